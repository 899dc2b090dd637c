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

from kcloak.core.geometry import EARTH_RADIUS_M
from kcloak.core.places import Poi, PoiSet

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
#     edges (two meridian arcs, which are geodesics, and two parallel arcs, which are not). Path
#     length along an edge (meridian: `R·Δφ`; parallel: `R·cos φ·Δλ`) is at least the geodesic
#     distance between any two of its points, so `g` is 1-Lipschitz for path length too.
#
# (b) *Pool: the Lipschitz bound* (any `n`). On an edge from corner `a` to corner `b` of path
#     length `ℓ`, a point `q` at path length `t` from `a` has
#     `g(q) <= min(g(a) + t, g(b) + ℓ - t) <= (g(a) + g(b) + ℓ) / 2`. Any upper bound of `g(a)`
#     may be used; we use the largest distance among `n` actual POIs near `a`, which is one (so
#     how they are found affects only the pool's size, never soundness). If `D_e >= max g` on
#     edge `e`, every answer at a point of `e` lies within `D_e` of `e` (the "stadium"
#     `e ⊕ disk(D_e)`, measured with the exact point-to-arc distance). The *pool* `P` — the POIs
#     inside `R` or within `D_e` of some edge `e` — therefore holds the exact union of (a) and
#     the `n` nearest POIs of every boundary point, so `g` computed over `P` at a boundary point
#     is the true `g` there. If at most `n` POIs match, every matching POI is a candidate.
#
# (c) *Pool: Casper's filter bound* (filters and middle point, for any `n`; for `n = 1` it is
#     exactly Casper's). Let `S_a` be the `n` POIs used at `a` (the filters) and
#     `F_a(q) = max_{o ∈ S_a} d(q, o)`; then `g <= F_a` everywhere, same for `b`. Along an edge
#     every `d(·, o)` is quasi-convex (see below), hence so is `F_a`. For *any* split point `m`
#     of the edge, `g <= F_a` on `[a, m]` and `g <= F_b` on `[m, b]`, so
#     `max g <= max(F_a(a), F_a(m), F_b(m), F_b(b))`; we pick `m` near where `F_a = F_b` (the
#     middle point) among evenly spaced points, but soundness does not depend on how well it is found.
#     Quasi-convexity: along a geodesic arc, `cos d(q(s), o) = C·cos(s/R - θ)`, whose only interior
#     maximum of `d` is the point farthest from `o` on the great circle (`d >= πR/2`); it cannot lie
#     on the edge when `d(a, o) + ℓ < πR/2`, which we require. Along a parallel,
#     `d` increases with the wrapped longitude difference `|λ - λ_o|`, so `d` is quasi-convex
#     unless the edge contains the antipodal meridian `λ_o + π`, which we exclude. Where a
#     condition fails the edge keeps the Lipschitz bound. `D_e` is the smaller of (b) and (c).
#
# (d) *Segment test* (decides each pooled POI). Cut each edge into segments; at each segment end
#     `q_i` compute `g(q_i)` over `P` (exact by (b)) and, for each pooled `o`, the excess
#     `e_i(o) = d(q_i, o) - g(q_i)`. If `o` is an answer at a point `q` of the segment at path
#     length `t` from `q_i` and `h - t` from `q_j`, then `d(q_i, o) <= d(q, o) + t <= g(q) + t
#     <= g(q_i) + 2t`, i.e. `e_i <= 2t`, and likewise `e_j <= 2(h - t)`; hence
#     `max(e_i, 0) + max(e_j, 0) <= 2h`. A pooled POI outside `R` that fails this on every
#     segment is an answer at no boundary point, hence (by (a)) at no point of `R`. A POI with
#     `e_i <= 0` at some sample is an answer there, so it belongs to the exact union. The others
#     (undecided) make us cut every segment on which an undecided POI passes into four parts and
#     test again; cutting stops when twice a segment's length is below `refine_ratio`·g at its
#     ends or the sample budget is spent, and POIs still undecided are kept. Only the POIs that
#     pass on a segment can be an answer at a point of it, so `g` at the new samples is computed
#     over those alone (any `n` POIs give an upper bound of `g`, and an upper bound only makes
#     the test pass more often). Soundness never depends on where the segments are cut.
#
# (e) *Floating point.* Every distance is a haversine on the contract sphere, as the checker
#     computes it; a computed value differs from the real one by ε, about 1e-9 m plus 1e-15
#     relative (up to ~0.1 m only for nearly antipodal points, where asin is ill-conditioned).
#     The checker's answer at `p` uses computed distances, so it may hold an `o` with real
#     `d(p, o) <= g(p) + 2ε`; the chain (a)-(d) then gives each inequality with a few ε more.
#     Every comparison that *excludes* a POI therefore allows `slack_m` (1 mm plus 1e-7
#     relative, ≫ 5ε, and enough for the broker's millimetre rounding of distances): the pool's
#     `dist(o, edge) <= D_e + slack_m(D_e)` and the segment test's `2h + slack_m`. The spatial
#     index queries are prefilters over boxes that provably contain every POI the exact test can
#     accept (unit vectors; a point within angle `δ` of an edge is within the chord `2 sin(δ/2)`
#     of it, hence within that much of the edge's axis-aligned box in each coordinate), with
#     1e-9 margin.
#
# Minimality: range answers are exactly minimal. A kNN candidate is inside `R`, an answer at a
# boundary sample, or within `2h <= refine_ratio·g` of being an answer on some segment (unless
# the sample budget ran out), so the candidate set is the exact union up to that margin.

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

