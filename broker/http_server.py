"""The HTTP door (contract §4): small aiohttp handlers that parse, authenticate and call the
pipeline — the same pipeline the MQTT door calls.

Every 4xx/5xx leaves as the contract's error body: :func:`request_handler`, around the whole
application, rewrites aiohttp's own 404/405/413 and any exception of a handler (or of the auth
middleware, present with tokens only), and :class:`HttpServer`'s connection handler answers
requests that do not even parse (over-long lines, bad framing) the same way, without quoting
them back or logging them. Access is counted per route *template*, never per concrete path: the
``kcloak_http_requests`` counter, the ``kcloak_http_request_duration_seconds`` histogram and, with
``log.access``, one JSON access line per request (:func:`route_access_log`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import traceback
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from aiohttp import hdrs, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from prometheus_client import Counter

from kcloak import __version__
from kcloak.broker.auth import TokenStore
from kcloak.broker.config import Config, ConfigError
from kcloak.broker.errors import BrokerError
from kcloak.broker.livemap import FRAME_PERIOD_S, MAX_VIEWERS, LiveMap
from kcloak.broker.metrics import Metrics
from kcloak.broker.openapi import OPEN_PATHS
from kcloak.broker.pipeline import FIX_CHUNK, Duplicate, Pipeline, QueryRejected
from kcloak.broker.publication import WindowPublisher
from kcloak.broker.stores import StoreError
from kcloak.core.logs import log_event
from kcloak.core.memory import bound_socket_reads
from kcloak.core.profile import ProfileError, ReasonCode
from kcloak.wire.payloads import (
    USER_ID_RULE,
    InvalidInput,
    MalformedJson,
    ascii_int,
    decode_fix,
    parse_fix,
    parse_json_object,
    valid_user_id,
)

if TYPE_CHECKING:
    from kcloak.broker.http_fast import FastFixes

log = logging.getLogger("kcloak.http")
access_logger = logging.getLogger("kcloak.access")

PIPELINE = web.AppKey("pipeline", Pipeline)
CONFIG = web.AppKey("config", Config)
METRICS = web.AppKey("metrics", Metrics)
TOKENS = web.AppKey("tokens", TokenStore)
STATE = web.AppKey("state", dict)
PUBLICATION = web.AppKey("publication", WindowPublisher)
MAP_STOPPING = web.AppKey("map_stopping", asyncio.Event)  # set when the server stops: live map feeds end
AUTH_USER = web.RequestKey("auth_user", str)
ABANDON = web.RequestKey("abandon", bool)  # the body will never come: close once answered
ROUTE = web.RequestKey("route", str)  # the route template of a request served without the router

_STATUS: dict[ReasonCode, int] = {
    ReasonCode.INVALID: 400,
    ReasonCode.UNAUTHORIZED: 401,
    ReasonCode.FORBIDDEN: 403,
    ReasonCode.NOT_FOUND: 404,
    ReasonCode.METHOD_NOT_ALLOWED: 405,
    ReasonCode.DUPLICATE: 409,
    ReasonCode.TOO_LARGE: 413,
    ReasonCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ReasonCode.RATE_LIMITED: 429,
    ReasonCode.INTERNAL: 500,
    ReasonCode.OVERLOADED: 503,
    ReasonCode.SHUTDOWN: 503,
    ReasonCode.UNKNOWN_SESSION: 404,
}
_ERROR_ANSWERS = {
    ReasonCode.INVALID,
    ReasonCode.RATE_LIMITED,
    ReasonCode.INTERNAL,
    ReasonCode.OVERLOADED,
    ReasonCode.SHUTDOWN,
}


class HttpError(BrokerError):
    """An error answer; ``close`` also ends the connection (the request was not read to its end)."""

    def __init__(
        self,
        code: ReasonCode,
        message: str,
        *,
        field: str | None = None,
        query_id: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        self.query_id = query_id
        self.close = close


def error_parts(
    code: ReasonCode, message: str, *, field: str | None = None, query_id: str | None = None
) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
    """The contract's error answer for ``code``: its status, its JSON body and its extra headers."""
    err: dict[str, Any] = {"code": code.value, "message": message}
    if field is not None:
        err["field"] = field
    if query_id is not None:
        err["query_id"] = query_id
    extra: tuple[tuple[str, str], ...] = ()
    if code is ReasonCode.UNAUTHORIZED:
        extra = (("WWW-Authenticate", "Bearer"),)
    elif code is ReasonCode.RATE_LIMITED or code in (ReasonCode.OVERLOADED, ReasonCode.SHUTDOWN):
        extra = (("Retry-After", "1"),)
    return _STATUS.get(code, 400), json.dumps({"error": err}).encode(), extra


