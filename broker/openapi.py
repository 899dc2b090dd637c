"""The broker's OpenAPI 3.1 document (``GET /v1/openapi.json``), listing every route of contract §4."""

from __future__ import annotations

from typing import Any

from broker import __version__

_NUM = {"type": "number"}
_FIX = {
    "type": "object",
    "additionalProperties": False,
    "required": ["t", "lat", "lon"],
    "properties": {
        "t": {"type": "number", "description": "Unix seconds UTC"},
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
    },
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
_QUERY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["query_id"],
    "properties": {
        "query_id": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,64}$"},
        "kind": {"enum": ["range", "knn"]},
        "radius_m": {"type": "number", "exclusiveMinimum": 0, "maximum": 50000},
        "n": {"type": "integer", "minimum": 1, "maximum": 100},
        "category": {"type": "string", "minLength": 1, "maxLength": 64},
        "lat": _FIX["properties"]["lat"],  # type: ignore[index]
        "lon": _FIX["properties"]["lon"],  # type: ignore[index]
        "t": _NUM,
        "profile": _PROFILE,
        "continuous": {"type": "boolean"},
        "session_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "stop": {"type": "boolean"},
    },
}
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
        "session": {"type": "object"},
        "t": _NUM,
    },
}


def _op(summary: str, body: dict[str, Any] | None = None, ok: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "success", "content": {"application/json": {"schema": ok or {"type": "object"}}}},
            "default": {"description": "error", "content": {"application/json": {"schema": _ERROR}}},
        },
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def broker_openapi() -> dict[str, Any]:
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
            "/v1/users/{user}/sessions": {"post": _op("Start a continuous query", _QUERY, _ANSWER)},
            "/v1/users/{user}/sessions/{session_id}/refresh": {"post": _op("Refresh a session", _QUERY, _ANSWER)},
            "/v1/users/{user}/sessions/{session_id}": {
                "get": _op("Read a session"),
                "delete": {"summary": "Stop a session", "responses": {"204": {"description": "stopped"}}},
            },
            "/v1/published/windows": {"get": _op("List published windows")},
            "/v1/published/windows/{window_id}": {"get": _op("A published window's report")},
            "/v1/published/windows/{window_id}.csv": {"get": _op("A published window's file")},
            "/v1/info": {"get": _op("Service information")},
            "/v1/openapi.json": {"get": _op("This document")},
            "/healthz": {"get": _op("Health")},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        },
    }
