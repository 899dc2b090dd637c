"""``kcloak bench cloak`` (contract §9; CONCEPTS §9.9): populations, snapshots, rows, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import kcloak.cloaking.bench as bench
import kcloak.cloaking.cloakers as registry
from kcloak.cli.main import main
from kcloak.cloaking.bench import (
    CONTRACT_FIELDS,
    CloakBenchConfig,
    NullProgress,
    auto_window_s,
    busiest_instant,
    clustered_population,
    k_levels,
    make_workload,
    measure_index,
    run_cloak_bench,
    snapshot_population,
)
from kcloak.cloaking.cloakers.base import BatchResult, CloakMode, CloakResult, cloak_each, finish_region, refuse
from kcloak.cloaking.grid import cell_udeg
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode
from kcloak.core.readers import FixTable

HERE = "tests.cloaking.test_bench"


# -- fake cloakers (the real ones are tested in their own modules) ----------------------------
class BoxCloak:
    """A fixed-size box centred on the querier: not reciprocal (every user has its own box)."""

    name: ClassVar[str] = "box"
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    vectorized: ClassVar[bool] = False
    half_udeg = 3000

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        if len(view) < profile.k:
            return refuse(ReasonCode.K_UNREACHABLE)
        bbox = box_of(view, row)
        n = view.count_in(bbox)
        if n < profile.k:
            return refuse(ReasonCode.AREA_EXCEEDED)
        return finish_region(view, bbox, profile, algorithm=self.name, k_achieved=n)

    def cloak_batch(self, view: IndexView, rows: Any, profiles: ProfileArrays) -> BatchResult:
        return cloak_each(self, view, rows, profiles)


def box_of(view: IndexView, row: int) -> BBox:
    lon = int(view.lon_key[row]) >> 1
    lat = int(view.lat_key[row]) >> 1
    h = BoxCloak.half_udeg
    return BBox(lon - h, lat - h, lon + h + 1, lat + h + 1)


def box_area(view: IndexView, rows: Any, k: int) -> Any:
    """Stands in for ``nn_mbr_area_m2``: the BoxCloak area, so its ratio is exactly 1."""
    return np.array([box_of(view, int(r)).area_m2 for r in rows])


class CellCloak(BoxCloak):
    """The grid cell (level 16, ≈ 0.008°) holding the querier, refused for the whole cell when
    it holds fewer users than its members' largest k: reciprocal.
    """

    name: ClassVar[str] = "cell"
    reciprocal: ClassVar[bool] = True
    level = 16

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        shift = 29 - self.level
        cx, cy = int(view.gx[row]) >> shift, int(view.gy[row]) >> shift
        members = np.flatnonzero(((view.gx >> shift) == cx) & ((view.gy >> shift) == cy))
        if len(members) < max(int(view.k[members].max()), profile.k):
            return refuse(ReasonCode.AREA_EXCEEDED)
        bbox = view.cell_rect_bbox(self.level, cx, cy, cx, cy)
        lon0, lat0, _, _ = cell_udeg(self.level, cx, cy)
        k = len(members) + view.edge_extras(bbox, lon0, lat0)
        return finish_region(view, bbox, profile, algorithm=self.name, k_achieved=k)


class BrokenBatchCloak(BoxCloak):
    """Single calls fine, batch refuses everything: the bench must report the mismatches."""

    def cloak_batch(self, view: IndexView, rows: Any, profiles: ProfileArrays) -> BatchResult:
        out = BatchResult.empty(self.name, view.epoch, len(rows))
        out.status[:] = 2
        return out


class CrashingCloak(BoxCloak):
    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        raise RuntimeError("boom")


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """nn → BoxCloak, interval → CellCloak, casper → broken batch, hilbert → crashes,
    privacygrid → a module that does not exist; no nn reference areas.
    """
    table = dict(registry._REGISTRY)
    table.update(
        nn=f"{HERE}:BoxCloak",
        interval=f"{HERE}:CellCloak",
        casper=f"{HERE}:BrokenBatchCloak",
        hilbert=f"{HERE}:CrashingCloak",
        privacygrid="kcloak.cloaking.cloakers.no_such_module:Nothing",
    )
    monkeypatch.setattr(registry, "_REGISTRY", table)
    monkeypatch.setattr(bench, "load_nn_area", lambda: None)


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2


SMALL = ["bench", "cloak", "--users", "400", "--requests", "300", "--k", "4", "--seed", "7", "--no-progress"]


# -- the CLI ----------------------------------------------------------------------------------
def test_json_shape_and_field_sanity(fakes: None, capsys: pytest.CaptureFixture[str]) -> None:
    code = run([*SMALL, "--algorithms", "nn,interval,privacygrid", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    doc = json.loads(captured.out)  # exactly one JSON object on stdout
    assert captured.out.strip().count("\n") == 0
    assert doc["bench"] == "cloak"
    assert doc["seed"] == 7
    assert doc["population"]["source"] == "synthetic"
    assert doc["profiles"]["k_levels"] == [2, 4, 6]
    rows = {r["algorithm"]: r for r in doc["results"]}
    assert list(rows) == ["nn", "interval", "privacygrid"]
    for name in ("nn", "interval"):
        r = rows[name]
        assert list(r)[: len(CONTRACT_FIELDS)] == list(CONTRACT_FIELDS)
        assert (r["users"], r["k"], r["requests"]) == (400, 4, 300)
        assert 0 < r["success_rate"] <= 1
        assert r["achieved_k_ratio_mean"] >= 1.0  # k_achieved ≥ requested k on every success
        assert r["achieved_k_mean"] >= 2  # users in the region (the smallest requested k is 2)
        assert 0 < r["area_m2_median"] <= r["area_m2_p95"] <= 4e6
        assert 0 < r["cloak_us_p50"] <= r["cloak_us_p99"]
        assert r["cloaks_per_s"] > 0 and r["batch_cloaks_per_s"] > 0
        assert r["updates_per_s"] > 0 and r["batch_updates_per_s"] > 0
        assert 45 <= r["bytes_per_user"] < 5000  # the numpy columns alone take 45 B per user
        assert r["area_ratio_to_nn"] is None  # no reference in this test
        assert r["prepare_ms"] >= 0
        assert r["batch_mismatches"] == 0
        assert r["k_achieved_miscounts"] == 0
        refused = sum(r["refusals"].values())
        assert refused == round((1 - r["success_rate"]) * 300)
    assert rows["nn"]["k_violation_rate"] == 1.0  # a box per querier: nobody shares it
    assert rows["interval"]["k_violation_rate"] == 0.0  # whole cells: reciprocal
    assert rows["interval"]["k_violation_sample"] > 0
    assert "no_such_module" in rows["privacygrid"]["error"]
    assert rows["privacygrid"]["success_rate"] is None
    assert "privacygrid" in captured.err


def test_broken_batch_and_crashing_cloaker_are_reported(fakes: None, capsys: pytest.CaptureFixture[str]) -> None:
    code = run([*SMALL, "--algorithms", "casper,hilbert", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    casper, hilbert = doc["results"]
    assert casper["batch_mismatches"] == round(casper["success_rate"] * 300) > 0
    assert hilbert["error"] == "failed: RuntimeError: boom"


def test_nothing_measured_exits_1(fakes: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*SMALL, "--algorithms", "privacygrid", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert "error" in doc["results"][0]


def test_table_output(fakes: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*SMALL, "--algorithms", "nn,privacygrid"]) == 0
    out = capsys.readouterr().out
    assert "algorithm" in out and "cloaks/s" in out
    assert "synthetic clustered population, 400 users" in out
    assert "privacygrid: not available" in out
    assert not out.lstrip().startswith("{")


@pytest.mark.parametrize(
    "extra",
    [
        ["--algorithms", "nn,teleport"],
        ["--algorithms", ","],
        ["--k", "0"],
        ["--k", "1001"],
        ["--requests", "0"],
        ["--users", "0"],
        ["--max-area-m2", "0"],
        ["--max-area-m2", "nan"],
        ["--max-area-m2", "3e9"],
        ["--seed", "-1"],
        ["--window-s", "300"],  # only with --data
        ["--time-limit-s", "0"],
        ["--users", "many"],
        ["--frobnicate"],
        ["--data", "/nonexistent/trace.csv"],
    ],
)
def test_bad_flags_exit_2(fakes: None, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    if extra[:2] == ["--algorithms", "nn,teleport"]:
        assert "teleport" in captured.err


def test_bench_needs_a_benchmark_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["bench"]) == 2
    assert "BENCH" in capsys.readouterr().err


def test_time_limit_truncates_the_stream(fakes: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "cloak", "--users", "400", "--requests", "2500", "--k", "4", "--seed", "1"]
    assert run([*argv, "--algorithms", "nn", "--time-limit-s", "1e-9", "--json", "--no-progress"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["truncated"] is True
    assert row["requests"] == row["requests_done"] == 1000


def write_trace(path: Path) -> Path:
    """40 taxis around Beijing reporting every 100 s from t = 1000, one bad row."""
    rng = np.random.default_rng(0)
    lines = ["lat,traj_id,lon,t"]
    for i in range(40):
        lat0, lon0 = 39.9 + rng.normal(0, 0.003), 116.4 + rng.normal(0, 0.003)
        for j in range(5):
            lines.append(f"{lat0 + j * 1e-4:.6f},taxi{i},{lon0:.6f},{1000 + 100 * j + i}")
    lines.append("95.0,taxi0,116.4,5000")  # out of range: a bad row
    path.write_text("\n".join(lines) + "\n")
    return path


def test_data_snapshot_from_a_tiny_csv(fakes: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    argv = ["bench", "cloak", "--data", str(trace), "--k", "4", "--requests", "200", "--seed", "2"]
    assert run([*argv, "--algorithms", "nn", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    snap = doc["population"]["snapshot"]
    assert doc["population"]["source"] == "trace.csv"
    assert snap["window_s"] == 120.0  # gaps of 100 s → p90 rounded up to a minute
    assert snap["bad_rows"] == 1
    assert snap["t"] == 1439.0  # the last fix time (1000 + 400 + 39), exact in the JSON
    assert snap["trajectories"] == 40
    assert doc["population"]["users"] == snap["trajectories_in_window"] == 40
    row = doc["results"][0]
    assert row["users"] == 40
    assert row["success_rate"] > 0.9  # 40 taxis within ~300 m, k ≤ 6


def test_data_users_subsample(fakes: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    argv = ["bench", "cloak", "--data", str(trace), "--users", "25", "--window-s", "0", "--requests", "50"]
    assert run([*argv, "--algorithms", "nn", "--json", "--no-progress", "--k", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["population"]["users"] == 25
    assert doc["population"]["snapshot"]["window_rule"].startswith("whole trace")


# -- building blocks --------------------------------------------------------------------------
def fix_table(rows: list[tuple[str, float]]) -> FixTable:
    ids = np.array([r[0] for r in rows], dtype=np.str_)
    t = np.array([r[1] for r in rows], dtype=np.float64)
    return FixTable(ids, t, np.full(len(rows), 39.9) + t * 1e-6, np.full(len(rows), 116.4), 0)


def test_busiest_instant_worked_example() -> None:
    # a: 0, 100; b: 50; c: 400; window 60. Coverage: T=0 → 1, T=50 → 2 (a@0, b@50),
    # T=100 → 2 (a@100, b@50), T=400 → 1. Ties go to the latest instant: 100.
    fixes = fix_table([("a", 0), ("a", 100), ("b", 50), ("c", 400)])
    assert busiest_instant(fixes, 60.0) == (100.0, 2)
    assert busiest_instant(fixes, 1000.0) == (400.0, 3)
    pop = snapshot_population(fixes, window_s=60.0)
    assert pop.now == 100.0
    assert sorted(pop.t.tolist()) == [50.0, 100.0]  # a's latest fix at T is the one at 100
    assert pop.stale_after_s == 60.0


def test_busiest_instant_merges_overlapping_fixes_of_one_trajectory() -> None:
    # a reports every 10 s; one trajectory must count once however many fixes fall in the window.
    fixes = fix_table([("a", float(t)) for t in range(0, 200, 10)] + [("b", 95.0)])
    t, count = busiest_instant(fixes, 60.0)
    assert count == 2
    assert 95.0 <= t <= 150.0


def test_auto_window() -> None:
    fast = fix_table([("a", float(t)) for t in range(0, 300, 10)])
    assert auto_window_s(fast) == 60.0  # never below the contract's 60 s
    slow = fix_table([("a", float(t)) for t in range(0, 3010, 301)] + [("b", 0.0), ("b", 131.0)])
    assert auto_window_s(slow) == 360.0  # T-Drive-like: p90 gap 301 s → 6 minutes


def test_k_levels() -> None:
    assert k_levels(10) == (5, 10, 15)
    assert k_levels(5) == (3, 5, 7)
    assert k_levels(1) == (1, 1, 1)
    assert k_levels(1000) == (500, 1000, 1000)


def test_workload_is_personalized_around_k() -> None:
    w = make_workload(20_000, k=10, requests=500, max_area_m2=1e6, seed=3)
    assert set(np.unique(w.stored_k).tolist()) == {5, 10, 15}
    assert abs(float(w.stored_k.mean()) - 10.0) < 0.2
    assert np.array_equal(w.requested_k, w.stored_k[w.rows])
    profiles = w.profile_list()
    assert [p.k for p in profiles] == w.requested_k.tolist()
    assert {p.max_area_m2 for p in profiles} == {1e6}
    again = make_workload(20_000, k=10, requests=500, max_area_m2=1e6, seed=3)
    assert np.array_equal(again.rows, w.rows)


def test_clustered_population_is_seeded_and_near_the_city() -> None:
    a = clustered_population(5000, seed=1)
    b = clustered_population(5000, seed=1)
    c = clustered_population(5000, seed=2)
    assert len(a) == 5000
    assert np.array_equal(a.lat, b.lat) and np.array_equal(a.lon, b.lon)
    assert not np.array_equal(a.lat, c.lat)
    assert np.all(np.abs(a.lat - 39.9) < 1.5) and np.all(np.abs(a.lon - 116.4) < 1.5)
    assert np.all(a.t >= a.now - a.stale_after_s) and np.all(a.t <= a.now)
    assert a.description["clusters"] == 10


def test_index_costs_are_measured() -> None:
    pop = clustered_population(3000, seed=0)
    work = make_workload(len(pop), k=5, requests=10, max_area_m2=4e6, seed=0)
    costs = measure_index(pop, work, seed=0, progress=NullProgress())
    assert costs.update_moves == 10_000
    assert costs.updates_per_s > 0 and costs.batch_updates_per_s > 0
    assert 45 <= costs.bytes_per_user < 5000


def test_area_ratio_to_nn_uses_the_reference(fakes: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "load_nn_area", lambda: box_area)
    pop = clustered_population(400, seed=5)
    report = run_cloak_bench(pop, CloakBenchConfig(algorithms=("nn",), k=4, requests=200, seed=5))
    row = report.rows[0]
    assert row.area_ratio_to_nn == pytest.approx(1.0)
    assert report.to_json()["area_reference"] == "kcloak.cloaking.cloakers.nn.nn_mbr_area_m2"


# -- the real cloakers, as they land ----------------------------------------------------------
@pytest.mark.parametrize("name", [a for a in registry.SPATIAL_ALGORITHMS if a != "clique"])
def test_real_cloaker_smoke(name: str) -> None:
    try:
        cls = registry.cloaker_class(name)
    except (ImportError, AttributeError):
        pytest.skip(f"{name} is not available yet")
    pop = clustered_population(3000, seed=11)
    report = run_cloak_bench(pop, CloakBenchConfig(algorithms=(name,), k=5, requests=300, seed=11))
    row = report.rows[0]
    assert "error" not in row.extra, row.extra.get("error")
    assert row.success_rate is not None and row.success_rate > 0.5
    assert row.achieved_k_mean is not None and row.achieved_k_mean >= 3  # users in the region (k levels 3/5/7)
    assert row.extra["achieved_k_ratio_mean"] >= 1.0
    assert row.extra["batch_mismatches"] == 0
    assert row.extra["k_achieved_miscounts"] == 0
    if cls.reciprocal:
        assert row.extra["k_violation_rate"] == 0.0


def test_clique_arrivals_never_overlap_a_user() -> None:
    rows, offsets = bench.clique_arrivals(500, 1200, queries_per_user_min=1.0, seed=4)
    assert len(rows) == len(offsets) == 1200
    assert np.all(np.diff(offsets) > 0)
    assert sorted(rows[:500].tolist()) == list(range(500))  # one full cycle = every user once
    assert np.array_equal(rows[500:1000], rows[:500])
    # total rate 500/60 per second: 1200 arrivals span about 144 s
    assert 110 < offsets[-1] < 180


def test_real_clique_stream() -> None:
    try:
        registry.cloaker_class("clique")
    except (ImportError, AttributeError):
        pytest.skip("clique is not available yet")
    pop = clustered_population(2000, seed=12)
    report = run_cloak_bench(pop, CloakBenchConfig(algorithms=("clique",), k=4, requests=1500, seed=12))
    row = report.rows[0]
    assert "error" not in row.extra, row.extra.get("error")
    assert row.success_rate is not None and row.success_rate > 0
    assert row.achieved_k_mean is not None and row.achieved_k_mean >= 2.0  # users (k levels 2/4/6)
    assert row.extra["achieved_k_ratio_mean"] >= 1.0
    assert row.extra["k_violation_rate"] == 0.0  # every member's k ≤ its clique's size
    assert row.extra["batch_mismatches"] == 0  # run_stream releases the same cliques
    assert row.extra["latency_s_p99"] <= 30.0  # max_delay_s of the default profile
    expired = row.extra["refusals"].get("expired", 0)
    assert expired == round((1 - row.success_rate) * 1500)


def test_views_section_compares_incremental_and_fresh_views(capsys: pytest.CaptureFixture[str]) -> None:
    """After each batch of moves, the incremental view and the one built from scratch answer the
    same (mismatches 0), both are timed, and single calls and memory are reported."""
    argv = ["bench", "cloak", "--users", "3000", "--requests", "200", "--seed", "5", "--no-progress"]
    argv += ["--algorithms", "hilbert,interval,casper", "--view-batches", "50,600", "--view-rounds", "2", "--json"]
    code = run(argv)
    assert code == 0
    views = json.loads(capsys.readouterr().out)["views"]
    assert views["users"] == 3000
    assert views["batches"] == [50, 600]
    rows = {r["algorithm"]: r for r in views["results"]}
    assert list(rows) == ["hilbert", "interval", "casper"]
    assert all(r["incremental_state"] is True for r in rows.values())
    # The quadtree counts are patched after 50 moves (100 changed points of 3,000) and sorted
    # from scratch after 600 (above an eighth of the users).
    for name in ("interval", "casper"):
        assert [b["carried_views"] for b in rows[name]["batches"]] == [2, 0]
    assert [b["carried_views"] for b in rows["hilbert"]["batches"]] == [None, None]
    for r in rows.values():
        assert r["mismatches"] == 0
        assert [b["moved"] for b in r["batches"]] == [50, 600]
        for b in r["batches"]:
            for key in ("incremental_ms", "scratch_ms", "incremental_snapshot_ms"):
                s = b[key]
                assert 0 < s["min"] <= s["median"] <= s["max"]
            assert b["speedup"] > 0
        assert 0 < r["single_us_p50"] <= r["single_us_p99"]
    assert views["peak_rss_mb"] > 10


def test_views_section_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*SMALL, "--algorithms", "hilbert", "--view-batches", "none", "--json"]) == 0
    assert "views" not in json.loads(capsys.readouterr().out)
    for bad in (["--view-batches", "0"], ["--view-batches", "ten"], ["--view-rounds", "0"]):
        assert run([*SMALL, *bad]) == 2
        assert "--view" in capsys.readouterr().err