def error_response(
    code: ReasonCode, message: str, *, field: str | None = None, query_id: str | None = None
) -> web.Response:
    status, body, extra = error_parts(code, message, field=field, query_id=query_id)
    resp = web.Response(body=body, status=status, content_type="application/json", charset="utf-8")
    resp.headers.extend(extra)
    return resp


_AIOHTTP_CODES = {
    404: (ReasonCode.NOT_FOUND, "no such route"),
    405: (ReasonCode.METHOD_NOT_ALLOWED, "method not allowed on this route"),
    413: (ReasonCode.TOO_LARGE, "request body too large"),
}


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})


def _method_label(method: str) -> str:
    """The ``method`` metric label: a fixed set, whatever method a client made up."""
    return method if method in _METHODS else "other"


def error_frames(exc: BaseException) -> list[str]:
    """Where an exception was raised, as ``file:line function`` frames: no message, no source
    line, no locals (any of them could hold a submitted value)."""
    return [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_tb(exc.__traceback__)[-12:]]


def request_handler(
    app: web.Application, metrics: Metrics
) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """``app``'s request handler as :class:`HttpServer` serves it: every error, aiohttp's own
    404/405/413 and a handler's exception included, answered with the contract's error body, and
    every request counted in ``kcloak_http_requests`` by route pattern, method and status.

    It wraps the application's handler on the connection rather than as an aiohttp middleware: a
    middleware costs every request two more coroutine layers (aiohttp adds one of its own).

    A single fix (``POST /v1/users/{user}/location`` whose path is exactly that, with a user id
    that needs no decoding, and no ``Expect`` header) goes to its handler without the router: the
    route, the user and the handler are known from the request line, and the auth check (with
    tokens) is the one the auth middleware makes. Every other request goes through the
    application, and both answer and count alike."""
    handle = app._handle
    counter = metrics.http_requests
    pipeline, config, tokens = app[PIPELINE], app[CONFIG], app.get(TOKENS)
    fix_path = _FIX_PATH.fullmatch
    fix_answered = counter.labels(FIX_ROUTE, "POST", "200")  # the hot path's series, looked up once
    fix_received = metrics.messages.labels("http", "update")

    async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
        status = 500
        route: str | None = None
        try:
            found = fix_path(request.raw_path) if request.method == "POST" else None
            if found is not None and hdrs.EXPECT not in request.headers:
                route = request[ROUTE] = FIX_ROUTE
                user = found.group(1)
                if tokens is not None:
                    request[AUTH_USER] = _bearer_user(request, tokens, user)
                resp: web.StreamResponse = await _post_location(request, user, pipeline, config, fix_received)
            else:
                resp = await handle(request)  # type: ignore[arg-type]  # the runner's requests are web.Requests
            status = resp.status
            return resp
        except HttpError as exc:
            resp = error_response(exc.code, str(exc), field=exc.field, query_id=exc.query_id)
            if exc.close:
                resp.force_close()
                request[ABANDON] = True
            status = resp.status
            return resp
        except web.HTTPException as exc:
            code, message = _AIOHTTP_CODES.get(exc.status, (ReasonCode.INVALID, "bad request"))
            if exc.status >= 500:
                code, message = ReasonCode.INTERNAL, "internal error"
            resp = error_response(code, message)
            status = resp.status
            return resp
        except StoreError:
            # A store that cannot write (disk full, I/O error) is a condition that passes: 503
            # overloaded, as a fix the movement store cannot take is refused overloaded.
            resp = error_response(ReasonCode.OVERLOADED, "storage is failing; retry later")
            status = resp.status
            return resp
        except Exception as exc:  # a bug: the contract's 500, never aiohttp's plain text
            route, error, stack = _route_template(request), type(exc).__name__, error_frames(exc)
            log_event(log, "http_handler_failed", logging.ERROR, route=route, error=error, stack=stack)
            resp = error_response(ReasonCode.INTERNAL, "internal error")
            status = resp.status
            return resp
        finally:
            if route is FIX_ROUTE and status == 200:
                fix_answered.inc()
            else:
                counter.labels(route or _route_template(request), _method_label(request.method), str(status)).inc()

    return dispatch


def _route_template(request: web.BaseRequest) -> str:
    route = request.get(ROUTE)
    if isinstance(route, str):
        return route
    try:
        info = request.match_info if isinstance(request, web.Request) else None
    except AssertionError:  # a request that did not parse has no match (aiohttp asserts there is one)
        return "unmatched"
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    if resource is None:
        return "unmatched"
    canonical = getattr(resource, "canonical", None)
    return canonical if isinstance(canonical, str) else "unmatched"


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    tokens = request.app.get(TOKENS)
    if tokens is None or not request.path.startswith("/v1/") or request.path in OPEN_PATHS:
        return await handler(request)
    user = request[AUTH_USER] = _bearer_user(request, tokens, request.match_info.get("user"))
    if request.path.startswith("/v1/published/"):
        readers = request.app[CONFIG].auth.published_readers
        if user not in readers:
            raise HttpError(ReasonCode.FORBIDDEN, "not a published-data reader")
    if request.path.startswith("/v1/map/") and user not in request.app[CONFIG].auth.map_viewers:
        raise HttpError(ReasonCode.FORBIDDEN, "not a map viewer (auth.map_viewers)")
    return await handler(request)