SLACK_REL = 1e-7
"""Relative allowance for floating-point rounding of haversine distances (see the module proof (e))."""
SLACK_ABS_M = 1e-3
"""Absolute allowance (metres) for floating-point rounding of haversine distances."""

_AABB_MARGIN = 1e-9  # unit-sphere coordinates; float noise is ~1e-16
_QUASI_CONVEX_LIMIT_M = 0.9 * math.pi * EARTH_RADIUS_M / 2  # d(a, o) + ℓ must stay below πR/2
_ANTIPODE_MARGIN_RAD = 1e-9
_MERIDIAN, _PARALLEL = 0, 1
_PARTS = 4  # a kNN boundary segment that is cut is cut into this many


def slack_m(bound_m: npt.ArrayLike) -> FloatArray:
    """Rounding allowance added to every distance bound before comparing (module proof (e))."""
    b = np.asarray(bound_m, dtype=np.float64)
    out: FloatArray = b * SLACK_REL + SLACK_ABS_M
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


def _hav_pre(
    lat1: FloatArray, lon1: FloatArray, cos1: FloatArray, lat2: FloatArray, lon2: FloatArray, cos2: FloatArray
) -> FloatArray:
    """:func:`_hav_m` with the cosines of the latitudes given (the same values, computed once)."""
    a = np.sin((lat2 - lat1) / 2) ** 2 + cos1 * cos2 * np.sin((lon2 - lon1) / 2) ** 2
    out: FloatArray = 2 * EARTH_RADIUS_M * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))
    return out


