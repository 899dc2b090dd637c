"""A lean MQTT 3.1.1 subscriber for the intake connections (contract §3).

aiomqtt (paho underneath) reads one packet per event-loop turn, a byte at a time, which caps
intake at a few thousand messages per second. Intake only needs CONNECT, SUBSCRIBE, PUBLISH
(QoS 0 and 1, with PUBACK), PINGREQ and DISCONNECT, so this client speaks exactly that over an
asyncio protocol: it parses every packet in each chunk the socket delivers and acknowledges them
in one write. Answers and status messages go out through :class:`PublishConnection`.

Durability over an external broker: with a stable ``client_id`` the intake session is persistent
(clean session off), and a QoS 1 message is acknowledged only once the callback's completion for
it is done (the fix committed), in the order the messages arrived (MQTT 3.1.1 §4.6). Whatever was
not acknowledged when kcloak died is redelivered by the MQTT broker to the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from kcloak.core.logs import log_event

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 1, 2, 3, 4, 8, 9, 12, 13, 14

log = logging.getLogger("kcloak.mqtt")


class MqttIntakeError(ConnectionError):
    """The MQTT broker refused us or the connection broke."""


@dataclass(frozen=True, slots=True)
class Incoming:
    topic: str
    payload: bytes
    qos: int
    retain: bool


def encode_remaining_length(n: int) -> bytes:
    """MQTT's variable-length "remaining length" field."""
    out = bytearray()
    while True:
        byte = n % 128
        n //= 128
        if n:
            byte |= 0x80
        out.append(byte)
        if not n:
            return bytes(out)


def encode_utf8(s: str) -> bytes:
    """An MQTT UTF-8 string: two length bytes, then the bytes."""
    b = s.encode("utf-8")
    return struct.pack("!H", len(b)) + b


def encode_packet(kind: int, flags: int, body: bytes) -> bytes:
    """A whole MQTT control packet: fixed header, remaining length, body."""
    return bytes([(kind << 4) | flags]) + encode_remaining_length(len(body)) + body


def encode_connect(
    client_id: str,
    *,
    username: str | None,
    password: str | None,
    keepalive_s: int,
    will: tuple[str, bytes] | None = None,
    clean_session: bool = True,
) -> bytes:
    """An MQTT 3.1.1 CONNECT, by default with a clean session; a ``will`` (topic, payload) is QoS 1
    and retained. A password is sent only with a username (MQTT 3.1.1 §3.1.2.9)."""
    flags = 0x02 if clean_session else 0
    payload = encode_utf8(client_id)
    if will is not None:
        topic, message = will
        flags |= 0x04 | (1 << 3) | 0x20  # will, will QoS 1, will retain
        payload += encode_utf8(topic) + struct.pack("!H", len(message)) + message
    if username is not None:
        flags |= 0x80
        payload += encode_utf8(username)
        if password is not None:
            flags |= 0x40
            payload += encode_utf8(password)
    body = encode_utf8("MQTT") + bytes([4, flags]) + struct.pack("!H", keepalive_s) + payload
    return encode_packet(CONNECT, 0, body)


MAX_REMAINING_LENGTH = 268_435_455
"""The largest remaining length four bytes can encode (MQTT 3.1.1 §2.2.3)."""


class MalformedFrame(ValueError):
    """A remaining length longer than four bytes, or a packet over the allowed size."""


def read_header(buf: bytearray, pos: int) -> tuple[int, int] | None:
    """The remaining length and the body start of the packet that starts at ``buf[pos]``, or None
    while its fixed header is incomplete. Raises :class:`MalformedFrame` for a remaining length over
    four bytes."""
    mult, length, i, n = 1, 0, pos + 1, len(buf)
    while True:
        if i >= pos + 5:
            raise MalformedFrame("remaining length over four bytes")
        if i >= n:
            return None
        byte = buf[i]
        length += (byte & 0x7F) * mult
        i += 1
        if not byte & 0x80:
            return length, i
        mult *= 128


