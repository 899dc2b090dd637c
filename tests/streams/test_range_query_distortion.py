"""Range-query distortion as NWA and W4M define it (docs/quality.md), checked by an independent count.

The test counts *possibly sometimes inside* and *definitely always inside* trajectory by trajectory with
plain Python loops, then takes the mean of ``|Q(D) − Q(D*)| / max(Q(D), Q(D*))`` itself; only the random
queries (part of the definition: where the boxes are) come from kcloak.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kcloak.core.geometry import Aeqd
from kcloak.core.readers import FixTable
from kcloak.streams.publish import anonymize
from kcloak.streams.quality import (
    RangeQueries,
    random_range_queries,
    range_query_answers,
    range_query_distortion,
    relative_distortion,
)
from kcloak.streams.trajectory import Trajectory, fixes_of

FRAME = Aeqd(45.0, 10.0)


def traj(name: str, xy: list[tuple[float, float]], t: list[float]) -> Trajectory:
    lat, lon = FRAME.inverse(np.array([p[0] for p in xy]), np.array([p[1] for p in xy]))
    return Trajectory.of(name, np.array(t), lat, lon)


def own_counts(fixes: FixTable, q: RangeQueries, i: int, u: float) -> tuple[int, int]:
    """PSI and DAI of query ``i``, one trajectory at a time, no numpy tricks."""
    by_id: dict[str, list[tuple[float, float, float]]] = {}
    for tid, t, lat, lon in zip(
        fixes.traj_id.tolist(), fixes.t.tolist(), fixes.lat.tolist(), fixes.lon.tolist(), strict=True
    ):
        by_id.setdefault(tid, []).append((t, lat, lon))
    psi = dai = 0
    for rows in by_id.values():
        inside = [(lat, lon) for t, lat, lon in rows if q.t_lo[i] <= t <= q.t_hi[i]]
        if not inside:
            continue
        possibly = False
        always = True
        for lat, lon in inside:
            x, y = (float(v[0]) for v in q.frame.forward([lat], [lon]))
            gx = max(q.x_lo[i] - x, 0.0, x - q.x_hi[i])
            gy = max(q.y_lo[i] - y, 0.0, y - q.y_hi[i])
            possibly = possibly or math.hypot(gx, gy) <= u
            always = always and (q.x_lo[i] + u <= x <= q.x_hi[i] - u) and (q.y_lo[i] + u <= y <= q.y_hi[i] - u)
        psi += possibly
        dai += always
    return psi, dai


def test_worked_example() -> None:
    """One 200 m × 200 m box over [0, 120] s, uncertainty 10 m.

    a: always well inside (PSI, DAI); b: enters once, 5 m outside the box at other times (PSI only, via u);
    c: 30 m outside all the time (neither); d: inside but only after the interval (neither).
    """
    a = traj("a", [(0, 0), (10, 10), (20, 20)], [0, 60, 120])
    b = traj("b", [(105, 0), (50, 0), (105, 0)], [0, 60, 120])
    c = traj("c", [(130, 0), (130, 10), (130, 20)], [0, 60, 120])
    d = traj("d", [(0, 0), (0, 0)], [200, 260])
    z = np.zeros(1)
    q = RangeQueries(FRAME, z, z + 120, z - 100, z + 100, z - 100, z + 100)
    psi, dai = range_query_answers(fixes_of([a, b, c, d]), q, 10.0)
    assert (psi[0], dai[0]) == (2, 1)
    # after anonymization b moved out of reach and c moved in: PSI 2 → 2 (0 distortion), DAI 1 → 2 (|1−2|/2)
    b2 = traj("b", [(140, 0), (140, 0), (140, 0)], [0, 60, 120])
    c2 = traj("c", [(50, 0), (50, 10), (50, 20)], [0, 60, 120])
    psi2, dai2 = range_query_answers(fixes_of([a, b2, c2, d]), q, 10.0)
    assert (psi2[0], dai2[0]) == (2, 2)
    assert relative_distortion(dai, dai2) == 0.5 and relative_distortion(psi, psi2) == 0.0
    assert relative_distortion([0, 4], [0, 1]) == pytest.approx(0.375)  # empty in both counts 0; 3/4 halved


@pytest.mark.parametrize("method", ["nwa", "microagg"])
def test_report_value_equals_an_independent_count(method: str) -> None:
    rng = np.random.default_rng(4)
    t = (np.arange(8) * 60.0).tolist()
    trajs = []
    for i in range(45):  # five corridors, nine walkers each, 150 m of scatter
        base = np.array([(i % 5) * 900.0, 0.0]) + np.outer(np.arange(8), [40.0, 25.0])
        pts = base + rng.normal(0.0, 150.0, base.shape)
        trajs.append(traj(f"w{i}", [(float(x), float(y)) for x, y in pts], t))
    fixes = fixes_of(trajs)
    release = anonymize(fixes, method=method, k=3, delta_m=500.0, trash_max=0.3, seed=7, range_queries=25)
    assert release.ok
    rep = release.report
    q = random_range_queries(fixes_of_inputs(fixes), 25, seed=7)
    u = 250.0
    errs_psi: list[float] = []
    errs_dai: list[float] = []
    for i in range(25):
        pb, db = own_counts(fixes_of_inputs(fixes), q, i, u)
        pa, da = own_counts(release.table, q, i, u)
        errs_psi.append(abs(pb - pa) / max(pb, pa) if max(pb, pa) else 0.0)
        errs_dai.append(abs(db - da) / max(db, da) if max(db, da) else 0.0)
    assert rep["range_query_uncertainty_m"] == u
    assert rep["range_query_distortion"] == pytest.approx(sum(errs_psi) / 25, abs=1e-12)
    assert rep["range_query_distortion_dai"] == pytest.approx(sum(errs_dai) / 25, abs=1e-12)
    assert 0.0 < rep["range_query_distortion"] < 1.0
    assert rep["range_query_changed_fraction"] >= rep["range_query_distortion"]  # the old, harsher figure


def fixes_of_inputs(fixes: FixTable) -> FixTable:
    """The input as the report sees it (trajectories of ≥ 2 instants, rows grouped per trajectory)."""
    from kcloak.streams.trajectory import split_too_short, trajectories_from_fixes

    return fixes_of(split_too_short(trajectories_from_fixes(fixes))[0])


def test_identical_and_empty_outputs() -> None:
    fx = fixes_of([traj("a", [(0, 0), (50, 0)], [0, 60]), traj("b", [(500, 0), (520, 0)], [0, 60])])
    assert range_query_distortion(fx, fx, n_queries=50, uncertainty_m=20.0) == 0.0
    assert range_query_distortion(fx, fixes_of([]), n_queries=50) == 1.0
