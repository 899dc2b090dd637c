"""A cell owner acknowledges what it applied with the consumer's own ack policy (docs/cluster.md "Workers"): a cell
consumer of this layout acknowledges with ``all``, so the owner sends one ack per applied micro-batch, not one per
event, and the consumer still ends with nothing pending; a cell consumer created by an earlier layout (``explicit``,
which NATS cannot change) keeps its policy and gets an ack for every event.

Read from outside: the consumer's configuration and state from the JetStream API, the acks counted by a plain NATS
subscription on the consumer's ack subjects."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.worker_fixtures import one_cell_worker

nats = pytest.importorskip("nats")
pytestmark = pytest.mark.cluster

EVENTS = 200


async def _api(nc: Any, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await nc.request(f"$JS.API.{subject}", b"" if body is None else json.dumps(body).encode(), timeout=5)
    data: dict[str, Any] = json.loads(reply.data)
    assert "error" not in data, data["error"]
    return data


@pytest.mark.parametrize("earlier_layout", [False, True], ids=["ack-all", "explicit-kept"])
def test_owner_acknowledges_each_batch_once_with_the_consumers_policy(
    nats_cluster: Any, tmp_path: Path, earlier_layout: bool
) -> None:
    async def scenario() -> None:
        nc = await nats.connect(servers=nats_cluster.urls)
        worker = one_cell_worker(nats_cluster.urls, tmp_path)
        if earlier_layout:  # what an earlier version created: the cells stream and an explicit-ack cell consumer
            for config in worker.layout.stream_configs():
                await _api(nc, f"STREAM.CREATE.{config['name']}", config)
            explicit = {**worker.layout.pinned_consumer_config("cell-0", "kcloak.cell.0.>"), "ack_policy": "explicit"}
            await _api(nc, "CONSUMER.CREATE.KCLOAK_CELLS.cell-0", {"stream_name": "KCLOAK_CELLS", "config": explicit})
        acks: list[str] = []

        async def count(msg: Any) -> None:
            acks.append(msg.subject)

        await nc.subscribe("$JS.ACK.KCLOAK_CELLS.cell-0.>", cb=count)
        await worker.start()
        try:
            js = nc.jetstream()
            now = time.time()
            published = await asyncio.gather(
                *(
                    js.publish(
                        f"kcloak.cell.0.0.u{i}",
                        json.dumps({"e": "fix", "t": now, "lat": 39.9 + i * 1e-4, "lon": 116.4, "in": i + 1}).encode(),
                        stream="KCLOAK_CELLS",
                    )
                    for i in range(EVENTS)
                )
            )
            last = max(ack.seq for ack in published)
            deadline = time.monotonic() + 30
            while True:
                info = await _api(nc, "CONSUMER.INFO.KCLOAK_CELLS.cell-0")
                floor, pending = info["ack_floor"]["stream_seq"], info["num_ack_pending"] + info["num_pending"]
                done = floor >= last and pending == 0
                if done or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert done, info
            await nc.flush()
            await asyncio.sleep(0.3)  # the last acks reach our subscription too
            assert info["config"]["ack_policy"] == ("explicit" if earlier_layout else "all")
            delivered = info["delivered"]["consumer_seq"]
            assert delivered >= EVENTS
            if earlier_layout:
                assert len(acks) >= EVENTS  # every event acknowledged on its own
            else:
                assert 1 <= len(acks) < EVENTS  # one ack per applied micro-batch
        finally:
            await worker.stop()
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 90))