class _Layer:
    """POIs of one category (or all) in order of ``z = sin φ``: radians, unit vectors, and a 3-D
    rtree on the unit vectors when the layer is large (small layers are scanned with numpy)."""

    __slots__ = ("cos_lat", "lat_deg", "lat_r", "lon_deg", "lon_r", "rows", "tree", "xyz", "z")

    def __init__(self, rows: IntArray, lat_deg: FloatArray, lon_deg: FloatArray, *, use_rtree: bool) -> None:
        xyz = _unit_vectors(np.radians(lat_deg), np.radians(lon_deg))
        order = np.argsort(xyz[:, 2], kind="stable")
        self.rows = rows[order]
        self.lat_deg = lat_deg[order]
        self.lon_deg = lon_deg[order]
        self.lat_r = np.radians(self.lat_deg)
        self.lon_r = np.radians(self.lon_deg)
        self.cos_lat = np.cos(self.lat_r)
        self.xyz = np.ascontiguousarray(xyz[order])
        self.z = np.ascontiguousarray(self.xyz[:, 2])
        self.tree: rtree_index.Index | None = None
        if use_rtree and len(rows):
            prop = rtree_index.Property()
            prop.dimension = 3
            stream = ((i, (x, y, z, x, y, z), None) for i, (x, y, z) in enumerate(self.xyz.tolist()))
            self.tree = rtree_index.Index(stream, properties=prop)

    def __len__(self) -> int:
        return len(self.rows)

    def close(self) -> None:
        if self.tree is not None:
            self.tree.close()
            self.tree = None

    def in_boxes(self, mins: FloatArray, maxs: FloatArray) -> tuple[IntArray, IntArray]:
        """Pairs (local id, box index) of POIs whose unit vector lies in an axis-aligned box (m×3 corners)."""
        if self.tree is not None:
            ids, counts = _intersection_v(self.tree, mins, maxs)
            return ids, np.repeat(np.arange(len(mins), dtype=np.int64), counts)
        lo = int(np.searchsorted(self.z, mins[:, 2].min(), side="left"))
        hi = int(np.searchsorted(self.z, maxs[:, 2].max(), side="right"))
        sub = self.xyz[lo:hi]
        hit = np.all((sub[None, :, :] >= mins[:, None, :]) & (sub[None, :, :] <= maxs[:, None, :]), axis=2)
        which, j = np.nonzero(hit)
        return (j + lo).astype(np.int64), which.astype(np.int64)

    def nearest(self, lat: FloatArray, lon: FloatArray, n: int) -> tuple[IntArray, FloatArray]:
        """``n`` POIs near each point (m×n local ids) and the largest haversine among them.

        The POIs are the ``n`` nearest by chord (the spherical order, up to rounding), but any
        ``n`` POIs give an upper bound of ``g`` (module proof (b)); requires ``n < len(self)``.
        """
        q = _unit_vectors(lat, lon)
        if self.tree is None:
            xyz = self.xyz  # dot products spelled out: no BLAS call (and no BLAS threads) per request
            dot = q[:, 0:1] * xyz[:, 0] + q[:, 1:2] * xyz[:, 1] + q[:, 2:3] * xyz[:, 2]
            sets = np.argpartition(-dot, n - 1, axis=1)[:, :n].astype(np.int64)
        else:
            ids, counts = _nearest_v(self.tree, q, n)
            width = int(counts.max())
            row = np.repeat(np.arange(len(lat)), counts)
            col = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
            mat = np.zeros((len(lat), width), np.int64)
            mat[row, col] = ids
            dist = np.full((len(lat), width), np.inf)
            dist[row, col] = _hav_m(lat[row], lon[row], self.lat_r[ids], self.lon_r[ids])
            sets = np.take_along_axis(mat, np.argsort(dist, axis=1, kind="stable")[:, :n], axis=1)
        g: FloatArray = _hav_m(lat[:, None], lon[:, None], self.lat_r[sets], self.lon_r[sets]).max(axis=1)
        return sets, g

    def farthest(self, sets: IntArray, lat: FloatArray, lon: FloatArray) -> FloatArray:
        """``max_{o ∈ set} d(point, o)`` per row (the filter function ``F`` of the module proof (c))."""
        out: FloatArray = _hav_m(lat[:, None], lon[:, None], self.lat_r[sets], self.lon_r[sets]).max(axis=1)
        return out


@dataclass(slots=True)
class _Edges:
    """The four edges of a box: arcs of meridians (``fixed`` = lon) or parallels (``fixed`` = lat), radians."""

    kind: IntArray
    fixed: FloatArray
    a: FloatArray
    b: FloatArray
    pa: IntArray  # corner index of the start point
    pb: IntArray  # corner index of the end point
    bound_m: FloatArray

    def points(self, u: FloatArray, which: IntArray | None = None) -> tuple[FloatArray, FloatArray]:
        """Points at parameter ``u`` ∈ [0, 1] along the edges ``which`` (all four by default)."""
        kind, fixed, a, b = self.kind, self.fixed, self.a, self.b
        if which is not None:
            kind, fixed, a, b = kind[which], fixed[which], a[which], b[which]
        along = a + u * (b - a)
        mer = kind == _MERIDIAN
        return np.where(mer, along, fixed), np.where(mer, fixed, along)

    def length_m(self) -> FloatArray:
        """Path length: a meridian arc is a geodesic; a parallel arc is longer than its chords' geodesics."""
        scale = np.where(self.kind == _MERIDIAN, 1.0, np.cos(self.fixed))
        out: FloatArray = EARTH_RADIUS_M * np.maximum(scale, 0.0) * (self.b - self.a)
        return out


