"""The MQTT door: bad input is dropped and counted, never fatal; batches and profiles work."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from kcloak.broker.service import Broker
from tests.broker.conftest import SpyUpstream, broker_config


def _count(text: str, prefix: str, *needles: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and all(n in line for n in needles)
    )


async def test_bad_messages_are_dropped_and_counted(tmp_path: Path, spy: SpyUpstream, mqtt_port: int) -> None:
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}"})
    async with Broker(config=cfg) as b, aiomqtt.Client("127.0.0.1", mqtt_port) as c:
        await c.subscribe("kcloak/v1/status/alice", qos=1)
        now = time.time()
        fix = json.dumps({"t": now, "lat": 39.9, "lon": 116.4})
        await c.publish("kcloak/v1/update/alice", b"{not json", qos=1)
        await c.publish("kcloak/v1/update/bad$user", fix, qos=1)
        await c.publish(
            "kcloak/v1/update/alice", b'{"t": 1, "lat": 1, "lon": 1, "pad": "' + b"x" * 70_000 + b'"}', qos=1
        )
        await c.publish("kcloak/v1/update/alice", json.dumps({"t": now, "lat": 95, "lon": 0}), qos=1)
        await c.publish("kcloak/v1/update/alice", fix, qos=1)
        batch = {"updates": [{"t": now + 0.1 * i, "lat": 39.9, "lon": 116.4, "user": f"g{i}"} for i in range(50)]}
        await c.publish("kcloak/v1/updates/gateway", json.dumps(batch), qos=1)
        await c.publish("kcloak/v1/profile/alice", json.dumps({"request_id": "p1", "profile": {"k": 8}}), qos=1)
        async with asyncio.timeout(5):
            async for m in c.messages:
                assert isinstance(m.payload, bytes)
                status = json.loads(m.payload)
                break
        for _ in range(50):
            text = b.metrics.render().decode()
            if _count(text, "kcloak_updates_accepted_total") >= 51:
                break
            await asyncio.sleep(0.05)
    assert status["kind"] == "profile" and status["status"] == "ok" and status["profile"]["k"] == 8
    assert status["request_id"] == "p1"
    dropped = "kcloak_messages_dropped_total"
    assert _count(text, dropped, 'reason="malformed_json"') == 1
    assert _count(text, dropped, 'reason="invalid"') == 1
    assert _count(text, dropped, 'reason="too_large"') == 1
    assert _count(text, "kcloak_updates_rejected_total", 'reason="invalid"') == 1
    assert _count(text, "kcloak_updates_accepted_total") == 51


async def test_profile_request_id_outside_its_pattern_is_refused_not_echoed(
    tmp_path: Path, spy: SpyUpstream, mqtt_port: int
) -> None:
    """A profile message's ``request_id`` follows the query id pattern (contract §1); one that does
    not (a trailing newline, 65 characters, a number) is refused ``invalid`` and never echoed."""
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}"})
    bad_ids: list[object] = ["p1\n", "x" * 65, 7]
    async with Broker(config=cfg) as b, aiomqtt.Client("127.0.0.1", mqtt_port) as c:
        await c.subscribe("kcloak/v1/status/alice", qos=1)
        for rid in [*bad_ids, "p-ok"]:
            await c.publish("kcloak/v1/profile/alice", json.dumps({"request_id": rid, "profile": {"k": 8}}), qos=1)
        statuses = []
        async with asyncio.timeout(5):
            async for m in c.messages:
                assert isinstance(m.payload, bytes)
                statuses.append(json.loads(m.payload))
                if len(statuses) == len(bad_ids) + 1:
                    break
        stored, _, _ = b.pipeline.get_profile("alice") if b.pipeline is not None else (None, None, None)
    for st in statuses[:-1]:
        assert (st["status"], st["reason"]) == ("refused", "invalid") and "request_id" not in st
    assert statuses[-1]["status"] == "ok" and statuses[-1]["request_id"] == "p-ok"
    assert stored is not None and stored.k == 8


async def test_single_fixes_whose_submission_was_cancelled_are_not_reported_durable(
    tmp_path: Path, spy: SpyUpstream, mqtt_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion the door hands a transport for single fixes is cancelled, not done, when
    their submission was cancelled (shutdown): the transports acknowledge only durable messages."""
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}"})
    async with Broker(config=cfg) as b:
        assert b.pipeline is not None
        real = b.pipeline.enqueue_fixes

        def enqueue_then_cancel(*args: Any, **kwargs: Any) -> asyncio.Task[Any]:
            task = real(*args, **kwargs)
            task.cancel()
            return task

        monkeypatch.setattr(b.pipeline, "enqueue_fixes", enqueue_then_cancel)
        fix = json.dumps({"t": time.time(), "lat": 39.9, "lon": 116.4}).encode()
        done = b.mqtt.dispatch("kcloak/v1/update/alice", fix, False)
        assert done is not None
        await asyncio.wait([done], timeout=5)
        assert done.cancelled()


