"""Issue 15: windows are published from the cluster's own movement history (stream ``KCLOAK_MOVES``), on a
timer, exactly once even with two workers racing. A real 3-node NATS cluster, two real worker processes
(``python -m kcloak.cli.cluster_worker`` with the window timer on), fixes sent through the intake stream and
the real router path; the published window is checked with the independent (k,δ) checker, and the stream is
read here with nats-py alone (no kcloak reader) to show a rejected fix never reaches the history."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcloak.core.readers import FixTable
from kcloak.streams.quality import verify_k_delta
from tests.cluster.conftest import NatsCluster
from tests.cluster.worker_fixtures import LAT0, LON0, App, WorkerProcess, partition, token, worker_procs  # noqa: F401

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats", reason="the cluster extra (nats-py) is not installed")

W, AGE, GRACE, K, DELTA, P = 12, 3.0, 1.0, 3, 2000.0, 2
USERS = [f"mover.{i}" for i in range(8)]


def start_workers(cluster: NatsCluster, tmp_path: Path, procs: list[WorkerProcess]) -> None:
    for name in ("wa", "wb"):
        args = [
            "--servers", ",".join(cluster.urls), "--partitions", str(P), "--name", name,
            "--upstream", "http://127.0.0.1:9", "--data-dir", str(tmp_path / name),
            "--publish-window-s", str(W), "--max-update-age-s", str(AGE), "--publish-grace-s", str(GRACE),
            "--publish-k", str(K), "--publish-delta-m", str(DELTA),
        ]  # fmt: skip
        procs.append(WorkerProcess(args, tmp_path / f"{name}.log"))
    for proc in procs:
        proc.wait_started(60)


async def send_fix(app: App, user: str, t: float, lat: float, lon: float) -> str | None:
    """One fix through the intake stream with a reply inbox: the router's code for it (None: accepted)."""
    inbox = app.nc.new_inbox()
    sub = await app.nc.subscribe(inbox, max_msgs=1)
    app.counter += 1
    subject = f"kcloak.in.{partition(user, P)}.update.{token(user)}"
    headers = {"Nats-Msg-Id": f"moves-test/{app.counter}", "Kcloak-Transport": "http", "Kcloak-Reply": inbox}
    await app.js.publish(
        subject, json.dumps({"t": t, "lat": lat, "lon": lon}).encode(), stream="KCLOAK_IN", headers=headers
    )
    reply = await sub.next_msg(timeout=20)
    code: str | None = json.loads(reply.data)["codes"][0]
    return code


async def stored_moves(nc: Any) -> list[dict[str, Any]]:
    """Every move of KCLOAK_MOVES, read with nats-py's plain stream API: a message holds a router's flush,
    ``{"m": [[user token, t, lat, lon], …]}`` (docs/cluster.md "Window publication")."""
    js = nc.jetstream()
    info = await js.stream_info("KCLOAK_MOVES")
    out = []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            body = json.loads((await js.get_msg("KCLOAK_MOVES", seq)).data)
        except nats.js.errors.NotFoundError:
            continue
        out += [{"u": u, "t": t, "lat": lat, "lon": lon} for u, t, lat, lon in body["m"]]
    return out


async def published(nc: Any, window_id: str) -> tuple[dict[str, Any] | None, list[Any]]:
    js = nc.jetstream()
    kv = await js.key_value("kcloak_windows")
    try:
        entry = await kv.get(window_id)
        ledger = json.loads(entry.value) if entry.value else None
    except nats.js.errors.KeyNotFoundError:
        ledger = None
    msgs = []
    try:
        info = await js.stream_info("KCLOAK_PUBLISHED")
    except nats.js.errors.NotFoundError:
        return ledger, []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            msg = await js.get_msg("KCLOAK_PUBLISHED", seq)
        except nats.js.errors.NotFoundError:
            continue
        if msg.subject == f"kcloak.published.{window_id}":
            msgs.append(msg)
    return ledger, msgs


def test_accepted_fixes_are_published_once_by_racing_workers_and_a_rejected_one_never(
    nats_cluster: NatsCluster,
    tmp_path: Path,
    worker_procs: list[WorkerProcess],  # noqa: F811
) -> None:
    start_workers(nats_cluster, tmp_path, worker_procs)

    async def scenario() -> None:
        nc = await nats.connect(servers=nats_cluster.urls)
        try:
            app = App(nc, P)
            # start at a fresh window, so the whole run falls in one window
            t_start = math.ceil(time.time() / W) * W
            await asyncio.sleep(max(0.0, t_start - time.time()) + 0.2)
            window_id = f"{t_start}-{t_start + W}"
            accepted: set[tuple[str, float]] = set()
            for r in range(4):
                t = round(time.time(), 3)
                for i, user in enumerate(USERS):
                    lat, lon = LAT0 + 0.001 * i + 0.0005 * r, LON0 + 0.001 * i
                    assert await send_fix(app, user, t, lat, lon) is None
                    accepted.add((token(user), t))
                if r == 1:  # older than his latest fix: refused by the router, never in the history
                    late_t = t - 0.5
                    assert await send_fix(app, USERS[0], late_t, LAT0 + 0.5, LON0 + 0.5) == "out_of_order"
                await asyncio.sleep(1.5)
            assert time.time() < t_start + W, "the run must fit in one window"

            moves = await stored_moves(nc)
            stored = {(m["u"], float(m["t"])) for m in moves}
            assert accepted <= stored
            assert (token(USERS[0]), late_t) not in stored
            assert not any(abs(float(m["lat"]) - (LAT0 + 0.5)) < 1e-9 for m in moves)

            # the timers publish once the window closed (t_end + max_update_age_s + grace)
            deadline = time.time() + W + AGE + GRACE + 60
            ledger: dict[str, Any] | None = None
            while time.time() < deadline:
                ledger, msgs = await published(nc, window_id)
                if ledger is not None and ledger["state"] in ("published", "refused"):
                    break
                await asyncio.sleep(0.5)
            assert ledger is not None and ledger["state"] == "published", ledger
            assert time.time() >= t_start + W + AGE, "never before the window closed"
            await asyncio.sleep(2 * (GRACE + 1))  # both timers had their chance at it
            ledger2, msgs = await published(nc, window_id)
            assert ledger2 == ledger
            n = int(ledger["parts"])
            numbers = [int(m.headers["Kcloak-Part"].split("/")[0]) for m in msgs]
            assert numbers == list(range(1, n + 1)), "each part exactly once"
            assert {m.headers["Kcloak-Content-Hash"] for m in msgs} == {ledger["hash"]}
            assert ledger["n_in"] == len(USERS)
            rows: list[list[Any]] = []
            for m in msgs:
                rows += json.loads(m.data)["rows"]
            table = FixTable(
                np.array([r[0] for r in rows]),
                np.array([float(r[1]) for r in rows]),
                np.array([r[2] for r in rows], dtype=np.float64),
                np.array([r[3] for r in rows], dtype=np.float64),
            )
            assert len(np.unique(table.traj_id)) == ledger["n_out"] >= K
            assert not set(table.traj_id.tolist()) & ({token(u) for u in USERS} | set(USERS))
            assert verify_k_delta(table, K, DELTA).failures == ()
            assert float(table.lat.max()) < LAT0 + 0.1, "the rejected far-away fix is in no published row"
        finally:
            await nc.close()

    asyncio.run(scenario())
