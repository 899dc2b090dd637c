"""Attack: malformed HTTP that makes the server quote the request back and into its log.

aiohttp's parser errors carry the first bytes of the offending line ("Got more than 8190 bytes
when reading: b'/v1/users/alice...'", "Bad status line ... b'GET /x MARKER'"), and its default
error handler both logs them with the stack and answers them as plain text: user ids and bearer
tokens reach the log and are echoed to whoever sent them. Contract §4 and §10: every 4xx is the
contract's error body with a generic message; nothing submitted is echoed or logged.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import Any

from tests.conformance.conftest import Servers, metric

MARK = "Zq7mK3xV"  # a unique string planted in every request below


def _exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], Any, bytes]:
    """Send raw bytes, read until the server closes (or the response is complete)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(timeout)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # the server may answer and close before reading everything
        raw = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            raw += chunk
            head, sep, body = raw.partition(b"\r\n\r\n")
            if sep:
                length = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                if length and len(body) >= int(length[0].split(b":")[1]):
                    break
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body.decode("latin-1")
    return status, headers, parsed, raw


LONG = "x" * 9000
CASES: list[tuple[str, bytes, int | None, str]] = [
    (
        "request line over 8190 bytes",
        f"GET /v1/users/{MARK}{LONG}/profile HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        413,
        "too_large",
    ),
    (
        "header over 8190 bytes (a bearer token)",
        f"GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {MARK}{LONG}\r\n\r\n".encode(),
        413,
        "too_large",
    ),
    (
        "header name over 8190 bytes",
        f"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-{MARK}{LONG}: 1\r\n\r\n".encode(),
        413,
        "too_large",
    ),
    ("malformed request line", f"GET /v1/users/{MARK}/profile {MARK}\r\n\r\n".encode(), 400, "invalid"),
    ("unknown method", f"{MARK} /v1/users/{MARK}/profile HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 400, "invalid"),
    (
        "bad Content-Length",
        f"PUT /v1/users/{MARK}/profile HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: 1{MARK}\r\n\r\n{{}}".encode(),
        400,
        "invalid",
    ),
    (
        "two different Content-Lengths",
        f"PUT /v1/users/{MARK}/profile HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}".encode(),
        400,
        "invalid",
    ),
    (
        "invalid chunked encoding",
        f"PUT /v1/users/{MARK}/profile HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Transfer-Encoding: chunked\r\n\r\n{MARK}\r\n{{}}\r\n0\r\n\r\n".encode(),
        400,
        "invalid",
    ),
    (
        "non-UTF-8 bytes in the path",
        b"GET /v1/users/\xff\xfe" + MARK.encode() + b"/profile HTTP/1.1\r\nHost: x\r\n\r\n",
        400,
        "invalid",
    ),
    (
        "percent-encoded non-UTF-8 in the path",
        f"GET /v1/users/%ff%fe{MARK}/profile HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        400,
        "invalid",
    ),
    (
        "control character in a header",
        f"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-A: {MARK}\x01{MARK}\r\n\r\n".encode(),
        400,
        "invalid",
    ),
    (
        "too many headers",
        ("GET /v1/info HTTP/1.1\r\nHost: x\r\n" + "".join(f"X-{i}: {MARK}\r\n" for i in range(200)) + "\r\n").encode(),
        None,  # 400 or 413, both are fine
        "",
    ),
]


def test_malformed_requests_get_generic_contract_errors(servers: Servers) -> None:
    served = servers.serve(mqtt=False)
    answered = 0
    for name, data, want_status, want_code in CASES:
        status, headers, body, raw = _exchange(served.http_port, data)
        assert MARK.encode() not in raw and MARK.lower().encode() not in raw.lower(), (name, raw[:300])
        assert headers.get("content-type", "").startswith("application/json"), (name, raw[:300])
        assert isinstance(body, dict) and set(body) == {"error"}, (name, body)
        if want_status is None:
            assert (status, body["error"]["code"]) in ((400, "invalid"), (413, "too_large")), (name, body)
        else:
            assert status == want_status and body["error"]["code"] == want_code, (name, status, body)
        assert set(body["error"]) <= {"code", "message", "field"}, (name, body)
        answered += 1
    logs = served.logs()
    assert MARK not in logs and MARK.lower() not in logs.lower()
    text = served.metrics()
    assert MARK not in text
    bad = sum(metric(text, "kcloak_http_requests_total", status=s) for s in ("400", "413"))
    assert bad >= answered
    assert metric(text, "kcloak_http_requests_total", status="500") == 0
    # the broker still serves well-formed requests
    status, _, body, _ = _exchange(served.http_port, b"GET /v1/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200 and body["auth"] == "open"