async def test_profile_message_on_a_full_disk_is_refused_overloaded(
    tmp_path: Path, spy: SpyUpstream, mqtt_port: int
) -> None:
    """A profile message the store cannot write (a real SQLITE_FULL) gets its status, refused
    ``overloaded`` as HTTP's 503, instead of no status at all."""
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}"})
    async with Broker(config=cfg) as b, aiomqtt.Client("127.0.0.1", mqtt_port) as c:
        assert b.pipeline is not None
        conn: sqlite3.Connection = b.pipeline.profiles._conn
        conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
        await c.subscribe("kcloak/v1/status/+", qos=1)
        refused: dict[str, object] | None = None
        for i in range(2000):
            await c.publish(f"kcloak/v1/profile/u{i}", json.dumps({"request_id": f"p{i}", "profile": {"k": 6}}), qos=1)
            async with asyncio.timeout(5):
                m = await anext(aiter(c.messages))
            assert isinstance(m.payload, bytes)
            status = json.loads(m.payload)
            if status["status"] != "ok":
                refused = status
                break
        text = b.metrics.render().decode()
    assert refused is not None and (refused["status"], refused["reason"]) == ("refused", "overloaded")
    assert _count(text, "kcloak_profile_sets_total", 'reason="overloaded"', 'transport="mqtt"') == 1


async def test_retained_input_replayed_at_subscription_is_dropped(tmp_path: Path, spy: SpyUpstream) -> None:
    """A retained fix left on the MQTT broker would replay at every restart: it is dropped."""
    from kcloak.broker.bench import mosquitto

    with mosquitto(tmp_path) as (port, _):
        async with aiomqtt.Client("127.0.0.1", port) as c:
            fix = json.dumps({"t": time.time(), "lat": 39.9, "lon": 116.4})
            await c.publish("kcloak/v1/update/alice", fix, qos=1, retain=True)
        cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": f"mqtt://127.0.0.1:{port}"})
        async with Broker(config=cfg) as b:
            for _ in range(50):
                text = b.metrics.render().decode()
                if _count(text, "kcloak_messages_dropped_total", 'reason="retained"'):
                    break
                await asyncio.sleep(0.05)
    assert _count(text, "kcloak_messages_dropped_total", 'reason="retained"', 'topic="update"') == 1
    assert _count(text, "kcloak_updates_accepted_total") == 0


async def test_embedded_broker_with_tokens_enforces_the_acl(tmp_path: Path, spy: SpyUpstream, mqtt_port: int) -> None:
    """With tokens, the embedded broker authenticates users and pins each one to its own topics."""
    from kcloak.broker.auth import TokenStore

    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("alice:tokA\nbob:tokB\n")
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}"})
    tokens = TokenStore.from_file(tokens_file)
    async with Broker(config=cfg, tokens=tokens) as b:
        for user, password in (("alice", "wrong"), ("mallory", "tokA")):
            try:
                async with aiomqtt.Client("127.0.0.1", mqtt_port, username=user, password=password):
                    refused = False
            except aiomqtt.MqttError:
                refused = True
            assert refused, user
        async with (
            aiomqtt.Client("127.0.0.1", mqtt_port, username="alice", password="tokA") as alice,
            aiomqtt.Client("127.0.0.1", mqtt_port, username="bob", password="tokB") as bob,
        ):
            await bob.subscribe("kcloak/v1/answer/alice", qos=1)  # not bob's: never delivered
            await alice.subscribe("kcloak/v1/answer/alice", qos=1)
            now = time.time()
            await alice.publish("kcloak/v1/update/bob", json.dumps({"t": now, "lat": 1.0, "lon": 1.0}), qos=1)
            await alice.publish("kcloak/v1/update/alice", json.dumps({"t": now, "lat": 39.9, "lon": 116.4}), qos=1)
            await alice.publish("kcloak/v1/query/alice", json.dumps({"query_id": "q", "kind": "knn", "n": 1}), qos=1)
            async with asyncio.timeout(5):
                async for m in alice.messages:
                    assert isinstance(m.payload, bytes)
                    answer = json.loads(m.payload)
                    break
            assert answer["query_id"] == "q" and answer["status"] == "refused"
            try:
                async with asyncio.timeout(0.5):
                    async for _ in bob.messages:
                        raise AssertionError("bob received alice's answer")
            except TimeoutError:
                pass
        text = b.metrics.render().decode()
    assert _count(text, "kcloak_updates_accepted_total") == 1  # bob's topic was never written


