"""The gateway's MQTT PUBACK means "in the replicated intake stream" (docs/cluster.md "Gateway").

Compare with pinned fact 2 (``test_acknowledged_fix_survives_node_kill.py``): NATS's own MQTT listener
PUBACKs before the stream has the message and lost acknowledged fixes when the stream leader was
SIGKILLed. kcloak's gateway PUBACKs only after the JetStream PubAck, so every acknowledged fix is in
``KCLOAK_IN`` after the same kill; a publish that meets a leader failover is retried with the same
``Nats-Msg-Id`` and stored once.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import nats
import pytest

from kcloak.broker.cluster.natsconf import NatsNode
from kcloak.broker.cluster.topology import partition_of, subject_token
from tests.cluster.conftest import NatsCluster, mqtt_publish
from tests.cluster.gateway_fixtures import PARTITIONS, Gateway, gateway, intake_messages, stream_leader

pytestmark = pytest.mark.cluster
__all__ = ["gateway"]

USERS = [f"u{i}.x" for i in range(10)]


def door(gw: Gateway, tmp_path: Path) -> NatsNode:
    """The gateway's MQTT listener, in the shape ``mqtt_publish`` takes."""
    return NatsNode("gateway", 0, 0, gw.mqtt_port, 0, tmp_path)


def fixes(n: int, t0: float) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        user = USERS[i % len(USERS)]
        fix = {"lat": 39.9 + i * 1e-5, "lon": 116.4, "t": round(t0 + i * 0.01, 3)}
        out.append((f"kcloak/v1/update/{user}", json.dumps(fix).encode()))
    return out


async def intake_leader(cluster: NatsCluster) -> str:
    nc = await nats.connect(servers=cluster.urls)
    try:
        return await stream_leader(nc.jetstream(timeout=2.0))
    finally:
        await nc.close()


def stored_fixes(cluster: NatsCluster) -> list[tuple[str, str, dict[str, str], float]]:
    """``(subject, user token, headers, t)`` of every fix in ``KCLOAK_IN``, in stream order; a gateway's
    ``batch`` message (docs/cluster.md "Envelope") holds several app messages, each with its user."""
    out = []
    for subject, headers, body in asyncio.run(intake_messages(cluster)):
        kind, token = subject.split(".")[3:5]
        if kind == "update":
            out.append((subject, token, headers, float(json.loads(body)["t"])))
        elif kind == "batch":
            for part in json.loads(body)["batch"]:
                assert part["kind"] == "update"
                out.append((subject, part["user"], headers, float(part["body"]["t"])))
    return out


def metric(text: str, name: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name))


def test_fixes_pubacked_by_the_gateway_survive_sigkill_of_the_intake_leader(
    nats_cluster: NatsCluster, gateway: Gateway, tmp_path: Path
) -> None:
    leader = asyncio.run(intake_leader(nats_cluster))
    sent = fixes(200, time.time())
    mqtt_publish(door(gateway, tmp_path), sent, client_id="app-1", timeout_s=60)  # every PUBACK is back
    nats_cluster.kill9(leader)
    stored = stored_fixes(nats_cluster)
    assert sorted(t for *_, t in stored) == sorted(json.loads(p)["t"] for _, p in sent)
    for subject, token, headers, _ in stored:
        partition, kind = subject.split(".")[2:4]
        assert int(partition) == partition_of(token, PARTITIONS)  # every fix in its user's partition
        assert kind == "batch" or subject == f"kcloak.in.{partition}.update.{token}"
        assert headers["Kcloak-Transport"] == "mqtt"
        assert headers["Nats-Msg-Id"].startswith(f"gw{gateway.http_port}/")
    ids = [h["Nats-Msg-Id"] for _, h, _ in asyncio.run(intake_messages(nats_cluster))]
    assert len(set(ids)) == len(ids)  # each intake message stored once
    for user in USERS:  # each user's fixes in the order the app sent them
        mine = [t for _, token, _, t in stored if token == subject_token(user)]
        assert mine == sorted(mine) and len(mine) == 20


def test_a_publish_during_a_leader_failover_is_retried_and_stored_once(
    nats_cluster: NatsCluster, gateway: Gateway, tmp_path: Path
) -> None:
    leader = asyncio.run(intake_leader(nats_cluster))
    nats_cluster.kill9(leader)  # no intake leader for about 5 s
    sent = fixes(20, time.time())
    started = time.monotonic()
    mqtt_publish(door(gateway, tmp_path), sent, client_id="app-2", timeout_s=60)
    took = time.monotonic() - started
    text = gateway.metrics()
    assert metric(text, "kcloak_gateway_publish_retries_total") > 0, f"no retry (PUBACKs after {took:.1f} s)"
    assert metric(text, "kcloak_gateway_publish_failed_total") == 0
    stored = stored_fixes(nats_cluster)
    assert sorted(t for *_, t in stored) == sorted(json.loads(p)["t"] for _, p in sent)  # each once
