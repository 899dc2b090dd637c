"""Wait For Me (CONCEPTS §7.4): edit distance vs its recursion, clustering vs brute force, invariants, real data.

Every release is judged by the independent verifier of §9.6 (:mod:`kcloak.streams.quality`, which imports no
algorithm code); shifts are re-derived from the inputs, not from the algorithm's bookkeeping.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cli.main import main
from kcloak.core.geometry import Aeqd, haversine_m_array
from kcloak.core.readers import read_fixes
from kcloak.streams.kdelta import KDeltaError, trash_limit
from kcloak.streams.kdelta.w4m import Distance, W4MResult, _align, _Greedy, _pack, _Space, edit_distance, w4m
from kcloak.streams.publish import anonymization_report, anonymize, publish_rows
from kcloak.streams.quality import verify_k_delta
from kcloak.streams.trajectory import Trajectory, fixes_of, split_too_short, trajectories_from_fixes

DATA = Path(__file__).resolve().parents[1] / "data"
GEOLIFE = Path(__file__).resolve().parents[3] / "shared" / "data" / "research" / "geolife_sample"
FRAME = Aeqd(39.9, 116.4)


def brute_edit(a: np.ndarray, b: np.ndarray, eps: float, tau: float, lst: bool) -> float:
    """The EDR recursion of CONCEPTS §7.4 (LST: a match costs its normalized gap)."""

    @functools.cache
    def f(i: int, j: int) -> float:
        if i == len(a):
            return float(len(b) - j)
        if j == len(b):
            return float(len(a) - i)
        gap = max(abs(a[i][0] - b[j][0]) / eps, abs(a[i][1] - b[j][1]) / eps, abs(a[i][2] - b[j][2]) / tau)
        cost = (gap if lst else 0.0) if gap <= 1 else 1.0
        return min(f(i + 1, j + 1) + cost, f(i + 1, j) + 1.0, f(i, j + 1) + 1.0)

    return f(0, 0)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_edit_distance_equals_the_recursion(seed: int, lst: bool) -> None:
    rng = np.random.default_rng(seed)
    la, lb = rng.integers(0, 9, 2)
    a = rng.integers(0, 4, (la, 3)).astype(float)
    b = rng.integers(0, 4, (lb, 3)).astype(float)
    got = edit_distance(a, b, eps_m=1.0, tau_s=1.5, distance="lst" if lst else "edr")
    assert got == pytest.approx(brute_edit(a, b, 1.0, 1.5, lst), abs=1e-5)
    assert got == pytest.approx(edit_distance(b, a, eps_m=1.0, tau_s=1.5, distance="lst" if lst else "edr"), abs=1e-5)


def test_edr_worked_cases() -> None:
    """Identical sequences cost 0; a shift within the tolerances is free; no match at all costs max(|A|, |B|)."""
    a = np.array([[0.0, 0.0, 0.0], [10.0, 0.0, 10.0], [20.0, 0.0, 20.0]])
    assert edit_distance(a, a, eps_m=1, tau_s=1) == 0
    assert edit_distance(a, a + np.array([0.5, 0.5, 5.0]), eps_m=1, tau_s=5) == 0
    assert edit_distance(a, a + np.array([0.5, 0.5, 5.0]), eps_m=1, tau_s=4) == 3
    assert edit_distance(a, a[:2] + 1000.0, eps_m=1, tau_s=5) == 3
    assert edit_distance(a, a[1:], eps_m=1, tau_s=1) == 1  # one deletion


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_alignment_is_monotone_matched_and_optimal(seed: int) -> None:
    """Matched pairs increase in both sequences, satisfy the match relation, and the path's cost is the distance."""
    rng = np.random.default_rng(seed)
    la, lb = rng.integers(1, 9, 2)
    a = rng.integers(0, 4, (la, 3)).astype(np.float32)
    b = rng.integers(0, 4, (lb, 3)).astype(np.float32)
    eps, tau = 1.0, 1.5
    got = _align(a[None], np.array([la]), b[None], np.array([lb]), eps, tau, Distance.EDR)[0]
    hit = np.flatnonzero(got >= 0)
    assert np.all(np.diff(got[hit]) > 0)
    for i in hit.tolist():
        d = np.abs(a[i] - b[got[i]])
        assert d[0] <= eps and d[1] <= eps and d[2] <= tau
    # any monotone alignment with h matches costs at least max(la, lb) - h, so an optimal path has
    # at least max(la, lb) - EDR matches
    assert len(hit) >= max(la, lb) - brute_edit(a, b, eps, tau, False)


