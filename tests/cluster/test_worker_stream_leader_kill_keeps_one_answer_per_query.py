"""Issue 15 proofs (1), (3), (4) and (5) across a SIGKILL of a NATS node: the leader of ``KCLOAK_ANSWERS``.

Two worker processes, 4 cells, 4 partitions, a real ``kcloak lbs``, users moving and jumping across cells
every round (``Rounds``, the tests' own reference and counting). Before the third round the node leading
the answers stream is SIGKILLed (it may lead other streams and consumers too); the app's publishes retry
with the same message id, as a gateway does. Checked: every ``ok`` region holds ≥ k users of the
reference, no user in two live indexes in any sample, exactly one republished answer per query id, zero
``out_of_order``/``too_old`` and every user's latest PubAck'ed fix in a live index.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_worker_kill_keeps_k_one_index_one_answer import cells_file, start_workers
from tests.cluster.worker_fixtures import App, Rounds, WorkerProcess, lbs_url, population, worker_procs

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")
__all__ = ["lbs_url", "worker_procs"]


def test_a_killed_stream_leader_loses_no_fix_and_answers_each_query_once(
    nats_cluster: Any, lbs_url: str, tmp_path: Path, worker_procs: list[WorkerProcess]
) -> None:
    pop = population(60, seed=5, spread=0.01)
    cells = cells_file(pop, tmp_path / "cells.json")
    start_workers(nats_cluster, lbs_url, tmp_path, cells, worker_procs, 2)

    async def scenario() -> None:
        nc = await nats.connect(servers=nats_cluster.urls, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        app = App(nc, 4)
        rounds = Rounds(app, nc, pop, seed=11)
        await rounds.start()
        users = list(pop)
        killed = None
        for r in range(5):
            if r == 2:
                info = await app.js.stream_info("KCLOAK_ANSWERS")
                killed = info.cluster.leader
                nats_cluster.kill9(killed)
            await rounds.move_all()
            await rounds.settle(timeout=20)
            await rounds.query(f"r{r}", users[r * 10 : r * 10 + 12], timeout=20)
        assert killed is not None
        await rounds.exactly_one_answer_each(wait_s=1.5)
        assert rounds.out_of_order() == 0
        assert rounds.ok >= 30, rounds.refused
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 100))
