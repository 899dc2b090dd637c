"""Trajectory microaggregation baseline (Domingo-Ferrer & Trujillo-Rasua, Inf. Sci. 2012; CONCEPTS §7.5).

MDAV (§8.10) with the medoid for the centroid over the p-contemporaneity distance, then aggregation:
every member is replaced by its cluster's representative (the mean of the members, at the instants of
the cluster medoid), so each published group holds ≥ k identical trajectories (δ = 0 suffices).
Distances are evaluated on a common grid of ``grid_points`` instants over the data's time range ⚠
(the paper uses the union of both trajectories' timestamps inside their overlap). Pairs with
``p_ij = 0`` (or no common grid instant) get the shortest-path distance in the graph of comparable pairs
(CONCEPTS §7.5); comparable pairs keep their own distance.

The distance matrix is never built. MDAV asks, per round, for the medoid of the remaining trajectories,
the farthest one from it, the farthest from that and each seed's k − 1 nearest: every question is first
answered from fast distances (three matrix products over the resampled positions, :class:`_Fast`) that
come with a rigorous error bound, then the few candidates the bound cannot separate are re-evaluated with
the exact formula of :func:`p_contemporaneous_distances`. The decisions, hence the clusters, are those of
the straightforward dense algorithm (ties to the lowest index); medoid sums are exact (``math.fsum``), and sums
equal but for the rounding of shortest-path lengths (:data:`MEDOID_TIE_ATOL_M`) tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.sparse import coo_matrix, csr_matrix
from scipy.sparse.csgraph import dijkstra

from kcloak.core.geometry import EARTH_RADIUS_M
from kcloak.streams.kdelta import KDeltaResult, check_params, from_unit, to_unit, trash_limit
from kcloak.streams.trajectory import Trajectory

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B1 = npt.NDArray[np.bool_]

EPS = float(np.finfo(np.float64).eps)
ROW_BLOCK = 128
"""Rows per matrix-product block when a whole pass over the pairs is needed (bounds temporary memory)."""
MEDOID_TIE_RTOL = 1e-7
MEDOID_TIE_ATOL_M = 1e-3
"""Medoid sums within ``MEDOID_TIE_ATOL_M + MEDOID_TIE_RTOL·|smallest|`` of the smallest tie (lowest index wins).

