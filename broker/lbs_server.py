"""HTTP server of the reference LBS provider ``kcloak lbs`` (contract §5, §4 error body, §10; CONCEPTS §5.3).

Routes: ``POST /v1/search`` (strict request, inclusive candidate set from
:class:`~kcloak.broker.lbs.LbsEngine`), ``GET /v1/categories``, ``GET /v1/openapi.json``, ``GET /healthz``
and ``GET /metrics`` (its own prometheus registry). Every 4xx/5xx, aiohttp's own included, gets the
contract's error body from one middleware. Logs (``kcloak.core.logs``) carry route templates, statuses and
durations only: never a coordinate, bbox, POI id, name, category or pseudonym (contract §10).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeGuard

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from kcloak import __version__
from kcloak.broker.errors import BrokerError
from kcloak.broker.lbs import LbsEngine, LonLatBox
from kcloak.broker.metrics import CANDIDATE_BUCKETS, LATENCY_BUCKETS
from kcloak.core.logs import log_event
from kcloak.core.places import PoiSet
from kcloak.core.profile import ReasonCode
from kcloak.wire.payloads import (
    CATEGORY_RE,
    MAX_KNN_N,
    MAX_RADIUS_M,
    SESSION_ID_RE,
    InvalidInput,
    parse_json_object,
)

log = logging.getLogger("kcloak.lbs")

BODY_LIMIT_BYTES = 65_536
"""Largest accepted request body (contract §1: 64 KiB; larger → 413 ``too_large``)."""
SEARCH_FIELDS = frozenset({"pseudonym", "kind", "region", "radius_m", "n", "category"})
REGION_FIELDS = frozenset({"bbox", "t_start", "t_end"})
KINDS = ("range", "knn")

_STATUS_CODES: dict[int, ReasonCode] = {
    400: ReasonCode.INVALID,
    404: ReasonCode.NOT_FOUND,
    405: ReasonCode.METHOD_NOT_ALLOWED,
    413: ReasonCode.TOO_LARGE,
    415: ReasonCode.UNSUPPORTED_MEDIA_TYPE,
    500: ReasonCode.INTERNAL,
    503: ReasonCode.OVERLOADED,
}
_STATUS_MESSAGES: dict[int, str] = {
    404: "route: not found",
    405: "method: not allowed for this route",
    413: f"body: must not exceed {BODY_LIMIT_BYTES} bytes",
    500: "internal error",
}


class RequestError(BrokerError):
    """A request the contract rejects; becomes the error body of §4 (``kind`` labels the metric)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        field: str | None = None,
        kind: str = "unknown",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = _STATUS_CODES.get(status, ReasonCode.INVALID)
        self.message = message
        self.field = field
        self.kind = kind


@dataclass(frozen=True, slots=True)
class SearchRequest:
    """A validated ``POST /v1/search`` body (contract §5); the pseudonym is checked, then dropped."""

    kind: Literal["range", "knn"]
    box: LonLatBox
    radius_m: float | None = None
    n: int | None = None
    category: str | None = None


# ---------------------------------------------------------------------------------------------
# Request parsing (pure).


def _is_number(v: object) -> TypeGuard[int | float]:
    """A finite JSON number (ints are exact and may exceed float range: compare before converting)."""
    return (isinstance(v, float) and math.isfinite(v)) or _is_int(v)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_search(doc: dict[str, Any]) -> SearchRequest:
    """Validate a search body against contract §5 (strict: unknown fields are ``invalid``)."""
    kind_raw = doc.get("kind")
    kind: Literal["range", "knn"] | None = "range" if kind_raw == "range" else "knn" if kind_raw == "knn" else None
    label = kind or "unknown"

    def fail(field: str | None, message: str) -> RequestError:
        return RequestError(message, field=field, kind=label)

    for key in doc:
        if key not in SEARCH_FIELDS:
            raise fail(str(key)[:64], "unknown field (requests are strict)")
    pseudonym = doc.get("pseudonym")
    if not isinstance(pseudonym, str) or not SESSION_ID_RE.match(pseudonym):
        raise fail("pseudonym", "pseudonym: required, 32 lowercase hex characters")
    if kind is None:
        raise fail("kind", "kind: required, one of range, knn")
    box = _parse_region(doc.get("region"), fail)
    radius_m: float | None = None
    n: int | None = None
    if kind == "range":
        if "n" in doc:
            raise fail("n", "n: not allowed for kind range")
        r = doc.get("radius_m")
        if not _is_number(r) or not 0 < r <= MAX_RADIUS_M:
            raise fail("radius_m", f"radius_m: required for kind range, a number in (0, {MAX_RADIUS_M:g}]")
        radius_m = float(r)
    else:
        if "radius_m" in doc:
            raise fail("radius_m", "radius_m: not allowed for kind knn")
        nv = doc.get("n")
        if not _is_int(nv) or not 1 <= nv <= MAX_KNN_N:
            raise fail("n", f"n: required for kind knn, an integer in [1, {MAX_KNN_N}]")
        n = int(nv)
    category = doc.get("category")
    if category is not None and (not isinstance(category, str) or not CATEGORY_RE.match(category)):
        raise fail("category", "category: a string of 1-64 characters without control characters")
    if "category" in doc and category is None:
        raise fail("category", "category: must be a string when present")
    return SearchRequest(kind=kind, box=box, radius_m=radius_m, n=n, category=category)


