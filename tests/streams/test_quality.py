"""The independent (k,δ) verifier (§9.6), quality measures (§7.8) and output randomization (§7.7)."""

from __future__ import annotations

import numpy as np
import pytest

from kcloak.core.geometry import Aeqd
from kcloak.core.readers import FixTable
from kcloak.streams.publish import anonymize, fresh_ids, publish_rows
from kcloak.streams.quality import (
    Violation,
    mec_radius,
    publication_format_problems,
    range_query_distortion,
    translation_m,
    verify_k_delta,
)
from kcloak.streams.trajectory import Trajectory, fixes_of

FRAME = Aeqd(45.0, 10.0)
T = np.array([0.0, 60.0, 120.0])


def traj(name: str, xs: list[float], ys: list[float], t: np.ndarray = T) -> Trajectory:
    lat, lon = FRAME.inverse(np.array(xs, float), np.array(ys, float))
    return Trajectory.of(name, t, lat, lon)


def test_verifier_accepts_a_good_group() -> None:
    trajs = [traj(f"{i:016x}", [i * 10.0] * 3, [0.0, 5.0, 10.0]) for i in range(3)]
    v = verify_k_delta(fixes_of(trajs), 3, 20.5)
    assert v.ok and not v.warnings and v.n_trajectories == 3


def test_verifier_rejects_a_pair_too_far_apart_at_one_instant() -> None:
    trajs = [traj("a", [0, 0, 0], [0, 0, 0]), traj("b", [10, 10, 30], [0, 0, 0]), traj("c", [5, 5, 5], [0, 0, 0])]
    v = verify_k_delta(fixes_of(trajs), 3, 20.0)
    assert not v.ok
    # b is 30 m from a and 25 m from c at t = 120: nobody has two others within 20 m throughout
    assert sorted(v.failures) == [("a", Violation.PAIRWISE), ("b", Violation.PAIRWISE), ("c", Violation.PAIRWISE)]
    assert verify_k_delta(fixes_of(trajs), 3, 30.0).ok


def test_verifier_rejects_classes_with_different_instants() -> None:
    trajs = [traj("a", [0, 0, 0], [0, 0, 0]), traj("b", [1, 1, 1], [0, 0, 0], T + 1.0)]
    v = verify_k_delta(fixes_of(trajs), 2, 100.0)
    assert sorted(v.failures) == [("a", Violation.CLASS_SMALLER_THAN_K), ("b", Violation.CLASS_SMALLER_THAN_K)]


def test_pairwise_without_cylinder_is_a_warning() -> None:
    """Equilateral triangle of side δ: pairwise fine, but the MEC radius δ/√3 > δ/2 (§7.2)."""
    side = 100.0
    xs, ys = [0.0, side, side / 2], [0.0, 0.0, side * np.sqrt(3) / 2]
    trajs = [traj(n, [x] * 3, [y] * 3) for n, x, y in zip("abc", xs, ys, strict=True)]
    v = verify_k_delta(fixes_of(trajs), 3, side + 1e-3)
    assert v.ok
    assert sorted(i for i, _ in v.warnings) == ["a", "b", "c"]
    assert all(r is Violation.NO_CYLINDER_CERTIFICATE for _, r in v.warnings)


def test_mec_radius_brute_force() -> None:
    pts = np.array([[[0.0, 0.0], [4.0, 0.0], [2.0, 3.0]], [[0.0, 0.0], [4.0, 0.0], [2.0, 1.0]]])
    np.testing.assert_allclose(mec_radius(pts), [13 / 6, 2.0])


def test_format_checks_and_fresh_ids() -> None:
    good = FixTable(np.array(["00000000000000ab"] * 2), np.array([1.0, 2.0]), np.zeros(2), np.zeros(2))
    assert publication_format_problems(good, ["x"]) == []
    bad = FixTable(np.array(["User1", "User1"]), np.array([2.0, 1.0]), np.zeros(2), np.zeros(2))
    assert len(publication_format_problems(bad, ["User1"])) == 3
    import random

    ids = fresh_ids(1000, random.Random(1), avoid={"00"})
    assert len(set(ids)) == 1000 and all(len(i) == 16 and int(i, 16) >= 0 and i == i.lower() for i in ids)


def test_publish_rows_sorted_by_t_and_shuffled_within_equal_t() -> None:
    t = np.array([0.0, 60.0])
    trajs = [traj(f"in{i}", [float(i)] * 2, [0.0] * 2, t) for i in range(2000)]
    table, mapping = publish_rows(trajs, seed=7, avoid=[tr.traj_id for tr in trajs])
    assert np.all(np.diff(table.t) >= 0)
    assert publication_format_problems(table, [tr.traj_id for tr in trajs]) == []
    assert sorted(mapping.values()) == sorted(tr.traj_id for tr in trajs)
    first = table.traj_id[table.t == 0.0]
    rank = np.array([int(mapping[i][2:]) for i in first.tolist()])  # input position of each output row
    tau = np.corrcoef(rank, np.arange(len(rank)))[0, 1]
    assert abs(tau) < 0.1
    again, _ = publish_rows(trajs, seed=7)
    assert again.traj_id.tolist() == table.traj_id.tolist()  # seeded: reproducible


def test_translation_and_range_distortion() -> None:
    a = traj("a", [0, 0, 0], [0, 0, 0])
    b = traj("a", [3, 3, 3], [4, 4, 4])
    assert translation_m([a], [b])[0] == pytest.approx(15.0, rel=1e-4)
    fx = fixes_of([a, traj("z", [500, 500, 500], [0, 0, 0])])
    assert range_query_distortion(fx, fx, n_queries=200) == 0.0
    assert range_query_distortion(fx, fixes_of([]), n_queries=200) == 1.0


def test_anonymize_report_fields_and_verifier() -> None:
    rng = np.random.default_rng(5)
    t = np.arange(10) * 60.0
    xy = rng.normal(size=(40, 2, 10)) * 200
    trajs = [traj(f"u{i}", xy[i, 0].tolist(), xy[i, 1].tolist(), t) for i in range(40)]
    trajs.append(traj("short", [0.0], [0.0], np.array([0.0])))
    rel = anonymize(fixes_of(trajs), method="nwa", k=4, delta_m=300, pi_s=60, seed=3, range_queries=100)
    assert rel.ok
    r = rel.report
    assert set(r) >= {
        "method", "k", "delta", "trash_max", "pi_s", "n_in", "n_out", "n_trash", "n_too_short", "n_bad_rows",
        "n_points_in", "n_points_out", "trash_fraction", "n_groups", "group_size_mean", "total_translation_m",
        "mean_translation_m", "time_distortion_s", "range_query_distortion", "range_queries", "runtime_s",
    }  # fmt: skip
    assert (r["n_in"], r["n_too_short"], r["n_out"] + r["n_trash"]) == (40, 1, 40)
    assert r["n_points_out"] == len(rel.table) == r["n_out"] * 10
    assert r["trash_fraction"] <= 0.1
    assert r["mean_translation_m"] == pytest.approx(r["total_translation_m"] / r["n_points_out"])
    assert verify_k_delta(rel.table, 4, 300).ok
    assert publication_format_problems(rel.table, [tr.traj_id for tr in trajs]) == []
    failed = anonymize(fixes_of(trajs[:3]), method="nwa", k=4, delta_m=300, seed=3)
    assert not failed.ok and len(failed.table) == 0 and failed.report["n_out"] == 0
