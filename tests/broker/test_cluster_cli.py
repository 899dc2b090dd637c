"""``kcloak cluster status`` / ``publish`` refuse what they cannot use with one line and the right exit code,
before touching the ledger (no NATS needed: the refusals come first or NATS is unreachable)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kcloak.wire.net import free_port

pytest.importorskip("nats", reason="the cluster extra (nats-py) is not installed")
pytest.importorskip("distributed", reason="the cluster extra (dask[distributed]) is not installed")


def kcloak(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", "-m", "kcloak", *args], capture_output=True, text=True, timeout=60)


def test_status_of_an_unreachable_cluster_is_one_line_and_exit_1() -> None:
    done = kcloak("cluster", "status", "--nats", f"nats://127.0.0.1:{free_port()}")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "kcloak: error: cannot reach NATS at any of 1 server(s) (NoServersError)"
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--window", "900-100"), "--window: expected T_START-T_END"),
        (("--k", "1"), "k: must be an integer ≥ 2"),
        (("--trash-max", "1.5"), "trash_max: must be within [0, 1]"),
        (("--fixes", "/nonexistent/window.csv"), "window.csv: cannot open"),
    ],
)
def test_publish_refuses_bad_input_before_connecting(tmp_path: Path, extra: tuple[str, ...], message: str) -> None:
    fixes = tmp_path / "w.csv"
    fixes.write_text("traj_id,t,lat,lon\nsecret-user,150,39.9,116.4\n", encoding="utf-8")
    args = {"--window": "100-900", "--fixes": str(fixes), "--k": "3", "--trash-max": "0.1"}
    args.update(dict(zip(extra[::2], extra[1::2], strict=True)))
    flat = [x for kv in args.items() for x in kv]
    done = kcloak("cluster", "publish", "--nats", f"nats://127.0.0.1:{free_port()}", *flat)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "cannot reach NATS" not in done.stderr  # refused before any connection
    assert "secret-user" not in done.stderr
