"""Trajectory microaggregation baseline (Domingo-Ferrer & Trujillo-Rasua, Inf. Sci. 2012; CONCEPTS §7.5).

MDAV (§8.10) with the medoid for the centroid over the p-contemporaneity distance, then aggregation:
every member is replaced by its cluster's representative (the mean of the members, at the instants of
the cluster medoid), so each published group holds ≥ k identical trajectories (δ = 0 suffices).
Distances are evaluated on a common grid of ``grid_points`` instants over the data's time range ⚠
(the paper uses the union of both trajectories' timestamps inside their overlap).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from scipy.sparse.csgraph import connected_components, shortest_path

from cloaking.geometry import EARTH_RADIUS_M
from streams.kdelta import KDeltaResult, check_params, from_unit, to_unit, trash_limit
from streams.trajectory import Trajectory

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def p_contemporaneous_distances(trajectories: Sequence[Trajectory], grid_points: int = 64) -> F64:
    """Matrix of ``d_ij = (1/p_ij) · sqrt(Σ_t |τ_i(t) − τ_j(t)|²) / |O_ij|`` (metres; ∞ when not comparable)."""
    n = len(trajectories)
    s = np.array([tr.t_start for tr in trajectories])
    e = np.array([tr.t_end for tr in trajectories])
    grid = np.linspace(s.min(), e.max(), grid_points)
    valid = (grid[None, :] >= s[:, None]) & (grid[None, :] <= e[:, None])
    pos = np.empty((n, grid_points, 3))
    for i, tr in enumerate(trajectories):
        pos[i] = EARTH_RADIUS_M * to_unit(*tr.at(grid))
    dur = np.maximum(e - s, 1e-9)
    out = np.full((n, n), np.inf)
    for i in range(n):
        both = valid[i] & valid
        count = both.sum(axis=1)
        overlap = np.minimum(e[i], e) - np.maximum(s[i], s)
        p = np.minimum(overlap / dur[i], overlap / dur)
        sq = np.where(both, ((pos - pos[i]) ** 2).sum(axis=2), 0.0).sum(axis=1)
        ok = (p > 0) & (count > 0)
        out[i, ok] = np.sqrt(sq[ok]) / count[ok] / p[ok]
    out[np.arange(n), np.arange(n)] = 0.0
    sym: F64 = np.minimum(out, out.T)
    return sym


def _complete(d: F64) -> tuple[F64, I64]:
    """Shortest-path distances inside the largest component of comparable pairs, and its members."""
    finite = np.isfinite(d)
    if finite.all():
        return d, np.arange(len(d), dtype=np.int64)
    graph = np.where(finite, d + 1e-9, 0.0)  # csgraph reads 0 as "no edge"
    np.fill_diagonal(graph, 0.0)
    _, labels = connected_components(graph, directed=False)
    main = np.flatnonzero(labels == np.bincount(labels).argmax()).astype(np.int64)
    sub = graph[np.ix_(main, main)]
    return np.asarray(shortest_path(sub, method="D", directed=False), dtype=np.float64), main


def mdav_groups(d: F64, k: int) -> list[I64]:
    """MDAV (§8.10) on a distance matrix, with the medoid of the remaining records as their centroid (§7.5 ⚠)."""
    n = len(d)
    alive = np.ones(n, bool)
    row_sum = d.sum(axis=1)
    groups: list[I64] = []

    def take(seed: int) -> None:
        cand = np.flatnonzero(alive)
        g = cand[np.argsort(d[seed, cand], kind="stable")[:k]]
        if seed not in g:
            g = np.r_[seed, g[: k - 1]]
        alive[g] = False
        row_sum[:] -= d[:, g].sum(axis=1)
        groups.append(g.astype(np.int64))

    def farthest(src: int) -> int:
        cand = np.flatnonzero(alive)
        return int(cand[np.argmax(d[src, cand])])

    def medoid() -> int:
        cand = np.flatnonzero(alive)
        return int(cand[np.argmin(row_sum[cand])])

    while np.count_nonzero(alive) >= 3 * k:
        r = farthest(medoid())
        take(r)
        take(farthest(r))
    if np.count_nonzero(alive) >= 2 * k:
        take(farthest(medoid()))
    if np.any(alive):
        groups.append(np.flatnonzero(alive).astype(np.int64))
    return groups


def microaggregate(
    trajectories: Sequence[Trajectory],
    *,
    k: int,
    delta_m: float = 0.0,
    trash_max: float = 0.1,
    grid_points: int = 64,
) -> KDeltaResult:
    """Aggregation microaggregation (CONCEPTS §7.5): groups of ≥ k identical published trajectories.

    Trajectories outside the largest component of comparable (time-overlapping) pairs go to the trash.
    ``delta_m`` is accepted for symmetry with NWA; aggregated members coincide, so any δ ≥ 0 holds.
    """
    check_params(k, delta_m, trash_max)
    n_in = len(trajectories)
    limit = trash_limit(n_in, trash_max)
    if n_in < k:
        return KDeltaResult((), (), (), tuple(tr.traj_id for tr in trajectories), n_in, limit)
    d, main = _complete(p_contemporaneous_distances(trajectories, grid_points))
    keep = set(main.tolist())
    trash = [tr.traj_id for i, tr in enumerate(trajectories) if i not in keep]
    members = [trajectories[i] for i in main.tolist()]
    if len(members) < k:
        return KDeltaResult((), (), (), tuple(tr.traj_id for tr in trajectories), n_in, limit)
    published: list[Trajectory] = []
    originals: list[Trajectory] = []
    groups: list[tuple[int, ...]] = []
    for g in mdav_groups(d, k):
        sub = d[np.ix_(g, g)]
        times = members[int(g[np.argmin(sub.sum(axis=1))])].t
        at = [members[i].at(times) for i in g.tolist()]
        mean_lat, mean_lon = from_unit(sum((to_unit(la, lo) for la, lo in at), np.zeros((len(times), 3))))
        start = len(published)
        for i, (la, lo) in zip(g.tolist(), at, strict=True):
            tid = members[i].traj_id
            originals.append(Trajectory(tid, times, la, lo))
            published.append(Trajectory(tid, times, mean_lat, mean_lon))
        groups.append(tuple(range(start, len(published))))
    return KDeltaResult(tuple(published), tuple(originals), tuple(groups), tuple(trash), n_in, limit)


__all__ = ["mdav_groups", "microaggregate", "p_contemporaneous_distances"]
