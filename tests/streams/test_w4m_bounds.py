"""W4M's bounds (issue 16 §2): a bounded time shift, a clustering radius, unmatched trajectories to the trash.

Before the fix W4M grouped any trajectories at normalized distance up to 1 (no match at all) and shifted
inserted points to the far end of a member's span, so 964 GeoLife trajectories of five years came out
"published" with time shifts of 575 days and a mean translation of 42 km.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.core.geometry import Aeqd
from kcloak.streams.kdelta.w4m import time_groups, w4m
from kcloak.streams.publish import anonymize
from kcloak.streams.quality import verify_k_delta
from kcloak.streams.synthetic import geolife_like_fixes
from kcloak.streams.trajectory import Trajectory, fixes_of, split_too_short, trajectories_from_fixes

FRAME = Aeqd(39.9, 116.4)
T0 = 1_700_000_000.0


def walker(name: str, t0: float, n: int, x0: float, y0: float, period: float = 10.0) -> Trajectory:
    t = t0 + np.arange(n) * period
    lat, lon = FRAME.inverse(x0 + 5.0 * (t - t0), np.full(n, y0))
    return Trajectory.of(name, t, lat, lon)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(3, 14),
    st.sampled_from([0.0, 15.0, 60.0, 600.0]),
    st.sampled_from([0.5, 0.9, 1.0]),
)
def test_no_published_point_moves_in_time_beyond_the_bound(seed: int, n: int, shift: float, radius: float) -> None:
    rng = np.random.default_rng(seed)
    trajs = [
        walker(f"u{i}", T0 + float(rng.uniform(0, 900)), int(rng.integers(2, 12)), float(rng.normal(0, 200)), 0.0)
        for i in range(n)
    ]
    r = w4m(trajs, k=2, delta_m=500.0, tau_s=30.0, max_time_shift_s=shift, max_radius=radius)
    for o, p in zip(r.originals, r.published, strict=True):
        assert float(np.abs(p.t - o.t).max()) <= shift + 1e-6
    assert sum(n for _, n in r.trash_reasons) == len(r.trash)
    assert sorted([tr.traj_id for tr in r.published] + list(r.trash)) == sorted(tr.traj_id for tr in trajs)
    if r.published:
        assert verify_k_delta(fixes_of(r.published), 2, 500.0).ok


def test_trajectories_without_partners_are_trash_not_published() -> None:
    """Three co-moving walkers publish; a walker 20 km away and one a day later are trash."""
    group = [walker(f"g{i}", T0 + 3.0 * i, 30, 40.0 * i, 0.0) for i in range(3)]
    far = walker("far", T0, 30, 0.0, 20_000.0)
    late = walker("late", T0 + 86_400.0, 30, 0.0, 0.0)
    r = w4m([*group, far, late], k=3, delta_m=300.0, tau_s=10.0, trash_max=0.5)
    assert sorted(r.trash) == ["far", "late"] and r.ok
    assert r.trash_by_reason() == {"class_smaller_than_k": 1, "no_match_within_bounds": 1}
    assert {tr.traj_id for tr in r.published} == {"g0", "g1", "g2"}
    tight = w4m([*group, far, late], k=3, delta_m=300.0, tau_s=10.0, trash_max=0.2)
    assert sorted(tight.trash) == ["far", "late"] and not tight.ok  # same trash, over the bound: refused
    # the unbounded behaviour this replaced: radius 1 and no shift bound group them all
    loose = w4m([*group, far, late], k=3, delta_m=300.0, tau_s=10.0, max_radius=1.0, max_time_shift_s=1e9)
    assert loose.trash == ()


def test_time_groups_split_on_gaps_wider_than_the_bound() -> None:
    trajs = [walker("a", T0, 10, 0, 0), walker("b", T0 + 50, 10, 0, 0), walker("c", T0 + 3_000, 10, 0, 0)]
    assert time_groups(trajs, 3600.0) == [[0, 1, 2]]
    assert time_groups(trajs, 60.0) == [[0, 1], [2]]


def test_geolife_shaped_input_is_refused_quickly_with_the_reason() -> None:
    """964 trajectories of 31 users over five years, 453,397 points: honest refusal, no 575-day shifts."""
    fixes = geolife_like_fixes()
    trajs, _ = split_too_short(trajectories_from_fixes(fixes))
    assert len(trajs) == 964 and len(fixes) == 453_397
    release = anonymize(fixes, method="w4m", k=3, delta_m=2_000.0, seed=1, range_queries=50)
    rep = release.report
    assert not release.ok and rep["n_trash"] > rep["trash_limit"]
    assert rep["trash_reasons"]["class_smaller_than_k"] > 900
    assert rep["runtime_s"] < 15.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 400)), min_size=1, max_size=200), st.integers(1, 200_000))
def test_prefetch_batches_bound_their_padded_cells(pairs: list[tuple[int, int]], budget: int) -> None:
    """Batches cover every pair once and, unless a single pair, pad to at most ``budget`` cells."""
    from kcloak.streams.kdelta.w4m import _batch_end

    arr = np.array(pairs, dtype=np.int64)
    arr = arr[np.lexsort((arr[:, 1], arr[:, 0]))]
    la, lb = arr[:, 0], arr[:, 1]
    start = 0
    while start < len(la):
        end = _batch_end(la, lb, start, budget)
        assert end > start
        padded = (end - start) * (int(la[start:end].max()) + 1) * (int(lb[start:end].max()) + 1)
        assert end - start == 1 or padded <= budget
        start = end
    assert start == len(la)
