"""``kcloak bench cloak --broker-rss only``: a real ``kcloak serve`` loaded through its batch route."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # ~30 s on two shared cores: a broker started, loaded and queried
def test_broker_rss_phase_loads_every_user_and_reports_its_memory() -> None:
    users = 3000
    flags = ["--users", str(users), "--broker-rss", "only", "--broker-settle-s", "0", "--json", "--no-progress"]
    out = subprocess.run(
        [sys.executable, "-m", "kcloak", "bench", "cloak", *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bench"] == "cloak" and report["results"] == []
    b = report["broker_memory"]
    assert b["users"] == users and b["accepted"] == users and b["users_present"] == users
    # Every query answered (a few users at the sparse edge may be refused k_unreachable).
    assert sum(b["answers"].values()) == b["queries"] == 200 and b["answers"].get("ok", 0) > 150
    assert b["target_mb"] == 400.0 and b["met"] == (b["broker_rss_mb"] < 400.0)
    # A broker process with Python, numpy and aiohttp loaded is tens of MB; its peak is at least its RSS.
    assert 20.0 < b["rss_mb_idle"] <= b["broker_peak_mb"] and b["broker_rss_mb"] <= b["broker_peak_mb"]
    assert b["sqlite_mb"]["movement.sqlite3"] >= 0.0


def test_a_negative_settle_time_is_a_usage_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kcloak", "bench", "cloak", "--broker-rss", "only", "--broker-settle-s", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--broker-settle-s" in out.stderr
