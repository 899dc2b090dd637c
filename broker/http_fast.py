"""Single fixes over HTTP without aiohttp's request machinery (``http.fast_fixes``).

A phone app sends its fixes one ``POST /v1/users/{user}/location`` at a time on one keep-alive
connection. Each such request costs aiohttp's per-request machinery (a request object, a payload
stream, a response object, a task) about as much CPU as everything kcloak does with the fix, and
kcloak's event loop was the bottleneck of the HTTP intake (``docs/http-fast-path.md``).

:class:`FixConnection` serves a connection while its requests are single fixes in the narrow,
unambiguous form :func:`~kcloak.wire.fix_requests.read_fix_head` reads: it decodes, checks and
submits each fix as the aiohttp route does (:func:`~kcloak.broker.http_server.submit_fix`), and
writes the same answer, byte for byte but for the ``Date``, once the fix is decided. At the
first request it does not read (another route, another form, anything malformed) it hands the
connection, with every byte not yet answered, to aiohttp's connection handler for the rest of
its life; aiohttp then answers that request and all that follow by its own rules. Requests are
answered one at a time, in order; the timeouts are the aiohttp door's (``http.head_timeout_s``
for a complete head, idle keep-alive included; ``http.body_timeout_s`` for the body).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

from aiohttp.http import SERVER_SOFTWARE
from prometheus_client import Counter

from kcloak.broker.auth import TokenStore
from kcloak.broker.config import Config
from kcloak.broker.http_server import (
    FIX_ROUTE,
    HttpError,
    bearer_user,
    error_frames,
    error_parts,
    fix_answer,
    record_access,
    submit_fix,
)
from kcloak.broker.metrics import Metrics
from kcloak.broker.pipeline import Pipeline
from kcloak.broker.stores import StoreError
from kcloak.core.logs import log_event
from kcloak.core.profile import ReasonCode
from kcloak.wire.fix_requests import DECLINE, INCOMPLETE, MAX_HEAD_BYTES, FixHead, read_fix_head
from kcloak.wire.reads import scratch

log = logging.getLogger("kcloak.http")

_SERVER = SERVER_SOFTWARE.encode()
_date_second = -1
_date_line = b""


def _date() -> bytes:
    """The ``Date`` header's value, formatted once per second (as aiohttp does)."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_second, _date_line = now, formatdate(now, usegmt=True).encode()
    return _date_line


def render(status: int, body: bytes, charset: str | None, extra: tuple[tuple[str, str], ...], close: bool) -> bytes:
    """An answer as aiohttp writes it: status line, ``Content-Type``, the extra headers,
    ``Content-Length``, ``Date``, ``Server``, ``Connection: close`` when the connection ends."""
    content_type = b"application/json" if charset is None else b"application/json; charset=" + charset.encode()
    head = [b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode()), b"Content-Type: " + content_type]
    head.extend(f"{name}: {value}".encode() for name, value in extra)
    head += [b"Content-Length: %d" % len(body), b"Date: " + _date(), b"Server: " + _SERVER]
    if close:
        head.append(b"Connection: close")
    head.append(b"\r\n")
    return b"\r\n".join(head) + body


