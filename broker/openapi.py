"""The broker's OpenAPI 3.1 document (``GET /v1/openapi.json``), listing every route of the HTTP door.

Payload schemas come from :mod:`kcloak.wire.schemas` (shared with the AsyncAPI document and checked
against the validators), reason codes from :mod:`kcloak.wire.reasons`. ``tests/broker/test_openapi.py``
validates the document with openapi-spec-validator and checks that it lists exactly the routes
:func:`kcloak.broker.http_server.build_app` registers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from kcloak import __version__
from kcloak.wire import schemas as s
from kcloak.wire.reasons import ANSWER_REASONS, ERROR_CODES, REASONS

OPEN_PATHS = frozenset(
    {"/v1/openapi.json", "/v1/asyncapi.json", "/v1/info", "/healthz", "/metrics", "/map", "/map/map.js", "/map/map.css"}
)
"""Routes that never need a token (the others need one when tokens are configured)."""

_STATUS_TEXT = {
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    404: "not found",
    405: "method not allowed",
    409: "duplicate",
    413: "too large",
    415: "unsupported media type",
    429: "rate limited",
    500: "internal",
    503: "overloaded or shutting down",
}
_ERROR = s.error_schema(ERROR_CODES)
_ANSWER = s.answer_schema(ANSWER_REASONS)
_FIX_RESULT = {
    "type": "object",
    "required": ["accepted", "rejected"],
    "properties": {
        "accepted": {"type": "integer", "minimum": 0},
        "rejected": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "code"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "code": {"enum": ["invalid", "out_of_order", "too_old", "rate_limited", "overloaded"]},
                },
            },
        },
    },
}
_PROFILE_ANSWER = {
    "type": "object",
    "required": ["profile", "source", "updated_t"],
    "properties": {
        "profile": s.PROFILE_FULL,
        "source": {"enum": ["stored", "default"]},
        "updated_t": {"type": ["number", "null"]},
    },
}
_NUM = {"type": "number"}
_WINDOW_META_PROPERTIES: dict[str, object] = {
    "window_id": s.WINDOW_ID,
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
_INFO = {
    "type": "object",
    "required": ["version", "algorithm", "auth", "mqtt", "profile_defaults", "limits"],
    "properties": {
        "version": {"type": "string"},
        "algorithm": {"type": "string"},
        "auth": {"enum": ["tokens", "open"]},
        "mqtt": {"enum": ["embedded", "external", "none"]},
        "profile_defaults": s.PROFILE_FULL,
        "limits": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
}
_HEALTH = {
    "type": "object",
    "required": ["status", "version", "uptime_s", "mqtt", "upstream"],
    "properties": {
        "status": {"enum": ["ok", "draining", "degraded"]},
        "version": {"type": "string"},
        "uptime_s": _NUM,
        "mqtt": {"enum": ["connected", "disconnected", "none"]},
        "upstream": {"enum": ["ok", "failing", "unknown"]},
        "stores": {"type": "object", "additionalProperties": {"enum": ["ok", "failing"]}},
    },
}
_PARAMETERS: dict[str, dict[str, Any]] = {
    "user": {"name": "user", "in": "path", "required": True, "schema": s.USER_ID},
    "session_id": {"name": "session_id", "in": "path", "required": True, "schema": s.SESSION_ID},
    "window_id": {"name": "window_id", "in": "path", "required": True, "schema": s.WINDOW_ID},
}


def _json(schema: Mapping[str, object], description: str) -> dict[str, object]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _op(
    operation_id: str,
    summary: str,
    *,
    tag: str,
    body: Mapping[str, object] | None = None,
    ok: Mapping[str, object] | None = None,
    ok_status: str = "200",
    ok_response: Mapping[str, object] | None = None,
    errors: Sequence[int] = (),
    description: str | None = None,
) -> dict[str, object]:
    """One operation: JSON ``body`` (if any), ``ok`` the JSON schema of its success answer (or a
    whole ``ok_response``), ``errors`` the HTTP statuses of its error bodies."""
    if ok_response is None:
        ok_response = _json(ok or {"type": "object"}, "success") if ok_status != "204" else {"description": "done"}
    responses: dict[str, object] = {ok_status: ok_response}
    for status in errors:
        responses[str(status)] = _json(_ERROR, _STATUS_TEXT[status])
    op: dict[str, object] = {"operationId": operation_id, "summary": summary, "tags": [tag], "responses": responses}
    if description:
        op["description"] = description
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


_QUERY_ERRORS = (400, 401, 403, 409, 413, 415, 429, 500, 503)


def _operations() -> dict[str, dict[str, dict[str, object]]]:
    return {
        "/v1/users/{user}/location": {
            "post": _op(
                "postLocation",
                "Submit one location fix",
                tag="fixes",
                body=s.FIX,
                ok=_FIX_RESULT,
                errors=(400, 401, 403, 413, 415, 429, 503),
                description="Answered once the fix is stored (it survives a crash). A fix that is too_old or "
                "out_of_order is a 200 with the code in `rejected`.",
            )
        },
        "/v1/locations": {
            "post": _op(
                "postLocations",
                "Submit a batch of fixes",
                tag="fixes",
                body=s.BATCH,
                ok=_FIX_RESULT,
                errors=(400, 401, 403, 413, 415, 503),
            )
        },
        "/v1/users/{user}/profile": {
            "get": _op(
                "getProfile", "Read the stored profile", tag="profiles", ok=_PROFILE_ANSWER, errors=(400, 401, 403)
            ),
            "put": _op(
                "putProfile",
                "Replace the stored profile (omitted fields take the server defaults)",
                tag="profiles",
                body=s.PROFILE,
                ok=_PROFILE_ANSWER,
                errors=(400, 401, 403, 413, 415, 429, 503),
            ),
            "delete": _op(
                "deleteProfile", "Reset to the default profile", tag="profiles", ok_status="204", errors=(400, 401, 403)
            ),
        },
        "/v1/users/{user}/query": {
            "post": _op(
                "postQuery",
                "Run a query (one answer)",
                tag="queries",
                body=s.QUERY,
                ok=_ANSWER,
                errors=_QUERY_ERRORS,
                description="Blocks until answered: at most max_delay_s + upstream.deadline_s + 1 s. A refusal "
                "with an answer code (k_unreachable, area_exceeded, …) is a 200 answer; error bodies carry query_id.",
            )
        },
        "/v1/users/{user}/sessions": {
            "post": _op(
                "startSession",
                "Start a continuous query",
                tag="sessions",
                body=s.SESSION_START,
                ok=_ANSWER,
                errors=_QUERY_ERRORS,
            )
        },
        "/v1/users/{user}/sessions/{session_id}/refresh": {
            "post": _op(
                "refreshSession",
                "Refresh a session",
                tag="sessions",
                body=s.SESSION_REFRESH,
                ok=_ANSWER,
                errors=_QUERY_ERRORS,
            )
        },
        "/v1/users/{user}/sessions/{session_id}": {
            "get": _op("getSession", "Read a session", tag="sessions", ok=s.SESSION, errors=(400, 401, 403, 404)),
            "delete": _op(
                "stopSession", "Stop a session", tag="sessions", ok_status="204", errors=(400, 401, 403, 404)
            ),
        },
        "/v1/published/windows": {"get": _windows_op()},
        "/v1/published/windows/{window_id}": {
            "get": _op(
                "getWindow", "A published window's report", tag="published", ok=_WINDOW_REPORT, errors=(401, 403, 404)
            )
        },
        "/v1/published/windows/{window_id}.csv": {
            "get": _op(
                "getWindowCsv",
                "A published window's file (CSV traj_id,t,lat,lon)",
                tag="published",
                ok_response={"description": "the window file", "content": {"text/csv": {"schema": {"type": "string"}}}},
                errors=(401, 403, 404),
            )
        },
        "/v1/info": {
            "get": _op("getInfo", "Service information: version, algorithm, defaults, limits", tag="service", ok=_INFO)
        },
        "/v1/openapi.json": {"get": _op("getOpenApi", "This document (OpenAPI 3.1)", tag="service")},
        "/v1/asyncapi.json": {"get": _op("getAsyncApi", "The MQTT interface (AsyncAPI 3.0)", tag="service")},
        "/healthz": {
            "get": _op(
                "getHealth",
                "Health",
                tag="service",
                ok=_HEALTH,
                description="503 with status draining during shutdown, or degraded when MQTT has been "
                "disconnected for more than 10 s or a store cannot write.",
            )
        },
        "/metrics": {
            "get": _op(
                "getMetrics",
                "Prometheus metrics",
                tag="service",
                ok_response={
                    "description": "Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
            )
        },
    }


_MAP_FRAME = {
    "type": "object",
    "description": "One frame of the live map: aggregates only, never a user id or an exact position.",
    "required": ["t", "regions", "density", "counters", "windows"],
    "properties": {
        "t": {"type": "number", "description": "Unix seconds (0.1 s)"},
        "regions": {
            "type": "object",
            "description": "Regions forwarded in the last max_age_s seconds, newest first, at most 500: "
            "[x0, y0, x1, y1, k_achieved, age_s], bounds in units of grid_deg (the forwarded region widened to "
            "grid lines: min_lon = x0 * grid_deg).",
            "properties": {
                "grid_deg": _NUM,
                "max_age_s": _NUM,
                "rows": {"type": "array", "items": {"type": "array", "items": _NUM, "minItems": 6, "maxItems": 6}},
            },
        },
        "density": {
            "type": "object",
            "description": "Present users per cell [x, y, n] (cell x covers [x * cell_deg, (x + 1) * cell_deg) of "
            "longitude, y of latitude); cells with fewer than min_k users are left out, only counted.",
            "properties": {
                "cell_deg": _NUM,
                "min_k": {"type": "integer"},
                "cells": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                "hidden_cells": {"type": "integer"},
                "hidden_users": {"type": "integer"},
            },
        },
        "counters": {
            "type": "object",
            "properties": {
                "updates": {"type": "integer"},
                "updates_per_s": {"type": ["number", "null"]},
                "queries": {"type": "integer"},
                "ok": {"type": "integer"},
                "refused": {"type": "integer"},
                "success_rate": {"type": ["number", "null"]},
                "refusals": {"type": "object", "additionalProperties": {"type": "integer"}},
                "p99_ms": {"type": ["number", "null"]},
                "latency_window_s": _NUM,
                "users_present": {"type": "integer"},
            },
        },
        "windows": {
            "type": "object",
            "properties": {
                "by_outcome": {"type": "object", "additionalProperties": {"type": "integer"}},
                "recent": {"type": "array", "items": {"type": "object"}},
            },
        },
    },
}


def _map_operations() -> dict[str, dict[str, dict[str, object]]]:
    def static(operation_id: str, summary: str, media: str) -> dict[str, dict[str, object]]:
        content = {media: {"schema": {"type": "string"}}}
        return {"get": _op(operation_id, summary, tag="map", ok_response={"description": summary, "content": content})}

    viewers = (
        "Open without tokens (the broker then listens on loopback only); with tokens, a bearer token of a user "
        "listed in auth.map_viewers."
    )
    return {
        "/map": static(
            "getMapPage", "The live map page (no data in it; open it as /map#token=… with tokens)", "text/html"
        ),
        "/map/map.js": static("getMapScript", "The live map's script", "text/javascript"),
        "/map/map.css": static("getMapStyle", "The live map's style sheet", "text/css"),
        "/v1/map/streets": {
            "get": _op(
                "getMapStreets",
                "The street lines drawn under the live map (map.streets), or none",
                tag="map",
                ok={
                    "type": "object",
                    "required": ["lines", "bbox"],
                    "properties": {
                        "lines": {"type": "array", "items": {"type": "array", "items": _NUM}},
                        "bbox": {"type": ["array", "null"], "items": _NUM},
                    },
                },
                errors=(401, 403, 404),
                description=viewers,
            )
        },
        "/v1/map/stream": {
            "get": _op(
                "getMapStream",
                "The live map's feed: Server-Sent Events, one `frame` event a second",
                tag="map",
                ok_response={
                    "description": "text/event-stream; each event is `event: frame` with a MapFrame as its data",
                    "content": {"text/event-stream": {"schema": _MAP_FRAME}},
                },
                errors=(401, 403, 404, 503),
                description=viewers + " At most 8 feeds at once (503 overloaded beyond).",
            )
        },
    }


def _windows_op() -> dict[str, object]:
    op = _op(
        "listWindows",
        "List published windows (ascending t_start)",
        tag="published",
        ok={
            "type": "object",
            "required": ["windows", "next_since"],
            "properties": {
                "windows": {"type": "array", "items": _WINDOW_META},
                "next_since": {"type": ["integer", "null"]},
            },
        },
        errors=(400, 401, 403),
    )
    op["parameters"] = [
        {"name": "since", "in": "query", "schema": {"type": "integer", "minimum": 0, "default": 0}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
    ]
    return op


def broker_openapi() -> dict[str, object]:
    paths: dict[str, object] = {}
    for path, operations in (_operations() | _map_operations()).items():
        names = [name for name in _PARAMETERS if "{" + name + "}" in path]
        item: dict[str, object] = dict(operations)
        if names:
            item["parameters"] = [_PARAMETERS[name] for name in names]
        if path not in OPEN_PATHS:
            for op in operations.values():
                op["security"] = [{"bearer": []}]
        paths[path] = item
    document: dict[str, object] = {
        "openapi": "3.1.0",
        "info": {
            "title": "kcloak broker",
            "version": __version__,
            "description": "The HTTP door of kcloak's v1 interface. With tokens configured every /v1/ route but "
            "/v1/openapi.json, /v1/asyncapi.json and /v1/info needs a bearer token acting for {user} (the live "
            "map's /v1/map/ routes: a user in auth.map_viewers); in open mode the header is ignored. Every error "
            "is the Error body. Reason codes: docs/interface.md.",
        },
        "tags": [{"name": t} for t in ("fixes", "profiles", "queries", "sessions", "published", "service", "map")],
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    }
    # a copy: the payload schemas are shared with the validators, and a caller may change its document
    return copy.deepcopy(document)


__all__ = ["OPEN_PATHS", "REASONS", "broker_openapi"]
