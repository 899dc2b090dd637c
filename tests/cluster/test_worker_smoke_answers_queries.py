"""Two Worker objects, 4 cells, 8 partitions, a real `kcloak lbs`: fixes go through routers to cell owners,
every query gets one stored answer whose region holds ≥ k users of the published population, the
partitions and cells are split between the two workers as their rendezvous hashes say (6/2 and 3/1 here;
≥ 10 of the 12 consumers as predicted, start skew allowing), and each owner holds only its cell's users."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcloak.broker.cluster.topology import Layout
from kcloak.broker.cluster.worker import Worker, preference
from kcloak.broker.config import Config
from kcloak.broker.metrics import Metrics
from kcloak.cloaking.cells import CellMap
from tests.cluster.worker_fixtures import App, count_inside, lbs_url, population

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")
__all__ = ["lbs_url"]


def make_worker(urls: list[str], layout: Layout, cells: CellMap, upstream: str, data: Path, name: str) -> Worker:
    config = Config()
    config = dataclasses.replace(
        config,
        upstream=dataclasses.replace(config.upstream, url=upstream),
        storage=dataclasses.replace(config.storage, data_dir=str(data)),
    )
    return Worker(
        servers=urls,
        layout=layout,
        cells=cells,
        config=config,
        metrics=Metrics(version="t", algorithm="hilbert"),
        name=name,
        debug_status=True,
    )


def test_two_workers_answer_every_query_from_their_cells(nats_cluster: Any, lbs_url: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        pop = population(60, seed=1, spread=0.01)
        lat = np.array([p[0] for p in pop.values()])
        lon = np.array([p[1] for p in pop.values()])
        cells = CellMap.balanced(lat, lon, cells=4)
        layout = Layout(partitions=8, cells=4, replicas=3, pinned_timeout_s=2.0)
        workers = [make_worker(nats_cluster.urls, layout, cells, lbs_url, tmp_path, f"w{i}") for i in range(2)]
        await asyncio.gather(*(w.start() for w in workers))
        nc = await nats.connect(servers=nats_cluster.urls)
        app = App(nc, layout.partitions)
        now = time.time()
        for user, (la, lo) in pop.items():
            await app.fix(user, now, la, lo)
        await asyncio.sleep(1.0)
        users = list(pop)[:20]
        for i, user in enumerate(users):
            await app.publish(user, "query", {"query_id": f"q{i}", "kind": "knn", "n": 3})
        deadline = time.monotonic() + 15
        answers: dict[str, Any] = {}
        while len(answers) < len(users) and time.monotonic() < deadline:
            for i, user in enumerate(users):
                if user not in answers:
                    a = await app.answer(user, f"q{i}")
                    if a is not None:
                        answers[user] = a
            await asyncio.sleep(0.2)
        statuses = [w.status(users=True) for w in workers]
        assert len(answers) == len(users), statuses
        for a in answers.values():
            assert a["status"] == "ok", a
            assert count_inside(a["region"]["bbox"], pop) >= 5
        parts = sorted(p for s in statuses for p in s["partitions"])
        owned = sorted(c for s in statuses for c in s["cells"])
        assert parts == list(range(8)) and owned == list(range(4))
        # balance: a consumer goes to the worker whose rendezvous hash for it is lowest (it pulls first), unless
        # the two workers' start skew exceeds the gap between their delays for it (then either may win)
        expected = {f"in-{p}": min(("w0", "w1"), key=lambda n: preference(f"in-{p}", n)) for p in range(8)}
        expected.update({f"cell-{c}": min(("w0", "w1"), key=lambda n: preference(f"cell-{c}", n)) for c in range(4)})
        holder = {f"in-{p}": s["name"] for s in statuses for p in s["partitions"]}
        holder.update({f"cell-{c}": s["name"] for s in statuses for c in s["cells"]})
        assert sum(holder[k] == v for k, v in expected.items()) >= 10, (holder, expected)
        assert all(s["partitions"] and s["cells"] for s in statuses), "both workers hold some partitions and cells"
        held = [set(u) for s in statuses for u in s["users"].values()]
        assert sum(len(h) for h in held) == len(pop) and set.union(*held) == {u.replace(".", "//") for u in pop}
        for w in workers:
            await w.stop()
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
