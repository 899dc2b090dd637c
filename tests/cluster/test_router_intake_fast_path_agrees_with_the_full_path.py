"""The router's one-pass reading of a fix intake message (msgspec: a gateway ``batch`` envelope whose ``update``
bodies ``decode_fix`` decodes, or a single ``update``) against the full path it replaces when it can (stdlib JSON
with the depth check, each app message's fixes, ``parse_fix``): whatever the fast path accepts, the full path
accepts with the same users and the same float64 values, in the same order; a message the fast path does not
take (an ``updates`` message, a fix it refuses, a broken envelope) goes the full way. No NATS needed: this is
the pure parsing step, and the cluster tests drive the router itself."""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.broker.cluster.router import _decoded_fixes, _message_fixes
from kcloak.core.profile import ReasonCode
from kcloak.wire.payloads import InvalidInput, parse_fix, parse_json_object


def _full_path(kind: str, token: str, data: bytes) -> list[tuple[str, bytes] | str]:
    """Each fix of the message as (user, its three float64s) or the reason it is refused, as the full path reads it."""
    try:
        obj = parse_json_object(data)
    except InvalidInput:
        return ["invalid message"]
    if kind == "batch":
        parts = obj.get("batch")
        messages = parts if isinstance(parts, list) else [None]
    else:
        messages = [{"user": token, "kind": kind, "body": obj}]
    out: list[tuple[str, bytes] | str] = []
    for part in messages:
        for item in _message_fixes(part):
            if isinstance(item, ReasonCode):
                out.append(item.value)
                continue
            try:
                fix, _ = parse_fix(item[1])
            except InvalidInput:
                out.append("invalid fix")
                continue
            out.append((item[0], struct.pack("<3d", fix.t, fix.lat, fix.lon)))
    return out


def _agree(kind: str, token: str, data: bytes) -> bool:
    fast = _decoded_fixes(kind, token, data)
    if fast is None:
        return False
    expected = [(user, struct.pack("<3d", f.t, f.lat, f.lon)) for user, f in fast]
    assert _full_path(kind, token, data) == expected, data
    return True


def _batch(parts: list[dict[str, Any]]) -> bytes:
    return json.dumps({"batch": parts}, separators=(",", ":")).encode()


def test_named_messages() -> None:
    good = {"t": 1764200000.5, "lat": 39.9, "lon": 116.4}
    assert _agree("update", "alice", json.dumps(good).encode())
    assert _agree("batch", "a", _batch([{"user": "a", "kind": "update", "body": good}] * 3))
    # what the fast path leaves to the full path
    assert not _agree("update", "alice", json.dumps({**good, "lat": 91}).encode())
    assert not _agree("update", "alice", b'{"t": 1, "lat": NaN, "lon": 0}')
    assert not _agree("batch", "a", _batch([{"user": "a", "kind": "updates", "body": {"updates": [good]}}]))
    assert not _agree("batch", "a", _batch([{"user": "a", "kind": "update", "body": {**good, "x": 1}}]))
    assert not _agree("batch", "a", _batch([{"user": "a", "kind": "update", "body": [1, 2]}]))
    assert not _agree("batch", "a", b'{"batch": {"user": "a"}}')
    assert not _agree("batch", "a", b'\xef\xbb\xbf{"batch": []}')
    assert not _agree("query", "a", json.dumps(good).encode())


_numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.sampled_from([0, -0.0, 90, -90, 180, -180, 90.0000001, True, None, "1"]),
)
_bodies = st.one_of(
    st.fixed_dictionaries({"t": _numbers, "lat": _numbers, "lon": _numbers}),
    st.dictionaries(st.sampled_from(["t", "lat", "lon", "user", "x"]), _numbers, max_size=4),
)
_parts = st.fixed_dictionaries(
    {
        "user": st.sampled_from(["a", "b//c", "u1"]),
        "kind": st.sampled_from(["update", "update", "updates"]),
        "body": _bodies,
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_parts, min_size=1, max_size=6))
def test_batches_agree(parts: list[dict[str, Any]]) -> None:
    _agree("batch", parts[0]["user"], _batch(parts))


@settings(max_examples=300, deadline=None)
@given(_bodies)
def test_single_updates_agree(body: dict[str, Any]) -> None:
    _agree("update", "alice", json.dumps(body).encode())