def _edges(box: LonLatBox, bound_m: FloatArray) -> _Edges:
    """Bottom, top (parallels), left, right (meridians); corners 0..3 = SW, SE, NW, NE (see :func:`_corners`)."""
    lat1, lat2 = math.radians(box.min_lat), math.radians(box.max_lat)
    lon1, lon2 = math.radians(box.min_lon), math.radians(box.max_lon)
    return _Edges(
        kind=np.array([_PARALLEL, _PARALLEL, _MERIDIAN, _MERIDIAN], np.int64),
        fixed=np.array([lat1, lat2, lon1, lon2]),
        a=np.array([lon1, lon1, lat1, lat1]),
        b=np.array([lon2, lon2, lat2, lat2]),
        pa=np.array([0, 2, 0, 1], np.int64),
        pb=np.array([1, 3, 2, 3], np.int64),
        bound_m=np.asarray(bound_m, dtype=np.float64),
    )


def _corners(box: LonLatBox) -> tuple[FloatArray, FloatArray]:
    """Latitudes and longitudes (radians) of the corners SW, SE, NW, NE."""
    lat1, lat2 = math.radians(box.min_lat), math.radians(box.max_lat)
    lon1, lon2 = math.radians(box.min_lon), math.radians(box.max_lon)
    return np.array([lat1, lat1, lat2, lat2]), np.array([lon1, lon2, lon1, lon2])


