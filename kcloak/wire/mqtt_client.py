"""kcloak's one MQTT 3.1.1 client (contract §3): the broker's intake and publishing connections to
an external MQTT broker, and the simulators' connections to kcloak, all go through :class:`MqttClient`.

Why hand-written (docs/mqtt.md, "One client"): paho reads one packet per event-loop turn, a byte
at a time; this client parses every packet of each chunk the socket delivers over an asyncio
protocol, and writes what one loop turn produced (PUBACKs, publishes) in one system call.

Durability over an external broker: with a stable ``client_id`` the session is persistent (clean
session off), and a received QoS 1 message is acknowledged only once the completion the caller
returned for it is done (the fix committed), in the order the messages arrived (MQTT 3.1.1 §4.6).
Whatever was not acknowledged when kcloak died is redelivered by the MQTT broker to the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

from kcloak.core.logs import log_event
from kcloak.wire.errors import WireError
from kcloak.wire.mqtt_codec import (
    DISCONNECT_PACKET,
    MAX_REMAINING_LENGTH,
    PINGREQ_PACKET,
    PUBACK,
    PUBLISH,
    MalformedFrame,
    encode_connect,
    encode_publish,
    encode_subscribe,
    publish_head,
    read_header,
)
from kcloak.wire.reads import scratch

log = logging.getLogger("kcloak.mqtt")

_PUBACK_HEAD = bytes([PUBACK << 4, 2])
_FLUSH_BYTES = 64 * 1024
"""Buffered outgoing bytes written at once rather than at the end of the loop turn."""


class MqttError(WireError, ConnectionError):
    """The MQTT broker is unreachable, refused us, broke the protocol or stopped answering, or the
    connection is gone."""


@dataclass(frozen=True, slots=True)
class Incoming:
    """One PUBLISH received from the MQTT broker."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False


