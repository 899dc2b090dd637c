"""JSON Schemas of every payload of the v1 interface: the one place they are written.

The OpenAPI document (``GET /v1/openapi.json``), the AsyncAPI 3 document of the MQTT interface
(``GET /v1/asyncapi.json``) and ``docs/interface.md`` all take their payload schemas from here,
and the bounds and identifier patterns come from the validators themselves
(:mod:`kcloak.wire.payloads`, :mod:`kcloak.core.profile`), so a schema cannot say one thing while
the broker checks another. ``tests/wire/test_schemas.py`` checks, example by example and with
Hypothesis, that a request the schema accepts is one the validator accepts and the other way round.

The schemas use only keywords that JSON Schema draft-07 (AsyncAPI 3's Schema Object) and 2020-12
(OpenAPI 3.1) read alike. Patterns are ECMA-262 regular expressions, as JSON Schema says: ``$``
is the end of the text (Python's ``re`` also lets ``$`` match before a final newline; the
validators use ``\\Z``).

Rules no JSON Schema can state are in the schema's ``description`` (``min_area_m2`` ≤
``max_area_m2``; a fix's time within the clock skew; a refresh's ``kind`` equal to its session's).
"""

from __future__ import annotations

import re
from typing import Any

from kcloak.core.profile import PROFILE_RULES
from kcloak.wire.payloads import (
    CATEGORY_RE,
    MAX_KNN_N,
    MAX_RADIUS_M,
    QUERY_ID_RE,
    QUERY_KINDS,
    SESSION_ID_RE,
    USER_ID_RE,
)

Schema = dict[str, Any]

MAX_BATCH_ITEMS = 10_000
"""Fixes in one batch (contract §1; ``[limits] batch_items``, the shipped default)."""


def ecma_pattern(regex: re.Pattern[str]) -> str:
    """A validator's pattern (``^…\\Z``) as a JSON Schema (ECMA-262) pattern (``^…$``)."""
    text = regex.pattern
    if not text.endswith("\\Z"):
        raise ValueError("validator patterns end in \\Z")
    return text[:-2] + "$"


USER_ID: Schema = {
    "type": "string",
    "pattern": ecma_pattern(USER_ID_RE),
    "description": "1-64 ASCII characters of [A-Za-z0-9._-], starting with a letter or digit",
}
QUERY_ID: Schema = {
    "type": "string",
    "pattern": ecma_pattern(QUERY_ID_RE),
    "description": "chosen by the client, unique per user for 10 minutes (a UUID or a counter)",
}
SESSION_ID: Schema = {"type": "string", "pattern": ecma_pattern(SESSION_ID_RE), "description": "set by the broker"}
CATEGORY: Schema = {
    "type": "string",
    "pattern": ecma_pattern(CATEGORY_RE),
    "description": "1-64 characters, no control characters; matched exactly against POI categories",
}
WINDOW_ID: Schema = {"type": "string", "pattern": "^[0-9]+-[0-9]+$", "description": "{t_start}-{t_end}"}
_NUM: Schema = {"type": "number"}
TIME: Schema = {"type": "number", "minimum": 0, "description": "Unix seconds UTC"}
LAT: Schema = {"type": "number", "minimum": -90, "maximum": 90, "description": "WGS84 degrees"}
LON: Schema = {"type": "number", "minimum": -180, "maximum": 180, "description": "WGS84 degrees"}

FIX: Schema = {
    "title": "Fix",
    "description": "One location fix. t must not be more than 5 s (max_clock_skew_s) ahead of the broker's "
    "clock; a fix older than 120 s is rejected too_old, one not newer than the user's last is out_of_order.",
    "type": "object",
    "additionalProperties": False,
    "required": ["t", "lat", "lon"],
    "properties": {"t": TIME, "lat": LAT, "lon": LON},
}
BATCH_ITEM: Schema = {
    **FIX,
    "title": "BatchFix",
    "description": "A fix of a batch; user defaults to the topic user (MQTT) or the token's user (HTTP with "
    "tokens) and is required per item on HTTP in open mode. Another user's fix is allowed only in open mode.",
    "properties": {
        **FIX["properties"],
        "user": {**USER_ID, "type": ["string", "null"], "description": "null is the same as leaving it out"},
    },
}
BATCH: Schema = {
    "title": "Batch",
    "description": "Fixes processed in order, each under the fix rules; a bad item does not spoil the rest.",
    "type": "object",
    "additionalProperties": False,
    "required": ["updates"],
    "properties": {"updates": {"type": "array", "maxItems": MAX_BATCH_ITEMS, "items": BATCH_ITEM}},
}


def _profile_field(name: str) -> Schema:
    integer, low, low_inclusive, high, _stricter_larger = PROFILE_RULES[name]
    field: Schema = {"type": "integer" if integer else "number"}
    field["minimum" if low_inclusive else "exclusiveMinimum"] = int(low) if integer else low
    field["maximum"] = int(high) if integer else high
    return field