Completed (shortest-path) distances are sums of edges, and two remaining trajectories can have equal sums
by the graph's shape alone (each reaches the other's neighbours through the other); how a sum of path
lengths rounds (the fast path sums edges rounded to 2⁻²⁰ m) is not a difference between them; nor is a
millimetre in a sum of distances between GPS positions.
"""


def _medoid_of(sums: list[float], ids: list[int]) -> int:
    """The lowest id among those whose exact sum ties with the smallest (:data:`MEDOID_TIE_ATOL_M`)."""
    best = min(sums)
    return min(i for i, v in zip(ids, sums, strict=True) if v <= best + _medoid_tie(best))


def _medoid_tie(best: float) -> float:
    return MEDOID_TIE_ATOL_M + MEDOID_TIE_RTOL * abs(best)


@dataclass(frozen=True, slots=True, eq=False)
class _Samples:
    """Trajectories resampled on the common grid: positions (metres, 3-D) and where each one is defined."""

    pos: F64  # (n, G, 3) EARTH_RADIUS_M · unit vector at each grid instant
    valid: B1  # (n, G) grid instant inside the trajectory's span
    s: F64
    e: F64
    dur: F64

    def take(self, rows: I64) -> _Samples:
        return _Samples(self.pos[rows], self.valid[rows], self.s[rows], self.e[rows], self.dur[rows])


def _resample(trajectories: Sequence[Trajectory], grid_points: int) -> _Samples:
    s = np.array([tr.t_start for tr in trajectories])
    e = np.array([tr.t_end for tr in trajectories])
    grid = np.linspace(s.min(), e.max(), grid_points)
    valid = (grid[None, :] >= s[:, None]) & (grid[None, :] <= e[:, None])
    pos = np.empty((len(trajectories), grid_points, 3))
    for i, tr in enumerate(trajectories):
        pos[i] = EARTH_RADIUS_M * to_unit(*tr.at(grid))
    return _Samples(pos, valid, s, e, np.maximum(e - s, 1e-9))


def _exact(sm: _Samples, i: int, cols: I64) -> F64:
    """Distances ``d(i, j)`` for ``j`` in ``cols`` by the reference formula (∞ when not comparable)."""
    both = sm.valid[i] & sm.valid[cols]
    count = both.sum(axis=1)
    overlap = np.minimum(sm.e[i], sm.e[cols]) - np.maximum(sm.s[i], sm.s[cols])
    p = np.minimum(overlap / sm.dur[i], overlap / sm.dur[cols])
    sq = np.where(both, ((sm.pos[cols] - sm.pos[i]) ** 2).sum(axis=2), 0.0).sum(axis=1)
    ok = (p > 0) & (count > 0)
    out = np.full(len(cols), np.inf)
    out[ok] = np.sqrt(sq[ok]) / count[ok] / p[ok]
    out[cols == i] = 0.0
    return out


def p_contemporaneous_distances(trajectories: Sequence[Trajectory], grid_points: int = 64) -> F64:
    """Matrix of ``d_ij = (1/p_ij) · sqrt(Σ_t |τ_i(t) − τ_j(t)|²) / |O_ij|`` (metres; ∞ when not comparable).

    The dense reference (O(n²) memory): the algorithm itself evaluates the same formula pair by pair.
    """
    sm = _resample(trajectories, grid_points)
    n = len(trajectories)
    everyone = np.arange(n, dtype=np.int64)
    return np.stack([_exact(sm, i, everyone) for i in range(n)]) if n else np.zeros((0, 0))


def _product(a: F64, b: F64) -> F64:
    """``a @ b.T``; a few rows go as matrix–vector products (a threaded BLAS is slow on tiny products)."""
    if len(a) <= 16:
        return np.stack([b @ row for row in a]) if len(a) else np.zeros((0, len(b)))
    out: F64 = a @ b.T
    return out


@dataclass(frozen=True, slots=True, eq=False)
class _Cols:
    """Column side of :meth:`_Fast.rows` for a fixed set of columns."""

    idx: I64
    right: F64
    x: F64
    s: F64
    e: F64
    dur: F64
    lo: I64
    hi: I64


class _Fast:
    """Distances from a few rows to many columns by matrix products, each with an error bound.

    With masked, centred positions ``x``, ``Σ_t m_i m_j |x_i − x_j|² = P_ij − 2 X_ij`` where
    ``P = Q_i·V_j + V_i·Q_j`` (``Q`` = masked squared norms, ``V`` = masks) and ``X_ij = x_i·x_j``. A dot
    product of length m errs by at most ``m·ε·Σ|terms|`` and ``2|X_ij| ≤ P_ij``, so the computed sum errs
    by at most ``(5G + 4)·ε·P_ij``; the bound also covers centring and the reference formula's own rounding.
    Pairs that are not comparable read their completed (shortest-path) value from ``completion``.
    """

    def __init__(self, sm: _Samples, completion: csr_matrix | None) -> None:
        self.sm = sm
        n, g, _ = sm.pos.shape
        self.g = g
        v = sm.valid.astype(np.float64)
        ref = sm.pos[sm.valid].mean(axis=0) if sm.valid.any() else np.zeros(3)
        x = np.where(sm.valid[..., None], sm.pos - ref, 0.0)
        q = (x**2).sum(axis=2)
        self.left = np.ascontiguousarray(np.concatenate([q, v], axis=1))
        self.right = np.ascontiguousarray(np.concatenate([v, q], axis=1))
        self.x = np.ascontiguousarray(x.reshape(n, 3 * g))
        self.big = float(np.abs(sm.pos).max() + np.abs(ref).max()) if n else 0.0
        idx = np.flatnonzero(sm.valid.any(axis=1))
        self.lo = np.full(n, g, np.int64)
        self.hi = np.full(n, -1, np.int64)
        self.lo[idx] = sm.valid[idx].argmax(axis=1)
        self.hi[idx] = g - 1 - sm.valid[idx, ::-1].argmax(axis=1)
        self.completion = completion

    def columns(self, cols: I64) -> _Cols:
        """Contiguous copies of what :meth:`rows` reads of ``cols`` (reuse them across many calls)."""
        sm = self.sm
        return _Cols(
            cols,
            np.ascontiguousarray(self.right[cols]),
            np.ascontiguousarray(self.x[cols]),
            sm.s[cols],
            sm.e[cols],
            sm.dur[cols],
            self.lo[cols],
            self.hi[cols],
        )

    def distances(self, rows: I64, cols: _Cols) -> F64:
        """The fast distances of :meth:`rows` without their error bound (for the medoid sums' updates)."""
        sm = self.sm
        sq = np.maximum(_product(self.left[rows], cols.right) - 2.0 * _product(self.x[rows], cols.x), 0.0)
        count = np.minimum(self.hi[rows][:, None], cols.hi[None, :])
        count = np.maximum(count - np.maximum(self.lo[rows][:, None], cols.lo[None, :]) + 1, 0)
        overlap = np.minimum(sm.e[rows][:, None], cols.e[None, :]) - np.maximum(sm.s[rows][:, None], cols.s[None, :])
        p = np.minimum(overlap / sm.dur[rows][:, None], overlap / cols.dur[None, :])
        ok = (p > 0) & (count > 0)
        d: F64 = np.where(ok, np.sqrt(sq) / np.where(ok, count * p, 1.0), np.inf)
        same = rows[:, None] == cols.idx[None, :]
        d[same] = 0.0
        if self.completion is not None and not ok.all():
            self._complete(rows, cols.idx, ok | same, d, np.zeros_like(d))
        return d

    def rows(self, rows: I64, cols: I64 | _Cols) -> tuple[F64, F64]:
        """``(d, err)`` of shape ``(len(rows), len(cols))`` with ``|d − d_exact| ≤ err``."""
        sm = self.sm
        c = cols if isinstance(cols, _Cols) else self.columns(cols)
        p_mat = _product(self.left[rows], c.right)
        sq = np.maximum(p_mat - 2.0 * _product(self.x[rows], c.x), 0.0)
        bound = 2.0 * (5 * self.g + 4) * EPS * p_mat
        count = np.minimum(self.hi[rows][:, None], c.hi[None, :])
        count = np.maximum(count - np.maximum(self.lo[rows][:, None], c.lo[None, :]) + 1, 0)
        overlap = np.minimum(sm.e[rows][:, None], c.e[None, :]) - np.maximum(sm.s[rows][:, None], c.s[None, :])
        p = np.minimum(overlap / sm.dur[rows][:, None], overlap / c.dur[None, :])
        ok = (p > 0) & (count > 0)
        scale = np.where(ok, 1.0 / np.where(ok, count * p, 1.0), 0.0)
        root = np.sqrt(sq)
        dsq = np.minimum(np.sqrt(bound), bound / np.maximum(root, 1e-300))
        d = np.where(ok, root * scale, np.inf)
        err = (dsq + 8.0 * EPS * self.big * np.sqrt(3.0 * count)) * scale * (1.0 + 1e-9)
        err += 2.0 * (3 * self.g + 16) * EPS * np.where(ok, d, 0.0) + 1e-300
        same = rows[:, None] == c.idx[None, :]
        d[same] = 0.0
        err[same] = 0.0
        if self.completion is not None and not ok.all():
            self._complete(rows, c.idx, ok | same, d, err)
        return d, err

    def _complete(self, rows: I64, cols: I64, ok: B1, d: F64, err: F64) -> None:
        assert self.completion is not None
        where = np.full(len(self.sm.s), -1, np.int64)
        where[cols] = np.arange(len(cols))
        for a, r in enumerate(rows.tolist()):
            lo, hi = self.completion.indptr[r], self.completion.indptr[r + 1]
            js = where[self.completion.indices[lo:hi]]
            vals = self.completion.data[lo:hi]
            keep = js >= 0
            js, vals = js[keep], vals[keep]
            sel = ~ok[a, js]
            d[a, js[sel]] = vals[sel]
            err[a, js[sel]] = 1e-9 * vals[sel] + 1e-9

    def exact(self, i: int, cols: I64) -> F64:
        """Exact distances (reference formula; the completed value where not comparable)."""
        out = _exact(self.sm, i, cols)
        if self.completion is not None:
            bad = np.flatnonzero(np.isinf(out))
            if len(bad):
                out[bad] = np.asarray(self.completion[i, cols[bad]].toarray()).ravel()
        return out


def _components(fast: _Fast) -> I64:
    """Members of the largest connected component of comparable pairs (ties: the one with the lowest index).

    Breadth-first search where a node's neighbours are all remaining nodes minus its incomparable ones.
    """
    n = len(fast.sm.s)
    labels = np.full(n, -1, np.int64)
    label = 0
    everyone = np.arange(n, dtype=np.int64)
    for start in range(n):
        if labels[start] >= 0:
            continue
        labels[start] = label
        frontier = [start]
        while frontier:
            rest = np.flatnonzero(labels < 0)
            if not len(rest):
                break
            reach = np.zeros(len(rest), bool)
            for block in range(0, len(frontier), ROW_BLOCK):
                f = np.array(frontier[block : block + ROW_BLOCK], np.int64)
                reach |= _comparable(fast, f, rest).any(axis=0)
            frontier = rest[reach].tolist()
            labels[rest[reach]] = label
        label += 1
    main: I64 = everyone[labels == np.bincount(labels).argmax()]
    return main


def _comparable(fast: _Fast, rows: I64, cols: I64) -> B1:
    sm = fast.sm
    count = np.minimum(fast.hi[rows][:, None], fast.hi[cols][None, :]) - np.maximum(
        fast.lo[rows][:, None], fast.lo[cols][None, :]
    )
    overlap = np.minimum(sm.e[rows][:, None], sm.e[cols][None, :]) - np.maximum(
        sm.s[rows][:, None], sm.s[cols][None, :]
    )
    p = np.minimum(overlap / sm.dur[rows][:, None], overlap / sm.dur[cols][None, :])
    out: B1 = (p > 0) & (count >= 0)
    return out


_WEIGHT_SCALE = float(2**20)
"""Edge weights of the completion graph are multiples of 2⁻²⁰ m (about 1 µm)."""


def _completion(fast: _Fast) -> csr_matrix | None:
    """Shortest-path distances for the incomparable pairs (CONCEPTS §7.5), or ``None`` when there are none.

    Dijkstra runs only from a vertex cover of the incomparable pairs (greedy, highest degree first).
    Its edge weights are the fast distances rounded to multiples of 2⁻²⁰ m, so every path length is
    an exact sum: the same from either end, and the same to identical trajectories (unrounded,
    the matrix product's last bit depends on a column's position, and such ties broke differently).
    """
    n = len(fast.sm.s)
    everyone = np.arange(n, dtype=np.int64)
    bad_r: list[I64] = []
    bad_c: list[I64] = []
    for a in range(0, n, ROW_BLOCK):
        rows = everyone[a : a + ROW_BLOCK]
        r, c = np.nonzero(~_comparable(fast, rows, everyone))
        keep = rows[r] != c
        bad_r.append(rows[r[keep]])
        bad_c.append(c[keep])
    ri, ci = np.concatenate(bad_r), np.concatenate(bad_c)
    if not len(ri):
        return None
    cover = _vertex_cover(ri, ci, n)
    deg = np.zeros(n, np.int64)
    for a in range(0, n, ROW_BLOCK):
        rows = everyone[a : a + ROW_BLOCK]
        deg[rows] = _comparable(fast, rows, everyone).sum(axis=1) - 1  # no self loops
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(deg, out=indptr[1:])
    data = np.empty(int(indptr[-1]))
    indices = np.empty(int(indptr[-1]), np.int32)
    columns = fast.columns(everyone)
    for a in range(0, n, ROW_BLOCK):
        rows = everyone[a : a + ROW_BLOCK]
        d = fast.distances(rows, columns)
        r, c = np.nonzero(np.isfinite(d) & (rows[:, None] != everyone[None, :]))
        data[indptr[a] : indptr[a + len(rows)]] = np.round(d[r, c] * _WEIGHT_SCALE) / _WEIGHT_SCALE
        indices[indptr[a] : indptr[a + len(rows)]] = c
    graph = csr_matrix((data, indices, indptr), shape=(n, n))
    del data, indices
    sp = np.asarray(dijkstra(graph, directed=True, indices=cover), dtype=np.float64)
    del graph
    where = np.full(n, -1, np.int64)
    where[cover] = np.arange(len(cover))
    use = where[ri] >= 0
    vals = np.where(use, sp[np.maximum(where[ri], 0), ci], sp[np.maximum(where[ci], 0), ri])
    out = coo_matrix((vals, (ri, ci)), shape=(n, n)).tocsr()
    out.sum_duplicates()
    # The exact distances are symmetric and equal for identical trajectories; rounding alone does not give
    # the completed values that (a fast distance just below a rounding boundary in one row, just above it
    # in its twin's, made the twins' medoid sums differ: the dense algorithm ties them, lowest index first).
    # So every incomparable pair reads the value of its canonical pair: (lowest, highest) representative.
    rep = _representatives(fast.sm)
    lo, hi = np.minimum(rep[ri], rep[ci]), np.maximum(rep[ri], rep[ci])
    canon = coo_matrix((np.asarray(out[lo, hi]).ravel(), (ri, ci)), shape=(n, n)).tocsr()
    canon.sum_duplicates()
    return canon


def _representatives(sm: _Samples) -> I64:
    """For each trajectory, the lowest index of those with identical samples (the same distances to all)."""
    n = len(sm.s)
    key = np.ascontiguousarray(
        np.concatenate([sm.pos.reshape(n, -1), sm.valid.astype(np.float64), sm.s[:, None], sm.e[:, None]], axis=1)
    )
    rows = key.view(np.dtype((np.void, key.shape[1] * key.itemsize))).ravel()  # bytes: NaN equals NaN
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    rep: I64 = first[inverse.ravel()].astype(np.int64)
    return rep


def _vertex_cover(ri: I64, ci: I64, n: int) -> I64:
    """A vertex cover of the (symmetric) pair list: repeatedly the node with the most uncovered pairs."""
    deg = np.bincount(ri, minlength=n)
    adj = csr_matrix((np.ones(len(ri)), (ri, ci)), shape=(n, n)).tocsr()
    covered = np.zeros(n, bool)
    cover: list[int] = []
    while deg.max() > 0:
        v = int(deg.argmax())
        cover.append(v)
        covered[v] = True
        deg[v] = 0
        nb = adj.indices[adj.indptr[v] : adj.indptr[v + 1]]
        nb = nb[~covered[nb]]
        deg[nb] -= 1
    return np.array(sorted(cover), np.int64)


class _Mdav:
    """MDAV (§8.10) on :class:`_Fast` distances with exact decisions (filter by bound, refine exactly)."""

    def __init__(self, fast: _Fast, k: int) -> None:
        self.fast = fast
        self.k = k
        n = len(fast.sm.s)
        self.alive = np.ones(n, bool)
        self.cols = fast.columns(np.arange(n, dtype=np.int64))  # compacted superset of the alive rows
        self.row_sum = np.zeros(n)
        self.row_err = np.zeros(n)
        for a in range(0, n, ROW_BLOCK):
            rows = self.cols.idx[a : a + ROW_BLOCK]
            d, err = fast.rows(rows, self.cols)
            self.row_sum[rows] = d.sum(axis=1)
            self.row_err[rows] = 3.0 * err.sum(axis=1) + 8.0 * n * EPS * self.row_sum[rows]
        self.groups: list[I64] = []

    def _live(self) -> B1:
        """Which of the current columns are alive (compacting the columns when a fifth are gone)."""
        live = self.alive[self.cols.idx]
        if np.count_nonzero(live) < 0.8 * len(live):
            self.cols = self.fast.columns(np.flatnonzero(self.alive).astype(np.int64))
            live = np.ones(len(self.cols.idx), bool)
        return live

    def medoid(self) -> int:
        cand = self.cols.idx[self._live()]
        lo = self.row_sum[cand] - self.row_err[cand]
        hi = self.row_sum[cand] + self.row_err[cand]
        top = hi.min()
        close = cand[lo <= top + _medoid_tie(top)]
        if len(close) == 1:
            return int(close[0])
        sums = [math.fsum(self.fast.exact(int(i), cand).tolist()) for i in close.tolist()]
        return _medoid_of(sums, close.tolist())

    def farthest(self, src: int) -> int:
        live = self._live()
        cand = self.cols.idx[live]
        d, err = self.fast.rows(np.array([src], np.int64), self.cols)
        dv, ev = d[0, live], err[0, live]
        close = cand[dv + ev >= (dv - ev).max()]
        if len(close) == 1:
            return int(close[0])
        return int(close[int(np.argmax(self.fast.exact(src, close)))])

    def take(self, seed: int) -> None:
        live = self._live()
        cand = self.cols.idx[live]
        k = self.k
        d, err = self.fast.rows(np.array([seed], np.int64), self.cols)
        dv, ev = d[0, live], err[0, live]
        upper = np.partition(dv + ev, k - 1)[k - 1]
        close = cand[dv - ev <= upper]
        g = close[np.argsort(self.fast.exact(seed, close), kind="stable")[:k]]
        if seed not in g:
            g = np.r_[seed, g[: k - 1]]
        self.alive[g] = False
        live = self._live()
        self.row_sum[self.cols.idx[live]] -= self.fast.distances(g, self.cols)[:, live].sum(axis=0)
        self.groups.append(g.astype(np.int64))

    def run(self) -> list[I64]:
        k = self.k
        while np.count_nonzero(self.alive) >= 3 * k:
            r = self.farthest(self.medoid())
            self.take(r)
            self.take(self.farthest(r))
        if np.count_nonzero(self.alive) >= 2 * k:
            self.take(self.farthest(self.medoid()))
        if np.any(self.alive):
            self.groups.append(np.flatnonzero(self.alive).astype(np.int64))
        return self.groups


def mdav_groups(d: F64, k: int) -> list[I64]:
    """MDAV (§8.10) on a dense distance matrix, with the medoid of the remaining records as their centroid.

    The dense statement of the clustering :func:`microaggregate` performs (§7.5 ⚠): the medoid minimizes the
    exact (``math.fsum``) sum of distances to the remaining records (sums within :data:`MEDOID_TIE_ATOL_M` tie); ties
    go to the lowest index everywhere.
    """
    n = len(d)
    alive = np.ones(n, bool)
    groups: list[I64] = []

    def take(seed: int) -> None:
        cand = np.flatnonzero(alive)
        g = cand[np.argsort(d[seed, cand], kind="stable")[:k]]
        if seed not in g:
            g = np.r_[seed, g[: k - 1]]
        alive[g] = False
        groups.append(g.astype(np.int64))

    def farthest(src: int) -> int:
        cand = np.flatnonzero(alive)
        return int(cand[np.argmax(d[src, cand])])

    def medoid() -> int:
        cand = np.flatnonzero(alive)
        return _medoid_of([math.fsum(d[i, cand].tolist()) for i in cand.tolist()], cand.tolist())

    while np.count_nonzero(alive) >= 3 * k:
        r = farthest(medoid())
        take(r)
        take(farthest(r))
    if np.count_nonzero(alive) >= 2 * k:
        take(farthest(medoid()))
    if np.any(alive):
        groups.append(np.flatnonzero(alive).astype(np.int64))
    return groups


def cluster(trajectories: Sequence[Trajectory], k: int, grid_points: int = 64) -> tuple[I64, list[I64]]:
    """The largest comparable component (indices into ``trajectories``) and its MDAV groups (indices into it).

    The groups are those :func:`mdav_groups` finds on the completed dense matrix of the component.
    """
    main, groups, _ = _cluster(trajectories, k, grid_points)
    return main, groups


def _cluster(trajectories: Sequence[Trajectory], k: int, grid_points: int) -> tuple[I64, list[I64], _Fast]:
    fast = _Fast(_resample(trajectories, grid_points), None)
    main = _components(fast)
    fast = _Fast(fast.sm.take(main), None)
    fast.completion = _completion(fast)
    if len(main) < k:
        return main, [], fast
    return main, _Mdav(fast, k).run(), fast


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
    main, mdav, fast = _cluster(trajectories, k, grid_points)
    keep = set(main.tolist())
    trash = [tr.traj_id for i, tr in enumerate(trajectories) if i not in keep]
    members = [trajectories[i] for i in main.tolist()]
    if len(members) < k:
        return KDeltaResult((), (), (), tuple(tr.traj_id for tr in trajectories), n_in, limit)
    published: list[Trajectory] = []
    originals: list[Trajectory] = []
    groups: list[tuple[int, ...]] = []
    for g in mdav:
        sub = np.stack([fast.exact(int(i), g) for i in g.tolist()])
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


__all__ = ["cluster", "mdav_groups", "microaggregate", "p_contemporaneous_distances"]
