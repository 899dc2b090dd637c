"""Candidate sets of the reference LBS provider (CONCEPTS §1.7, §5.3, §2.1 rule 2; contract §5).

Inclusive for every point of the cloaked box and as small as that allows, decided with haversine
distances directly on the contract sphere (no frame, so no frame error); proof in the comment below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from rtree import index as rtree_index

from cloaking.geometry import EARTH_RADIUS_M
from cloaking.places import Poi, PoiSet

# PROOF OF INCLUSIVENESS (and of the rounding allowance).
#
# The provider sees a cloaked lat/lon box `R` and answers with a candidate set that is
# *inclusive* (for every point `p` of `R` the exact answer at `p` is a subset) and as small as
# that allows. Everything is decided with great-circle (haversine) distances on the contract's
# sphere, so no frame error has to be absorbed; the only allowance is `slack_m` for
# floating-point rounding.
#
# **Range** (§5.3): `C = {o : dist(o, R) <= r}` where `dist(o, R)` is the exact spherical
# point-to-box distance: 0 inside, else the least distance to the four edges (the distance from a
# point outside has no interior minimum). Inclusive since `dist(o, R) <= d(o, p)` for `p` in `R`;
# minimal since each candidate is within `r` of its closest point of `R`.
#
# **kNN** — proof of inclusiveness on the sphere (the planar proof of §5.3, with each step checked
# for the sphere). Let `g(q)` be the great-circle distance from `q` to its `n`-th nearest
# matching POI; `g` is 1-Lipschitz for the great-circle metric (triangle inequality).
#
# (a) *Boundary reduction.* Let `p` be in `R` and `o` one of its `n` nearest POIs (ties
#     included: `d(p, o) <= g(p)`) with `o` outside `R`. A minimizing geodesic from `p` to `o`
#     is a continuous path from the closed set `R` to its complement, so it meets the boundary of
#     `R` at some `q` with `d(p, q) + d(q, o) = d(p, o)`. Then
#     `d(q, o) = d(p, o) - d(p, q) <= g(p) - d(p, q) <= g(q)`. So every such `o` is within `g(q)`
#     of a boundary point `q`, and every POI inside `R` is its own answer: the exact union over
#     `R` is `(POIs in R) ∪ ⋃_{q ∈ ∂R} {o : d(q, o) <= g(q)}`. The boundary is covered by four
#     edges (two meridian arcs, which are geodesics, and two parallel arcs, which are not), each
#     cut into *pieces*; if `D >= max g` on a piece, every answer is within `D` of that piece
#     (the "stadium" piece ⊕ disk, measured with the exact point-to-arc distance).
#
# (b) *Lipschitz bound* (any `n`). On a piece from `a` to `b` of path length `ℓ` (an arc of a
#     meridian: `R·Δφ`; of a parallel: `R·cos φ·Δλ`, which is at least the geodesic distance
#     between any two of its points), a point `q` at path length `t` from `a` has
#     `g(q) <= min(g(a) + t, g(b) + ℓ - t) <= (g(a) + g(b) + ℓ) / 2`. Any upper bound of `g(a)`
#     may be used; we use the `n`-th smallest distance among `n` actual POIs, which is one (so the
#     rtree's nearest-neighbour search affects only minimality, never soundness). If at most `n` POIs
#     match, every matching POI is a candidate.
#
# (c) *Filter bound* (Casper's filters and middle point, for any `n`; for `n = 1` it is exactly
#     Casper's). Let `S_a` be the `n` nearest POIs of `a` (the filters) and
#     `F_a(q) = max_{o ∈ S_a} d(q, o)`; then `g <= F_a` everywhere, same for `b`. Along a piece
#     every `d(·, o)` is quasi-convex (see below), hence so is `F_a`. For *any* split point `m`
#     of the piece, `g <= F_a` on `[a, m]` and `g <= F_b` on `[m, b]`, so
#     `max g <= max(F_a(a), F_a(m), F_b(m), F_b(b))`; we pick `m` near where `F_a = F_b` (the
#     middle point) by bisection, but soundness does not depend on how well it is found.
#     Quasi-convexity: along a geodesic arc, `cos d(q(s), o) = C·cos(s/R - θ)`, whose only interior
#     maximum of `d` is the point farthest from `o` on the great circle (`d >= πR/2`); it cannot lie
#     on the piece when `d(a, o) + ℓ < πR/2`, which we require. Along a parallel,
#     `d` increases with the wrapped longitude difference `|λ - λ_o|`, so `d` is quasi-convex
#     unless the piece contains the antipodal meridian `λ_o + π`, which we exclude. Where a
#     condition fails the piece keeps the Lipschitz bound.
#
# (d) *Floating point.* Every distance is a haversine on the contract sphere, as the checker
#     computes it; a computed value differs from the real one by ε, about 1e-9 m plus 1e-15
#     relative (up to ~0.1 m only for nearly antipodal points, where asin is ill-conditioned).
#     The checker's answer at `p` uses computed distances, so it may hold an `o` with real
#     `d(p, o) <= g(p) + 2ε`; the chain (a)-(c) then gives `d(q, o) <= D + 2ε` with the real `D`,
#     our computed `D` and `dist(o, piece)` are each off by a few ε more. Comparing
#     `dist(o, piece) <= D + slack_m(D)` (1 mm plus 1e-7 relative, ≫ 5ε) is therefore sound. The rtree
#     queries are prefilters over boxes that provably contain every POI the exact test can accept
#     (unit vectors; a point within angle `δ` of a piece is within the chord `2 sin(δ/2)` of it,
#     hence within that much of the piece's axis-aligned box in each coordinate), with 1e-9 margin.
#
# Minimality: a piece is cut while its bound exceeds the smaller `g` at its ends by more than
# `refine_ratio` of it (within a budget of sample points), so each stadium's radius is within
# `1 + refine_ratio` of the smaller `g` at its piece's ends; range answers are exactly minimal.

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

SLACK_REL = 1e-7
"""Relative allowance for floating-point rounding of haversine distances (see the module proof (d))."""
SLACK_ABS_M = 1e-3
"""Absolute allowance (metres) for floating-point rounding of haversine distances."""

_AABB_MARGIN = 1e-9  # unit-sphere coordinates; float noise is ~1e-16
_QUASI_CONVEX_LIMIT_M = 0.9 * math.pi * EARTH_RADIUS_M / 2  # d(a, o) + ℓ must stay below πR/2
_ANTIPODE_MARGIN_RAD = 1e-9
_MERIDIAN, _PARALLEL = 0, 1


def slack_m(bound_m: npt.ArrayLike) -> FloatArray:
    """Rounding allowance added to every distance bound before comparing (module proof (d))."""
    b = np.asarray(bound_m, dtype=np.float64)
    out: FloatArray = b * SLACK_REL + SLACK_ABS_M
    return out


# ---------------------------------------------------------------------------------------------
# Pure planar bound functions of §5.3 (the worked example `casper_nn`; the production engine
# below applies the same bounds on the sphere).


def lipschitz_bound(g_i: float, g_j: float, length: float) -> float:
    """Bound of the ``n``-th NN distance along an edge from its vertex values (§5.3, any ``n``)."""
    return (g_i + g_j + length) / 2


def planar_casper_bound(
    v_i: tuple[float, float], v_j: tuple[float, float], t_i: tuple[float, float], t_j: tuple[float, float]
) -> float:
    """Casper's ``n = 1`` edge bound in the plane: filters ``t_i``, ``t_j`` and the middle point (§5.3)."""
    cands = [math.dist(v_i, t_i), math.dist(v_j, t_j)]
    if t_i != t_j:
        # Solve |q - t_i| = |q - t_j| for q = v_i + s (v_j - v_i): linear in s.
        ex, ey = v_j[0] - v_i[0], v_j[1] - v_i[1]
        wx, wy = t_i[0] - t_j[0], t_i[1] - t_j[1]
        denom = 2 * (ex * wx + ey * wy)
        num = (t_i[0] ** 2 + t_i[1] ** 2 - t_j[0] ** 2 - t_j[1] ** 2) - 2 * (v_i[0] * wx + v_i[1] * wy)
        if denom != 0:
            s = num / denom
            if 0 <= s <= 1:
                m = (v_i[0] + s * ex, v_i[1] + s * ey)
                cands.append(math.dist(m, t_i))
    return max(cands)