PROFILE: Schema = {
    "title": "Profile",
    "description": "A privacy profile: any subset of the five fields (omitted ones take the server defaults "
    "when stored, the stored values in a query override). min_area_m2 must not exceed max_area_m2.",
    "type": "object",
    "additionalProperties": False,
    "properties": {name: _profile_field(name) for name in PROFILE_RULES},
}
PROFILE_FULL: Schema = {**PROFILE, "title": "EffectiveProfile", "required": list(PROFILE_RULES)}
PROFILE_MESSAGE: Schema = {
    "title": "ProfileMessage",
    "description": "Set the stored profile, or reset it to the server default with null.",
    "type": "object",
    "additionalProperties": False,
    "required": ["profile"],
    "properties": {"request_id": QUERY_ID, "profile": {"oneOf": [PROFILE, {"type": "null"}]}},
}


def _or_null(schema: Schema) -> Schema:
    """``schema`` or JSON ``null``, which the validators read as the field left out."""
    return {"anyOf": [schema, {"type": "null"}]}


_KIND: Schema = {"enum": list(QUERY_KINDS)}
_QUERY_PROPERTIES: Schema = {
    "query_id": QUERY_ID,
    "kind": _or_null(_KIND),
    "radius_m": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_RADIUS_M, "description": "kind range"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_KNN_N, "description": "kind knn"},
    "category": _or_null(CATEGORY),
    "lat": LAT,
    "lon": LON,
    "t": TIME,
    "profile": _or_null(PROFILE),
    "continuous": {"type": "boolean", "description": "start a session"},
    "session_id": _or_null(SESSION_ID),
    "stop": {"type": "boolean", "description": "stop the session session_id"},
}


def _requires(*names: str) -> Schema:
    return {"required": list(names)}


