"""Fact 3b (docs/cluster.md "Engine", "Durability"): which acknowledgement means "in the replicated stream".

Pinned here, against the design's first assumption: NATS's MQTT listener sends a QoS 1 PUBACK as soon
as the message enters the server (it hands it to core NATS), not once a JetStream stream has stored it.
A PUBACK therefore proves nothing about durability: a stream that refuses the fixes still lets every one
be PUBACKed (and SIGKILL of the stream leader right after the PUBACKs lost 18 of 200 acknowledged
fixes in one of 8 runs here: docs/cluster.md "Engine").
A JetStream publish acknowledgement (``PubAck``) does wait for the R3 stream: SIGKILL of the stream
leader right after the acks loses none of them. kcloak's durable intake must acknowledge an app's fix
only after such a ``PubAck``.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy

from tests.cluster.conftest import NatsCluster, mqtt_publish, retried

pytestmark = pytest.mark.cluster

FIXES = 200
STREAM = "UPDATES"


async def stream_leader(js: JetStreamContext, timeout_s: float = 20.0) -> str:
    """The stream's leader once one is elected (about 5 s after the old one is SIGKILLed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = await js.stream_info(STREAM)
        except (nats.errors.Error, TimeoutError):
            info = None
        if info is not None and info.cluster is not None and info.cluster.leader:
            return str(info.cluster.leader)
        await asyncio.sleep(0.1)
    raise TimeoutError(f"stream {STREAM} has no leader within {timeout_s} s")


async def create_r3_stream(nats_cluster: NatsCluster) -> str:
    nc = await nats.connect(servers=nats_cluster.urls)
    try:
        js = nc.jetstream(timeout=1.0)
        await retried(lambda: js.add_stream(name=STREAM, subjects=["kcloak.v1.update.>"], num_replicas=3))
        return await stream_leader(js)
    finally:
        await nc.close()


async def stored_messages(nats_cluster: NatsCluster) -> list[bytes]:
    await asyncio.to_thread(nats_cluster.wait_meta_leader)  # consumers are created through the meta leader
    nc = await nats.connect(servers=nats_cluster.urls)
    try:
        await stream_leader(nc.jetstream(timeout=1.0))
        js = nc.jetstream(timeout=5.0)
        info = await js.stream_info(STREAM)
        sub = await retried(lambda: js.pull_subscribe("kcloak.v1.update.>", durable="check"))
        stored: list[bytes] = []
        while len(stored) < info.state.messages:
            # The new consumer's own leader may not be elected yet on a busy host (503, "no responders"):
            # the cluster settling, read again as any reader would.
            batch = await retried(partial(sub.fetch, info.state.messages - len(stored), timeout=5))
            stored += [m.data for m in batch]
        return stored
    finally:
        await nc.close()


def fixes() -> list[tuple[str, bytes]]:
    return [(f"kcloak/v1/update/user.{i % 7}", f"fix-{i}".encode()) for i in range(FIXES)]


async def test_jetstream_acknowledged_fixes_survive_sigkill_of_the_stream_leader(nats_cluster: NatsCluster) -> None:
    leader = await create_r3_stream(nats_cluster)
    via = next(node for node in nats_cluster.nodes if node.name != leader)
    nc = await nats.connect(servers=[via.client_url])
    try:
        js = nc.jetstream(timeout=5.0)
        for topic, payload in fixes():
            # The node published through may not yet know the new stream's subjects ("no responders"); a
            # retry under the message's id is stored once (the stream's duplicate window), so order holds.
            ack = await retried(
                partial(
                    js.publish,
                    topic.replace("/", "."),
                    payload,
                    stream=STREAM,
                    headers={"Nats-Msg-Id": payload.decode()},
                )
            )
            assert ack.stream == STREAM
    finally:
        await nc.close()
    nats_cluster.kill9(leader)  # at once after the last PubAck

    assert await stored_messages(nats_cluster) == [payload for _topic, payload in fixes()]  # all, in order


async def test_mqtt_qos1_puback_does_not_wait_for_the_stream_to_store(nats_cluster: NatsCluster) -> None:
    """The R3 stream takes one message and refuses the rest (``max_msgs=1``, discard new): the app still
    gets a PUBACK for every fix, so a PUBACK says nothing about the stream."""
    nc = await nats.connect(servers=nats_cluster.urls)
    try:
        js = nc.jetstream(timeout=1.0)
        await retried(
            lambda: js.add_stream(
                name=STREAM, subjects=["kcloak.v1.update.>"], num_replicas=3, max_msgs=1, discard=DiscardPolicy.NEW
            )
        )
        await stream_leader(js)
        await asyncio.to_thread(mqtt_publish, nats_cluster.nodes[0], fixes(), client_id="app-1")  # every PUBACK
        await asyncio.sleep(0.5)  # the stream has had time to store whatever it would store
        info = await js.stream_info(STREAM)
        assert info.state.messages == 1
        assert info.state.first_seq == info.state.last_seq == 1
    finally:
        await nc.close()