async def test_broker_status_is_retained_up_then_down(tmp_path: Path, spy: SpyUpstream) -> None:
    """``kcloak/v1/broker/status`` is retained: ``up`` while serving, ``down`` with a time after a
    graceful stop (contract §3)."""
    from kcloak.broker.bench import mosquitto

    with mosquitto(tmp_path) as (port, _):
        cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": f"mqtt://127.0.0.1:{port}"})
        async with Broker(config=cfg), aiomqtt.Client("127.0.0.1", port) as c:
            await c.subscribe("kcloak/v1/broker/status", qos=1)
            async with asyncio.timeout(5):
                async for m in c.messages:
                    assert isinstance(m.payload, bytes)
                    up = json.loads(m.payload)
                    assert m.retain
                    break
        async with aiomqtt.Client("127.0.0.1", port) as c:
            await c.subscribe("kcloak/v1/broker/status", qos=1)
            async with asyncio.timeout(5):
                async for m in c.messages:
                    assert isinstance(m.payload, bytes)
                    down = json.loads(m.payload)
                    break
    assert up["state"] == "up" and up["algorithm"] == "hilbert" and up["auth"] == "open"
    assert down["state"] == "down" and isinstance(down["t"], float)


def test_split_frames_keeps_incomplete_packets_and_rejects_malformed_lengths() -> None:
    from kcloak.wire.mqtt_codec import MalformedFrame, encode_packet, split_frames

    small, big = encode_packet(4, 0, b"\x00\x07"), encode_packet(3, 0, b"x" * 300)  # 300: two length bytes
    buf = bytearray(small + big + big[:5])
    frames, used = split_frames(buf)
    assert frames == [(0x40, 2, 4), (0x30, 7, 307)] and used == len(small) + len(big)
    assert split_frames(bytearray(b"\x30\xff\xff"))[1] == 0  # length still arriving
    with pytest.raises(MalformedFrame):
        split_frames(bytearray(b"\x30\xff\xff\xff\xff\x01"))  # five length bytes
    with pytest.raises(MalformedFrame):
        split_frames(bytearray(big), max_packet=127)


def test_connect_packet_bytes_follow_mqtt_3_1_1() -> None:
    """CONNECT laid out by hand from the specification (§3.1): fixed header, protocol name and
    level, connect flags, keep-alive, then client id, will topic and message, username, password."""
    from kcloak.wire.mqtt_codec import encode_connect

    header = b"\x00\x04MQTT\x04"
    with_login = encode_connect("c", username="u", password="p", keepalive_s=30)
    assert with_login == b"\x10\x13" + header + b"\xc2\x00\x1e" + b"\x00\x01c" + b"\x00\x01u" + b"\x00\x01p"
    with_will = encode_connect("c", username=None, password="ignored", keepalive_s=300, will=("w", b"xy"))
    assert with_will == b"\x10\x14" + header + b"\x2e\x01\x2c" + b"\x00\x01c" + b"\x00\x01w" + b"\x00\x02xy"


async def test_client_raises_instead_of_waiting_when_it_cannot_connect() -> None:
    from kcloak.wire.mqtt_client import MqttClient, MqttError
    from kcloak.wire.net import free_port

    with pytest.raises(MqttError, match="cannot connect"):
        async with asyncio.timeout(10), MqttClient(host="127.0.0.1", port=free_port(), on_messages=lambda _: None):
            pass