def split_frames(buf: bytearray, max_packet: int = MAX_REMAINING_LENGTH) -> tuple[list[tuple[int, int, int]], int]:
    """The complete control packets at the head of ``buf``, as ``(first byte, body start, body end)``,
    and how many bytes they span (an incomplete packet at the end stays for the next chunk).

    Raises :class:`MalformedFrame` for a remaining length over four bytes or over ``max_packet``.
    """
    frames: list[tuple[int, int, int]] = []
    pos, n = 0, len(buf)
    while n - pos >= 2:
        head = read_header(buf, pos)
        if head is None:
            break
        length, i = head
        if length > max_packet:
            raise MalformedFrame("packet too large")
        end = i + length
        if end > n:
            break
        frames.append((buf[pos], i, end))
        pos = end
    return frames, pos


PUBACK_HEAD = bytes([PUBACK << 4, 2])


def publish_head(buf: bytearray, first: int, i: int, end: int, have: int) -> tuple[str, bytes | None, int] | None:
    """Topic, packet id (None at QoS 0) and payload start of the PUBLISH whose body spans
    ``buf[i:end]``, of which ``buf[:have]`` has arrived; None until they have arrived. Raises
    :class:`MalformedFrame` when the topic (or packet id) would run past the packet."""
    if end - i < 2:
        raise MalformedFrame("PUBLISH without a topic")
    if have - i < 2:
        return None
    j = i + 2 + ((buf[i] << 8) | buf[i + 1])
    start = j + 2 if first & 0x06 else j
    if start > end:
        raise MalformedFrame("topic beyond the packet")
    if start > have:
        return None
    topic = bytes(buf[i + 2 : j]).decode("utf-8", "replace")
    return topic, (bytes(buf[j:start]) if start > j else None), start


