"""A lean MQTT 3.1.1 subscriber for the intake connections (contract §3).

aiomqtt (paho underneath) reads one packet per event-loop turn, a byte at a time, which caps
intake at a few thousand messages per second. Intake only needs CONNECT, SUBSCRIBE, PUBLISH
(QoS 0 and 1, with PUBACK), PINGREQ and DISCONNECT, so this client speaks exactly that over an
asyncio protocol: it parses every packet in each chunk the socket delivers and acknowledges them
in one write. Answers and status messages are still published through aiomqtt.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 1, 2, 3, 4, 8, 9, 12, 13, 14


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
) -> bytes:
    """An MQTT 3.1.1 CONNECT with a clean session; a ``will`` (topic, payload) is QoS 1 and retained.
    A password is sent only with a username (MQTT 3.1.1 §3.1.2.9)."""
    flags = 0x02  # clean session
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


def split_frames(buf: bytearray, max_packet: int = MAX_REMAINING_LENGTH) -> tuple[list[tuple[int, int, int]], int]:
    """The complete control packets at the head of ``buf``, as ``(first byte, body start, body end)``,
    and how many bytes they span (an incomplete packet at the end stays for the next chunk).

    Raises :class:`MalformedFrame` for a remaining length over four bytes or over ``max_packet``.
    """
    frames: list[tuple[int, int, int]] = []
    pos, n = 0, len(buf)
    while n - pos >= 2:
        mult, length, i = 1, 0, pos + 1
        while True:
            if i >= pos + 5:
                raise MalformedFrame("remaining length over four bytes")
            if i >= n:
                return frames, pos
            byte = buf[i]
            length += (byte & 0x7F) * mult
            i += 1
            if not byte & 0x80:
                break
            mult *= 128
        if length > max_packet:
            raise MalformedFrame("packet too large")
        end = i + length
        if end > n:
            break
        frames.append((buf[pos], i, end))
        pos = end
    return frames, pos


class _Protocol(asyncio.Protocol):
    def __init__(self, on_message: Callable[[list[Incoming]], object], max_packet: int) -> None:
        self.on_message = on_message
        self.max_packet = max_packet
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.suback: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.connack, self.suback):
            if not fut.done():
                fut.set_exception(MqttIntakeError("connection lost"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            frames, pos = split_frames(buf, self.max_packet)
        except MalformedFrame:
            self._fail()
            return
        batch: list[Incoming] = []
        acks = bytearray()
        for first, i, end in frames:
            kind = first >> 4
            if kind == PUBLISH:
                qos = (first >> 1) & 3
                tlen = (buf[i] << 8) | buf[i + 1]
                j = i + 2 + tlen
                topic = bytes(buf[i + 2 : j]).decode("utf-8", "replace")
                if qos:
                    acks += bytes([PUBACK << 4, 2]) + bytes(buf[j : j + 2])
                    j += 2
                batch.append(Incoming(topic, bytes(buf[j:end]), qos, bool(first & 1)))
            elif kind == CONNACK and not self.connack.done():
                self.connack.set_result(buf[i + 1] if end - i >= 2 else 255)
            elif kind == SUBACK and not self.suback.done():
                self.suback.set_result(bytes(buf[i + 2 : end]))
        del buf[:pos]
        if batch:
            self.on_message(batch)
        if acks and self.transport is not None:
            self.transport.write(bytes(acks))

    def _fail(self) -> None:
        if self.transport is not None:
            self.transport.close()


class IntakeConnection:
    """One subscribing connection; :meth:`run` delivers message batches until the connection ends.

    Keyword arguments: ``host``, ``port``, ``username``/``password`` (or None), ``filters``
    (topic filters, subscribed at QoS 1), ``on_messages`` (called with each batch, in order),
    ``keepalive_s`` (30), ``max_packet`` (2 MiB).
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
        keepalive_s: int = 30,
        max_packet: int = 2 * 1024 * 1024,
    ) -> None:
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.filters = filters
        self.on_messages = on_messages
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
                lambda: _Protocol(self.on_messages, self.max_packet), self.host, self.port
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
                if not proto.closed.done():
                    transport.write(bytes([PINGREQ << 4, 0]))
            raise MqttIntakeError("connection closed")
        finally:
            if not transport.is_closing():
                with contextlib.suppress(Exception):
                    transport.write(bytes([DISCONNECT << 4, 0]))
                transport.close()

    def _connect_packet(self) -> bytes:
        return encode_connect(
            f"kcloak-in-{secrets.token_hex(6)}",
            username=self.username,
            password=self.password,
            keepalive_s=self.keepalive_s,
        )


class _PubProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.pending: dict[int, asyncio.Future[None]] = {}

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
            elif kind == CONNACK and not self.connack.done():
                self.connack.set_result(buf[i + 1] if end - i >= 2 else 255)
        del buf[:pos]


class PublishConnection:
    """A lean MQTT 3.1.1 publisher (QoS 0/1, PUBACKs matched in bulk) with a retained last will.

    ``async with PublishConnection(...) as pub: await pub.publish(topic, payload)`` waits for the
    broker's PUBACK on QoS 1. :attr:`closed` resolves when the connection ends.
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
        while self._transport is not None and not self._transport.is_closing():
            await asyncio.sleep(self.keepalive_s / 2)
            if not self._transport.is_closing():
                self._transport.write(bytes([PINGREQ << 4, 0]))

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
