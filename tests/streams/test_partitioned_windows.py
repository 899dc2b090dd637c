"""A window cut into parts (NWA classes or start cells) and merged with the whole window's trash bound (issue 15)."""

from __future__ import annotations

import numpy as np
import pytest

from kcloak.cloaking.cells import CellMap
from kcloak.core.readers import FixTable
from kcloak.streams.partitioned import (
    PartitionError,
    PartParams,
    anonymize_partitioned,
    cut_groups,
    plan_window,
    refusal_reason,
)
from kcloak.streams.publish import anonymize
from kcloak.streams.quality import verify_k_delta


def window_fixes(seed: int = 1, *, users_per_spot: int = 8, spots: int = 4, outliers: int = 0) -> FixTable:
    """Users walking around a few spots of one city, with a few start/end times (several NWA classes)."""
    rng = np.random.default_rng(seed)
    ids: list[str] = []
    ts: list[float] = []
    lats: list[float] = []
    lons: list[float] = []
    n = 0
    for s in range(spots):
        lat0, lon0 = 39.90 + 0.03 * s, 116.40 + 0.02 * s
        for _ in range(users_per_spot + outliers):
            start = 1_000_020 + 120 * (n % 3)
            steps = 8 + (n % 2) * 2
            la = lat0 + rng.normal(0, 0.0005) + np.cumsum(rng.normal(0, 0.0001, steps))
            lo = lon0 + rng.normal(0, 0.0005) + np.cumsum(rng.normal(0, 0.0001, steps))
            if outliers and n % (users_per_spot + outliers) >= users_per_spot:
                la = la + rng.uniform(0.2, 0.5)  # far from everyone
            ids += [f"user{n:03d}"] * steps
            ts += (start + 60.0 * np.arange(steps)).tolist()
            lats += la.tolist()
            lons += lo.tolist()
            n += 1
    return FixTable(np.array(ids), np.array(ts), np.array(lats), np.array(lons))


def same_table(a: FixTable, b: FixTable) -> None:
    assert a.traj_id.tolist() == b.traj_id.tolist()
    np.testing.assert_array_equal(a.t, b.t)
    np.testing.assert_array_equal(a.lat, b.lat)
    np.testing.assert_array_equal(a.lon, b.lon)


@pytest.mark.parametrize("method", ["nwa", "w4m", "microagg"])
def test_one_part_is_the_single_process_release(method: str) -> None:
    fixes = window_fixes()
    params = PartParams(method=method, k=3, delta_m=400.0, trash_max=0.2, pi_s=60.0)
    single = anonymize(fixes, method=method, k=3, delta_m=400.0, trash_max=0.2, pi_s=60.0, seed=7)
    parted = anonymize_partitioned(fixes, params, parts=1, seed=7)
    assert single.ok and parted.ok
    same_table(single.table, parted.table)
    assert {key: parted.report[key] for key in ("n_in", "n_out", "n_trash", "n_groups")} == {
        key: single.report[key] for key in ("n_in", "n_out", "n_trash", "n_groups")
    }


def test_nwa_parts_are_equivalence_classes_and_give_the_single_release() -> None:
    """NWA never mixes classes, so cutting by class changes nothing, whatever the number of parts."""
    fixes = window_fixes(2)
    params = PartParams(method="nwa", k=3, delta_m=400.0, trash_max=0.2, pi_s=60.0)
    plan = plan_window(fixes, params, parts=4)
    assert len(plan.parts) > 1
    spans = [{(tr.t_start, tr.t_end) for tr in part} for part in plan.parts]
    for i, a in enumerate(spans):  # a class lies in one part only
        for b in spans[i + 1 :]:
            assert not a & b
    single = anonymize(fixes, method="nwa", k=3, delta_m=400.0, trash_max=0.2, pi_s=60.0, seed=3)
    parted = anonymize_partitioned(fixes, params, parts=4, seed=3)
    same_table(single.table, parted.table)