def _planar_segment_dist(p: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    ex, ey = b[0] - a[0], b[1] - a[1]
    ll = ex * ex + ey * ey
    s = 0.0 if ll == 0 else min(max(((p[0] - a[0]) * ex + (p[1] - a[1]) * ey) / ll, 0.0), 1.0)
    return math.dist(p, (a[0] + s * ex, a[1] + s * ey))


def planar_knn_candidates(
    rect: tuple[float, float, float, float], points: Sequence[tuple[float, float]], n: int
) -> set[int]:
    """§5.3 ``knn_candidates`` in the plane, verbatim (one stadium per edge); indices into ``points``."""
    x0, y0, x1, y1 = rect
    if len(points) <= n:
        return set(range(len(points)))
    verts = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]

    def nearest(v: tuple[float, float]) -> list[int]:
        return sorted(range(len(points)), key=lambda i: (math.dist(v, points[i]), i))

    order = {v: nearest(v) for v in verts}
    f = {v: math.dist(v, points[order[v][n - 1]]) for v in verts}
    bounds: list[tuple[tuple[float, float], tuple[float, float], float]] = []
    for vi, vj in zip(verts, verts[1:] + verts[:1], strict=True):
        if n == 1:
            d = planar_casper_bound(vi, vj, points[order[vi][0]], points[order[vj][0]])
        else:
            d = lipschitz_bound(f[vi], f[vj], math.dist(vi, vj))
        bounds.append((vi, vj, d))
    out: set[int] = set()
    for i, p in enumerate(points):
        inside = x0 <= p[0] <= x1 and y0 <= p[1] <= y1
        if inside or any(_planar_segment_dist(p, a, b) <= d for a, b, d in bounds):
            out.add(i)
    return out


