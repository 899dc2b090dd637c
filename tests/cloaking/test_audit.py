"""Attacks of ``kcloak audit cloaking`` (CONCEPTS §6, §6.8; contract §9).

Statistical assertions use the audit's own tolerance (upper end of the 99.9 % Wilson interval of
a rate equal to 1/k over the number of trials, minus 1/k) for "the defence holds", and the
99.9 % Wilson interval of the measured rate for "the attack works" (its lower end clearly above
1/k). Worlds are seeded, so outcomes are reproducible.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from kcloak.cli.main import main
from kcloak.cloaking.attacks import (
    BoundaryGuess,
    CentreGuess,
    CloakedWorld,
    Forwarded,
    Homogeneity,
    ObservationIdentification,
    QueryTrackingNaive,
    QueryTrackingSession,
    RestrictedSpaceIdentification,
    Target,
    World,
    tolerance,
)
from kcloak.cloaking.audit import cloak_world, snapshot_targets, stay_points, synthetic_world, tracking_targets
from kcloak.cloaking.checks import candidate_sets, wilson_interval
from kcloak.cloaking.cloakers import get_cloaker
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile

K = 5
PROFILE = PrivacyProfile(k=K)
QUERIES = 400
TDRIVE = (
    Path(__file__).resolve().parents[2]
    / ".."
    / "shared"
    / "data"
    / "research"
    / "tdrive_beijing_20080202_1600-1630.csv.gz"
)


@pytest.fixture(scope="module")
def world() -> World:
    return synthetic_world(1500, frames=8, seed=7)


@pytest.fixture(scope="module")
def cloaked(world: World) -> dict[str, CloakedWorld]:
    return {a: cloak_world(world, a, PROFILE, seed=7) for a in ("nn", "hilbert")}


def test_tolerance_is_the_wilson_excess_over_one_over_k() -> None:
    assert tolerance(0.2, 400) == pytest.approx(wilson_interval(80, 400)[1] - 0.2)
    assert tolerance(0.2, 1600) < tolerance(0.2, 400) < tolerance(0.2, 100)
    assert tolerance(0.2, 0) == 1.0


def test_policy_aware_candidate_sets_agree_with_the_reciprocity_evaluator(cloaked: dict[str, CloakedWorld]) -> None:
    """C(R) from grouping identical forwarded boxes equals ``kcloak.cloaking.checks.candidate_sets``
    (one cloak per user)."""
    for name, cw in cloaked.items():
        view = cw.world.frames[0]
        fwd = cw.forwarded[0]
        cs = candidate_sets(get_cloaker(name), view, profiles=[PROFILE] * len(view))
        ours = np.array([len(fwd.candidates(r)) for r in cs.rows.tolist()])
        assert np.array_equal(ours, cs.size), name
        assert int(np.count_nonzero(fwd.ok)) == cs.trials


def test_centre_and_boundary_break_nn(world: World, cloaked: dict[str, CloakedWorld]) -> None:
    targets = snapshot_targets(world, QUERIES, seed=1)
    for attack in (CentreGuess(), BoundaryGuess()):
        r = attack.assess_risk(cloaked["nn"], targets)
        assert r.trials > 300
        lo, _ = r.interval()
        assert lo > 2 / K, attack.name
        assert not r.holds()


def test_reciprocal_hilbert_holds_under_centre_and_boundary(world: World, cloaked: dict[str, CloakedWorld]) -> None:
    targets = snapshot_targets(world, QUERIES, seed=1)
    for attack in (CentreGuess(), BoundaryGuess(), CentreGuess(policy_aware=False)):
        r = attack.assess_risk(cloaked["hilbert"], targets)
        assert r.trials > 300
        assert r.baseline == pytest.approx(1 / K)
        assert r.success_rate <= r.baseline + r.tolerance, attack.name


def test_query_tracking_breaks_the_naive_continuous_query_and_sessions_hold(
    world: World, cloaked: dict[str, CloakedWorld]
) -> None:
    targets = tracking_targets(world, 300, seed=2)
    for name, cw in cloaked.items():
        naive = QueryTrackingNaive().assess_risk(cw, targets)
        lo, _ = naive.interval()
        assert lo > 2 / K, name
        assert naive.extra["below_k_fraction"] is not None and float(naive.extra["below_k_fraction"]) > 0.5
        session = QueryTrackingSession().assess_risk(cw, targets)
        assert session.trials > 250
        assert session.success_rate <= session.baseline + session.tolerance, name
        assert session.extra["final_candidates_min"] is not None and int(session.extra["final_candidates_min"]) >= K
        assert float(session.risk.max()) <= 1 / K  # memorization: every intersection keeps ≥ k users


def test_observation_with_everyone_observed_guesses_uniformly_inside(
    cloaked: dict[str, CloakedWorld], world: World
) -> None:
    cw = cloaked["hilbert"]
    targets = snapshot_targets(world, 60, seed=3)
    r = ObservationIdentification(observed_fraction=1.0).assess_risk(cw, targets)
    for tg, risk in zip(r.targets, r.risk.tolist(), strict=True):
        row = int(world.row_of_user[tg.frame][tg.user])
        inside = cw.world.frames[tg.frame].rows_in(cw.forwarded[tg.frame].box(row))
        assert risk == pytest.approx(1 / len(inside))
    none = ObservationIdentification(observed_fraction=0.0).assess_risk(cw, targets)
    assert none.success_rate == 0.0 and none.extra["no_observed_user_fraction"] == 1.0


# -- constructed worlds -----------------------------------------------------------------------
def _tiny(lat: list[float], lon: list[float], homes: list[tuple[float, float]], places: PlacesLayer | None) -> World:
    ids = [f"u{i}" for i in range(len(lat))]
    view = IndexView.from_points(ids, lat, lon, k=[K] * len(lat))
    return World(tuple(ids), (view,), (np.arange(len(lat), dtype=np.int64),), np.array(homes, float), places)


def _all_in(world: World, box: BBox) -> CloakedWorld:
    n = len(world.frames[0])
    b = np.tile(np.array([box.min_lon_udeg, box.min_lat_udeg, box.max_lon_udeg, box.max_lat_udeg]), (n, 1))
    return CloakedWorld(world, "fixed", PROFILE, (Forwarded(b, np.ones(n, bool)),))


def test_restricted_space_names_the_owner_of_the_only_home_in_the_region() -> None:
    lat = [39.9000 + 0.0001 * i for i in range(5)]
    lon = [116.4000] * 5
    homes = [(39.90005, 116.40005), (40.5, 117.0), (40.5, 117.1), (np.nan, np.nan), (40.6, 117.0)]
    box = BBox(116_399_000, 39_899_000, 116_401_000, 39_901_000)
    world = _tiny(lat, lon, homes, None)
    r = RestrictedSpaceIdentification().assess_risk(_all_in(world, box), [Target(0, u) for u in range(5)])
    assert r.risk.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert r.extra["single_home_fraction"] == 1.0
    # a second home inside hides the owner
    homes[1] = (39.90010, 116.40010)
    r2 = RestrictedSpaceIdentification().assess_risk(_all_in(_tiny(lat, lon, homes, None), box), [Target(0, 0)])
    assert r2.success_rate == 0.0


def test_homogeneity_fires_only_when_every_user_inside_shares_one_category() -> None:
    places = PlacesLayer(
        lat=np.array([39.9000, 39.9100]),
        lon=np.array([116.4000, 116.4100]),
        category_code=np.array([0, 1]),
        category_names=("hospital", "cafe"),
    )
    box = BBox(116_399_000, 39_899_000, 116_412_000, 39_912_000)
    same = _tiny([39.9000 + 1e-5 * i for i in range(5)], [116.4] * 5, [(np.nan, np.nan)] * 5, places)
    r = Homogeneity().assess_risk(_all_in(same, box), [Target(0, 0)])
    assert r.success_rate == 1.0 and r.extra["max_category_share_mean"] == 1.0
    mixed = _tiny(
        [39.9000 + 1e-5 * i for i in range(4)] + [39.91], [116.4] * 4 + [116.41], [(np.nan, np.nan)] * 5, places
    )
    r2 = Homogeneity().assess_risk(_all_in(mixed, box), [Target(0, 0)])
    assert r2.success_rate == 0.0 and r2.extra["max_category_share_mean"] == pytest.approx(0.8)


def test_stay_points_find_a_long_stop() -> None:
    t = np.arange(0, 4000, 100.0)
    lat = np.where(t < 2500, 39.9, 39.95) + 1e-6 * np.arange(len(t))
    lon = np.full(len(t), 116.4)
    stays = stay_points(t, lat, lon, radius_m=200, min_s=1200)
    assert len(stays) == 2
    assert stays[0][0] == 0.0 and stays[0][1] == 2400.0 and stays[0][2] == pytest.approx(39.9, abs=1e-4)


# -- invariants (Hypothesis) ------------------------------------------------------------------
@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([2, 3, 5]))
def test_reciprocal_algorithms_never_beat_one_over_k_when_everyone_asks(seed: int, k: int) -> None:
    """With every user as a querier, a policy-aware guess hits at most one member per shared region."""
    world = synthetic_world(120, frames=2, seed=seed)
    profile = PrivacyProfile(k=k, max_area_m2=2.5e9)
    for name in ("hilbert", "clique"):
        cw = cloak_world(world, name, profile, seed=seed)
        targets = [Target(0, int(u)) for u in world.present[0][cw.forwarded[0].ok].tolist()]
        for attack in (CentreGuess(), BoundaryGuess()):
            r = attack.assess_risk(cw, targets)
            assert r.success_rate <= 1 / k + 1e-12, (name, attack.name)
        s = QueryTrackingSession().assess_risk(cw, targets)
        assert float(s.risk.max(initial=0.0)) <= 1 / k


# -- the CLI ----------------------------------------------------------------------------------
def test_cli_json_shape_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["audit", "cloaking", "--users", "200", "--snapshots", "2", "--queries", "40", "--k", "5"]
    code = main([*args, "--algorithms", "nn,hilbert", "--seed", "1", "--json", "--report", str(tmp_path)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"results"}
    rows = out["results"]
    assert {(r["algorithm"], r["attack"]) for r in rows} == {
        (a, b)
        for a in ("nn", "hilbert")
        for b in (
            "centre",
            "boundary",
            "observation",
            "restricted_space",
            "query_tracking_naive",
            "query_tracking_session",
            "homogeneity",
        )
    }
    for r in rows:
        assert set(r) == {"algorithm", "k", "attack", "success_rate", "baseline", "trials", "tolerance"}
        assert r["k"] == 5 and r["baseline"] == pytest.approx(0.2)
        assert r["trials"] > 0 and 0 <= r["success_rate"] <= 1 and r["tolerance"] > 0
    assert {p.name for p in tmp_path.iterdir()} == {"audit_cloaking.json", "attack_success.png", "frontier.png"}
    detailed = json.loads((tmp_path / "audit_cloaking.json").read_text())
    assert detailed["world"]["source"] == "synthetic" and len(detailed["results"]) == 14


@pytest.mark.parametrize(
    "bad",
    [["--algorithms", "nope"], ["--k", "0"], ["--k", "x"], ["--snapshots", "0"], ["--observed-fraction", "2"]],
)
def test_cli_bad_input_exits_2(bad: list[str]) -> None:
    assert main(["audit", "cloaking", "--users", "50", "--queries", "5", *bad]) == 2


def test_cli_unreadable_data_exits_2(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("nothing,useful\n1,2\n")
    assert main(["audit", "cloaking", "--data", str(tmp_path / "x.csv"), "--queries", "5"]) == 2


@pytest.mark.slow
def test_real_tdrive_snapshots_nn_breaks_hilbert_holds(capsys: pytest.CaptureFixture[str]) -> None:
    if not TDRIVE.exists():
        pytest.skip(f"research data absent: {TDRIVE}")
    args = ["audit", "cloaking", "--data", str(TDRIVE), "--algorithms", "nn,hilbert", "--k", "5", "--snapshots", "6"]
    assert main([*args, "--queries", "600", "--seed", "1", "--json"]) == 0
    rows = {(r["algorithm"], r["attack"]): r for r in json.loads(capsys.readouterr().out)["results"]}
    nn, hb = rows[("nn", "centre")], rows[("hilbert", "centre")]
    assert nn["success_rate"] > nn["baseline"] + nn["tolerance"]
    assert hb["success_rate"] <= hb["baseline"] + hb["tolerance"]
    s = rows[("hilbert", "query_tracking_session")]
    assert s["success_rate"] <= s["baseline"] + s["tolerance"]


def test_cli_off_a_terminal_prints_progress_and_verdicts_that_match_the_numbers(tmp_path: Path) -> None:
    """Run as a user would with stderr piped (no terminal): progress lines on stderr as each phase starts and
    ends; each printed verdict is the one the printed numbers give; the pictures carry a title."""
    cmd = [sys.executable, "-I", "-m", "kcloak", "audit", "cloaking", "--users", "300", "--snapshots", "2"]
    cmd += ["--queries", "60", "--k", "10", "--algorithms", "nn,hilbert", "--seed", "3", "--report", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    assert err[0] == "kcloak audit cloaking: building 2 snapshots (seed 3)", proc.stderr
    for i, algorithm in enumerate(("nn", "hilbert"), start=1):
        assert f"{algorithm} k=10 ({i}/2): started (9 steps)" in err, proc.stderr
        assert any(line.startswith(f"{algorithm} k=10 ({i}/2): done in ") for line in err), proc.stderr
    seen = 0
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 8 or cells[0] not in ("nn", "hilbert"):
            continue
        rate, baseline, tolerance = float(cells[3]), float(cells[4]), float(cells[5])
        verdict = cells[7]
        if rate <= baseline:
            assert verdict == "≤ 1/k", line
        elif rate <= baseline + tolerance:
            assert verdict == "> 1/k, within tolerance", line
        else:
            assert verdict == "> 1/k + tolerance", line
        seen += 1
    assert seen == 2 * 7, proc.stdout
    for name in ("attack_success.png", "frontier.png"):
        with Image.open(tmp_path / name) as img:
            grey = np.asarray(img.convert("L"))
        band = grey[: grey.shape[0] // 16]  # the title band above the panels
        assert (band < 128).sum() > 500, f"{name}: no title"


def test_verdict_of_a_rate_between_1_over_k_and_the_tolerance() -> None:
    """0.128 against 1/k = 0.100 is not "≤ 1/k": it is above 1/k, within the sampling tolerance."""
    from kcloak.cli.audit import cloaking_verdict

    assert cloaking_verdict(0.128, 0.100, 0.102) == "> 1/k, within tolerance"
    assert cloaking_verdict(0.100, 0.100, 0.102) == "≤ 1/k"
    assert "> 1/k + tolerance" in cloaking_verdict(0.203, 0.100, 0.102)
    assert cloaking_verdict(None, 0.1, None) == "—"
