"""Lean client side of the contract (§3 MQTT, §4 HTTP) for simulators, replay, load and benchmarks.

A simulator must be able to saturate the broker from one process, so it cannot spend more CPU
per message than the broker does. General-purpose clients do: paho reads a byte at a time, and
aiohttp's client costs about as much as the server. These two clients speak only what a kcloak
client needs, over asyncio protocols, and parse every packet or response in each chunk the
socket delivers:

* :class:`MqttClient`: MQTT 3.1.1 CONNECT, SUBSCRIBE (QoS 1), PUBLISH at QoS 0 or 1 in both
  directions with a bounded window of unacknowledged publishes (PUBACKs matched in bulk),
  PINGREQ and DISCONNECT.
* :class:`HttpClient`: HTTP/1.1 keep-alive connections in a pool, one request in flight per
  connection, ``Content-Length`` or chunked responses, an optional bearer token per request.

:class:`BrokerUrl` parses the ``--broker`` flag of every client command (contract §9).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, cast
from urllib.parse import urlsplit

# The MQTT 3.1.1 packet codec is shared with the broker's intake client.
from kcloak.wire.http_client import HttpClientError as HttpError
from kcloak.wire.http_client import HttpConnectionError, HttpPool, HttpResponse, HttpTimeout
from kcloak.wire.mqtt_client import (
    CONNACK,
    DISCONNECT,
    PINGREQ,
    PUBACK,
    PUBLISH,
    SUBACK,
    SUBSCRIBE,
    MalformedFrame,
    encode_connect,
    encode_packet,
    encode_utf8,
    split_frames,
)

DEFAULT_MQTT_PORT = 1883
DEFAULT_HTTP_PORT = 8470


class TransportError(ConnectionError):
    """The broker is unreachable, refused us, or the connection broke (exit 1 at the CLI)."""


@dataclass(frozen=True, slots=True)
class BrokerUrl:
    """``mqtt://host[:port]`` (default port 1883) or ``http://host[:port]`` (default 8470); contract §9."""

    scheme: Literal["mqtt", "http"]
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> BrokerUrl:
        """Raises :class:`ValueError` naming the rule (never echoing credentials)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("mqtt", "http"):
            raise ValueError("--broker: must be mqtt://HOST[:PORT] or http://HOST[:PORT]")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError("--broker: only a scheme, host and port are allowed")
        try:
            port = parts.port
        except ValueError:
            raise ValueError("--broker: port must be 1-65535") from None
        host = parts.hostname
        if not host:
            raise ValueError("--broker: missing host")
        if scheme == "mqtt":
            return cls("mqtt", host, port or DEFAULT_MQTT_PORT)
        return cls("http", host, port or DEFAULT_HTTP_PORT)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


# -- MQTT --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MqttMessage:
    """One PUBLISH received from the MQTT broker."""

    topic: str
    payload: bytes


class _MqttProtocol(asyncio.Protocol):
    """Parses every packet of each chunk; acknowledges incoming QoS 1 publishes in one write."""

    def __init__(self, on_messages: Callable[[list[MqttMessage]], None] | None, on_acks: Callable[[int], None]) -> None:
        loop = asyncio.get_running_loop()
        self.on_messages = on_messages
        self.on_acks = on_acks
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[int] = loop.create_future()
        self.suback: asyncio.Future[bytes] | None = None
        self.closed: asyncio.Future[None] = loop.create_future()
        self.pending: dict[int, asyncio.Future[None] | None] = {}
        self.writable = asyncio.Event()
        self.writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        err = TransportError("MQTT connection lost")
        for fut in (self.connack, self.suback):
            if fut is not None and not fut.done():
                fut.set_exception(err)
        for pending in self.pending.values():
            if pending is not None and not pending.done():
                pending.set_exception(err)
        self.pending.clear()
        self.writable.set()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            frames, pos = split_frames(buf)
        except MalformedFrame:
            if self.transport is not None:
                self.transport.close()
            return
        batch: list[MqttMessage] = []
        acks = bytearray()
        acked = 0
        for first, i, end in frames:
            kind = first >> 4
            if kind == PUBACK and end - i >= 2:
                pid = (buf[i] << 8) | buf[i + 1]
                if pid in self.pending:
                    fut = self.pending.pop(pid)
                    acked += 1
                    if fut is not None and not fut.done():
                        fut.set_result(None)
            elif kind == PUBLISH:
                qos = (first >> 1) & 3
                tlen = (buf[i] << 8) | buf[i + 1]
                j = i + 2 + tlen
                topic = bytes(buf[i + 2 : j]).decode("utf-8", "replace")
                if qos:
                    acks += bytes([PUBACK << 4, 2]) + bytes(buf[j : j + 2])
                    j += 2
                batch.append(MqttMessage(topic, bytes(buf[j:end])))
            elif kind == CONNACK and not self.connack.done():
                self.connack.set_result(buf[i + 1] if end - i >= 2 else 255)
            elif kind == SUBACK and self.suback is not None and not self.suback.done():
                self.suback.set_result(bytes(buf[i + 2 : end]))
        del buf[:pos]
        if acks and self.transport is not None:
            self.transport.write(bytes(acks))
        if acked:
            self.on_acks(acked)
        if batch and self.on_messages is not None:
            self.on_messages(batch)


class MqttClient:
    """One MQTT 3.1.1 connection (async context manager): entering connects, leaving disconnects.

    Keyword-only arguments:
        host, port: the MQTT broker.
        username, password: credentials (with tokens: the user id and its token); default none.
        on_messages: called on the event loop with each batch of received publishes, in order.
        window: most QoS 1 publishes awaiting their PUBACK (:meth:`send` waits beyond it); default 2000.
        keepalive_s: MQTT keep-alive; default 30.
        client_id: default a random ``kcloak-sim-…`` id (clean session).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        username: str | None = None,
        password: str | None = None,
        on_messages: Callable[[list[MqttMessage]], None] | None = None,
        window: int = 2000,
        keepalive_s: int = 30,
        client_id: str | None = None,
    ) -> None:
        if not 1 <= window <= 65000:
            raise ValueError("window: must be within [1, 65000]")
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.on_messages = on_messages
        self.window = window
        self.keepalive_s = keepalive_s
        self.client_id = client_id or f"kcloak-sim-{secrets.token_hex(6)}"
        self.published = 0
        self.acknowledged = 0
        self._proto: _MqttProtocol | None = None
        self._transport: asyncio.Transport | None = None
        self._next_id = 0
        self._slots = asyncio.Semaphore(window)
        self._idle = asyncio.Event()
        self._idle.set()
        self._pinger: asyncio.Task[None] | None = None

    async def __aenter__(self) -> MqttClient:
        loop = asyncio.get_running_loop()
        try:
            transport, proto = await loop.create_connection(
                lambda: _MqttProtocol(self.on_messages, self._on_acks), self.host, self.port
            )
        except OSError as exc:
            raise TransportError(f"cannot connect to the MQTT broker ({exc.strerror or type(exc).__name__})") from None
        self._transport, self._proto = transport, proto
        transport.write(self._connect_packet())
        try:
            async with asyncio.timeout(10):
                code = await proto.connack
        except TimeoutError:
            transport.close()
            raise TransportError("the MQTT broker did not answer CONNECT") from None
        except BaseException:
            transport.close()
            raise
        if code != 0:
            transport.close()
            raise TransportError(f"connection refused by the MQTT broker (code {code})")
        self._pinger = asyncio.create_task(self._ping())
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
            t.write(bytes([DISCONNECT << 4, 0]))
            t.close()

    @property
    def closed(self) -> asyncio.Future[None]:
        """Resolves when the connection ends."""
        if self._proto is None:
            raise TransportError("not connected")
        return self._proto.closed

    @property
    def in_flight(self) -> int:
        """QoS 1 publishes sent and not yet acknowledged."""
        return 0 if self._proto is None else len(self._proto.pending)

    async def subscribe(self, filters: list[str]) -> None:
        """Subscribe at QoS 1 and wait for the SUBACK; a refused filter raises :class:`TransportError`."""
        proto, t = self._live()
        proto.suback = asyncio.get_running_loop().create_future()
        body = struct.pack("!H", self._packet_id(proto)) + b"".join(encode_utf8(f) + b"\x01" for f in filters)
        t.write(encode_packet(SUBSCRIBE, 2, body))
        try:
            async with asyncio.timeout(10):
                granted = await proto.suback
        except TimeoutError:
            raise TransportError("the MQTT broker did not answer SUBSCRIBE") from None
        if any(g == 0x80 for g in granted):
            raise TransportError("subscription refused by the MQTT broker")

    async def send(self, topic: str, payload: bytes, *, qos: int = 1) -> None:
        """Publish without waiting for the PUBACK; waits only for a window slot and socket buffer room."""
        proto, t = self._live()
        if not proto.writable.is_set():
            await proto.writable.wait()
            proto, t = self._live()
        if qos == 0:
            t.write(encode_packet(PUBLISH, 0, encode_utf8(topic) + payload))
            self.published += 1
            return
        await self._slots.acquire()
        proto, t = self._live()
        pid = self._packet_id(proto)
        proto.pending[pid] = None
        self._idle.clear()
        t.write(encode_packet(PUBLISH, 2, encode_utf8(topic) + struct.pack("!H", pid) + payload))
        self.published += 1

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1) -> None:
        """Publish and, at QoS 1, wait for the MQTT broker's PUBACK."""
        if qos == 0:
            await self.send(topic, payload, qos=0)
            return
        proto, t = self._live()
        await self._slots.acquire()
        proto, t = self._live()
        pid = self._packet_id(proto)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        proto.pending[pid] = fut
        self._idle.clear()
        t.write(encode_packet(PUBLISH, 2, encode_utf8(topic) + struct.pack("!H", pid) + payload))
        self.published += 1
        await fut

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every QoS 1 publish is acknowledged; False on timeout or a lost connection."""
        proto = self._proto
        if proto is None:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                while proto.pending and not proto.closed.done():
                    self._idle.clear()
                    idle: asyncio.Future[bool] = asyncio.ensure_future(self._idle.wait())
                    try:
                        waiters: set[asyncio.Future[Any]] = {idle, proto.closed}
                        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        idle.cancel()
        except TimeoutError:
            return False
        return self._proto is not None and not self._proto.pending

    # -- internals -----------------------------------------------------------------------------
    def _live(self) -> tuple[_MqttProtocol, asyncio.Transport]:
        proto, t = self._proto, self._transport
        if proto is None or t is None or t.is_closing():
            raise TransportError("MQTT connection lost")
        return proto, t

    def _packet_id(self, proto: _MqttProtocol) -> int:
        for _ in range(65535):
            self._next_id = self._next_id % 65535 + 1
            if self._next_id not in proto.pending:
                return self._next_id
        raise TransportError("too many publishes in flight")  # pragma: no cover - the window prevents it

    def _on_acks(self, n: int) -> None:
        self.acknowledged += n
        for _ in range(n):
            self._slots.release()
        if self._proto is not None and not self._proto.pending:
            self._idle.set()

    async def _ping(self) -> None:
        while self._transport is not None and not self._transport.is_closing():
            await asyncio.sleep(self.keepalive_s / 2)
            if not self._transport.is_closing():
                self._transport.write(bytes([PINGREQ << 4, 0]))

    def _connect_packet(self) -> bytes:
        return encode_connect(
            self.client_id, username=self.username, password=self.password, keepalive_s=self.keepalive_s
        )


# -- HTTP --------------------------------------------------------------------------------------
class HttpClient:
    """A pool of keep-alive HTTP/1.1 connections to one kcloak listener (async context manager);
    the broker's lean client (:class:`kcloak.wire.http_client.HttpPool`) with errors as :class:`TransportError`.

    Keyword-only arguments:
        host, port: the kcloak HTTP listener.
        connections: most connections open at once (requests beyond wait for a free one); default 64.
        timeout_s: per-request limit (connect, send, full response); default 60.
    """

    def __init__(self, *, host: str, port: int, connections: int = 64, timeout_s: float = 60.0) -> None:
        self.host = host
        self.port = port
        self._pool = HttpPool(host=host, port=port, connections=connections, timeout_s=timeout_s)

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool.close()

    async def request(
        self, method: str, path: str, body: bytes | None = None, *, token: str | None = None
    ) -> HttpResponse:
        """Send one request (JSON body if given) and read the whole response; errors raise :class:`TransportError`."""
        headers = (("Authorization", f"Bearer {token}"),) if token is not None else ()
        try:
            return await self._pool.request(method, path, body, headers=headers)
        except HttpTimeout:
            raise TransportError("the broker did not answer in time") from None
        except HttpConnectionError as exc:
            raise TransportError(f"cannot reach the broker over HTTP: {exc}") from None
        except HttpError as exc:
            raise TransportError(f"the broker's HTTP response is invalid: {exc}") from None


__all__ = [
    "DEFAULT_HTTP_PORT",
    "DEFAULT_MQTT_PORT",
    "BrokerUrl",
    "HttpClient",
    "HttpResponse",
    "MqttClient",
    "MqttMessage",
    "TransportError",
]
