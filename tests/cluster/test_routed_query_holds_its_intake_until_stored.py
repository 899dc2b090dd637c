"""The router's side of a routed query (docs/cluster.md "Workers" → "The routed query"), on a real NATS cluster.

The test plays the cell's owner itself (a queue subscriber on ``kcloak.cellq.<c>`` answering what it chooses) and
watches the held intake message's ack subject (a core subscription of its own), so it sees exactly what the
router sends: no ``+ACK`` before the owner said ``stored``; a silent owner gets the query again marked
``again``; a router that lost its pin acknowledges nothing; a cell with no owner at all ends in the router's
give-up refusal and then one ``+ACK``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")


class Watch:
    """Everything published on one subject, with arrival times."""

    def __init__(self) -> None:
        self.got: list[tuple[float, bytes, str | None]] = []

    async def cb(self, msg: Any) -> None:
        self.got.append((time.monotonic(), bytes(msg.data), msg.reply or None))


async def settle(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_the_intake_message_is_acknowledged_only_after_the_owner_stored_the_answer(nats_cluster: Any) -> None:
    from kcloak.broker.cluster.routed import QueryDispatch

    async def scenario() -> None:
        nc = await nats.connect(servers=nats_cluster.urls)
        owner_nc = await nats.connect(servers=nats_cluster.urls[::-1])
        pinned = {"on": True}
        calls = {"owner_check": 0, "give_up": 0}

        async def owner_check() -> None:
            calls["owner_check"] += 1

        async def give_up() -> None:
            calls["give_up"] += 1

        dispatch = QueryDispatch(nc, keep_trying=lambda: pinned["on"], silence_s=0.5, give_up_s=1.5)
        acks = Watch()
        await nc.subscribe("test.ack.>", cb=acks.cb)

        # 1. an owner that works for 1.2 s, saying so, then says stored
        requests = Watch()
        stored_at: list[float] = []

        async def slow_owner(msg: Any) -> None:
            await requests.cb(msg)

            async def work() -> None:
                for _ in range(6):  # 1.2 s of work, saying so well within the router's 0.5 s of patience
                    await asyncio.sleep(0.2)
                    await owner_nc.publish(msg.reply, b'{"s":"working"}')
                stored_at.append(time.monotonic())
                await owner_nc.publish(msg.reply, b'{"s":"stored"}')

            asyncio.get_running_loop().create_task(work())

        sub = await owner_nc.subscribe("kcloak.cellq.3", queue="kcloak", cb=slow_owner)
        await owner_nc.flush()
        routed = {"user": "u1", "query": {"query_id": "q1", "kind": "knn", "n": 1}}
        dispatch.hold(101, "test.ack.101", 3, dict(routed), owner_check=owner_check, give_up=give_up)
        await settle(lambda: len(acks.got) == 1)
        await asyncio.sleep(0.6)
        assert len(requests.got) == 1, "a working owner was sent the query again"
        assert [a[1] for a in acks.got] == [b"+ACK"]
        assert acks.got[0][0] >= stored_at[0], "acknowledged before the answer was stored"
        assert 101 not in dispatch.held
        await sub.unsubscribe()

        # 2. a silent owner: the query comes again, marked "again"; the router loses its pin: no ack, nothing held
        silent = Watch()
        # On the router's own node: its first request must find the subscriber (interest sent to other nodes
        # may still be on its way, and a "no responders" there would make the first copy a resend).
        local_nc = await nats.connect(servers=[nc.connected_url.geturl()])
        sub = await local_nc.subscribe("kcloak.cellq.4", queue="kcloak", cb=silent.cb)
        await local_nc.flush()
        dispatch.hold(102, "test.ack.102", 4, dict(routed, user="u2"), owner_check=owner_check, give_up=give_up)
        await settle(lambda: len(silent.got) >= 2)
        first, second = (json.loads(m[1]) for m in silent.got[:2])
        assert "again" not in first and second["again"] is True
        pinned["on"] = False
        await settle(lambda: 102 not in dispatch.held)
        await asyncio.sleep(1.0)
        assert len(acks.got) == 1, "a router that lost its pin acknowledged a query it had not seen stored"
        await sub.unsubscribe()
        await local_nc.close()
        pinned["on"] = True

        # 3. nobody subscribed: no responders, resends with owner checks, then the give-up refusal and one ack
        dispatch.hold(103, "test.ack.103", 5, dict(routed, user="u3"), owner_check=owner_check, give_up=give_up)
        await settle(lambda: len(acks.got) == 2)
        assert calls["give_up"] == 1 and calls["owner_check"] >= 2
        assert acks.got[1][1] == b"+ACK"
        await asyncio.sleep(0.5)
        assert len(acks.got) == 2 and calls["give_up"] == 1
        await nc.close()
        await owner_nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
