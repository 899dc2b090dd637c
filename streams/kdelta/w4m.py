"""Wait For Me (Abul, Bonchi, Nanni, *Information Systems* 2010; CONCEPTS §7.4).

NWA (§7.3) needs equal time spans; W4M groups trajectories of any span and sampling rate with a
time-tolerant edit distance and then edits each cluster member in time *and* space:

* **Distance** (``distance``): ``edr`` — EDR (Chen, Özsu, Oria, SIGMOD 2005), two samples *match* iff
  ``|Δx| ≤ ε``, ``|Δy| ≤ ε`` (metres, AEQD frame of the data) and ``|Δt| ≤ τ``; substitution of a match
  costs 0, of a mismatch 1, insertions and deletions 1. ``lst`` — the linear spatio-temporal refinement
  ⚠: a match costs its normalized gap ``max(|Δx|/ε, |Δy|/ε, |Δt|/τ)`` instead of 0. Both are divided
  by ``max(|A|, |B|)``, so distances lie in [0, 1] and a pair without any match is exactly 1.
* **Bounds** (issue 16): a member is aligned with a pivot only when their starts and their ends differ by
  at most ``max_time_shift_s`` (so no published point is shifted by more), and only within the
  clustering radius ``max_radius`` (< 1: at least one match); trajectories that cannot be grouped within
  both are trash. Time-connected groups (spans widened by the shift bound) are anonymized separately.
* **Clustering**: NWA's greedy pivots with that radius bound and a trash (§7.3). EDR saturates at 1
  for every pair without a match, so the pivot sweep (farthest
  from the previous pivot) and ties at distance 1 use the distance between space–time centroids
  ``(x̄, ȳ, t̄·ε/τ)`` ⚠ [design].
* **Translation**: every member is aligned with its pivot along an optimal edit path; a member sample
  matched with a pivot sample takes the pivot's instant (time shift ≤ τ), unmatched member samples are
  deleted, and at pivot instants without a match the member's interpolated position is inserted (its
  source instant is the pivot instant clamped to the member's span). All members thus share the pivot's
  instants; NWA's space translation (:func:`kcloak.streams.kdelta.nwa.space_translate`) then puts them at every
  instant within δ/2 of the centroid, hence pairwise within δ (contract §7).

``originals[i]`` of the result holds, per published point, the source instant and the source position,
so ``Σ|t_out − t_in|`` (``time_distortion_s``) and the translation are measured from the result alone.

Complexity: the exact distance is an O(|A|·|B|) dynamic program, vectorized over batches of pairs
(numpy, row by row with a running minimum for the unit-cost insertions). It is evaluated only for
candidates that share at least one match with the pivot — found by a k-d tree over all samples in
``(x/ε, y/ε, t/τ)`` with the Chebyshev radius 1, i.e. exactly the match relation — in the order of the
lower bound ``max(|A| − M_A(B), ||A| − |B||) / max(|A|, |B|)`` (``M_A(B)``: samples of ``A`` with a
match in ``B``), stopping once the (k−1)-th exact distance is below the next bound, or after
``max_candidates`` (20) of them [design]; pairs without any match are at distance 1 without a DP. The
best-bounded candidates of every trajectory are evaluated up front in large batches. With ``n``
trajectories of ``L`` samples, ``N = n·L``: candidates O(n·L·log N) (tree queries), distances
O(n·c·L²) with ``c`` ≤ ``max_candidates``, a greedy run O(n/k · (n + c·L²)) (the pivot sweep scans
the alive summaries), the radius search O(log grid) runs on shrinking suffixes, the translation
O(n·L²).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.spatial import cKDTree

from kcloak.core.geometry import Aeqd
from kcloak.core.names import TrajectoryDistance
from kcloak.streams.kdelta import KDeltaError, KDeltaResult, SmallClass, TrashReason, check_params, trash_limit
from kcloak.streams.kdelta.nwa import DELTA_MARGIN_M, Step, greedy_step, replay_runs, space_translate
from kcloak.streams.trajectory import Trajectory

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]

DP_CELLS_PER_BATCH = 4_000_000
"""Cells (pairs × (|A|+1) × (|B|+1)) kept in memory by one batched alignment with traceback."""

DEFAULT_TAU_S = 60.0
"""Default time tolerance τ of a match (seconds) ⚠."""

DEFAULT_MAX_TIME_SHIFT_S = 3600.0
"""Default bound of any published point's time shift (seconds): an hour, longer than a live window ⚠."""

