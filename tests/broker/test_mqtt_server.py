"""The embedded MQTT 3.1.1 server (broker/mqtt_server.py) at the protocol level, with real clients:
raw sockets for exact bytes (acknowledgement order, malformed, oversize and idle input), paho-mqtt
2.2 and the mosquitto command-line clients for interoperability. ``dispatch`` is a real recording
function whose completion the tests control."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import shutil
import socket
import struct
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion

from kcloak import __version__
from kcloak.broker.auth import TokenStore
from kcloak.broker.metrics import Metrics
from kcloak.broker.mqtt_server import MqttServer, topic_matches
from kcloak.broker.service import Broker
from kcloak.wire.mqtt_codec import encode_packet, encode_utf8, split_frames
from kcloak.wire.tokens import TokenLine, token_digest
from tests.broker.conftest import SpyUpstream, broker_config

needs_mosquitto_clients = pytest.mark.skipif(
    shutil.which("mosquitto_pub") is None or shutil.which("mosquitto_sub") is None,
    reason="needs mosquitto_pub/mosquitto_sub (mosquitto-clients)",
)


@dataclass
class Recorder:
    """A real dispatch target: records every call; with ``hold``, returns a future the test completes."""

    hold: bool = False
    calls: list[tuple[str, bytes]] = field(default_factory=list)
    futures: list[asyncio.Future[None]] = field(default_factory=list)
    drops: list[tuple[str, str]] = field(default_factory=list)

    def dispatch(self, topic: str, payload: bytes, retain: bool) -> asyncio.Future[None] | None:
        assert not retain  # the server never hands retained input on
        self.calls.append((topic, payload))
        if not self.hold:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        return fut

    def dropped(self, topic: str, reason: str) -> None:
        self.drops.append((topic, reason))


def _tokens(**users: str) -> TokenStore:
    return TokenStore.from_lines([TokenLine(u, token_digest(t), None) for u, t in users.items()])


@asynccontextmanager
async def running(rec: Recorder, **kw: Any) -> AsyncIterator[MqttServer]:
    metrics = Metrics(version=__version__, algorithm="test")
    async with MqttServer(port=0, dispatch=rec.dispatch, dropped=rec.dropped, metrics=metrics, **kw) as srv:
        yield srv


def counter(srv: MqttServer, name: str, **labels: str) -> float:
    value = srv.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def connect_packet(
    client_id: str = "c1",
    *,
    user: str | None = None,
    password: str | None = None,
    clean: bool = True,
    keepalive: int = 60,
    will: tuple[str, bytes, bool] | None = None,
    level: int = 4,
    name: str = "MQTT",
) -> bytes:
    flags = 0x02 if clean else 0
    payload = encode_utf8(client_id)
    if will is not None:
        flags |= 0x04 | (0x20 if will[2] else 0)
        payload += encode_utf8(will[0]) + struct.pack("!H", len(will[1])) + will[1]
    if user is not None:
        flags |= 0x80
        payload += encode_utf8(user)
    if password is not None:
        flags |= 0x40
        payload += encode_utf8(password)
    return encode_packet(1, 0, encode_utf8(name) + bytes([level, flags]) + struct.pack("!H", keepalive) + payload)


def publish_packet(topic: str, payload: bytes, *, qos: int = 1, pid: int = 1, retain: bool = False) -> bytes:
    body = encode_utf8(topic) + (struct.pack("!H", pid) if qos else b"") + payload
    return encode_packet(3, (qos << 1) | (1 if retain else 0), body)


def subscribe_packet(*filters: str, pid: int = 1, qos: int = 1) -> bytes:
    return encode_packet(8, 2, struct.pack("!H", pid) + b"".join(encode_utf8(f) + bytes([qos]) for f in filters))


class Raw:
    """A raw MQTT client on an asyncio stream: exact bytes out, whole packets in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buf = bytearray()

    @classmethod
    async def open(cls, port: int) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def packet(self, timeout: float = 3.0) -> tuple[int, bytes]:
        """The next packet as (first byte, body); raises TimeoutError, or EOFError when closed."""
        async with asyncio.timeout(timeout):
            while True:
                frames, _ = split_frames(self.buf)
                if frames:
                    first, i, end = frames[0]
                    body = bytes(self.buf[i:end])
                    del self.buf[:end]
                    return first, body
                chunk = await self.reader.read(65536)
                if not chunk:
                    raise EOFError("closed by the server")
                self.buf += chunk

    async def nothing(self, wait_s: float = 0.3) -> None:
        """Assert that no packet arrives within ``wait_s``."""
        with pytest.raises(TimeoutError):
            got = await self.packet(wait_s)
            raise AssertionError(f"unexpected packet {got!r}")

    async def connect(self, client_id: str = "c1", **kw: Any) -> tuple[int, int]:
        """(session present, return code) of the CONNACK."""
        await self.send(connect_packet(client_id, **kw))
        first, body = await self.packet()
        assert first == 0x20 and len(body) == 2
        return body[0], body[1]

    async def closed(self, timeout: float = 3.0) -> bool:
        """True once the server closed the connection (pending packets are read and dropped)."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
            return True
        except (TimeoutError, ConnectionError):
            return False

    def close(self) -> None:
        self.writer.close()


def puback(pid: int) -> tuple[int, bytes]:
    return 0x40, struct.pack("!H", pid)


# -- acknowledgements ---------------------------------------------------------------------------
async def test_puback_waits_until_dispatch_is_durable_and_keeps_arrival_order() -> None:
    rec = Recorder(hold=True)
    async with running(rec) as srv:
        c = await Raw.open(srv.port)
        assert await c.connect() == (0, 0)
        await c.send(b"".join(publish_packet("kcloak/v1/update/alice", b"{%d}" % i, pid=i) for i in (1, 2, 3)))
        for _ in range(50):
            if len(rec.futures) == 3:
                break
            await asyncio.sleep(0.01)
        assert [p for _, p in rec.calls] == [b"{1}", b"{2}", b"{3}"]  # dispatched in arrival order
        await c.nothing()  # nothing is durable yet: no PUBACK
        rec.futures[2].set_result(None)
        rec.futures[1].set_result(None)
        await c.nothing()  # 2 and 3 are durable but 1 is not: PUBACKs keep arrival order (§4.6)
        rec.futures[0].set_result(None)
        assert [await c.packet() for _ in range(3)] == [puback(1), puback(2), puback(3)]
        c.close()


async def test_a_message_that_cannot_be_made_durable_is_never_acknowledged() -> None:
    rec = Recorder(hold=True)
    async with running(rec) as srv:
        c = await Raw.open(srv.port)
        await c.connect()
        await c.send(publish_packet("kcloak/v1/update/alice", b"{}", pid=9))
        for _ in range(50):
            if rec.futures:
                break
            await asyncio.sleep(0.01)
        rec.futures[0].set_exception(OSError("disk full"))
        assert await c.closed()  # no PUBACK: the app keeps the message and sends it again


async def test_qos2_is_delivered_once_and_completed() -> None:
    rec = Recorder()
    async with running(rec) as srv:
        c = await Raw.open(srv.port)
        await c.connect()
        await c.send(publish_packet("kcloak/v1/update/alice", b"{a}", qos=2, pid=7))
        assert await c.packet() == (0x50, b"\x00\x07")  # PUBREC
        await c.send(publish_packet("kcloak/v1/update/alice", b"{a}", qos=2, pid=7))  # resent before PUBREL
        assert await c.packet() == (0x50, b"\x00\x07")
        await c.send(encode_packet(6, 2, b"\x00\x07"))  # PUBREL
        assert await c.packet() == (0x70, b"\x00\x07")  # PUBCOMP
        await c.send(publish_packet("kcloak/v1/update/alice", b"{b}", qos=2, pid=7))  # a new message
        assert await c.packet() == (0x50, b"\x00\x07")
        c.close()
    assert [p for _, p in rec.calls] == [b"{a}", b"{b}"]


# -- protocol versions, authentication, client ids ----------------------------------------------
@pytest.mark.parametrize(("name", "level"), [("MQTT", 5), ("MQIsdp", 3)])
async def test_other_protocol_levels_get_connack_unacceptable_version(name: str, level: int) -> None:
    rec = Recorder()
    async with running(rec) as srv:
        c = await Raw.open(srv.port)
        assert await c.connect(level=level, name=name) == (0, 1)
        assert await c.closed()
        assert counter(srv, "kcloak_mqtt_connects_refused_total", reason="protocol_version") == 1


@needs_mosquitto_clients
async def test_mosquitto_pub_mqtt5_is_told_the_version_is_unsupported() -> None:
    async with running(Recorder()) as srv:
        proc = await asyncio.create_subprocess_exec(
            *("mosquitto_pub", "-V", "mqttv5", "-p", str(srv.port), "-t", "kcloak/v1/update/a", "-m", "{}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode not in (0, 19)  # 19 was amqtt's silent failure
    assert "Unsupported Protocol Version" in err.decode()


async def test_tokens_authenticate_users() -> None:
    async with running(Recorder(), tokens=_tokens(alice="tokA")) as srv:
        for kw, code in (
            ({"user": "alice", "password": "wrong"}, 4),
            ({"user": "mallory", "password": "tokA"}, 4),
            ({}, 5),
            ({"user": "alice"}, 5),
            ({"user": "alice", "password": "tokA"}, 0),
        ):
            c = await Raw.open(srv.port)
            assert (await c.connect("x", **kw))[1] == code, kw
            if code:
                assert await c.closed()
            c.close()
        assert counter(srv, "kcloak_mqtt_connects_refused_total", reason="bad_credentials") == 2


async def test_another_users_client_id_is_refused_and_the_owner_keeps_his_session() -> None:
    async with running(Recorder(), tokens=_tokens(alice="tokA", bob="tokB")) as srv:
        alice = await Raw.open(srv.port)
        assert await alice.connect("phone", user="alice", password="tokA", clean=False) == (0, 0)
        await alice.send(subscribe_packet("kcloak/v1/answer/alice"))
        assert (await alice.packet())[0] == 0x90
        bob = await Raw.open(srv.port)
        assert await bob.connect("phone", user="bob", password="tokB", clean=False) == (0, 2)
        assert await bob.closed()
        srv.publish("kcloak/v1/answer/alice", b"for alice")
        first, body = await alice.packet()  # alice was not kicked and still gets her answers
        assert first == 0x32 and body.endswith(b"for alice")
        alice.close()
        await asyncio.sleep(0.1)
        srv.publish("kcloak/v1/answer/alice", b"queued")  # her stored session queues it
        bob = await Raw.open(srv.port)
        assert await bob.connect("phone", user="bob", password="tokB", clean=True) == (0, 2)
        alice = await Raw.open(srv.port)
        assert await alice.connect("phone", user="alice", password="tokA", clean=False) == (1, 0)
        got = [await alice.packet(), await alice.packet()]
        assert [b.endswith(x) for (_, b), x in zip(got, (b"for alice", b"queued"), strict=True)] == [True, True]
        assert got[0][0] & 0x08  # the unacknowledged one again, with DUP set
        assert counter(srv, "kcloak_mqtt_connects_refused_total", reason="identifier_rejected") == 2
        alice.close()


async def test_same_user_takes_over_own_client_id_and_empty_ids_need_clean_session() -> None:
    async with running(Recorder()) as srv:
        first = await Raw.open(srv.port)
        await first.connect("dev")
        second = await Raw.open(srv.port)
        assert await second.connect("dev") == (0, 0)
        assert await first.closed()
        anon = await Raw.open(srv.port)
        assert await anon.connect("", clean=False) == (0, 2)
        anon = await Raw.open(srv.port)
        assert await anon.connect("", clean=True) == (0, 0)
        second.close()
        anon.close()


# -- ACL ------------------------------------------------------------------------------------------
async def test_tokens_acl_for_publish_and_subscribe() -> None:
    rec = Recorder()
    tokens = _tokens(alice="tokA", carol="tokC")
    async with running(rec, tokens=tokens, published_readers=frozenset({"carol"})) as srv:
        alice = await Raw.open(srv.port)
        await alice.connect("a", user="alice", password="tokA")
        filters = (
            "kcloak/v1/answer/alice",
            "kcloak/v1/status/alice",
            "kcloak/v1/broker/status",
            "kcloak/v1/answer/bob",
            "kcloak/v1/answer/+",
            "kcloak/v1/published/#",
            "kcloak/v1/update/alice",
            "#",
        )
        await alice.send(subscribe_packet(*filters, pid=3, qos=2))
        assert await alice.packet() == (0x90, b"\x00\x03" + bytes([1, 1, 1, 0x80, 0x80, 0x80, 0x80, 0x80]))
        carol = await Raw.open(srv.port)
        await carol.connect("c", user="carol", password="tokC")
        await carol.send(subscribe_packet("kcloak/v1/published/#", "kcloak/v1/published/trajectories", pid=4))
        assert await carol.packet() == (0x90, b"\x00\x04\x01\x01")
        await alice.send(publish_packet("kcloak/v1/update/bob", b"{}", pid=1))
        await alice.send(publish_packet("kcloak/v1/answer/alice", b"forged", pid=2))
        await alice.send(publish_packet("foo/bar", b"x", pid=3))
        await alice.send(publish_packet("kcloak/v1/update/alice", b"{}", pid=4))
        assert [await alice.packet() for _ in range(4)] == [puback(1), puback(2), puback(3), puback(4)]
        await alice.nothing()  # the forged answer reached no one
        assert rec.calls == [("kcloak/v1/update/alice", b"{}")]
        assert rec.drops == [("kcloak/v1/update/bob", "forbidden")]
        assert counter(srv, "kcloak_mqtt_server_dropped_total", reason="topic_not_allowed") == 2
        alice.close()
        carol.close()


async def test_open_mode_wildcards_only_over_output_topics_and_input_reaches_no_subscriber() -> None:
    rec = Recorder()
    async with running(rec) as srv:
        sub = await Raw.open(srv.port)
        await sub.connect("s")
        filters = ("kcloak/v1/answer/+", "kcloak/v1/status/bob", "#", "kcloak/#", "kcloak/v1/+/alice", "foo/bar")
        await sub.send(subscribe_packet(*filters))
        assert await sub.packet() == (0x90, b"\x00\x01" + bytes([1, 1, 0x80, 0x80, 0x80, 0x80]))
        pub = await Raw.open(srv.port)
        await pub.connect("p")
        await pub.send(publish_packet("kcloak/v1/query/alice", b'{"query_id":"q"}', pid=1))
        await pub.send(publish_packet("kcloak/v1/answer/alice", b"forged", pid=2))
        assert [await pub.packet(), await pub.packet()] == [puback(1), puback(2)]
        await sub.nothing()
        srv.publish("kcloak/v1/answer/alice", b"real")
        first, body = await sub.packet()
        assert first == 0x32 and body.endswith(b"real")
        assert rec.calls == [("kcloak/v1/query/alice", b'{"query_id":"q"}')]
        sub.close()
        pub.close()


async def test_retained_input_is_dropped_and_only_kcloaks_status_is_retained() -> None:
    rec = Recorder()
    async with running(rec) as srv:
        srv.publish("kcloak/v1/broker/status", b'{"state":"up"}', retain=True)
        pub = await Raw.open(srv.port)
        await pub.connect("p", will=("kcloak/v1/update/alice", b"{w}", True))
        await pub.send(publish_packet("kcloak/v1/update/alice", b"{fix}", pid=1, retain=True))
        await pub.send(publish_packet("kcloak/v1/query/alice", b"{q}", pid=2, retain=True))
        await pub.send(publish_packet("foo/bar", b"x", pid=3, retain=True))
        assert [await pub.packet() for _ in range(3)] == [puback(1), puback(2), puback(3)]
        pub.close()  # no DISCONNECT: the retained will is dropped the same way
        await asyncio.sleep(0.1)
        sub = await Raw.open(srv.port)
        await sub.connect("s")
        await sub.send(subscribe_packet("kcloak/v1/broker/status", "kcloak/v1/answer/+", "foo/bar"))
        assert (await sub.packet())[0] == 0x90
        first, body = await sub.packet()
        assert first == 0x33 and body.endswith(b'{"state":"up"}')  # QoS 1, RETAIN set
        await sub.nothing()
        sub.close()
    assert rec.calls == []
    topics = ("kcloak/v1/update/alice", "kcloak/v1/query/alice", "kcloak/v1/update/alice")  # fix, query, will
    assert rec.drops == [(t, "retained") for t in topics]


# -- wills, keep-alive, idle and malformed clients ----------------------------------------------
async def test_keepalive_expiry_closes_and_publishes_will_but_disconnect_does_not() -> None:
    rec = Recorder()
    async with running(rec) as srv:
        quiet = await Raw.open(srv.port)
        await quiet.connect("q", keepalive=1, will=("kcloak/v1/update/alice", b"{will}", False))
        polite = await Raw.open(srv.port)
        await polite.connect("p", keepalive=1, will=("kcloak/v1/update/bob", b"{bye}", False))
        await polite.send(bytes([0xC0, 0]))  # PINGREQ
        assert await polite.packet() == (0xD0, b"")
        await polite.send(bytes([0xE0, 0]))  # DISCONNECT
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await quiet.closed(timeout=4)
        assert 1.2 < loop.time() - t0 < 2.5
        assert rec.calls == [("kcloak/v1/update/alice", b"{will}")]
        assert counter(srv, "kcloak_mqtt_disconnects_total", reason="keepalive") == 1


@pytest.mark.parametrize("sent", [b"", connect_packet("half")[:9]], ids=["nothing", "half-a-connect"])
async def test_connection_without_complete_connect_is_closed_in_time(sent: bytes) -> None:
    async with running(Recorder(), connect_timeout_s=0.5) as srv:
        c = await Raw.open(srv.port)
        await c.send(sent)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await c.closed(timeout=3)
        assert loop.time() - t0 < 1.5
        assert counter(srv, "kcloak_mqtt_connects_refused_total", reason="timeout") == 1


@pytest.mark.parametrize(
    "bad",
    [
        b"\x30\xff\xff\xff\xff\x01",  # remaining length over four bytes
        publish_packet("kcloak/v1/update/a", b"{}", qos=3),
        publish_packet("kcloak/v1/update/+", b"{}"),  # wildcard in a topic name
        encode_packet(3, 2, b"\x00\x10kcl"),  # topic longer than the packet
        bytes([0x20, 2, 0, 0]),  # a CONNACK from a client
        connect_packet("again"),  # a second CONNECT
    ],
)
async def test_malformed_packet_closes_only_its_own_client(bad: bytes) -> None:
    rec = Recorder()
    async with running(rec) as srv:
        good = await Raw.open(srv.port)
        await good.connect("good")
        evil = await Raw.open(srv.port)
        await evil.connect("evil")
        await evil.send(bad)
        assert await evil.closed()
        await good.send(publish_packet("kcloak/v1/update/alice", b"{ok}", pid=5))
        assert await good.packet() == puback(5)
        good.close()
    assert rec.calls[-1] == ("kcloak/v1/update/alice", b"{ok}")


async def test_topic_length_past_the_frame_end_is_not_read_from_the_next_packet() -> None:
    rec = Recorder()
    async with running(rec) as srv:
        c = await Raw.open(srv.port)
        await c.connect("evil")
        # Topic length 64: the frame ends after 18 topic bytes and a packet id; the rest would come
        # from the PUBLISH sent behind it in the same write.
        lying = encode_packet(3, 2, struct.pack("!H", 64) + b"kcloak/v1/update/a" + b"\x00\x01")
        await c.send(lying + publish_packet("kcloak/v1/update/a", b"{behind}", pid=2))
        assert await c.closed()
    assert rec.calls == [] and rec.drops == []
    assert counter(srv, "kcloak_mqtt_disconnects_total", reason="malformed") == 1


async def test_oversize_publish_is_skipped_unbuffered_acknowledged_and_the_connection_lives() -> None:
    rec = Recorder()
    async with running(rec, max_packet_bytes=1024 * 1024 + 64 * 1024) as srv:
        c = await Raw.open(srv.port)
        await c.connect("big")
        big = publish_packet("kcloak/v1/updates/alice", b"[" + b"1," * 600_000 + b"1]", pid=11)
        assert len(big) > 1_200_000
        for i in range(0, len(big), 50_000):  # streams in over many reads
            await c.send(big[i : i + 50_000])
        await c.send(publish_packet("kcloak/v1/update/alice", b"{after}", pid=12))
        assert [await c.packet(), await c.packet()] == [puback(11), puback(12)]
        conn = next(iter(srv._conns))
        assert len(conn.buf) < 64 * 1024  # the oversize packet was never held in memory
        c.close()
    assert rec.drops == [("kcloak/v1/updates/alice", "too_large")]
    assert rec.calls == [("kcloak/v1/update/alice", b"{after}")]


async def test_packets_larger_than_a_read_and_many_packets_per_read_arrive_whole() -> None:
    """The server reads at most 64 KiB at a time (kcloak.core.memory.bound_socket_reads): a
    PUBLISH of five reads' length sent in odd pieces, and 4,000 small PUBLISHes (about 150 KiB)
    in one write, each reach dispatch byte for byte, in order."""
    rec = Recorder()
    async with running(rec) as srv:
        c = await Raw.open(srv.port)
        await c.connect("reads")
        big_payload = bytes(range(256)) * (5 * 64 * 1024 // 256) + b"tail"
        big = publish_packet("kcloak/v1/updates/alice", big_payload, pid=1)
        for i in range(0, len(big), 40_001):
            await c.send(big[i : i + 40_001])
        assert await c.packet() == puback(1)
        small = [b'{"n": %d}' % i for i in range(4000)]
        await c.send(b"".join(publish_packet("kcloak/v1/update/alice", p, qos=0) for p in small))
        await c.send(publish_packet("kcloak/v1/update/alice", b"{last}", pid=2))
        assert await c.packet() == puback(2)
        c.close()
    assert rec.calls[0] == ("kcloak/v1/updates/alice", big_payload)
    assert [p for _, p in rec.calls[1:]] == [*small, b"{last}"]


# -- outbound: sessions, retransmission, bounds ---------------------------------------------------
async def test_persistent_session_queues_while_offline_bounded_oldest_dropped() -> None:
    async with running(Recorder(), max_queued_messages=5) as srv:
        c = await Raw.open(srv.port)
        await c.connect("keep", clean=False)
        await c.send(subscribe_packet("kcloak/v1/answer/alice"))
        assert (await c.packet())[0] == 0x90
        await c.send(bytes([0xE0, 0]))
        assert await c.closed()
        for i in range(8):
            srv.publish("kcloak/v1/answer/alice", b"a%d" % i)
        c = await Raw.open(srv.port)
        assert await c.connect("keep", clean=False) == (1, 0)
        got = [await c.packet() for _ in range(5)]
        assert [b[-2:] for _, b in got] == [b"a3", b"a4", b"a5", b"a6", b"a7"]
        assert counter(srv, "kcloak_mqtt_server_dropped_total", reason="queue_full") == 3
        c.close()


async def test_a_subscriber_that_never_reads_cannot_grow_memory() -> None:
    async with running(Recorder(), max_inflight_messages=50, max_queued_messages=100) as srv:
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.sendall(connect_packet("slow") + subscribe_packet("kcloak/v1/answer/+", "kcloak/v1/status/+", pid=2))
        await asyncio.sleep(0.2)
        for _ in range(300):
            srv.publish("kcloak/v1/answer/x", b"y" * 20_000)
            srv.publish("kcloak/v1/status/x", b"z" * 20_000)
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        session = next(iter(srv._sessions.values()))
        assert len(session.inflight) <= 50 and len(session.queue) <= 100
        assert counter(srv, "kcloak_mqtt_server_dropped_total", reason="queue_full") > 0
        slow.close()


# -- interoperability ---------------------------------------------------------------------------
async def test_paho_client_publishes_and_receives() -> None:
    rec = Recorder(hold=True)
    async with running(rec) as srv:
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id="paho-1", protocol=paho.MQTTv311)
        client.on_connect = lambda _c, _u, _f, rc, _p: events.put(("connect", rc.value))
        client.on_subscribe = lambda _c, _u, _m, rcs, _p: events.put(("suback", [r.value for r in rcs]))
        client.on_publish = lambda _c, _u, mid, _rc, _p: events.put(("puback", mid))
        client.on_message = lambda _c, _u, m: events.put(("message", (m.topic, m.payload, m.retain)))
        get: Callable[[], tuple[str, Any]] = lambda: events.get(timeout=5)  # noqa: E731
        client.connect("127.0.0.1", srv.port)
        client.loop_start()
        try:
            assert await asyncio.to_thread(get) == ("connect", 0)
            client.subscribe("kcloak/v1/answer/alice", qos=1)
            assert await asyncio.to_thread(get) == ("suback", [1])
            info = client.publish("kcloak/v1/update/alice", json.dumps({"t": 1}), qos=1)
            with pytest.raises(queue.Empty):
                await asyncio.to_thread(events.get, timeout=0.3)  # not durable yet
            for _ in range(50):
                if rec.futures:
                    break
                await asyncio.sleep(0.01)
            rec.futures[0].set_result(None)
            assert await asyncio.to_thread(get) == ("puback", info.mid)
            srv.publish("kcloak/v1/answer/alice", b"answer")
            assert await asyncio.to_thread(get) == ("message", ("kcloak/v1/answer/alice", b"answer", False))
        finally:
            client.loop_stop()
            client.disconnect()


async def test_paho_mqtt5_client_is_refused_with_a_reason() -> None:
    async with running(Recorder()) as srv:
        events: queue.Queue[Any] = queue.Queue()
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id="v5", protocol=paho.MQTTv5)
        client.on_connect = lambda _c, _u, _f, rc, _p: events.put(rc)
        client.connect("127.0.0.1", srv.port)
        client.loop_start()
        try:
            rc = await asyncio.to_thread(events.get, timeout=5)
        finally:
            client.loop_stop()
    assert rc.is_failure and str(rc) == "Unsupported protocol version"


@needs_mosquitto_clients
async def test_mosquitto_clients_interoperate() -> None:
    rec = Recorder()
    async with running(rec) as srv:
        srv.publish("kcloak/v1/broker/status", b"up", retain=True)
        port = str(srv.port)
        sub = await asyncio.create_subprocess_exec(
            *("mosquitto_sub", "-p", port, "-q", "1", "-t", "kcloak/v1/broker/status", "-C", "1", "-W", "5"),
            stdout=subprocess.PIPE,
        )
        out, _ = await sub.communicate()
        assert out == b"up\n"
        for qos in ("0", "1", "2"):
            pub = await asyncio.create_subprocess_exec(
                *("mosquitto_pub", "-p", port, "-q", qos, "-t", "kcloak/v1/update/alice", "-m", f"q{qos}")
            )
            assert await asyncio.wait_for(pub.wait(), 10) == 0
    assert [p for _, p in rec.calls] == [b"q0", b"q1", b"q2"]


async def test_port_in_use_raises_at_once() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError):
            async with MqttServer(port=port, dispatch=Recorder().dispatch, dropped=Recorder().dropped):
                pass


def test_topic_filter_matching() -> None:
    assert topic_matches("kcloak/v1/answer/+", "kcloak/v1/answer/alice")
    assert not topic_matches("kcloak/v1/answer/+", "kcloak/v1/answer/alice/x")
    assert topic_matches("kcloak/v1/published/#", "kcloak/v1/published")
    assert topic_matches("kcloak/v1/published/#", "kcloak/v1/published/trajectories")
    assert not topic_matches("kcloak/v1/broker/status", "kcloak/v1/broker/statuses")


# -- wired into the Broker ----------------------------------------------------------------------
async def test_broker_embedded_status_up_retained_then_down_on_graceful_stop(tmp_path: Path, spy: SpyUpstream) -> None:
    """The Broker serves MQTT in-process: ``/healthz`` says connected, the retained status is ``up``,
    and a graceful stop sends ``down`` to connected subscribers before closing their connections."""
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": "embedded", "mqtt.listen": "127.0.0.1:0"})
    async with Broker(config=cfg) as b:
        assert b.mqtt_port and b.state["mqtt"] == "connected"
        c = await Raw.open(b.mqtt_port)
        await c.connect("watcher")
        await c.send(subscribe_packet("kcloak/v1/broker/status"))
        assert (await c.packet())[0] == 0x90
        first, body = await c.packet()
        assert first == 0x33 and json.loads(body[2 + len("kcloak/v1/broker/status") + 2 :])["state"] == "up"
    first, body = await c.packet()
    down = json.loads(body[2 + len("kcloak/v1/broker/status") + 2 :])
    assert first & 0xF0 == 0x30 and down["state"] == "down" and isinstance(down["t"], float)
    assert await c.closed()


async def test_reading_pauses_while_too_many_acknowledgements_wait() -> None:
    """A client that pipelines QoS 1 messages faster than kcloak makes them durable is read no
    further (its socket fills up) until the acknowledgements drain: bounded memory per connection."""
    rec = Recorder(hold=True)
    async with running(rec, max_pending_acks=4) as srv:
        c = await Raw.open(srv.port)
        await c.connect()
        for pid in range(1, 11):
            await c.send(publish_packet("kcloak/v1/update/alice", b"{%d}" % pid, pid=pid))
            await asyncio.sleep(0.05)
        assert len(rec.calls) == 5  # the fifth waiting acknowledgement paused reading
        while len(rec.calls) < 10:
            for fut in rec.futures:
                if not fut.done():
                    fut.set_result(None)
            await asyncio.sleep(0.05)
        for fut in rec.futures:
            if not fut.done():
                fut.set_result(None)
        assert [await c.packet() for _ in range(10)] == [puback(pid) for pid in range(1, 11)]
        c.close()


async def test_nothing_a_client_sends_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secrets_sent = ("secret-client-77", "alice", "tok-alice-9", "39.987654", "q-secret-5")
    async with running(Recorder(), tokens=_tokens(alice="tok-alice-9")) as srv:
        c = await Raw.open(srv.port)
        await c.connect("secret-client-77", user="alice", password="tok-alice-9", will=("kcloak/v1/x", b"w", False))
        await c.send(publish_packet("kcloak/v1/update/alice", b'{"lat": 39.987654}', pid=1))
        await c.send(publish_packet("kcloak/v1/query/bob", b'{"query_id": "q-secret-5"}', pid=2))
        await c.send(subscribe_packet("kcloak/v1/answer/alice", "secret-client-77/#"))
        await c.send(b"\x30\xff\xff\xff\xff\x01")  # malformed: closes
        assert await c.closed()
        bad = await Raw.open(srv.port)
        assert (await bad.connect("secret-client-77", user="alice", password="wrong"))[1] == 4
    assert caplog.records  # something was logged (the listening port)
    assert not [s for s in secrets_sent if s in caplog.text]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=300))
async def test_random_bytes_after_connect_never_break_the_server(garbage: bytes) -> None:
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        async with running(Recorder()) as srv:
            evil = await Raw.open(srv.port)
            await evil.connect("evil")
            await evil.send(garbage)
            good = await Raw.open(srv.port)
            await good.connect("good")
            await good.send(publish_packet("kcloak/v1/update/alice", b"{}", pid=3))
            assert await good.packet() == puback(3)
            evil.close()
            good.close()
    finally:
        loop.set_exception_handler(None)
    assert errors == []
