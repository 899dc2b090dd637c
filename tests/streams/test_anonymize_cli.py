"""``kcloak anonymize``: exit codes, output only on success, and a release the verifier accepts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kcloak.cli.main import main
from kcloak.core.readers import read_fixes
from kcloak.streams.quality import verify_k_delta


def _write_trajectories(path: Path, n: int, seed: int = 3) -> None:
    rng = np.random.default_rng(seed)
    lines = ["traj_id,t,lat,lon"]
    hubs = [(39.90, 116.40), (39.95, 116.30), (39.85, 116.45)]
    for i in range(n):
        la, lo = hubs[i % 3]
        la += rng.normal(0, 0.002)
        lo += rng.normal(0, 0.002)
        for j in range(20):
            lines.append(f"v{i},{1_700_000_000 + 60 * j},{la + 0.0005 * j:.6f},{lo + 0.0004 * j:.6f}")
    path.write_text("\n".join(lines) + "\n")


def test_publishes_a_verified_release(tmp_path: Path) -> None:
    src, out, rep, mp = tmp_path / "in.csv", tmp_path / "out.csv", tmp_path / "rep.json", tmp_path / "map.csv"
    _write_trajectories(src, 30)
    code = main(
        [
            "anonymize",
            str(src),
            "-o",
            str(out),
            "--k",
            "3",
            "--delta",
            "1000",
            "--report",
            str(rep),
            "--mapping",
            str(mp),
            "--seed",
            "7",
        ]
    )
    assert code == 0
    published = read_fixes(out)
    verdict = verify_k_delta(published, 3, 1000.0)
    assert verdict.ok, verdict.failures[:3]
    report = json.loads(rep.read_text())
    assert report["k"] == 3 and report["method"] == "nwa" and report["n_in"] == 30
    assert report["n_out"] + report["n_trash"] == 30 and report["trash_fraction"] <= 0.1
    ids = set(published.traj_id.tolist())
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids) and not ids & {f"v{i}" for i in range(30)}
    assert mp.read_text().splitlines()[0] == "published_id,traj_id"


def test_refusals_write_nothing(tmp_path: Path) -> None:
    src, out = tmp_path / "in.csv", tmp_path / "out.csv"
    _write_trajectories(src, 2)
    assert main(["anonymize", str(src), "-o", str(out), "--k", "5", "--delta", "500"]) == 1
    assert not out.exists()
    assert main(["anonymize", str(src), "-o", str(out), "--k", "5", "--delta", "500", "--method", "magic"]) == 2
    assert main(["anonymize", str(src), "-o", str(out), "--k", "1", "--delta", "500"]) == 2
    assert main(["anonymize", str(tmp_path / "missing.csv"), "-o", str(out), "--k", "5", "--delta", "5"]) == 2
    assert not out.exists()
