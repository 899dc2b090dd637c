"""A priority group of two pinned members (broker/cluster/pinned.py) on a real 3-node cluster: exactly one
member receives; when it dies with messages un-acknowledged, the other is pinned after ``priority_timeout``
and gets every message it had not acknowledged, in stream order, none lost and none handed over twice; a
member coming back with the old pin id is told 423 and receives nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from kcloak.broker.cluster.pinned import Delivered, PinnedMember
from kcloak.broker.cluster.topology import IN_STREAM, Layout, ensure_layout, in_filter, in_subject

pytestmark = pytest.mark.cluster

nats = pytest.importorskip("nats")


class Recorder:
    """A handler that records sequences and acknowledges only the first ``ack_first`` messages."""

    def __init__(self, name: str, ack_first: int | None = None) -> None:
        self.name = name
        self.ack_first = ack_first
        self.seqs: list[int] = []
        self.member: PinnedMember | None = None
        self.pinned_at: float | None = None
        self.events: list[str] = []

    async def handle(self, batch: list[Delivered]) -> None:
        assert self.member is not None
        for msg in batch:
            self.seqs.append(msg.seq)
            if self.ack_first is None or len(self.seqs) <= self.ack_first:
                await self.member.ack(msg)

    async def pinned(self) -> None:
        self.pinned_at = time.monotonic()
        self.events.append("pinned")

    async def unpinned(self) -> None:
        self.events.append("unpinned")


def member(nc: Any, rec: Recorder, **kw: Any) -> PinnedMember:
    m = PinnedMember(
        nc,
        IN_STREAM,
        "in-0",
        handler=rec.handle,
        on_pinned=rec.pinned,
        on_unpinned=rec.unpinned,
        lease_s=2.0,
        catch_up=True,
        filter_subject=in_filter(0),
        batch=16,
        **kw,
    )
    rec.member = m
    return m


async def wait_for(cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def test_one_member_receives_and_the_other_takes_over_every_unacked_message_in_order(nats_cluster: Any) -> None:
    async def scenario() -> None:
        layout = Layout(partitions=1, cells=1, replicas=3, pinned_timeout_s=2.0)
        nc_a = await nats.connect(servers=nats_cluster.urls)
        nc_b = await nats.connect(servers=nats_cluster.urls)
        pub = await nats.connect(servers=nats_cluster.urls)
        js = pub.jetstream()
        await ensure_layout(pub, layout)
        a, b = Recorder("a", ack_first=20), Recorder("b")
        ma, mb = member(nc_a, a), member(nc_b, b, start_delay_s=0.5)
        ta, tb = asyncio.create_task(ma.run()), asyncio.create_task(mb.run())
        published: list[int] = []
        for i in range(50):
            ack = await js.publish(in_subject(0, "update", "u1"), str(i).encode(), stream=IN_STREAM)
            published.append(ack.seq)
        await wait_for(lambda: len(a.seqs) + len(b.seqs) >= 50, 10)
        await asyncio.sleep(0.5)
        assert a.seqs == published and b.seqs == [], "exactly one member (the first to pull) receives"
        assert ma.pinned and not mb.pinned
        # a dies: no more pulls, no unpin, 30 messages delivered and never acknowledged
        ta.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ta
        died = time.monotonic()
        stale_pin = ma.pin_id
        await nc_a.close()
        for i in range(50, 70):
            ack = await js.publish(in_subject(0, "update", "u1"), str(i).encode(), stream=IN_STREAM)
            published.append(ack.seq)
        await wait_for(lambda: len(b.seqs) >= 50, 15)
        assert b.pinned_at is not None and b.pinned_at - died >= 1.0, "pinned only after priority_timeout"
        assert b.seqs == published[20:], "every un-acked message, in stream order, none twice"
        # a comes back with its old pin id: 423, nothing delivered
        nc_a2 = await nats.connect(servers=nats_cluster.urls)
        a2 = Recorder("a2")
        ma2 = member(nc_a2, a2)
        ma2.pin_id = stale_pin
        ta2 = asyncio.create_task(ma2.run())
        await wait_for(lambda: ma2.counters["status_423"] >= 1, 5)
        ack = await js.publish(in_subject(0, "update", "u1"), b"70", stream=IN_STREAM)
        published.append(ack.seq)
        await wait_for(lambda: len(b.seqs) >= 51, 5)
        assert a2.seqs == [] and b.seqs[-1] == ack.seq
        for m in (mb, ma2):
            await m.stop()
        for t in (tb, ta2):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for nc in (nc_b, nc_a2, pub):
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 40))