class _Protocol(asyncio.Protocol):
    """Parses an intake connection's packets; acknowledges QoS 1 messages once they are durable.

    ``on_message`` gets each chunk's messages in arrival order and may return a list with one
    entry per message: None (acknowledge now) or a future (acknowledge once it is done; a
    cancelled one is never acknowledged: that is shutdown, and the MQTT broker redelivers the
    message to the next run). Any other return value acknowledges the whole batch now. PUBACKs
    leave in the order the PUBLISHes arrived, all that are ready in one write.

    A PUBLISH over ``max_packet`` is skipped as it streams in: its topic and packet id are read,
    the rest is discarded unbuffered, ``on_too_large(topic)`` counts it and it is acknowledged in
    turn. No exception from a callback reaches the transport (which would close the connection).
    Reading pauses while ``max_unacked`` messages wait for their completion.
    """

    def __init__(
        self,
        on_message: Callable[[list[Incoming]], object],
        max_packet: int,
        on_too_large: Callable[[str], object] | None = None,
        max_unacked: int = 50_000,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.on_message = on_message
        self.on_too_large = on_too_large
        self.max_packet = max_packet
        self.max_unacked = max_unacked
        self.buf = bytearray()
        self.skip = 0  # bytes of an oversize PUBLISH still to discard
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[int] = loop.create_future()
        self.suback: asyncio.Future[bytes] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.ping_outstanding = False
        self.paused = False
        # QoS 1 messages not acknowledged yet, in arrival order: (packet id, completion or None).
        self.unacked: deque[tuple[bytes, asyncio.Future[Any] | None]] = deque()
        self._watched: set[asyncio.Future[Any]] = set()
        self._release_scheduled = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.connack, self.suback):
            if not fut.done():
                fut.set_exception(MqttIntakeError("connection lost"))
        # What was not acknowledged stays with the MQTT broker, which redelivers it (persistent session).
        self.unacked.clear()
        for fut in self._watched:
            fut.remove_done_callback(self._completed)
        self._watched.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.skip:
            if len(data) <= self.skip:
                self.skip -= len(data)
                return
            data = data[self.skip :]
            self.skip = 0
        buf = self.buf
        buf += data
        batch: list[Incoming] = []
        plan: list[tuple[bytes, int]] = []  # QoS 1 packet ids in arrival order, with their batch index or -1
        pos, n = 0, len(buf)
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
                        self.skip, pos = end - n, n
                        break
                    pos = end
                    continue
                if end > n:
                    break
                if kind == PUBLISH:
                    got = publish_head(buf, first, i, end, end)
                    assert got is not None  # the whole packet is here
                    topic, pid, start = got
                    if pid is not None:
                        plan.append((pid, len(batch)))
                    batch.append(Incoming(topic, bytes(buf[start:end]), (first >> 1) & 3, bool(first & 1)))
                elif kind == PINGRESP:
                    self.ping_outstanding = False
                elif kind == CONNACK and not self.connack.done():
                    self.connack.set_result(buf[i + 1] if end - i >= 2 else 255)
                elif kind == SUBACK and not self.suback.done():
                    self.suback.set_result(bytes(buf[i + 2 : end]))
                pos = end
        except MalformedFrame:
            self._fail()
            return
        del buf[:pos]
        results: object = None
        if batch:
            try:
                results = self.on_message(batch)
            except Exception as exc:  # a bug in the callback must not end everyone's connection
                log_event(log, "mqtt_callback_failed", logging.ERROR, error=type(exc).__name__)
        if plan:
            self._plan_acks(plan, results if isinstance(results, list) and len(results) == len(batch) else None)

    def _too_large(self, topic: str) -> None:
        if self.on_too_large is not None:
            try:
                self.on_too_large(topic)
            except Exception as exc:
                log_event(log, "mqtt_callback_failed", logging.ERROR, error=type(exc).__name__)

    def _plan_acks(self, plan: list[tuple[bytes, int]], results: list[object] | None) -> None:
        unacked, watched = self.unacked, self._watched
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
        if len(unacked) >= self.max_unacked and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _completed(self, fut: asyncio.Future[Any]) -> None:
        self._watched.discard(fut)
        if not self._release_scheduled:
            # Completions of one loop turn leave in one write.
            self._release_scheduled = True
            asyncio.get_running_loop().call_soon(self._release)

    def _release(self) -> None:
        """Acknowledge the messages at the head of the queue whose completion is done, in order."""
        self._release_scheduled = False
        unacked = self.unacked
        out = bytearray()
        while unacked:
            pid, done = unacked[0]
            if done is not None and (not done.done() or done.cancelled()):
                break
            unacked.popleft()
            out += PUBACK_HEAD
            out += pid
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if out:
            transport.write(bytes(out))
        if self.paused and len(unacked) < self.max_unacked // 2:
            self.paused = False
            transport.resume_reading()

    def _fail(self) -> None:
        if self.transport is not None:
            self.transport.close()


