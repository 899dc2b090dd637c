"""The upstream client against a scripted raw HTTP/1.1 server on 127.0.0.1 (contract §5, §10).

Every test runs twice: on ``UpstreamClient`` in the test's event loop (``upstream.processes = 0``)
and on ``UpstreamProcesses``, which carries out the same policy in a child process (the default,
``upstream.processes = 1``): the policy must not depend on where it runs.

The provider here is a bare ``asyncio.start_server`` handler that parses each request (request
line, headers, ``Content-Length`` body) and writes exactly the bytes a test chooses, so framing
variants (chunked with extensions and trailers, close-delimited bodies, ``Connection: close``),
keep-alive, failures (refused, reset, silence, garbage, oversize) and cancellation are exercised
on real sockets. Only the public interface of the client is used: the constructor, the async
context, ``search``, ``healthy`` and the metrics it updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kcloak import __version__
from kcloak.broker.metrics import Metrics
from kcloak.broker.upstream import (
    MAX_RESPONSE_BYTES,
    Candidate,
    SearchRequest,
    Upstream,
    UpstreamClient,
    UpstreamError,
)
from kcloak.broker.upstream_processes import UpstreamProcesses
from kcloak.wire.net import free_port

BBOX = [116.391204, 39.903381, 116.402877, 39.913012]
PSEUDONYM_RE = re.compile(r"[0-9a-f]{32}")
OUTCOMES = ("ok", "timeout", "connection_error", "http_error", "invalid_response")
# Headers any HTTP/1.1 client may send without identifying anyone; the contract fixes the rest.
POI = {"poi_id": "n1", "lat": 39.90912, "lon": 116.39803, "category": "restaurant", "name": "Quanjude"}


# --------------------------------------------------------------------------- scripted server


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the server parsed it off the wire."""

    conn: int
    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]  # names lower-cased, in wire order
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name.lower()]
        assert len(values) <= 1, f"header {name} sent {len(values)} times"
        return values[0] if values else None

    def json(self) -> dict[str, Any]:
        doc = json.loads(self.body)
        assert isinstance(doc, dict)
        return doc

    @property
    def pseudonym(self) -> str:
        value = self.json()["pseudonym"]
        assert isinstance(value, str)
        return value


# Writes the answer to ``request``; returns whether to keep reading requests on this connection.
Responder = Callable[[Request, asyncio.StreamWriter], Awaitable[bool]]


async def read_request(reader: asyncio.StreamReader, conn: int) -> Request | None:
    """The next request on the connection, or None at a clean end of stream."""
    line = await reader.readline()
    if not line:
        return None
    method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        raw = await reader.readline()
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip().lower(), value.strip()))
    length = next((int(v) for k, v in headers if k == "content-length"), 0)
    body = await reader.readexactly(length) if length else b""
    return Request(conn, method, target, version, tuple(headers), body)


