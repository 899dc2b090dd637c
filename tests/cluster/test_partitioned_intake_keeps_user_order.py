"""Fact 3c (docs/cluster.md "Engine", "Intake"): the stream's subject transform
``kcloak.v1.update.*`` → ``kcloak.v1.update.{{partition(P,1)}}.{{wildcard(1)}}`` stores each user's fixes in
one partition, in the order the app sent them; one consumer per partition then sees a user's whole history."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js.api import StreamConfig, SubjectTransform

from kcloak.broker.cluster.topology import partition_of
from tests.cluster.conftest import NatsCluster, retried

pytestmark = pytest.mark.cluster

PARTITIONS = 4
USERS = ["alice.b", "bob", "carol", "dave-1", "erin.x.y", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar"]
FIXES_PER_USER = 15


def nats_token(user: str) -> str:
    """The subject token NATS's MQTT listener makes of a topic level (a ``.`` becomes ``//``)."""
    return user.replace(".", "//")


def fnv1a_32(data: bytes) -> int:
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


async def publish_via(url: str, fixes: list[tuple[str, bytes]]) -> None:
    """Publish each user's fixes on ``kcloak.v1.update.<token>`` through one node, waiting for each PubAck."""
    nc = await nats.connect(servers=[url])
    try:
        js = nc.jetstream(timeout=10.0)
        for user, payload in fixes:
            await js.publish(f"kcloak.v1.update.{nats_token(user)}", payload)
    finally:
        await nc.close()


async def test_one_users_fixes_stay_in_one_partition_in_order(nats_cluster: NatsCluster) -> None:
    nc = await nats.connect(servers=nats_cluster.urls)
    try:
        js = nc.jetstream(timeout=5.0)
        await retried(
            lambda: js.add_stream(
                StreamConfig(
                    name="UPDATES",
                    subjects=["kcloak.v1.update.*"],
                    num_replicas=3,
                    subject_transform=SubjectTransform(
                        src="kcloak.v1.update.*",
                        dest=f"kcloak.v1.update.{{{{partition({PARTITIONS},1)}}}}.{{{{wildcard(1)}}}}",
                    ),
                )
            )
        )
        # interleaved across users, as many apps send at once; two publishers on two nodes, each fix
        # acknowledged by the stream (a PubAck: NATS's MQTT PUBACK would not prove it was stored, fact 3b)
        fixes = [(user, f"{user}:{seq}".encode()) for seq in range(FIXES_PER_USER) for user in USERS]
        half = len(USERS) // 2
        await asyncio.gather(
            publish_via(nats_cluster.nodes[0].client_url, [f for f in fixes if f[0] in USERS[:half]]),
            publish_via(nats_cluster.nodes[1].client_url, [f for f in fixes if f[0] in USERS[half:]]),
        )

        seen: dict[str, list[int]] = {}
        partition_of_user: dict[str, set[int]] = {}
        for partition in range(PARTITIONS):
            sub = await js.pull_subscribe(
                f"kcloak.v1.update.{partition}.*", durable=f"part-{partition}", stream="UPDATES"
            )
            pending = (await sub.consumer_info()).num_pending or 0
            for _ in range(pending):
                for msg in await sub.fetch(1, timeout=5):
                    user, seq = msg.data.decode().rsplit(":", 1)
                    assert msg.subject == f"kcloak.v1.update.{partition}.{nats_token(user)}"
                    seen.setdefault(user, []).append(int(seq))
                    partition_of_user.setdefault(user, set()).add(partition)
                    await msg.ack()

        assert seen == {user: list(range(FIXES_PER_USER)) for user in USERS}  # every fix, each user in order
        assert all(len(parts) == 1 for parts in partition_of_user.values())  # one partition per user
        assert len({next(iter(parts)) for parts in partition_of_user.values()}) > 1  # and the users are spread
        # the rule, so a worker can compute a user's partition: FNV-1a (32 bit) of the subject token, mod P
        assert {user: next(iter(parts)) for user, parts in partition_of_user.items()} == {
            user: fnv1a_32(nats_token(user).encode()) % PARTITIONS for user in USERS
        }
        # and kcloak's gateway computes the same partition without the transform
        assert all(partition_of(nats_token(user), PARTITIONS) == next(iter(partition_of_user[user])) for user in USERS)
    finally:
        await nc.close()
