"""PrivacyGrid (Bamba, Liu, Pesti, Wang, WWW 2008): k-anonymity with location l-diversity (CONCEPTS §4.6).

Regions are rectangles of cells of the micro-degree quadtree grid (:mod:`kcloak.cloaking.grid`) at one
level, grown from the querier's cell (bottom-up) or shrunk from the largest admissible rectangle
centred on it (top-down). User counts of cell rectangles come from a per-view summed-area table,
place categories (§1.6) from the places layer indexed once per cloaker; the published bbox is
counted exactly (§2.2, §4.0).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.cloakers.base import BatchResult, CloakMode, CloakResult, Region, cloak_each, refuse
from kcloak.cloaking.grid import GRID_BITS, GRID_OFFSET, MAX_LEVEL, grid_coords
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import (
    EARTH_RADIUS_M,
    WORLD_LAT_UDEG,
    WORLD_LON_UDEG,
    BBox,
    coordinate_keys,
    expand_to_area,
)
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

I64 = npt.NDArray[np.int64]
Rect = tuple[int, int, int, int]
"""A cell rectangle ``(x0, y0, x1, y1)``, inclusive, in cell indices of the cloaker's level."""

DEFAULT_LEVEL = 18
"""Level-18 cells are 2^11 = 2048 µdeg wide: ≈ 228 m north–south everywhere and ≈ 228·cos φ m
east–west (175 m at Beijing, 114 m at 60°), the 100–250 m cells of the paper's evaluation."""

Mode = Literal["hybrid", "bottom_up", "top_down"]
GrowCriterion = Literal["density", "count"]
ShrinkCriterion = Literal["fewest_users", "fewest_users_per_cell"]

_R2 = EARTH_RADIUS_M * EARTH_RADIUS_M
_WINDOW_BLOCK_BITS = 8  # window mode: blocks of 256 × 256 cells, a window is 3 × 3 blocks
_MODES = ("hybrid", "bottom_up", "top_down")
_GROW = ("density", "count")
_SHRINK = ("fewest_users", "fewest_users_per_cell")


@functools.cache
def _bundled_places() -> PlacesLayer:
    """The bundled Beijing places layer, read once per process."""
    return PlacesLayer.bundled()


def _least_radius(step_m: float, other_m: float, *, strict: bool) -> int:
    """Smallest radius ``r ≥ 1`` with ``r · step_m ≥ other_m`` (``>`` when ``strict``), in floats."""

    def passes(r: int) -> bool:
        return r * step_m > other_m if strict else r * step_m >= other_m

    r = max(1, math.ceil(other_m / step_m))
    while r > 1 and passes(r - 1):
        r -= 1
    while not passes(r):
        r += 1
    return r


class _UserGrid:
    """User counts of one window of cells as a flat summed-area table (§4.6).

    ``count`` clamps to the table (cells outside hold no users); ``bounds`` limit where a
    region may grow: the world in dense mode, the window itself in window mode.
    """

    __slots__ = ("bounds", "mx", "my", "ox", "oy", "sat", "w1")

    def __init__(self, cx: I64, cy: I64, ox: int, oy: int, mx: int, my: int, bounds: Rect) -> None:
        w, h = mx - ox + 1, my - oy + 1
        counts = np.bincount((cy - oy) * w + (cx - ox), minlength=w * h).reshape(h, w)
        sat = np.zeros((h + 1, w + 1), np.int32)
        np.cumsum(np.cumsum(counts, axis=0), axis=1, out=sat[1:, 1:])
        self.ox, self.oy, self.mx, self.my = ox, oy, mx, my
        self.w1 = w + 1
        self.sat = sat.reshape(-1).data
        self.bounds = bounds

    def count(self, x0: int, y0: int, x1: int, y1: int) -> int:
        """Users in the cell rectangle (every user in exactly one cell). O(1)."""
        if x0 < self.ox:
            x0 = self.ox
        if y0 < self.oy:
            y0 = self.oy
        if x1 > self.mx:
            x1 = self.mx
        if y1 > self.my:
            y1 = self.my
        if x0 > x1 or y0 > y1:
            return 0
        s, w1 = self.sat, self.w1
        a = (y1 - self.oy + 1) * w1
        b = (y0 - self.oy) * w1
        c1 = x1 - self.ox + 1
        c0 = x0 - self.ox
        return int(s[a + c1] - s[b + c1] - s[a + c0] + s[b + c0])


