"""Fact 3a (docs/cluster.md "Engine"): NATS's MQTT listener takes kcloak's topics, user ids with ``.``
included, and a JetStream stream on ``kcloak.v1.update.>`` receives them under a fixed subject rule:
MQTT ``/`` becomes ``.`` and a ``.`` inside a level becomes ``//``."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest
from nats.js.errors import ServiceUnavailableError

from tests.cluster.conftest import NatsCluster, mqtt_publish

pytestmark = pytest.mark.cluster


async def _fetch_once_the_consumer_serves(sub: Any, n: int, within_s: float = 15.0) -> list[Any]:
    """``fetch`` of a consumer just created with three replicas: until its leader is elected the pull
    request has no responder (503), which says nothing about the subjects; that is retried, no more."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        try:
            got: list[Any] = await sub.fetch(n, timeout=5)
            return got
        except ServiceUnavailableError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_mqtt_topic_levels_and_dots_map_to_subject_tokens(nats_cluster: NatsCluster) -> None:
    nc = await nats.connect(servers=nats_cluster.urls)
    try:
        js = nc.jetstream()
        await js.add_stream(name="UPDATES", subjects=["kcloak.v1.update.>"], num_replicas=3)
        messages = [("kcloak/v1/update/alice.b", b"fix-alice"), ("kcloak/v1/update/bob", b"fix-bob")]
        await asyncio.to_thread(mqtt_publish, nats_cluster.nodes[1], messages, client_id="app-1")

        sub = await js.pull_subscribe("kcloak.v1.update.*", durable="intake")
        got = await _fetch_once_the_consumer_serves(sub, 2)
        assert {(m.subject, m.data) for m in got} == {
            ("kcloak.v1.update.alice//b", b"fix-alice"),
            ("kcloak.v1.update.bob", b"fix-bob"),
        }
        # ``alice//b`` is one subject token: a single ``*`` matches it, so one wildcard per user id holds.
        assert all(len(m.subject.split(".")) == 4 for m in got)
    finally:
        await nc.close()


async def test_subject_with_double_slash_reaches_the_mqtt_topic_with_a_dot(nats_cluster: NatsCluster) -> None:
    """The way back (answers): a NATS publish on ``kcloak.v1.answer.alice//b`` reaches an MQTT subscriber of
    ``kcloak/v1/answer/alice.b``."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    node = nats_cluster.nodes[2]
    received: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    subscribed = asyncio.Event()
    connected = asyncio.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="app-answer", protocol=paho.MQTTv311)

    def on_message(_client: paho.Client, _userdata: object, msg: paho.MQTTMessage) -> None:
        loop.call_soon_threadsafe(received.put_nowait, (msg.topic, bytes(msg.payload)))

    def on_subscribe(*_args: object) -> None:
        loop.call_soon_threadsafe(subscribed.set)

    def on_connect(*_args: object) -> None:
        loop.call_soon_threadsafe(connected.set)

    client.on_message = on_message
    client.on_subscribe = on_subscribe
    client.on_connect = on_connect
    client.connect(node.host, node.mqtt_port, keepalive=30)
    client.loop_start()
    nc = await nats.connect(servers=[nats_cluster.nodes[0].client_url])
    try:
        await asyncio.wait_for(connected.wait(), 10)  # NATS sets up the MQTT session in JetStream first
        client.subscribe("kcloak/v1/answer/alice.b", qos=1)
        await asyncio.wait_for(subscribed.wait(), 10)
        # the subscription is registered on node 3; interest reaches node 1 through the routes shortly after
        for _ in range(50):
            await nc.publish("kcloak.v1.answer.alice//b", b"answer-1")
            await nc.flush()
            try:
                topic, payload = await asyncio.wait_for(received.get(), 0.2)
                break
            except TimeoutError:
                continue
        else:
            pytest.fail("the MQTT subscriber never received the answer")
        assert (topic, payload) == ("kcloak/v1/answer/alice.b", b"answer-1")
    finally:
        await nc.close()
        client.disconnect()
        client.loop_stop()
