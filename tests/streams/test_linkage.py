"""The km linkage attack of ``kcloak audit trajectories`` (CONCEPTS §7.6, §9.6; contract §9).

Statistical assertions compare a re-identification rate with 1/k using the tolerance of
:func:`kcloak.cloaking.attacks.base.tolerance` (upper end of the 99.9 % Wilson interval of a rate equal to
1/k over the number of victims, minus 1/k) or the Wilson interval of the measured rate itself.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cli.main import main
from kcloak.cloaking.checks import wilson_interval
from kcloak.core.readers import FixTable, read_fixes, write_contract_csv
from kcloak.streams.attacks import KnownPointsLinkage, LinkageError, _Stacked, audit_trajectories
from kcloak.streams.publish import Release, anonymize
from kcloak.streams.trajectory import Trajectory, trajectories_from_fixes

K = 5
DELTA = 200.0


def commuters(groups: int = 24, size: int = 6, points: int = 24, seed: int = 1) -> FixTable:
    """Groups of trajectories heading the same way from spread-out starts (offsets σ ≈ 330 m), 60 s sampling."""
    rng = np.random.default_rng(seed)
    ids: list[str] = []
    ts, lats, lons = [], [], []
    steps = np.arange(points)
    for g in range(groups):
        lat0, lon0 = 39.9 + rng.uniform(-0.1, 0.1), 116.4 + rng.uniform(-0.12, 0.12)
        vlat, vlon = rng.normal(0, 0.0004, 2)
        for j in range(size):
            off = rng.normal(0, 0.003, 2)
            ts.append(1_700_000_000 + steps * 60.0)
            lats.append(lat0 + off[0] + vlat * steps + np.cumsum(rng.normal(0, 0.0002, points)))
            lons.append(lon0 + off[1] + vlon * steps + np.cumsum(rng.normal(0, 0.0002, points)))
            ids += [f"g{g}m{j}"] * points
    return FixTable(np.array(ids), np.concatenate(ts), np.concatenate(lats), np.concatenate(lons))


@pytest.fixture(scope="module")
def data() -> FixTable:
    return commuters()


@pytest.fixture(scope="module")
def release(data: FixTable) -> Release:
    rel = anonymize(data, method="nwa", k=K, delta_m=DELTA, seed=1)
    assert rel.ok
    return rel


def test_two_known_points_reidentify_raw_trajectories_most_of_the_time(data: FixTable) -> None:
    originals = trajectories_from_fixes(data)
    r = KnownPointsLinkage(m=2, resolution_m=DELTA, seed=3).assess_risk(
        originals, originals, {t.traj_id: t.traj_id for t in originals}, target="raw"
    )
    assert r.trials == len(originals) == 144
    lo, _ = wilson_interval(float(r.risk.sum()), r.trials)
    assert lo > 0.5  # most of the time, with 99.9 % confidence
    assert r.reidentification_rate > 1 / K


@pytest.mark.parametrize("method", ["nwa", "microagg"])
def test_published_k_delta_data_hold_near_one_over_k(data: FixTable, method: str) -> None:
    rel = anonymize(data, method=method, k=K, delta_m=DELTA, seed=2)
    assert rel.ok
    audit = audit_trajectories(data, rel.table, k=K, delta_m=DELTA, ms=(1, 3), mapping=rel.mapping, seed=4)
    assert audit.kdelta_ok
    rows = {(r.target, r.m): r for r in audit.rows}
    for m in (1, 3):
        pub = rows[("published", m)]
        assert pub.trials > 100
        assert pub.reidentification_rate is not None and pub.tolerance is not None
        assert pub.reidentification_rate <= 1 / K + pub.tolerance
        assert pub.candidates_median is not None and pub.candidates_median >= K
        raw = rows[("raw", m)]
        assert raw.reidentification_rate is not None and raw.reidentification_rate > 2 / K


def test_every_published_victim_has_at_least_k_consistent_candidates(release: Release) -> None:
    """The consistency rule (D ≤ D* + δ) keeps a whole (k,δ) set: no victim is ever narrowed below k."""
    originals = trajectories_from_fixes(commuters())
    pub = trajectories_from_fixes(release.table)
    r = KnownPointsLinkage(m=3, resolution_m=DELTA, seed=5).assess_risk(originals, pub, release.mapping, target="p")
    assert r.trials == len(pub)
    assert int(r.candidates.min()) >= K
    assert float(r.risk.max()) <= 1 / K


def test_a_victim_with_no_published_trajectory_is_suppressed_not_attacked() -> None:
    a = Trajectory.of("a", [0, 10], [39.9, 39.91], [116.4, 116.41])
    b = Trajectory.of("b", [0, 10], [40.0, 40.01], [116.5, 116.51])
    r = KnownPointsLinkage(m=1, resolution_m=0.0).assess_risk([a, b], [a], {"a": "a"}, target="raw")
    assert (r.trials, r.suppressed, r.reidentification_rate) == (1, 1, 1.0)


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(LinkageError):
        KnownPointsLinkage(m=0, resolution_m=1.0)
    with pytest.raises(LinkageError):
        KnownPointsLinkage(m=1, resolution_m=-1.0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.floats(-5.0, 5.0), min_size=2, max_size=6), min_size=1, max_size=5),
    st.floats(-20.0, 120.0),
)
def test_stacked_interpolation_equals_trajectory_at(offsets: list[list[float]], when: float) -> None:
    trajs = [
        Trajectory.of(f"t{i}", np.arange(len(o)) * 20.0 + i, 39.9 + np.array(o) * 1e-3, 116.4 - np.array(o) * 1e-3)
        for i, o in enumerate(offsets)
    ]
    lat, lon = _Stacked.of(trajs).at(when)
    for i, tr in enumerate(trajs):
        elat, elon = tr.at([when])
        assert lat[i] == pytest.approx(float(elat[0]), abs=1e-12)
        assert lon[i] == pytest.approx(float(elon[0]), abs=1e-12)


# -- the CLI ----------------------------------------------------------------------------------
def _write(tmp: Path, data: FixTable, release: Release) -> tuple[Path, Path, Path]:
    orig, pub, mp = tmp / "orig.csv", tmp / "pub.csv", tmp / "map.csv"
    write_contract_csv(orig, data)
    write_contract_csv(pub, release.table)
    with open(mp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["published_id", "traj_id"])
        w.writerows(sorted(release.mapping.items()))
    return orig, pub, mp


def test_cli_json_shape_report_and_exit_codes(
    tmp_path: Path, data: FixTable, release: Release, capsys: pytest.CaptureFixture[str]
) -> None:
    orig, pub, mp = _write(tmp_path, data, release)
    args = ["audit", "trajectories", str(pub), "--original", str(orig), "--k", "5", "--delta", "200"]
    code = main([*args, "--m", "2", "--mapping", str(mp), "--seed", "1", "--json", "--report", str(tmp_path / "r")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"kdelta", "results"}
    assert set(out["kdelta"]) == {"ok", "violations", "trajectories"}
    assert out["kdelta"] == {"ok": True, "violations": 0, "trajectories": 144}
    assert [r["target"] for r in out["results"]] == ["raw", "published"]
    for r in out["results"]:
        assert set(r) == {"target", "m", "reidentification_rate", "trials", "baseline"}
        assert r["baseline"] == pytest.approx(0.2) and r["m"] == 2
    assert {p.name for p in (tmp_path / "r").iterdir()} == {"audit_trajectories.json", "linkage.png", "frontier.png"}

    # without the mapping only (k,δ) and the raw data are reported
    assert main([*args, "--m", "1", "--seed", "1", "--json"]) == 0
    assert [r["target"] for r in json.loads(capsys.readouterr().out)["results"]] == ["raw"]

    # a published file that is not (k,δ)-anonymous: exit 1, report still written
    bad = read_fixes(pub)
    lat = bad.lat.copy()
    lat[bad.traj_id == bad.traj_id[0]] += 0.05
    write_contract_csv(tmp_path / "bad.csv", FixTable(bad.traj_id, bad.t, lat, bad.lon))
    bad_args = ["audit", "trajectories", str(tmp_path / "bad.csv"), "--original", str(orig), "--k", "5"]
    code = main([*bad_args, "--delta", "200", "--m", "1", "--json", "--report", str(tmp_path / "b")])
    assert code == 1
    assert json.loads(capsys.readouterr().out)["kdelta"]["ok"] is False
    assert (tmp_path / "b" / "audit_trajectories.json").exists()

    # bad input: exit 2
    assert main([*args, "--m", "0"]) == 2
    assert main([*args, "--methods", "nope"]) == 2
    assert (
        main(
            [
                "audit",
                "trajectories",
                str(tmp_path / "missing.csv"),
                "--original",
                str(orig),
                "--k",
                "5",
                "--delta",
                "1",
            ]
        )
        == 2
    )


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([2, 3, 5]), st.sampled_from([100.0, 300.0]))
def test_no_victim_of_a_k_delta_release_is_ever_narrowed_below_k(seed: int, k: int, delta: float) -> None:
    """Whatever the data, k and δ: every published victim keeps ≥ k consistent candidates (risk ≤ 1/k)."""
    data = commuters(groups=8, size=5, points=10, seed=seed)
    rel = anonymize(data, method="nwa", k=k, delta_m=delta, trash_max=0.5, seed=seed)
    if not rel.ok:
        return
    originals = trajectories_from_fixes(data)
    pub = trajectories_from_fixes(rel.table)
    for m in (1, 2):
        r = KnownPointsLinkage(m=m, resolution_m=delta, seed=seed).assess_risk(originals, pub, rel.mapping, target="p")
        assert r.trials == len(pub)
        assert int(r.candidates.min()) >= k
        assert float(r.risk.max()) <= 1 / k


TDRIVE = (
    Path(__file__).resolve().parents[2]
    / ".."
    / "shared"
    / "data"
    / "research"
    / "tdrive_beijing_20080202_1600-1630.csv.gz"
)


@pytest.mark.slow
def test_real_tdrive_raw_is_linkable_and_nwa_release_holds() -> None:
    if not TDRIVE.exists():
        pytest.skip(f"research data absent: {TDRIVE}")
    fixes = read_fixes(TDRIVE)
    rel = anonymize(fixes, method="nwa", k=K, delta_m=1000.0, trash_max=0.5, seed=1)
    assert rel.ok
    audit = audit_trajectories(fixes, rel.table, k=K, delta_m=1000.0, ms=(3,), mapping=rel.mapping, seed=1, victims=400)
    assert audit.kdelta_ok
    rows = {r.target: r for r in audit.rows}
    raw, pub = rows["raw"], rows["published"]
    assert raw.reidentification_rate is not None and pub.reidentification_rate is not None and pub.tolerance is not None
    lo, _ = wilson_interval(raw.reidentification_rate * raw.trials, raw.trials)
    assert lo > 1 / K  # three known points link raw taxi trajectories well above 1/k
    assert pub.reidentification_rate <= 1 / K + pub.tolerance