class _ViewGrid:
    """Per-view state: each user's cell and the summed-area table(s) (cached in ``view.cache``).

    Dense mode: one table over the populated extent. When that extent exceeds ``max_sat_cells``
    (users on several continents), window mode: a table per 3 × 3 block window, built on demand.
    """

    __slots__ = ("cx", "cy", "dense", "windows", "world")

    def __init__(self, view: IndexView, level: int, max_sat_cells: int) -> None:
        s = GRID_BITS - level
        self.cx: I64 = view.gx >> s
        self.cy: I64 = view.gy >> s
        self.world: Rect = (
            (GRID_OFFSET - WORLD_LON_UDEG) >> s,
            (GRID_OFFSET - WORLD_LAT_UDEG) >> s,
            (GRID_OFFSET + WORLD_LON_UDEG) >> s,
            (GRID_OFFSET + WORLD_LAT_UDEG) >> s,
        )
        self.windows: dict[tuple[int, int], _UserGrid] = {}
        self.dense: _UserGrid | None = None
        if len(view):
            ox, mx = int(self.cx.min()), int(self.cx.max())
            oy, my = int(self.cy.min()), int(self.cy.max())
            if (mx - ox + 1) * (my - oy + 1) <= max_sat_cells:
                self.dense = _UserGrid(self.cx, self.cy, ox, oy, mx, my, self.world)

    def grid_for(self, qx: int, qy: int) -> _UserGrid:
        if self.dense is not None:
            return self.dense
        bx, by = qx >> _WINDOW_BLOCK_BITS, qy >> _WINDOW_BLOCK_BITS
        g = self.windows.get((bx, by))
        if g is None:
            wx0, wy0, wx1, wy1 = self.world
            x0 = max((bx - 1) << _WINDOW_BLOCK_BITS, wx0)
            y0 = max((by - 1) << _WINDOW_BLOCK_BITS, wy0)
            x1 = min(((bx + 2) << _WINDOW_BLOCK_BITS) - 1, wx1)
            y1 = min(((by + 2) << _WINDOW_BLOCK_BITS) - 1, wy1)
            m = (self.cx >= x0) & (self.cx <= x1) & (self.cy >= y0) & (self.cy <= y1)
            g = _UserGrid(self.cx[m], self.cy[m], x0, y0, x1, y1, (x0, y0, x1, y1))
            self.windows[(bx, by)] = g
        return g