class FastFixes:
    """What the fix connections of one listener share, and the set of them (for shutdown).

    ``handoff``: a new aiohttp connection handler, for a connection that leaves the fast path."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        config: Config,
        tokens: TokenStore | None,
        metrics: Metrics,
        access_log: bool,
        handoff: Callable[[], asyncio.Protocol],
    ) -> None:
        self.pipeline = pipeline
        self.tokens = tokens
        self.handoff = handoff
        self.limit = config.limits.body_bytes
        self.ahead_bytes = MAX_HEAD_BYTES + self.limit  # requests read ahead of the answers: one at most
        self.head_timeout_s = config.http.head_timeout_s
        self.body_timeout_s = config.http.body_timeout_s
        self.received: Counter = metrics.messages.labels("http", "update")
        self.connections: set[FixConnection] = set()
        self.closing = False
        self._metrics = metrics
        self._ok_count = metrics.http_requests.labels(FIX_ROUTE, "POST", "200")
        self._ok_time = metrics.http_seconds.labels(FIX_ROUTE, "POST", "2xx")
        self._emit = access_log

    def connection(self) -> FixConnection:
        return FixConnection(self)

    def record(self, status: int, elapsed: float, sent: int) -> None:
        """Count and time one answer as the aiohttp door does (``kcloak_http_requests`` as
        :func:`~kcloak.broker.http_server.request_handler`, the rest as its access-log hook)."""
        if status == 200:
            self._ok_count.inc()
            if not self._emit:
                self._ok_time.observe(elapsed)
                return
        else:
            self._metrics.http_requests.labels(FIX_ROUTE, "POST", str(status)).inc()
        record_access(self._metrics, FIX_ROUTE, "POST", status, elapsed, sent, emit=self._emit)

    async def close(self, grace_s: float) -> None:
        """Stop: idle connections close now, one whose fix is being decided once it is answered;
        after ``grace_s`` the rest are aborted."""
        self.closing = True
        for conn in list(self.connections):
            conn.shutdown()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.abort()


class _Answering(asyncio.Future[ReasonCode | None]):
    """The future of one fix's outcome that writes its answer as the outcome is set (inside the
    intake's turn), not a turn of the event loop later as a done-callback would."""

    def __init__(self, conn: FixConnection, close: bool, started: float) -> None:
        super().__init__(loop=conn.loop)
        self._answer = (conn, close, started)

    def set_result(self, result: ReasonCode | None) -> None:
        super().set_result(result)
        self._deliver()

    def set_exception(self, exception: type | BaseException) -> None:
        super().set_exception(exception)
        self._deliver()

    def cancel(self, msg: object | None = None) -> bool:
        if not super().cancel(msg):
            return False
        self._deliver()
        return True

    def _deliver(self) -> None:
        # Called by whoever settles the outcome (the intake, for every fix of a batch in turn):
        # nothing of this connection's may reach it.
        conn, close, started = self._answer
        try:
            conn.decided(self, close, started)
        except Exception as exc:  # a bug: this connection ends, the others are answered
            log_event(log, "http_handler_failed", logging.ERROR, route=FIX_ROUTE, error=type(exc).__name__)
            conn.abort()