@dataclass
class RawServer:
    """A loopback HTTP server whose every answer is written by the test's ``responder``."""

    responder: Responder = field(repr=False)
    idle_timeout_s: float | None = None  # close a keep-alive connection idle this long
    requests: list[Request] = field(default_factory=list, repr=False)
    accepted: int = 0
    open_now: int = 0
    max_open: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    port: int = 0
    _server: asyncio.Server | None = field(default=None, repr=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = self.accepted
        self.accepted += 1
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        try:
            await self._serve(conn, reader, writer)
        except asyncio.CancelledError:
            pass  # stop() ends the connections still open; asyncio would log a cancelled handler
        finally:
            self.open_now -= 1
            writer.close()
            self._tasks.discard(task)

    async def _serve(self, conn: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            try:
                if self.idle_timeout_s is not None and served:
                    async with asyncio.timeout(self.idle_timeout_s):
                        request = await read_request(reader, conn)
                else:
                    request = await read_request(reader, conn)
            except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                return
            if request is None:
                return
            self.requests.append(request)
            served += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                keep = await self.responder(request, writer)
                await writer.drain()
            except ConnectionError:
                return
            finally:
                self.in_flight -= 1
            if not keep:
                return


ServerFactory = Callable[..., Awaitable[RawServer]]


@pytest.fixture
async def serve() -> AsyncIterator[ServerFactory]:
    """``await serve(responder, idle_timeout_s=None)`` starts a :class:`RawServer`."""
    servers: list[RawServer] = []

    async def start(responder: Responder, idle_timeout_s: float | None = None) -> RawServer:
        server = RawServer(responder, idle_timeout_s)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


# --------------------------------------------------------------------------- response bytes


def http(
    status: int,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    *,
    version: str = "HTTP/1.1",
    length: bool = True,
) -> bytes:
    head = [f"{version} {status} Status"]
    head += [f"{k}: {v}" for k, v in headers]
    if length:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def chunked(
    parts: Sequence[bytes],
    *,
    extension: str = "",
    trailers: Sequence[tuple[str, str]] = (),
    status: int = 200,
) -> bytes:
    out = f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    for part in parts:
        out += f"{len(part):x}{extension}\r\n".encode() + part + b"\r\n"
    out += b"0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in trailers) + b"\r\n"
    return out


def ok_json(doc: Any, headers: Sequence[tuple[str, str]] = ()) -> bytes:
    return http(200, json.dumps(doc).encode(), (("Content-Type", "application/json"), *headers))


def echo_doc(request: Request) -> dict[str, Any]:
    """One candidate carrying the request's pseudonym as its name and its bbox's min_lon as lon."""
    doc = request.json()
    return {
        "candidates": [
            {
                "poi_id": "echo",
                "lat": 39.9,
                "lon": doc["region"]["bbox"][0],
                "category": doc.get("category", "cafe"),
                "name": doc["pseudonym"],
            }
        ]
    }


async def echo(request: Request, writer: asyncio.StreamWriter) -> bool:
    writer.write(ok_json(echo_doc(request)))
    return True


def script(*replies: bytes) -> Responder:
    """Answer the i-th request with ``replies[i]`` (the last one repeats), keeping the connection."""

    calls = 0

    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        nonlocal calls
        writer.write(replies[min(calls, len(replies) - 1)])
        calls += 1
        return True

    return respond


async def hang(request: Request, writer: asyncio.StreamWriter) -> bool:
    await asyncio.sleep(3600)
    return False


async def close_without_answer(request: Request, writer: asyncio.StreamWriter) -> bool:
    return False


# --------------------------------------------------------------------------- client helpers


def new_metrics() -> Metrics:
    return Metrics(version="test", algorithm="hilbert")


def outcomes(metrics: Metrics) -> dict[str, int]:
    """Attempts per outcome, read from the ``kcloak_upstream_seconds`` histogram."""
    out: dict[str, int] = {}
    for outcome in OUTCOMES:
        value = metrics.registry.get_sample_value("kcloak_upstream_seconds_count", {"outcome": outcome})
        if value:
            out[outcome] = int(value)
    return out


def retries(metrics: Metrics) -> int:
    return int(metrics.registry.get_sample_value("kcloak_upstream_retries_total") or 0)


IN_PROCESSES = False
"""Set by :func:`where`: :func:`client` gives an ``UpstreamProcesses`` (one child process)."""


@pytest.fixture(autouse=True, params=["event-loop", "child-process"])
def where(request: pytest.FixtureRequest) -> str:
    global IN_PROCESSES
    IN_PROCESSES = request.param == "child-process"
    return str(request.param)


def client(url: str, metrics: Metrics | None = None, **options: Any) -> UpstreamClient | UpstreamProcesses:
    values: dict[str, Any] = {"timeout_s": 1.0, "retries": 2, "deadline_s": 4.0, "concurrency": 8}
    values.update(options)
    if IN_PROCESSES:
        return UpstreamProcesses(url=url, metrics=metrics, **values)
    return UpstreamClient(url=url, metrics=metrics, **values)


def range_request(**values: Any) -> SearchRequest:
    base: dict[str, Any] = {"kind": "range", "bbox": list(BBOX), "radius_m": 500.0, "category": "restaurant"}
    base.update(values)
    return SearchRequest(**base)


async def expect_failure(c: Upstream, request: SearchRequest | None = None) -> None:
    with pytest.raises(UpstreamError):
        await c.search(request or range_request())


# --------------------------------------------------------------------------- 1. framing


CANDIDATES_DOC = {
    "candidates": [
        {"poi_id": "n1", "lat": 39.90912, "lon": 116.39803, "category": "restaurant", "name": "Quanjude"},
        {"poi_id": "n2", "lat": -90, "lon": 180, "category": "restaurant", "name": "Pole"},
        {"poi_id": "n3", "lat": 39.5, "lon": -179.25, "category": "restaurant", "name": "饭馆", "extra": [1]},
    ],
    "next": None,
}
CANDIDATES = [
    Candidate("n1", 39.90912, 116.39803, "restaurant", "Quanjude"),
    Candidate("n2", -90.0, 180.0, "restaurant", "Pole"),
    Candidate("n3", 39.5, -179.25, "restaurant", "饭馆"),
]


async def test_content_length_answer_is_parsed_exactly(serve: ServerFactory) -> None:
    server = await serve(script(ok_json(CANDIDATES_DOC)))
    metrics = new_metrics()
    async with client(server.url, metrics) as c:
        assert c.healthy is None
        got = await c.search(range_request())
        assert c.healthy is True
    assert got == CANDIDATES
    assert all(isinstance(x.lat, float) and isinstance(x.lon, float) for x in got)
    assert outcomes(metrics) == {"ok": 1}
    assert retries(metrics) == 0


async def test_empty_candidate_list_is_a_valid_answer(serve: ServerFactory) -> None:
    server = await serve(script(ok_json({"candidates": []})))
    async with client(server.url) as c:
        assert await c.search(range_request()) == []


async def test_chunked_answer_with_extension_and_trailer(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        raw = json.dumps(echo_doc(request)).encode()
        parts = [raw[:1], raw[1:7], raw[7:30], raw[30:]]
        writer.write(chunked(parts, extension=";sig=abc", trailers=[("X-Checksum", "1234")]))
        return True

    server = await serve(respond)
    async with client(server.url) as c:
        for i in range(3):  # the trailer must be consumed fully for the next answer to be right
            got = await c.search(range_request(bbox=[116.0 + i, 39.0, 116.5 + i, 39.5]))
            assert got == [Candidate("echo", 39.9, 116.0 + i, "restaurant", server.requests[i].pseudonym)]
    assert len(server.requests) == 3


async def test_chunked_answer_of_exact_candidates(serve: ServerFactory) -> None:
    raw = json.dumps(CANDIDATES_DOC).encode()
    parts = [raw[i : i + 13] for i in range(0, len(raw), 13)]
    server = await serve(script(chunked(parts)))
    async with client(server.url) as c:
        assert await c.search(range_request()) == CANDIDATES


LARGE_DOC = {
    "candidates": [
        {"poi_id": f"p{i:06d}", "lat": 39.0 + i * 1e-5, "lon": 116.0 + i * 1e-5, "category": "cafe", "name": f"n{i}"}
        for i in range(20000)
    ]
}


@pytest.mark.parametrize("framing", ["content_length", "chunked", "close"])
async def test_large_answer_is_read_completely(serve: ServerFactory, framing: str) -> None:
    raw = json.dumps(LARGE_DOC).encode()  # about 2 MB: far more than one socket read
    replies = {
        "content_length": http(200, raw, [("Content-Type", "application/json")]),
        "chunked": chunked([raw[i : i + 300_000] for i in range(0, len(raw), 300_000)]),
        "close": http(200, raw, version="HTTP/1.0", length=False),
    }

    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(replies[framing])
        return framing != "close"

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics, timeout_s=5.0, deadline_s=8.0) as c:
        got = await c.search(range_request(category="cafe"))
    assert len(got) == 20000
    assert got[0] == Candidate("p000000", 39.0, 116.0, "cafe", "n0")
    assert got[-1] == Candidate("p019999", 39.0 + 19999e-5, 116.0 + 19999e-5, "cafe", "n19999")
    assert outcomes(metrics) == {"ok": 1}


async def test_informational_responses_are_skipped(serve: ServerFactory) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"

    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(interim + ok_json(echo_doc(request)))
        return True

    server = await serve(respond)
    async with client(server.url) as c:
        for i in range(2):
            got = await c.search(range_request(bbox=[10.0 + i, 1.0, 12.0, 2.0]))
            assert got == [Candidate("echo", 39.9, 10.0 + i, "restaurant", server.requests[i].pseudonym)]


@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1"])
async def test_close_delimited_answer(serve: ServerFactory, version: str) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        body = json.dumps(echo_doc(request)).encode()
        extra = [("Connection", "close")] if version == "HTTP/1.1" else []
        writer.write(http(200, body, [("Content-Type", "application/json"), *extra], version=version, length=False))
        return False  # the end of the body is the end of the connection

    server = await serve(respond)
    async with client(server.url) as c:
        for i in range(3):
            got = await c.search(range_request(bbox=[100.0 + i, 30.0, 101.0 + i, 31.0]))
            assert got == [Candidate("echo", 39.9, 100.0 + i, "restaurant", server.requests[i].pseudonym)]
    assert server.accepted == 3


async def test_connection_close_answers_make_the_client_reconnect(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(ok_json(echo_doc(request), [("Connection", "close")]))
        return False

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics) as c:
        for i in range(4):
            got = await c.search(range_request(bbox=[110.0 + i, 30.0, 110.5 + i, 30.5]))
            assert got[0].name == server.requests[i].pseudonym
            assert got[0].lon == 110.0 + i
    assert [r.conn for r in server.requests] == [0, 1, 2, 3]
    assert outcomes(metrics) == {"ok": 4}


# --------------------------------------------------------------------------- 2. keep-alive


async def test_sequential_searches_reuse_one_connection(serve: ServerFactory) -> None:
    server = await serve(echo)
    async with client(server.url) as c:
        for i in range(30):
            got = await c.search(range_request(bbox=[100.0 + i, 30.0, 101.0 + i, 31.0]))
            assert got[0].name == server.requests[i].pseudonym
    assert len(server.requests) == 30
    assert server.accepted <= 2, f"{server.accepted} connections for 30 sequential requests"


async def test_server_closing_an_idle_connection_is_not_a_failure(serve: ServerFactory) -> None:
    server = await serve(echo, idle_timeout_s=0.05)
    async with client(server.url) as c:
        for i in range(3):
            got = await c.search(range_request(bbox=[100.0 + i, 30.0, 101.0 + i, 31.0]))
            assert got[0].name == server.requests[-1].pseudonym
            assert got[0].lon == 100.0 + i
            await asyncio.sleep(0.25)  # the server closes the idle connection meanwhile
        assert c.healthy is True
    assert server.accepted >= 3


# --------------------------------------------------------------------------- 3. what is sent


@pytest.mark.parametrize(
    ("suffix", "target"),
    [("", "/v1/search"), ("/", "/v1/search"), ("/lbs", "/lbs/v1/search"), ("/lbs/", "/lbs/v1/search")],
)
async def test_request_line_and_framing(serve: ServerFactory, suffix: str, target: str) -> None:
    server = await serve(echo)
    async with client(server.url + suffix) as c:
        await c.search(range_request())
    (request,) = server.requests
    assert (request.method, request.target, request.version) == ("POST", target, "HTTP/1.1")
    content_type = request.header("content-type")
    assert content_type is not None and content_type.split(";")[0].strip() == "application/json"
    assert request.header("content-length") == str(len(request.body))
    assert request.header("transfer-encoding") is None
    assert request.header("user-agent") == f"kcloak/{__version__}"
    assert request.header("host") in (f"127.0.0.1:{server.port}", "127.0.0.1")


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (
            SearchRequest("range", list(BBOX), radius_m=500.0, category="restaurant"),
            {"kind": "range", "region": {"bbox": BBOX}, "radius_m": 500.0, "category": "restaurant"},
        ),
        (
            SearchRequest("range", list(BBOX), radius_m=250.5),
            {"kind": "range", "region": {"bbox": BBOX}, "radius_m": 250.5},
        ),
        (
            SearchRequest("knn", list(BBOX), n=3, category="cafe"),
            {"kind": "knn", "region": {"bbox": BBOX}, "n": 3, "category": "cafe"},
        ),
        (
            SearchRequest("knn", list(BBOX), n=1, t_start=1700000000, t_end=1700000060),
            {"kind": "knn", "region": {"bbox": BBOX, "t_start": 1700000000, "t_end": 1700000060}, "n": 1},
        ),
    ],
)
async def test_body_is_exactly_the_allow_list(
    serve: ServerFactory, request_: SearchRequest, expected: dict[str, Any]
) -> None:
    server = await serve(echo)
    async with client(server.url) as c:
        await c.search(request_)
        await c.search(request_)
    bodies = [r.json() for r in server.requests]
    pseudonyms = [b.pop("pseudonym") for b in bodies]
    assert bodies == [expected, expected]
    assert all(isinstance(p, str) and PSEUDONYM_RE.fullmatch(p) for p in pseudonyms)
    assert pseudonyms[0] != pseudonyms[1]


