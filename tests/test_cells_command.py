"""``kcloak cells``: the cluster's cell file from a population sample (one position per trajectory)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from kcloak.cloaking.cells import CellMap

ROOT = Path(__file__).resolve().parents[1]


def kcloak(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-m", "kcloak", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_cells_from_a_sample_hold_equally_many_trajectories(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    lat = 39.8 + rng.random(90) * 0.3
    lon = 116.2 + rng.random(90) * 0.4
    rows = ["traj_id,t,lat,lon"]
    for i in range(90):  # each trajectory's earlier fix far away: only the latest one counts
        rows.append(f"p{i},1000,10.0,10.0")
        rows.append(f"p{i},2000,{lat[i]:.6f},{lon[i]:.6f}")
    sample = tmp_path / "sample.csv"
    sample.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "cells.json"
    done = kcloak("cells", "--from-sample", str(sample), "--cells", "6", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"cells": 6, "sample_users": 90, "out": str(out)}
    cells = CellMap.from_json(out.read_text(encoding="utf-8"))
    assert cells.cells == 6
    counts = np.bincount(cells.cell_of(np.round(lat, 6), np.round(lon, 6)), minlength=6)
    assert counts.tolist() == [15] * 6


def test_cells_refuses_bad_input_with_exit_2(tmp_path: Path) -> None:
    done = kcloak("cells", "--from-simulator", "10", "--cells", "0", "--out", str(tmp_path / "c.json"))
    assert done.returncode == 2 and "--cells: must be at least 1" in done.stderr and "Traceback" not in done.stderr
    done = kcloak("cells", "--from-sample", str(tmp_path / "missing.csv"), "--cells", "2", "--out", "-")
    assert done.returncode == 2 and "Traceback" not in done.stderr