class _PlaceGrid:
    """The places layer on the cloaker's grid: category counts of cell strips and rectangles (§1.6).

    Rows and columns map to the places they hold, sorted along the strip, so the categories of a
    strip are one ``bincount`` of a slice; exact counts in a published bbox use the places' keys.
    """

    def __init__(self, places: PlacesLayer, level: int) -> None:
        s = GRID_BITS - level
        self.n_categories = len(places.category_names)
        lon_key = coordinate_keys(places.lon)
        lat_key = coordinate_keys(places.lat)
        code = np.asarray(places.category_code, dtype=np.int64)
        pcx = grid_coords(lon_key, "lon") >> s
        pcy = grid_coords(lat_key, "lat") >> s
        self.rows = self._strips(pcy, pcx, code)
        self.cols = self._strips(pcx, pcy, code)
        o = np.argsort(pcx, kind="stable")
        self._x_sorted: list[int] = pcx[o].tolist()
        self._y_by_x = pcy[o]
        self._code_by_x = code[o]
        o = np.argsort(lon_key, kind="stable")
        self._lon_key_sorted: list[int] = lon_key[o].tolist()
        self._lat_key_by_lon = lat_key[o]
        self._code_by_lon = code[o]
        self._lat_key_list: list[int] = self._lat_key_by_lon.tolist()
        self._code_list: list[int] = self._code_by_lon.tolist()

    @staticmethod
    def _strips(major: I64, minor: I64, code: I64) -> dict[int, tuple[list[int], I64]]:
        out: dict[int, tuple[list[int], I64]] = {}
        if len(major) == 0:
            return out
        o = np.lexsort((minor, major))
        major, minor, code = major[o], minor[o], code[o]
        starts = np.flatnonzero(np.r_[True, major[1:] != major[:-1]])
        ends = np.r_[starts[1:], len(major)]
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            out[int(major[a])] = (minor[a:b].tolist(), code[a:b].copy())
        return out

    def strip(self, table: dict[int, tuple[list[int], I64]], at: int, lo: int, hi: int) -> I64 | None:
        """Category counts of the places in one row (or column) ``at`` between ``lo`` and ``hi``."""
        entry = table.get(at)
        if entry is None:
            return None
        pos, code = entry
        i = bisect.bisect_left(pos, lo)
        j = bisect.bisect_right(pos, hi, lo=i)
        if i == j:
            return None
        out: I64 = np.bincount(code[i:j], minlength=self.n_categories)
        return out

    def rect(self, x0: int, y0: int, x1: int, y1: int) -> I64:
        """Category counts of the places in a cell rectangle."""
        i = bisect.bisect_left(self._x_sorted, x0)
        j = bisect.bisect_right(self._x_sorted, x1, lo=i)
        ys = self._y_by_x[i:j]
        sel = self._code_by_x[i:j][(ys >= y0) & (ys <= y1)]
        out: I64 = np.bincount(sel, minlength=self.n_categories)
        return out

    def any_in(self, x0: int, y0: int, x1: int, y1: int) -> bool:
        """Whether any place lies in a cell rectangle."""
        i = bisect.bisect_left(self._x_sorted, x0)
        j = bisect.bisect_right(self._x_sorted, x1, lo=i)
        if i == j:
            return False
        ys = self._y_by_x[i:j]
        return bool(np.any((ys >= y0) & (ys <= y1)))

    def categories_in(self, bbox: BBox) -> int:
        """Distinct categories of places inside a published bbox: strictly, but at the world edge (exact)."""
        lo_lon, lo_lat, hi_lon, hi_lat = bbox.key_bounds()
        keys = self._lon_key_sorted
        i = bisect.bisect_left(keys, lo_lon)
        j = bisect.bisect_right(keys, hi_lon, lo=i)
        if j - i <= 64:  # the usual case: a few places in the longitude band
            lat, code = self._lat_key_list, self._code_list
            return len({code[m] for m in range(i, j) if lo_lat <= lat[m] <= hi_lat})
        lat_a = self._lat_key_by_lon[i:j]
        return len(np.unique(self._code_by_lon[i:j][(lat_a >= lo_lat) & (lat_a <= hi_lat)]))


@dataclass(slots=True)
class _Track:
    """What the searches saw, for the refusal code of §4.6."""

    k_fit: bool = False  # a rectangle within max_area_m2 held ≥ k users
    kl_fit: bool = False  # … and ≥ l categories


