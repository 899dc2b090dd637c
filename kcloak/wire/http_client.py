"""A lean HTTP/1.1 client: keep-alive connections to one origin, one request in flight on each.

The broker sends one upstream request per query and the simulators send one request per update,
so the client's cost per request bounds their throughput. aiohttp's client costs about as much
CPU as the server it talks to (in the broker it was about half of the time spent on a query);
this one speaks only what these callers need and costs a fraction of that:

* ``http`` and ``https`` origins (TLS through :mod:`ssl`, server name checked), a pool of at most
  ``connections`` keep-alive connections, requests beyond waiting for a free one;
* responses framed by ``Content-Length``, ``Transfer-Encoding: chunked`` (extensions and trailers
  skipped) or the end of the connection; informational (1xx) responses skipped; ``Connection:
  close`` and HTTP/1.0 honoured; ``Content-Encoding`` other than identity refused (no
  ``Accept-Encoding`` is sent: the only headers are ``Host``, the caller's fixed ones and framing);
* bounded: response heads up to ``max_head`` bytes, bodies up to ``max_body`` bytes, the whole
  exchange (waiting for a connection included) within ``timeout_s``;
* a request on a reused connection that the server had closed while idle is sent once more on a
  new connection (only if no byte of a response arrived); nothing else is retried here.

Failures raise :class:`HttpTimeout`, :class:`HttpConnectionError` or :class:`HttpProtocolError`
(all :class:`HttpClientError`). A connection is reused only after a complete response, so a timeout or
a cancellation never leaves a half-read connection in the pool. No cookies are ever kept.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from kcloak.wire.errors import WireError
from kcloak.wire.reads import BufferedStreamProtocol

DEFAULT_MAX_HEAD = 64 * 1024
DEFAULT_MAX_BODY = 64 * 1024 * 1024


class HttpClientError(WireError):
    """The request did not produce a complete HTTP response."""


class HttpTimeout(HttpClientError):
    """No complete response within the timeout."""


class HttpConnectionError(HttpClientError):
    """Could not connect, or the connection broke before the response was complete."""


class HttpProtocolError(HttpClientError):
    """The peer's response is not valid HTTP/1.1, or exceeds the size limits."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Origin:
    """Scheme, host and port of a URL, and its path (without a trailing slash)."""

    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        """Raises ValueError for anything but an absolute ``http``/``https`` URL without query or fragment."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"the URL may not carry credentials, a query or a fragment: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


class _Stale(WireError):
    """A reused connection was closed by the server before any byte of the response arrived."""


class _Connection:
    __slots__ = ("reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def usable(self) -> bool:
        """Open, and nothing unsolicited waiting (a stray byte would be read as the next response)."""
        return not self.writer.is_closing() and not self.reader.at_eof() and not getattr(self.reader, "_buffer", b"")

    def close(self) -> None:
        self.writer.close()

    async def exchange(self, request: bytes, max_body: int) -> tuple[HttpResponse, bool]:
        """Send ``request``; the response and whether the connection may be reused."""
        self.writer.write(request)
        reader = self.reader
        may_be_stale = self.reused
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if may_be_stale and not exc.partial:
                    raise _Stale from None
                raise HttpConnectionError("the connection closed before the response was complete") from None
            except ConnectionError:  # reset: on a reused connection, the server dropped it while idle
                if may_be_stale:
                    raise _Stale from None
                raise
            except asyncio.LimitOverrunError:
                raise HttpProtocolError("the response head is too long") from None
            may_be_stale = False
            lines = head[:-4].split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            code = rest[:3]
            if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
                raise HttpProtocolError("malformed status line")
            status = int(code)
            if status >= 200 or status == 101:
                break
        length: int | None = None
        chunked = False
        keep = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, colon, raw_value = line.partition(b":")
            if not colon:
                raise HttpProtocolError("malformed header line")
            name = name.strip().lower()
            value = raw_value.strip().lower()
            if name == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise HttpProtocolError("invalid Content-Length")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
                if not chunked and value != b"identity":
                    raise HttpProtocolError("unsupported Transfer-Encoding")
            elif name == b"connection":
                tokens = {t.strip() for t in value.split(b",")}
                if b"close" in tokens:
                    keep = False
                elif b"keep-alive" in tokens:
                    keep = True
            elif name == b"content-encoding" and value not in (b"identity", b""):
                raise HttpProtocolError("unsupported Content-Encoding")
        if status == 101:
            raise HttpProtocolError("unexpected protocol switch")
        try:
            if status in (204, 304):
                body = b""
            elif chunked:
                body = await self._chunked(max_body)
            elif length is not None:
                if length > max_body:
                    raise HttpProtocolError("the response body is too large")
                body = await reader.readexactly(length)
            else:
                body = await self._until_eof(max_body)
                keep = False
        except asyncio.IncompleteReadError:
            raise HttpConnectionError("the connection closed before the response was complete") from None
        except asyncio.LimitOverrunError:
            raise HttpProtocolError("a chunk header is too long") from None
        return HttpResponse(status, body), keep

    async def _chunked(self, max_body: int) -> bytes:
        reader = self.reader
        parts: list[bytes] = []
        total = 0
        while True:
            size_line = (await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise HttpProtocolError("malformed chunk size") from None
            if size < 0:
                raise HttpProtocolError("malformed chunk size")
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, then the empty line
                    pass
                return b"".join(parts)
            total += size
            if total > max_body:
                raise HttpProtocolError("the response body is too large")
            parts.append(await reader.readexactly(size))
            if await reader.readexactly(2) != b"\r\n":
                raise HttpProtocolError("malformed chunk")

    async def _until_eof(self, max_body: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while chunk := await self.reader.read(256 * 1024):
            total += len(chunk)
            if total > max_body:
                raise HttpProtocolError("the response body is too large")
            parts.append(chunk)
        return b"".join(parts)


class HttpPool:
    """Keep-alive HTTP/1.1 connections to one origin (async context manager).

    Keyword-only arguments:
        scheme: ``http`` (default) or ``https``; host, port: the origin.
        connections: most connections open at once; default 64.
        timeout_s: default limit for one request (waiting for a connection, connecting, sending,
            the full response); default 60.
        headers: sent with every request (e.g. ``User-Agent``); ``Host``, ``Content-Length`` and
            ``Content-Type`` are set by the pool.
        max_head, max_body: response size limits in bytes (64 KiB, 64 MiB).
        ssl_context: for ``https`` (default: the system's trusted certificates, names checked).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        scheme: str = "http",
        connections: int = 64,
        timeout_s: float = 60.0,
        headers: Sequence[tuple[str, str]] = (),
        max_head: int = DEFAULT_MAX_HEAD,
        max_body: int = DEFAULT_MAX_BODY,
        ssl_context: ssl_module.SSLContext | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError("connections: must be >= 1")
        if scheme not in ("http", "https"):
            raise ValueError("scheme: must be http or https")
        for name, value in headers:
            if any(c in name + value for c in "\r\n") or not name or ":" in name:
                raise ValueError(f"invalid header {name!r}")
        self.host = host
        self.port = port
        self.connections = connections
        self.timeout_s = timeout_s
        self.max_head = max_head
        self.max_body = max_body
        self._ssl: ssl_module.SSLContext | None = None
        if scheme == "https":
            self._ssl = ssl_context or ssl_module.create_default_context()
        default_port = 443 if scheme == "https" else 80
        host_header = host if port == default_port else f"{host}:{port}"
        if ":" in host and not host.startswith("["):  # an IPv6 literal
            host_header = f"[{host}]" if port == default_port else f"[{host}]:{port}"
        fixed = [("Host", host_header), *headers]
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed).encode("latin-1")
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(connections)
        self._closed = False

    async def __aenter__(self) -> HttpPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        headers: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
        timeout_s: float | None = None,
    ) -> HttpResponse:
        """Send one request and read the whole response (any status); raises :class:`HttpClientError`."""
        if self._closed:
            raise HttpConnectionError("the client is closed")
        head = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), self._fixed]
        for name, value in headers:
            if any(c in name + value for c in "\r\n"):
                raise ValueError(f"invalid header {name!r}")
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        payload = body or b""
        if body is not None:
            head.append(f"Content-Type: {content_type}\r\n".encode("latin-1"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(payload))
        request = b"".join(head) + payload
        try:
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                for _ in range(2):
                    conn = await self._acquire()
                    keep = False
                    try:
                        response, keep = await conn.exchange(request, self.max_body)
                        return response
                    except _Stale:
                        continue
                    except OSError as exc:
                        raise HttpConnectionError(f"HTTP connection failed ({type(exc).__name__})") from None
                    finally:
                        self._release(conn, keep)
                raise HttpConnectionError("the server closed the connection twice before answering")
        except TimeoutError:
            raise HttpTimeout("no complete response in time") from None

    async def _acquire(self) -> _Connection:
        """A connection for one request (an idle one if any is still usable); holds one of the
        ``connections`` slots until :meth:`_release`. Open connections never exceed the slots."""
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if conn.usable():
                    return conn
                conn.close()
            # asyncio.open_connection, with a protocol that reads into a buffer of its own
            # (kcloak.wire.reads: no allocation per read).
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=self.max_head, loop=loop)
            protocol = BufferedStreamProtocol(reader, loop=loop)
            transport, _ = await loop.create_connection(
                lambda: protocol,
                self.host,
                self.port,
                ssl=self._ssl,
                server_hostname=self.host if self._ssl is not None else None,
            )
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        except (OSError, ssl_module.SSLError) as exc:
            self._slots.release()
            raise HttpConnectionError(f"cannot connect ({exc.strerror or type(exc).__name__})") from None
        except BaseException:
            self._slots.release()
            raise
        return _Connection(reader, writer)

    def _release(self, conn: _Connection, keep: bool) -> None:
        """Back to the pool after a complete response that allows it; closed otherwise."""
        conn.reused = True
        if keep and not self._closed:
            self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()


__all__ = [
    "HttpClientError",
    "HttpConnectionError",
    "HttpPool",
    "HttpProtocolError",
    "HttpResponse",
    "HttpTimeout",
    "Origin",
]