def _has(name: str) -> Schema:
    """``name`` is given and not null (a null is the field left out, as the validators read it)."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def _kind_is(kind: str) -> Schema:
    return {"required": ["kind"], "properties": {"kind": {"const": kind}}}


_QUERY_RULES: list[Schema] = [
    # A position is all three of lat, lon and t, or none of them.
    {"if": {"anyOf": [_requires("lat"), _requires("lon"), _requires("t")]}, "then": _requires("lat", "lon", "t")},
    # radius_m only with kind range, n only with kind knn.
    {"if": _requires("radius_m"), "then": _kind_is("range")},
    {"if": _requires("n"), "then": _kind_is("knn")},
    # Without session_id (a one-shot query or a session start): kind and its parameter are
    # required and stop is not allowed.
    {
        "if": {"not": _has("session_id")},
        "then": {
            "required": ["kind"],
            "properties": {"kind": _KIND, "stop": {"const": False}},
            "allOf": [
                {"if": _kind_is("range"), "then": _requires("radius_m")},
                {"if": _kind_is("knn"), "then": _requires("n")},
            ],
        },
    },
    # With session_id (a refresh or a stop): not continuous and no profile override.
    {
        "if": _has("session_id"),
        "then": {"properties": {"continuous": {"const": False}}, "not": _has("profile")},
    },
]
QUERY: Schema = {
    "title": "Query",
    "description": "A one-shot query, a session start (continuous), a refresh (session_id) or a stop "
    "(session_id and stop). A refresh may repeat kind, radius_m, n and category only with the session's values.",
    "type": "object",
    "additionalProperties": False,
    "required": ["query_id"],
    "properties": _QUERY_PROPERTIES,
    "allOf": _QUERY_RULES,
}
SESSION_START: Schema = {
    "title": "SessionStart",
    "description": "A query without continuous, session_id and stop (the route makes it continuous).",
    "type": "object",
    "additionalProperties": False,
    "required": ["query_id", "kind"],
    "properties": {
        **{k: v for k, v in _QUERY_PROPERTIES.items() if k not in ("continuous", "session_id", "stop")},
        "kind": _KIND,
    },
    "allOf": [
        *_QUERY_RULES[:3],
        {"if": _kind_is("range"), "then": _requires("radius_m")},
        {"if": _kind_is("knn"), "then": _requires("n")},
    ],
}
SESSION_REFRESH: Schema = {
    "title": "SessionRefresh",
    "type": "object",
    "additionalProperties": False,
    "required": ["query_id"],
    "properties": {k: _QUERY_PROPERTIES[k] for k in ("query_id", "lat", "lon", "t")},
    "allOf": _QUERY_RULES[:1],
}

SESSION_STATE: Schema = {"enum": ["active", "stopped", "expired", "ended"]}
SESSION_BRIEF: Schema = {
    "type": "object",
    "required": ["session_id", "state"],
    "properties": {"session_id": SESSION_ID, "state": SESSION_STATE, "expires_t": _NUM},
}
SESSION: Schema = {
    "title": "Session",
    "type": "object",
    "required": ["session_id", "state", "kind", "category", "started_t", "last_refresh_t", "expires_t", "refreshes"],
    "properties": {
        "session_id": SESSION_ID,
        "state": SESSION_STATE,
        "kind": {"enum": list(QUERY_KINDS)},
        "radius_m": _NUM,
        "n": {"type": "integer"},
        "category": {"type": ["string", "null"]},
        "started_t": _NUM,
        "last_refresh_t": {"type": ["number", "null"]},
        "expires_t": _NUM,
        "refreshes": {"type": "integer", "minimum": 0},
    },
}
REGION: Schema = {
    "title": "Region",
    "description": "Exactly what was sent upstream: a bbox in GeoJSON order, t_start and t_end for a temporal one.",
    "type": "object",
    "required": ["bbox"],
    "properties": {
        "bbox": {"type": "array", "minItems": 4, "maxItems": 4, "items": _NUM},
        "t_start": {"type": "integer"},
        "t_end": {"type": "integer"},
    },
}
RESULT: Schema = {
    "type": "object",
    "required": ["poi_id", "lat", "lon", "category", "name", "distance_m"],
    "properties": {
        "poi_id": {"type": "string"},
        "lat": LAT,
        "lon": LON,
        "category": {"type": "string"},
        "name": {"type": "string"},
        "distance_m": _NUM,
    },
}


def answer_schema(reasons: list[str]) -> Schema:
    """The answer to a query; ``reasons`` are the codes a refused answer may carry."""
    return {
        "title": "Answer",
        "description": "Exactly one per query: ok with results, or refused with a reason code.",
        "type": "object",
        "required": ["query_id", "status", "t"],
        "properties": {
            "query_id": QUERY_ID,
            "status": {"enum": ["ok", "refused"]},
            "reason": {"enum": reasons},
            "message": {"type": "string"},
            "algorithm": {"type": "string"},
            "k_achieved": {"type": "integer"},
            "l_achieved": {"type": "integer"},
            "area_m2": _NUM,
            "region": REGION,
            "results": {"type": "array", "items": RESULT},
            "truncated": {"type": "boolean"},
            "session": SESSION_BRIEF,
            "t": _NUM,
        },
    }


PROFILE_STATUS: Schema = {
    "title": "ProfileStatus",
    "description": "After every profile message whose topic user is valid.",
    "type": "object",
    "required": ["kind", "status", "t"],
    "properties": {
        "kind": {"const": "profile"},
        "request_id": QUERY_ID,
        "status": {"enum": ["ok", "refused"]},
        "reason": {"enum": ["invalid", "rate_limited", "overloaded"]},
        "profile": PROFILE_FULL,
        "t": _NUM,
    },
}
SESSION_STATUS: Schema = {
    "title": "SessionStatus",
    "description": "A session expired or ended without a refresh answer to carry it.",
    "type": "object",
    "required": ["kind", "session_id", "state", "t"],
    "properties": {"kind": {"const": "session"}, "session_id": SESSION_ID, "state": SESSION_STATE, "t": _NUM},
}
STATUS: Schema = {"title": "Status", "oneOf": [PROFILE_STATUS, SESSION_STATUS]}
BROKER_STATUS: Schema = {
    "title": "BrokerStatus",
    "description": "Retained. The last will is the same object with state down and t null; a graceful stop "
    "publishes down with a time.",
    "type": "object",
    "required": ["state", "version", "algorithm", "auth", "t"],
    "properties": {
        "state": {"enum": ["up", "down"]},
        "version": {"type": "string"},
        "algorithm": {"type": "string"},
        "auth": {"enum": ["tokens", "open"]},
        "t": {"type": ["number", "null"]},
    },
}
WINDOW_PART: Schema = {
    "title": "PublishedWindowPart",
    "description": "One part (at most 10,000 rows) of a published window; deduplicate by (window_id, part). "
    "An empty window is one part with no rows.",
    "type": "object",
    "required": ["window_id", "t_start", "t_end", "method", "k", "delta", "n_trajectories", "part", "parts"],
    "properties": {
        "window_id": WINDOW_ID,
        "t_start": {"type": "integer"},
        "t_end": {"type": "integer"},
        "method": {"type": "string"},
        "k": {"type": "integer"},
        "delta": _NUM,
        "n_trajectories": {"type": "integer", "minimum": 0},
        "part": {"type": "integer", "minimum": 1},
        "parts": {"type": "integer", "minimum": 1},
        "columns": {"const": ["traj_id", "t", "lat", "lon"]},
        "rows": {
            "type": "array",
            "maxItems": 10_000,
            "items": {
                "type": "array",
                "minItems": 4,
                "maxItems": 4,
                "items": [{"type": "string", "pattern": "^[0-9a-f]{16}$"}, _NUM, LAT, LON],
            },
        },
    },
}


def error_schema(codes: list[str]) -> Schema:
    """The HTTP error body; ``codes`` are the reason codes an error may carry."""
    return {
        "title": "Error",
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {
                    "code": {"enum": codes},
                    "message": {"type": "string", "description": "names the field and the rule, never a value"},
                    "field": {"type": "string"},
                    "query_id": {"type": "string"},
                },
            }
        },
    }