async def test_retries_carry_fresh_pseudonyms_and_the_same_body(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        if len(server.requests) < 3:
            writer.write(http(503, b'{"error":{"code":"overloaded","message":"busy"}}'))
        else:
            writer.write(ok_json(echo_doc(request)))
        return True

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics, retries=2) as c:
        got = await c.search(range_request())
    pseudonyms = [r.pseudonym for r in server.requests]
    assert len(pseudonyms) == 3 and len(set(pseudonyms)) == 3
    assert all(PSEUDONYM_RE.fullmatch(p) for p in pseudonyms)
    assert got[0].name == pseudonyms[-1]
    rest = [{k: v for k, v in r.json().items() if k != "pseudonym"} for r in server.requests]
    assert rest[0] == rest[1] == rest[2]
    assert retries(metrics) == 2
    assert outcomes(metrics) == {"http_error": 2, "ok": 1}


@pytest.mark.parametrize("token", [None, "", "op-wide-token.v1"])
async def test_authorization_only_with_a_token(serve: ServerFactory, token: str | None) -> None:
    server = await serve(echo)
    async with client(server.url, token=token) as c:
        await c.search(range_request())
        await c.search(range_request(kind="knn", radius_m=None, n=2))
    for request in server.requests:
        assert request.header("authorization") == (f"Bearer {token}" if token else None)


