"""Issue 15 proofs (1), (3), (4) and (5) across a SIGKILL of a worker process.

Two worker processes (``python -m kcloak.cli.cluster_worker``), 4 cells, 4 partitions, a real
``kcloak lbs``; users move every round and a fifth of them jump across the city (so across cells). Halfway
the worker holding more partitions and cells is SIGKILLed. Checked with the test's own code:

- (1) every ``ok`` answer's region (JSON → float64) holds ≥ k users of the test's own latest-fix reference;
- (3) every sample of the live owners' users (debug status) has no user twice (``Rounds.sample``);
- (4) each query id's answer is republished by ``KCLOAK_ANSWERS`` exactly once;
- (5) zero ``out_of_order``/``too_old`` with monotone input, and every user's latest PubAck'ed fix reaches
  a live index after the kill (none lost).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.cluster.worker_fixtures import App, Rounds, WorkerProcess, debug_status, lbs_url, population, worker_procs

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")
__all__ = ["lbs_url", "worker_procs"]

PARTITIONS, CELLS, PINNED_TIMEOUT = 4, 4, 2.0


def cells_file(pop: dict[str, tuple[float, float]], path: Path) -> Path:
    from kcloak.cloaking.cells import CellMap  # the public cells file every worker loads

    lat = np.array([p[0] for p in pop.values()])
    lon = np.array([p[1] for p in pop.values()])
    path.write_text(CellMap.balanced(lat, lon, cells=CELLS).to_json())
    return path


def start_workers(
    nats_cluster: Any, lbs: str, tmp_path: Path, cells: Path, procs: list[WorkerProcess], n: int
) -> list[WorkerProcess]:
    started = []
    for i in range(n):
        args = [
            "--servers",
            ",".join(nats_cluster.urls),
            "--cells",
            str(cells),
            "--partitions",
            str(PARTITIONS),
            "--pinned-timeout",
            str(PINNED_TIMEOUT),
            "--upstream",
            lbs,
            "--data-dir",
            str(tmp_path / f"w{i}"),
            "--name",
            f"w{i}",
            "--debug-status",
        ]
        w = WorkerProcess(args, tmp_path / f"w{i}.log")
        procs.append(w)
        started.append(w)
    for w in started:
        w.wait_started()
    return started


async def wait_all_owned(nc: Any, timeout: float = 15.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        statuses = await debug_status(nc, 0.2)
        parts = sorted(p for s in statuses for p in s["partitions"])
        cells = sorted(c for s in statuses for c in s["cells"])
        if parts == list(range(PARTITIONS)) and cells == list(range(CELLS)):
            return statuses
        assert time.monotonic() < deadline, (parts, cells)
        await asyncio.sleep(0.1)


def test_a_killed_worker_loses_no_fix_and_no_answer_and_never_counts_a_user_twice(
    nats_cluster: Any, lbs_url: str, tmp_path: Path, worker_procs: list[WorkerProcess]
) -> None:
    pop = population(60, seed=3, spread=0.01)
    cells = cells_file(pop, tmp_path / "cells.json")
    workers = start_workers(nats_cluster, lbs_url, tmp_path, cells, worker_procs, 2)

    async def scenario() -> None:
        nc = await nats.connect(servers=nats_cluster.urls)
        app = App(nc, PARTITIONS)
        rounds = Rounds(app, nc, pop)
        await rounds.start()
        statuses: list[dict[str, Any]] = []
        users = list(pop)
        for r in range(5):
            if r == 2:
                victim = max(statuses, key=lambda s: len(s["partitions"]) + len(s["cells"]))["name"]
                workers[int(victim[1:])].kill9()
                await rounds.move_all()  # fixes published while the victim's partitions have no router
            else:
                await rounds.move_all()
            await rounds.settle()
            await rounds.query(f"r{r}", users[r * 10 : r * 10 + 12])
            statuses = await debug_status(nc, 0.2)
        await rounds.exactly_one_answer_each()
        assert rounds.out_of_order() == 0
        assert rounds.ok >= 30, rounds.refused
        assert rounds.samples >= 5
        survivors = await wait_all_owned(nc)
        assert len(survivors) == 1
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 90))
