"""kcloak's MQTT client as the intake (and publisher) against a scripted MQTT broker on a real loopback socket.

The peer in this file speaks just enough MQTT 3.1.1 to drive the client packet by packet: what
it acknowledges, when, in which order; oversize and malformed packets; a peer that stops
answering PINGREQ (a half-open connection); a broker that drops every connection at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kcloak.broker.service import Broker
from kcloak.wire.mqtt_client import Incoming, MqttClient, MqttError
from kcloak.wire.mqtt_codec import (
    CONNACK,
    CONNECT,
    PINGREQ,
    PINGRESP,
    PUBACK,
    PUBLISH,
    SUBACK,
    SUBSCRIBE,
    encode_packet,
    encode_utf8,
)
from tests.broker.conftest import SpyUpstream, broker_config
from tests.wire.peers import read_packet


def publish(topic: str, payload: bytes, pid: int | None, *, retain: bool = False) -> bytes:
    flags = (2 if pid is not None else 0) | (1 if retain else 0)
    body = encode_utf8(topic) + (struct.pack("!H", pid) if pid is not None else b"") + payload
    return encode_packet(PUBLISH, flags, body)


@dataclass
class Session:
    """One client connection to the scripted broker, after CONNECT (and SUBSCRIBE, if any)."""

    client_id: str
    clean_session: bool
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    connected_at: float

    async def pubacks(self, n: int, timeout: float = 5.0) -> list[int]:
        """The packet ids of the next ``n`` PUBACKs (PINGREQs are answered on the way)."""
        out: list[int] = []
        async with asyncio.timeout(timeout):
            while len(out) < n:
                first, body = await read_packet(self.reader)
                if first >> 4 == PUBACK:
                    out.append(struct.unpack("!H", body)[0])
                elif first >> 4 == PINGREQ:
                    self.writer.write(bytes([PINGRESP << 4, 0]))
        return out

    async def no_puback(self, within: float) -> None:
        """Assert that no PUBACK comes within ``within`` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while True:
                    first, _ = await read_packet(self.reader)
                    assert first >> 4 != PUBACK, "acknowledged before its completion was done"

    async def closed_by_client(self, timeout: float = 5.0) -> bool:
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
            return True
        except (TimeoutError, ConnectionError):
            return False


@dataclass
class ScriptedBroker:
    """Accepts connections, answers CONNECT and SUBSCRIBE, then hands each session to the test.

    ``answer_pings``: PINGREQs read during the handshake get a PINGRESP (later ones only while the
    test reads through :meth:`Session.pubacks`). ``serve_publishers``: connections whose id starts
    with ``kcloak-pub`` are answered in the background (PUBACK, PINGRESP) and not handed over.
    ``hang_up``: close every handed-over connection right after its SUBACK.
    """

    serve_publishers: bool = False
    hang_up: bool = False
    port: int = 0
    sessions: asyncio.Queue[Session] = field(default_factory=asyncio.Queue)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first, body = await read_packet(reader)
        assert first >> 4 == CONNECT
        flags = body[7]
        (id_len,) = struct.unpack("!H", body[10:12])
        client_id = body[12 : 12 + id_len].decode()
        writer.write(encode_packet(CONNACK, 0, b"\x00\x00"))
        session = Session(client_id, bool(flags & 0x02), reader, writer, time.monotonic())
        if self.serve_publishers and client_id.startswith("kcloak-pub"):
            task = asyncio.create_task(self._serve_publisher(session))
            self._tasks.add(task)
            return
        first, body = await read_packet(reader)
        assert first >> 4 == SUBSCRIBE
        writer.write(encode_packet(SUBACK, 0, body[:2] + b"\x01" * 4))
        if self.hang_up:
            writer.close()
        await self.sessions.put(session)

    async def _serve_publisher(self, s: Session) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                first, body = await read_packet(s.reader)
                if first >> 4 == PUBLISH and first & 0x06:
                    (tlen,) = struct.unpack("!H", body[:2])
                    s.writer.write(encode_packet(PUBACK, 0, body[2 + tlen : 4 + tlen]))
                elif first >> 4 == PINGREQ:
                    s.writer.write(bytes([PINGRESP << 4, 0]))

    async def next_session(self, timeout: float = 5.0) -> Session:
        async with asyncio.timeout(timeout):
            return await self.sessions.get()


@pytest.fixture
async def peer() -> AsyncIterator[ScriptedBroker]:
    b = ScriptedBroker()
    await b.start()
    yield b
    await b.close()