class LbsEngine:
    """Inclusive, near-minimal candidate sets over a lat/lon box for range and kNN queries (§5.3).

    Keyword-only parameters: ``refine_ratio`` (0.001): a kNN boundary segment is no longer cut
    once twice its length is below this fraction of the ``n``-th-NN distance at its ends, so a
    candidate that is no answer anywhere misses by at most that much; ``max_samples`` (2048):
    budget of boundary points where ``g`` is computed per query; ``initial_segments`` (16): at
    most this many segments per edge before cutting (each about half of ``g`` long);
    ``filter_splits`` (16): Casper's middle point is sought among this many evenly spaced points
    of each edge; ``rtree_min_pois`` (4096): layers (categories) with at least this many POIs are
    searched with an rtree, smaller ones are scanned with numpy.
    """

    def __init__(
        self,
        pois: PoiSet,
        *,
        refine_ratio: float = 0.001,
        max_samples: int = 2048,
        initial_segments: int = 16,
        filter_splits: int = 16,
        rtree_min_pois: int = 4096,
    ) -> None:
        if refine_ratio <= 0 or max_samples < 1 or initial_segments < 1 or filter_splits < 2:
            raise ValueError(
                "LbsEngine: needs refine_ratio > 0, max_samples >= 1, initial_segments >= 1, filter_splits >= 2"
            )
        self.pois: tuple[Poi, ...] = pois.pois
        self.refine_ratio = refine_ratio
        self.max_samples = max_samples
        self.initial_segments = initial_segments
        self.filter_splits = filter_splits
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
        self._layers[None] = _Layer(all_rows, lat, lon, use_rtree=len(all_rows) >= rtree_min_pois)
        for cat in sorted(by_cat):
            rows = np.asarray(by_cat[cat], dtype=np.int64)
            self._layers[cat] = _Layer(rows, lat[rows], lon[rows], use_rtree=len(rows) >= rtree_min_pois)

    def close(self) -> None:
        """Release the rtree indexes."""
        for layer in self._layers.values():
            layer.close()

    def categories(self) -> list[tuple[str, int]]:
        """``(category, count)`` for every category, sorted by name."""
        return [(c, len(layer)) for c, layer in self._layers.items() if c is not None]

    def _sorted_rows(self, layer: _Layer, local: IntArray) -> IntArray:
        rows = layer.rows[local]
        out: IntArray = rows[np.argsort(self._rank[rows], kind="stable")]
        return out

    # -- range ---------------------------------------------------------------------------------

    def range_candidates(self, box: LonLatBox, radius_m: float, category: str | None = None) -> IntArray:
        """POI rows (sorted by ``poi_id``) within ``radius_m`` of some point of ``box`` (§5.3; exact, minimal)."""
        layer = self._layers.get(category)
        if layer is None or len(layer) == 0:
            return np.empty(0, np.int64)
        inside, near = _gather(layer, box, _edges(box, np.full(4, float(radius_m))))
        return self._sorted_rows(layer, _unique(np.concatenate([inside, near])))

    # -- knn -----------------------------------------------------------------------------------

    def knn_candidates(self, box: LonLatBox, n: int, category: str | None = None) -> IntArray:
        """POI rows (sorted by ``poi_id``) containing every point's ``n`` nearest, ties included (§5.3)."""
        if n < 1:
            raise ValueError("n: must be at least 1")
        layer = self._layers.get(category)
        if layer is None or len(layer) == 0:
            return np.empty(0, np.int64)
        everything = np.arange(len(layer), dtype=np.int64)
        if len(layer) <= n:
            return self._sorted_rows(layer, everything)
        corner_lat, corner_lon = _corners(box)
        sets, g = layer.nearest(corner_lat, corner_lon, n)
        edges = _edges(box, np.zeros(4))
        edges.bound_m = _edge_bounds(layer, edges, sets, g, self.filter_splits)
        inside, near = _gather(layer, box, edges)
        pool = _unique(np.concatenate([inside, near]))
        if len(pool) < n:  # impossible by the module proof (b); stay inclusive regardless
            return self._sorted_rows(layer, everything)
        if len(pool) > n:
            is_inside = np.zeros(len(pool), np.bool_)
            is_inside[np.searchsorted(pool, inside)] = True
            pool = pool[self._segment_test(layer, edges, pool, is_inside, g, n)]
        return self._sorted_rows(layer, pool)

    def _segment_test(
        self, layer: _Layer, edges: _Edges, pool: IntArray, inside: BoolArray, g_corner: FloatArray, n: int
    ) -> BoolArray:
        """Which pooled POIs are candidates: inside the box or possibly an answer at a boundary point.

        Module proof (d); ``len(pool) > n``, ``g_corner`` are upper bounds of ``g`` at the corners.
        Only the POIs that pass on a segment still being cut can be an answer at a later sample
        point, so ``g`` there is computed over those alone (exact in real arithmetic, an upper
        bound in any case, which is all the test needs).
        """
        lat_c, lon_c, cos_c = layer.lat_r[pool], layer.lon_r[pool], layer.cos_lat[pool]

        def excess(which: IntArray, u: FloatArray) -> tuple[FloatArray, FloatArray]:
            lat, lon = edges.points(u, which)
            d = _hav_pre(lat[:, None], lon[:, None], np.cos(lat)[:, None], lat_c, lon_c, cos_c)
            g = np.partition(d, n - 1, axis=1)[:, n - 1]
            out: FloatArray = d - g[:, None]
            return out, g

        # First cut: segments about half the n-th-NN distance at the corners long (at most
        # ``initial_segments`` per edge), so that the first test already drops most of the pool.
        length = edges.length_m()
        g_edge = np.maximum(np.minimum(g_corner[edges.pa], g_corner[edges.pb]), 1.0)
        k = np.clip(np.ceil(2 * length / g_edge), 1, self.initial_segments).astype(np.int64)
        seg_edge = np.repeat(np.arange(4, dtype=np.int64), k)
        j = np.arange(len(seg_edge)) - np.repeat(np.cumsum(k) - k, k)
        kk = k[seg_edge]
        which = np.concatenate([seg_edge, np.arange(4, dtype=np.int64)])
        e, g = excess(which, np.concatenate([j / kk, np.ones(4)]))
        samples = len(which)
        result: BoolArray = inside | np.any(e <= slack_m(g)[:, None], axis=0)
        # End sample of segment i: the next segment's start, or the edge's end sample.
        nxt = np.where(j == kk - 1, len(seg_edge) + seg_edge, np.arange(len(seg_edge)) + 1)
        u0, u1 = j / kk, (j + 1) / kk
        g0, g1, e0, e1 = g[: len(seg_edge)], g[nxt], e[: len(seg_edge)], e[nxt]
        cols = np.arange(len(pool))  # pool positions of the columns still carried
        und = ~result  # undecided columns
        while True:
            h = length[seg_edge] * (u1 - u0)
            tol = 2 * h + slack_m(2 * h + np.maximum(g0, g1))
            passes = np.maximum(e0, 0.0) + np.maximum(e1, 0.0) <= tol[:, None]
            relevant = passes[:, und].any(axis=1)  # an undecided POI may be an answer there
            carry = passes[relevant].any(axis=0)  # the only POIs that can be an answer there
            und &= carry  # an undecided POI passing nowhere is an answer at no boundary point
            split = relevant & (2 * h > self.refine_ratio * np.minimum(g0, g1))
            count = int(split.sum())
            if not und.any() or count == 0 or samples + count * (_PARTS - 1) > self.max_samples or carry.sum() < n:
                break
            samples += count * (_PARTS - 1)
            keep = relevant & ~split
            cols, und = cols[carry], und[carry]
            lat_c, lon_c, cos_c = lat_c[carry], lon_c[carry], cos_c[carry]
            e0, e1 = e0[:, carry], e1[:, carry]
            # Cut each split segment in _PARTS: its ends and the new inner samples, row by row.
            base = u0[split]
            cut_u = base[:, None] + (u1[split] - base)[:, None] * (np.arange(1, _PARTS) / _PARTS)
            em, gm = excess(np.repeat(seg_edge[split], _PARTS - 1), cut_u.ravel())
            newly = und & np.any(em <= slack_m(gm)[:, None], axis=0)
            result[cols[newly]] = True
            und &= ~newly
            ends_u = np.column_stack([base, cut_u, u1[split]])
            ends_g = np.column_stack([g0[split], gm.reshape(count, _PARTS - 1), g1[split]])
            ends_e = np.concatenate([e0[split][:, None], em.reshape(count, _PARTS - 1, -1), e1[split][:, None]], axis=1)
            seg_edge = np.concatenate([seg_edge[keep], np.repeat(seg_edge[split], _PARTS)])
            u0 = np.concatenate([u0[keep], ends_u[:, :-1].ravel()])
            u1 = np.concatenate([u1[keep], ends_u[:, 1:].ravel()])
            g0 = np.concatenate([g0[keep], ends_g[:, :-1].ravel()])
            g1 = np.concatenate([g1[keep], ends_g[:, 1:].ravel()])
            e0 = np.concatenate([e0[keep], ends_e[:, :-1].reshape(-1, len(cols))])
            e1 = np.concatenate([e1[keep], ends_e[:, 1:].reshape(-1, len(cols))])
        result[cols[und]] = True  # still undecided: kept
        return result