# ---------------------------------------------------------------------------------------------
# Spherical geometry on radians (vectorized).


def _hav_m(lat1: FloatArray, lon1: FloatArray, lat2: FloatArray, lon2: FloatArray) -> FloatArray:
    """Haversine distance (metres) between points given in radians; same formula as the contract's."""
    a = np.sin((lat2 - lat1) / 2) ** 2 + np.cos(lat1) * np.cos(lat2) * np.sin((lon2 - lon1) / 2) ** 2
    out: FloatArray = 2 * EARTH_RADIUS_M * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))
    return out


def _unit_vectors(lat: FloatArray, lon: FloatArray) -> FloatArray:
    c = np.cos(lat)
    return np.stack([c * np.cos(lon), c * np.sin(lon), np.sin(lat)], axis=-1)


def _lonlat_box_aabb(lat_a: FloatArray, lat_b: FloatArray, lon_a: FloatArray, lon_b: FloatArray) -> FloatArray:
    """Axis-aligned box (m×6: mins then maxs) of the unit vectors of lat/lon boxes (radians, lon in [-π, π])."""
    cos_a, cos_b = np.cos(lat_a), np.cos(lat_b)
    c_max = np.where((lat_a <= 0) & (lat_b >= 0), 1.0, np.maximum(cos_a, cos_b))
    c_min = np.minimum(cos_a, cos_b)
    cl_a, cl_b, sl_a, sl_b = np.cos(lon_a), np.cos(lon_b), np.sin(lon_a), np.sin(lon_b)
    u_max = np.where((lon_a <= 0) & (lon_b >= 0), 1.0, np.maximum(cl_a, cl_b))
    u_min = np.where((lon_a <= -math.pi) | (lon_b >= math.pi), -1.0, np.minimum(cl_a, cl_b))
    half = math.pi / 2
    v_max = np.where((lon_a <= half) & (lon_b >= half), 1.0, np.maximum(sl_a, sl_b))
    v_min = np.where((lon_a <= -half) & (lon_b >= -half), -1.0, np.minimum(sl_a, sl_b))
    xs = np.stack([c_min * u_min, c_min * u_max, c_max * u_min, c_max * u_max])
    ys = np.stack([c_min * v_min, c_min * v_max, c_max * v_min, c_max * v_max])
    return np.stack(
        [xs.min(0), ys.min(0), np.sin(lat_a), xs.max(0), ys.max(0), np.sin(lat_b)],
        axis=-1,
    )


