"""The ledger's lease and compare-and-set (issue 15, docs/cluster.md "Window publication"): a live coordinator
keeps its window while it anonymizes; after a dead one's lease, two coordinators racing to take the window
over publish it once. Real 3-node NATS; coordinators in the test process."""

from __future__ import annotations

import asyncio
import json

import pytest

from kcloak.broker.publication import Window
from kcloak.streams.partitioned import PartParams, anonymize_partitioned
from kcloak.streams.publish import Release
from tests.cluster.conftest import NatsCluster
from tests.streams.test_partitioned_windows import window_fixes

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats", reason="the cluster extra (nats-py) is not installed")

from kcloak.broker.cluster.coordinator import PART_HEADER, WindowBusy, WindowCoordinator  # noqa: E402
from kcloak.broker.cluster.topology import (  # noqa: E402
    PUBLISHED_STREAM,
    WINDOWS_BUCKET,
    Layout,
    ensure_publication_layout,
    published_subject,
)

WINDOW = Window(1_000_000, 1_000_900)
PARAMS = PartParams(method="nwa", k=3, delta_m=400.0, trash_max=0.1, pi_s=60.0)


async def release() -> Release:
    return await asyncio.to_thread(anonymize_partitioned, window_fixes(21), PARAMS, parts=2)


async def never() -> Release:
    raise AssertionError("a coordinator that does not hold the window must not anonymize it")


async def parts_in_stream(js: object, window_id: str) -> list[int]:
    info = await js.stream_info(PUBLISHED_STREAM)  # type: ignore[attr-defined]
    out = []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        msg = await js.get_msg(PUBLISHED_STREAM, seq)  # type: ignore[attr-defined]
        if msg.subject == published_subject(window_id):
            out.append(int(msg.headers[PART_HEADER].split("/")[0]))
    return out


async def test_a_live_coordinator_keeps_its_window_while_it_anonymizes(nats_cluster: NatsCluster) -> None:
    nc = await nats.connect(servers=nats_cluster.urls)
    try:
        await ensure_publication_layout(nc, Layout(replicas=3))
        a = WindowCoordinator(nc, name="a", lease_s=0.9, part_rows=100)
        b = WindowCoordinator(nc, name="b", lease_s=0.9, part_rows=100)
        began = asyncio.Event()

        async def slow() -> Release:
            began.set()
            await asyncio.sleep(3.0)  # more than three leases
            return await release()

        task = asyncio.create_task(a.publish(WINDOW, slow))
        await began.wait()
        for _ in range(5):
            await asyncio.sleep(0.5)
            with pytest.raises(WindowBusy):
                await b.publish(WINDOW, never)
        outcome = await task
        assert outcome.state == "published" and outcome.acted
        late = await b.publish(WINDOW, never)
        assert (late.state, late.acted, late.content_hash) == ("published", False, outcome.content_hash)
        assert await parts_in_stream(nc.jetstream(), WINDOW.window_id) == list(range(1, outcome.parts + 1))
    finally:
        await nc.close()


async def test_two_coordinators_taking_over_a_dead_ones_window_publish_it_once(nats_cluster: NatsCluster) -> None:
    nc = await nats.connect(servers=nats_cluster.urls)
    try:
        await ensure_publication_layout(nc, Layout(replicas=3))
        js = nc.jetstream()
        kv = await js.key_value(WINDOWS_BUCKET)
        dead = {"state": "started", "coordinator": "dead", "t": 0.0, "attempt": 1}  # its lease long expired
        await kv.create(WINDOW.window_id, json.dumps(dead).encode())
        racers = [WindowCoordinator(nc, name=n, lease_s=60.0, part_rows=100) for n in ("a", "b", "c")]
        results = await asyncio.gather(*(r.publish(WINDOW, release) for r in racers), return_exceptions=True)
        published = [r for r in results if not isinstance(r, BaseException)]
        assert len(published) == 1 and published[0].state == "published"
        assert all(isinstance(r, WindowBusy) for r in results if isinstance(r, BaseException))
        assert await parts_in_stream(js, WINDOW.window_id) == list(range(1, published[0].parts + 1))
    finally:
        await nc.close()
