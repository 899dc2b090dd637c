"""kcloak's clients (the upstream HTTP pool, the MQTT client) read into a buffer of their own
(kcloak.wire.reads), not into a new bytes object per read: on real loopback connections, answers
larger than that buffer, split over many writes, arrive whole and in order."""

from __future__ import annotations

import asyncio
import os

from kcloak.wire.http_client import HttpPool
from kcloak.wire.mqtt_client import Incoming, MqttClient
from kcloak.wire.mqtt_codec import encode_publish
from kcloak.wire.reads import SCRATCH_BYTES, BufferedStreamProtocol

BIG = os.urandom(5 * SCRATCH_BYTES + 123)


class _HttpPeer(asyncio.Protocol):
    """Answers every request head (requests here carry no body) with ``BIG``, in pieces."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            _, _, self.buf = self.buf.partition(b"\r\n\r\n")
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BIG) + BIG
            for i in range(0, len(answer), 7001):
                self.transport.write(answer[i : i + 7001])  # type: ignore[attr-defined]


class _MqttPeer(asyncio.Protocol):
    """Accepts the CONNECT, then sends two PUBLISHes of ``BIG`` (QoS 0) in pieces."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.sent = False

    def data_received(self, data: bytes) -> None:
        if not self.sent:
            self.sent = True
            out = b"\x20\x02\x00\x00" + encode_publish("t/a", BIG) + encode_publish("t/b", BIG[::-1])
            for i in range(0, len(out), 9973):
                self.transport.write(out[i : i + 9973])  # type: ignore[attr-defined]


async def test_the_http_pool_reads_answers_larger_than_its_buffer_whole() -> None:
    server = await asyncio.get_running_loop().create_server(_HttpPeer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with HttpPool(host="127.0.0.1", port=port, connections=2) as pool:
            for _ in range(3):  # one kept-alive connection, read again
                response = await pool.request("GET", "/")
                assert response.status == 200
                assert response.body == BIG
            (conn,) = pool._idle
            assert isinstance(conn.writer.transport.get_protocol(), BufferedStreamProtocol)
    finally:
        server.close()


async def test_the_mqtt_client_reads_packets_larger_than_its_buffer_whole() -> None:
    server = await asyncio.get_running_loop().create_server(_MqttPeer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    got: list[Incoming] = []
    try:
        async with MqttClient(host="127.0.0.1", port=port, keepalive_s=0, on_messages=got.extend) as client:
            assert isinstance(client, asyncio.BufferedProtocol)
            for _ in range(500):
                if len(got) == 2:
                    break
                await asyncio.sleep(0.01)
    finally:
        server.close()
    assert [(m.topic, bytes(m.payload)) for m in got] == [("t/a", BIG), ("t/b", BIG[::-1])]
