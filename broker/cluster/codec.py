"""JSON of the cluster's own messages (fix path: cell events, moves, intake envelopes; query path: routed queries,
answers), with msgspec.

The same JSON values as ``json.dumps(obj, separators=(",", ":"))`` and ``json.loads`` (numbers may be spelt
differently, e.g. ``1e16`` for ``1e+16``; every reader parses JSON), at a fraction of the CPU: these run once
per fix in the router and the owner. What apps send is still parsed at the doors by
:mod:`kcloak.wire.payloads`; a gateway's ``batch`` envelope is decoded here, and anything this fast path
refuses goes the full way (:func:`kcloak.wire.payloads.parse_json_object`), which names the reason.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def encode(obj: Any) -> bytes:
    """Compact JSON of ``obj`` (dicts, lists, str, int, float, bool, None)."""
    return _ENCODER.encode(obj)


def decode(data: bytes) -> Any:
    """The JSON value of ``data``; raises ValueError (``msgspec.DecodeError``) when it is not JSON."""
    return _DECODER.decode(data)


def encode_any(obj: Any) -> bytes:
    """:func:`encode`, or the standard library's compact JSON for what msgspec cannot write (an integer beyond
    64 bits from an app's query, a float that is not finite): for messages that carry what an app sent."""
    try:
        return _ENCODER.encode(obj)
    except (msgspec.MsgspecError, TypeError, OverflowError):
        return json.dumps(obj, separators=(",", ":")).encode()


def decode_any(data: bytes) -> Any:
    """:func:`decode`, or the standard library's for a number msgspec refuses (an integer beyond 64 bits); raises
    ValueError when ``data`` is not JSON."""
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError:
        return json.loads(data)


class BatchPart(msgspec.Struct, gc=False):
    """One app message of a gateway's ``batch`` intake message; ``body`` kept as its raw JSON."""

    user: str
    kind: str
    body: msgspec.Raw


class BatchEnvelope(msgspec.Struct, gc=False):
    """A gateway's ``batch`` intake message: ``{"batch": [{"user", "kind", "body"}, …]}``."""

    batch: list[BatchPart]


_BATCH_DECODER = msgspec.json.Decoder(BatchEnvelope)


def decode_batch(data: bytes) -> BatchEnvelope | None:
    """The envelope of a ``batch`` intake message, or None when msgspec refuses it (then take the full path)."""
    try:
        return _BATCH_DECODER.decode(data)
    except msgspec.DecodeError:
        return None


__all__ = ["BatchEnvelope", "BatchPart", "decode", "decode_any", "decode_batch", "encode", "encode_any"]