def _bearer_user(request: web.BaseRequest, tokens: TokenStore, path_user: str | None) -> str:
    return bearer_user(request.headers.get("Authorization", ""), tokens, path_user)


def bearer_user(authorization: str, tokens: TokenStore, path_user: str | None) -> str:
    """The user of the bearer token in an ``Authorization`` header's value: 401 without a valid
    one, 403 if the path names another user."""
    scheme, _, token = authorization.partition(" ")
    user = tokens.user_of(token.strip()) if scheme.lower() == "bearer" else None
    if user is None:
        raise HttpError(ReasonCode.UNAUTHORIZED, "a valid bearer token is required")
    if path_user is not None and path_user != user:
        raise HttpError(ReasonCode.FORBIDDEN, "the token does not act for this user")
    return user


async def _json_body(request: web.Request, limit: int) -> dict[str, Any]:
    return _parse_body(await _raw_body(request, limit, request.app[CONFIG].http.body_timeout_s))


async def _raw_body(request: web.BaseRequest, limit: int, timeout_s: float) -> bytes:
    """The body of a JSON request, not yet parsed: 415, 413 and a body not received in
    ``timeout_s`` as :func:`_json_body` refuses them."""
    # The header as clients send it is taken as it is; anything else (parameters, other case) is parsed.
    if request.headers.get("Content-Type") != "application/json" and request.content_type != "application/json":
        raise HttpError(ReasonCode.UNSUPPORTED_MEDIA_TYPE, "Content-Type must be application/json")
    length = request.content_length
    if length is not None and length > limit:
        raise HttpError(ReasonCode.TOO_LARGE, f"body: at most {limit} bytes")
    try:
        if length is not None and request.content.is_eof():
            # The whole body came with the head (the parser stops at Content-Length): no wait, no timer.
            return request.content.read_nowait()
        async with asyncio.timeout(timeout_s):
            raw = await _read_body(request, limit)
    except TimeoutError:
        raise HttpError(ReasonCode.INVALID, f"body: not received within {timeout_s:g} s", close=True) from None
    except (ConnectionError, web.RequestPayloadError, HttpProcessingError):
        raise HttpError(ReasonCode.INVALID, "body: incomplete or badly framed", close=True) from None
    return raw


