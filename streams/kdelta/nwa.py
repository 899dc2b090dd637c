"""Never Walk Alone (Abul, Bonchi, Nanni, ICDE 2008; CONCEPTS §7.3).

Three phases: equivalence classes of equal time span after trimming to the granularity ``pi_s``,
greedy pivot clustering under a radius bound with a trash, and space translation of each cluster into
a cylinder of diameter δ. Distances between synchronized trajectories are the root-sum-square of the
pointwise distances in an AEQD frame of the class (§2.1 rule 2); the k nearest neighbours of a pivot
are found through a k-d tree on piecewise-aggregate summaries whose distance never exceeds the true
one, so the search is exact and large classes stay tractable. The translation itself is done on the
contract sphere, which the checker uses, so the δ guarantee needs no frame slack.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.spatial import cKDTree

from kcloak.core.geometry import EARTH_RADIUS_M, Aeqd
from kcloak.streams.kdelta import (
    KDeltaResult,
    SmallClass,
    TrashReason,
    angle_between,
    check_params,
    from_unit,
    to_unit,
    trash_limit,
)
from kcloak.streams.trajectory import Trajectory

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

PAA_SEGMENTS = 8
"""Summary segments per coordinate for the k-d tree lower bound (dimension 2 × this)."""

DELTA_MARGIN_M = 1e-6
"""Published radius is ``δ/2 − margin``: absorbs float rounding so haversine never exceeds δ."""


# -- phase 1: classes -------------------------------------------------------------------------
def trimmed_span(t_start: float, t_end: float, pi_s: float) -> tuple[float, float]:
    """Span rounded inwards to multiples of ``pi_s`` (§7.3 ⚠); empty when ``a >= b``."""
    return math.ceil(t_start / pi_s) * pi_s, math.floor(t_end / pi_s) * pi_s


def sample_instants(a: float, b: float, step_s: float) -> F64:
    """``a, a+step, …`` up to ``b``, with ``b`` always the last instant."""
    n = math.floor((b - a) / step_s + 1e-9)
    t = a + step_s * np.arange(n + 1, dtype=np.float64)
    if t[-1] < b - 1e-9 * max(1.0, abs(b)):
        t = np.append(t, b)
    t[-1] = b
    return t


# -- phase 3: space translation ---------------------------------------------------------------
def space_translate(lat: F64, lon: F64, radius_m: float) -> tuple[F64, F64, F64]:
    """Move every member (rows) at every instant (columns) onto the disc of ``radius_m`` around the centre.

    The centre per instant is the (spherical) centroid (§7.3 ⚠); a point farther than the radius moves
    along the great circle to the nearest point of the disc, the cheapest move for that centre. Returns
    the new ``lat``, ``lon`` and the distance each point moved (metres).
    """
    u = to_unit(lat, lon)  # (c, m, 3)
    centre = u.sum(axis=0)
    centre /= np.linalg.norm(centre, axis=-1, keepdims=True)
    c = np.broadcast_to(centre, u.shape)
    theta = angle_between(u, c)  # (c, m)
    alpha = max(radius_m, 0.0) / EARTH_RADIUS_M
    move = theta > alpha
    out = u.copy()
    if np.any(move):
        th = theta[move][:, None]
        sin_th = np.sin(th)
        out[move] = (np.sin(th - alpha) * c[move] + math.sin(alpha) * u[move]) / sin_th
    new_lat, new_lon = from_unit(out)
    new_lat = np.where(move, new_lat, lat)
    new_lon = np.where(move, new_lon, lon)
    cost = np.where(move, (theta - alpha) * EARTH_RADIUS_M, 0.0)
    return new_lat, new_lon, cost


# -- phase 2: greedy clustering ---------------------------------------------------------------
def _summaries(X: F64, m: int) -> tuple[F64, F64]:
    """Piecewise-aggregate summaries ``z`` and residual norms of the rows of ``X`` (``m`` instants × (x, y)).

    ``z`` holds the orthonormal coordinates of each row's projection on the piecewise-constant
    trajectories, so ``X_p·X_q = z_p·z_q + R_p·R_q`` with ``|R_p·R_q| ≤ ‖R_p‖‖R_q‖`` (residuals ``R``).
    """
    X2 = np.atleast_2d(X)
    n = len(X2)
    pts = X2.reshape(n, m, 2)
    zs: list[F64] = []
    r2 = np.zeros(n)
    for s in np.array_split(np.arange(m), min(PAA_SEGMENTS, m)):
        seg = pts[:, s, :]
        mean = seg.mean(axis=1)
        zs.append(math.sqrt(len(s)) * mean)
        r2 += ((seg - mean[:, None, :]) ** 2).sum(axis=(1, 2))
    return np.concatenate(zs, axis=1), np.sqrt(r2)


class _Neighbours:
    """Exact k-nearest-neighbour search among the still unclustered rows of ``X`` (RSS distance).

    A k-d tree over piecewise-aggregate summaries ``z`` (``|z_p − z_q| ≤ D(p, q)``) proposes
    candidates in order of a lower bound; the search stops once the k-th true distance is no larger
    than the bound of the next candidate. The tree is rebuilt when half of its rows are gone.
    """

    def __init__(self, X: F64, m: int, z: F64 | None = None, alive: npt.NDArray[np.bool_] | None = None) -> None:
        self.X = X
        n = len(X)
        self.z = _summaries(X, m)[0] if z is None else z
        self.alive = np.ones(n, bool) if alive is None else alive.copy()
        self.n_alive = int(np.count_nonzero(self.alive))
        self._rebuild()

    def _rebuild(self) -> None:
        self.rows = np.flatnonzero(self.alive)
        self.tree = cKDTree(self.z[self.rows])

    def remove(self, rows: npt.ArrayLike) -> None:
        r = np.atleast_1d(np.asarray(rows, dtype=np.int64))
        self.alive[r] = False
        self.n_alive = int(np.count_nonzero(self.alive))
        if 0 < self.n_alive < len(self.rows) // 2:
            self._rebuild()

    def knn(self, p: int, kk: int) -> tuple[I64, F64]:
        """The ``kk`` nearest alive rows to row ``p`` (excluding ``p``) and their distances, nearest first."""
        size = len(self.rows)
        q = min(size, 2 * kk + 8)
        while True:
            dz, j = self.tree.query(self.z[p], k=q)
            dz, j = np.atleast_1d(dz), np.atleast_1d(j)
            rows = self.rows[j]
            cand = rows[self.alive[rows] & (rows != p)]
            if len(cand) >= kk or q >= size:
                d = np.linalg.norm(self.X[cand] - self.X[p], axis=1)
                order = np.argsort(d, kind="stable")[:kk]
                if q >= size or d[order[-1]] <= dz[-1]:
                    return cand[order], d[order]
            q = min(size, 4 * q)


class _Farthest:
    """Exact farthest alive row from a reference trajectory, pruned by summary bounds (§7.3 pivot choice).

    ``‖X_i − ref‖² = sq_i − 2 X_i·ref + const`` and ``X_i·ref`` lies within ``‖R_i‖‖R_ref‖`` (plus a
    rounding allowance) of ``z_i·z_ref``; only rows whose upper bound reaches the best lower bound are
    measured exactly. The summary columns are compacted when half of them are dead.
    """

    def __init__(self, X: F64, m: int, z: F64, rnorm: F64, sq: F64, alive: npt.NDArray[np.bool_]) -> None:
        self.X, self.m, self.z, self.rnorm, self.sq, self.alive = X, m, z, rnorm, sq, alive
        self._compact()

    def _compact(self) -> None:
        self.idx = np.flatnonzero(self.alive)
        self.zc, self.rc, self.sqc = self.z[self.idx], self.rnorm[self.idx], self.sq[self.idx]

    def __call__(self, ref: F64, z_ref: F64, r_ref: float, n_alive: int) -> int:
        if len(self.idx) > 2 * n_alive:
            self._compact()
        sq_ref = float(ref @ ref)
        base = self.sqc - 2.0 * (self.zc @ z_ref)
        slack = 2.0 * self.rc * r_ref + 1e-9 * (self.sqc + sq_ref) + 1e-9
        live = self.alive[self.idx]
        lower = np.where(live, base - slack, -np.inf)
        cand = self.idx[live & (base + slack >= lower.max())]
        d2 = self.sq[cand] - 2.0 * np.einsum("ij,j->i", self.X[cand], ref)
        return int(cand[int(np.argmax(d2))])


@dataclass(frozen=True, slots=True)
class Step:
    """One pivot of a greedy run: the pivot, its (k−1)-th neighbour distance and the rows it removed."""

    pivot: int
    dist: float
    removed: I64


def replay_runs(
    runs: Sequence[tuple[float, Sequence[Step]]], max_radius: float, n: int
) -> tuple[list[Step], npt.NDArray[np.bool_], list[I64], list[int]]:
    """The longest recorded run prefix that ``max_radius`` would repeat, and the state it leaves.

    Returns ``(steps, alive, clusters, trash)``: two radii make the same choices up to the first pivot
    whose (k−1)-th neighbour distance lies between them. Shared by NWA's and W4M's greedy clustering.
    """
    steps: list[Step] = []
    for radius, log in runs:
        same = 0
        for s in log:
            if (s.dist > radius) != (s.dist > max_radius):
                break
            same += 1
        if same > len(steps):
            steps = list(log[:same])
    alive = np.ones(n, bool)
    clusters: list[I64] = []
    trash: list[int] = []
    for s in steps:
        alive[s.removed] = False
        if s.dist > max_radius:
            trash.append(s.pivot)
        else:
            clusters.append(s.removed)
    return steps, alive, clusters, trash


def greedy_step(
    pivot: int,
    near: I64,
    dist: F64,
    max_radius: float,
    steps: list[Step],
    clusters: list[I64],
    trash: list[int],
) -> I64:
    """Record one step of the greedy clustering (§7.3) and return the rows it removes: the pivot and
    its k−1 nearest (``near``, ascending ``dist``) form a cluster when the farthest of them lies
    within ``max_radius``; otherwise the pivot alone goes to the trash. Shared by NWA and W4M, and
    the rule :func:`replay_runs` replays."""
    d_last = float(dist[-1]) if len(dist) else 0.0
    if d_last > max_radius:
        trash.append(pivot)
        removed = np.array([pivot], dtype=np.int64)
    else:
        removed = np.r_[pivot, near].astype(np.int64)
        clusters.append(removed)
    steps.append(Step(pivot, d_last, removed))
    return removed


class _Greedy:
    """NWA's greedy clustering on one class, able to replay the common prefix of an earlier run (§7.3).

    Two radii make the same choices up to the first pivot whose (k−1)-th neighbour distance lies
    between them, so a run resumes from the recorded run that agrees longest with the new radius.
    """

    def __init__(self, X: F64, m: int, k: int) -> None:
        self.X, self.m, self.k = X, m, k
        self.z, self.rnorm = _summaries(X, m)
        self.sq = np.einsum("ij,ij->i", X, X)
        self.runs: list[tuple[float, list[Step]]] = []

    def run(self, max_radius: float) -> tuple[list[I64], I64]:
        """Clusters (pivot first) and trashed rows for ``max_radius``."""
        X, k = self.X, self.k
        n = len(X)
        if n < k:
            return [], np.arange(n, dtype=np.int64)
        steps, alive, clusters, trash = replay_runs(self.runs, max_radius, n)
        if steps:
            ref = X[steps[-1].pivot]
            z_ref, r_ref = self.z[steps[-1].pivot], float(self.rnorm[steps[-1].pivot])
        else:
            ref = X.mean(axis=0)
            zr, rr = _summaries(ref, self.m)
            z_ref, r_ref = zr[0], float(rr[0])
        nb = _Neighbours(X, self.m, self.z, alive)
        far = _Farthest(X, self.m, self.z, self.rnorm, self.sq, nb.alive)
        while nb.n_alive >= k:
            p = far(ref, z_ref, r_ref, nb.n_alive)
            near, dist = nb.knn(p, k - 1)
            ref, z_ref, r_ref = X[p], self.z[p], float(self.rnorm[p])
            nb.remove(greedy_step(p, near, dist, max_radius, steps, clusters, trash))
        self.runs.append((max_radius, steps))
        left = np.flatnonzero(nb.alive)
        if len(left):
            if clusters:
                pivots = X[[c[0] for c in clusters]]
                extra: dict[int, list[int]] = defaultdict(list)
                for r in left.tolist():
                    d = np.linalg.norm(pivots - X[r], axis=1)
                    best = int(np.argmin(d))
                    if d[best] <= max_radius:
                        extra[best].append(r)
                    else:
                        trash.append(r)
                for ci, rows in extra.items():
                    clusters[ci] = np.r_[clusters[ci], rows].astype(np.int64)
            else:
                trash.extend(left.tolist())
        return clusters, np.array(sorted(trash), dtype=np.int64)


def greedy_clusters(X: F64, m: int, k: int, max_radius: float) -> tuple[list[I64], I64]:
    """NWA's greedy clustering (§7.3 ⚠): farthest pivot from the previous one, its k−1 nearest, radius bound.

    ``X`` holds one synchronized trajectory per row (``m`` instants × (x, y) in metres). Returns the
    clusters (row indices, pivot first) and the trashed rows.
    """
    return _Greedy(X, m, k).run(max_radius)


def _search_radius(X: F64, m: int, k: int, max_trash: int) -> tuple[float, list[I64], I64]:
    """:func:`choose_radius` with the clustering of the chosen radius.

    Candidates are the sorted (k−1)-NN distances and ∞ (always feasible: no trash when ``n ≥ k``). The
    bracket (infeasible ``lo``, feasible ``hi``) starts from the (1 − budget) quantile and shrinks by
    interpolating the trash counts, falling back to bisection whenever a probe fails to halve it; it ends
    on adjacent candidates, as a binary search does.
    """
    n = len(X)
    g = _Greedy(X, m, k)
    if n < k:
        return math.inf, *g.run(math.inf)
    nb = _Neighbours(X, m, g.z)
    knn_d = np.array([nb.knn(i, k - 1)[1][-1] for i in range(n)]) if k > 1 else np.zeros(n)
    cand = np.r_[np.unique(knn_d), np.inf]
    lo, hi = -1, len(cand) - 1
    t_lo, t_hi = float(n), 0.0
    best: tuple[list[I64], I64] | None = None
    q = 1.0 - max_trash / n
    probe = min(int(np.searchsorted(cand, float(np.quantile(knn_d, q)))), hi - 1)
    while hi - lo > 1:
        width = hi - lo
        result = g.run(float(cand[probe]))
        t = float(len(result[1]))
        if t <= max_trash:
            hi, t_hi, best = probe, t, result
        else:
            lo, t_lo = probe, t
        if hi - lo <= 1:
            break
        if 2 * (hi - lo) > width:
            probe = (lo + hi) // 2
        else:
            frac = (t_lo - (max_trash + 0.5)) / max(t_lo - t_hi, 1.0)
            probe = lo + round(frac * (hi - lo))
        probe = min(max(probe, lo + 1), hi - 1)
    if best is None:
        best = g.run(float(cand[hi]))
    return float(cand[hi]), *best


def choose_radius(X: F64, m: int, k: int, max_trash: int) -> float:
    """Smallest radius among the sorted (k−1)-NN distances whose trash stays ≤ ``max_trash`` (§7.3, bracketed)."""
    return _search_radius(X, m, k, max_trash)[0]


# -- the algorithm ----------------------------------------------------------------------------
def _class_frame(lat: F64, lon: F64) -> Aeqd:
    """AEQD frame centred on a class's samples (mean latitude, circular mean longitude)."""
    lam = np.radians(lon)
    lon0 = math.degrees(math.atan2(float(np.sin(lam).mean()), float(np.cos(lam).mean())))
    return Aeqd(float(lat.mean()), lon0)