class Backoff:
    """Waits between reconnection attempts: ``first_s``, doubling up to ``max_s``; :meth:`reset`
    after a successful connection, so an outage after hours of service starts again at the shortest."""

    def __init__(self, first_s: float = 0.2, max_s: float = 5.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.next_s = first_s

    def reset(self) -> None:
        self.next_s = self.first_s

    async def wait(self) -> None:
        delay, self.next_s = self.next_s, min(self.next_s * 2, self.max_s)
        await asyncio.sleep(delay)


class MqttClient(asyncio.BufferedProtocol):
    """One MQTT 3.1.1 connection (async context manager): entering connects and waits for the
    CONNACK, leaving stops the keep-alive and disconnects, whatever happened inside. One object
    serves one connection; reconnecting is a new object (see :class:`Backoff`).

    Keyword-only arguments:
        host, port: the MQTT broker.
        username, password: credentials, or None (a password is sent only with a username).
        client_id: None (default) for a random ``{client_prefix}-…`` id with a clean session; a
            stable id makes the session persistent (clean session off), so the MQTT broker keeps
            what was not acknowledged across reconnects and restarts, and redelivers it.
        clean_session: overrides the choice above; default None.
        client_prefix: prefix of a random client id; default ``"kcloak"``.
        will: (topic, payload) published QoS 1 retained if the connection dies; default None.
        keepalive_s: MQTT keep-alive; a PINGREQ every half of it; default 30.
        ping_timeout_s: no PINGRESP within it (while reading is not paused, which would hold the
            PINGRESP back) and the connection is dead: aborted, :attr:`error` set, :attr:`closed`
            resolved; default ``keepalive_s / 2``.
        connect_timeout_s: longest wait for CONNACK and SUBACK; default 10.
        on_messages: called on the event loop with each chunk's PUBLISHes in arrival order; it may
            return a list with one entry per message: None (acknowledge now) or a future
            (acknowledge once it is done; a failed one too, a cancelled one never: that is shutdown,
            and the MQTT broker redelivers the message to the next run). Any other return value
            acknowledges the whole batch now. PUBACKs leave in arrival order. An exception in it
            is logged and the batch acknowledged: it never ends the connection. Default None.
        on_too_large: called with the topic of each PUBLISH over ``max_packet``, which is skipped
            as it streams in (never buffered) and acknowledged in turn; default None.
        max_packet: largest packet read whole; default 2 MiB.
        max_unacked: received QoS 1 messages waiting for their completion before reading pauses;
            default 50,000.
        window: most QoS 1 publishes awaiting their PUBACK (:meth:`send` and :meth:`publish` wait
            beyond it); default 2,000, at most 65,000.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        username: str | None = None,
        password: str | None = None,
        client_id: str | None = None,
        clean_session: bool | None = None,
        client_prefix: str = "kcloak",
        will: tuple[str, bytes] | None = None,
        keepalive_s: int = 30,
        ping_timeout_s: float | None = None,
        connect_timeout_s: float = 10.0,
        on_messages: Callable[[list[Incoming]], object] | None = None,
        on_too_large: Callable[[str], object] | None = None,
        max_packet: int = 2 * 1024 * 1024,
        max_unacked: int = 50_000,
        window: int = 2000,
    ) -> None:
        if not 1 <= window <= 65000:
            raise ValueError("window: must be within [1, 65000]")
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.client_id = client_id or f"{client_prefix}-{secrets.token_hex(6)}"
        self.clean_session = client_id is None if clean_session is None else clean_session
        self.will = will
        self.keepalive_s = keepalive_s
        self.ping_timeout_s = keepalive_s / 2 if ping_timeout_s is None else ping_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.on_messages = on_messages
        self.on_too_large = on_too_large
        self.max_packet = min(max_packet, MAX_REMAINING_LENGTH)
        self.max_unacked = max_unacked
        self.window = window
        self.published = 0
        self.acknowledged = 0
        self.error: MqttError | None = None
        """Why the connection ended, once it has (None: still open, or closed by us)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._skip = 0  # bytes of an oversize PUBLISH still to discard
        self._connack: asyncio.Future[int] = loop.create_future()
        self._closed: asyncio.Future[None] = loop.create_future()
        # Pending acknowledgements, keyed by packet id (None: a publish nobody awaits).
        self._pubacks: dict[int, asyncio.Future[None] | None] = {}
        self._subacks: dict[int, asyncio.Future[bytes]] = {}
        self._next_id = 0
        self._slots = asyncio.Semaphore(window)
        self._idle = asyncio.Event()
        self._idle.set()
        self._writable = asyncio.Event()
        self._writable.set()
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._pong = asyncio.Event()
        self._pinger: asyncio.Task[None] | None = None
        # Received QoS 1 messages not acknowledged yet, in arrival order: (packet id, completion or None).
        self._unacked: deque[tuple[bytes, asyncio.Future[Any] | None]] = deque()
        self._watched: set[asyncio.Future[Any]] = set()
        self._release_scheduled = False
        self._reading_paused = False

    # -- the context manager --------------------------------------------------------------------
    async def __aenter__(self) -> MqttClient:
        try:
            await self._loop.create_connection(lambda: self, self.host, self.port)
        except OSError as exc:
            raise MqttError(f"cannot connect to the MQTT broker ({exc.strerror or type(exc).__name__})") from None
        packet = encode_connect(
            self.client_id,
            username=self.username,
            password=self.password,
            keepalive_s=self.keepalive_s,
            will=self.will,
            clean_session=self.clean_session,
        )
        self._write(packet)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                code = await self._connack
        except TimeoutError:
            self._close()
            raise MqttError("the MQTT broker did not answer CONNECT") from None
        except BaseException:
            self._close()
            raise
        if code != 0:
            self._close()
            raise MqttError(f"connection refused by the MQTT broker (code {code})")
        if self.keepalive_s > 0:
            self._pinger = asyncio.create_task(self._keepalive())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pinger
        t = self._transport
        if t is not None and not t.is_closing():
            self._flush()
            t.write(DISCONNECT_PACKET)
        self._close()

    # -- public operations ----------------------------------------------------------------------
    @property
    def closed(self) -> asyncio.Future[None]:
        """Resolves (with None) when the connection ends, whoever ended it; :attr:`error` says why."""
        return self._closed

    @property
    def in_flight(self) -> int:
        """QoS 1 publishes sent and not yet acknowledged."""
        return len(self._pubacks)

    async def wait_closed(self) -> None:
        """Wait until the connection ends; raise :class:`MqttError` saying why."""
        await asyncio.shield(self._closed)
        raise self.error or MqttError("connection closed")

    async def subscribe(self, filters: list[str], *, qos: int = 1) -> bytes:
        """Subscribe and wait for the SUBACK; the granted codes, one per filter. A refused filter
        raises :class:`MqttError`."""
        self._live()
        pid = self._packet_id()
        fut: asyncio.Future[bytes] = self._loop.create_future()
        self._subacks[pid] = fut
        self._write(encode_subscribe(pid, filters, qos))
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                granted = await fut
        except TimeoutError:
            raise MqttError("the MQTT broker did not answer SUBSCRIBE") from None
        finally:
            self._subacks.pop(pid, None)
        if any(g == 0x80 for g in granted):
            raise MqttError("subscription refused by the MQTT broker")
        return granted

    async def send(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Publish without waiting for the PUBACK; waits only for a window slot and socket buffer room."""
        await self._publish(topic, payload, qos, retain, None)

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Publish and, at QoS 1, wait for the MQTT broker's PUBACK (:class:`MqttError` if the
        connection ends first)."""
        if qos == 0:
            await self._publish(topic, payload, 0, retain, None)
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        await self._publish(topic, payload, qos, retain, fut)
        await fut

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every QoS 1 publish is acknowledged; False on timeout or a lost connection."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._pubacks and not self._closed.done():
                    self._idle.clear()
                    idle: asyncio.Future[Any] = asyncio.ensure_future(self._idle.wait())
                    try:
                        waiters: set[asyncio.Future[Any]] = {idle, self._closed}
                        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        idle.cancel()
        except TimeoutError:
            return False
        return not self._pubacks and not self._closed.done()

    # -- internals: sending ---------------------------------------------------------------------
    async def _publish(
        self, topic: str, payload: bytes, qos: int, retain: bool, fut: asyncio.Future[None] | None
    ) -> None:
        self._live()
        if not self._writable.is_set():
            await self._writable.wait()
            self._live()
        if qos == 0:
            self._write(encode_publish(topic, payload, retain=retain))
            self.published += 1
            return
        await self._slots.acquire()
        self._live()
        pid = self._packet_id()
        self._pubacks[pid] = fut
        self._idle.clear()
        self._write(encode_publish(topic, payload, qos=qos, pid=pid, retain=retain))
        self.published += 1

    def _live(self) -> asyncio.Transport:
        t = self._transport
        if t is None or t.is_closing():
            raise self.error or MqttError("MQTT connection lost")
        return t

    def _packet_id(self) -> int:
        for _ in range(65535):
            self._next_id = self._next_id % 65535 + 1
            if self._next_id not in self._pubacks and self._next_id not in self._subacks:
                return self._next_id
        raise MqttError("too many publishes in flight")  # pragma: no cover - the window prevents it

    def _write(self, packet: bytes) -> None:
        """Queue a packet; what one event-loop turn queues leaves in one write (sooner past 64 KiB)."""
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(packet)
        self._out_bytes += len(packet)
        if self._out_bytes >= _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        out, self._out = self._out, []
        self._out_bytes = 0
        t = self._transport
        if out and t is not None and not t.is_closing():
            t.write(b"".join(out))

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: MqttError, *, abort: bool = True) -> None:
        """End the connection because of ``error`` (kept in :attr:`error`)."""
        if self.error is None:
            self.error = error
        t = self._transport
        if t is not None:
            if abort:
                t.abort()
            else:
                t.close()

    async def _keepalive(self) -> None:
        """A PINGREQ every half keep-alive; no PINGRESP within ``ping_timeout_s``: the connection is
        half open (the peer vanished without a FIN, or hangs), so it is aborted."""
        interval = delay = self.keepalive_s / 2
        while True:
            await asyncio.sleep(delay)
            t = self._transport
            if t is None or t.is_closing():
                return
            started = self._loop.time()
            self._pong.clear()
            self._write(PINGREQ_PACKET)
            try:
                async with asyncio.timeout(self.ping_timeout_s):
                    await self._pong.wait()
            except TimeoutError:
                if not self._reading_paused and not t.is_closing():
                    log_event(log, "mqtt_ping_timeout", logging.WARNING)
                    self._fail(MqttError("no PINGRESP from the MQTT broker"))
                    return
            delay = max(0.0, interval - (self._loop.time() - started))

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        err = self.error or MqttError("MQTT connection lost")
        if not self._connack.done():
            self._connack.set_exception(err)
        for waiters in (self._pubacks, self._subacks):
            for fut in waiters.values():
                if fut is not None and not fut.done():
                    fut.set_exception(err)
            waiters.clear()
        self._idle.set()
        self._writable.set()
        # What was not acknowledged stays with the MQTT broker, which redelivers it (persistent session).
        self._unacked.clear()
        for done in self._watched:
            done.remove_done_callback(self._completed)
        self._watched.clear()
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return scratch()  # no allocation per read (kcloak.wire.reads)

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(scratch()[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        """What arrived (a view of the read buffer, copied into ``_buf`` before anything else)."""
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                return
            data = data[self._skip :]
            self._skip = 0
        buf = self._buf
        buf += data
        batch: list[Incoming] = []
        plan: list[tuple[bytes, int]] = []  # QoS 1 packet ids in arrival order, with their batch index or -1
        pos, n = 0, len(buf)
        acked = 0
        try:
            while n - pos >= 2:
                head = read_header(buf, pos)
                if head is None:
                    break
                length, i = head
                first, end = buf[pos], i + length
                kind = first >> 4
                if length > self.max_packet:
                    if kind != PUBLISH:
                        raise MalformedFrame("packet too large")
                    got = publish_head(buf, first, i, end, min(end, n))
                    if got is None:
                        break  # its topic and packet id are not all here yet (at most 64 KiB)
                    topic, pid, _ = got
                    if pid is not None:
                        plan.append((pid, -1))
                    self._too_large(topic)
                    if end > n:
                        self._skip, pos = end - n, n
                        break
                    pos = end
                    continue
                if end > n:
                    break
                match kind:
                    case 3:  # PUBLISH
                        got = publish_head(buf, first, i, end, end)
                        assert got is not None  # the whole packet is here
                        topic, pid, start = got
                        if pid is not None:
                            plan.append((pid, len(batch)))
                        batch.append(Incoming(topic, bytes(buf[start:end]), (first >> 1) & 3, bool(first & 1)))
                    case 4:  # PUBACK
                        if end - i < 2:
                            raise MalformedFrame("PUBACK without a packet id")
                        key = (buf[i] << 8) | buf[i + 1]
                        if key in self._pubacks:
                            fut = self._pubacks.pop(key)
                            acked += 1
                            if fut is not None and not fut.done():
                                fut.set_result(None)
                    case 13:  # PINGRESP
                        self._pong.set()
                    case 2:  # CONNACK
                        if not self._connack.done():
                            self._connack.set_result(buf[i + 1] if end - i >= 2 else 255)
                    case 9:  # SUBACK
                        if end - i < 2:
                            raise MalformedFrame("SUBACK without a packet id")
                        sub = self._subacks.get((buf[i] << 8) | buf[i + 1])
                        if sub is not None and not sub.done():
                            sub.set_result(bytes(buf[i + 2 : end]))
                    case _:
                        pass  # nothing else is meant for a client at QoS ≤ 1; ignored
                pos = end
        except MalformedFrame as exc:
            log_event(log, "mqtt_malformed_packet", logging.WARNING)
            self._fail(MqttError(f"malformed packet from the MQTT broker ({exc})"))
            return
        del buf[:pos]
        if acked:
            self._acked(acked)
        results: object = None
        if batch and self.on_messages is not None:
            try:
                results = self.on_messages(batch)
            except Exception as exc:  # a bug in the callback must not end everyone's connection
                log_event(log, "mqtt_callback_failed", logging.ERROR, error=type(exc).__name__)
        if plan:
            self._plan_acks(plan, results if isinstance(results, list) and len(results) == len(batch) else None)

    # -- internals: acknowledging what we received, in order ------------------------------------
    def _acked(self, n: int) -> None:
        self.acknowledged += n
        for _ in range(n):
            self._slots.release()
        if not self._pubacks:
            self._idle.set()

    def _too_large(self, topic: str) -> None:
        if self.on_too_large is not None:
            try:
                self.on_too_large(topic)
            except Exception as exc:
                log_event(log, "mqtt_callback_failed", logging.ERROR, error=type(exc).__name__)

    def _plan_acks(self, plan: list[tuple[bytes, int]], results: list[object] | None) -> None:
        unacked, watched = self._unacked, self._watched
        for pid, index in plan:
            done = results[index] if results is not None and index >= 0 else None
            if not isinstance(done, asyncio.Future):
                unacked.append((pid, None))
                continue
            if not done.done() and done not in watched:
                watched.add(done)
                done.add_done_callback(self._completed)
            unacked.append((pid, done))
        self._release()
        if len(unacked) >= self.max_unacked and not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _completed(self, fut: asyncio.Future[Any]) -> None:
        self._watched.discard(fut)
        if not self._release_scheduled:
            # Completions of one loop turn leave in one write.
            self._release_scheduled = True
            self._loop.call_soon(self._release)

    def _release(self) -> None:
        """Acknowledge the messages at the head of the queue whose completion is done, in order."""
        self._release_scheduled = False
        unacked = self._unacked
        out = bytearray()
        while unacked:
            pid, done = unacked[0]
            if done is not None and (not done.done() or done.cancelled()):
                break
            unacked.popleft()
            out += _PUBACK_HEAD
            out += pid
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if out:
            self._write(bytes(out))
        if self._reading_paused and len(unacked) < self.max_unacked // 2:
            self._reading_paused = False
            transport.resume_reading()


__all__ = ["Backoff", "Incoming", "MqttClient", "MqttError"]
