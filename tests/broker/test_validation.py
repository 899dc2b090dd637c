"""Strict input parsing shared by the MQTT and HTTP doors (contract §0, §1, §3)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcloak.broker.publication import Window
from kcloak.core.profile import PrivacyProfile, ProfileError, ReasonCode
from kcloak.streams.quality import PUBLISHED_ID
from kcloak.wire.payloads import (
    CATEGORY_RE,
    SESSION_ID_RE,
    InvalidInput,
    MalformedJson,
    ascii_int,
    parse_fix,
    parse_json_object,
    parse_query,
    valid_query_id,
    valid_user_id,
)
from kcloak.wire.tokens import HEX64_RE, TOKEN_RE


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


@pytest.mark.parametrize("digits", [5000, 4301, 400, 310, 301])
def test_huge_integer_parses_and_is_invalid_for_its_field(digits: int) -> None:
    """Python refuses int literals of > 4,300 digits (ValueError) and a float() of an int beyond
    ~309 digits overflows: either used to escape as a 500 / end the MQTT intake."""
    for sign in ("", "-"):
        body = parse_json_object(f'{{"t": 1, "lat": {sign}1{"0" * (digits - 1)}, "lon": 1}}'.encode())
        with pytest.raises(InvalidInput) as err:
            parse_fix(body)
        assert err.value.field == "lat" and not isinstance(err.value, MalformedJson)
        assert err.value.code is ReasonCode.INVALID
    query = parse_json_object(f'{{"query_id": "q1", "kind": "knn", "n": 1{"0" * (digits - 1)}}}')
    with pytest.raises(InvalidInput) as err:
        parse_query(query)
    assert err.value.field == "n"
    with pytest.raises(ProfileError) as perr:
        PrivacyProfile.from_mapping(parse_json_object(f'{{"max_delay_s": 1{"0" * (digits - 1)}}}'))
    assert perr.value.field == "max_delay_s"


def test_integers_up_to_300_digits_stay_integers() -> None:
    body = parse_json_object(f'{{"k": 1{"0" * 299}, "t": 17}}')
    assert body["k"] == 10**299 and isinstance(body["t"], int)
    with pytest.raises(InvalidInput) as err:
        parse_fix({"t": 1, "lat": 10**400, "lon": 1})  # an int from elsewhere than JSON
    assert err.value.field == "lat"


@pytest.mark.parametrize(
    "check",
    [
        lambda s: valid_user_id(s),
        lambda s: valid_query_id(s),
        lambda s: bool(SESSION_ID_RE.match(s)),
        lambda s: bool(CATEGORY_RE.match(s)),
        lambda s: bool(TOKEN_RE.match(s)),
        lambda s: bool(HEX64_RE.match(s)),
        lambda s: Window.parse(s) is not None,
        lambda s: bool(PUBLISHED_ID.match(s)),
    ],
    ids=["user", "query", "session", "category", "token", "hex64", "window", "published"],
)
def test_identifier_patterns_end_at_the_true_end(check: Any) -> None:
    """``$`` also matches before a final newline: "alice\\n" was a valid user id."""
    samples = ["alice", "q-1", "0" * 32, "cafe", "tok.A1", "a" * 64, "1714550400-1714551300", "0" * 16]
    good = [s for s in samples if check(s)]
    assert good, "the check accepts none of the samples"
    for s in good:
        assert not check(s + "\n") and not check(s + "\r\n") and not check(s + "\n\n")


def test_query_ids_sessions_and_categories_with_newline_are_invalid() -> None:
    base = {"query_id": "q1", "kind": "knn", "n": 1}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"query_id": "q1\n"}, "query_id"),
        ({"category": "cafe\n"}, "category"),
        ({"category": "caf\x85"}, "category"),  # C1 control
        ({"category": "caf\ud800"}, "category"),  # a lone surrogate is not text
        ({"session_id": "0" * 32 + "\n", "kind": None, "n": None}, "session_id"),
    ]
    for extra, field in cases:
        q = {k: v for k, v in {**base, **extra}.items() if v is not None}
        with pytest.raises(InvalidInput) as err:
            parse_query(q)
        assert err.value.field == field
    with pytest.raises(InvalidInput) as err:
        parse_fix({"t": 1, "lat": 0, "lon": 0, "user": "bob\n"}, allow_user=True)
    assert err.value.field == "user"
    assert parse_query({**base, "category": "café ☕"}).category == "café ☕"


@pytest.mark.parametrize("text", ["²", "٣", "５", "①", "1_000", "+5", " 5", "5 ", "5\n", "", "-1", "1" * 20, "0x10"])
def test_ascii_int_takes_plain_ascii_digits_only(text: str) -> None:
    assert ascii_int(text) is None


def test_ascii_int_values() -> None:
    assert ascii_int("0") == 0 and ascii_int("0042") == 42 and ascii_int("9" * 19) == 10**19 - 1