def _parse_region(region: object, fail: Callable[[str | None, str], RequestError]) -> LonLatBox:
    if not isinstance(region, dict):
        raise fail("region", "region: required, an object with bbox")
    for key in region:
        if key not in REGION_FIELDS:
            raise fail("region." + str(key)[:57], "region: unknown field (requests are strict)")
    bbox = region.get("bbox")
    if not isinstance(bbox, list) or len(bbox) != 4 or not all(_is_number(v) for v in bbox):
        raise fail("region.bbox", "region.bbox: required, [min_lon, min_lat, max_lon, max_lat] of finite numbers")
    if not (-180 <= bbox[0] <= 180 and -180 <= bbox[2] <= 180):
        raise fail("region.bbox", "region.bbox: longitudes must be within [-180, 180]")
    if not (-90 <= bbox[1] <= 90 and -90 <= bbox[3] <= 90):
        raise fail("region.bbox", "region.bbox: latitudes must be within [-90, 90]")
    min_lon, min_lat, max_lon, max_lat = (float(v) for v in bbox)
    if min_lon > max_lon or min_lat > max_lat:
        raise fail("region.bbox", "region.bbox: min must not exceed max (no antimeridian crossing)")
    has_start, has_end = "t_start" in region, "t_end" in region
    if has_start or has_end:
        t_start, t_end = region.get("t_start"), region.get("t_end")
        if not (has_start and has_end):
            raise fail("region.t_start", "region.t_start, region.t_end: both or neither")
        if not _is_int(t_start) or not _is_int(t_end) or not 0 <= t_start <= t_end:
            raise fail("region.t_start", "region.t_start, region.t_end: integers with 0 <= t_start <= t_end")
    return LonLatBox(min_lon, min_lat, max_lon, max_lat)


# ---------------------------------------------------------------------------------------------
# Metrics and logs.


@dataclass(frozen=True, slots=True)
class LbsMetrics:
    """The provider's metrics (contract §10) in a registry of its own (not the global one)."""

    registry: CollectorRegistry
    requests: Counter
    seconds: Histogram
    candidates: Histogram

    @classmethod
    def create(cls) -> LbsMetrics:
        reg = CollectorRegistry()
        return cls(
            registry=reg,
            requests=Counter(
                "kcloak_lbs_requests",
                "Search requests by kind (range, knn, unknown) and HTTP status.",
                ["kind", "status"],
                registry=reg,
            ),
            seconds=Histogram(
                "kcloak_lbs_seconds",
                "Time to answer a search request.",
                ["kind"],
                buckets=LATENCY_BUCKETS,
                registry=reg,
            ),
            candidates=Histogram(
                "kcloak_lbs_candidates",
                "Candidate-set size of answered searches.",
                ["kind"],
                buckets=CANDIDATE_BUCKETS,
                registry=reg,
            ),
        )


# ---------------------------------------------------------------------------------------------
# The application.


class _Catalog:
    """The engine plus each POI's JSON object, pre-serialized once (responses only concatenate)."""

    def __init__(self, pois: PoiSet) -> None:
        self.engine = LbsEngine(pois)
        self.fragments = [
            json.dumps(
                {"poi_id": p.poi_id, "lat": p.lat, "lon": p.lon, "category": p.category, "name": p.name},
                ensure_ascii=False,
                separators=(",", ":"),
            )
            for p in pois.pois
        ]
        self.count = len(pois)
        self.started = time.monotonic()


POIS_KEY = web.AppKey("pois", PoiSet)
CATALOG_KEY = web.AppKey("catalog", _Catalog)
METRICS_KEY = web.AppKey("metrics", LbsMetrics)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(status: int, message: str, field: str | None = None) -> web.Response:
    err: dict[str, Any] = {"code": str(_STATUS_CODES.get(status, ReasonCode.INVALID)), "message": message}
    if field is not None:
        err["field"] = field
    return web.json_response({"error": err}, status=status)


