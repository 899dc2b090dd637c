"""The single-fix head reader against a full HTTP parser: every head it accepts reads, in a real
aiohttp server on loopback fed the same bytes, as the same method, path, user, token, body and
keep-alive; every proper prefix of an accepted head waits for more; nothing makes it raise."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.wire.fix_requests import DECLINE, INCOMPLETE, MAX_HEAD_BYTES, FixHead, read_fix_head
from tests.wire.fix_request_shapes import fix_requests, users

LIMIT = 65536
BODY = b'{"t": 1790000000.5, "lat": 39.9, "lon": 116.4}'


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    seen = {
        "method": request.method,
        "path": request.raw_path,
        "version": list(request.version),
        "keep_alive": request.keep_alive,
        "authorization": request.headers.get("Authorization"),
        "content_type": request.content_type,
        "body": body.decode("latin-1"),
    }
    return web.json_response(seen)


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await runner.cleanup()


async def _as_aiohttp_reads(port: int, raw: bytes) -> dict[str, object]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")) if k.lower() == b"content-length"
        )
        answer = await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()
    assert status == 200, (raw, status, answer)
    seen: dict[str, object] = json.loads(answer)
    return seen


def _same_reading(head: FixHead, raw: bytes, seen: dict[str, object]) -> None:
    assert seen["method"] == "POST"
    assert seen["path"] == f"/v1/users/{head.user}/location"
    assert seen["version"] == [1, 1]
    assert seen["keep_alive"] is (not head.close)
    assert seen["authorization"] == head.authorization
    assert seen["content_type"] == "application/json"  # what the aiohttp route takes
    assert seen["body"] == raw[head.end : head.end + head.length].decode("latin-1")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=fix_requests(BODY, ["tok1", "t-2.x"]))
async def test_an_accepted_head_reads_as_a_full_parser_reads_it(echo: int, raw: bytes) -> None:
    found = read_fix_head(raw, LIMIT)
    if isinstance(found, FixHead):
        missing = found.end + found.length - len(raw)
        if missing > 0:  # the head declares more body than was drawn: a client sends the rest
            raw += b" " * missing
        _same_reading(found, raw, await _as_aiohttp_reads(echo, raw))
        for cut in range(found.end):
            assert read_fix_head(raw[:cut], LIMIT) == INCOMPLETE, cut
    else:
        assert found == DECLINE  # the whole request is here: nothing to wait for


@given(user=users, auth=st.sampled_from([None, "Bearer abc", "bearer  x.y"]), close=st.booleans())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_the_plain_forms_of_http_clients_are_accepted(
    echo: int, user: str, auth: str | None, close: bool
) -> None:
    lines = [
        f"POST /v1/users/{user}/location HTTP/1.1",
        "Host: 127.0.0.1:8470",
        "User-Agent: okhttp/4.12.0",
        "Accept-Encoding: gzip",
        "Content-Type: application/json; charset=utf-8",  # OkHttp's, for a JSON string body
        f"Content-Length: {len(BODY)}",
    ]
    if auth is not None:
        lines.append(f"Authorization: {auth}")
    if close:
        lines.append("Connection: close")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + BODY
    found = read_fix_head(raw, LIMIT)
    assert isinstance(found, FixHead)
    assert (found.user, found.length, found.authorization, found.close) == (user, len(BODY), auth, close)
    _same_reading(found, raw, await _as_aiohttp_reads(echo, raw))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", INCOMPLETE),
        (b"POST /v1/us", INCOMPLETE),
        (b"POST /v1/users/u1/location HTTP/1.1\r\nHost: x\r\n", INCOMPLETE),
        (b"GET /v1/users/u1/profile HTTP/1.1\r\n", DECLINE),
        (b"PO", INCOMPLETE),
        (b"PUT", DECLINE),
        (b"POST /v1/users/u1/location HTTP/1.1\nHost: x\n", DECLINE),  # bare LF: a full parser decides
        (b"POST /v1/users/" + b"a" * MAX_HEAD_BYTES, DECLINE),  # a head too long to wait for
        (b"POST /v1/users/u1/location HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", DECLINE),  # over the limit
        (b"POST /v1/users/u1/location HTTP/1.1\r\nContent-Type: application/json\r\n\r\n", DECLINE),  # no length
    ],
)
def test_what_waits_and_what_is_handed_on(raw: bytes, expected: str) -> None:
    assert read_fix_head(raw, LIMIT) == expected


@given(
    st.binary(max_size=300)
    | st.builds(lambda a, b: b"POST /v1/users/" + a + b"\r\n\r\n" + b, st.binary(max_size=80), st.binary(max_size=40))
)
def test_any_bytes_give_an_answer(raw: bytes) -> None:
    found = read_fix_head(raw, LIMIT)
    assert isinstance(found, FixHead) or found in (INCOMPLETE, DECLINE)
