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

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 1, 2, 3, 4, 8, 9, 12, 13, 14


class MqttIntakeError(ConnectionError):
    """The MQTT broker refused us or the connection broke."""


@dataclass(frozen=True, slots=True)
class Incoming:
    topic: str
    payload: bytes
    qos: int
    retain: bool


def _remaining_length(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n % 128
        n //= 128
        if n:
            byte |= 0x80
        out.append(byte)
        if not n:
            return bytes(out)


def _utf8(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("!H", len(b)) + b


def _packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes([(kind << 4) | flags]) + _remaining_length(len(body)) + body


class _Protocol(asyncio.Protocol):
    def __init__(self, on_message: Callable[[list[Incoming]], None], max_packet: int) -> None:
        self.on_message = on_message
        self.max_packet = max_packet
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.suback: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.connack, self.suback):
            if not fut.done():
                fut.set_exception(MqttIntakeError("connection lost"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        n = len(buf)
        batch: list[Incoming] = []
        acks = bytearray()
        while True:
            if n - pos < 2:
                break
            first = buf[pos]
            # remaining length: up to 4 bytes
            mult, length, i = 1, 0, pos + 1
            complete = False
            while i < n and i < pos + 5:
                byte = buf[i]
                length += (byte & 0x7F) * mult
                i += 1
                if not byte & 0x80:
                    complete = True
                    break
                mult *= 128
            if not complete:
                if i >= pos + 5:
                    self._fail()
                    return
                break
            if length > self.max_packet:
                self._fail()
                return
            end = i + length
            if end > n:
                break
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
                self.connack.set_result(buf[i + 1] if length >= 2 else 255)
            elif kind == SUBACK and not self.suback.done():
                self.suback.set_result(bytes(buf[i + 2 : end]))
            pos = end
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
        on_messages: Callable[[list[Incoming]], None],
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
        self._transport.write(_packet(PUBLISH, 0, _utf8(topic) + payload))

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
            body = struct.pack("!H", 1) + b"".join(_utf8(f) + b"\x01" for f in self.filters)
            transport.write(_packet(SUBSCRIBE, 2, body))
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
        flags = 0x02  # clean session
        payload = _utf8(f"kcloak-in-{secrets.token_hex(6)}")
        if self.username is not None:
            flags |= 0x80
            payload += _utf8(self.username)
            if self.password is not None:
                flags |= 0x40
                payload += _utf8(self.password)
        body = _utf8("MQTT") + bytes([4, flags]) + struct.pack("!H", self.keepalive_s) + payload
        return _packet(CONNECT, 0, body)
