"""The owner's lease (docs/cluster.md "Workers", "Lease"), on a real 3-node cluster.

Worker w0 reaches NATS only through node n1; worker w1 through n2 and n3. w0 holds the cell and its 20
users. SIGKILL of n1 cuts w0 off without any message to it: its owner must drop its index (``live`` False,
no users) on its own, about ``priority_timeout / 2`` after its last answered pull, and before w1's owner is
live — sampled every 20 ms in the same event loop, the two are never live together — and w1's owner, pinned
after ``priority_timeout`` when the only message after the kill (a query) reaches the cell, rebuilds every
user from the stream and answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from kcloak.broker.cluster.worker import Worker
from tests.cluster.worker_fixtures import App, one_cell_worker, population

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")

TIMEOUT = 2.0


def worker(urls: list[str], tmp: Path, name: str, spread: float) -> Worker:
    return one_cell_worker(urls, tmp, name=name, spread=spread, pinned_timeout_s=TIMEOUT)


async def abandon(w: Worker) -> None:
    """Stop a cut-off worker's tasks without talking to NATS."""
    for task in w._tasks:
        task.cancel()
    for owner in w.owners:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(owner.stop(), 2)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(w.nc.close(), 2)


def test_a_cut_off_owner_drops_its_index_before_its_successor_is_live(nats_cluster: Any, tmp_path: Path) -> None:
    n1, n2, n3 = (node.client_url for node in nats_cluster.nodes)

    async def scenario() -> None:
        w0 = worker([n1], tmp_path, "w0", 0.0)
        await w0.start()

        # nats-py adds the servers the cluster advertises (INFO connect_urls, at connect and whenever the cluster
        # changes) to its pool and has no option against it: keep w0 on n1 by stripping them each time
        async def only_n1() -> None:
            w0.nc._server_pool[:] = [srv for srv in w0.nc._server_pool if not srv.discovered]

        await only_n1()
        w0.nc._discovered_server_cb = only_n1
        w1 = worker([n2, n3], tmp_path, "w1", 1.0)
        await w1.start()
        nc = await nats.connect(servers=[n2, n3])
        app = App(nc, 2)
        pop = population(20, seed=2, spread=0.01)
        now = time.time()
        for user, (lat, lon) in pop.items():
            await app.fix(user, now, lat, lon)
        o0, o1 = w0.owners[0], w1.owners[0]
        deadline = time.monotonic() + 10
        while len(o0.users()) < 20:
            assert time.monotonic() < deadline, "w0 never held the cell's users"
            await asyncio.sleep(0.05)
        assert not o1.live
        await only_n1()
        assert [srv.uri.netloc for srv in w0.nc._server_pool] == [n1.split("//")[1]]
        killed = time.monotonic()
        nats_cluster.kill9("n1")
        # sampled from the kill on, every 20 ms, while the test publishes (a publish may wait out the intake
        # stream's leader election for seconds: the lease must not depend on it)
        seen: dict[str, float] = {}
        both_live: list[float] = []

        async def sample() -> None:
            while True:
                now = time.monotonic()
                if o0.live and o1.live:
                    both_live.append(now)
                if "dropped" not in seen and not o0.live:
                    seen["dropped"] = now
                    seen["users_left"] = float(len(o0.users()))
                if o1.live and len(o1.users()) >= 20:
                    seen["taken"] = now
                    return
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        # only a query after the kill: its router (w1's, once pinned by it) must find the cell ownerless and
        # give the cell's consumer a delivery, so that w1's owner is pinned and answers it
        first = next(iter(pop))
        await app.publish(first, "query", {"query_id": "after-kill", "kind": "knn", "n": 1})
        try:
            await asyncio.wait_for(asyncio.shield(sampler), max(0.1, killed + 20 - time.monotonic()))
        except TimeoutError:
            sampler.cancel()
            raise AssertionError(("no successor owner", o1.member.counters)) from None
        assert both_live == [], "two live owners of one cell"
        dropped = seen.get("dropped")
        assert dropped is not None and seen["users_left"] == 0
        taken = seen["taken"]
        assert dropped is not None and dropped < taken
        assert dropped - killed <= TIMEOUT / 2 + 1.0, "the cut-off owner kept its index past its lease"
        assert set(o1.users()) == {u.replace(".", "//") for u in pop}
        deadline = time.monotonic() + 10
        while (answer := await app.answer(first, "after-kill")) is None:
            assert time.monotonic() < deadline, "the query after the kill got no answer"
            await asyncio.sleep(0.1)
        assert answer["status"] == "refused" and answer["reason"] == "upstream_error"  # no provider on port 9
        await abandon(w0)
        await w1.stop()
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