def nwa(
    trajectories: Sequence[Trajectory],
    *,
    k: int,
    delta_m: float,
    pi_s: float = 60.0,
    step_s: float | None = None,
    trash_max: float = 0.1,
    max_radius: float | None = None,
    max_rms_m: float | None = None,
) -> KDeltaResult:
    """Anonymize ``trajectories`` (each ≥ 2 instants) into (k,δ)-anonymity sets with NWA (CONCEPTS §7.3).

    ``pi_s`` is the time granularity of the classes, ``step_s`` the resampling period (default
    ``pi_s``), ``max_radius`` the clustering radius in RSS metres (default ∞: no outlier trash);
    ``max_rms_m`` states it per instant instead (root-mean-square metres, ``× √m`` for a class of
    ``m`` instants; the smaller of the two applies).
    Published members of a cluster lie at every instant within ``δ/2`` (haversine) of a common centre,
    hence pairwise within ``δ``.

    Trash accounting (issue 16): ``trash_max`` bounds the trash over the whole input
    (``floor(trash_max · n_in)``); it is a limit, never a budget to spend. The trash is what the input
    forces — spans shorter than π, classes smaller than ``k`` — plus, within a class, only the
    trajectories the clustering cannot place within ``max_radius``. So the same input gives the same
    trash at any ``trash_max`` and raising the bound never raises the trash; the bound only decides
    whether the result may be published (:attr:`KDeltaResult.ok`). ``small_classes`` lists the classes
    smaller than ``k`` so that a refusal can say why.
    """
    check_params(k, delta_m, trash_max)
    if not (math.isfinite(pi_s) and pi_s > 0):
        raise ValueError("pi_s: must be a finite number > 0 (seconds)")
    step = pi_s if step_s is None else step_s
    if not (math.isfinite(step) and step > 0):
        raise ValueError("step_s: must be a finite number > 0 (seconds)")
    radius_pub = max(0.0, delta_m / 2.0 * (1.0 - 1e-9) - DELTA_MARGIN_M)

    if max_radius is not None and not max_radius >= 0:
        raise ValueError("max_radius: must be ≥ 0 (RSS metres)")
    if max_rms_m is not None and not max_rms_m >= 0:
        raise ValueError("max_rms_m: must be ≥ 0 (metres)")
    radius = math.inf if max_radius is None else float(max_radius)
    trash: list[str] = []
    n_short = n_small = n_outliers = 0
    small: list[SmallClass] = []
    classes: dict[tuple[float, float], list[Trajectory]] = defaultdict(list)
    for tr in trajectories:
        a, b = trimmed_span(tr.t_start, tr.t_end, pi_s)
        if a >= b:
            trash.append(tr.traj_id)
            n_short += 1
        else:
            classes[(a, b)].append(tr)

    published: list[Trajectory] = []
    originals: list[Trajectory] = []
    groups: list[tuple[int, ...]] = []
    for (a, b), members in sorted(classes.items()):
        if len(members) < k:
            trash.extend(tr.traj_id for tr in members)
            n_small += len(members)
            small.append(SmallClass(float(a), float(b), len(members)))
            continue
        times = sample_instants(a, b, step)
        m = len(times)
        lat = np.empty((len(members), m))
        lon = np.empty((len(members), m))
        for i, tr in enumerate(members):
            lat[i], lon[i] = tr.at(times)
        x, y = _class_frame(lat, lon).forward(lat, lon)
        X = np.stack([x, y], axis=-1).reshape(len(members), 2 * m)
        r_class = radius if max_rms_m is None else min(radius, max_rms_m * math.sqrt(m))
        clusters, left = greedy_clusters(X, m, k, r_class)
        trash.extend(members[i].traj_id for i in left.tolist())
        n_outliers += len(left)
        for rows in clusters:
            new_lat, new_lon, _ = space_translate(lat[rows], lon[rows], radius_pub)
            start = len(published)
            for j, r in enumerate(rows.tolist()):
                tid = members[r].traj_id
                originals.append(Trajectory(tid, times, lat[r], lon[r]))
                published.append(Trajectory(tid, times, new_lat[j], new_lon[j]))
            groups.append(tuple(range(start, len(published))))
    n_in = len(trajectories)
    return KDeltaResult(
        published=tuple(published),
        originals=tuple(originals),
        groups=tuple(groups),
        trash=tuple(trash),
        n_in=n_in,
        trash_limit=trash_limit(n_in, trash_max),
        trash_reasons=(
            (TrashReason.SPAN_SHORTER_THAN_PI, n_short),
            (TrashReason.CLASS_SMALLER_THAN_K, n_small),
            (TrashReason.BEYOND_RADIUS, n_outliers),
        ),
        small_classes=tuple(small),
    )


__all__ = ["choose_radius", "greedy_clusters", "nwa", "sample_instants", "space_translate", "trimmed_span"]
