"""Never Walk Alone (CONCEPTS §7.3) checked with the independent verifier of §9.6."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.core.geometry import Aeqd, haversine_m_array
from kcloak.streams.kdelta import KDeltaError, trash_limit
from kcloak.streams.kdelta.nwa import (
    _Greedy,
    choose_radius,
    greedy_clusters,
    nwa,
    sample_instants,
    space_translate,
    trimmed_span,
)
from kcloak.streams.quality import verify_k_delta
from kcloak.streams.trajectory import Trajectory, fixes_of

FRAME = Aeqd(39.9, 116.4)


def make(i: int, t: np.ndarray, x: np.ndarray, y: np.ndarray) -> Trajectory:
    lat, lon = FRAME.inverse(x, y)
    return Trajectory.of(f"u{i}", t, lat, lon)


def test_nwa_translate_worked_example() -> None:
    """§7.3 `nwa_translate`: A(0,0), B(4,0), C(2,3), δ = 4 → A, B move 0.2361 each, C stays."""
    f = Aeqd(0.0, 0.0)
    lat, lon = f.inverse(np.array([0.0, 4.0, 2.0]), np.array([0.0, 0.0, 3.0]))
    new_lat, new_lon, cost = space_translate(lat[:, None], lon[:, None], 4.0 / 2)
    x, y = f.forward(new_lat[:, 0], new_lon[:, 0])
    np.testing.assert_allclose(x, [0.2111, 3.7889, 2.0], atol=1e-4)
    np.testing.assert_allclose(y, [0.1056, 0.1056, 3.0], atol=1e-4)
    np.testing.assert_allclose(cost[:, 0], [0.2361, 0.2361, 0.0], atol=1e-4)
    assert cost.sum() == pytest.approx(0.4721, abs=1e-4)
    assert np.all(np.hypot(x - 2.0, y - 1.0) <= 2.0 + 1e-6)


def test_space_translation_is_the_cheapest_move_for_its_centre() -> None:
    """Brute force: no point of the disc around the centre is nearer to the original than the published point."""
    rng = np.random.default_rng(3)
    f = Aeqd(0.0, 0.0)
    for _ in range(5):
        xy = rng.normal(size=(4, 2)) * 30
        lat, lon = f.inverse(xy[:, 0], xy[:, 1])
        new_lat, new_lon, cost = space_translate(lat[:, None], lon[:, None], 10.0)
        centre = xy.mean(axis=0)
        ang = np.linspace(0, 2 * np.pi, 721)
        rad = np.linspace(0, 10.0, 101)
        disc = centre + np.stack([np.outer(rad, np.cos(ang)).ravel(), np.outer(rad, np.sin(ang)).ravel()], 1)
        for i in range(4):
            best = np.hypot(*(disc - xy[i]).T).min()
            assert cost[i, 0] <= best + 1e-3
            d = haversine_m_array(lat[i], lon[i], new_lat[i, 0], new_lon[i, 0])
            assert float(d) == pytest.approx(cost[i, 0], abs=1e-6)


def test_classes_trim_inwards_to_pi() -> None:
    assert trimmed_span(101.0, 359.0, 60.0) == (120.0, 300.0)
    assert trimmed_span(100.0, 119.0, 60.0)[0] >= trimmed_span(100.0, 119.0, 60.0)[1]
    assert sample_instants(120.0, 300.0, 60.0).tolist() == [120.0, 180.0, 240.0, 300.0]
    assert sample_instants(0.0, 100.0, 30.0).tolist() == [0.0, 30.0, 60.0, 90.0, 100.0]


def test_short_span_and_small_classes_go_to_the_trash() -> None:
    t = np.array([0.0, 60.0, 120.0])
    trajs = [make(i, t, np.full(3, 10.0 * i), np.zeros(3)) for i in range(3)]
    trajs.append(make(9, np.array([10.0, 50.0]), np.zeros(2), np.zeros(2)))  # trims to an empty span
    r = nwa(trajs, k=4, delta_m=100, pi_s=60, trash_max=1.0)
    assert r.published == ()
    assert sorted(r.trash) == ["u0", "u1", "u2", "u9"]
    r = nwa(trajs, k=3, delta_m=100, pi_s=60, trash_max=0.5)
    assert sorted(tr.traj_id for tr in r.published) == ["u0", "u1", "u2"]
    assert r.trash == ("u9",)
    assert r.ok


def test_outlier_is_trashed_under_a_radius_bound() -> None:
    t = np.arange(4) * 60.0
    trajs = [make(i, t, np.full(4, 5.0 * i), np.zeros(4)) for i in range(6)]
    trajs.append(make(6, t, np.full(4, 50_000.0), np.zeros(4)))
    r = nwa(trajs, k=3, delta_m=50, pi_s=60, max_radius=1_000.0)
    assert r.trash == ("u6",)
    assert sorted(len(g) for g in r.groups) == [3, 3]
    assert verify_k_delta(fixes_of(r.published), 3, 50).ok


def test_greedy_clusters_are_at_least_k_and_partition() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(103, 20)) * 100
    clusters, trash = greedy_clusters(X, 10, 5, np.inf)
    assert len(trash) == 0
    assert all(len(c) >= 5 for c in clusters)
    assert sorted(np.concatenate(clusters).tolist()) == list(range(103))


def brute_greedy(X: np.ndarray, k: int, max_radius: float) -> tuple[list[list[int]], list[int]]:
    """§7.3 pseudo-code of ``greedy_clusters`` by brute force (full distance scans)."""
    alive = list(range(len(X)))
    ref = X.mean(axis=0)
    clusters: list[list[int]] = []
    trash: list[int] = []
    while len(alive) >= k:
        p = max(alive, key=lambda t: float(np.linalg.norm(X[t] - ref)))
        others = sorted((r for r in alive if r != p), key=lambda t: float(np.linalg.norm(X[t] - X[p])))[: k - 1]
        ref = X[p]
        if float(np.linalg.norm(X[others[-1]] - X[p])) > max_radius:
            alive.remove(p)
            trash.append(p)
            continue
        clusters.append([p, *others])
        alive = [r for r in alive if r not in clusters[-1]]
    for r in alive:
        d = [float(np.linalg.norm(X[c[0]] - X[r])) for c in clusters]
        if d and min(d) <= max_radius:
            clusters[int(np.argmin(d))].append(r)
        else:
            trash.append(r)
    return clusters, sorted(trash)


def test_greedy_matches_brute_force_and_resumed_runs_match_fresh_ones() -> None:
    """Pruned pivot choice and prefix replay change nothing: every radius gives the brute-force clustering."""
    rng = np.random.default_rng(7)
    X = (rng.normal(size=(150, 1, 2)) * 2_000 + np.cumsum(rng.normal(size=(150, 12, 2)) * 50, axis=1)).reshape(150, 24)
    g = _Greedy(X, 12, 4)
    for radius in (300.0, 2_000.0, 900.0, 1_500.0, 1_200.0, np.inf):
        clusters, trash = g.run(radius)
        expected, expected_trash = brute_greedy(X, 4, radius)
        assert [c.tolist() for c in clusters] == expected
        assert trash.tolist() == expected_trash
    assert len(g.runs) == 6


def test_choose_radius_ends_on_a_feasible_candidate_next_to_an_infeasible_one() -> None:
    """§7.3 `choose_radius`: the chosen (k−1)-NN distance keeps the trash in budget, the next smaller one does not."""
    rng = np.random.default_rng(11)
    X = (rng.normal(size=(300, 1, 2)) * 3_000 + np.cumsum(rng.normal(size=(300, 10, 2)) * 30, axis=1)).reshape(300, 20)
    k, budget = 5, 30
    radius = choose_radius(X, 10, k, budget)
    assert len(greedy_clusters(X, 10, k, radius)[1]) <= budget
    knn = np.sort(np.linalg.norm(X[:, None, :] - X[None, :, :], axis=2), axis=1)[:, k - 1]
    cand = np.unique(knn)
    assert radius in cand
    below = cand[cand < radius]
    assert len(below) == 0 or len(greedy_clusters(X, 10, k, float(below[-1]))[1]) > budget


@st.composite
def scenes(draw: st.DrawFn) -> tuple[list[Trajectory], int, float, float]:
    n = draw(st.integers(2, 14))
    m = draw(st.integers(2, 5))
    k = draw(st.integers(2, 4))
    delta = draw(st.sampled_from([0.0, 10.0, 200.0, 2_000.0]))
    trash_max = draw(st.sampled_from([0.0, 0.1, 0.5]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    t = np.arange(m) * 60.0 + 600.0
    scale = draw(st.sampled_from([50.0, 3_000.0, 40_000.0]))
    trajs = [make(i, t, *(rng.normal(size=(2, m)) * scale)) for i in range(n)]
    return trajs, k, delta, trash_max


@settings(max_examples=60, deadline=None)
@given(scenes())
def test_every_published_trajectory_passes_the_verifier(scene: tuple[list[Trajectory], int, float, float]) -> None:
    trajs, k, delta, trash_max = scene
    r = nwa(trajs, k=k, delta_m=delta, pi_s=60, trash_max=trash_max)
    published_ids = [tr.traj_id for tr in r.published]
    assert len(set(published_ids)) == len(published_ids)
    assert not set(published_ids) & set(r.trash)  # no trashed trajectory published
    assert sorted(published_ids + list(r.trash)) == sorted(tr.traj_id for tr in trajs)
    if len(trajs) >= k:  # one class: the radius search keeps the trash within its bound
        assert len(r.trash) <= trash_limit(len(trajs), trash_max)
        assert r.ok
    assert all(len(g) >= k for g in r.groups)  # no output trajectory outside a valid group
    assert sorted(i for g in r.groups for i in g) == list(range(len(r.published)))
    if r.published:
        verdict = verify_k_delta(fixes_of(r.published), k, delta)
        assert verdict.ok, verdict.failures
        assert not verdict.warnings
    for o, p in zip(r.originals, r.published, strict=True):
        assert o.traj_id == p.traj_id
        assert o.t.tolist() == p.t.tolist()


def test_parameters_are_validated() -> None:
    with pytest.raises(KDeltaError):
        nwa([], k=1, delta_m=10)
    with pytest.raises(KDeltaError):
        nwa([], k=2, delta_m=-1)
    with pytest.raises(ValueError):
        nwa([], k=2, delta_m=10, pi_s=0)