async def _read_body(request: web.BaseRequest, limit: int) -> bytes:
    if request.content_length is not None:
        return await request.read()
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(65536)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise HttpError(ReasonCode.TOO_LARGE, f"body: at most {limit} bytes", close=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        return parse_json_object(raw)
    except MalformedJson as exc:
        raise HttpError(ReasonCode.INVALID, str(exc)) from None


def _user(request: web.Request) -> str:
    user = request.match_info["user"]
    if not valid_user_id(user):
        raise HttpError(ReasonCode.INVALID, USER_ID_RULE, field="user")
    return user


# -- fixes -------------------------------------------------------------------------------------
ACCEPTED_ONE = json.dumps({"accepted": 1, "rejected": []}).encode()
FIX_ROUTE = "/v1/users/{user}/location"
_FIX_PATH = re.compile(r"/v1/users/([A-Za-z0-9][A-Za-z0-9._-]{0,63})/location")
"""A single fix's request target that :func:`request_handler` serves without the router: a valid
user id is left as it is by the router's decoding, so the route and ``{user}`` are the router's."""


async def post_location(request: web.Request) -> web.Response:
    return await _post_location(request, _user(request), request.app[PIPELINE], request.app[CONFIG])


async def _post_location(
    request: web.BaseRequest, user: str, pipeline: Pipeline, cfg: Config, received: Counter | None = None
) -> web.Response:
    """A single fix of ``user`` (a valid user id: checked by the router's caller, or by :data:`_FIX_PATH`);
    ``received``: the ``kcloak_messages`` series it counts into, if already looked up."""
    raw = await _raw_body(request, cfg.limits.body_bytes, cfg.http.body_timeout_s)
    body, charset = fix_answer(await submit_fix(raw, user, pipeline, received))
    return web.Response(body=body, content_type="application/json", charset=charset)


def submit_fix(
    raw: bytes,
    user: str,
    pipeline: Pipeline,
    received: Counter | None = None,
    waiter: asyncio.Future[ReasonCode | None] | None = None,
) -> Awaitable[ReasonCode | None]:
    """Decode and submit the single fix of body ``raw`` (its outcome, as :meth:`Pipeline.decide_fix`,
    resolving ``waiter`` if given); raises :class:`HttpError` for a body that is not a fix."""
    # A well-formed fix is decoded and checked in one pass; anything else takes the full path,
    # which names the reason (a body that is not JSON, or the field and rule a fix breaks).
    fix = decode_fix(raw)
    body = _parse_body(raw) if fix is None else None
    (received or pipeline.metrics.messages.labels("http", "update")).inc()
    if fix is None:
        try:
            fix, _ = parse_fix(body)
        except InvalidInput as exc:
            pipeline.metrics.updates_rejected.labels(transport="http", reason="invalid").inc()
            raise HttpError(ReasonCode.INVALID, str(exc), field=exc.field) from None
    return pipeline.decide_fix("http", user, fix, waiter)


_FIX_REFUSALS = {
    ReasonCode.INVALID: "t: more than max_clock_skew_s in the future",
    ReasonCode.RATE_LIMITED: "update rate limit reached",
    ReasonCode.OVERLOADED: "the movement store queue is full",
    ReasonCode.SHUTDOWN: "the broker is shutting down",
}


def fix_answer(code: ReasonCode | None) -> tuple[bytes, str | None]:
    """The 200 answer (a JSON body, its charset) to a single fix decided ``code``; raises
    :class:`HttpError` for a refusal that is an error answer."""
    if code is None:
        return ACCEPTED_ONE, None
    if code in (ReasonCode.TOO_OLD, ReasonCode.OUT_OF_ORDER):
        rejected = {"accepted": 0, "rejected": [{"index": 0, "code": code.value}]}
        return json.dumps(rejected).encode(), "utf-8"
    field = "t" if code is ReasonCode.INVALID else None
    raise HttpError(code, _FIX_REFUSALS.get(code, "refused"), field=field)


async def post_locations(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    pipeline = request.app[PIPELINE]
    body = await _json_body(request, cfg.limits.batch_bytes)
    pipeline.metrics.messages.labels(transport="http", topic="updates").inc()
    if set(body) != {"updates"} or not isinstance(body["updates"], list):
        raise HttpError(ReasonCode.INVALID, 'body: must be {"updates": [...]}', field="updates")
    updates = body["updates"]
    if len(updates) > cfg.limits.batch_items:
        raise HttpError(ReasonCode.TOO_LARGE, f"updates: at most {cfg.limits.batch_items} fixes")
    auth_user = request.get(AUTH_USER)
    items: list[tuple[str, Any]] = []
    codes: dict[int, ReasonCode] = {}
    for i, item in enumerate(updates):
        if i and i % FIX_CHUNK == 0:  # a large batch does not hold up other requests for long
            await asyncio.sleep(0)
        who = item.get("user") if isinstance(item, dict) else None
        if auth_user is not None:
            if who is not None and who != auth_user:
                raise HttpError(ReasonCode.FORBIDDEN, "a batch may only carry the token user's fixes")
            who = auth_user
        try:
            fix, _ = parse_fix(item, allow_user=True)
        except InvalidInput:
            codes[i] = ReasonCode.INVALID
            continue
        if not isinstance(who, str):
            codes[i] = ReasonCode.INVALID
            continue
        items.append((who, fix))
    for _ in codes:
        pipeline.metrics.updates_rejected.labels(transport="http", reason="invalid").inc()
    res = await pipeline.enqueue_fixes("http", items, batch=True)
    valid_positions = [i for i in range(len(updates)) if i not in codes]
    for pos, code in zip(valid_positions, res.codes, strict=True):
        if code is not None:
            codes[pos] = code
    if items and all(c is ReasonCode.SHUTDOWN for c in res.codes):
        raise HttpError(ReasonCode.SHUTDOWN, "the broker is shutting down")
    rejected = [{"index": i, "code": codes[i].value} for i in sorted(codes)]
    return web.json_response({"accepted": len(updates) - len(rejected), "rejected": rejected})


# -- profiles ----------------------------------------------------------------------------------
def _profile_body(pipeline: Pipeline, user: str) -> dict[str, Any]:
    profile, source, updated = pipeline.get_profile(user)
    return {"profile": profile.to_dict(), "source": source, "updated_t": updated}


async def get_profile(request: web.Request) -> web.Response:
    user = _user(request)
    pipeline = request.app[PIPELINE]
    await pipeline.load_profile(user)
    return web.json_response(_profile_body(pipeline, user))


async def put_profile(request: web.Request) -> web.Response:
    user = _user(request)
    pipeline = request.app[PIPELINE]
    body = await _json_body(request, request.app[CONFIG].limits.body_bytes)
    if not pipeline.profile_rate_ok(user):
        pipeline.metrics.profile_sets.labels(transport="http", status="refused", reason="rate_limited").inc()
        raise HttpError(ReasonCode.RATE_LIMITED, "profile rate limit reached")
    await _set_profile(pipeline, user, body)
    return web.json_response(_profile_body(pipeline, user))


async def delete_profile(request: web.Request) -> web.Response:
    user = _user(request)
    pipeline = request.app[PIPELINE]
    await _set_profile(pipeline, user, None)
    return web.Response(status=204)


async def _set_profile(pipeline: Pipeline, user: str, data: dict[str, Any] | None) -> None:
    """Store (or, with None, reset) a user's profile, counting the outcome; a refusal is raised as
    its contract error (an invalid profile, or a store that cannot write: 503 overloaded)."""
    try:
        await pipeline.set_profile(user, data)
    except ProfileError as exc:
        pipeline.metrics.profile_sets.labels(transport="http", status="refused", reason="invalid").inc()
        raise HttpError(ReasonCode.INVALID, str(exc), field=exc.field) from None
    except StoreError:
        pipeline.metrics.profile_sets.labels(transport="http", status="refused", reason="overloaded").inc()
        raise HttpError(ReasonCode.OVERLOADED, "the profile store cannot write; retry later") from None
    pipeline.metrics.profile_sets.labels(transport="http", status="ok", reason="none").inc()


# -- queries -----------------------------------------------------------------------------------
async def _run_query(request: web.Request, body: dict[str, Any]) -> web.Response:
    user = _user(request)
    pipeline = request.app[PIPELINE]
    pipeline.metrics.messages.labels(transport="http", topic="query").inc()
    try:
        qid = pipeline.admit(user, body)
    except QueryRejected as exc:
        raise HttpError(exc.code, str(exc), field=exc.field) from None
    except Duplicate:
        raise HttpError(ReasonCode.DUPLICATE, "query_id: already used", query_id=body.get("query_id")) from None
    if await pipeline.is_answered(user, qid):
        raise HttpError(ReasonCode.DUPLICATE, "query_id: already used", query_id=qid)
    stored, _, _ = pipeline.get_profile(user)
    cfg = request.app[CONFIG]
    wait_s = stored.max_delay_s + cfg.upstream.deadline_s + 1.0
    task = pipeline.start_query("http", user, qid, body)  # runs to its answer even if the client leaves
    try:
        async with asyncio.timeout(wait_s):
            outcome = await asyncio.shield(task)
    except TimeoutError:
        raise HttpError(ReasonCode.OVERLOADED, "no answer in time", query_id=qid) from None
    answer = outcome.answer
    code = answer.reason
    if code is not None and code in _ERROR_ANSWERS:
        raise HttpError(code, answer.message or "", query_id=qid)
    return web.json_response(answer.to_json())


async def post_query(request: web.Request) -> web.Response:
    body = await _json_body(request, request.app[CONFIG].limits.body_bytes)
    return await _run_query(request, body)


async def post_session(request: web.Request) -> web.Response:
    body = await _json_body(request, request.app[CONFIG].limits.body_bytes)
    for key in ("continuous", "session_id", "stop"):
        if key in body:
            raise HttpError(ReasonCode.INVALID, f"{key}: not allowed on this route", field=key)
    body["continuous"] = True
    return await _run_query(request, body)


async def refresh_session(request: web.Request) -> web.Response:
    body = await _json_body(request, request.app[CONFIG].limits.body_bytes)
    allowed = {"query_id", "lat", "lon", "t"}
    for key in body:
        if key not in allowed:
            raise HttpError(ReasonCode.INVALID, "unknown field", field=str(key)[:64])
    body["session_id"] = request.match_info["session_id"]
    return await _run_query(request, body)


async def get_session(request: web.Request) -> web.Response:
    user = _user(request)
    obj = request.app[PIPELINE].session_object(user, request.match_info["session_id"])
    if obj is None:
        raise HttpError(ReasonCode.UNKNOWN_SESSION, "unknown session")
    return web.json_response(obj)


async def delete_session(request: web.Request) -> web.Response:
    user = _user(request)
    if not request.app[PIPELINE].stop_session(user, request.match_info["session_id"]):
        raise HttpError(ReasonCode.UNKNOWN_SESSION, "unknown session")
    return web.Response(status=204)


# -- published data (contract §4, §7) -----------------------------------------------------------
async def list_windows(request: web.Request) -> web.Response:
    values = {"since": 0, "limit": 100}
    for name, lo, hi in (("since", 0, 2**62), ("limit", 1, 1000)):
        raw = request.query.get(name)
        if raw is None:
            continue
        value = ascii_int(raw)  # plain ASCII digits: int() alone takes "٣", "1_000", " 5"
        if value is None or not lo <= value <= hi:
            raise HttpError(ReasonCode.INVALID, f"{name}: must be an integer within [{lo}, {hi}]", field=name)
        values[name] = value
    publication = request.app.get(PUBLICATION)
    if publication is None:
        return web.json_response({"windows": [], "next_since": None})
    windows, next_since = await asyncio.to_thread(publication.listing, since=values["since"], limit=values["limit"])
    return web.json_response({"windows": windows, "next_since": next_since})


async def get_window(request: web.Request) -> web.Response:
    publication = request.app.get(PUBLICATION)
    report = None
    if publication is not None:
        report = await asyncio.to_thread(publication.report, request.match_info["window_id"])
    if report is None:
        raise HttpError(ReasonCode.NOT_FOUND, "unknown window")
    return web.json_response(report)


async def get_window_csv(request: web.Request) -> web.StreamResponse:
    publication = request.app.get(PUBLICATION)
    path = None
    if publication is not None:
        path = await asyncio.to_thread(publication.published_csv, request.match_info["window_id"])
    if path is None:
        raise HttpError(ReasonCode.NOT_FOUND, "unknown window")
    return web.FileResponse(path, headers={"Content-Type": "text/csv; charset=utf-8"})


# -- service routes ----------------------------------------------------------------------------
async def info(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    mqtt = cfg.mqtt.mode if cfg.mqtt.mode in ("embedded", "none") else "external"
    lim = cfg.limits
    return web.json_response(
        {
            "version": __version__,
            "algorithm": cfg.cloaking.algorithm,
            "auth": "tokens" if request.app.get(TOKENS) is not None else "open",
            "mqtt": mqtt,
            "profile_defaults": cfg.profile.to_profile().to_dict(),
            "limits": {
                "body_bytes": lim.body_bytes,
                "batch_bytes": lim.batch_bytes,
                "batch_items": lim.batch_items,
                "knn_n_max": 100,
                "range_radius_m_max": 50000,
                "range_results_max": 1000,
            },
        }
    )


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pipeline = request.app[PIPELINE]
    upstream = pipeline.upstream.healthy
    stores = {health.store: health.healthy for health in state.get("stores", ())}
    body: dict[str, Any] = {
        "status": "ok",
        "version": __version__,
        "uptime_s": round(time.monotonic() - state["started"], 3),
        "mqtt": state.get("mqtt", "none"),
        "upstream": "unknown" if upstream is None else ("ok" if upstream else "failing"),
        "stores": {name: "ok" if healthy else "failing" for name, healthy in stores.items()},
    }
    if pipeline.closing:
        body["status"] = "draining"
        return web.json_response(body, status=503)
    mqtt_down = state.get("mqtt") == "disconnected" and time.monotonic() - state.get("mqtt_down_since", 0) > 10
    if mqtt_down or not all(stores.values()):  # a store that cannot write: degraded until one write succeeds
        body["status"] = "degraded"
        return web.json_response(body, status=503)
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request) -> web.Response:
    from kcloak.broker.openapi import broker_openapi

    return web.json_response(broker_openapi())


async def asyncapi(request: web.Request) -> web.Response:
    from kcloak.broker.asyncapi import broker_asyncapi

    return web.json_response(broker_asyncapi())


# -- the live map (docs/contract-extensions.md "The live map") ---------------------------------
_PAGE_TYPES = {"map.html": "text/html", "map.js": "text/javascript", "map.css": "text/css"}
_PAGE_HEADERS = {
    # The page talks to this broker only: no third-party script, style, image or connection.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _page_file(name: str) -> web.Response:
    from importlib.resources import files

    body = files("kcloak.broker").joinpath("static", name).read_bytes()
    return web.Response(body=body, content_type=_PAGE_TYPES[name], charset="utf-8", headers=_PAGE_HEADERS)


async def map_page(request: web.Request) -> web.Response:
    return _page_file("map.html")


async def map_script(request: web.Request) -> web.Response:
    return _page_file("map.js")


async def map_style(request: web.Request) -> web.Response:
    return _page_file("map.css")


def _livemap(request: web.Request) -> LiveMap:
    live = getattr(request.app[PIPELINE], "livemap", None)
    if not isinstance(live, LiveMap):
        raise HttpError(ReasonCode.NOT_FOUND, "the live map is served by kcloak serve without --cluster")
    return live


async def map_streets(request: web.Request) -> web.Response:
    try:
        streets = await asyncio.to_thread(_livemap(request).streets)
    except ConfigError as exc:
        raise HttpError(ReasonCode.NOT_FOUND, str(exc)) from None
    body = streets if streets is not None else {"lines": [], "bbox": None}
    return web.json_response(body, dumps=lambda obj: json.dumps(obj, separators=(",", ":")))


async def map_stream(request: web.Request) -> web.StreamResponse:
    live = _livemap(request)
    if live.viewers >= MAX_VIEWERS:
        raise HttpError(ReasonCode.OVERLOADED, f"at most {MAX_VIEWERS} live map feeds at once")
    pipeline = request.app[PIPELINE]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
    live.viewers += 1
    try:
        await resp.prepare(request)
        await resp.write(f"retry: {int(FRAME_PERIOD_S * 2000)}\n\n".encode())
        stopping = request.app[MAP_STOPPING]
        while not (pipeline.closing or stopping.is_set()):
            await resp.write(await live.frame(request.app.get(PUBLICATION)))
            with contextlib.suppress(TimeoutError):  # the next frame, or at once when the server stops
                await asyncio.wait_for(stopping.wait(), FRAME_PERIOD_S)
    except ConnectionError:
        pass  # the viewer left
    finally:
        live.viewers -= 1
    return resp


def build_app(pipeline: Pipeline, config: Config, tokens: TokenStore | None, state: dict[str, Any]) -> web.Application:
    app = web.Application(
        # Without tokens every route is open: no middleware at all on the hot path. Errors are
        # answered around the whole application (request_handler, installed by HttpServer).
        middlewares=[] if tokens is None else [auth_middleware],
        client_max_size=config.limits.batch_bytes + 1024,
    )
    app[PIPELINE] = pipeline
    app[CONFIG] = config
    app[METRICS] = pipeline.metrics
    app[STATE] = state
    if tokens is not None:
        app[TOKENS] = tokens
    app[MAP_STOPPING] = asyncio.Event()

    async def end_map_feeds(app: web.Application) -> None:
        app[MAP_STOPPING].set()

    app.on_shutdown.append(end_map_feeds)
    r = app.router
    r.add_post("/v1/users/{user}/location", post_location)
    r.add_post("/v1/locations", post_locations)
    r.add_get("/v1/users/{user}/profile", get_profile, allow_head=False)
    r.add_put("/v1/users/{user}/profile", put_profile)
    r.add_delete("/v1/users/{user}/profile", delete_profile)
    r.add_post("/v1/users/{user}/query", post_query)
    r.add_post("/v1/users/{user}/sessions", post_session)
    r.add_post("/v1/users/{user}/sessions/{session_id}/refresh", refresh_session)
    r.add_get("/v1/users/{user}/sessions/{session_id}", get_session, allow_head=False)
    r.add_delete("/v1/users/{user}/sessions/{session_id}", delete_session)
    r.add_get("/v1/published/windows", list_windows, allow_head=False)
    r.add_get("/v1/published/windows/{window_id}.csv", get_window_csv, allow_head=False)
    r.add_get("/v1/published/windows/{window_id}", get_window, allow_head=False)
    r.add_get("/v1/info", info, allow_head=False)
    r.add_get("/v1/openapi.json", openapi, allow_head=False)
    r.add_get("/v1/asyncapi.json", asyncapi, allow_head=False)
    r.add_get("/healthz", healthz, allow_head=False)
    r.add_get("/metrics", metrics, allow_head=False)
    r.add_get("/map", map_page, allow_head=False)
    r.add_get("/map/map.js", map_script, allow_head=False)
    r.add_get("/map/map.css", map_style, allow_head=False)
    r.add_get("/v1/map/streets", map_streets, allow_head=False)
    r.add_get("/v1/map/stream", map_stream, allow_head=False)
    return app


# -- the listener ------------------------------------------------------------------------------
def route_access_log(metrics: Metrics, *, emit: bool) -> type[AbstractAccessLogger]:
    """aiohttp's access-log hook for one server: every request, answered or not parsed, is timed into
    ``metrics.http_seconds`` by route pattern, method and status class, and with ``emit`` logged as
    one ``http_access`` line (route pattern, method, status, duration, bytes sent) on ``kcloak.access``.
    The concrete path, the query string, headers and the peer's address are never read."""

    fix_answered = metrics.http_seconds.labels(FIX_ROUTE, "POST", "2xx")  # the hot path's series, looked up once

    class RouteAccessLog(AbstractAccessLogger):
        def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
            if not emit and response.status == 200 and request.get(ROUTE) is FIX_ROUTE:
                fix_answered.observe(time)
                return
            route, method = _route_template(request), _method_label(request.method)
            record_access(metrics, route, method, response.status, time, response.body_length, emit=emit)

    return RouteAccessLog


def record_access(
    metrics: Metrics, route: str, method: str, status: int, seconds: float, bytes_sent: int, *, emit: bool
) -> None:
    """Time one answered request into ``metrics.http_seconds`` (route pattern, method, status class)
    and, with ``emit``, write its ``http_access`` line: for aiohttp's hook and the fast path alike."""
    metrics.http_seconds.labels(route, method, f"{status // 100}xx").observe(seconds)
    if emit:
        log_event(
            access_logger,
            "http_access",
            method=method,
            route=route,
            status=status,
            duration_s=round(seconds, 6),
            bytes_sent=bytes_sent,
        )


def _protocol_error(exc: BaseException | None) -> tuple[ReasonCode, str]:
    """The contract error for a request aiohttp could not parse, with a generic message."""
    if isinstance(exc, LineTooLong):
        return ReasonCode.TOO_LARGE, "request line or header field too long"
    return ReasonCode.INVALID, "malformed HTTP request"


class _ConnectionHandler(web.RequestHandler):
    """aiohttp's connection handler, answering what it cannot parse with the contract's error body.

    aiohttp's own ``handle_error`` logs the parser's message with its stack and sends it back as
    plain text; that message quotes the offending bytes (a path with a user id, a bearer token).
    Here the answer is generic and the log names only the error class.
    """

    __slots__ = ("_metrics",)

    def __init__(self, manager: web.Server, *, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._metrics = metrics

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        bound_socket_reads(transport)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        error = type(exc).__name__ if exc is not None else "none"
        if status < 500:  # the request did not parse (aiohttp gives 400)
            code, text = _protocol_error(exc)
            log_event(log, "http_request_malformed", logging.DEBUG, code=code.value, error=error)
        else:  # a handler failed outside the middleware (or timed out)
            code, text = ReasonCode.INTERNAL, "internal error"
            stack = error_frames(exc) if exc is not None else []
            log_event(log, "http_handler_failed", logging.ERROR, error=error, stack=stack)
        resp = error_response(code, text)
        self._metrics.http_requests.labels(route="unmatched", method="other", status=str(resp.status)).inc()
        if request.writer.output_size > 0:  # as aiohttp: a response already started cannot be replaced
            raise ConnectionError("response already started")
        resp.force_close()
        return resp

    def log_access(self, request: web.BaseRequest, response: web.StreamResponse, time: float | None) -> None:
        # Called once the answer is written (or failed to be), without a coroutine layer of its own.
        super().log_access(request, response, time)
        if request.get(ABANDON):
            # aiohttp would linger up to 10 s reading the rest of the body, which a stalled
            # client never sends: close now that the answer is written.
            self.force_close()


class HttpServer:
    """The HTTP listener of ``app`` on ``host:port``, an async context manager.

    Keyword arguments: ``host``, ``port`` (0 picks a free one, see :attr:`port`),
    ``head_timeout_s`` (a connection without a complete request head for that long, idle
    keep-alive included, is closed), ``metrics`` and ``access_log`` (one JSON line per request,
    ``log.access``; off by default). Entering listens; leaving stops listening,
    lets requests in flight finish briefly, and closes every connection.
    """

    def __init__(
        self,
        app: web.Application,
        *,
        host: str,
        port: int,
        head_timeout_s: float,
        metrics: Metrics,
        access_log: bool = False,
        fast_fixes: bool = False,
    ) -> None:
        self._app = app
        self._fast_fixes = fast_fixes
        self._fast: FastFixes | None = None
        self._host = host
        self._port = port
        self._head_timeout_s = head_timeout_s
        self._metrics = metrics
        self._access_log = access_log
        self._access_log_class = route_access_log(metrics, emit=access_log)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.port = port

    async def __aenter__(self) -> HttpServer:
        runner = web.AppRunner(self._app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        manager = runner.server
        assert manager is not None
        manager.request_handler = request_handler(self._app, self._metrics)  # read by each connection
        loop = asyncio.get_running_loop()

        def connection() -> web.RequestHandler:
            # aiohttp's keep-alive timer runs from the connection's start (and from each response)
            # and closes the connection if no complete request head has arrived by then.
            return _ConnectionHandler(
                manager,
                loop=loop,
                metrics=self._metrics,
                keepalive_timeout=self._head_timeout_s,
                access_log=access_logger,  # handed to the hook, which times every request
                access_log_class=self._access_log_class,
            )

        factory: Callable[[], asyncio.BaseProtocol] = connection
        if self._fast_fixes:
            from kcloak.broker.http_fast import FastFixes  # it imports this module's fix route

            app = self._app
            self._fast = FastFixes(
                pipeline=app[PIPELINE],
                config=app[CONFIG],
                tokens=app.get(TOKENS),
                metrics=self._metrics,
                access_log=self._access_log,
                handoff=connection,
            )
            factory = self._fast.connection
        try:
            self._listener = await loop.create_server(factory, self._host, self._port, reuse_address=True)
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        sockets = self._listener.sockets
        self.port = int(sockets[0].getsockname()[1]) if sockets else self._port
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._fast is not None:
            await self._fast.close(grace_s=1.0)  # as the runner's shutdown_timeout
            self._fast = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
