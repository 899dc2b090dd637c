"""Strict parsing of everything apps send (contract §0, §1, §3): JSON, ids, fixes, queries.

Pure functions, shared by the MQTT and HTTP doors. Errors are :class:`InvalidInput` carrying
the contract reason code and the offending field; messages name the field and the rule and
never echo the submitted value.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kcloak.core.errors import InputError
from kcloak.core.profile import PROFILE_FIELDS, ReasonCode
from kcloak.wire.errors import WireError

# Every identifier pattern ends in \Z: Python's ``$`` also matches before a final newline, which
# would make "alice\n" a user id of its own. Use them with ``.match`` or ``.fullmatch``.
USER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
QUERY_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}\Z")
SESSION_ID_RE = re.compile(r"^[0-9a-f]{32}\Z")
# No control characters (C0, DEL, C1) and no lone surrogates (not text: they cannot be encoded).
CATEGORY_RE = re.compile(r"^[^\x00-\x1f\x7f-\x9f\ud800-\udfff]{1,64}\Z")
ASCII_INT_RE = re.compile(r"^[0-9]{1,19}\Z")
USER_ID_RULE = "user: must be 1-64 characters of [A-Za-z0-9._-], starting with a letter or digit"
MAX_DEPTH = 16
MAX_KNN_N = 100
MAX_RADIUS_M = 50_000.0


class InvalidInput(WireError, InputError, ValueError):
    """Input refused with a contract reason code (``invalid``, ``too_large``, …)."""

    def __init__(self, message: str, *, field: str | None = None, code: ReasonCode = ReasonCode.INVALID) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class MalformedJson(InvalidInput):
    """The payload is not a JSON object we accept (metric label ``malformed_json`` on MQTT)."""


def _reject_constant(name: str) -> Any:
    raise MalformedJson(f"JSON: {name} is not allowed")


MAX_INT_DIGITS = 300
"""Longest JSON integer literal decoded as an ``int``; longer ones become a float (±inf beyond
about 309 digits). No field can hold such a number: field checks then refuse it ``invalid``
(out of range, not finite, not an integer) instead of Python's int-string conversion limit
(4,300 digits) raising, or ``float()`` overflowing on an int of a few hundred digits."""


def _parse_int(text: str) -> int | float:
    if len(text) > MAX_INT_DIGITS:
        return float(text)
    return int(text)


# One decoder for every body: ``json.loads`` with keyword arguments builds a new decoder per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_int=_parse_int)


def _depth(obj: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in o)
    return True


def parse_json_object(payload: bytes | str) -> dict[str, Any]:
    """Parse a request body: UTF-8 JSON, top level an object, no NaN/Infinity, depth ≤ 16.

    Raises :class:`MalformedJson` for anything that does not parse, whatever the reason. An
    integer too long to be any field's value parses (see :data:`MAX_INT_DIGITS`) and is then
    refused ``invalid`` by the field's own check.
    """
    if isinstance(payload, bytes):
        if payload.startswith(b"\xef\xbb\xbf"):
            raise MalformedJson("JSON: a byte order mark is not allowed")
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedJson("JSON: body must be UTF-8") from None
    else:
        text = payload
    try:
        obj = _DECODER.decode(text)
    except MalformedJson:
        raise
    except (ValueError, RecursionError, OverflowError, MemoryError):  # any failure to parse
        raise MalformedJson("JSON: body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise MalformedJson("JSON: the top level must be an object")
    # Nesting needs brackets: a text with few of them (every usual body) cannot be too deep.
    if text.count("{") + text.count("[") > MAX_DEPTH and not _depth(obj, MAX_DEPTH):
        raise MalformedJson(f"JSON: nesting deeper than {MAX_DEPTH} levels")
    return obj


def valid_user_id(user: str) -> bool:
    return bool(USER_ID_RE.match(user))


def ascii_int(text: str) -> int | None:
    """A query-string or header integer: 1-19 ASCII digits only, else ``None``.

    ``int()`` alone would take "٣", "1_000", " 5", "+5" and "5\n"; ``str.isdigit()`` takes "²",
    which ``int()`` then refuses with a ValueError.
    """
    return int(text) if ASCII_INT_RE.match(text) else None


def valid_query_id(qid: object) -> bool:
    return isinstance(qid, str) and bool(QUERY_ID_RE.match(qid))


def _number(obj: dict[str, Any], name: str) -> float:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidInput(f"{name}: must be a number", field=name)
    try:
        f = float(v)
    except OverflowError:  # an int beyond the float range
        raise InvalidInput(f"{name}: must be finite", field=name) from None
    if not math.isfinite(f):
        raise InvalidInput(f"{name}: must be finite", field=name)
    return f


def _integer(obj: dict[str, Any], name: str) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInput(f"{name}: must be an integer", field=name)
    return v


def _no_unknown(obj: dict[str, Any], allowed: frozenset[str], where: str = "") -> None:
    for key in obj:
        if key not in allowed:
            raise InvalidInput(f"{where}unknown field", field=str(key)[:64])


class Fix(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A location fix that passed the type and range rules (rule 1 of contract §1).

    Also the type :func:`decode_fix` decodes a single-fix body into: the bounds below are checked
    only when decoding (constructing a Fix checks nothing)."""

    t: Annotated[float, msgspec.Meta(ge=0)]
    lat: Annotated[float, msgspec.Meta(ge=-90.0, le=90.0)]
    lon: Annotated[float, msgspec.Meta(ge=-180.0, le=180.0)]


_FIX_DECODER = msgspec.json.Decoder(Fix)