def brute_greedy(space: _Space, k: int, radius: float) -> tuple[list[list[int]], list[int]]:
    """§7.3/§7.4 greedy from a full distance matrix (no pruning, no cache, no replay)."""
    packed = space.p
    n = len(packed.length)
    full = np.ones((n, n))
    for p in range(n):
        for q in range(n):
            a, b = packed.xyt[p, : packed.length[p]], packed.xyt[q, : packed.length[q]]
            e = brute_edit(a, b, space.eps, space.tau, False)
            full[p, q] = e / max(len(a), len(b))
    summ = packed.summary
    alive = list(range(n))
    ref = summ.mean(axis=0)
    clusters: list[list[int]] = []
    trash: list[int] = []
    while len(alive) >= k:
        p = max(alive, key=lambda t: float(((summ[t] - ref) ** 2).sum()))
        others = sorted(
            (r for r in alive if r != p), key=lambda t: (full[p, t], float(((summ[t] - summ[p]) ** 2).sum()))
        )
        near = others[: k - 1]
        ref = summ[p]
        if full[p, near[-1]] > radius:
            alive.remove(p)
            trash.append(p)
            continue
        clusters.append([p, *near])
        alive = [r for r in alive if r not in clusters[-1]]
    for r in alive:
        if clusters:
            ds = [(full[c[0], r], float(((summ[c[0]] - summ[r]) ** 2).sum()), i) for i, c in enumerate(clusters)]
            d, _, i = min(ds)
            if d <= radius:
                clusters[i].append(r)
                continue
        trash.append(r)
    return clusters, sorted(trash)


