"""Attack: connections that never finish a request (slowloris) or never send one.

Each open connection costs the broker a socket and a task; a client that connects and sends
nothing, trickles a request line byte by byte, stalls in the middle of a body, or idles on a
keep-alive connection must not hold them forever. Extension (docs/contract-extensions.md):
``[http] head_timeout_s`` (10 s) bounds the time to a complete request head, idle keep-alive
included; ``[http] body_timeout_s`` (30 s) bounds the time to read a body. Tested with raw
sockets and both bounds set to about a second.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conformance.conftest import ROOT, Served, Servers, kcloak

HEAD_S = 1.0
BODY_S = 1.0
SLACK_S = 1.5  # scheduling slack on a busy two-core machine


def _served(servers: Servers, tmp_path: Path) -> Served:
    config = tmp_path / "kcloak.toml"
    config.write_text(f"[http]\nhead_timeout_s = {HEAD_S}\nbody_timeout_s = {BODY_S}\n", encoding="utf-8")
    return servers.serve("--config", str(config), mqtt=False)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Read until the server closes the connection; (closed in time, bytes received)."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + seconds
    got = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def test_silent_and_trickling_connections_are_closed(servers: Servers, tmp_path: Path) -> None:
    served = _served(servers, tmp_path)
    addr = ("127.0.0.1", served.http_port)

    with socket.create_connection(addr) as silent:
        started = time.monotonic()
        closed, _ = _closed_within(silent, HEAD_S + SLACK_S)
        assert closed, "a connection that sends nothing stays open"
        assert time.monotonic() - started >= HEAD_S * 0.8  # not closed at once either

    with socket.create_connection(addr) as half:
        half.sendall(b"GET /v1/info HT")
        closed, _ = _closed_within(half, HEAD_S + SLACK_S)
        assert closed, "half a request line keeps the connection open"

    with socket.create_connection(addr) as trickle:
        started = time.monotonic()
        closed = False
        for byte in b"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            try:
                trickle.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if time.monotonic() - started > HEAD_S + SLACK_S:
                break
            time.sleep(0.05)
        if not closed:
            closed, _ = _closed_within(trickle, 0.5)
        assert closed, "a request head trickled a byte at a time keeps the connection open"
        assert time.monotonic() - started < HEAD_S + SLACK_S + 0.5


def test_idle_keep_alive_and_stalled_body_are_closed(servers: Servers, tmp_path: Path) -> None:
    served = _served(servers, tmp_path)
    addr = ("127.0.0.1", served.http_port)

    with socket.create_connection(addr) as keep:
        keep.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
        keep.settimeout(5)
        first = keep.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        # a second request within the bound is served on the same connection
        time.sleep(HEAD_S / 3)
        keep.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
        assert keep.recv(65536).startswith(b"HTTP/1.1 200")
        closed, _ = _closed_within(keep, HEAD_S + SLACK_S)
        assert closed, "an idle keep-alive connection stays open"

    with socket.create_connection(addr) as body:
        body.sendall(
            b"PUT /v1/users/alice/profile HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"k": '
        )
        closed, reply = _closed_within(body, BODY_S + SLACK_S)
        assert closed, "a stalled body keeps the connection open"
        if reply:  # a response, if any, is the contract's error body
            assert reply.startswith(b"HTTP/1.1 400") and b'"code": "invalid"' in reply, reply


@pytest.mark.parametrize("key", ["head_timeout_s = 10.0", "body_timeout_s = 30.0"])
def test_timeouts_are_printed_configuration(key: str) -> None:
    out = subprocess.run(kcloak("serve", "--print-config"), cwd=ROOT, capture_output=True, check=True, text=True)
    assert key in out.stdout