DEFAULT_MAX_RADIUS = 0.9
"""Default clustering radius on the normalized edit distance ⚠: a member must match at least a tenth of
the longer trajectory's samples within (ε, τ); beyond it a trajectory is trash, as in NWA."""

DEFAULT_MAX_CANDIDATES = 20
"""Exact distance evaluations per pivot: the candidates with the smallest lower bounds [design]."""


Distance = TrajectoryDistance
"""Time-tolerant trajectory distances of W4M (CONCEPTS §7.4), named in :mod:`kcloak.core.names`."""


@dataclass(frozen=True, slots=True, eq=False)
class W4MResult(KDeltaResult):
    """A :class:`KDeltaResult` plus W4M's edit counts (CONCEPTS §7.4 extra quality measures).

    ``originals[i].t`` are the source instants of ``published[i]``'s points (not necessarily increasing
    when inserted points are clamped to the member's span); ``radius`` is the clustering radius used.
    """

    n_inserted: int = 0
    n_deleted: int = 0
    radius: float = math.nan


# -- packed samples ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class _Packed:
    """Samples of every trajectory as padded rows: ``xyt[i, :length[i]]`` = (x m, y m, t s relative)."""

    xyt: F64  # (n, L, 3)
    xyt32: npt.NDArray[Any]  # the same for the edit distance: float32 unless times span over 2**20 s
    length: I64
    summary: F64  # (n, 3) space–time centroid (x̄, ȳ, t̄·ε/τ)


