"""``kcloak bench soak`` end to end: a real broker, LBS and street users, read as a client reads the JSON.

The default run has one short soak (seconds, not minutes: its verdict is not asserted, only that
the command reports it consistently); the real 20-minute soak is ``slow``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import descendants

SAMPLE_FIELDS = {
    "t_s": float,
    "interval_s": float,
    "rss_bytes": int,
    "children_rss_bytes": int,
    "open_files": int,
    "cpu_s": float,
    "sqlite_bytes": dict,
    "sqlite_total_bytes": int,
    "queue_depths": dict,
    "queries_sent": int,
    "answers": int,
    "refusals": dict,
    "fixes_accepted": int,
    "windows": int,
    "upstream_failures": dict,
    "loadavg_1m": float,
}
CHECKS = ["rss_growth", "p99_drift", "refusals", "exactly_once", "load_held"]


def soak(*flags: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-I", "-m", "kcloak", "bench", "soak", "--json", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out, json.loads(out.stdout)


def test_short_soak_reports_samples_ledger_and_verdict(tmp_path: Path) -> None:
    picture = tmp_path / "soak.png"
    out, report = soak(
        *("--duration", "4", "--sample-every", "2", "--warmup", "0", "--calibrate", "2", "--users", "200"),
        *("--plot", str(picture)),
        timeout=150,
    )
    assert report["bench"] == "soak" and report["users"] == 200
    measured = report["sustained_qps"]
    assert measured["measured"] is True and measured["ok_per_s"] > 0
    assert report["target_qps"] == pytest.approx(measured["ok_per_s"] / 2, rel=0.01)
    rows = report["results"]
    assert [r["t_s"] for r in rows] == [2.0, 4.0]
    for r in rows:
        for name, kind in SAMPLE_FIELDS.items():
            assert isinstance(r[name], kind) or (kind is float and isinstance(r[name], int)), (name, r[name])
        assert r["rss_bytes"] > 20 * 2**20 and r["open_files"] > 5
        assert r["sqlite_total_bytes"] == sum(r["sqlite_bytes"].values())
        assert any(name.endswith("-wal") for name in r["sqlite_bytes"])  # the stores run in WAL mode
        assert "cloak" in r["queue_depths"]
        assert r["p99_ms"] is None or r["p99_ms"] > 0
    assert sum(r["fixes_accepted"] for r in rows) > 0
    # Two accountings that share no code: the ledger's own MQTT connection, and the simulated
    # users' client (which counts each answer once, by its pending queries).
    ledger, sim = report["ledger"], report["simulation"]
    assert ledger["sent"] == sim["queries"] > 0
    assert sum(r["queries_sent"] for r in rows) <= ledger["sent"]
    if ledger["unanswered"] == 0 and ledger["duplicated"] == 0:
        assert sim["answers"]["ok"] + sim["answers"]["refused"] == sim["queries"]
    assert sum(sum(r["refusals"].values()) for r in rows) <= sim["answers"]["refused"]
    verdict = report["verdict"]
    assert [c["name"] for c in verdict["checks"]] == CHECKS
    assert verdict["passed"] == all(c["passed"] for c in verdict["checks"])
    assert out.returncode == (0 if verdict["passed"] else 1)
    for reason in verdict["reasons"]:
        assert reason in out.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ETA" in out.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ("--duration", "0"),
        ("--duration", "10", "--sample-every", "20"),
        ("--duration", "10", "--warmup", "10"),
        ("--rate", "-1"),
        ("--users", "3"),
        ("--algorithm", "nope"),
        ("--window", "0"),
    ],
)
def test_bad_flags_exit_2_with_the_flag_named(flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    from kcloak.cli.main import main

    assert main(["bench", "soak", *flags]) == 2
    out = capsys.readouterr()
    assert out.out == "" and flags[-2] in out.err


@pytest.mark.slow
def test_twenty_minute_soak_passes(tmp_path: Path) -> None:
    out, report = soak("--duration", "1200", "--plot", str(tmp_path / "soak.png"), timeout=1800)
    assert len(report["results"]) == 20
    assert report["verdict"]["passed"], report["verdict"]["reasons"]
    assert out.returncode == 0


SMALL = ("--sample-every", "4", "--warmup", "0", "--rate", "40", "--users", "50")


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_stops_the_children_and_still_reports(sig: signal.Signals) -> None:
    """``kill`` (or Ctrl-C) during the traffic: the broker and the LBS are stopped, not orphaned, and
    the samples taken so far are printed with an "interrupted" verdict and exit status 130."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-m", "kcloak", "bench", "soak", "--json", "--duration", "120", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a background job's SIGINT is ignored unless restored: an interactive Ctrl-C is what is meant
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    seen: list[str] = []
    for line in proc.stderr:
        seen.append(line)
        if "RSS" in line and "answers/s" in line:  # the first sample: the traffic is running
            break
    children = descendants(proc.pid)
    assert len(children) >= 2, "".join(seen)  # kcloak serve and kcloak lbs (and their helpers)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(seen) + err
    assert "Traceback" not in err, err
    report = json.loads(out)
    assert report["interrupted"] is True and report["verdict"]["passed"] is False
    # the traffic ended at the signal, not at the next sample 4 s later
    assert [r["t_s"] for r in report["results"]] == [4.0]
    assert 4.0 <= report["interrupted_at_s"] < 7.0
    assert any("interrupted" in reason for reason in report["verdict"]["reasons"])
    left = {pid for pid in children if Path(f"/proc/{pid}").exists()}
    assert not left, f"still running after the soak ended: {left}"
