"""Strict input parsing shared by the MQTT and HTTP doors (contract §0, §1, §3)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.validation import InvalidInput, MalformedJson, parse_fix, parse_json_object, parse_query, valid_user_id


@pytest.mark.parametrize(
    "payload",
    [b"[1]", b"nope", b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b"\xef\xbb\xbf{}", b"\xff\xfe", b""],
)
def test_malformed_json_is_refused(payload: bytes) -> None:
    with pytest.raises(MalformedJson):
        parse_json_object(payload)


def test_nesting_limit() -> None:
    ok: Any = {}
    for _ in range(15):
        ok = {"a": ok}
    assert parse_json_object(json.dumps(ok))
    with pytest.raises(MalformedJson):
        parse_json_object(json.dumps({"a": ok}))
    with pytest.raises(MalformedJson):
        parse_json_object("[" * 100000 + "]" * 100000)


@pytest.mark.parametrize(
    ("fix", "field"),
    [
        ({"t": 1, "lat": 91, "lon": 0}, "lat"),
        ({"t": 1, "lat": 0, "lon": -180.5}, "lon"),
        ({"t": 1, "lat": "1", "lon": 0}, "lat"),
        ({"t": True, "lat": 0, "lon": 0}, "t"),
        ({"t": 1, "lat": 0}, "lon"),
        ({"t": 1, "lat": 0, "lon": 0, "x": 1}, "x"),
    ],
)
def test_bad_fixes_name_the_field(fix: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_fix(fix)
    assert err.value.field == field


def test_good_fix_and_batch_user() -> None:
    fix, user = parse_fix({"t": 1714550412.25, "lat": 90, "lon": -180})
    assert (fix.lat, fix.lon, user) == (90.0, -180.0, None)
    _, user = parse_fix({"t": 1, "lat": 0, "lon": 0, "user": "bob"}, allow_user=True)
    assert user == "bob"
    with pytest.raises(InvalidInput):
        parse_fix({"t": 1, "lat": 0, "lon": 0, "user": "bob"})


def test_contract_query_example_parses() -> None:
    q = parse_query(
        {
            "query_id": "q-000017",
            "kind": "knn",
            "n": 5,
            "category": "restaurant",
            "lat": 39.908692,
            "lon": 116.397477,
            "t": 1714550412.25,
            "profile": {"k": 10},
        }
    )
    assert q.kind == "knn" and q.n == 5 and q.fix is not None and q.profile == {"k": 10}


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"query_id": "q1", "kind": "range"}, "radius_m"),
        ({"query_id": "q1", "kind": "range", "radius_m": 0}, "radius_m"),
        ({"query_id": "q1", "kind": "range", "radius_m": 50001}, "radius_m"),
        ({"query_id": "q1", "kind": "knn", "n": 5.0}, "n"),
        ({"query_id": "q1", "kind": "knn", "n": 101}, "n"),
        ({"query_id": "q1", "kind": "walk"}, "kind"),
        ({"query_id": "q1", "kind": "knn", "n": 1, "lat": 1}, "lon"),
        ({"query_id": "q1", "kind": "knn", "n": 1, "who": "me"}, "who"),
        ({"query_id": "q1", "kind": "knn", "n": 1, "profile": {"k": 3, "x": 1}}, "x"),
        ({"query_id": "bad id!", "kind": "knn", "n": 1}, "query_id"),
        ({"query_id": "q1", "session_id": "0" * 32, "profile": {"k": 3}}, "profile"),
        ({"query_id": "q1", "kind": "knn", "n": 1, "stop": True}, "stop"),
    ],
)
def test_bad_queries_name_the_field(query: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_query(query)
    assert err.value.field == field


@given(st.text(max_size=80))
def test_user_id_rule(user: str) -> None:
    ok = valid_user_id(user)
    expected = (
        1 <= len(user) <= 64 and user.isascii() and (user[0].isalnum()) and all(c.isalnum() or c in "._-" for c in user)
    )
    assert ok == expected


def test_error_messages_never_echo_values() -> None:
    with pytest.raises(InvalidInput) as err:
        parse_fix({"t": 1, "lat": 123.456789, "lon": 0})
    assert "123.456789" not in str(err.value)