def _lon_in(lon: FloatArray, lo: FloatArray, hi: FloatArray) -> BoolArray:
    """``lon`` (any representative) lies in ``[lo, hi]`` (radians, interval within [-π, π])."""
    two_pi = 2 * math.pi
    out: BoolArray = (
        ((lon >= lo) & (lon <= hi))
        | ((lon - two_pi >= lo) & (lon - two_pi <= hi))
        | ((lon + two_pi >= lo) & (lon + two_pi <= hi))
    )
    return out


def _dist_to_pieces(
    lat: FloatArray, lon: FloatArray, kind: IntArray, fixed: FloatArray, a: FloatArray, b: FloatArray
) -> FloatArray:
    """Exact great-circle distance (m) from points to arcs of meridians or parallels, pairwise.

    The distance along an arc has its minimum at an end or at the interior critical point: the
    foot of the perpendicular for a meridian (a geodesic), the point's own longitude for a parallel.
    """
    mer = kind == _MERIDIAN
    lat_a = np.where(mer, a, fixed)
    lon_a = np.where(mer, fixed, a)
    lat_b = np.where(mer, b, fixed)
    lon_b = np.where(mer, fixed, b)
    d = np.minimum(_hav_m(lat, lon, lat_a, lon_a), _hav_m(lat, lon, lat_b, lon_b))
    # Meridian: cos d = sin φ sin φ' + cos φ cos Δλ cos φ' is maximal at φ' = atan2(sin φ, cos φ cos Δλ).
    foot = np.arctan2(np.sin(lat), np.cos(lat) * np.cos(lon - fixed))
    d_mer = np.where((foot >= a) & (foot <= b), np.minimum(d, _hav_m(lat, lon, foot, fixed)), d)
    # Parallel: the nearest point is at the same longitude when it lies on the arc.
    d_par = np.where(_lon_in(lon, a, b), np.minimum(d, EARTH_RADIUS_M * np.abs(lat - fixed)), d)
    out: FloatArray = np.where(mer, d_mer, d_par)
    return out


# ---------------------------------------------------------------------------------------------
# The engine.


@dataclass(frozen=True, slots=True)
class LonLatBox:
    """A search region in degrees, GeoJSON order, never across the antimeridian (contract §0)."""

    min_lon: float
    min_lat: float
    max_lon: float
    max_lat: float

    def __post_init__(self) -> None:
        vals = (self.min_lon, self.min_lat, self.max_lon, self.max_lat)
        if not all(math.isfinite(v) for v in vals):
            raise ValueError("bbox: coordinates must be finite")
        if not (-180 <= self.min_lon <= self.max_lon <= 180):
            raise ValueError("bbox: longitudes must be ordered and within [-180, 180]")
        if not (-90 <= self.min_lat <= self.max_lat <= 90):
            raise ValueError("bbox: latitudes must be ordered and within [-90, 90]")

    @classmethod
    def of(cls, bbox: Sequence[float]) -> LonLatBox:
        """From ``[min_lon, min_lat, max_lon, max_lat]``."""
        if len(bbox) != 4:
            raise ValueError("bbox: must have four numbers")
        return cls(float(bbox[0]), float(bbox[1]), float(bbox[2]), float(bbox[3]))


class _Layer:
    """POIs of one category (or all): radians, unit vectors and a 3-D rtree on the unit vectors."""

    __slots__ = ("lat_deg", "lat_r", "lon_deg", "lon_r", "rows", "tree")

    def __init__(self, rows: IntArray, lat_deg: FloatArray, lon_deg: FloatArray) -> None:
        self.rows = rows
        self.lat_deg = lat_deg
        self.lon_deg = lon_deg
        self.lat_r = np.radians(lat_deg)
        self.lon_r = np.radians(lon_deg)
        self.tree: rtree_index.Index | None = None
        if len(rows):
            xyz = _unit_vectors(self.lat_r, self.lon_r)
            prop = rtree_index.Property()
            prop.dimension = 3
            stream = ((i, (x, y, z, x, y, z), None) for i, (x, y, z) in enumerate(xyz.tolist()))
            self.tree = rtree_index.Index(stream, properties=prop)

    def __len__(self) -> int:
        return len(self.rows)

    def close(self) -> None:
        if self.tree is not None:
            self.tree.close()
            self.tree = None