def _edge_bounds(layer: _Layer, edges: _Edges, sets: IntArray, g: FloatArray, splits: int) -> FloatArray:
    """Upper bound of ``g`` on each edge: min(Lipschitz, Casper's filter bound where it is valid) (proof (b), (c)).

    The filter bound holds for any split point ``m``; it is evaluated at ``splits - 1`` evenly
    spaced ones at once and the smallest is kept (the middle point, to within ``1/splits``).
    """
    g_a, g_b = g[edges.pa], g[edges.pb]
    length = edges.length_m()
    lipschitz: FloatArray = (g_a + g_b + length) / 2
    which = np.repeat(np.arange(4, dtype=np.int64), splits + 1)
    lat_m, lon_m = edges.points(np.tile(np.arange(splits + 1) / splits, 4), which)
    f_a = layer.farthest(sets[edges.pa][which], lat_m, lon_m).reshape(4, splits + 1)
    f_b = layer.farthest(sets[edges.pb][which], lat_m, lon_m).reshape(4, splits + 1)
    s_a, s_b = sets[edges.pa], sets[edges.pb]  # (4, n) local ids
    valid = _quasi_convex(layer, edges, s_a, s_b, np.maximum(g_a, f_b[:, 0]), length)
    filt = np.maximum(np.maximum(g_a, g_b), np.maximum(f_a, f_b)[:, 1:splits].min(axis=1))
    out: FloatArray = np.where(valid, np.minimum(lipschitz, filt), lipschitz)
    return out