@contextlib.asynccontextmanager
async def intake(peer: ScriptedBroker, on_messages: Any, **kw: Any) -> AsyncIterator[MqttClient]:
    """A connection subscribed to ``t/+``, as the broker's intake makes it."""
    async with MqttClient(
        host="127.0.0.1", port=peer.port, client_prefix="kcloak-in", on_messages=on_messages, **kw
    ) as conn:
        await conn.subscribe(["t/+"])
        yield conn


async def test_acks_wait_for_each_completion_and_leave_in_arrival_order(peer: ScriptedBroker) -> None:
    loop = asyncio.get_running_loop()
    first_done: asyncio.Future[None] = loop.create_future()
    third_done: asyncio.Future[None] = loop.create_future()
    got: list[Incoming] = []

    def on_messages(batch: list[Incoming]) -> list[asyncio.Future[None] | None]:
        got.extend(batch)
        plan = {b"1": first_done, b"2": None, b"3": third_done}
        return [plan.get(m.payload) for m in batch]

    async with intake(peer, on_messages):
        s = await peer.next_session()
        s.writer.write(publish("t/a", b"1", 11) + publish("t/a", b"2", 12) + publish("t/a", b"3", 13))
        await s.no_puback(0.3)  # the first message is not durable yet: nothing may be acknowledged
        assert [m.payload for m in got] == [b"1", b"2", b"3"]
        third_done.set_result(None)
        await s.no_puback(0.3)  # the third is durable, but the first still holds the line
        first_done.set_result(None)
        assert await s.pubacks(3) == [11, 12, 13]


async def test_many_acks_in_order_whatever_order_completions_come_in(peer: ScriptedBroker) -> None:
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[None]] = []

    def on_messages(batch: list[Incoming]) -> list[asyncio.Future[None] | None]:
        futs: list[asyncio.Future[None] | None] = []
        for m in batch:
            if int(m.payload) % 3 == 0:
                futs.append(None)
            else:
                pending.append(loop.create_future())
                futs.append(pending[-1])
        return futs

    async with intake(peer, on_messages):
        s = await peer.next_session()
        s.writer.write(b"".join(publish("t/a", str(i).encode(), i) for i in range(1, 501)))
        async with asyncio.timeout(5):
            while len(pending) < 333:
                await asyncio.sleep(0.01)
        for fut in reversed(pending):  # the last to arrive is the first to be durable
            fut.set_result(None)
            await asyncio.sleep(0)
        assert await s.pubacks(500) == list(range(1, 501))


async def test_a_failed_completion_is_acknowledged_a_cancelled_one_is_not(peer: ScriptedBroker) -> None:
    loop = asyncio.get_running_loop()
    failed: asyncio.Future[None] = loop.create_future()
    cancelled: asyncio.Future[None] = loop.create_future()
    futs = iter([failed, cancelled])
    async with intake(peer, lambda batch: [next(futs) for _ in batch]):
        s = await peer.next_session()
        s.writer.write(publish("t/a", b"x", 1))
        await asyncio.sleep(0.1)
        s.writer.write(publish("t/a", b"y", 2))
        failed.set_exception(RuntimeError("refused by a bug"))
        assert await s.pubacks(1) == [1]
        cancelled.cancel()  # shutdown: left to the MQTT broker to redeliver
        await s.no_puback(0.3)


async def test_oversize_publish_is_skipped_counted_acknowledged_and_the_connection_kept(peer: ScriptedBroker) -> None:
    got: list[Incoming] = []
    too_large: list[str] = []
    async with intake(peer, got.extend, on_too_large=too_large.append, max_packet=64 * 1024) as conn:
        s = await peer.next_session()
        huge = publish("t/attacker", b"9" * (3 * 1024 * 1024), 21)
        for k in range(0, len(huge), 100_000):  # streamed in pieces, as a socket delivers it
            s.writer.write(huge[k : k + 100_000])
            await s.writer.drain()
        s.writer.write(publish("t/bystander", b'{"fine": 1}', 22) + publish("t/bystander", b"q0", None))
        assert await s.pubacks(2) == [21, 22]
        assert too_large == ["t/attacker"]
        assert [(m.topic, m.payload) for m in got] == [("t/bystander", b'{"fine": 1}'), ("t/bystander", b"q0")]
        assert not conn.closed.done()


async def test_oversize_publish_split_inside_its_topic_is_still_skipped(peer: ScriptedBroker) -> None:
    got: list[Incoming] = []
    too_large: list[str] = []
    async with intake(peer, got.extend, on_too_large=too_large.append, max_packet=1000):
        s = await peer.next_session()
        huge = publish("t/" + "x" * 300, b"0" * 5000, 5)
        # Cut inside the remaining length, the topic length, the topic and the packet id.
        cuts = [0, 2, 3, 4, 150, 307, 308, 2000, len(huge)]
        for a, b in itertools.pairwise(cuts):
            s.writer.write(huge[a:b])
            await s.writer.drain()
            await asyncio.sleep(0.01)
        s.writer.write(publish("t/b", b"after", 6))
        assert await s.pubacks(2) == [5, 6]
        assert too_large == ["t/" + "x" * 300]
        assert [m.payload for m in got] == [b"after"]