def scene(seed: int, n: int, points: int) -> list[Trajectory]:
    """``n`` trajectories in a few bundles, with different starts, spans and sampling periods."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        bundle = i % 3
        period = float(rng.choice([5.0, 10.0, 20.0]))
        m = int(rng.integers(2, points + 1))
        t = 1_700_000_000.0 + rng.uniform(0, 60) + bundle * 30 + np.arange(m) * period
        x = bundle * 400.0 + rng.normal(0, 40) + 8.0 * (t - t[0]) + rng.normal(0, 5, m)
        y = bundle * -300.0 + rng.normal(0, 40) + rng.normal(0, 5, m)
        lat, lon = FRAME.inverse(x, y)
        out.append(Trajectory.of(f"u{i}", t, lat, lon))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_greedy_with_pruning_matches_brute_force(seed: int) -> None:
    """Lower-bound pruning, the distance cache and prefix replay change nothing (exact mode)."""
    trajs = scene(seed, 13, 7)
    packed = _pack(trajs, 60.0, 20.0)
    space = _Space(packed, 60.0, 20.0, Distance.EDR, None)
    g = _Greedy(space, 3)
    for radius in (0.3, 0.8, 0.5, 1.0, 0.0):
        clusters, trash = g.run(radius)
        expected, expected_trash = brute_greedy(space, 3, radius)
        assert [c.tolist() for c in clusters] == expected
        assert trash.tolist() == expected_trash


def source_checks(inputs: list[Trajectory], r: W4MResult, tau: float) -> None:
    """Every published point's source (instant, position) is the input's own, and its time shift is explained."""
    by_id = {tr.traj_id: tr for tr in inputs}
    for o, p in zip(r.originals, r.published, strict=True):
        tr = by_id[o.traj_id]
        assert len(o) == len(p)
        assert np.all(o.t >= tr.t_start) and np.all(o.t <= tr.t_end)
        lat, lon = tr.at(o.t)
        assert np.all(haversine_m_array(lat, lon, o.lat, o.lon) < 1e-3)
        shift = np.abs(p.t - o.t)
        clamped = np.isin(o.t, [tr.t_start, tr.t_end]) & ((p.t < tr.t_start) | (p.t > tr.t_end))
        assert np.all((shift <= tau + 1e-6) | clamped)  # matched: ≤ τ; inserted inside the span: 0


@st.composite
def scenes(draw: st.DrawFn) -> tuple[list[Trajectory], int, float, float]:
    n = draw(st.integers(2, 16))
    k = draw(st.integers(2, 4))
    delta = draw(st.sampled_from([0.0, 50.0, 300.0, 3_000.0]))
    trash_max = draw(st.sampled_from([0.0, 0.1, 0.5]))
    return scene(draw(st.integers(0, 2**32 - 1)), n, draw(st.integers(2, 9))), k, delta, trash_max


@settings(max_examples=60, deadline=None)
@given(scenes())
def test_w4m_invariants(s: tuple[list[Trajectory], int, float, float]) -> None:
    trajs, k, delta, trash_max = s
    tau = 30.0
    r = w4m(trajs, k=k, delta_m=delta, trash_max=trash_max, tau_s=tau, eps_m=max(delta / 2, 25.0))
    ids = [tr.traj_id for tr in r.published]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & set(r.trash)
    assert sorted(ids + list(r.trash)) == sorted(tr.traj_id for tr in trajs)
    # trash_max is a bound, not a budget (issue 16): the trash is what the bounds force, at any trash_max
    assert r.ok == (len(r.trash) <= trash_limit(len(trajs), trash_max))
    assert sum(n for _, n in r.trash_reasons) == len(r.trash)
    loose = w4m(trajs, k=k, delta_m=delta, trash_max=1.0, tau_s=tau, eps_m=max(delta / 2, 25.0))
    assert sorted(loose.trash) == sorted(r.trash) and loose.ok
    assert all(len(g) >= k for g in r.groups)  # no output trajectory outside a valid group
    assert sorted(i for g in r.groups for i in g) == list(range(len(r.published)))
    for g in r.groups:  # a group shares its pivot's instants
        assert all(r.published[i].t.tolist() == r.published[g[0]].t.tolist() for i in g)
    if r.published:
        verdict = verify_k_delta(fixes_of(r.published), k, delta)
        assert verdict.ok, verdict.failures
    source_checks(trajs, r, tau)
    # the report's totals are the sums of the per-point shifts
    table, _ = publish_rows(r.published, seed=1)
    rep = anonymization_report(
        r,
        trajs,
        table,
        method="w4m",
        k=k,
        delta_m=delta,
        trash_max=trash_max,
        pi_s=None,
        n_too_short=0,
        n_bad_rows=0,
        runtime_s=0.0,
        range_queries=10,
    )
    shifts = sum(float(np.abs(p.t - o.t).sum()) for o, p in zip(r.originals, r.published, strict=True))
    moved = sum(
        float(haversine_m_array(o.lat, o.lon, p.lat, p.lon).sum())
        for o, p in zip(r.originals, r.published, strict=True)
    )
    assert rep["time_distortion_s"] == pytest.approx(shifts)
    assert rep["total_translation_m"] == pytest.approx(moved, abs=1e-6)
    n_points = sum(len(p) for p in r.published)
    assert rep["n_points_out"] == n_points
    matched = n_points - r.n_inserted
    assert r.n_deleted == sum(len(trajs[[t.traj_id for t in trajs].index(o.traj_id)]) for o in r.originals) - matched


def test_members_with_offset_clocks_are_shifted_onto_the_pivot() -> None:
    """Three equal routes sampled 10 s apart with 3 s clock offsets: one group, no edits, shifts ≤ 6 s."""
    t = 1_700_000_000.0 + np.arange(12) * 10.0
    trajs = [
        Trajectory.of(f"u{i}", t + 3.0 * i, *FRAME.inverse(8.0 * (t + 3.0 * i - t[0]) + 5 * i, np.zeros(12)))
        for i in range(3)
    ]
    r = w4m(trajs, k=3, delta_m=300.0, tau_s=10.0)
    assert len(r.groups) == 1 and r.n_inserted == 0 and r.n_deleted == 0
    shifts = np.concatenate([np.abs(p.t - o.t) for o, p in zip(r.originals, r.published, strict=True)])
    assert shifts.max() <= 6.0 + 1e-9 and shifts.sum() > 0
    assert verify_k_delta(fixes_of(r.published), 3, 300.0).ok


def test_parameters_are_validated() -> None:
    with pytest.raises(KDeltaError):
        w4m([], k=1, delta_m=10)
    with pytest.raises(KDeltaError):
        w4m([], k=2, delta_m=10, tau_s=-1)
    with pytest.raises(ValueError):
        w4m([], k=2, delta_m=10, distance="dtw")


def real_sources() -> list[Path]:
    out = [DATA / "ais_nyharbor.csv.gz", *sorted(DATA.glob("*.gpx"))]
    return out


@pytest.mark.parametrize("method", ["nwa", "w4m", "microagg"])
@pytest.mark.parametrize("source", real_sources(), ids=lambda p: p.name)
def test_real_data_releases_pass_the_verifier(source: Path, method: str) -> None:
    fixes = read_fixes(source)
    if source.suffix == ".gpx":  # one track: split it into consecutive pieces so there is something to group
        ids = np.array([f"piece{i // 12}" for i in range(len(fixes))], dtype=np.str_)
        fixes = type(fixes)(ids, fixes.t, fixes.lat, fixes.lon)
    release = anonymize(fixes, method=method, k=3, delta_m=500.0, seed=5, range_queries=50)
    if not release.ok:
        assert release.report["trash_fraction"] > 0.1 or release.report["n_in"] < 3
        return
    verdict = verify_k_delta(release.table, 3, 500.0)
    assert verdict.ok, verdict.failures[:3]
    if method != "w4m":
        assert release.report["time_distortion_s"] == 0.0


def test_geolife_sample_w4m_release_passes_the_verifier() -> None:
    if not GEOLIFE.exists():
        pytest.skip(f"research GeoLife sample absent at {GEOLIFE}")
    fixes = read_fixes(GEOLIFE)
    inputs, _ = split_too_short(trajectories_from_fixes(fixes))
    release = anonymize(fixes, method="w4m", k=3, delta_m=500.0, seed=2, range_queries=50)
    # 5 users in different years: no three trajectories are co-temporal within the shift bound, so
    # an honest W4M refuses (before issue 16 it "published" them with shifts of months)
    rep = release.report
    assert rep["n_out"] + rep["n_trash"] == len(inputs)
    assert sum(rep["trash_reasons"].values()) == rep["n_trash"]
    if release.ok:
        assert verify_k_delta(release.table, 3, 500.0).ok
        assert rep["time_shift_s"]["max"] <= 3600.0
    else:
        assert rep["n_trash"] > rep["trash_limit"] and len(release.table) == 0


def test_cli_publishes_a_w4m_release(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, rep = tmp_path / "out.csv", tmp_path / "rep.json"
    src = DATA / "ais_nyharbor.csv.gz"
    # at δ = 800 m most ships of the harbour never meet three others: W4M now refuses (it used to group
    # them anyway, with a mean translation of about 2δ and more insertions than kept points)
    args = ["anonymize", str(src), "-o", str(out), "--k", "4", "--delta", "800", "--method", "w4m"]
    assert main([*args, "--report", str(rep), "--seed", "3", "--tau-s", "45"]) == 1
    assert not out.exists()
    err = capsys.readouterr().err
    assert "not published" in err and "no k-1 others within the time-shift bound and radius" in err
    refused = json.loads(rep.read_text())
    assert refused["n_trash"] > refused["trash_limit"] == 29
    # at a harbour-scale δ the same ships form groups within the bounds
    args = ["anonymize", str(src), "-o", str(out), "--k", "4", "--delta", "20000", "--method", "w4m"]
    assert main([*args, "--report", str(rep), "--seed", "3", "--tau-s", "45"]) == 0
    report = json.loads(rep.read_text())
    assert report["method"] == "w4m" and report["pi_s"] is None
    assert report["time_distortion_s"] >= 0 and "n_inserted" in report and "n_deleted" in report
    assert report["time_shift_s"]["max"] <= 3600.0 and report["translation_m"]["max"] <= 10_000.0
    published = read_fixes(out)
    assert verify_k_delta(published, 4, 20000.0).ok
    with pytest.raises(SystemExit) as exc:
        main([*args, "--distance", "dtw"])
    assert exc.value.code == 2
    assert main([*args, "--tau-s", "-3"]) == 2