def _route_template(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every 4xx/5xx as the contract's error body (§4), aiohttp's own 404/405/413 included."""
    t0 = time.perf_counter()
    try:
        response = await handler(request)
    except RequestError as exc:
        response = _error_response(exc.status, exc.message, exc.field)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error_response(exc.status, _STATUS_MESSAGES.get(exc.status, exc.reason))
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
    except Exception:
        log.exception("internal_error", extra={"kcloak_fields": {"route": _route_template(request)}})
        response = _error_response(500, _STATUS_MESSAGES[500])
    log_event(
        log,
        "http_request",
        logging.DEBUG,
        route=_route_template(request),
        method=request.method,
        status=response.status,
        duration_ms=round((time.perf_counter() - t0) * 1e3, 3),
    )
    return response


async def _read_json(request: web.Request) -> dict[str, Any]:
    """Size (413), media type (415), then strict JSON (400), in that order."""
    if request.content_length is not None and request.content_length > BODY_LIMIT_BYTES:
        raise RequestError(_STATUS_MESSAGES[413], status=413)
    charset = (request.charset or "utf-8").lower()
    if request.content_type != "application/json" or charset not in {"utf-8", "utf8"}:
        raise RequestError("content-type: must be application/json (UTF-8)", status=415)
    body = await request.read()  # client_max_size raises 413 for a longer body without Content-Length
    try:
        return parse_json_object(body)
    except InvalidInput as exc:
        raise RequestError(str(exc), field=exc.field) from None


async def search(request: web.Request) -> web.Response:
    """``POST /v1/search``: validate, compute the candidate set, answer sorted by ``poi_id``."""
    catalog, metrics = request.app[CATALOG_KEY], request.app[METRICS_KEY]
    t0 = time.perf_counter()
    kind, status = "unknown", 500
    try:
        req = parse_search(await _read_json(request))
        kind = req.kind
        if req.kind == "range":
            assert req.radius_m is not None
            rows = catalog.engine.range_candidates(req.box, req.radius_m, req.category)
        else:
            assert req.n is not None
            rows = catalog.engine.knn_candidates(req.box, req.n, req.category)
        text = '{"candidates":[' + ",".join([catalog.fragments[i] for i in rows.tolist()]) + "]}"
        metrics.candidates.labels(kind).observe(len(rows))
        status = 200
        return web.Response(text=text, content_type="application/json", charset="utf-8")
    except RequestError as exc:
        kind, status = exc.kind, exc.status
        raise
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        metrics.requests.labels(kind, str(status)).inc()
        metrics.seconds.labels(kind).observe(time.perf_counter() - t0)


async def categories(request: web.Request) -> web.Response:
    """``GET /v1/categories``: every category with its POI count, sorted by name."""
    cats = request.app[CATALOG_KEY].engine.categories()
    return web.json_response({"categories": [{"category": c, "count": n} for c, n in cats]})


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: liveness, version, uptime and the number of POIs served."""
    catalog = request.app[CATALOG_KEY]
    return web.json_response(
        {
            "status": "ok",
            "version": __version__,
            "uptime_s": round(time.monotonic() - catalog.started, 3),
            "pois": catalog.count,
        }
    )


async def metrics_route(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format from the app's own registry."""
    body = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi_route(request: web.Request) -> web.Response:
    """``GET /v1/openapi.json``: the OpenAPI 3.1 description of these routes."""
    return web.json_response(openapi_document())


async def _catalog_ctx(app: web.Application) -> AsyncIterator[None]:
    """Build the engine (rtree indexes) at startup and release it at cleanup."""
    catalog = _Catalog(app[POIS_KEY])
    app[CATALOG_KEY] = catalog
    yield
    catalog.engine.close()


def make_app(pois: PoiSet) -> web.Application:
    """The ``kcloak lbs`` application over ``pois`` (contract §5)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=BODY_LIMIT_BYTES)
    app[POIS_KEY] = pois
    app[METRICS_KEY] = LbsMetrics.create()
    app.cleanup_ctx.append(_catalog_ctx)
    app.router.add_post("/v1/search", search)
    app.router.add_get("/v1/categories", categories)
    app.router.add_get("/v1/openapi.json", openapi_route)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_route)
    return app


class LbsServer:
    """``kcloak lbs`` listening on ``host:port``, as an async context manager (entering binds).

    Keyword-only parameters: ``host`` ("127.0.0.1") and ``port`` (8471; 0 picks a free port, see
    :attr:`port`). Binding failures (port in use) raise ``OSError`` from ``__aenter__``.
    """

    def __init__(self, pois: PoiSet, *, host: str = "127.0.0.1", port: int = 8471) -> None:
        self.app = make_app(pois)
        self.host = host
        self._port = port
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> LbsServer:
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self._port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        addr = runner.addresses[0]
        self._port = int(addr[1])
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 was asked)."""
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}"


# ---------------------------------------------------------------------------------------------
# OpenAPI.


def _error_schema() -> dict[str, Any]:
    codes = sorted({str(c) for c in _STATUS_CODES.values()})
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {
                    "code": {"type": "string", "enum": codes},
                    "message": {"type": "string"},
                    "field": {"type": "string"},
                },
            }
        },
    }


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 document of the provider's routes and schemas (contract §5)."""
    ref = "#/components/schemas/"
    text = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[^\\x00-\\x1f\\x7f]{1,64}$"}
    search_request = {
        "type": "object",
        "additionalProperties": False,
        "required": ["pseudonym", "kind", "region"],
        "properties": {
            "pseudonym": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
            "kind": {"type": "string", "enum": list(KINDS)},
            "region": {"$ref": ref + "Region"},
            "radius_m": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_RADIUS_M},
            "n": {"type": "integer", "minimum": 1, "maximum": MAX_KNN_N},
            "category": text,
        },
        "oneOf": [
            {"properties": {"kind": {"const": "range"}}, "required": ["radius_m"], "not": {"required": ["n"]}},
            {"properties": {"kind": {"const": "knn"}}, "required": ["n"], "not": {"required": ["radius_m"]}},
        ],
    }
    region = {
        "type": "object",
        "additionalProperties": False,
        "required": ["bbox"],
        "properties": {
            "bbox": {
                "type": "array",
                "description": "[min_lon, min_lat, max_lon, max_lat]; min <= max (no antimeridian crossing)",
                "prefixItems": [
                    {"type": "number", "minimum": -180, "maximum": 180},
                    {"type": "number", "minimum": -90, "maximum": 90},
                    {"type": "number", "minimum": -180, "maximum": 180},
                    {"type": "number", "minimum": -90, "maximum": 90},
                ],
                "minItems": 4,
                "maxItems": 4,
            },
            "t_start": {"type": "integer", "minimum": 0},
            "t_end": {"type": "integer", "minimum": 0},
        },
        "dependentRequired": {"t_start": ["t_end"], "t_end": ["t_start"]},
    }
    candidate = {
        "type": "object",
        "required": ["poi_id", "lat", "lon", "category", "name"],
        "properties": {
            "poi_id": text,
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
            "category": text,
            "name": {"type": "string"},
        },
    }

    def ok(schema: str, description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": {"$ref": ref + schema}}}}

    def errors(*statuses: int) -> dict[str, Any]:
        return {str(s): {"$ref": "#/components/responses/Error"} for s in statuses}

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kcloak reference LBS provider",
            "version": __version__,
            "description": (
                "Candidate sets over a cloaked region (kcloak contract §5): inclusive for every point of the "
                "bbox (haversine), sorted by poi_id, never truncated."
            ),
        },
        "paths": {
            "/v1/search": {
                "post": {
                    "summary": "Range or kNN candidate set over a region",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": ref + "SearchRequest"}}},
                    },
                    "responses": {
                        "200": ok("SearchResponse", "Candidates sorted by poi_id"),
                        **errors(400, 404, 405, 413, 415, 500, 503),
                    },
                }
            },
            "/v1/categories": {
                "get": {
                    "summary": "POI categories with counts",
                    "responses": {"200": ok("Categories", "Categories sorted by name"), **errors(405)},
                }
            },
            "/v1/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3.1"}}}
            },
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": ok("Health", "Serving")}}},
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {"description": "Prometheus text format", "content": {"text/plain": {}}},
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "SearchRequest": search_request,
                "Region": region,
                "SearchResponse": {
                    "type": "object",
                    "required": ["candidates"],
                    "properties": {"candidates": {"type": "array", "items": {"$ref": ref + "Candidate"}}},
                },
                "Candidate": candidate,
                "Categories": {
                    "type": "object",
                    "required": ["categories"],
                    "properties": {
                        "categories": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["category", "count"],
                                "properties": {"category": text, "count": {"type": "integer", "minimum": 1}},
                            },
                        }
                    },
                },
                "Health": {
                    "type": "object",
                    "required": ["status", "version", "uptime_s"],
                    "properties": {
                        "status": {"type": "string", "enum": ["ok"]},
                        "version": {"type": "string"},
                        "uptime_s": {"type": "number"},
                        "pois": {"type": "integer"},
                    },
                },
                "Error": _error_schema(),
            },
            "responses": {
                "Error": {
                    "description": "Error body of kcloak contract §4",
                    "content": {"application/json": {"schema": {"$ref": ref + "Error"}}},
                }
            },
        },
    }
