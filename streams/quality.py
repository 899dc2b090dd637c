"""Quality measures and the independent (k,δ) verifier for trajectory releases (CONCEPTS §7.8, §9.6).

Everything here judges published rows with the contract geodesy (haversine on the contract sphere) and
knows nothing of the algorithms that produced them: the verifier reads a published table only.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kcloak.core.geometry import EARTH_RADIUS_M, Aeqd, haversine_m_array
from kcloak.core.readers import FixTable
from kcloak.streams.trajectory import Trajectory, trajectories_from_fixes

F64 = npt.NDArray[np.float64]

RANGE_QUERIES = 1000
"""Default number of random space–time boxes of ``range_query_distortion`` (contract §7)."""

PUBLISHED_ID = re.compile(r"^[0-9a-f]{16}\Z")
"""Published trajectory ids: 16 lowercase hex chars (contract §1)."""

EXHAUSTIVE_NEAR_MAX = 20
"""The cylinder certificate searches exhaustively only when a trajectory has at most this many neighbours."""

EXHAUSTIVE_SUBSETS_MAX = 5000
"""… and gives up (a warning, not a failure) after this many candidate subsets."""


# -- translation ------------------------------------------------------------------------------
def translation_m(originals: Sequence[Trajectory], published: Sequence[Trajectory]) -> F64:
    """Per published trajectory, Σ over its points of the haversine distance to the original (resampled) point.

    ``originals[i]`` and ``published[i]`` must share their instants (§7.8 ``total_translation_m``).
    """
    out = np.zeros(len(published))
    for i, (o, p) in enumerate(zip(originals, published, strict=True)):
        if len(o) != len(p):
            raise ValueError("originals and published trajectories must have the same instants")
        out[i] = float(haversine_m_array(o.lat, o.lon, p.lat, p.lon).sum())
    return out


# -- range queries ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RangeBoxes:
    """Space–time boxes ``[t_lo, t_hi] × [lat_lo, lat_hi] × [lon_lo, lon_hi]`` (closed), one per row."""

    t_lo: F64
    t_hi: F64
    lat_lo: F64
    lat_hi: F64
    lon_lo: F64
    lon_hi: F64


def random_boxes(fixes: FixTable, n: int = RANGE_QUERIES, *, seed: int = 0) -> RangeBoxes:
    """``n`` seeded boxes centred on random fixes of ``fixes``; each half-size a uniform 1–10 % of the extent."""
    rng = np.random.default_rng(seed)
    if len(fixes) == 0:
        z = np.zeros(n)
        return RangeBoxes(z, z, z, z, z, z)
    at = rng.integers(0, len(fixes), n)

    def half(values: F64, floor: float) -> F64:
        extent = max(float(values.max() - values.min()), floor)
        return extent * rng.uniform(0.01, 0.10, n)

    ht, hla, hlo = half(fixes.t, 1.0), half(fixes.lat, 1e-4), half(fixes.lon, 1e-4)
    t, la, lo = fixes.t[at], fixes.lat[at], fixes.lon[at]
    return RangeBoxes(t - ht, t + ht, la - hla, la + hla, lo - hlo, lo + hlo)


def range_counts(fixes: FixTable, boxes: RangeBoxes) -> npt.NDArray[np.int64]:
    """Number of distinct trajectories with at least one fix in each box."""
    n = len(boxes.t_lo)
    out = np.zeros(n, np.int64)
    if len(fixes) == 0:
        return out
    order = np.argsort(fixes.t, kind="stable")
    t, lat, lon = fixes.t[order], fixes.lat[order], fixes.lon[order]
    codes = np.unique(fixes.traj_id, return_inverse=True)[1][order]
    lo_i = np.searchsorted(t, boxes.t_lo, side="left")
    hi_i = np.searchsorted(t, boxes.t_hi, side="right")
    for q in range(n):
        a, b = int(lo_i[q]), int(hi_i[q])
        if a >= b:
            continue
        sl = slice(a, b)
        inside = (
            (lat[sl] >= boxes.lat_lo[q])
            & (lat[sl] <= boxes.lat_hi[q])
            & (lon[sl] >= boxes.lon_lo[q])
            & (lon[sl] <= boxes.lon_hi[q])
        )
        out[q] = len(np.unique(codes[sl][inside]))
    return out


def range_query_changed_fraction(
    before: FixTable, after: FixTable, *, n_queries: int = RANGE_QUERIES, seed: int = 0
) -> float:
    """Fraction of seeded random boxes whose distinct-trajectory count differs at all (the pre-issue-16
    ``range_query_distortion``; kept as ``range_query_changed_fraction``: any difference counts as 1)."""
    if n_queries <= 0:
        return 0.0
    boxes = random_boxes(before, n_queries, seed=seed)
    diff = range_counts(before, boxes) != range_counts(after, boxes)
    return float(np.count_nonzero(diff)) / n_queries


@dataclass(frozen=True, slots=True)
class RangeQueries:
    """Range queries ``Q = (R, [t_lo, t_hi])`` of NWA's evaluation (docs/quality.md): rectangles ``R`` in the
    AEQD ``frame`` of the input (metres), closed time intervals (Unix s), one query per row."""

    frame: Aeqd
    t_lo: F64
    t_hi: F64
    x_lo: F64
    x_hi: F64
    y_lo: F64
    y_hi: F64


def _frame_of(fixes: FixTable) -> Aeqd:
    lam = np.radians(fixes.lon)
    lon0 = math.degrees(math.atan2(float(np.sin(lam).mean()), float(np.cos(lam).mean())))
    return Aeqd(float(fixes.lat.mean()), lon0)


def random_range_queries(fixes: FixTable, n: int = RANGE_QUERIES, *, seed: int = 0) -> RangeQueries:
    """``n`` seeded queries centred on random fixes of ``fixes``: half-width, half-height and half-duration
    each a uniform 1–10 % of the input's extent on that axis (at least 10 m and 1 s)."""
    rng = np.random.default_rng(seed)
    if len(fixes) == 0:
        z = np.zeros(n)
        return RangeQueries(Aeqd(0.0, 0.0), z, z, z, z, z, z)
    frame = _frame_of(fixes)
    x, y = frame.forward(fixes.lat, fixes.lon)
    at = rng.integers(0, len(fixes), n)

    def half(values: F64, floor: float) -> F64:
        extent = max(float(values.max() - values.min()), floor)
        return extent * rng.uniform(0.01, 0.10, n)

    ht, hx, hy = half(fixes.t, 1.0), half(x, 10.0), half(y, 10.0)
    t0, x0, y0 = fixes.t[at], x[at], y[at]
    return RangeQueries(frame, t0 - ht, t0 + ht, x0 - hx, x0 + hx, y0 - hy, y0 + hy)


