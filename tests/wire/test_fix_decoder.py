"""The one-pass fix decoder (``decode_fix``, msgspec) against the full path (``parse_json_object``
then ``parse_fix``): whatever the decoder accepts, the full path accepts with the same three
float64 values; whatever the full path refuses, the decoder refuses too (the door then takes the
full path, which names the reason). Named cases first, then Hypothesis over bodies built from
the fields a fix has, the ones it must not have, and the values JSON can carry."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.wire.payloads import InvalidInput, decode_fix, parse_fix, parse_json_object


def _full_path(body: bytes) -> tuple[float, float, float] | None:
    try:
        fix, _ = parse_fix(parse_json_object(body))
    except InvalidInput:  # MalformedJson included
        return None
    return fix.t, fix.lat, fix.lon


def _bits(values: tuple[float, float, float]) -> bytes:
    return struct.pack("<3d", *values)  # -0.0 and 0.0 differ, as they do on the wire


def _agree(body: bytes) -> bool:
    """Checks the agreement on ``body``; True when the decoder accepted it."""
    fast = decode_fix(body)
    full = _full_path(body)
    if fast is None:
        return False
    assert full is not None, body
    assert _bits((fast.t, fast.lat, fast.lon)) == _bits(full), body
    return True


ACCEPTED = [
    b'{"t": 1700000000.25, "lat": 39.9, "lon": 116.4}',
    b'{"lon":-180,"lat":90,"t":0}',
    b'{"t":-0.0,"lat":-90.0,"lon":180}',
    b' \n\t{"t":1E3,"lat":1e-320,"lon":2.5E+1}\r\n',
    b'{"t":1,"t":2,"lat":3,"lon":4}',  # a repeated key: the last value in both
    b'{"l\\u0061t":1,"t":2,"lon":3}',  # an escaped key
    b'{"t":1,"lat":39.912345678901234567890123,"lon":116.4}',
]
REFUSED = [
    b"\xef\xbb\xbf" + ACCEPTED[0],  # byte order mark
    b'{"t":NaN,"lat":1,"lon":2}',
    b'{"t":Infinity,"lat":1,"lon":2}',
    b'{"t":1e400,"lat":1,"lon":2}',  # beyond float64: inf in json, refused by parse_fix
    b'{"t":' + b"9" * 400 + b',"lat":1,"lon":2}',
    b'{"t":true,"lat":1,"lon":2}',
    b'{"t":"1","lat":1,"lon":2}',
    b'{"t":null,"lat":1,"lon":2}',
    b'{"t":1,"lat":90.0000001,"lon":2}',
    b'{"t":1,"lat":1,"lon":-180.5}',
    b'{"t":-1,"lat":1,"lon":2}',
    b'{"t":1,"lat":1}',
    b'{"t":1,"lat":1,"lon":2,"user":"alice"}',  # a single fix has no user
    b'{"t":1,"lat":1,"lon":2,"x":null}',
    b"[1,2,3]",
    b'{"t":1,"lat":1,"lon":2}x',
    b'{"t":1,"lat":1,"lon":2,}',
    b'{"t":01,"lat":1,"lon":2}',
    b'{"t":1,"lat":1,"lon":2}\x00',
    b'{"t":1,"lat":1,"lon":"\xff"}',
    b"",
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_decoder_accepts_what_the_full_path_accepts_with_the_same_values(body: bytes) -> None:
    assert _agree(body)


@pytest.mark.parametrize("body", REFUSED)
def test_decoder_refuses_what_the_full_path_refuses_or_reads_differently(body: bytes) -> None:
    assert decode_fix(body) is None
    _agree(body)


_NUMBER = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.sampled_from(["1e400", "-1e400", "1e-400", "9" * 320, "NaN", "Infinity", "-0", "0.0", "90", "180.0000000001"]),
    st.floats(min_value=-200, max_value=200).map(lambda f: f"{f:.17e}"),
)
_VALUE = st.one_of(_NUMBER, st.sampled_from(["true", "false", "null", '"1"', "[]", "{}", '"x"']))
_KEY = st.sampled_from(["t", "lat", "lon", "t", "lat", "lon", "user", "T", "lat ", "l\\u0061t"])


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    pairs = draw(st.lists(st.tuples(_KEY, _VALUE), max_size=5))
    text = "{" + ",".join(f'"{k}":{v}' for k, v in pairs) + "}"
    if draw(st.booleans()):  # plenty of well-formed fixes, so the fast path is exercised
        text = json.dumps(
            {"t": draw(st.floats(0, 2e9)), "lat": draw(st.floats(-90, 90)), "lon": draw(st.floats(-180, 180))}
        )
    return text.encode()


@settings(max_examples=600, deadline=None)
@given(_bodies())
def test_decoder_and_full_path_agree_on_generated_bodies(body: bytes) -> None:
    _agree(body)
