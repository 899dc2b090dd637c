"""kcloak's clients (the upstream HTTP pool, the MQTT client) read at most SOCKET_READ_BYTES at a
time on real loopback connections, as its server connections do (tests/test_allocator.py shows why:
asyncio's 256 KiB reads are mappings of their own under the broker's allocator threshold)."""

from __future__ import annotations

import asyncio

from kcloak.core.memory import MMAP_THRESHOLD, SOCKET_READ_BYTES
from kcloak.wire.http_client import HttpPool
from kcloak.wire.mqtt_client import MqttClient


class _HttpPeer(asyncio.Protocol):
    """Answers every request head with an empty 200 (requests here carry no body)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            _, _, self.buf = self.buf.partition(b"\r\n\r\n")
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # type: ignore[attr-defined]


class _MqttPeer(asyncio.Protocol):
    """Accepts the CONNECT (CONNACK, session not present, accepted) and ignores the rest."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.sent = False

    def data_received(self, data: bytes) -> None:
        if not self.sent:
            self.sent = True
            self.transport.write(b"\x20\x02\x00\x00")  # type: ignore[attr-defined]


async def _transport_read_size_of_default_connection(port: int) -> int:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return int(writer.transport.max_size)  # type: ignore[attr-defined]
    finally:
        writer.close()


async def test_the_http_pool_reads_at_most_the_bound() -> None:
    server = await asyncio.get_running_loop().create_server(_HttpPeer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # The control: asyncio's own connections read more than the allocator's threshold at once.
        assert await _transport_read_size_of_default_connection(port) > MMAP_THRESHOLD
        async with HttpPool(host="127.0.0.1", port=port, connections=2) as pool:
            response = await pool.request("GET", "/")
            assert response.status == 200
            (conn,) = pool._idle
            assert conn.writer.transport.max_size == SOCKET_READ_BYTES  # type: ignore[attr-defined]
    finally:
        server.close()


async def test_the_mqtt_client_reads_at_most_the_bound() -> None:
    server = await asyncio.get_running_loop().create_server(_MqttPeer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with MqttClient(host="127.0.0.1", port=port, keepalive_s=0) as client:
            assert client._transport is not None
            assert client._transport.max_size == SOCKET_READ_BYTES  # type: ignore[attr-defined]
    finally:
        server.close()