def _quasi_convex(
    layer: _Layer, edges: _Edges, s_a: IntArray, s_b: IntArray, far_from_a: FloatArray, length: FloatArray
) -> BoolArray:
    """Edges along which the distance to every filter POI is quasi-convex (module proof (c))."""
    mer_ok = far_from_a + length < _QUASI_CONVEX_LIMIT_M
    filters = np.concatenate([s_a, s_b], axis=1)
    anti = layer.lon_r[filters] + math.pi  # (4, 2n)
    anti = np.where(anti > math.pi, anti - 2 * math.pi, anti)
    lo = (edges.a - _ANTIPODE_MARGIN_RAD)[:, None]
    hi = (edges.b + _ANTIPODE_MARGIN_RAD)[:, None]
    par_ok = ~np.any(_lon_in(anti, lo, hi), axis=1)
    out: BoolArray = np.where(edges.kind == _MERIDIAN, mer_ok, par_ok)
    return out


def _nearest_v(tree: rtree_index.Index, points: FloatArray, n: int) -> tuple[IntArray, IntArray]:
    """Typed wrapper of rtree's bulk k-nearest query (ties included): ids and per-point counts."""
    ids, counts = tree.nearest_v(points, points, num_results=n)  # type: ignore[no-untyped-call]  # rtree 1.4 leaves it unannotated
    return np.asarray(ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)


def _intersection_v(tree: rtree_index.Index, mins: FloatArray, maxs: FloatArray) -> tuple[IntArray, IntArray]:
    """Typed wrapper of rtree's bulk box query: ids and per-box counts."""
    ids, counts = tree.intersection_v(mins, maxs)  # type: ignore[no-untyped-call]  # rtree 1.4 leaves it unannotated
    return np.asarray(ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)


def _gather(layer: _Layer, box: LonLatBox, edges: _Edges) -> tuple[IntArray, IntArray]:
    """Local ids of POIs inside ``box``, and of POIs within an edge's bound (+ slack) of that edge."""
    corner_lat, corner_lon = _corners(box)
    mer = edges.kind == _MERIDIAN
    lat_a = np.concatenate([corner_lat[:1], np.where(mer, edges.a, edges.fixed)])
    lat_b = np.concatenate([corner_lat[3:], np.where(mer, edges.b, edges.fixed)])
    lon_a = np.concatenate([corner_lon[:1], np.where(mer, edges.fixed, edges.a)])
    lon_b = np.concatenate([corner_lon[3:], np.where(mer, edges.fixed, edges.b)])
    aabb = _lonlat_box_aabb(lat_a, lat_b, lon_a, lon_b)  # the region, then the four edges
    bound = edges.bound_m + slack_m(edges.bound_m)
    chord = 2 * np.sin(np.minimum(bound / EARTH_RADIUS_M, math.pi) / 2) + _AABB_MARGIN
    margin = np.concatenate([[_AABB_MARGIN], chord])[:, None]
    ids, which = layer.in_boxes(aabb[:, :3] - margin, aabb[:, 3:] + margin)
    in_region = which == 0
    ids_in = ids[in_region]
    inside = ids_in[
        (layer.lat_deg[ids_in] >= box.min_lat)
        & (layer.lat_deg[ids_in] <= box.max_lat)
        & (layer.lon_deg[ids_in] >= box.min_lon)
        & (layer.lon_deg[ids_in] <= box.max_lon)
    ]
    ids, which = ids[~in_region], which[~in_region] - 1
    d = _dist_to_pieces(
        layer.lat_r[ids], layer.lon_r[ids], edges.kind[which], edges.fixed[which], edges.a[which], edges.b[which]
    )
    return inside, _unique(ids[d <= bound[which]])


def _unique(ids: IntArray) -> IntArray:
    """Sorted distinct values (``np.unique`` without its one-off import of ``numpy.ma`` on first use)."""
    s = np.sort(ids)
    out: IntArray = s[np.concatenate([[True], s[1:] != s[:-1]])] if len(s) else s
    return out