async def test_cookies_are_never_sent_back(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        cookies = [("Set-Cookie", f"sid=s{len(server.requests)}; Path=/"), ("Set-Cookie", "track=1; Max-Age=3600")]
        writer.write(ok_json(echo_doc(request), cookies))
        return True

    server = await serve(respond)
    async with client(server.url) as c:
        for _ in range(4):
            await c.search(range_request())
    assert len(server.requests) == 4
    assert all(r.header("cookie") is None for r in server.requests)


async def test_headers_are_the_same_for_every_query(serve: ServerFactory) -> None:
    server = await serve(echo)
    queries = [
        range_request(),
        range_request(bbox=[-10.0, -10.0, 10.0, 10.0], radius_m=20000.0, category=None),
        SearchRequest("knn", [0.0, 0.0, 0.001, 0.001], n=7, category="bank", t_start=1, t_end=2),
    ]
    async with client(server.url, token="tok") as c:
        for query in queries:
            await c.search(query)
    seen = [{k: v for k, v in r.headers if k != "content-length"} for r in server.requests]
    assert seen[0] == seen[1] == seen[2]
    # Contract §5: Content-Type, User-Agent and the operator's Authorization, besides HTTP/1.1 framing.
    names = {k for k, _ in server.requests[0].headers}
    assert names == {"host", "content-length", "content-type", "user-agent", "authorization"}


# --------------------------------------------------------------------------- 4. retries


@pytest.mark.parametrize("status", [503, 500, 502, 429])
async def test_retryable_status_then_success(serve: ServerFactory, status: int) -> None:
    server = await serve(script(http(status, b"{}", [("Retry-After", "0")]), ok_json({"candidates": [POI]})))
    metrics = new_metrics()
    async with client(server.url, metrics) as c:
        got = await c.search(range_request())
        assert c.healthy is True
    assert got == [Candidate("n1", 39.90912, 116.39803, "restaurant", "Quanjude")]
    assert len(server.requests) == 2
    assert retries(metrics) == 1
    assert outcomes(metrics) == {"http_error": 1, "ok": 1}


@pytest.mark.parametrize("n_retries", [0, 1, 2, 3])
async def test_persistent_5xx_fails_after_retries_plus_one_attempts(serve: ServerFactory, n_retries: int) -> None:
    server = await serve(script(http(500, b'{"error":{"code":"internal","message":"x"}}')))
    metrics = new_metrics()
    async with client(server.url, metrics, retries=n_retries) as c:
        await expect_failure(c)
        assert c.healthy is False
    assert len(server.requests) == n_retries + 1
    assert retries(metrics) == n_retries
    assert outcomes(metrics) == {"http_error": n_retries + 1}


@pytest.mark.parametrize(
    "reply",
    [
        http(404, b'{"error":{"code":"not_found","message":"x"}}'),
        http(400, b'{"error":{"code":"invalid","message":"x"}}'),
        http(401, b""),
        http(413, b""),
        http(302, b"", [("Location", "/v1/elsewhere")]),
        http(307, b"", [("Location", "/v1/search")]),
        http(204, b""),
    ],
    ids=["404", "400", "401", "413", "302", "307", "204"],
)
async def test_other_statuses_fail_at_once(serve: ServerFactory, reply: bytes) -> None:
    server = await serve(script(reply, ok_json({"candidates": []})))
    metrics = new_metrics()
    async with client(server.url, metrics) as c:
        await expect_failure(c)
        assert c.healthy is False
    assert [r.target for r in server.requests] == ["/v1/search"]  # no retry, no redirect followed
    assert retries(metrics) == 0
    assert outcomes(metrics) == {"http_error": 1}


async def test_connection_refused() -> None:
    metrics = new_metrics()
    async with client(f"http://127.0.0.1:{free_port()}", metrics, retries=2) as c:
        await expect_failure(c)
        assert c.healthy is False
    assert outcomes(metrics) == {"connection_error": 3}
    assert retries(metrics) == 2


async def test_accept_then_close_without_answer(serve: ServerFactory) -> None:
    server = await serve(close_without_answer)
    metrics = new_metrics()
    async with client(server.url, metrics, retries=2) as c:
        await expect_failure(c)
    assert outcomes(metrics) == {"connection_error": 3}
    assert retries(metrics) == 2
    assert len(server.requests) >= 3


async def test_connection_error_then_success(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        if len(server.requests) == 1:
            return False
        writer.write(ok_json(echo_doc(request)))
        return True

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics) as c:
        got = await c.search(range_request())
    assert got[0].name == server.requests[-1].pseudonym
    assert server.requests[0].pseudonym != server.requests[-1].pseudonym
    assert outcomes(metrics) == {"connection_error": 1, "ok": 1}
    assert retries(metrics) == 1


async def test_silent_server_times_out_per_attempt(serve: ServerFactory) -> None:
    server = await serve(hang)
    metrics = new_metrics()
    started = time.monotonic()
    async with client(server.url, metrics, timeout_s=0.2, retries=2, deadline_s=5.0) as c:
        await expect_failure(c)
    wall = time.monotonic() - started
    assert outcomes(metrics) == {"timeout": 3}
    assert retries(metrics) == 2
    assert len(server.requests) == 3
    per_attempt = (metrics.registry.get_sample_value("kcloak_upstream_seconds_sum", {"outcome": "timeout"}) or 0) / 3
    assert 0.18 <= per_attempt < 0.6
    assert 0.55 <= wall < 0.6 + 0.1 + 0.2 + 0.8  # three timeouts, at most 0.3 s of backoff, slack


async def test_stalled_body_times_out(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"candi')
        await writer.drain()
        await asyncio.sleep(3600)
        return False

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics, timeout_s=0.2, retries=1) as c:
        await expect_failure(c)
    assert outcomes(metrics) == {"timeout": 2}
    assert len(server.requests) == 2


@pytest.mark.parametrize(("timeout_s", "deadline_s"), [(0.3, 0.8), (5.0, 0.5)])
async def test_deadline_bounds_the_whole_search(serve: ServerFactory, timeout_s: float, deadline_s: float) -> None:
    server = await serve(hang)
    metrics = new_metrics()
    async with client(server.url, metrics, timeout_s=timeout_s, retries=20, deadline_s=deadline_s) as c:
        started = time.monotonic()
        await expect_failure(c)
        wall = time.monotonic() - started
        assert c.healthy is False
    assert wall < deadline_s + 0.5, wall
    assert wall >= min(timeout_s, deadline_s) - 0.05
    assert set(outcomes(metrics)) <= {"timeout"}
    assert len(server.requests) <= deadline_s / min(timeout_s, deadline_s) + 1


async def test_deadline_includes_waiting_for_a_free_slot(serve: ServerFactory) -> None:
    server = await serve(hang)
    async with client(server.url, timeout_s=5.0, retries=0, deadline_s=0.5, concurrency=1) as c:
        started = time.monotonic()
        results = await asyncio.gather(*(c.search(range_request()) for _ in range(3)), return_exceptions=True)
        wall = time.monotonic() - started
    assert all(isinstance(r, UpstreamError) for r in results), results
    assert wall < 0.5 + 0.5, wall
    assert 1 <= len(server.requests) <= 3


# --------------------------------------------------------------------------- 5. invalid answers


def candidate_json(**changes: Any) -> bytes:
    poi: dict[str, Any] = dict(POI)
    for key, value in changes.items():
        if value is ...:
            del poi[key]
        else:
            poi[key] = value
    return json.dumps({"candidates": [POI, poi]}).encode()


INVALID_BODIES = {
    "not_json": b"<html>busy</html>",
    "truncated_json": b'{"candidates": [',
    "not_utf8": b'{"candidates": [], "x": "\xff\xfe"}',
    "empty": b"",
    "top_level_list": b"[]",
    "no_candidates": b'{"results": []}',
    "candidates_not_list": b'{"candidates": {"n1": {}}}',
    "candidate_not_object": b'{"candidates": ["n1"]}',
    "nan_lat": json.dumps({"candidates": [POI]}).replace("39.90912", "NaN").encode(),
    "infinity_lon": json.dumps({"candidates": [POI]}).replace("116.39803", "Infinity").encode(),
    "minus_infinity_lat": json.dumps({"candidates": [POI]}).replace("39.90912", "-Infinity").encode(),
    "lat_over_90": candidate_json(lat=90.000001),
    "lat_under_minus_90": candidate_json(lat=-91),
    "lon_over_180": candidate_json(lon=180.5),
    "missing_poi_id": candidate_json(poi_id=...),
    "empty_poi_id": candidate_json(poi_id=""),
    "numeric_poi_id": candidate_json(poi_id=12),
    "missing_lat": candidate_json(lat=...),
    "missing_lon": candidate_json(lon=...),
    "bool_lat": candidate_json(lat=True),
    "bool_lon": candidate_json(lon=False),
    "string_lat": candidate_json(lat="39.9"),
    "null_lon": candidate_json(lon=None),
    "missing_category": candidate_json(category=...),
    "wrong_category": candidate_json(category="cafe"),
}


@pytest.mark.parametrize("body", list(INVALID_BODIES.values()), ids=list(INVALID_BODIES))
async def test_invalid_answer_fails_at_once(serve: ServerFactory, body: bytes) -> None:
    server = await serve(script(http(200, body, [("Content-Type", "application/json")]), ok_json({"candidates": []})))
    metrics = new_metrics()
    async with client(server.url, metrics) as c:
        await expect_failure(c, range_request(category="restaurant"))
        assert c.healthy is False
    assert len(server.requests) == 1
    assert retries(metrics) == 0
    assert outcomes(metrics) == {"invalid_response": 1}


async def test_any_category_is_accepted_without_a_requested_category(serve: ServerFactory) -> None:
    server = await serve(script(http(200, candidate_json(category="cafe"))))
    async with client(server.url) as c:
        got = await c.search(range_request(category=None))
    assert [x.category for x in got] == ["restaurant", "cafe"]


def padded(size: int) -> bytes:
    """A valid empty answer of exactly ``size`` bytes (JSON allows trailing whitespace)."""
    head = b'{"candidates": []}'
    return head + b" " * (size - len(head))


async def test_answer_of_exactly_the_limit_is_accepted(serve: ServerFactory) -> None:
    server = await serve(script(http(200, padded(MAX_RESPONSE_BYTES), [("Content-Type", "application/json")])))
    async with client(server.url, timeout_s=5.0, deadline_s=8.0) as c:
        assert await c.search(range_request()) == []


async def test_oversize_answer_announced_by_content_length(serve: ServerFactory) -> None:
    server = await serve(script(http(200, padded(MAX_RESPONSE_BYTES + 1), [("Content-Type", "application/json")])))
    metrics = new_metrics()
    async with client(server.url, metrics, timeout_s=5.0, deadline_s=8.0) as c:
        await expect_failure(c)
    assert outcomes(metrics) == {"invalid_response": 1}
    assert len(server.requests) == 1


async def test_oversize_chunked_answer(serve: ServerFactory) -> None:
    body = padded(MAX_RESPONSE_BYTES + 1)
    step = 1 << 20
    server = await serve(script(chunked([body[i : i + step] for i in range(0, len(body), step)])))
    metrics = new_metrics()
    async with client(server.url, metrics, timeout_s=5.0, deadline_s=8.0) as c:
        await expect_failure(c)
    assert outcomes(metrics) == {"invalid_response": 1}
    assert len(server.requests) == 1


async def test_oversize_close_delimited_answer(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(http(200, padded(MAX_RESPONSE_BYTES + 1), version="HTTP/1.0", length=False))
        return False

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics, timeout_s=5.0, deadline_s=8.0) as c:
        await expect_failure(c)
    assert outcomes(metrics) == {"invalid_response": 1}


GARBAGE = {
    "hello": b"HELLO\r\n\r\n",
    "bad_status_code": b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\n{}",
    "bad_header_line": b"HTTP/1.1 200 OK\r\nthis is no header\r\nContent-Length: 18\r\n\r\n" + b'{"candidates": []}',
    "bad_content_length": b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n{}",
    "bad_chunk_size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "binary": bytes(range(256)),
}


@pytest.mark.parametrize("reply", list(GARBAGE.values()), ids=list(GARBAGE))
async def test_garbage_is_an_upstream_error(serve: ServerFactory, reply: bytes) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(reply)
        return False

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics, timeout_s=0.5, deadline_s=3.0) as c:
        await expect_failure(c)
        assert c.healthy is False
    seen = outcomes(metrics)
    assert seen and set(seen) <= {"invalid_response", "connection_error"}, seen
    assert sum(seen.values()) == retries(metrics) + 1  # one observation per attempt