@dataclass(slots=True)
class _Pieces:
    """Boundary pieces: arcs of meridians (``fixed`` = lon) or parallels (``fixed`` = lat), radians."""

    kind: IntArray
    fixed: FloatArray
    a: FloatArray
    b: FloatArray
    pa: IntArray  # sample index of the start point
    pb: IntArray  # sample index of the end point
    bound_m: FloatArray

    def take(self, sel: IntArray | BoolArray) -> _Pieces:
        return _Pieces(
            self.kind[sel], self.fixed[sel], self.a[sel], self.b[sel], self.pa[sel], self.pb[sel], self.bound_m[sel]
        )

    @staticmethod
    def concat(parts: Sequence[_Pieces]) -> _Pieces:
        return _Pieces(*(np.concatenate([getattr(p, f) for p in parts]) for f in _PIECE_FIELDS))

    def points(self, u: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Points at parameter ``u`` ∈ [0, 1] along each piece."""
        along = self.a + u * (self.b - self.a)
        mer = self.kind == _MERIDIAN
        return np.where(mer, along, self.fixed), np.where(mer, self.fixed, along)

    def length_m(self) -> FloatArray:
        """Path length: a meridian arc is a geodesic; a parallel arc is longer than its chords' geodesics."""
        scale = np.where(self.kind == _MERIDIAN, 1.0, np.cos(self.fixed))
        out: FloatArray = EARTH_RADIUS_M * np.maximum(scale, 0.0) * (self.b - self.a)
        return out


_PIECE_FIELDS = ("kind", "fixed", "a", "b", "pa", "pb", "bound_m")


class LbsEngine:
    """Inclusive, near-minimal candidate sets over a lat/lon box for range and kNN queries (§5.3).

    Keyword-only parameters: ``refine_ratio`` (0.05): a kNN boundary piece is cut while its bound
    exceeds the smaller ``n``-th-NN distance at its ends by more than this fraction;
    ``max_samples`` (256): budget of boundary points where the ``n`` nearest POIs are looked up
    per query; ``bisect_steps`` (4): bisection steps locating the middle point of a piece.
    """

    def __init__(
        self, pois: PoiSet, *, refine_ratio: float = 0.05, max_samples: int = 256, bisect_steps: int = 4
    ) -> None:
        self.pois: tuple[Poi, ...] = pois.pois
        self.refine_ratio = refine_ratio
        self.max_samples = max_samples
        self.bisect_steps = bisect_steps
        lat, lon = pois.lat, pois.lon
        ids = [p.poi_id for p in self.pois]
        order = sorted(range(len(ids)), key=ids.__getitem__)
        self._rank = np.empty(len(ids), np.int64)
        self._rank[order] = np.arange(len(ids), dtype=np.int64)
        by_cat: dict[str, list[int]] = {}
        for i, p in enumerate(self.pois):
            by_cat.setdefault(p.category, []).append(i)
        self._layers: dict[str | None, _Layer] = {}
        all_rows = np.arange(len(self.pois), dtype=np.int64)
        self._layers[None] = _Layer(all_rows, lat, lon)
        for cat in sorted(by_cat):
            rows = np.asarray(by_cat[cat], dtype=np.int64)
            self._layers[cat] = _Layer(rows, lat[rows], lon[rows])

    def close(self) -> None:
        """Release the rtree indexes."""
        for layer in self._layers.values():
            layer.close()

    def categories(self) -> list[tuple[str, int]]:
        """``(category, count)`` for every category, sorted by name."""
        return [(c, len(layer)) for c, layer in self._layers.items() if c is not None]

    def _layer(self, category: str | None) -> _Layer | None:
        return self._layers.get(category)

    def _sorted_rows(self, layer: _Layer, local: IntArray) -> IntArray:
        rows = layer.rows[local]
        out: IntArray = rows[np.argsort(self._rank[rows], kind="stable")]
        return out

    # -- range ---------------------------------------------------------------------------------

    def range_candidates(self, box: LonLatBox, radius_m: float, category: str | None = None) -> IntArray:
        """POI rows (sorted by ``poi_id``) within ``radius_m`` of some point of ``box`` (§5.3; exact, minimal)."""
        layer = self._layer(category)
        if layer is None or layer.tree is None:
            return np.empty(0, np.int64)
        pieces = _edges(box, np.full(4, float(radius_m)))
        return self._sorted_rows(layer, _gather(layer, box, pieces))

    # -- knn -----------------------------------------------------------------------------------

    def knn_candidates(self, box: LonLatBox, n: int, category: str | None = None) -> IntArray:
        """POI rows (sorted by ``poi_id``) containing every point's ``n`` nearest, ties included (§5.3)."""
        if n < 1:
            raise ValueError("n: must be at least 1")
        layer = self._layer(category)
        if layer is None or layer.tree is None:
            return np.empty(0, np.int64)
        if len(layer) <= n:
            return self._sorted_rows(layer, np.arange(len(layer), dtype=np.int64))
        sampler = _Sampler(layer, n)
        pieces = _edges(box, np.zeros(4))
        lat1, lat2 = math.radians(box.min_lat), math.radians(box.max_lat)
        lon1, lon2 = math.radians(box.min_lon), math.radians(box.max_lon)
        sampler.add(np.array([lat1, lat1, lat2, lat2]), np.array([lon1, lon2, lon1, lon2]))
        pieces.bound_m = self._piece_bounds(sampler, pieces)
        pieces = self._refine(sampler, pieces)
        return self._sorted_rows(layer, _gather(layer, box, pieces))

    def _refine(self, sampler: _Sampler, pieces: _Pieces) -> _Pieces:
        """Cut pieces whose bound is loose (relative excess over the smaller ``g`` at the ends) within the budget."""
        while sampler.size < self.max_samples:
            g_end = np.maximum(np.minimum(sampler.g[pieces.pa], sampler.g[pieces.pb]), 1.0)
            excess = (pieces.bound_m - g_end) / g_end
            loose = np.flatnonzero((excess > self.refine_ratio) & (pieces.length_m() > 1.0))
            if len(loose) == 0:
                break
            # Cut each loose piece into as many parts as its excess suggests (the bound tightens
            # roughly in proportion to the part length); the loosest first, within the budget.
            loose = loose[np.argsort(-excess[loose], kind="stable")]
            parts = np.clip(np.ceil(excess[loose] / self.refine_ratio), 2, 8).astype(np.int64)
            budget = self.max_samples - sampler.size
            parts[0] = min(int(parts[0]), budget + 1)
            fits = np.cumsum(parts - 1) <= budget
            loose, parts = loose[fits], parts[fits]
            split = pieces.take(np.repeat(loose, parts))
            keep = np.ones(len(pieces.kind), dtype=np.bool_)
            keep[loose] = False
            # Part j of a piece cut in c parts spans [j/c, (j+1)/c]; inner cut points are new samples.
            j = np.arange(len(split.kind)) - np.repeat(np.cumsum(parts) - parts, parts)
            c = np.repeat(parts, parts)
            u0, u1 = j / c, (j + 1) / c
            span = split.b - split.a
            lo, hi = split.a + u0 * span, split.a + u1 * span
            hi = np.where(j == c - 1, split.b, hi)
            inner = j < c - 1
            mer = split.kind[inner] == _MERIDIAN
            first = sampler.add(
                np.where(mer, hi[inner], split.fixed[inner]), np.where(mer, split.fixed[inner], hi[inner])
            )
            cut_id = np.full(len(j), -1, np.int64)
            cut_id[inner] = np.arange(first, first + int(inner.sum()), dtype=np.int64)
            pa = np.where(j == 0, split.pa, np.roll(cut_id, 1))
            pb = np.where(inner, cut_id, split.pb)
            new = _Pieces(split.kind, split.fixed, lo, hi, pa, pb, np.zeros(len(j)))
            new.bound_m = self._piece_bounds(sampler, new)
            pieces = _Pieces.concat([pieces.take(keep), new])
        return pieces

    def _piece_bounds(self, sampler: _Sampler, pieces: _Pieces) -> FloatArray:
        """Upper bound of ``g`` on each piece: min(Lipschitz, filter bound where it is valid)."""
        g_a, g_b = sampler.g[pieces.pa], sampler.g[pieces.pb]
        length = pieces.length_m()
        lipschitz: FloatArray = (g_a + g_b + length) / 2
        s_a, s_b = sampler.sets[pieces.pa], sampler.sets[pieces.pb]  # (p, n) local ids
        lat_a, lon_a = pieces.points(np.zeros(len(length)))
        f_b_at_a = sampler.farthest(s_b, lat_a, lon_a)
        valid = _quasi_convex(sampler.layer, pieces, s_a, s_b, np.maximum(g_a, f_b_at_a), length)
        lo = np.zeros(len(length))
        hi = np.ones(len(length))
        for _ in range(self.bisect_steps):
            mid = (lo + hi) / 2
            lat_m, lon_m = pieces.points(mid)
            a_smaller = sampler.farthest(s_a, lat_m, lon_m) <= sampler.farthest(s_b, lat_m, lon_m)
            lo = np.where(a_smaller, mid, lo)
            hi = np.where(a_smaller, hi, mid)
        lat_m, lon_m = pieces.points((lo + hi) / 2)
        filt = np.maximum.reduce([g_a, g_b, sampler.farthest(s_a, lat_m, lon_m), sampler.farthest(s_b, lat_m, lon_m)])
        out: FloatArray = np.where(valid, np.minimum(lipschitz, filt), lipschitz)
        return out


def _quasi_convex(
    layer: _Layer, pieces: _Pieces, s_a: IntArray, s_b: IntArray, far_from_a: FloatArray, length: FloatArray
) -> BoolArray:
    """Pieces along which the distance to every filter POI is quasi-convex (module proof (c))."""
    mer_ok = far_from_a + length < _QUASI_CONVEX_LIMIT_M
    filters = np.concatenate([s_a, s_b], axis=1)
    anti = layer.lon_r[filters] + math.pi  # (p, 2n)
    anti = np.where(anti > math.pi, anti - 2 * math.pi, anti)
    lo = (pieces.a - _ANTIPODE_MARGIN_RAD)[:, None]
    hi = (pieces.b + _ANTIPODE_MARGIN_RAD)[:, None]
    par_ok = ~np.any(_lon_in(anti, lo, hi), axis=1)
    out: BoolArray = np.where(pieces.kind == _MERIDIAN, mer_ok, par_ok)
    return out


class _Sampler:
    """Boundary sample points with their ``n`` nearest POIs (the filters) and ``g`` = the n-th distance."""

    def __init__(self, layer: _Layer, n: int) -> None:
        self.layer = layer
        self.n = n
        self.lat = np.empty(0)
        self.lon = np.empty(0)
        self.g = np.empty(0)
        self.sets = np.empty((0, n), np.int64)

    @property
    def size(self) -> int:
        return len(self.lat)

    def add(self, lat: FloatArray, lon: FloatArray) -> int:
        """Look up the ``n`` nearest POIs of new points (exact on the sphere: chord order); first new index."""
        first = self.size
        assert self.layer.tree is not None
        q = _unit_vectors(lat, lon)
        ids, counts = _nearest_v(self.layer.tree, q, self.n)
        width = int(counts.max())
        row = np.repeat(np.arange(len(lat)), counts)
        col = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
        mat = np.zeros((len(lat), width), np.int64)
        mat[row, col] = ids
        dist = np.full((len(lat), width), np.inf)
        dist[row, col] = _hav_m(lat[row], lon[row], self.layer.lat_r[ids], self.layer.lon_r[ids])
        order = np.argsort(dist, axis=1, kind="stable")[:, : self.n]
        sets = np.take_along_axis(mat, order, axis=1)
        g = np.take_along_axis(dist, order, axis=1)[:, -1]
        self.lat = np.concatenate([self.lat, lat])
        self.lon = np.concatenate([self.lon, lon])
        self.g = np.concatenate([self.g, g])
        self.sets = np.concatenate([self.sets, sets])
        return first

    def farthest(self, sets: IntArray, lat: FloatArray, lon: FloatArray) -> FloatArray:
        """``max_{o ∈ set} d(point, o)`` per row (the filter function F of the module proof)."""
        d = _hav_m(lat[:, None], lon[:, None], self.layer.lat_r[sets], self.layer.lon_r[sets])
        out: FloatArray = d.max(axis=1)
        return out


def _nearest_v(tree: rtree_index.Index, points: FloatArray, n: int) -> tuple[IntArray, IntArray]:
    """Typed wrapper of rtree's bulk k-nearest query (ties included): ids and per-point counts."""
    ids, counts = tree.nearest_v(points, points, num_results=n)  # type: ignore[no-untyped-call]
    return np.asarray(ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)


def _intersection_v(tree: rtree_index.Index, mins: FloatArray, maxs: FloatArray) -> tuple[IntArray, IntArray]:
    """Typed wrapper of rtree's bulk box query: ids and per-box counts."""
    ids, counts = tree.intersection_v(mins, maxs)  # type: ignore[no-untyped-call]
    return np.asarray(ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)


def _edges(box: LonLatBox, bound_m: FloatArray) -> _Pieces:
    """The four edges as pieces: bottom, top (parallels), left, right (meridians); corner samples 0..3."""
    lat1, lat2 = math.radians(box.min_lat), math.radians(box.max_lat)
    lon1, lon2 = math.radians(box.min_lon), math.radians(box.max_lon)
    return _Pieces(
        kind=np.array([_PARALLEL, _PARALLEL, _MERIDIAN, _MERIDIAN], np.int64),
        fixed=np.array([lat1, lat2, lon1, lon2]),
        a=np.array([lon1, lon1, lat1, lat1]),
        b=np.array([lon2, lon2, lat2, lat2]),
        pa=np.array([0, 2, 0, 1], np.int64),
        pb=np.array([1, 3, 2, 3], np.int64),
        bound_m=np.asarray(bound_m, dtype=np.float64),
    )


def _gather(layer: _Layer, box: LonLatBox, pieces: _Pieces) -> IntArray:
    """Local ids of POIs inside ``box`` or within a piece's bound (+ slack) of that piece."""
    tree = layer.tree
    assert tree is not None
    lat1, lat2 = math.radians(box.min_lat), math.radians(box.max_lat)
    lon1, lon2 = math.radians(box.min_lon), math.radians(box.max_lon)
    region = _lonlat_box_aabb(np.array([lat1]), np.array([lat2]), np.array([lon1]), np.array([lon2]))
    ids_in, _ = _intersection_v(tree, region[:, :3] - _AABB_MARGIN, region[:, 3:] + _AABB_MARGIN)
    inside = ids_in[
        (layer.lat_deg[ids_in] >= box.min_lat)
        & (layer.lat_deg[ids_in] <= box.max_lat)
        & (layer.lon_deg[ids_in] >= box.min_lon)
        & (layer.lon_deg[ids_in] <= box.max_lon)
    ]
    bound = pieces.bound_m + slack_m(pieces.bound_m)
    chord = 2 * np.sin(np.minimum(bound / EARTH_RADIUS_M, math.pi) / 2) + _AABB_MARGIN
    lat_a = np.where(pieces.kind == _MERIDIAN, pieces.a, pieces.fixed)
    lat_b = np.where(pieces.kind == _MERIDIAN, pieces.b, pieces.fixed)
    lon_a = np.where(pieces.kind == _MERIDIAN, pieces.fixed, pieces.a)
    lon_b = np.where(pieces.kind == _MERIDIAN, pieces.fixed, pieces.b)
    aabb = _lonlat_box_aabb(lat_a, lat_b, lon_a, lon_b)
    ids, counts = _intersection_v(tree, aabb[:, :3] - chord[:, None], aabb[:, 3:] + chord[:, None])
    which = np.repeat(np.arange(len(bound)), counts)
    d = _dist_to_pieces(
        layer.lat_r[ids],
        layer.lon_r[ids],
        pieces.kind[which],
        pieces.fixed[which],
        pieces.a[which],
        pieces.b[which],
    )
    near = ids[d <= bound[which]]
    out: IntArray = np.unique(np.concatenate([inside, near]))
    return out
