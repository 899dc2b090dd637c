"""Proof 6 of issue 15: each window is published exactly once after a coordinator crash, and passes the
independent (k,δ) checker. A real 3-node NATS cluster (fixture ``nats_cluster``), a real ``kcloak cluster
publish`` coordinator subprocess (Dask LocalCluster inside it) SIGKILLed at each stage of the ledger."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcloak.core.readers import FixTable, write_contract_csv
from kcloak.streams.quality import verify_k_delta
from tests.cluster.conftest import NatsCluster
from tests.streams.test_partitioned_windows import window_fixes, with_loners

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats", reason="the cluster extra (nats-py) is not installed")
pytest.importorskip("distributed", reason="the cluster extra (dask[distributed]) is not installed")

from kcloak.broker.cluster.coordinator import CRASH_ENV, HASH_HEADER, PART_HEADER, WindowCoordinator  # noqa: E402
from kcloak.broker.cluster.topology import PUBLISHED_STREAM, WINDOWS_BUCKET, published_subject  # noqa: E402

K, DELTA = 3, 400.0
T0 = 1_000_000  # window_fixes() starts at 1_000_020 and ends before 1_000_900


def window_csv(path: Path, shift: int, loners: int = 0) -> Path:
    fixes = window_fixes(21) if not loners else with_loners(window_fixes(21), loners)
    write_contract_csv(path, FixTable(fixes.traj_id, fixes.t + shift, fixes.lat, fixes.lon))
    return path


def coordinator(
    cluster: NatsCluster,
    window_id: str,
    fixes: Path,
    *,
    crash_at: str | None = None,
    name: str = "coord-a",
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    if crash_at:
        env[CRASH_ENV] = crash_at
    args = [
        sys.executable, "-I", "-m", "kcloak", "cluster", "publish",
        "--nats", ",".join(cluster.urls), "--window", window_id, "--fixes", str(fixes),
        "--method", "nwa", "--k", str(K), "--delta", str(DELTA), "--trash-max", "0.1",
        "--parts", "3", "--part-rows", "60", "--name", name, *extra,
    ]  # fmt: skip
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)


async def stored_releases(urls: list[str], window_id: str) -> list[str]:
    nc = await nats.connect(servers=urls)
    try:
        return await WindowCoordinator(nc, name="reader").stored_names(window_id)
    finally:
        await nc.close()


async def read_window(urls: list[str], window_id: str) -> tuple[dict[str, Any] | None, list[Any]]:
    """The ledger value and every stored message of the window, in stream order."""
    nc = await nats.connect(servers=urls)
    try:
        js = nc.jetstream()
        kv = await js.key_value(WINDOWS_BUCKET)
        try:
            entry = await kv.get(window_id)
            value = json.loads(entry.value) if entry.value else None
        except nats.js.errors.KeyNotFoundError:
            value = None
        msgs = []
        info = await js.stream_info(PUBLISHED_STREAM)
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            try:
                msg = await js.get_msg(PUBLISHED_STREAM, seq)
            except nats.js.errors.NotFoundError:
                continue
            if msg.subject == published_subject(window_id):
                msgs.append(msg)
        return value, msgs
    finally:
        await nc.close()


def check_published_once(urls: list[str], window_id: str, input_ids: set[str]) -> dict[str, Any]:
    ledger, msgs = asyncio.run(read_window(urls, window_id))
    assert ledger is not None and ledger["state"] == "published"
    n = int(ledger["parts"])
    assert n >= 2  # the crash at part-1 is really in the middle of the publication
    numbers = [int(m.headers[PART_HEADER].split("/")[0]) for m in msgs]
    assert numbers == list(range(1, n + 1)), "each part exactly once, in order"
    assert {m.headers[HASH_HEADER] for m in msgs} == {ledger["hash"]}
    rows: list[list[Any]] = []
    for m in msgs:
        body = json.loads(m.data)
        assert body["window_id"] == window_id and body["parts"] == n
        rows += body["rows"]
    table = FixTable(
        np.array([r[0] for r in rows]),
        np.array([float(r[1]) for r in rows]),
        np.array([r[2] for r in rows], dtype=np.float64),
        np.array([r[3] for r in rows], dtype=np.float64),
    )
    assert len(np.unique(table.traj_id)) == ledger["n_out"] > 0
    assert not set(table.traj_id.tolist()) & input_ids
    verdict = verify_k_delta(table, K, DELTA)
    assert verdict.failures == ()
    return ledger


# ledger state each stage leaves behind when the coordinator is SIGKILLed there
AFTER_CRASH = {
    "started": "started",
    "stored": "started",
    "anonymized": "anonymized",
    "part-1": "anonymized",
    "sent": "anonymized",
}


@pytest.mark.parametrize("stage", list(AFTER_CRASH))
def test_window_published_exactly_once_after_a_coordinator_sigkill(
    nats_cluster: NatsCluster, tmp_path: Path, stage: str
) -> None:
    fixes = window_csv(tmp_path / "window.csv", 0)
    window_id = f"{T0}-{T0 + 900}"
    input_ids = set(window_fixes(21).traj_id.tolist())

    crashed = coordinator(nats_cluster, window_id, fixes, crash_at=stage)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    ledger, msgs = asyncio.run(read_window(nats_cluster.urls, window_id))
    assert ledger is not None and ledger["state"] == AFTER_CRASH[stage]
    assert ledger["coordinator"] == "coord-a"
    assert len(msgs) == {"part-1": 1, "sent": ledger.get("parts", 0)}.get(stage, 0)
    stored = asyncio.run(stored_releases(nats_cluster.urls, window_id))
    assert len(stored) == (0 if stage == "started" else 1)

    if stage == "anonymized":  # another coordinator, while the crashed one's lease runs: it must not publish
        busy = coordinator(nats_cluster, window_id, fixes, name="coord-b")
        assert busy.returncode == 1 and "held by another coordinator" in busy.stderr
        assert asyncio.run(read_window(nats_cluster.urls, window_id))[1] == []

    restarted = coordinator(nats_cluster, window_id, fixes)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    outcome = json.loads(restarted.stdout.strip().splitlines()[-1])
    assert outcome["state"] == "published" and outcome["acted"] is True
    first = check_published_once(nats_cluster.urls, window_id, input_ids)
    assert asyncio.run(stored_releases(nats_cluster.urls, window_id)) == []  # earlier attempts' releases too
    if AFTER_CRASH[stage] == "anonymized":
        assert first["hash"] == ledger["hash"], "the stored release is published, never a recomputed one"

    again = coordinator(nats_cluster, window_id, fixes, name="coord-c")
    assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1])["acted"] is False
    assert check_published_once(nats_cluster.urls, window_id, input_ids) == first


def test_window_over_the_trash_bound_is_refused_with_the_reason(nats_cluster: NatsCluster, tmp_path: Path) -> None:
    fixes = window_csv(tmp_path / "window.csv", 0, loners=5)  # 37 trajectories, 5 alone in their class, limit 3
    window_id = f"{T0}-{T0 + 7200}"
    done = coordinator(nats_cluster, window_id, fixes)
    assert done.returncode == 1
    assert json.loads(done.stdout.strip().splitlines()[-1])["reason"] == "trash_exceeded"
    ledger, msgs = asyncio.run(read_window(nats_cluster.urls, window_id))
    assert ledger is not None and ledger["state"] == "refused"
    assert (ledger["reason"], ledger["n_trash"], ledger["trash_limit"]) == ("trash_exceeded", 5, 3)
    assert msgs == []