async def test_truncated_body_is_an_upstream_error(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"candidates": [')
        return False

    server = await serve(respond)
    metrics = new_metrics()
    async with client(server.url, metrics) as c:
        await expect_failure(c)
    seen = outcomes(metrics)
    assert seen and set(seen) <= {"invalid_response", "connection_error"}, seen


# --------------------------------------------------------------------------- 6. concurrency


async def test_concurrency_limit(serve: ServerFactory) -> None:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.02)
        writer.write(ok_json(echo_doc(request)))
        return True

    server = await serve(respond)
    metrics = new_metrics()
    queries = [range_request(bbox=[100.0 + i / 100, 30.0, 101.0, 31.0]) for i in range(50)]
    async with client(server.url, metrics, concurrency=4, deadline_s=10.0) as c:
        results = await asyncio.gather(*(c.search(q) for q in queries))
    for query, got in zip(queries, results, strict=True):
        assert len(got) == 1 and got[0].lon == query.bbox[0]
    assert sorted(got[0].name for got in results) == sorted(r.pseudonym for r in server.requests)
    assert len(server.requests) == 50
    assert server.max_open <= 4, server.max_open
    assert 2 <= server.max_in_flight <= 4, server.max_in_flight
    assert outcomes(metrics) == {"ok": 50}


# --------------------------------------------------------------------------- 7. cancellation


async def test_cancelled_search_does_not_poison_the_pool(serve: ServerFactory) -> None:
    slow_seen = asyncio.Event()
    next_seen = asyncio.Event()

    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        min_lon = request.json()["region"]["bbox"][0]
        if min_lon == 2.0:  # the search that gets cancelled
            slow_seen.set()
            # Answer late: after the next request was sent (or after a while, if the client
            # wrongly queued it behind this one on the same connection).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.6):
                    await next_seen.wait()
        elif min_lon == 3.0:
            next_seen.set()
        writer.write(ok_json(echo_doc(request)))
        return True

    def sent(min_lon: float) -> Request:
        (request,) = [r for r in server.requests if r.json()["region"]["bbox"][0] == min_lon]
        return request

    server = await serve(respond)
    async with client(server.url, concurrency=1, timeout_s=2.0, deadline_s=4.0) as c:
        warm = await c.search(range_request(bbox=[1.0, 1.0, 2.0, 2.0]))  # leaves a pooled connection
        assert warm[0].name == sent(1.0).pseudonym
        slow = asyncio.create_task(c.search(range_request(bbox=[2.0, 2.0, 3.0, 3.0])))
        async with asyncio.timeout(2.0):
            await slow_seen.wait()
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        async with asyncio.timeout(3.0):  # with concurrency=1 this also shows the slot was released
            got = await c.search(range_request(bbox=[3.0, 3.0, 4.0, 4.0]))
        assert got == [Candidate("echo", 39.9, 3.0, "restaurant", sent(3.0).pseudonym)]
        await asyncio.sleep(0.1)  # the late answer to the cancelled search is sent (or dropped) meanwhile
        got = await c.search(range_request(bbox=[4.0, 4.0, 5.0, 5.0]))
        assert got == [Candidate("echo", 39.9, 4.0, "restaurant", sent(4.0).pseudonym)]
        assert c.healthy is True


async def test_cancelled_waiter_releases_nothing_it_did_not_take(serve: ServerFactory) -> None:
    release = asyncio.Event()

    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        await release.wait()
        writer.write(ok_json(echo_doc(request)))
        return True

    server = await serve(respond)
    async with client(server.url, concurrency=1, deadline_s=4.0) as c:
        running = asyncio.create_task(c.search(range_request()))
        while not server.requests:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(c.search(range_request()))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        after = [asyncio.create_task(c.search(range_request(bbox=[50.0 + i, 1.0, 51.0, 2.0]))) for i in range(3)]
        await asyncio.sleep(0.1)
        assert server.max_in_flight == 1 and server.max_open == 1  # still one slot
        release.set()
        first = await running
        rest = await asyncio.gather(*after)
    assert first[0].name == server.requests[0].pseudonym
    assert [r[0].lon for r in rest] == [50.0, 51.0, 52.0]


# --------------------------------------------------------------------------- health and metrics


async def test_healthy_follows_the_last_search(serve: ServerFactory) -> None:
    server = await serve(script(ok_json({"candidates": []}), http(404, b""), ok_json({"candidates": []})))
    async with client(server.url) as c:
        assert c.healthy is None
        await c.search(range_request())
        assert c.healthy is True
        await expect_failure(c)
        assert c.healthy is False
        await c.search(range_request())
        assert c.healthy is True


async def test_works_without_metrics(serve: ServerFactory) -> None:
    server = await serve(script(http(503, b""), ok_json({"candidates": [POI]})))
    async with client(server.url, None) as c:
        assert len(await c.search(range_request())) == 1