def decode_fix(payload: bytes) -> Fix | None:
    """The fix of a single-fix body (``{"t", "lat", "lon"}``) decoded and checked in one pass by
    msgspec, or None when msgspec refuses it for any reason. It accepts only bodies that
    :func:`parse_json_object` and :func:`parse_fix` accept, with the same values (msgspec refuses a
    byte order mark, NaN, numbers beyond the float range, booleans, unknown fields; a repeated key
    takes its last value in both), so None means: take that full path, which names the exact
    reason (``malformed_json`` or ``invalid`` and its field). ``tests/wire/test_fix_decoder.py``
    holds the two to agreement."""
    try:
        return _FIX_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


_FIX_FIELDS = frozenset({"t", "lat", "lon"})
_BATCH_ITEM_FIELDS = frozenset({"t", "lat", "lon", "user"})


def parse_fix(obj: object, *, allow_user: bool = False) -> tuple[Fix, str | None]:
    """Check a fix object's types and ranges; returns the fix and its optional ``user``."""
    if not isinstance(obj, dict):
        raise InvalidInput("fix: must be an object", field="fix")
    _no_unknown(obj, _BATCH_ITEM_FIELDS if allow_user else _FIX_FIELDS)
    for name in ("t", "lat", "lon"):
        if name not in obj:
            raise InvalidInput(f"{name}: required", field=name)
    t = _number(obj, "t")
    lat = _number(obj, "lat")
    lon = _number(obj, "lon")
    if not -90.0 <= lat <= 90.0:
        raise InvalidInput("lat: must be within [-90, 90]", field="lat")
    if not -180.0 <= lon <= 180.0:
        raise InvalidInput("lon: must be within [-180, 180]", field="lon")
    if t < 0:
        raise InvalidInput("t: must be a Unix time ≥ 0", field="t")
    user = obj.get("user")
    if user is not None and (not isinstance(user, str) or not valid_user_id(user)):
        raise InvalidInput("user: must be a valid user id", field="user")
    return Fix(t, lat, lon), user


QUERY_KINDS = ("range", "knn")
_QUERY_FIELDS = frozenset(
    {"query_id", "kind", "radius_m", "n", "category", "lat", "lon", "t", "profile", "continuous", "session_id", "stop"}
)


@dataclass(frozen=True, slots=True)
class Query:
    """A query after schema checks (contract §3); the profile override is checked later."""

    query_id: str
    kind: str | None
    radius_m: float | None
    n: int | None
    category: str | None
    fix: Fix | None
    profile: dict[str, Any] | None
    continuous: bool
    session_id: str | None
    stop: bool

    @property
    def metric_kind(self) -> str:
        if self.stop:
            return "stop"
        return self.kind if self.kind in QUERY_KINDS else "unknown"


def parse_query(obj: dict[str, Any]) -> Query:
    """Validate a query object; raises :class:`InvalidInput` (``query_id`` is checked first)."""
    qid = obj.get("query_id")
    if not valid_query_id(qid):
        raise InvalidInput("query_id: required, 1-64 chars of [A-Za-z0-9._:-]", field="query_id")
    assert isinstance(qid, str)
    _no_unknown(obj, _QUERY_FIELDS)
    continuous = obj.get("continuous", False)
    stop = obj.get("stop", False)
    if not isinstance(continuous, bool):
        raise InvalidInput("continuous: must be a boolean", field="continuous")
    if not isinstance(stop, bool):
        raise InvalidInput("stop: must be a boolean", field="stop")
    session_id = obj.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not SESSION_ID_RE.match(session_id)):
        raise InvalidInput("session_id: must be 32 lowercase hex characters", field="session_id")
    if continuous and session_id is not None:
        raise InvalidInput("continuous: not allowed with session_id", field="continuous")
    if stop and session_id is None:
        raise InvalidInput("stop: requires session_id", field="stop")
    kind = obj.get("kind")
    if kind is not None and kind not in QUERY_KINDS:
        raise InvalidInput("kind: must be range or knn", field="kind")
    if kind is None and session_id is None:
        raise InvalidInput("kind: required", field="kind")
    radius: float | None = None
    n: int | None = None
    if "radius_m" in obj:
        if kind != "range":
            raise InvalidInput("radius_m: only for kind range", field="radius_m")
        radius = _number(obj, "radius_m")
        if not 0 < radius <= MAX_RADIUS_M:
            raise InvalidInput("radius_m: must be within (0, 50000]", field="radius_m")
    elif kind == "range" and session_id is None:
        raise InvalidInput("radius_m: required for kind range", field="radius_m")
    if "n" in obj:
        if kind != "knn":
            raise InvalidInput("n: only for kind knn", field="n")
        n = _integer(obj, "n")
        if not 1 <= n <= MAX_KNN_N:
            raise InvalidInput("n: must be within [1, 100]", field="n")
    elif kind == "knn" and session_id is None:
        raise InvalidInput("n: required for kind knn", field="n")
    category = obj.get("category")
    if category is not None and (not isinstance(category, str) or not CATEGORY_RE.match(category)):
        raise InvalidInput("category: must be 1-64 characters, no control characters", field="category")
    present = [name for name in ("lat", "lon", "t") if name in obj]
    fix: Fix | None = None
    if present:
        if len(present) != 3:
            missing = next(name for name in ("lat", "lon", "t") if name not in obj)
            raise InvalidInput("lat, lon, t: give all three or none", field=missing)
        fix, _ = parse_fix({k: obj[k] for k in ("t", "lat", "lon")})
    profile = obj.get("profile")
    if profile is not None:
        if not isinstance(profile, dict):
            raise InvalidInput("profile: must be an object", field="profile")
        _no_unknown(profile, frozenset(PROFILE_FIELDS), "profile: ")
        if session_id is not None:
            raise InvalidInput("profile: not allowed on a session refresh", field="profile")
    return Query(qid, kind, radius, n, category, fix, profile, continuous, session_id, stop)