def _pack(trajectories: Sequence[Trajectory], eps: float, tau: float) -> _Packed:
    n = len(trajectories)
    lengths = np.array([len(tr) for tr in trajectories], dtype=np.int64)
    L = int(lengths.max())
    lat = np.concatenate([tr.lat for tr in trajectories])
    lon = np.concatenate([tr.lon for tr in trajectories])
    t = np.concatenate([tr.t for tr in trajectories])
    lam = np.radians(lon)
    lon0 = math.degrees(math.atan2(float(np.sin(lam).mean()), float(np.cos(lam).mean())))
    x, y = Aeqd(float(lat.mean()), lon0).forward(lat, lon)
    xyt = np.zeros((n, L, 3))
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(len(t)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    xyt[row, col, 0] = x
    xyt[row, col, 1] = y
    xyt[row, col, 2] = t - float(t.min())
    valid = np.arange(L)[None, :] < lengths[:, None]
    summary = (xyt * valid[..., None]).sum(axis=1) / lengths[:, None]
    summary[:, 2] *= eps / tau
    small = float(xyt[..., 2].max()) < 2.0**20 and float(np.abs(xyt[..., :2]).max()) < 2.0**20
    return _Packed(xyt, xyt.astype(np.float32) if small else xyt, lengths, summary)


# -- the edit distance ------------------------------------------------------------------------
def _sub_cost(p: npt.NDArray[Any], q: npt.NDArray[Any], eps: float, tau: float, kind: Distance) -> tuple[F32, Bool]:
    """Substitution cost (float32) and match flag of samples ``p`` (…, 3) against ``q`` (…, 3), broadcast."""
    ax = np.abs(q[..., 0] - p[..., 0])
    ay = np.abs(q[..., 1] - p[..., 1])
    at = np.abs(q[..., 2] - p[..., 2])
    match = (ax <= eps) & (ay <= eps) & (at <= tau)
    if kind is Distance.EDR:
        return (~match).astype(np.float32), match
    gap = np.maximum(np.maximum(ax, ay) / np.float32(eps), at / np.float32(tau))
    return np.where(match, gap, np.float32(1.0)).astype(np.float32), match


def _edit_rows(
    P: npt.NDArray[Any], lp: I64, Q: npt.NDArray[Any], lq: I64, eps: float, tau: float, kind: Distance, *, keep: bool
) -> tuple[F64, F64 | None]:
    """Edit distances (not normalized) of pairs ``(P[b], Q[b])``; with ``keep`` also every DP row.

    ``P`` is (1 or b, m, 3), ``Q`` (b, n, 3); rows beyond ``lp``/``lq`` are padding. Row ``i`` of the DP
    is ``D_i[j] = min(D_{i−1}[j−1] + s(i, j), D_{i−1}[j] + 1, D_i[j−1] + 1)``; the last, unit-cost term is a
    running minimum of ``E[j'] − j'`` plus ``j``, so a row is a few whole-array operations over the batch.
    """
    b, n = Q.shape[0], Q.shape[1]
    lp = np.broadcast_to(lp, (b,))
    m = int(lp.max()) if b else 0
    qT = Q.transpose(1, 0, 2)[None]
    block = max(1, DP_CELLS_PER_BATCH // max(1, n * b))
    S = np.empty((0, n, b), np.float32)
    idx = np.arange(n + 1, dtype=np.float32)[:, None]
    D = np.repeat(idx, b, axis=1)
    rows = np.empty((m + 1, n + 1, b), np.float32) if keep else None
    if rows is not None:
        rows[0] = D
    out = np.zeros(b)
    cols = np.arange(b)
    at_row: dict[int, I64] = defaultdict(lambda: np.empty(0, np.int64))
    for v in np.unique(lp).tolist():
        at_row[int(v)] = np.flatnonzero(lp == v)
    z = at_row[0]
    out[z] = lq[z]
    for i in range(m):
        if i % block == 0:  # substitution costs (rows, n, b) for the next block of rows
            S, _ = _sub_cost(P[:, i : i + block].transpose(1, 0, 2)[:, None], qT, eps, tau, kind)
        E = np.empty_like(D)
        E[0] = D[0] + np.float32(1.0)
        np.minimum(D[:-1] + S[i % block], D[1:] + np.float32(1.0), out=E[1:])
        E -= idx
        np.minimum.accumulate(E, axis=0, out=E)
        E += idx
        D = E
        if rows is not None:
            rows[i + 1] = D
        at = at_row.get(i + 1)
        if at is not None:
            out[at] = D[lq[at], cols[at]]
    return out, rows


def edit_distance(a: F64, b: F64, *, eps_m: float, tau_s: float, distance: Distance | str = Distance.EDR) -> float:
    """Edit distance (not normalized) between two sample arrays (|A|, 3) and (|B|, 3) of (x m, y m, t s)."""
    kind = Distance(distance)
    A, B = np.asarray(a, np.float64)[None], np.asarray(b, np.float64)[None]
    d, _ = _edit_rows(A, np.array([len(a)]), B, np.array([len(b)]), eps_m, tau_s, kind, keep=False)
    return float(d[0])


def _align(
    P: npt.NDArray[Any], lp: I64, Q: npt.NDArray[Any], lq: I64, eps: float, tau: float, kind: Distance
) -> npt.NDArray[np.int64]:
    """For each pair, the sample of ``Q`` matched with each sample of ``P`` along an optimal path (−1: none)."""
    b = Q.shape[0]
    lp = np.broadcast_to(lp, (b,))
    _, rows = _edit_rows(P, lp, Q, lq, eps, tau, kind, keep=True)
    assert rows is not None
    m = P.shape[1]
    match_of = np.full((b, m), -1, dtype=np.int64)
    i, j = np.array(lp), lq.copy()
    pidx = np.zeros(b, np.int64) if P.shape[0] == 1 else np.arange(b)
    tol = 0.0 if kind is Distance.EDR else 1e-4  # EDR sums are small integers, exact in float32
    while True:
        a = np.flatnonzero((i > 0) | (j > 0))
        if len(a) == 0:
            return match_of
        ia, ja = i[a], j[a]
        cur = rows[ia, ja, a]
        i1, j1 = np.maximum(ia - 1, 0), np.maximum(ja - 1, 0)
        cost, match = _sub_cost(P[pidx[a], i1], Q[a, j1], eps, tau, kind)
        diag = (ia > 0) & (ja > 0) & (np.abs(rows[i1, j1, a] + cost - cur) <= tol)
        up = ~diag & (ia > 0) & (np.abs(rows[i1, ja, a] + np.float32(1.0) - cur) <= tol)
        left = ~diag & ~up
        hit = diag & match
        match_of[a[hit], i1[hit]] = j1[hit]
        i[a] -= (diag | up).astype(np.int64)
        j[a] -= (diag | left).astype(np.int64)


# -- neighbours -------------------------------------------------------------------------------
def _batch_end(la: I64, lb: I64, start: int, budget: int) -> int:
    """End of the batch of pairs from ``start`` whose *padded* DP, ``pairs × (max la + 1) × (max lb + 1)``,
    stays within ``budget`` cells (at least one pair). ``la`` is sorted ascending from ``start`` on.

    Sizing a batch by its first (smallest) pair, as before issue 16, padded a batch of thousands of short
    pairs to the longest trajectory among them: on a half hour of Beijing taxis most time went there.
    """
    n = len(la)
    end, mb, step = start + 1, int(lb[start]), 1
    while end < n:
        new_end = min(n, end + step)
        mb_new = max(mb, int(lb[end:new_end].max()))
        if (new_end - start) * (int(la[new_end - 1]) + 1) * (mb_new + 1) > budget:
            if step == 1:
                break
            step = 1
            continue
        end, mb, step = new_end, mb_new, step * 2
    return end


class _Space:
    """Exact normalized distances between packed trajectories, with candidate pruning (module docstring)."""

    def __init__(
        self,
        packed: _Packed,
        eps: float,
        tau: float,
        kind: Distance,
        max_candidates: int | None,
        spans: F64 | None = None,
        max_shift: float = math.inf,
    ) -> None:
        self.p, self.eps, self.tau, self.kind = packed, eps, tau, kind
        self.max_candidates = max_candidates
        self.spans = spans  # (n, 2) start and end of each trajectory (s); None: no time-shift bound
        self.max_shift = max_shift
        n, L, _ = packed.xyt.shape
        valid = np.arange(L)[None, :] < packed.length[:, None]
        scaled = packed.xyt / np.array([eps, eps, tau])
        self.owner = np.repeat(np.arange(n), packed.length)
        self.tree = cKDTree(scaled[valid])
        self.scaled = scaled
        self._matches: dict[int, tuple[I64, I64]] = {}
        self._exact: dict[tuple[int, int], float] = {}

    def matches(self, p: int) -> tuple[I64, I64]:
        """Trajectories with at least one sample matching a sample of ``p``, and ``M_p(B)`` for each."""
        got = self._matches.get(p)
        if got is not None:
            return got
        lp = int(self.p.length[p])
        hits = self.tree.query_ball_point(self.scaled[p, :lp], r=1.0 + 1e-9, p=np.inf, return_sorted=False)
        sizes = np.fromiter(map(len, hits), dtype=np.int64, count=lp)
        flat = np.fromiter(itertools.chain.from_iterable(hits), dtype=np.int64, count=int(sizes.sum()))
        n = len(self.p.length)
        code = np.unique(np.repeat(np.arange(lp, dtype=np.int64), sizes) * n + self.owner[flat])
        cand, count = np.unique(code % n, return_counts=True)
        keep = cand != p
        got = (cand[keep].astype(np.int64), count[keep].astype(np.int64))
        self._matches[p] = got
        return got

    def feasible(self, p: int, others: I64) -> Bool:
        """Whether each of ``others`` can be aligned with ``p`` (either as pivot) within the time-shift bound:
        the starts and the ends of the two spans differ by at most ``max_shift`` (an inserted point takes
        the pivot instant clamped to the member's span, so its shift is at most that difference)."""
        if self.spans is None or not math.isfinite(self.max_shift):
            return np.ones(len(others), bool)
        d = np.abs(self.spans[others] - self.spans[p])
        out: Bool = (d[:, 0] <= self.max_shift) & (d[:, 1] <= self.max_shift)
        return out

    def lower_bound(self, p: int, cand: I64, count: I64) -> F64:
        lp, lb = int(self.p.length[p]), self.p.length[cand]
        bound = np.maximum(lp - count, np.abs(lp - lb))
        out: F64 = bound / np.maximum(lp, lb)
        return out

    def exact(self, p: int, others: I64) -> F64:
        """Normalized distances from ``p`` to ``others`` (cached per pair)."""
        out = np.empty(len(others))
        todo: list[int] = []
        for r, o in enumerate(others.tolist()):
            key = (p, o) if p < o else (o, p)
            v = self._exact.get(key)
            if v is None:
                todo.append(r)
            else:
                out[r] = v
        if todo:
            rows = np.array(todo, dtype=np.int64)
            ids = others[rows]
            lq = self.p.length[ids]
            lp = self.p.length[[p]]
            n = int(lq.max())
            d, _ = _edit_rows(
                self.p.xyt32[[p], : int(lp[0])],
                lp,
                self.p.xyt32[ids, :n],
                lq,
                self.eps,
                self.tau,
                self.kind,
                keep=False,
            )
            d = d / np.maximum(lp[0], lq)
            out[rows] = d
            for o, v in zip(ids.tolist(), d.tolist(), strict=True):
                self._exact[(p, o) if p < o else (o, p)] = v
        return out

    def prefetch(self, per_trajectory: int) -> None:
        """Exact distances from every trajectory to its ``per_trajectory`` best-bounded candidates, in bulk.

        The greedy asks for them one pivot at a time; computing them here in large batches costs the same
        cells with far fewer array operations.
        """
        n = len(self.p.length)
        firsts: list[I64] = []
        seconds: list[I64] = []
        for p in range(n):
            cand, count = self.matches(p)
            if len(cand) == 0:
                continue
            top = cand[np.argsort(self.lower_bound(p, cand, count), kind="stable")[:per_trajectory]]
            firsts.append(np.minimum(top, p))
            seconds.append(np.maximum(top, p))
        if not firsts:
            return
        code = np.unique(np.concatenate(firsts) * n + np.concatenate(seconds))
        a, b = code // n, code % n
        la, lb = self.p.length[a], self.p.length[b]
        order = np.lexsort((lb, la))
        a, b, la, lb = a[order], b[order], la[order], lb[order]
        start = 0
        while start < len(a):
            end = _batch_end(la, lb, start, DP_CELLS_PER_BATCH // 2)
            sa, sb = a[start:end], b[start:end]
            ma, mb = int(la[start:end].max()), int(lb[start:end].max())
            d, _ = _edit_rows(
                self.p.xyt32[sa, :ma],
                la[start:end],
                self.p.xyt32[sb, :mb],
                lb[start:end],
                self.eps,
                self.tau,
                self.kind,
                keep=False,
            )
            d = d / np.maximum(la[start:end], lb[start:end])
            self._exact.update(zip(zip(sa.tolist(), sb.tolist(), strict=True), d.tolist(), strict=True))
            start = end

    def nearest(self, p: int, kk: int, alive: Bool) -> tuple[I64, F64]:
        """The ``kk`` alive trajectories nearest to ``p`` (normalized distance, then summary distance).

        Exact when ``max_candidates`` is ``None``; otherwise among the ``max_candidates`` alive candidates
        with the smallest lower bounds (and the unmatched ones at distance 1).
        """
        cand, count = self.matches(p)
        ok = alive[cand]
        cand, count = cand[ok], count[ok]
        ok = self.feasible(p, cand)
        cand, count = cand[ok], count[ok]
        lb = self.lower_bound(p, cand, count)
        order = np.argsort(lb, kind="stable")[: self.max_candidates]
        cand, lb = cand[order], lb[order]
        done = 0
        ids: list[I64] = []
        dists: list[F64] = []
        step = max(2 * kk, 8)
        while done < len(cand):
            chunk = cand[done : done + step]
            ids.append(chunk)
            dists.append(self.exact(p, chunk))
            done += len(chunk)
            d_all = np.concatenate(dists)
            if len(d_all) >= kk:
                kth = float(np.partition(d_all, kk - 1)[kk - 1])
                if done >= len(cand) or kth < lb[done]:  # strict: ties are broken by the summary distance
                    break
            step *= 2
        got_ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
        got_d = np.concatenate(dists) if dists else np.empty(0)
        kth_d = float(np.partition(got_d, kk - 1)[kk - 1]) if len(got_d) >= kk else 1.0
        if kth_d >= 1.0:  # unmatched trajectories are at distance 1: the nearest summaries compete for the ties
            rest = alive.copy()
            rest[p] = False
            rest[got_ids] = False
            pool = np.flatnonzero(rest)
            reach = self.feasible(p, pool)
            need = min(kk, len(pool))
            sd = ((self.p.summary[pool] - self.p.summary[p]) ** 2).sum(axis=1)
            sd = np.where(reach, sd, np.inf)
            pick = pool[np.argpartition(sd, need - 1)[:need]] if need else pool[:0]
            got_ids = np.r_[got_ids, pick].astype(np.int64)
            # beyond the time-shift bound: farther than any radius (never grouped with p)
            got_d = np.r_[got_d, np.where(self.feasible(p, pick), 1.0, np.inf)]
        sd = ((self.p.summary[got_ids] - self.p.summary[p]) ** 2).sum(axis=1)
        order = np.lexsort((sd, got_d))[:kk]
        return got_ids[order], got_d[order]


# -- greedy clustering ------------------------------------------------------------------------
class _Greedy:
    """NWA's greedy pivot clustering (§7.3) over the W4M distance, replaying common prefixes of earlier runs."""

    def __init__(self, space: _Space, k: int) -> None:
        self.space, self.k = space, k
        self.runs: list[tuple[float, list[Step]]] = []

    def run(self, max_radius: float) -> tuple[list[I64], I64]:
        sp, k = self.space, self.k
        summary = sp.p.summary
        n = len(summary)
        if n < k:
            return [], np.arange(n, dtype=np.int64)
        steps, alive, clusters, trash = replay_runs(self.runs, max_radius, n)
        ref = summary[steps[-1].pivot] if steps else summary.mean(axis=0)
        n_alive = int(np.count_nonzero(alive))
        while n_alive >= k:
            live = np.flatnonzero(alive)
            p = int(live[int(np.argmax(((summary[live] - ref) ** 2).sum(axis=1)))])
            near, dist = sp.nearest(p, k - 1, alive)
            ref = summary[p]
            removed = greedy_step(p, near, dist, max_radius, steps, clusters, trash)
            alive[removed] = False
            n_alive -= len(removed)
        self.runs.append((max_radius, steps))
        left = np.flatnonzero(alive)
        if len(left) and clusters:
            pivots = np.array([c[0] for c in clusters], dtype=np.int64)
            is_pivot = np.zeros(n, bool)
            is_pivot[pivots] = True
            slot = {int(q): ci for ci, q in enumerate(pivots.tolist())}
            extra: dict[int, list[int]] = defaultdict(list)
            for r in left.tolist():
                best, d = sp.nearest(r, 1, is_pivot)
                if len(best) and d[0] <= max_radius:
                    extra[slot[int(best[0])]].append(r)
                else:
                    trash.append(r)
            for ci, rows in extra.items():
                clusters[ci] = np.r_[clusters[ci], rows].astype(np.int64)
        else:
            trash.extend(left.tolist())
        return clusters, np.array(sorted(trash), dtype=np.int64)


# -- the algorithm ----------------------------------------------------------------------------
def time_groups(trajectories: Sequence[Trajectory], max_shift_s: float) -> list[list[int]]:
    """Indices of the trajectories in time-connected groups: two trajectories whose spans, widened by
    ``max_shift_s``, do not overlap (directly or through others) can never be aligned, so each group is
    anonymized on its own (less padding, no hopeless pairs)."""
    if not trajectories:
        return []
    starts = np.array([tr.t_start for tr in trajectories])
    ends = np.array([tr.t_end for tr in trajectories])
    order = np.argsort(starts, kind="stable")
    groups: list[list[int]] = [[int(order[0])]]
    reach = ends[order[0]] + max_shift_s
    for i in order[1:].tolist():
        if starts[i] > reach:
            groups.append([])
        groups[-1].append(int(i))
        reach = max(reach, ends[i] + max_shift_s)
    return groups


def w4m(
    trajectories: Sequence[Trajectory],
    *,
    k: int,
    delta_m: float,
    trash_max: float = 0.1,
    distance: Distance | str = Distance.EDR,
    eps_m: float | None = None,
    tau_s: float = DEFAULT_TAU_S,
    max_radius: float | None = None,
    max_candidates: int | None = DEFAULT_MAX_CANDIDATES,
    max_time_shift_s: float = DEFAULT_MAX_TIME_SHIFT_S,
) -> W4MResult:
    """Anonymize ``trajectories`` (each ≥ 2 instants, any spans) into (k,δ)-anonymity sets with W4M (§7.4).

    ``distance`` is ``edr`` or ``lst``; ``eps_m`` the spatial match tolerance per axis (default δ/2),
    ``tau_s`` the temporal one (at most ``max_time_shift_s``); ``max_radius`` the clustering radius on
    normalized distances in [0, 1] (default :data:`DEFAULT_MAX_RADIUS`): a trajectory without k−1 others
    within it is trash, as in NWA; ``max_time_shift_s`` bounds every published point's time shift (a
    member is aligned with a pivot only when their starts and their ends differ by at most that);
    ``max_candidates`` bounds the exact distance evaluations per pivot to the candidates with the
    smallest lower bounds (``None``: exact nearest neighbours, as the brute-force tests check).

    Like NWA (issue 16), ``trash_max`` is a bound, not a budget: the trash is what the bounds force
    (time-connected groups smaller than k, trajectories with no partners within the radius and the
    shift bound), the same at any ``trash_max``; over the bound the result is not :attr:`ok`. Members
    of a group share the pivot's instants and lie at each within δ/2 (haversine) of the group's centre.
    """
    check_params(k, delta_m, trash_max)
    kind = Distance(distance)
    eps = delta_m / 2.0 if eps_m is None else eps_m
    if not (math.isfinite(eps) and eps >= 0):
        raise KDeltaError("eps_m: must be a finite number ≥ 0 (metres)")
    if not (math.isfinite(tau_s) and tau_s >= 0):
        raise KDeltaError("tau_s: must be a finite number ≥ 0 (seconds)")
    if not max_time_shift_s >= 0:
        raise KDeltaError("max_time_shift_s: must be ≥ 0 (seconds)")
    if max_candidates is not None and max_candidates < 1:
        raise KDeltaError("max_candidates: must be ≥ 1 or None")
    if max_radius is not None and not 0 <= max_radius <= 1:
        raise KDeltaError("max_radius: must be within [0, 1]")
    radius = DEFAULT_MAX_RADIUS if max_radius is None else float(max_radius)
    tau = max(min(tau_s, max_time_shift_s), 1e-6)
    eps = max(eps, 1e-6)
    n_in = len(trajectories)
    limit = trash_limit(n_in, trash_max)
    published: list[Trajectory] = []
    originals: list[Trajectory] = []
    groups: list[tuple[int, ...]] = []
    trash: list[str] = []
    small: list[SmallClass] = []
    n_small = n_unmatched = n_ins = n_del = 0
    for members in time_groups(trajectories, max_time_shift_s):
        part = [trajectories[i] for i in members]
        if len(part) < k:
            trash.extend(tr.traj_id for tr in part)
            n_small += len(part)
            small.append(SmallClass(min(tr.t_start for tr in part), max(tr.t_end for tr in part), len(part)))
            continue
        packed = _pack(part, eps, tau)
        spans = np.array([[tr.t_start, tr.t_end] for tr in part])
        space = _Space(packed, eps, tau, kind, max_candidates, spans, max_time_shift_s)
        space.prefetch(max_candidates if max_candidates is not None else 2 * k)
        clusters, left = _Greedy(space, k).run(radius)
        trash.extend(part[i].traj_id for i in left.tolist())
        n_unmatched += len(left)
        pub, orig, grp, ins, dele = _translate(part, space, clusters, delta_m, eps, tau, kind)
        offset = len(published)
        published += pub
        originals += orig
        groups += [tuple(offset + i for i in g) for g in grp]
        n_ins += ins
        n_del += dele
    return W4MResult(
        published=tuple(published),
        originals=tuple(originals),
        groups=tuple(groups),
        trash=tuple(trash),
        n_in=n_in,
        trash_limit=limit,
        trash_reasons=(
            (TrashReason.CLASS_SMALLER_THAN_K, n_small),
            (TrashReason.NO_MATCH_WITHIN_BOUNDS, n_unmatched),
        ),
        small_classes=tuple(small),
        n_inserted=n_ins,
        n_deleted=n_del,
        radius=radius,
    )


def _translate(
    trajectories: Sequence[Trajectory],
    space: _Space,
    clusters: list[I64],
    delta_m: float,
    eps: float,
    tau: float,
    kind: Distance,
) -> tuple[list[Trajectory], list[Trajectory], list[tuple[int, ...]], int, int]:
    """Time translation (alignment with the pivot) then space translation of every cluster (§7.4)."""
    packed = space.p
    radius_pub = max(0.0, delta_m / 2.0 * (1.0 - 1e-9) - DELTA_MARGIN_M)
    pairs: list[tuple[int, int]] = []
    match_of: dict[tuple[int, int], npt.NDArray[np.int64]] = {}
    for c in clusters:
        p = int(c[0])
        related = set(space.matches(p)[0].tolist())
        for r in c[1:].tolist():
            if r in related:
                pairs.append((p, r))
            else:  # no sample of r matches one of p: every pivot instant is an insertion
                match_of[(p, r)] = np.full(int(packed.length[p]), -1, dtype=np.int64)
    if pairs:
        piv = np.array([p for p, _ in pairs], dtype=np.int64)
        mem = np.array([r for _, r in pairs], dtype=np.int64)
        order = np.argsort(packed.length[piv] * packed.length[mem], kind="stable")
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order):
                lpm = int(packed.length[piv[order[start : end + 1]]].max()) + 1
                lqm = int(packed.length[mem[order[start : end + 1]]].max()) + 1
                if (end + 1 - start) * lpm * lqm > DP_CELLS_PER_BATCH:
                    break
                end += 1
            sel = order[start:end]
            lp, lq = packed.length[piv[sel]], packed.length[mem[sel]]
            got = _align(
                packed.xyt32[piv[sel], : int(lp.max())], lp, packed.xyt32[mem[sel], : int(lq.max())], lq, eps, tau, kind
            )
            for r, s in enumerate(sel.tolist()):
                match_of[pairs[s]] = got[r, : int(lp[r])]
            start = end
    published: list[Trajectory] = []
    originals: list[Trajectory] = []
    groups: list[tuple[int, ...]] = []
    n_ins = n_del = 0
    for c in clusters:
        pivot = trajectories[int(c[0])]
        times = pivot.t
        m = len(times)
        lat_in = np.empty((len(c), m))
        lon_in = np.empty((len(c), m))
        t_in = np.empty((len(c), m))
        for row, r in enumerate(c.tolist()):
            tr = trajectories[r]
            if row == 0:
                lat_in[0], lon_in[0], t_in[0] = tr.lat, tr.lon, tr.t
                continue
            src = match_of[(int(c[0]), r)]
            hit = src >= 0
            tt = np.clip(times, tr.t_start, tr.t_end)
            tt[hit] = tr.t[src[hit]]
            la, lo = tr.at(tt)
            la[hit], lo[hit] = tr.lat[src[hit]], tr.lon[src[hit]]
            lat_in[row], lon_in[row], t_in[row] = la, lo, tt
            n_matched = int(np.count_nonzero(hit))
            n_ins += m - n_matched
            n_del += len(tr) - n_matched
        new_lat, new_lon, _ = space_translate(lat_in, lon_in, radius_pub)
        first = len(published)
        for row, r in enumerate(c.tolist()):
            tid = trajectories[r].traj_id
            originals.append(Trajectory(tid, t_in[row], lat_in[row], lon_in[row]))
            published.append(Trajectory(tid, times.copy(), new_lat[row], new_lon[row]))
        groups.append(tuple(range(first, len(published))))
    return published, originals, groups, n_ins, n_del


__all__ = [
    "DEFAULT_MAX_RADIUS",
    "DEFAULT_MAX_TIME_SHIFT_S",
    "DEFAULT_TAU_S",
    "Distance",
    "W4MResult",
    "edit_distance",
    "time_groups",
    "w4m",
]