async def test_an_exception_in_the_callback_does_not_end_the_connection(peer: ScriptedBroker) -> None:
    got: list[bytes] = []

    def on_messages(batch: list[Incoming]) -> None:
        for m in batch:
            if m.payload == b"boom":
                raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
            got.append(m.payload)

    async with intake(peer, on_messages) as conn:
        s = await peer.next_session()
        s.writer.write(publish("t/attacker", b"boom", 1))
        assert await s.pubacks(1) == [1]
        s.writer.write(publish("t/bystander", b"ok", 2))
        assert await s.pubacks(1) == [2]
        assert got == [b"ok"] and not conn.closed.done()


async def test_a_topic_length_beyond_the_packet_is_not_read_past_it(peer: ScriptedBroker) -> None:
    got: list[Incoming] = []
    async with intake(peer, got.extend) as conn:
        s = await peer.next_session()
        # A PUBLISH whose topic length (40) runs 36 bytes past its own end, into the next packet.
        lying = encode_packet(PUBLISH, 2, struct.pack("!H", 40) + b"t/a" + b"\x00\x07")
        s.writer.write(lying + publish("t/next", b"n" * 40, 8))
        with pytest.raises(MqttError, match="malformed packet"):
            async with asyncio.timeout(5):
                await conn.wait_closed()
    assert got == []  # malformed: the connection is closed, nothing read from beyond the packet


async def test_intake_notices_a_broker_that_stops_answering_pings(peer: ScriptedBroker) -> None:
    async with intake(peer, lambda _: None, keepalive_s=1) as conn:
        await peer.next_session()  # never reads again: PINGREQs go unanswered
        started = time.monotonic()
        with pytest.raises(MqttError, match="PINGRESP"):
            async with asyncio.timeout(5):
                await conn.wait_closed()
        assert time.monotonic() - started < 2.5


async def test_intake_keeps_a_connection_whose_pings_are_answered(peer: ScriptedBroker) -> None:
    async with intake(peer, lambda _: None, keepalive_s=1) as conn:
        s = await peer.next_session()
        with contextlib.suppress(TimeoutError):
            await s.pubacks(1, timeout=2.2)  # answers the PINGREQs of two seconds
        assert not conn.closed.done()


async def test_publisher_notices_a_broker_that_stops_answering_pings() -> None:
    silent_clients: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_packet(reader)
        writer.write(encode_packet(CONNACK, 0, b"\x00\x00"))
        silent_clients.append(writer)  # then reads nothing more

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with MqttClient(host="127.0.0.1", port=port, client_prefix="kcloak-pub", keepalive_s=1) as pub:
            async with asyncio.timeout(2.5):
                await pub.closed
            assert pub.error is not None and "PINGRESP" in str(pub.error)
    finally:
        server.close()


async def test_stable_client_id_asks_for_a_persistent_session(peer: ScriptedBroker) -> None:
    async with intake(peer, lambda _: None, client_id="kcloak-0123456789ab-in0"):
        s = await peer.next_session()
        assert (s.client_id, s.clean_session) == ("kcloak-0123456789ab-in0", False)
    async with intake(peer, lambda _: None):
        s = await peer.next_session()
        assert s.client_id.startswith("kcloak-in-") and s.clean_session


async def test_intake_backoff_restarts_short_after_each_successful_connect(tmp_path: Path, spy: SpyUpstream) -> None:
    """A broker that accepts and then drops the intake at once, five times: each reconnect follows
    within the shortest wait, instead of 0.2, 0.4, 0.8, 1.6 s."""
    peer = ScriptedBroker(serve_publishers=True, hang_up=True)
    await peer.start()
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": f"mqtt://127.0.0.1:{peer.port}"})
    try:
        async with Broker(config=cfg):
            sessions = [await peer.next_session(timeout=10) for _ in range(5)]
    finally:
        await peer.close()
    gaps = [b.connected_at - a.connected_at for a, b in itertools.pairwise(sessions)]
    assert max(gaps[1:]) < 0.6, gaps  # (the first one also waits for the broker's start-up)
    ids = {s.client_id for s in sessions}
    assert len(ids) == 1 and ids.pop().endswith("-in0")  # one stable id, persistent session
    assert not any(s.clean_session for s in sessions)
