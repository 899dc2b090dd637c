"""The published payload schemas (kcloak.wire.schemas) and the validators (kcloak.wire.payloads,
kcloak.core.profile) accept exactly the same requests: a table of named cases, then Hypothesis.

Two readings are fixed here, both as JSON Schema specifies and both stated in the schemas'
module documentation: a pattern is an ECMA-262 regular expression (``$`` is the end of the text,
not "before a final newline" as in Python's ``re``), and an integer field takes a JSON integer
literal (``5.0`` is refused, as the contract says). The one rule left to the descriptions,
``min_area_m2`` ≤ ``max_area_m2``, is not generated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.core.profile import MAX_AREA_CAP_M2, PrivacyProfile, ProfileError
from kcloak.wire import schemas
from kcloak.wire.payloads import InvalidInput, parse_fix, parse_query


def _ecma_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    if isinstance(instance, str) and not re.search(re.sub(r"\$$", r"\\Z", pattern), instance):
        yield jsonschema.ValidationError(f"does not match {pattern}")


def _json_integer(checker: Any, instance: object) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


_CACHE: dict[int, list[jsonschema.protocols.Validator]] = {}


def _validators(schema: schemas.Schema) -> list[jsonschema.protocols.Validator]:
    if id(schema) in _CACHE:
        return _CACHE[id(schema)]
    out: list[jsonschema.protocols.Validator] = []
    for base in (jsonschema.Draft7Validator, jsonschema.Draft202012Validator):  # AsyncAPI 3, OpenAPI 3.1
        base.check_schema(schema)
        checker = base.TYPE_CHECKER.redefine("integer", _json_integer)
        cls = jsonschema.validators.extend(base, {"pattern": _ecma_pattern}, type_checker=checker)
        out.append(cls(schema))
    _CACHE[id(schema)] = out
    return out


def _schema_accepts(schema: schemas.Schema, obj: object) -> bool:
    verdicts: set[bool] = {bool(v.is_valid(obj)) for v in _validators(schema)}
    assert len(verdicts) == 1, "draft-07 and 2020-12 read the schema differently"
    return verdicts.pop()


_PERMISSIVE = PrivacyProfile(min_area_m2=0.0, max_area_m2=MAX_AREA_CAP_M2)


def _accepts(check: Callable[[Any], object], obj: object) -> bool:
    try:
        check(obj)
    except (InvalidInput, ProfileError):
        return False
    return True


def _check_query(obj: Any) -> None:
    q = parse_query(obj)
    if q.profile is not None:  # its bounds are checked when the query runs, still `invalid`
        PrivacyProfile.from_mapping(q.profile, _PERMISSIVE)


KINDS: dict[str, tuple[schemas.Schema, Callable[[Any], object]]] = {
    "fix": (schemas.FIX, parse_fix),
    "batch_item": (schemas.BATCH_ITEM, lambda o: parse_fix(o, allow_user=True)),
    "profile": (schemas.PROFILE, lambda o: PrivacyProfile.from_mapping(o, _PERMISSIVE)),
    "query": (schemas.QUERY, _check_query),
}
SID = "0123456789abcdef0123456789abcdef"
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("fix", {"t": 1.5, "lat": 39.9, "lon": 116.4}, True),
    ("fix", {"t": 1, "lat": 90, "lon": -180}, True),
    ("fix", {"t": 1, "lat": 90.0001, "lon": 0}, False),
    ("fix", {"t": -1, "lat": 0, "lon": 0}, False),
    ("fix", {"t": 1, "lat": True, "lon": 0}, False),
    ("fix", {"t": 1, "lat": "1", "lon": 0}, False),
    ("fix", {"t": 1, "lat": 0}, False),
    ("fix", {"t": 1, "lat": 0, "lon": 0, "user": "alice"}, False),
    ("batch_item", {"t": 1, "lat": 0, "lon": 0, "user": "alice"}, True),
    ("batch_item", {"t": 1, "lat": 0, "lon": 0, "user": "alice\n"}, False),
    ("batch_item", {"t": 1, "lat": 0, "lon": 0, "user": "_kcloak"}, False),
    ("profile", {"k": 10, "max_area_m2": 2e6}, True),
    ("profile", {"k": 10.0}, False),
    ("profile", {"k": 0}, False),
    ("profile", {"max_area_m2": 0}, False),
    ("profile", {"max_delay_s": 600}, True),
    ("profile", {"colour": "red"}, False),
    ("query", {"query_id": "q1", "kind": "knn", "n": 5}, True),
    ("query", {"query_id": "q1", "kind": "knn", "n": 5.0}, False),
    ("query", {"query_id": "q1", "kind": "knn", "n": 101}, False),
    ("query", {"query_id": "q1", "kind": "knn"}, False),
    ("query", {"query_id": "q1", "kind": "range", "radius_m": 50000}, True),
    ("query", {"query_id": "q1", "kind": "range", "radius_m": 0}, False),
    ("query", {"query_id": "q1", "kind": "range", "n": 3, "radius_m": 1}, False),
    ("query", {"query_id": "q1\n", "kind": "knn", "n": 5}, False),
    ("query", {"query_id": "q1", "kind": "knn", "n": 5, "lat": 1, "lon": 1}, False),
    ("query", {"query_id": "q1", "kind": "knn", "n": 5, "lat": 1, "lon": 1, "t": 5}, True),
    ("query", {"query_id": "q1", "kind": "knn", "n": 5, "category": "a\x00b"}, False),
    ("query", {"query_id": "q1", "kind": "knn", "n": 5, "profile": {"k": 0}}, False),
    ("query", {"query_id": "q1", "kind": "knn", "n": 5, "continuous": True}, True),
    ("query", {"query_id": "q1", "session_id": SID}, True),
    ("query", {"query_id": "q1", "session_id": SID, "stop": True}, True),
    ("query", {"query_id": "q1", "stop": True, "kind": "knn", "n": 1}, False),
    ("query", {"query_id": "q1", "session_id": SID, "continuous": True}, False),
    ("query", {"query_id": "q1", "session_id": SID, "profile": {}}, False),
    ("query", {"query_id": "q1", "session_id": SID, "n": 3}, False),
    ("query", {"query_id": "q1", "session_id": SID, "kind": "range"}, True),
    ("query", {"query_id": "q1", "session_id": SID.upper()}, False),
]


@pytest.mark.parametrize("kind, obj, valid", CASES)
def test_schema_and_validator_agree_on_named_cases(kind: str, obj: dict[str, Any], valid: bool) -> None:
    schema, check = KINDS[kind]
    assert _accepts(check, obj) is valid
    assert _schema_accepts(schema, obj) is valid


_ids = st.sampled_from(["q1", "Q.2:x-y_z", "a" * 64, "a" * 65, "", "q 1", "q1\n", "é", "-lead", "_svc"])
_numbers = st.one_of(
    st.integers(-200, 200_000),
    st.floats(-1e10, 1e10, allow_nan=False),
    st.sampled_from([0, 1, 5.0, 90, 90.5, -180, 180.0, 1000, 1001, 50_000, 50_000.5, 2.5e9, 2.6e9, 600, 600.1]),
)
_junk: st.SearchStrategy[Any] = st.sampled_from([None, True, False, "5", [], {}, "knn"])
_values = st.one_of(_numbers, _junk)
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "t": st.one_of(_numbers, _junk),
    "lat": st.one_of(st.floats(-91, 91, allow_nan=False), _values),
    "lon": st.one_of(st.floats(-181, 181, allow_nan=False), _values),
    "user": st.one_of(_ids, _junk),
    "query_id": st.one_of(_ids, _junk),
    "kind": st.one_of(st.sampled_from(["range", "knn", "nearest"]), _junk),
    "radius_m": _values,
    "n": _values,
    "category": st.one_of(st.sampled_from(["food", "", "a\x00", "x" * 65, "é" * 64, "a\x85b"]), _junk),
    "continuous": st.one_of(st.booleans(), _junk),
    "stop": st.one_of(st.booleans(), _junk),
    "session_id": st.one_of(st.sampled_from([SID, SID[:-1], SID.upper(), SID + "\n"]), _junk),
    "k": _values,
    "l": _values,
    "min_area_m2": _values,
    "max_area_m2": _values,
    "max_delay_s": _values,
    "extra": _values,
}
_profile_keys = ["k", "l", "min_area_m2", "max_area_m2", "max_delay_s"]
_KEYS = {
    "fix": ["t", "lat", "lon", "extra"],
    "batch_item": ["t", "lat", "lon", "user", "extra"],
    "profile": [*_profile_keys, "extra"],
    "query": [*(k for k in _FIELDS if k not in (*_profile_keys, "user")), "profile", "continuous", "stop"],
}


_TEMPLATES: dict[str, list[dict[str, Any]]] = {
    "fix": [{"t": 1.5, "lat": 39.9, "lon": 116.4}],
    "batch_item": [{"t": 1, "lat": 0, "lon": 0, "user": "alice"}, {"t": 1, "lat": 0, "lon": 0}],
    "profile": [{"k": 10, "max_area_m2": 2e6}, {}, {"l": 2, "min_area_m2": 0, "max_delay_s": 10}],
    "query": [
        {"query_id": "q1", "kind": "knn", "n": 5},
        {"query_id": "q1", "kind": "range", "radius_m": 500, "category": "food", "lat": 1, "lon": 2, "t": 3},
        {"query_id": "q1", "kind": "knn", "n": 5, "continuous": True, "profile": {"k": 7}},
        {"query_id": "q1", "session_id": SID},
        {"query_id": "q1", "session_id": SID, "stop": True},
    ],
}


def _objects(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid object of ``kind`` with 0-3 edits (a field set to any value, removed, or added):
    most examples sit next to the boundary between valid and invalid, where a drift shows."""

    def build(template: dict[str, Any], edits: list[tuple[str, int]], data: st.DataObject) -> dict[str, Any]:
        obj = dict(template)
        for key, action in edits:
            if action == 0:
                obj.pop(key, None)
            elif key == "profile":
                obj[key] = data.draw(st.one_of(_objects("profile"), _junk))
            else:
                obj[key] = data.draw(_FIELDS[key])
        return obj

    edit = st.tuples(st.sampled_from(_KEYS[kind]), st.integers(0, 2))
    return st.builds(build, st.sampled_from(_TEMPLATES[kind]), st.lists(edit, max_size=3), st.data()).filter(
        lambda o: not _crossed_areas(o)
    )


def _crossed_areas(obj: dict[str, Any]) -> bool:
    profile = obj.get("profile")
    inner: dict[str, Any] = profile if isinstance(profile, dict) else obj
    lo, hi = inner.get("min_area_m2"), inner.get("max_area_m2")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi))
    return numbers and lo > hi  # type: ignore[operator]


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_schema_accepts_exactly_what_the_validator_accepts(kind: str, data: st.DataObject) -> None:
    obj = data.draw(_objects(kind))
    schema, check = KINDS[kind]
    assert _schema_accepts(schema, obj) == _accepts(check, obj), obj