@pytest.mark.parametrize("method", ["w4m", "microagg"])
def test_start_cell_parts_publish_only_k_delta_sets(method: str) -> None:
    fixes = window_fixes(3)
    cells = CellMap.balanced(fixes.lat, fixes.lon, cells=4)
    params = PartParams(method=method, k=3, delta_m=400.0, trash_max=0.3, pi_s=60.0)
    plan = plan_window(fixes, params, parts=4, cells=cells)
    assert len(plan.parts) >= 2
    starts = [
        set(cells.cell_of([tr.lat[0] for tr in part], [tr.lon[0] for tr in part]).tolist()) for part in plan.parts
    ]
    for i, a in enumerate(starts):  # a start cell lies in one part only
        for b in starts[i + 1 :]:
            assert not a & b
    assert all(len(part) >= 3 for part in plan.parts)
    release = anonymize_partitioned(fixes, params, parts=4, cells=cells, seed=1)
    assert release.ok
    verdict = verify_k_delta(release.table, 3, 400.0)
    assert verdict.failures == ()
    assert not set(release.table.traj_id.tolist()) & set(fixes.traj_id.tolist())


def with_loners(fixes: FixTable, loners: int) -> FixTable:
    """``loners`` extra users, each alone in an NWA class of its own (a later span): NWA trashes each of them."""
    ids, ts, lats, lons = [fixes.traj_id], [fixes.t], [fixes.lat], [fixes.lon]
    for j in range(loners):
        t = (1_003_000 + 600.0 * j + 60.0 * np.arange(5)).astype(np.float64)
        ids.append(np.array([f"loner{j}"] * 5))
        ts.append(t)
        lats.append(np.full(5, 39.95))
        lons.append(np.full(5, 116.45) + 0.0001 * np.arange(5))
    return FixTable(np.concatenate(ids), np.concatenate(ts), np.concatenate(lats), np.concatenate(lons))


def test_trash_bound_holds_over_the_whole_window_not_per_part() -> None:
    """A part that alone trashes all it holds does not stop the window when the window's sum is within bound;
    a sum beyond ``floor(trash_max · n)`` stops it (nothing published, with the reason), however it is cut."""
    params = PartParams(method="nwa", k=3, delta_m=400.0, trash_max=0.1, pi_s=60.0)
    within = with_loners(window_fixes(5), 2)  # 34 trajectories, limit 3, 2 loners
    plan = plan_window(within, params, parts=8)
    loner_parts = [part for part in plan.parts if any(tr.traj_id.startswith("loner") for tr in part)]
    assert loner_parts and all(len(part) < 34 for part in loner_parts)
    release = anonymize_partitioned(within, params, parts=8, seed=1)
    assert release.ok, refusal_reason(release)
    assert release.report["n_trash"] == 2 and release.report["n_in"] == 34
    assert verify_k_delta(release.table, 3, 400.0).failures == ()

    beyond = with_loners(window_fixes(5), 5)  # 37 trajectories, limit 3, 5 loners
    for parts in (1, 3, 8):
        refused = anonymize_partitioned(beyond, params, parts=parts, seed=1)
        assert not refused.ok
        assert len(refused.table) == 0
        assert refusal_reason(refused) == {
            "reason": "trash_exceeded",
            "n_in": 37,
            "n_trash": 5,
            "trash_limit": 3,
            "k": 3,
        }


def test_cut_groups_merges_runs_smaller_than_k() -> None:
    assert cut_groups([5, 5, 5, 5], 2, 3) == [0, 0, 1, 1]
    assert cut_groups([3, 3, 1], 3, 3) == [0, 1, 1]  # the run of 1 joins its neighbour
    assert cut_groups([1, 9], 2, 3) == [0, 0]
    assert cut_groups([4], 8, 3) == [0]
    with pytest.raises(PartitionError):
        cut_groups([1], 0, 3)