class FixConnection(asyncio.BufferedProtocol):
    """One client connection on the fast path (see the module's description)."""

    def __init__(self, shared: FastFixes) -> None:
        self._shared = shared
        self.loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._head: FixHead | None = None  # a head whose body has not all arrived
        self._busy = False  # a fix is being decided
        self._close_after = False
        self._read_paused = False
        self._write_paused = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio's calls -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # as aiohttp's connections
        self._shared.connections.add(self)
        self._arm(self.loop.time() + self._shared.head_timeout_s)
        if self._shared.closing:
            self.shutdown()

    def get_buffer(self, sizehint: int) -> memoryview:
        return scratch()

    def buffer_updated(self, nbytes: int) -> None:
        self._buf += scratch()[:nbytes]
        if not self._busy:
            self._serve()
        # Requests sent ahead wait in the buffer while one is decided (or the client does not read
        # its answers): past a full request's worth, stop reading until they are answered.
        waiting = self._busy or self._write_paused
        if waiting and len(self._buf) > self._shared.ahead_bytes and not self._read_paused and self._transport:
            self._read_paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close, as aiohttp's connections do

    def connection_lost(self, exc: BaseException | None) -> None:
        self._transport = None
        self._shared.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if not self._busy:
            # The client reads again: its time to send the next head (or the rest of a body) starts now.
            timeout = self._shared.head_timeout_s if self._head is None else self._shared.body_timeout_s
            self._arm(self.loop.time() + timeout)
            self._serve()

    # -- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._busy:
            self._close_after = True
        elif self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # -- requests ----------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Answer the complete requests at the start of the buffer, until one is being decided."""
        shared = self._shared
        while self._transport is not None and not self._busy and not self._write_paused:
            if self._transport.is_closing():
                return
            if shared.closing:
                self._transport.close()
                return
            head = self._head
            if head is None:
                found = read_fix_head(self._buf, shared.limit)
                if found is INCOMPLETE:
                    break
                if found is DECLINE:
                    self._hand_off()
                    return
                assert isinstance(found, FixHead)
                head = found
            if len(self._buf) < head.end + head.length:
                if self._head is None:  # the body starts arriving: its own deadline
                    self._head = head
                    self._arm(self.loop.time() + shared.body_timeout_s)
                break
            self._head = None
            raw = bytes(self._buf[head.end : head.end + head.length])
            del self._buf[: head.end + head.length]
            self._take(head, raw)
        self._read_on()

    def _take(self, head: FixHead, raw: bytes) -> None:
        shared = self._shared
        started = self.loop.time()
        try:
            user = head.user
            if shared.tokens is not None:
                user = bearer_user(head.authorization or "", shared.tokens, user)
            submit_fix(raw, user, shared.pipeline, shared.received, _Answering(self, head.close, started))
        except Exception as exc:
            self._answer_failure(exc, head.close, started)
            return
        self._busy = True  # until the outcome is set (:meth:`decided`): later requests wait

    def decided(self, decided: asyncio.Future[ReasonCode | None], close: bool, started: float) -> None:
        """Answer the fix whose outcome ``decided`` now holds, then the requests read meanwhile."""
        self._busy = False
        if decided.cancelled():  # the event loop is ending
            self.abort()
            return
        try:
            body, charset = fix_answer(decided.result())
        except Exception as exc:
            self._answer_failure(exc, close, started)
        else:
            self._write(200, body, charset, (), close, started)
        if self._buf:
            self._serve()  # the requests read meanwhile
        else:  # paused with only whole requests read ahead, now all answered
            self._read_on()

    def _read_on(self) -> None:
        """Resume reading paused while requests waited, once none is being decided and the client
        reads its answers (whatever is left in the buffer is less than a whole request)."""
        if self._read_paused and not self._busy and not self._write_paused and self._transport is not None:
            self._read_paused = False
            self._transport.resume_reading()

    def _answer_failure(self, exc: Exception, close: bool, started: float) -> None:
        if isinstance(exc, HttpError):
            status, body, extra = error_parts(exc.code, str(exc), field=exc.field, query_id=exc.query_id)
            close = close or exc.close
        elif isinstance(exc, StoreError):  # as the aiohttp door: a store that cannot write is 503
            status, body, extra = error_parts(ReasonCode.OVERLOADED, "storage is failing; retry later")
        else:  # a bug: the contract's 500, with where it was raised and nothing submitted
            error, stack = type(exc).__name__, error_frames(exc)
            log_event(log, "http_handler_failed", logging.ERROR, route=FIX_ROUTE, error=error, stack=stack)
            status, body, extra = error_parts(ReasonCode.INTERNAL, "internal error")
        self._write(status, body, "utf-8", extra, close, started)

    def _write(
        self,
        status: int,
        body: bytes,
        charset: str | None,
        extra: tuple[tuple[str, str], ...],
        close: bool,
        started: float,
    ) -> None:
        close = close or self._close_after or self._shared.closing
        transport = self._transport
        if transport is not None:
            transport.write(render(status, body, charset, extra, close))
            if close:  # nothing read behind this request is taken: drop it, read no more
                self._buf.clear()
                self._head = None
                transport.close()
            else:
                self._arm(self.loop.time() + self._shared.head_timeout_s)
        self._shared.record(status, self.loop.time() - started, len(body))

    # -- timeouts and hand-off ---------------------------------------------------------------------
    def _arm(self, deadline: float) -> None:
        """Expire at ``deadline`` (one timer per connection, moved lazily: a later deadline is
        checked when the earlier timer fires)."""
        self._deadline = deadline
        timer = self._timer
        if timer is not None and timer.when() > deadline:
            timer.cancel()
            timer = None
        if timer is None:
            self._timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or self._busy or self._write_paused:
            # An answer re-arms the timer, and so does the client reading again: the timeouts are
            # for requests not sent, not for answers not read (aiohttp's connections wait for those).
            return
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._expire)
            return
        if self._head is None:  # no complete head in time (idle keep-alive included): close
            transport.close()
            return
        self._head = None
        timeout = self._shared.body_timeout_s
        error = HttpError(ReasonCode.INVALID, f"body: not received within {timeout:g} s", close=True)
        self._answer_failure(error, True, self.loop.time() - timeout)

    def _hand_off(self) -> None:
        """Give the connection and every byte not answered to aiohttp's connection handler."""
        transport = self._transport
        assert transport is not None
        self._transport = None
        self._shared.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        handler = self._shared.handoff()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self._buf = bytes(self._buf), bytearray()
        if self._read_paused:
            transport.resume_reading()
        if data:
            handler.data_received(data)


__all__ = ["FastFixes", "FixConnection", "render"]
