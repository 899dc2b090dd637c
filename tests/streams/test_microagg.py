"""Trajectory microaggregation (CONCEPTS §7.5) and MDAV (§8.10)."""

from __future__ import annotations

import numpy as np

from cloaking.geometry import Aeqd
from streams.kdelta.microagg import mdav_groups, microaggregate, p_contemporaneous_distances
from streams.quality import verify_k_delta
from streams.trajectory import Trajectory, fixes_of

FRAME = Aeqd(39.9, 116.4)


def test_mdav_age_worked_example() -> None:
    """§8.10 `mdav_age` (medoid variant): {30,35,40}, {60,65,70}, {45,50,55}."""
    ages = np.array([35, 45, 30, 50, 60, 40, 65, 70, 55], float)
    d = np.abs(ages[:, None] - ages[None, :])
    groups = sorted(sorted(ages[g].tolist()) for g in mdav_groups(d, 3))
    assert groups == [[30, 35, 40], [45, 50, 55], [60, 65, 70]]


def test_distance_uses_p_contemporaneity() -> None:
    t = np.array([0.0, 100.0])
    lat, lon = FRAME.inverse(np.array([0.0, 0.0]), np.array([0.0, 0.0]))
    lat2, lon2 = FRAME.inverse(np.array([30.0, 30.0]), np.array([40.0, 40.0]))
    a = Trajectory.of("a", t, lat, lon)
    b = Trajectory.of("b", t, lat2, lon2)
    c = Trajectory.of("c", t + 50.0, lat2, lon2)  # half overlap: p = 1/2
    far = Trajectory.of("far", t + 500.0, lat, lon)  # no overlap
    d = p_contemporaneous_distances([a, b, c, far], grid_points=601)
    n_ab = 101  # grid instants inside [0, 100] (step 1 s)
    assert d[0, 1] == np.float64(d[1, 0])
    np.testing.assert_allclose(d[0, 1], np.sqrt(n_ab * 50.0**2) / n_ab, rtol=1e-4)
    n_ac = 51
    np.testing.assert_allclose(d[0, 2], 2 * np.sqrt(n_ac * 50.0**2) / n_ac, rtol=1e-4)
    assert np.isinf(d[0, 3])


def test_aggregation_publishes_identical_groups_of_at_least_k() -> None:
    rng = np.random.default_rng(2)
    trajs = []
    for i in range(23):
        t = np.sort(rng.uniform(0, 600, 8)) + rng.uniform(0, 60)
        lat, lon = FRAME.inverse(*(rng.normal(size=(2, 8)) * 500))
        trajs.append(Trajectory.of(f"u{i}", t, lat, lon))
    trajs.append(Trajectory.of("alone", np.array([5000.0, 5100.0]), *FRAME.inverse([0.0, 1.0], [0.0, 1.0])))
    r = microaggregate(trajs, k=4, trash_max=0.1)
    assert r.trash == ("alone",)  # outside the largest component of comparable pairs
    assert r.ok
    assert all(4 <= len(g) < 8 for g in r.groups)
    for g in r.groups:
        first = r.published[g[0]]
        for i in g:
            assert r.published[i].lat.tolist() == first.lat.tolist()
            assert r.published[i].t.tolist() == first.t.tolist()
    assert verify_k_delta(fixes_of(r.published), 4, 0.0).ok