class PrivacyGridCloak:
    """PrivacyGrid cloaker (§4.6): not reciprocal, honours ``l > 1`` with the places layer.

    Keyword arguments:
        places: places layer for l-diversity (default ``None``: the bundled Beijing POIs, read
            once per process).
        level: grid level of the µdeg quadtree (default 18: cells of 2048 µdeg ≈ 228 m N–S,
            ≈ 175 m E–W at Beijing; see :data:`DEFAULT_LEVEL`).
        mode: ``"hybrid"`` (default), ``"bottom_up"`` or ``"top_down"``.
        grow_criterion: bottom-up choice among the four growths ⚠: ``"density"`` (default: most
            added users per added cell; once k is met, most new categories per added cell, then
            users per cell) or ``"count"`` (the same without dividing by the added cells).
        shrink_criterion: top-down choice among the four shrinks ⚠: ``"fewest_users"`` (default)
            or ``"fewest_users_per_cell"``. Ties on either criterion go to the rectangle whose
            longer side (in cells) is shorter, then to the fixed order N, E, S, W.
        hybrid_radius_cells: radius r of the neighbourhood, the (2r+1)² cells around the
            querier's cell, that decides the hybrid mode ⚠ (default 2).
        hybrid_density: the hybrid mode runs bottom-up when that neighbourhood holds at least
            ``hybrid_density · k`` users (small boxes expected), top-down otherwise ⚠ (default 1.0).
        fallback: when the chosen search finds nothing, try the other before refusing
            (default ``True``), so a refusal means neither search found a region.
        max_sat_cells: largest populated extent, in cells, covered by one summed-area table
            (default 2^22 = 4,194,304); beyond it (users on several continents) each query uses a
            table over the 3 × 3 blocks of 256² cells around its cell, which regions cannot leave.

    Regions are cell rectangles published with ``IndexView.cell_rect_bbox``; ``k_achieved`` is
    the table count plus ``IndexView.edge_extras`` (exact), recounted after any A_min growth;
    ``l_achieved`` counts the categories of places inside the final bbox. ``anon_set`` is left
    empty: the counted users are everyone inside the bbox.
    """

    name: ClassVar[str] = "privacygrid"
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = True
    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    vectorized: ClassVar[bool] = False  # cloak_batch is one cloak per request

    def __init__(
        self,
        *,
        places: PlacesLayer | None = None,
        level: int = DEFAULT_LEVEL,
        mode: Mode = "hybrid",
        grow_criterion: GrowCriterion = "density",
        shrink_criterion: ShrinkCriterion = "fewest_users",
        hybrid_radius_cells: int = 2,
        hybrid_density: float = 1.0,
        fallback: bool = True,
        max_sat_cells: int = 1 << 22,
    ) -> None:
        if not 1 <= level <= MAX_LEVEL:
            raise ValueError(f"level: must be within [1, {MAX_LEVEL}]")
        if mode not in _MODES:
            raise ValueError(f"mode: must be one of {', '.join(_MODES)}")
        if grow_criterion not in _GROW:
            raise ValueError(f"grow_criterion: must be one of {', '.join(_GROW)}")
        if shrink_criterion not in _SHRINK:
            raise ValueError(f"shrink_criterion: must be one of {', '.join(_SHRINK)}")
        if hybrid_radius_cells < 0 or not hybrid_density >= 0:
            raise ValueError("hybrid_radius_cells, hybrid_density: must not be negative")
        if max_sat_cells < 1:
            raise ValueError("max_sat_cells: must be positive")
        self.places = places if places is not None else _bundled_places()
        self.level = level
        self.mode: Mode = mode
        self.grow_by_density = grow_criterion == "density"
        self.shrink_per_cell = shrink_criterion == "fewest_users_per_cell"
        self.hybrid_radius_cells = hybrid_radius_cells
        self.hybrid_density = hybrid_density
        self.fallback = fallback
        self.max_sat_cells = max_sat_cells
        self._shift = GRID_BITS - level
        self._cell_udeg = 1 << self._shift
        self._pg = _PlaceGrid(self.places, level)
        self._sines: dict[int, float] = {}
        self._cache_key = ("privacygrid", level, max_sat_cells)

    # -- per-view state ----------------------------------------------------------------------
    def _state(self, view: IndexView) -> _ViewGrid:
        st: _ViewGrid | None = view.cache.get(self._cache_key)
        if st is None:
            st = _ViewGrid(view, self.level, self.max_sat_cells)
            view.cache[self._cache_key] = st
        return st

    def cell_of(self, view: IndexView, row: int) -> tuple[int, int]:
        """Cell ``(cx, cy)`` of the user at ``row`` at the cloaker's level."""
        st = self._state(view)
        return int(st.cx[row]), int(st.cy[row])

    def published_count(self, view: IndexView, rect: Rect) -> int:
        """Exact users strictly inside the published bbox of a cell rectangle: table count + edge extras.

        Equal to ``view.count_in(view.cell_rect_bbox(level, *rect))`` (tested); falls back to
        that scan where the bbox is clipped at the world edge.
        """
        x0, y0, x1, y1 = rect
        st = self._state(view)
        bbox = view.cell_rect_bbox(self.level, x0, y0, x1, y1)
        lon0, lat0 = (x0 << self._shift) - GRID_OFFSET, (y0 << self._shift) - GRID_OFFSET
        lon1, lat1 = ((x1 + 1) << self._shift) - GRID_OFFSET, ((y1 + 1) << self._shift) - GRID_OFFSET
        g = st.grid_for(x0, y0)
        bx0, by0, bx1, by1 = g.bounds
        if (
            bbox.min_lon_udeg != lon0 - 1
            or bbox.min_lat_udeg != lat0 - 1
            or bbox.max_lon_udeg != lon1
            or bbox.max_lat_udeg != lat1
            or not (bx0 <= x0 and by0 <= y0 and x1 <= bx1 and y1 <= by1)
        ):
            return view.count_in(bbox)
        return g.count(x0, y0, x1, y1) + view.edge_extras(bbox, lon0, lat0)

    def _area(self, x0: int, y0: int, x1: int, y1: int) -> float:
        """Contract area of the published bbox of a cell rectangle (mirrors ``cell_rect_bbox``)."""
        s = self._shift
        lon0 = (x0 << s) - GRID_OFFSET - 1
        lat0 = (y0 << s) - GRID_OFFSET - 1
        lon1 = ((x1 + 1) << s) - GRID_OFFSET
        lat1 = ((y1 + 1) << s) - GRID_OFFSET
        if lon0 < -WORLD_LON_UDEG or lat0 < -WORLD_LAT_UDEG or lon1 > WORLD_LON_UDEG or lat1 > WORLD_LAT_UDEG:
            bbox = BBox(
                max(lon0, -WORLD_LON_UDEG),
                max(lat0, -WORLD_LAT_UDEG),
                min(max(lon1, -WORLD_LON_UDEG + 1), WORLD_LON_UDEG),
                min(max(lat1, -WORLD_LAT_UDEG + 1), WORLD_LAT_UDEG),
            )
            return bbox.area_m2
        # The same float operations as bbox_area_m2, with the sines of row edges memoized.
        sines = self._sines
        s0 = sines.get(lat0)
        if s0 is None:
            s0 = sines[lat0] = math.sin(math.radians(lat0 / 1e6))
        s1 = sines.get(lat1)
        if s1 is None:
            s1 = sines[lat1] = math.sin(math.radians(lat1 / 1e6))
        return _R2 * math.radians(lon1 / 1e6 - lon0 / 1e6) * abs(s1 - s0)

    # -- the cloaker protocol ----------------------------------------------------------------
    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        """Cloak the user at ``row`` (§4.6): a cell rectangle with ≥ k users and ≥ l categories."""
        k, need_l = profile.k, profile.l > 1
        if need_l and len(self.places) == 0:
            return refuse(ReasonCode.UNSUPPORTED, "no places layer for l-diversity")
        if len(view) < k:
            return refuse(ReasonCode.K_UNREACHABLE)
        st = self._state(view)
        qx, qy = int(st.cx[row]), int(st.cy[row])
        g = st.grid_for(qx, qy)
        if self.mode == "hybrid":
            r = self.hybrid_radius_cells
            dense = g.count(qx - r, qy - r, qx + r, qy + r) >= self.hybrid_density * k
            first_bottom_up = dense
        else:
            first_bottom_up = self.mode == "bottom_up"
        track = _Track()
        order = (True, False) if first_bottom_up else (False, True)
        for bottom_up in order[: 2 if self.fallback else 1]:
            if bottom_up:
                rect = self._bottom_up(g, qx, qy, profile, track)
            else:
                rect = self._top_down(g, qx, qy, float(view.lat[row]), profile, track)
            if rect is not None:
                region = self._finish(view, g, rect, profile)
                if region is not None:
                    return region
        if need_l and track.k_fit and not track.kl_fit:
            return refuse(ReasonCode.L_UNREACHABLE)
        return refuse(ReasonCode.AREA_EXCEEDED)

    def cloak_batch(self, view: IndexView, rows: I64, profiles: ProfileArrays) -> BatchResult:
        """One :meth:`cloak` per request against the shared per-view tables."""
        return cloak_each(self, view, rows, profiles)

    # -- searches ----------------------------------------------------------------------------
    def _bottom_up(self, g: _UserGrid, qx: int, qy: int, prof: PrivacyProfile, track: _Track) -> Rect | None:
        """Grow one row or column at a time from the querier's cell (§4.6 ``pg_bottom_up``)."""
        k, l_min, amax = prof.k, prof.l, prof.max_area_m2
        need_l = l_min > 1
        x0 = x1 = qx
        y0 = y1 = qy
        if self._area(x0, y0, x1, y1) > amax:
            return None
        count, area, pg = g.count, self._area, self._pg
        bx0, by0, bx1, by1 = g.bounds
        density = self.grow_by_density
        users = count(x0, y0, x1, y1)
        cats: I64 | None = pg.rect(x0, y0, x1, y1) if need_l else None
        ncat = int(np.count_nonzero(cats)) if cats is not None else 0
        while True:
            if users >= k:
                track.k_fit = True
                if ncat >= l_min or not need_l:
                    track.kl_fit = True
                    return x0, y0, x1, y1
            want_cats = need_l and users >= k
            best = -1
            b_num = b_num2 = b_den = b_side = 0
            b_strip: I64 | None = None
            b_du = 0
            for d in range(4):
                if d == 0:  # N
                    if y1 >= by1:
                        continue
                    nb = (x0, y0, x1, y1 + 1)
                    sx0, sy0, sx1, sy1 = x0, y1 + 1, x1, y1 + 1
                elif d == 1:  # E
                    if x1 >= bx1:
                        continue
                    nb = (x0, y0, x1 + 1, y1)
                    sx0, sy0, sx1, sy1 = x1 + 1, y0, x1 + 1, y1
                elif d == 2:  # S
                    if y0 <= by0:
                        continue
                    nb = (x0, y0 - 1, x1, y1)
                    sx0, sy0, sx1, sy1 = x0, y0 - 1, x1, y0 - 1
                else:  # W
                    if x0 <= bx0:
                        continue
                    nb = (x0 - 1, y0, x1, y1)
                    sx0, sy0, sx1, sy1 = x0 - 1, y0, x0 - 1, y1
                if area(*nb) > amax:
                    continue
                du = count(sx0, sy0, sx1, sy1)
                strip: I64 | None = None
                if want_cats:
                    assert cats is not None
                    strip = pg.strip(pg.rows, sy0, sx0, sx1) if d % 2 == 0 else pg.strip(pg.cols, sx0, sy0, sy1)
                    num = 0 if strip is None else int(np.count_nonzero((strip > 0) & (cats == 0)))
                    num2 = du
                else:
                    num, num2 = du, 0
                den = (sx1 - sx0 + 1) * (sy1 - sy0 + 1) if density else 1
                side = max(nb[2] - nb[0], nb[3] - nb[1])
                if best < 0:
                    better = True
                else:
                    lhs, rhs = num * b_den, b_num * den
                    if lhs == rhs:
                        lhs, rhs = num2 * b_den, b_num2 * den
                    better = lhs > rhs or (lhs == rhs and side < b_side)
                if better:
                    best, b_num, b_num2, b_den, b_side, b_strip, b_du = d, num, num2, den, side, strip, du
            if best < 0:
                return None
            if cats is not None and not want_cats:  # categories of the chosen strip only
                if best % 2 == 0:
                    row = y1 + 1 if best == 0 else y0 - 1
                    b_strip = pg.strip(pg.rows, row, x0, x1)
                else:
                    col = x1 + 1 if best == 1 else x0 - 1
                    b_strip = pg.strip(pg.cols, col, y0, y1)
            if best == 0:
                y1 += 1
            elif best == 1:
                x1 += 1
            elif best == 2:
                y0 -= 1
            else:
                x0 -= 1
            users += b_du
            if b_strip is not None and cats is not None:
                cats = cats + b_strip
                ncat = int(np.count_nonzero(cats))

    def _start_box(self, g: _UserGrid, qx: int, qy: int, lat: float, amax: float) -> Rect | None:
        """Largest rectangle centred on the querier's cell whose published area fits ``amax``."""
        h_m = EARTH_RADIUS_M * math.radians(self._cell_udeg / 1e6)
        w_m = max(h_m * math.cos(math.radians(lat)), 1e-9)
        side = math.sqrt(amax)
        rx = max(0, int((side / w_m - 1) // 2))
        ry = max(0, int((side / h_m - 1) // 2))
        bx0, by0, bx1, by1 = g.bounds
        # Radii beyond these reach the bounds on both sides: the clipped rectangle stays the same
        # (near the poles, where cells are narrow, rx can exceed the world's width many times).
        reach_x, reach_y = max(qx - bx0, bx1 - qx), max(qy - by0, by1 - qy)
        while True:
            rect = (max(qx - rx, bx0), max(qy - ry, by0), min(qx + rx, bx1), min(qy + ry, by1))
            if self._area(*rect) <= amax:
                return rect
            if rx == 0 and ry == 0:
                return None
            if ry == 0 or (rx > 0 and rx * w_m >= ry * h_m):
                # Skip the steps that shrink rx without changing the rectangle: rx keeps shrinking
                # down to the smallest radius that still passes this test.
                rx = max(reach_x, _least_radius(w_m, ry * h_m, strict=False) - 1) if rx > reach_x + 1 else rx - 1
            else:
                ry = max(reach_y, _least_radius(h_m, rx * w_m, strict=True) - 1) if ry > reach_y + 1 else ry - 1

    def _top_down(self, g: _UserGrid, qx: int, qy: int, lat: float, prof: PrivacyProfile, track: _Track) -> Rect | None:
        """Shrink the largest admissible rectangle one row or column at a time (§4.6 ``pg_top_down``)."""
        k, l_min, amin = prof.k, prof.l, prof.min_area_m2
        need_l = l_min > 1
        start = self._start_box(g, qx, qy, lat, prof.max_area_m2)
        if start is None:
            return None
        x0, y0, x1, y1 = start
        count, area, pg = g.count, self._area, self._pg
        users = count(x0, y0, x1, y1)
        if users < k:
            return None
        track.k_fit = True
        cats: I64 | None = pg.rect(x0, y0, x1, y1) if need_l else None
        ncat = int(np.count_nonzero(cats)) if cats is not None else 0
        if need_l and ncat < l_min:
            return None
        track.kl_fit = True
        per_cell = self.shrink_per_cell
        while True:
            best = -1
            b_du = b_den = b_side = b_ncat = 0
            b_strip: I64 | None = None
            for d in range(4):
                if d == 0:  # N: drop the top row
                    if y1 <= qy:
                        continue
                    nb = (x0, y0, x1, y1 - 1)
                    sx0, sy0, sx1, sy1 = x0, y1, x1, y1
                elif d == 1:  # E
                    if x1 <= qx:
                        continue
                    nb = (x0, y0, x1 - 1, y1)
                    sx0, sy0, sx1, sy1 = x1, y0, x1, y1
                elif d == 2:  # S
                    if y0 >= qy:
                        continue
                    nb = (x0, y0 + 1, x1, y1)
                    sx0, sy0, sx1, sy1 = x0, y0, x1, y0
                else:  # W
                    if x0 >= qx:
                        continue
                    nb = (x0 + 1, y0, x1, y1)
                    sx0, sy0, sx1, sy1 = x0, y0, x0, y1
                du = count(sx0, sy0, sx1, sy1)
                if users - du < k:
                    continue
                strip: I64 | None = None
                new_ncat = ncat
                if need_l:
                    assert cats is not None
                    strip = pg.strip(pg.rows, sy0, sx0, sx1) if d % 2 == 0 else pg.strip(pg.cols, sx0, sy0, sy1)
                    if strip is not None:
                        new_ncat = ncat - int(np.count_nonzero((strip > 0) & (cats == strip)))
                        if new_ncat < l_min:
                            continue
                if amin > 0 and area(*nb) < amin:
                    continue
                den = (sx1 - sx0 + 1) * (sy1 - sy0 + 1) if per_cell else 1
                side = max(nb[2] - nb[0], nb[3] - nb[1])
                if best < 0:
                    better = True
                else:
                    lhs, rhs = du * b_den, b_du * den
                    better = lhs < rhs or (lhs == rhs and side < b_side)
                if better:
                    best, b_du, b_den, b_side, b_strip, b_ncat = d, du, den, side, strip, new_ncat
            if best < 0:
                return x0, y0, x1, y1
            steps = 1
            if b_du == 0 and b_strip is None:  # an empty strip: as many of them as the greedy would take
                steps = self._empty_run(g, (x0, y0, x1, y1), best, qx, qy, amin, need_l)
            if best == 0:
                y1 -= steps
            elif best == 1:
                x1 -= steps
            elif best == 2:
                y0 += steps
            else:
                x0 += steps
            users -= b_du
            if b_strip is not None and cats is not None:
                cats = cats - b_strip
                ncat = b_ncat

    def _empty_run(self, g: _UserGrid, rect: Rect, d: int, qx: int, qy: int, amin: float, need_l: bool) -> int:
        """How many strips the top-down greedy drops in a row from side ``d`` of ``rect``, ≥ 1.

        Called when the greedy's choice at ``rect`` is a strip without users (and, for ``l > 1``,
        without places). Dropping it changes neither the users nor the categories, so the greedy
        takes the next strip on side ``d`` too as long as that one is empty as well, the area stays
        ≥ ``amin``, the querier's cell is not reached, and no other side could win the choice: one
        wins only with an empty strip of its own and a shorter longer side (or an equal one and an
        earlier place in N, E, S, W). Each condition, checked after ``m`` steps, implies it at every
        step before (strips only shrink, the longer-side order only turns toward the other sides
        once), so the longest such run is found by galloping and bisection, and the answer is the one the
        one-strip-at-a-time greedy gives, in O(log) table lookups instead of one step per strip.
        """
        x0, y0, x1, y1 = rect
        room = (y1 - qy, x1 - qx, qy - y0, qx - x0)
        last = room[d]
        if last <= 1:
            return 1
        count, pg = g.count, self._pg

        def after(r: Rect, side: int, j: int) -> Rect:
            a0, b0, a1, b1 = r
            if side == 0:
                return a0, b0, a1, b1 - j
            if side == 1:
                return a0, b0, a1 - j, b1
            if side == 2:
                return a0, b0 + j, a1, b1
            return a0 + j, b0, a1, b1

        def block(r: Rect, side: int, m: int) -> Rect:
            """The ``m`` strips of ``r`` next to its side ``side``."""
            extent = r[2] - r[0] + 1 if side % 2 else r[3] - r[1] + 1
            return after(r, (side + 2) % 4, extent - m)

        def longer(r: Rect) -> int:
            return max(r[2] - r[0], r[3] - r[1])

        def ok(m: int) -> bool:
            gone = block(rect, d, m)
            if count(*gone) or (need_l and pg.any_in(*gone)):
                return False
            if amin > 0 and self._area(*after(rect, d, m)) < amin:
                return False
            cur = after(rect, d, m - 1)  # the rectangle before the m-th step
            mine = longer(after(cur, d, 1))
            for other in range(4):
                if other == d or room[other] <= 0:
                    continue
                theirs = longer(after(cur, other, 1))
                if (theirs > mine or (theirs == mine and other > d)) or count(*block(cur, other, 1)):
                    continue
                return False
            return True

        lo, probe = 1, 2  # gallop (most runs are short), then bisect
        while probe <= last and ok(probe):
            lo, probe = probe, 2 * probe
        hi = min(last, probe - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- publication -------------------------------------------------------------------------
    def _finish(self, view: IndexView, g: _UserGrid, rect: Rect, prof: PrivacyProfile) -> Region | None:
        """Publish a cell rectangle: exact count, A_min growth, area bound, exact l (§2.2, §4.0)."""
        x0, y0, x1, y1 = rect
        s = self._shift
        bbox = view.cell_rect_bbox(self.level, x0, y0, x1, y1)
        lon0, lat0 = (x0 << s) - GRID_OFFSET, (y0 << s) - GRID_OFFSET
        if (
            bbox.min_lon_udeg == lon0 - 1
            and bbox.min_lat_udeg == lat0 - 1
            and bbox.max_lon_udeg == ((x1 + 1) << s) - GRID_OFFSET
            and bbox.max_lat_udeg == ((y1 + 1) << s) - GRID_OFFSET
        ):
            k_achieved = g.count(x0, y0, x1, y1) + view.edge_extras(bbox, lon0, lat0)
        else:  # clipped at the world edge: count exactly
            k_achieved = view.count_in(bbox)
        if prof.min_area_m2 > 0 and bbox.area_m2 < prof.min_area_m2:
            grown = expand_to_area(bbox, prof.min_area_m2)
            if grown is None:
                return None
            bbox = grown
            k_achieved = view.count_in(bbox)
        area = bbox.area_m2
        if area > prof.max_area_m2 or k_achieved < prof.k:
            return None
        l_achieved = self._pg.categories_in(bbox)
        if prof.l > 1 and l_achieved < prof.l:
            return None
        return Region(
            bbox=bbox,
            k_achieved=k_achieved,
            area_m2=area,
            algorithm=self.name,
            epoch=view.epoch,
            l_achieved=l_achieved,
        )