class IntakeConnection:
    """One subscribing connection; :meth:`run` delivers message batches until the connection ends.

    Keyword arguments: ``host``, ``port``, ``username``/``password`` (or None), ``filters``
    (topic filters, subscribed at QoS 1), ``on_messages`` (called with each batch, in order; it
    may return one completion per message, see :class:`_Protocol`: a QoS 1 message is
    acknowledged only once its completion is done), ``on_too_large`` (called with the topic of
    each PUBLISH over ``max_packet``, which is skipped and acknowledged; None), ``client_id``
    (None: a random id with a clean session; a stable id makes the session persistent, so the
    MQTT broker keeps what was not acknowledged across reconnects and restarts and redelivers
    it), ``keepalive_s`` (30; a PINGREQ every half of it, and no PINGRESP by the next one ends
    the connection), ``max_packet`` (2 MiB).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        username: str | None,
        password: str | None,
        filters: list[str],
        on_messages: Callable[[list[Incoming]], object],
        on_too_large: Callable[[str], object] | None = None,
        client_id: str | None = None,
        keepalive_s: int = 30,
        max_packet: int = 2 * 1024 * 1024,
    ) -> None:
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.filters = filters
        self.on_messages = on_messages
        self.on_too_large = on_too_large
        self.client_id = client_id
        self.keepalive_s = keepalive_s
        self.max_packet = max_packet
        self._transport: asyncio.Transport | None = None

    def publish_qos0(self, topic: str, payload: bytes) -> None:
        """Send a QoS 0 PUBLISH on this connection (load generators; answers use aiomqtt)."""
        if self._transport is None or self._transport.is_closing():
            raise MqttIntakeError("not connected")
        self._transport.write(encode_packet(PUBLISH, 0, encode_utf8(topic) + payload))

    async def start(self) -> asyncio.Task[None]:
        """:meth:`run` in a task, returned once subscribed; raises :class:`MqttIntakeError` (or what
        :meth:`run` raised) if the connection ends before that, instead of waiting forever."""
        ready = asyncio.Event()
        task = asyncio.create_task(self.run(ready.set))
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            waiter.cancel()
            await task  # raises why the connection ended
            raise MqttIntakeError("connection closed before subscribing")
        return task

    async def run(self, connected: Callable[[], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, proto = await loop.create_connection(
                lambda: _Protocol(self.on_messages, self.max_packet, self.on_too_large), self.host, self.port
            )
        except OSError as exc:
            raise MqttIntakeError(f"cannot connect ({exc.strerror})") from None
        try:
            transport.write(self._connect_packet())
            async with asyncio.timeout(10):
                code = await proto.connack
            if code != 0:
                raise MqttIntakeError(f"connection refused by the MQTT broker (code {code})")
            body = struct.pack("!H", 1) + b"".join(encode_utf8(f) + b"\x01" for f in self.filters)
            transport.write(encode_packet(SUBSCRIBE, 2, body))
            async with asyncio.timeout(10):
                granted = await proto.suback
            if any(g == 0x80 for g in granted):
                raise MqttIntakeError("subscription refused by the MQTT broker")
            self._transport = transport
            if connected is not None:
                connected()
            while not proto.closed.done():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.keepalive_s / 2):
                        await asyncio.shield(proto.closed)
                if proto.closed.done():
                    break
                if proto.ping_outstanding and not proto.paused:
                    # Half open: the peer is gone without a FIN (reading paused holds the PINGRESP back).
                    log_event(log, "mqtt_ping_timeout", logging.WARNING, connection="intake")
                    transport.abort()
                    raise MqttIntakeError("no PINGRESP from the MQTT broker")
                proto.ping_outstanding = True
                transport.write(bytes([PINGREQ << 4, 0]))
            raise MqttIntakeError("connection closed")
        finally:
            if not transport.is_closing():
                with contextlib.suppress(Exception):
                    transport.write(bytes([DISCONNECT << 4, 0]))
                transport.close()

    def _connect_packet(self) -> bytes:
        return encode_connect(
            self.client_id or f"kcloak-in-{secrets.token_hex(6)}",
            username=self.username,
            password=self.password,
            keepalive_s=self.keepalive_s,
            clean_session=self.client_id is None,
        )


class _PubProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.pending: dict[int, asyncio.Future[None]] = {}
        self.ping_outstanding = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.connack.done():
            self.connack.set_exception(MqttIntakeError("connection lost"))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(MqttIntakeError("connection lost"))
        self.pending.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            frames, pos = split_frames(buf, max_packet=127)  # the broker sends us only short packets
        except MalformedFrame:
            if self.transport is not None:
                self.transport.close()
            return
        for first, i, end in frames:
            kind = first >> 4
            if kind == PUBACK and end - i >= 2:
                fut = self.pending.pop((buf[i] << 8) | buf[i + 1], None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            elif kind == PINGRESP:
                self.ping_outstanding = False
            elif kind == CONNACK and not self.connack.done():
                self.connack.set_result(buf[i + 1] if end - i >= 2 else 255)
        del buf[:pos]


class PublishConnection:
    """A lean MQTT 3.1.1 publisher (QoS 0/1, PUBACKs matched in bulk) with a retained last will.

    ``async with PublishConnection(...) as pub: await pub.publish(topic, payload)`` waits for the
    broker's PUBACK on QoS 1. :attr:`closed` resolves when the connection ends, also when a
    PINGREQ (every ``keepalive_s`` / 2) goes unanswered until the next one.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        username: str | None,
        password: str | None,
        will_topic: str | None = None,
        will_payload: bytes = b"",
        keepalive_s: int = 30,
    ) -> None:
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.will_topic = will_topic
        self.will_payload = will_payload
        self.keepalive_s = keepalive_s
        self._proto: _PubProtocol | None = None
        self._transport: asyncio.Transport | None = None
        self._next_id = 0
        self._pinger: asyncio.Task[None] | None = None
        # Publishes made in one event-loop turn leave in one write (one system call, not one each).
        self._out: list[bytes] = []

    async def __aenter__(self) -> PublishConnection:
        loop = asyncio.get_running_loop()
        try:
            transport, proto = await loop.create_connection(_PubProtocol, self.host, self.port)
        except OSError as exc:
            raise MqttIntakeError(f"cannot connect ({exc.strerror})") from None
        self._transport, self._proto = transport, proto
        transport.write(self._connect_packet())
        try:
            async with asyncio.timeout(10):
                code = await proto.connack
        except BaseException:
            transport.close()
            raise
        if code != 0:
            transport.close()
            raise MqttIntakeError(f"connection refused by the MQTT broker (code {code})")
        self._pinger = asyncio.create_task(self._ping())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        if self._transport is not None and not self._transport.is_closing():
            self._flush()
            self._transport.write(bytes([DISCONNECT << 4, 0]))
            self._transport.close()

    def _write(self, packet: bytes) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(packet)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(out))

    @property
    def closed(self) -> asyncio.Future[None]:
        assert self._proto is not None
        return self._proto.closed

    async def _ping(self) -> None:
        """A PINGREQ every half keepalive; none answered by the next one: the connection is half
        open (the peer vanished without a FIN), so it is aborted and :attr:`closed` resolves."""
        proto, transport = self._proto, self._transport
        assert proto is not None and transport is not None
        while not transport.is_closing():
            await asyncio.sleep(self.keepalive_s / 2)
            if transport.is_closing():
                return
            if proto.ping_outstanding:
                log_event(log, "mqtt_ping_timeout", logging.WARNING, connection="publish")
                transport.abort()
                return
            proto.ping_outstanding = True
            transport.write(bytes([PINGREQ << 4, 0]))

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        proto, transport = self._proto, self._transport
        if proto is None or transport is None or transport.is_closing():
            raise MqttIntakeError("not connected")
        flags = (qos << 1) | (1 if retain else 0)
        if qos == 0:
            self._write(encode_packet(PUBLISH, flags, encode_utf8(topic) + payload))
            return
        for _ in range(65535):
            self._next_id = self._next_id % 65535 + 1
            if self._next_id not in proto.pending:
                break
        else:
            raise MqttIntakeError("too many publishes in flight")
        pid = self._next_id
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        proto.pending[pid] = fut
        self._write(encode_packet(PUBLISH, flags, encode_utf8(topic) + struct.pack("!H", pid) + payload))
        await fut

    def _connect_packet(self) -> bytes:
        return encode_connect(
            f"kcloak-pub-{secrets.token_hex(6)}",
            username=self.username,
            password=self.password,
            keepalive_s=self.keepalive_s,
            will=(self.will_topic, self.will_payload) if self.will_topic is not None else None,
        )
