"""A worker SIGKILLed while its routers hold queries in flight: each query still gets exactly one answer.

A routed query is a core-NATS request to the cell's owner, and the router holds the query's intake message until
the owner says the answer is stored (docs/cluster.md "Workers"). Here the upstream LBS answers only after
``DELAY_S`` (a delaying proxy in front of a real ``kcloak lbs``), so the queries sent just before the kill are
still in flight when the busier of two worker processes is SIGKILLed: routers of the victim hold their intake
messages, its owners are inside the upstream call. Fixes go on after the kill, as apps keep sending: a partition's
successor router is pinned by its next delivery and first hands over what its predecessor held (catch-up).
Checked with the test's own code: some query of a user of a victim's partition had no answer at the kill; every
query gets an answer afterwards; each query id's answer is republished by ``KCLOAK_ANSWERS`` exactly once; every
``ok`` region (JSON → float64) holds ≥ k users of the test's own latest-fix reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_worker_kill_keeps_k_one_index_one_answer import PARTITIONS, cells_file, start_workers
from tests.cluster.worker_fixtures import (
    App,
    Rounds,
    WorkerProcess,
    debug_status,
    lbs_url,
    partition,
    population,
    worker_procs,
)

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")
__all__ = ["lbs_url", "worker_procs"]

DELAY_S = 1.2
"""Under the upstream client's 2 s timeout: the queries are slow, not failing."""


@pytest.fixture
def slow_lbs(lbs_url: str) -> Iterator[str]:
    """The real LBS behind a proxy that waits ``DELAY_S`` before passing each request on."""

    class Slow(BaseHTTPRequestHandler):
        def _relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
            time.sleep(DELAY_S)
            req = urllib.request.Request(lbs_url + self.path, data=body, method=self.command)
            if self.headers.get("Content-Type"):
                req.add_header("Content-Type", self.headers["Content-Type"])
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    status, ctype, data = resp.status, resp.headers.get("Content-Type", ""), resp.read()
            except urllib.error.HTTPError as err:
                status, ctype, data = err.code, err.headers.get("Content-Type", ""), err.read()
            with contextlib.suppress(OSError):  # the asking worker may have been killed meanwhile
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        do_GET = do_POST = _relay

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_worker_killed_while_it_holds_queries_leaves_each_query_one_answer(
    nats_cluster: Any, slow_lbs: str, tmp_path: Path, worker_procs: list[WorkerProcess]
) -> None:
    pop = population(60, seed=9, spread=0.01)
    cells = cells_file(pop, tmp_path / "cells.json")
    workers = start_workers(nats_cluster, slow_lbs, tmp_path, cells, worker_procs, 2)

    async def scenario() -> None:
        nc = await nats.connect(servers=nats_cluster.urls, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        app = App(nc, PARTITIONS)
        rounds = Rounds(app, nc, pop, seed=13)
        await rounds.start()
        await rounds.move_all()
        await rounds.settle()
        statuses = await debug_status(nc, 0.2)
        victim = max(statuses, key=lambda s: len(s["partitions"]) + len(s["cells"]))
        users = list(pop)[:24]
        snapshot = dict(rounds.ref)
        for i, user in enumerate(users):
            await app.publish(user, "query", {"query_id": f"held:{i}", "kind": "knn", "n": 3})
        await asyncio.sleep(DELAY_S / 3)
        unanswered = [
            u
            for i, u in enumerate(users)
            if partition(u, PARTITIONS) in victim["partitions"] and await app.answer(u, f"held:{i}") is None
        ]
        workers[int(victim["name"][1:])].kill9()
        assert unanswered, "no query of the victim's routers was in flight at the kill"
        # traffic goes on: a partition's successor router is pinned by its next delivery, then catches up
        await rounds.move_all()

        deadline = time.monotonic() + 45
        pending = {u: f"held:{i}" for i, u in enumerate(users)}
        while pending:
            for user, qid in list(pending.items()):
                answer = await app.answer(user, qid)
                if answer is not None:
                    rounds.answers[f"{user}/{qid}"] = answer
                    rounds.check(answer, snapshot)
                    del pending[user]
            if pending:
                assert time.monotonic() < deadline, f"{len(pending)} held queries without an answer"
                await asyncio.sleep(0.2)
        await rounds.exactly_one_answer_each(wait_s=2.0)
        assert rounds.ok >= len(users) // 2, rounds.refused
        with contextlib.suppress(Exception):
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
