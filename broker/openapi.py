"""The broker's OpenAPI 3.1 document (``GET /v1/openapi.json``), listing every route of contract §4."""

from __future__ import annotations

from collections.abc import Mapping

from kcloak import __version__

_NUM = {"type": "number"}
_LAT = {"type": "number", "minimum": -90, "maximum": 90}
_LON = {"type": "number", "minimum": -180, "maximum": 180}
_SESSION_ID = {"type": "string", "pattern": "^[0-9a-f]{32}$"}
_FIX = {
    "type": "object",
    "additionalProperties": False,
    "required": ["t", "lat", "lon"],
    "properties": {"t": {"type": "number", "description": "Unix seconds UTC"}, "lat": _LAT, "lon": _LON},
}
_PROFILE = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "k": {"type": "integer", "minimum": 1, "maximum": 1000},
        "l": {"type": "integer", "minimum": 1, "maximum": 50},
        "min_area_m2": {"type": "number", "minimum": 0, "maximum": 2.5e9},
        "max_area_m2": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5e9},
        "max_delay_s": {"type": "number", "minimum": 0, "maximum": 600},
    },
}
_QUERY_PROPERTIES: dict[str, object] = {
    "query_id": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,64}$"},
    "kind": {"enum": ["range", "knn"]},
    "radius_m": {"type": "number", "exclusiveMinimum": 0, "maximum": 50000},
    "n": {"type": "integer", "minimum": 1, "maximum": 100},
    "category": {"type": "string", "minLength": 1, "maxLength": 64},
    "lat": _LAT,
    "lon": _LON,
    "t": _NUM,
    "profile": _PROFILE,
    "continuous": {"type": "boolean"},
    "session_id": _SESSION_ID,
    "stop": {"type": "boolean"},
}
_QUERY = {"type": "object", "additionalProperties": False, "required": ["query_id"], "properties": _QUERY_PROPERTIES}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field": {"type": "string"},
                "query_id": {"type": "string"},
            },
        }
    },
}
_SESSION_STATE = {"enum": ["active", "stopped", "expired", "ended"]}
_SESSION = {
    "type": "object",
    "required": ["session_id", "state", "kind", "category", "started_t", "last_refresh_t", "expires_t", "refreshes"],
    "properties": {
        "session_id": _SESSION_ID,
        "state": _SESSION_STATE,
        "kind": {"enum": ["range", "knn"]},
        "radius_m": _NUM,
        "n": {"type": "integer"},
        "category": {"type": ["string", "null"]},
        "started_t": _NUM,
        "last_refresh_t": {"type": ["number", "null"]},
        "expires_t": _NUM,
        "refreshes": {"type": "integer", "minimum": 0},
    },
}
_SESSION_BRIEF = {
    "type": "object",
    "required": ["session_id", "state"],
    "properties": {"session_id": _SESSION_ID, "state": _SESSION_STATE, "expires_t": _NUM},
}
_START = {
    **_QUERY,
    "properties": {k: v for k, v in _QUERY_PROPERTIES.items() if k not in ("continuous", "session_id", "stop")},
}
_REFRESH = {
    "type": "object",
    "additionalProperties": False,
    "required": ["query_id"],
    "properties": {k: _QUERY_PROPERTIES[k] for k in ("query_id", "lat", "lon", "t")},
}
_ANSWER = {
    "type": "object",
    "required": ["query_id", "status", "t"],
    "properties": {
        "query_id": {"type": "string"},
        "status": {"enum": ["ok", "refused"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "algorithm": {"type": "string"},
        "k_achieved": {"type": "integer"},
        "l_achieved": {"type": "integer"},
        "area_m2": _NUM,
        "region": {"type": "object"},
        "results": {"type": "array", "items": {"type": "object"}},
        "truncated": {"type": "boolean"},
        "session": _SESSION_BRIEF,
        "t": _NUM,
    },
}


_WINDOW_META_PROPERTIES: dict[str, object] = {
    "window_id": {"type": "string", "pattern": "^[0-9]+-[0-9]+$"},
    "t_start": {"type": "integer"},
    "t_end": {"type": "integer"},
    "method": {"type": "string"},
    "k": {"type": "integer"},
    "delta": _NUM,
    "n_in": {"type": "integer"},
    "n_out": {"type": "integer"},
    "published_t": _NUM,
    "status": {"enum": ["published", "empty"]},
    "csv": {"type": "string"},
}
_WINDOW_META = {
    "type": "object",
    "required": ["window_id", "t_start", "t_end", "method", "k", "delta", "n_in", "n_out", "published_t", "csv"],
    "properties": _WINDOW_META_PROPERTIES,
}
_WINDOW_REPORT = {
    "type": "object",
    "required": ["window_id", "t_start", "t_end", "published_t", "status", "method", "k", "delta", "n_in", "n_out"],
    "properties": {
        **_WINDOW_META_PROPERTIES,
        "kcloak_version": {"type": "string"},
        "seed": {"type": ["integer", "null"]},
        "trash_max": _NUM,
        "pi_s": {"type": ["number", "null"]},
        "n_trash": {"type": "integer"},
        "n_too_short": {"type": "integer"},
        "n_bad_rows": {"type": "integer"},
        "n_points_in": {"type": "integer"},
        "n_points_out": {"type": "integer"},
        "trash_fraction": _NUM,
        "n_groups": {"type": "integer"},
        "group_size_mean": _NUM,
        "total_translation_m": _NUM,
        "mean_translation_m": _NUM,
        "time_distortion_s": _NUM,
        "range_query_distortion": _NUM,
        "range_queries": {"type": "integer"},
        "runtime_s": _NUM,
    },
}


def _windows_op() -> dict[str, object]:
    op = _op(
        "List published windows (ascending t_start)",
        ok={
            "type": "object",
            "required": ["windows", "next_since"],
            "properties": {
                "windows": {"type": "array", "items": _WINDOW_META},
                "next_since": {"type": ["integer", "null"]},
            },
        },
    )
    op["parameters"] = [
        {"name": "since", "in": "query", "schema": {"type": "integer", "minimum": 0, "default": 0}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
    ]
    return op


def _csv_op() -> dict[str, object]:
    return _op(
        "A published window's file (contract CSV traj_id,t,lat,lon)",
        ok_response={"description": "the window file", "content": {"text/csv": {"schema": {"type": "string"}}}},
    )


def _op(
    summary: str,
    body: Mapping[str, object] | None = None,
    ok: Mapping[str, object] | None = None,
    *,
    ok_response: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """An operation: JSON ``body`` (if any), ``ok`` the JSON schema of its 200 answer (or a whole
    ``ok_response`` for other media types), errors in the contract's error object."""
    if ok_response is None:
        ok_response = {"description": "success", "content": {"application/json": {"schema": ok or {"type": "object"}}}}
    op: dict[str, object] = {
        "summary": summary,
        "responses": {
            "200": ok_response,
            "default": {"description": "error", "content": {"application/json": {"schema": _ERROR}}},
        },
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def broker_openapi() -> dict[str, object]:
    batch = {
        "type": "object",
        "additionalProperties": False,
        "required": ["updates"],
        "properties": {"updates": {"type": "array", "maxItems": 10000, "items": {"type": "object"}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kcloak broker", "version": __version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/users/{user}/location": {"post": _op("Submit one location fix", _FIX)},
            "/v1/locations": {"post": _op("Submit a batch of fixes", batch)},
            "/v1/users/{user}/profile": {
                "get": _op("Read the stored profile"),
                "put": _op("Replace the stored profile", _PROFILE),
                "delete": {"summary": "Reset to the default profile", "responses": {"204": {"description": "reset"}}},
            },
            "/v1/users/{user}/query": {"post": _op("Run a query (one answer)", _QUERY, _ANSWER)},
            "/v1/users/{user}/sessions": {"post": _op("Start a continuous query", _START, _ANSWER)},
            "/v1/users/{user}/sessions/{session_id}/refresh": {"post": _op("Refresh a session", _REFRESH, _ANSWER)},
            "/v1/users/{user}/sessions/{session_id}": {
                "get": _op("Read a session", ok=_SESSION),
                "delete": {"summary": "Stop a session", "responses": {"204": {"description": "stopped"}}},
            },
            "/v1/published/windows": {"get": _windows_op()},
            "/v1/published/windows/{window_id}": {"get": _op("A published window's report", ok=_WINDOW_REPORT)},
            "/v1/published/windows/{window_id}.csv": {"get": _csv_op()},
            "/v1/info": {"get": _op("Service information")},
            "/v1/openapi.json": {"get": _op("This document")},
            "/healthz": {"get": _op("Health")},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        },
    }