def range_query_answers(
    fixes: FixTable, queries: RangeQueries, uncertainty_m: float = 0.0
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Per query, the trajectories *possibly sometimes inside* and *definitely always inside* (docs/quality.md).

    A trajectory is a cylinder of radius ``u = uncertainty_m`` around its samples (NWA §III). Among its
    samples with ``t`` in the query interval, PSI counts it when one of them lies within ``u`` of ``R``;
    DAI when there is at least one and all of them lie inside ``R`` shrunk by ``u`` on every side.
    """
    n = len(queries.t_lo)
    psi = np.zeros(n, np.int64)
    dai = np.zeros(n, np.int64)
    if len(fixes) == 0 or n == 0:
        return psi, dai
    u = float(uncertainty_m)
    order = np.argsort(fixes.t, kind="stable")
    t = fixes.t[order]
    x, y = queries.frame.forward(fixes.lat[order], fixes.lon[order])
    codes = np.unique(fixes.traj_id, return_inverse=True)[1][order]
    lo_i = np.searchsorted(t, queries.t_lo, side="left")
    hi_i = np.searchsorted(t, queries.t_hi, side="right")
    for q in range(n):
        a, b = int(lo_i[q]), int(hi_i[q])
        if a >= b:
            continue
        xs, ys, cs = x[a:b], y[a:b], codes[a:b]
        dx = np.maximum(np.maximum(queries.x_lo[q] - xs, xs - queries.x_hi[q]), 0.0)
        dy = np.maximum(np.maximum(queries.y_lo[q] - ys, ys - queries.y_hi[q]), 0.0)
        near = np.hypot(dx, dy) <= u
        psi[q] = len(np.unique(cs[near]))
        deep = (
            (xs >= queries.x_lo[q] + u)
            & (xs <= queries.x_hi[q] - u)
            & (ys >= queries.y_lo[q] + u)
            & (ys <= queries.y_hi[q] - u)
        )
        present = np.unique(cs)
        outside = np.unique(cs[~deep])
        dai[q] = len(present) - len(outside)
    return psi, dai


def relative_distortion(before: npt.ArrayLike, after: npt.ArrayLike) -> float:
    """Mean over queries of ``|Q(D) − Q(D*)| / max(Q(D), Q(D*))``, a query empty in both counting 0."""
    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    if len(b) == 0:
        return 0.0
    den = np.maximum(a, b)
    per = np.divide(np.abs(b - a), den, out=np.zeros(len(b)), where=den > 0)
    return float(per.mean())


def range_query_distortions(
    before: FixTable, after: FixTable, *, n_queries: int = RANGE_QUERIES, seed: int = 0, uncertainty_m: float = 0.0
) -> dict[str, float]:
    """NWA/W4M's range-query distortion (docs/quality.md) for PSI and DAI queries, and the changed fraction."""
    if n_queries <= 0:
        return {"psi": 0.0, "dai": 0.0, "changed_fraction": 0.0}
    queries = random_range_queries(before, n_queries, seed=seed)
    psi_b, dai_b = range_query_answers(before, queries, uncertainty_m)
    psi_a, dai_a = range_query_answers(after, queries, uncertainty_m)
    return {
        "psi": relative_distortion(psi_b, psi_a),
        "dai": relative_distortion(dai_b, dai_a),
        "changed_fraction": range_query_changed_fraction(before, after, n_queries=n_queries, seed=seed),
    }


def range_query_distortion(
    before: FixTable, after: FixTable, *, n_queries: int = RANGE_QUERIES, seed: int = 0, uncertainty_m: float = 0.0
) -> float:
    """Range-query distortion of the literature (NWA, W4M; docs/quality.md): the mean relative error of
    *possibly sometimes inside* counts over seeded random queries."""
    return range_query_distortions(before, after, n_queries=n_queries, seed=seed, uncertainty_m=uncertainty_m)["psi"]


# -- the (k,δ) verifier -----------------------------------------------------------------------
class Violation(StrEnum):
    """Outcomes of :func:`verify_k_delta` per trajectory (CONCEPTS §9.6)."""

    CLASS_SMALLER_THAN_K = "class_smaller_than_k"
    PAIRWISE = "pairwise"
    NO_CYLINDER_CERTIFICATE = "no_cylinder_certificate"


@dataclass(frozen=True, slots=True)
class KDeltaVerdict:
    """Result of :func:`verify_k_delta`: failures break the contract's property, warnings the cylinder form."""

    n_trajectories: int
    failures: tuple[tuple[str, Violation], ...]
    warnings: tuple[tuple[str, Violation], ...]

    @property
    def ok(self) -> bool:
        return not self.failures


def _local_xy(lat: F64, lon: F64, lat0: F64, lon0: F64) -> tuple[F64, F64]:
    """AEQD coordinates (m) of ``lat``/``lon`` around per-element centres ``lat0``/``lon0`` (broadcast)."""
    p0, p, dl = np.radians(lat0), np.radians(lat), np.radians(lon - lon0)
    cos_c = np.clip(np.sin(p0) * np.sin(p) + np.cos(p0) * np.cos(p) * np.cos(dl), -1.0, 1.0)
    c = np.arccos(cos_c)
    sin_c = np.sin(c)
    kp = np.where(c < 1e-12, 1.0, c / np.where(sin_c == 0, 1.0, sin_c))
    x = EARTH_RADIUS_M * kp * np.cos(p) * np.sin(dl)
    y = EARTH_RADIUS_M * kp * (np.cos(p0) * np.sin(p) - np.sin(p0) * np.cos(p) * np.cos(dl))
    return x, y


def mec_radius(xy: F64) -> F64:
    """Minimum enclosing circle radius of the ``s`` points of each row of ``xy`` (m, s, 2) (§2.5).

    Brute force over the circles through 2 or 3 points, vectorized over rows (fine for s ≤ 30).
    """
    m, s, _ = xy.shape
    if s == 1:
        return np.zeros(m)
    cx: list[F64] = []
    cy: list[F64] = []
    for i, j in itertools.combinations(range(s), 2):
        cx.append((xy[:, i, 0] + xy[:, j, 0]) / 2)
        cy.append((xy[:, i, 1] + xy[:, j, 1]) / 2)
    for i, j, h in itertools.combinations(range(s), 3):
        ax, ay = xy[:, i, 0], xy[:, i, 1]
        bx, by = xy[:, j, 0] - ax, xy[:, j, 1] - ay
        qx, qy = xy[:, h, 0] - ax, xy[:, h, 1] - ay
        d = 2.0 * (bx * qy - by * qx)
        ok = np.abs(d) > 1e-12
        dd = np.where(ok, d, 1.0)
        b2, q2 = bx * bx + by * by, qx * qx + qy * qy
        cx.append(np.where(ok, ax + (qy * b2 - by * q2) / dd, np.nan))
        cy.append(np.where(ok, ay + (bx * q2 - qx * b2) / dd, np.nan))
    X, Y = np.stack(cx, axis=1), np.stack(cy, axis=1)  # (m, C)
    dist = np.hypot(xy[:, None, :, 0] - X[:, :, None], xy[:, None, :, 1] - Y[:, :, None])  # (m, C, s)
    r = dist.max(axis=2)
    r = np.where(np.isnan(r), np.inf, r)
    # a candidate is valid when it holds every point; its radius is then its farthest point
    best: F64 = r.min(axis=1)
    return best


def _cylinder_ok(lat: F64, lon: F64, rows: list[int], radius: float) -> bool:
    """Whether the trajectories ``rows`` fit at every instant in one disc of ``radius`` (AEQD per instant)."""
    la, lo = lat[rows], lon[rows]  # (s, m)
    x, y = _local_xy(la, lo, la[0], lo[0])
    xy = np.stack([x.T, y.T], axis=-1)  # (m, s, 2)
    return bool(np.all(mec_radius(xy) <= radius))


def _certify(lat: F64, lon: F64, a: int, near: list[int], order_key: F64, k: int, radius: float) -> list[int] | None:
    """A (k,δ) cylinder set containing ``a`` among ``near`` (greedy, then exhaustive for small ``near``)."""
    s = [a]
    for b in sorted(near, key=lambda b: float(order_key[b])):
        if _cylinder_ok(lat, lon, [*s, b], radius):
            s.append(b)
            if len(s) == k:
                return s
    if len(near) <= EXHAUSTIVE_NEAR_MAX:
        for tried, combo in enumerate(itertools.combinations(near, k - 1)):
            if tried >= EXHAUSTIVE_SUBSETS_MAX:
                break
            if _cylinder_ok(lat, lon, [a, *combo], radius):
                return [a, *combo]
    return None


def verify_k_delta(
    published: FixTable, k: int, delta_m: float, *, eps_m: float = 1e-6, certify: bool = True
) -> KDeltaVerdict:
    """Check (k,δ)-anonymity from the published rows alone (CONCEPTS §9.6).

    Trajectories are grouped by identical instants; each needs ≥ k−1 others of its group within
    ``delta_m + eps_m`` (haversine) at every instant (failure otherwise). With ``certify``, each is also
    shown to lie in a set of k whose positions fit in one disc of radius δ/2 at every instant (the
    cylinder form; a missing certificate is a warning).
    """
    trajs = trajectories_from_fixes(published)
    failures: list[tuple[str, Violation]] = []
    warnings: list[tuple[str, Violation]] = []
    by_instants: dict[bytes, list[Trajectory]] = defaultdict(list)
    for tr in trajs:
        by_instants[tr.t.tobytes()].append(tr)
    limit = delta_m + eps_m
    chord = 2.0 * EARTH_RADIUS_M * math.sin(min(limit / (2.0 * EARTH_RADIUS_M), math.pi / 2)) * (1 + 1e-9) + 1e-6
    cyl_radius = delta_m / 2.0 + eps_m + 1e-5 * delta_m  # AEQD transverse error ≈ ρ²/(6R²) (§2.1)
    from scipy.spatial import cKDTree  # here, not at module level: a broker imports this module, ~30 MB idle

    for group in by_instants.values():
        if len(group) < k:
            failures += [(tr.traj_id, Violation.CLASS_SMALLER_THAN_K) for tr in group]
            continue
        lat = np.stack([tr.lat for tr in group])
        lon = np.stack([tr.lon for tr in group])
        p0, l0 = np.radians(lat[:, 0]), np.radians(lon[:, 0])
        start = EARTH_RADIUS_M * np.stack([np.cos(p0) * np.cos(l0), np.cos(p0) * np.sin(l0), np.sin(p0)], axis=1)
        tree = cKDTree(start)
        certified = np.zeros(len(group), bool)
        for a, cand in enumerate(tree.query_ball_point(start, chord)):
            others = np.array([c for c in cand if c != a], dtype=np.int64)
            if len(others) < k - 1:
                failures.append((group[a].traj_id, Violation.PAIRWISE))
                continue
            dmax = haversine_m_array(lat[a], lon[a], lat[others], lon[others]).max(axis=1)
            near = others[dmax <= limit]
            if len(near) < k - 1:
                failures.append((group[a].traj_id, Violation.PAIRWISE))
                continue
            if not certify or certified[a]:
                continue
            key = np.full(len(group), np.inf)
            key[others] = dmax
            found = _certify(lat, lon, a, near.tolist(), key, k, cyl_radius)
            if found is None:
                warnings.append((group[a].traj_id, Violation.NO_CYLINDER_CERTIFICATE))
            else:
                certified[found] = True
    return KDeltaVerdict(len(trajs), tuple(failures), tuple(warnings))


def publication_format_problems(published: FixTable, input_ids: Sequence[str] = ()) -> list[str]:
    """Breaches of the published record format (contract §1, §7): id shape, fresh ids, rows sorted by ``t``."""
    problems: list[str] = []
    ids = set(published.traj_id.tolist())
    if any(not PUBLISHED_ID.match(i) for i in ids):
        problems.append("traj_id: published ids must be 16 lowercase hex characters")
    if ids & set(input_ids):
        problems.append("traj_id: a published id equals an input id")
    if len(published) > 1 and bool(np.any(np.diff(published.t) < 0)):
        problems.append("t: rows must be sorted by t ascending")
    return problems


__all__ = [
    "RANGE_QUERIES",
    "KDeltaVerdict",
    "RangeBoxes",
    "RangeQueries",
    "Violation",
    "mec_radius",
    "publication_format_problems",
    "random_boxes",
    "random_range_queries",
    "range_counts",
    "range_query_answers",
    "range_query_changed_fraction",
    "range_query_distortion",
    "range_query_distortions",
    "relative_distortion",
    "translation_m",
    "verify_k_delta",
]
