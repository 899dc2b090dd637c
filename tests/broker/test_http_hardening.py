"""The HTTP door under hostile or unlucky input: huge numbers, odd digits, full disks, malformed
HTTP, idle and stalled connections. Real broker, real sockets on 127.0.0.1, real SQLite."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from kcloak.broker.service import Broker
from kcloak.core.logs import JsonFormatter
from tests.broker.conftest import SpyUpstream, broker_config

MARK = "Qx9vT4pL"


async def _raw(port: int | None, data: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send raw bytes; read until the server closes (True) or ``timeout`` passes (False)."""
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        got = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return got, False
            try:
                chunk = await asyncio.wait_for(reader.read(65536), remaining)
            except TimeoutError:
                return got, False
            except ConnectionResetError:
                return got, True
            if not chunk:
                return got, True
            got += chunk
    finally:
        writer.close()


def _split(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    fmt = JsonFormatter()
    return "\n".join(fmt.format(r) for r in caplog.records)


@pytest.fixture
async def broker(tmp_path: Path, spy: SpyUpstream) -> AsyncIterator[Broker]:
    cfg = broker_config(tmp_path, spy.url, **{"http.head_timeout_s": 0.5, "http.body_timeout_s": 0.5})
    async with Broker(config=cfg) as b:
        yield b


async def test_huge_integer_in_a_fix_is_invalid_not_500(broker: Broker) -> None:
    base = f"http://127.0.0.1:{broker.http_port}"
    async with ClientSession() as http:
        for lat in ("1" + "0" * 4999, "1" + "0" * 399):
            raw = f'{{"t": {time.time()}, "lat": {lat}, "lon": 1}}'
            r = await http.post(
                f"{base}/v1/users/alice/location", data=raw, headers={"Content-Type": "application/json"}
            )
            assert r.status == 400, await r.text()
            assert (await r.json())["error"] == {"code": "invalid", "message": "lat: must be finite", "field": "lat"}


async def test_query_string_integers_are_ascii_digits(broker: Broker) -> None:
    base = f"http://127.0.0.1:{broker.http_port}"
    async with ClientSession() as http:
        for query in ("since=%C2%B2", "since=%D9%A3", "limit=%EF%BC%95", "since=1_0", "limit=%2B5"):
            r = await http.get(f"{base}/v1/published/windows?{query}")
            assert r.status == 400, (query, await r.text())
            assert (await r.json())["error"]["code"] == "invalid"
        r = await http.get(f"{base}/v1/published/windows?since=0&limit=3")
        assert r.status == 200


async def test_profile_write_on_full_disk_is_503_and_healthz_degraded(broker: Broker) -> None:
    assert broker.pipeline is not None
    conn: sqlite3.Connection = broker.pipeline.profiles._conn
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")  # SQLITE_FULL once the last page is full
    base = f"http://127.0.0.1:{broker.http_port}"
    async with ClientSession() as http:
        for i in range(2000):
            r = await http.put(f"{base}/v1/users/u{i}/profile", json={"k": 6})
            if r.status != 200:
                break
        assert r.status == 503, await r.text()
        assert r.headers["Retry-After"] == "1" and r.content_type == "application/json"
        assert (await r.json())["error"]["code"] == "overloaded"
        r = await http.get(f"{base}/healthz")
        body = await r.json()
        assert r.status == 503 and body["status"] == "degraded" and body["stores"]["profiles"] == "failing"
        assert body["stores"]["movement"] == "ok"
        metrics = await (await http.get(f"{base}/metrics")).text()
        assert 'kcloak_store_healthy{store="profiles"} 0.0' in metrics
        assert 'kcloak_profile_sets_total{reason="overloaded",status="refused",transport="http"}' in metrics
        conn.execute("PRAGMA max_page_count = 1000000")
        r = await http.put(f"{base}/v1/users/later/profile", json={"k": 6})
        assert r.status == 200
        r = await http.get(f"{base}/healthz")
        assert r.status == 200 and (await r.json())["status"] == "ok"
        metrics = await (await http.get(f"{base}/metrics")).text()
        assert 'kcloak_store_healthy{store="profiles"} 1.0' in metrics


async def test_trailing_newline_in_a_path_user_is_invalid(broker: Broker) -> None:
    base = f"http://127.0.0.1:{broker.http_port}"
    async with ClientSession() as http:
        r = await http.post(f"{base}/v1/users/alice%0A/location", json={"t": time.time(), "lat": 1, "lon": 1})
        assert r.status == 400 and (await r.json())["error"]["field"] == "user"
        r = await http.get(f"{base}/v1/users/alice%0A/profile")
        assert r.status == 400


async def test_a_handler_bug_is_the_contract_500_and_logs_no_message(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert broker.pipeline is not None

    def broken(user: str) -> Any:
        raise RuntimeError(f"{MARK} {user}")

    monkeypatch.setattr(broker.pipeline, "get_profile", broken)
    caplog.set_level(logging.DEBUG)
    base = f"http://127.0.0.1:{broker.http_port}"
    async with ClientSession() as http:
        r = await http.get(f"{base}/v1/users/alice/profile")
        assert r.status == 500 and r.content_type == "application/json"
        assert (await r.json()) == {"error": {"code": "internal", "message": "internal error"}}
    logged = _logged(caplog)
    assert "http_handler_failed" in logged and "RuntimeError" in logged
    assert MARK not in logged and "alice" not in logged


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (f"GET /v1/users/{MARK}{'x' * 9000}/profile HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 413, "too_large"),
        (
            f"GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {MARK}{'y' * 9000}\r\n\r\n".encode(),
            413,
            "too_large",
        ),
        (f"GET /v1/users/{MARK} {MARK}\r\n\r\n".encode(), 400, "invalid"),
        (f"PUT /v1/users/a/profile HTTP/1.1\r\nHost: x\r\nContent-Length: {MARK}\r\n\r\n{{}}".encode(), 400, "invalid"),
        (
            f"PUT /v1/users/a/profile HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            f"{MARK}\r\n{{}}\r\n0\r\n\r\n".encode(),
            400,
            "invalid",
        ),
        (b"GET /v1/users/\xff" + MARK.encode() + b"/profile HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid"),
    ],
    ids=["long-line", "long-header", "bad-line", "bad-length", "bad-chunk", "non-utf8-path"],
)
async def test_malformed_http_is_answered_generically_and_not_logged(
    broker: Broker, caplog: pytest.LogCaptureFixture, data: bytes, status: int, code: str
) -> None:
    caplog.set_level(logging.DEBUG)
    raw, closed = await _raw(broker.http_port, data)
    assert closed and MARK.encode() not in raw
    got_status, headers, body = _split(raw)
    assert (got_status, body["error"]["code"]) == (status, code)
    assert headers["content-type"].startswith("application/json")
    assert MARK not in _logged(caplog)
    assert "http_request_malformed" in _logged(caplog)


async def test_metric_method_label_is_a_fixed_set(broker: Broker) -> None:
    raw, _ = await _raw(broker.http_port, b"PURGE /v1/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    status, _, body = _split(raw)
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    async with ClientSession() as http:
        metrics = await (await http.get(f"http://127.0.0.1:{broker.http_port}/metrics")).text()
    assert "PURGE" not in metrics and 'method="other"' in metrics


async def test_idle_connections_and_partial_heads_are_closed(broker: Broker) -> None:
    loop = asyncio.get_running_loop()
    for data in (b"", b"GET /v1/info HT", b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n"):  # the last: keep-alive idle
        started = loop.time()
        raw, closed = await _raw(broker.http_port, data, timeout=3.0)
        assert closed, data
        assert 0.3 <= loop.time() - started < 2.5, data
        assert raw.startswith(b"HTTP/1.1 200") == bool(data.endswith(b"\r\n\r\n"))


async def test_stalled_body_is_refused_and_closed(broker: Broker) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    head = (
        b"PUT /v1/users/alice/profile HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{"
    )
    raw, closed = await _raw(broker.http_port, head, timeout=3.0)
    assert closed and loop.time() - started < 2.5
    status, _, body = _split(raw)
    assert status == 400 and body["error"]["code"] == "invalid" and body["error"]["message"].startswith("body:")
