"""Interval cloaking on the micro-degree quadtree (Gruteser & Grunwald, MobiSys 2003; CONCEPTS §4.2).

The querier's region is the deepest quadtree cell on its root path that still holds ``k`` users
and has area ≥ ``min_area_m2``. Both the count and the area shrink monotonically along the root
path, so the qualifying levels form a prefix of it and the deepest one is found by a binary search
over levels (about five O(log n) bisects instead of a descent through up to 29 levels).

The module also holds the quadtree machinery that :mod:`kcloak.cloaking.cloakers.casper` and
:mod:`kcloak.cloaking.temporal` share: the per-view :class:`QuadtreeCounts`, cell areas with the contract
formula (cells clipped to the world) and the published bbox of a cell rectangle (§2.2).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.cloakers.base import (
    STATUS_OF,
    BatchResult,
    CloakMode,
    CloakResult,
    Region,
    finish_region,
    new_region,
    refuse,
    trusted_bbox,
)
from kcloak.cloaking.grid import GRID_BITS, GRID_OFFSET, MAX_LEVEL, grid_coords, morton_codes
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import (
    UDEG_PER_DEG,
    WORLD_LAT_UDEG,
    WORLD_LON_UDEG,
    BBox,
    bbox_area_m2,
    bbox_area_m2_array,
)
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]
Hint = bytes | bytearray
"""Hashed occupancy bytes of an edge strip (see :func:`_strip_hint`)."""
Root = tuple[int, int, int]
"""A quadtree cell ``(level, cx, cy)``; ``(0, 0, 0)`` is the whole grid."""

WORLD_ROOT: Root = (0, 0, 0)

KIND_CELL = 0
KIND_HPAIR = 1
KIND_VPAIR = 2
"""Kinds of a published cell rectangle in :func:`group_id`: one cell, horizontal or vertical sibling pair."""

UNSUPPORTED_L = refuse(ReasonCode.UNSUPPORTED, "l > 1 is not supported by this algorithm (no place diversity)")
K_UNREACHABLE = refuse(ReasonCode.K_UNREACHABLE)
AREA_EXCEEDED = refuse(ReasonCode.AREA_EXCEEDED)
OUTSIDE_ROOT = refuse(ReasonCode.AREA_EXCEEDED, "the querier lies outside the quadtree's root cell")
_INTERNAL_SHORT = refuse(ReasonCode.K_UNREACHABLE, "internal check: region holds fewer than k users")
ST_K = STATUS_OF[ReasonCode.K_UNREACHABLE]
ST_AREA = STATUS_OF[ReasonCode.AREA_EXCEEDED]
ST_UNSUPPORTED = STATUS_OF[ReasonCode.UNSUPPORTED]

_STRIP = 1 << 31  # edge-strip composite key: own-axis key · 2^31 + (other-axis key + 2^30)
_STRIP_OFFSET = 1 << 30


# -- pure cell geometry ----------------------------------------------------------------------


def cell_rect_udeg(level: int, cx0: int, cy0: int, cx1: int, cy1: int) -> tuple[int, int, int, int]:
    """Half-open micro-degree bounds ``(lon0, lat0, lon1, lat1)`` of the cell rectangle ``[cx0, cx1] × [cy0, cy1]``."""
    s = GRID_BITS - level
    return (
        (cx0 << s) - GRID_OFFSET,
        (cy0 << s) - GRID_OFFSET,
        ((cx1 + 1) << s) - GRID_OFFSET,
        ((cy1 + 1) << s) - GRID_OFFSET,
    )


def rect_bbox(lon0: int, lat0: int, lon1: int, lat1: int) -> BBox:
    """Published bbox of the half-open micro-degree rectangle of some cells (§2.2).

    Lower edges one micro-degree below the cells' (users on them are strictly inside), upper edges
    the cells' own, clipped to the world: the box of :meth:`IndexView.cell_rect_bbox`.
    """
    return BBox(
        max(lon0 - 1, -WORLD_LON_UDEG),
        max(lat0 - 1, -WORLD_LAT_UDEG),
        min(max(lon1, -WORLD_LON_UDEG + 1), WORLD_LON_UDEG),
        min(max(lat1, -WORLD_LAT_UDEG + 1), WORLD_LAT_UDEG),
    )


def cell_bbox(level: int, cx0: int, cy0: int, cx1: int, cy1: int) -> BBox:
    """Published bbox of a cell rectangle, equal to ``view.cell_rect_bbox(...)`` but needing no view."""
    return rect_bbox(*cell_rect_udeg(level, cx0, cy0, cx1, cy1))


def udeg_box_area_m2(lon0: int, lat0: int, lon1: int, lat1: int) -> float:
    """Contract area (§0) of a micro-degree box clipped to the world; 0 when it lies outside."""
    lon0 = max(lon0, -WORLD_LON_UDEG)
    lat0 = max(lat0, -WORLD_LAT_UDEG)
    lon1 = min(lon1, WORLD_LON_UDEG)
    lat1 = min(lat1, WORLD_LAT_UDEG)
    if lon1 <= lon0 or lat1 <= lat0:
        return 0.0
    return bbox_area_m2(lon0 / UDEG_PER_DEG, lat0 / UDEG_PER_DEG, lon1 / UDEG_PER_DEG, lat1 / UDEG_PER_DEG)


def cell_area_m2(level: int, cx0: int, cy0: int, cx1: int | None = None, cy1: int | None = None) -> float:
    """Contract area of a cell (or cell rectangle) clipped to the world (§2.1 rule 1)."""
    return udeg_box_area_m2(*cell_rect_udeg(level, cx0, cy0, cx0 if cx1 is None else cx1, cy0 if cy1 is None else cy1))


def cell_areas_m2(level: I64, cx0: I64, cy0: I64, cx1: I64, cy1: I64) -> F64:
    """Vectorized :func:`cell_area_m2` of cell rectangles (one level per element)."""
    s = GRID_BITS - level
    lon0 = np.maximum((cx0 << s) - GRID_OFFSET, -WORLD_LON_UDEG)
    lat0 = np.maximum((cy0 << s) - GRID_OFFSET, -WORLD_LAT_UDEG)
    lon1 = np.minimum(((cx1 + 1) << s) - GRID_OFFSET, WORLD_LON_UDEG)
    lat1 = np.minimum(((cy1 + 1) << s) - GRID_OFFSET, WORLD_LAT_UDEG)
    area = bbox_area_m2_array(lon0 / UDEG_PER_DEG, lat0 / UDEG_PER_DEG, lon1 / UDEG_PER_DEG, lat1 / UDEG_PER_DEG)
    out: F64 = np.where((lon1 > lon0) & (lat1 > lat0), area, 0.0)
    return out


def group_id(level: int, cx: int, cy: int, kind: int = KIND_CELL) -> int:
    """Identifier of a published cell rectangle: a locational code (leading 1 bit) and the kind.

    ``(cx, cy)`` is the rectangle's lower-left cell; at most 61 bits, so it fits an int64.
    """
    return (((1 << (2 * level)) | _interleave(cx, cy)) << 2) | kind


def _spread_int(v: int) -> int:
    v &= 0xFFFFFFFF
    v = (v | (v << 16)) & 0x0000FFFF0000FFFF
    v = (v | (v << 8)) & 0x00FF00FF00FF00FF
    v = (v | (v << 4)) & 0x0F0F0F0F0F0F0F0F
    v = (v | (v << 2)) & 0x3333333333333333
    return (v | (v << 1)) & 0x5555555555555555


def _interleave(cx: int, cy: int) -> int:
    return _spread_int(cx) | (_spread_int(cy) << 1)


def cell_code_base(level: int, cx: int, cy: int) -> tuple[int, int]:
    """Half-open range of level-29 Morton codes of a cell (pure Python, no numpy round trip)."""
    sh = 2 * (GRID_BITS - level)
    base = _interleave(cx, cy) << sh
    return base, base + (1 << sh)


def grid_coord(key: int, axis: Literal["lon", "lat"]) -> int:
    """Scalar :func:`kcloak.cloaking.grid.grid_coords`: a coordinate on +180° / +90° goes to the cell below."""
    top = 2 * (WORLD_LON_UDEG if axis == "lon" else WORLD_LAT_UDEG)
    return (key >> 1) + GRID_OFFSET - (key == top)


LON_TOP_KEY = 2 * WORLD_LON_UDEG
LAT_TOP_KEY = 2 * WORLD_LAT_UDEG


def grid_of_key(key: int, top_key: int) -> int:
    """:func:`grid_coord` with the axis given by its top key (:data:`LON_TOP_KEY`, :data:`LAT_TOP_KEY`)."""
    return (key >> 1) + GRID_OFFSET - (key == top_key)


def levels_of(root: Root, depth_max: int | None) -> tuple[int, int]:
    """Validated ``(root level, deepest level)`` of a quadtree with this root and depth limit."""
    level, cx, cy = root
    if not 0 <= level <= MAX_LEVEL:
        raise ValueError("root: level must be within [0, 29]")
    if not (0 <= cx < (1 << level) and 0 <= cy < (1 << level)):
        raise ValueError("root: cell coordinates must be within [0, 2^level)")
    if depth_max is None:
        return level, MAX_LEVEL
    if depth_max < 0:
        raise ValueError("depth_max: must be at least 0")
    return level, min(MAX_LEVEL, level + depth_max)


# -- per-view counting structure ---------------------------------------------------------------


class QuadtreeCarry:
    """What a view's :class:`QuadtreeCounts` leaves for the next view of the same index: its sorted
    columns (immutable, shared; the next view makes patched copies, docs/views.md "casper and
    interval") and which snapshot of which index they describe."""

    __slots__ = ("counts", "index_len", "seq", "source")

    def __init__(self, counts: QuadtreeCounts, source: int, seq: int, index_len: int) -> None:
        self.counts = counts
        self.source = source
        self.seq = seq
        self.index_len = index_len


class QuadtreeCounts:
    """Per-view state of the quadtree cloakers, built once and cached in ``view.cache``.

    Sorted level-29 Morton codes as a list (``bisect``: O(log n) per cell count) and as an array
    (``np.searchsorted`` for batches), with the rows of the users in the same order (index rows for
    a view of a :class:`~kcloak.cloaking.index.PositionIndex`, else view rows); two sorted "edge
    strip" keys, with hashed occupancy hints, so that the users strictly between a published lower
    edge and the cells' lower edge (§2.2; ``view.edge_extras``) are counted with bisects too, and
    usually without any; and the memo of published regions.

    Given the :class:`QuadtreeCarry` of the view of the directly preceding snapshot of the same
    index, the sorted columns are that view's, patched with the delta (the points that left are
    deleted, those that entered inserted: O(n) memory moves, O(B log n) searches for B changes);
    otherwise, or when the change is large, they are sorted from scratch. Both give the same
    columns (equal values may sit in another order, which no count or set depends on).
    """

    __slots__ = (
        "_lat_key",
        "_lon_key",
        "_order",
        "_pos",
        "aligned",
        "at_row",
        "carried",
        "codes",
        "codes_array",
        "hint_bits",
        "lat_hint",
        "lat_strip",
        "lat_strip_array",
        "lon_hint",
        "lon_strip",
        "lon_strip_array",
        "n",
        "parent_bounds",
        "regions",
        "root_counts",
        "rows",
        "stale",
        "view_of",
    )
    CACHE_KEY: ClassVar[str] = "kcloak.quadtree_counts"
    PATCH_FRACTION: ClassVar[int] = 8
    """Above ``n / PATCH_FRACTION`` changed points the columns are sorted from scratch."""

    def __init__(self, view: IndexView, carry: QuadtreeCarry | None = None) -> None:
        self.n = len(view)
        self._lon_key = view.lon_key
        self._lat_key = view.lat_key
        self._pos: I64 | None = None
        self.aligned: AlignedStrips | None = None
        self.at_row: tuple[memoryview, memoryview, memoryview] | None = None
        """Per view row: an index of its code in :attr:`codes`, its grid column and grid row
        (see :meth:`row_columns`; built on the first single call)."""
        link = view.index_rows
        self.view_of: npt.NDArray[np.int32] | None = None if link is None else link[1]
        self._order: I64 | None = None
        self.root_counts: dict[Root, int] = {WORLD_ROOT: self.n}
        self.parent_bounds: dict[int, tuple[int, int, int, int, int]] = {}
        """Casper's memo of the code-index bounds of a cell's four children, keyed by the cell's
        locational code (see :func:`kcloak.cloaking.cloakers.casper._casper_region`)."""
        self.regions: defaultdict[str, dict[int, Region]] = defaultdict(dict)
        """Memo of the regions already published, per algorithm, keyed by :func:`group_id` (they
        depend on the view and the rectangle only; the profile is applied by :func:`fit_profile`)."""
        self.carried = carry is not None and self._patch(view, carry)
        """Whether the sorted columns were patched from the previous view's."""
        if not self.carried:
            self._build(view, None if link is None else link[0])

    def _build(self, view: IndexView, index_rows: I64 | None) -> None:
        order = np.argsort(view.morton).astype(np.int64)
        order.setflags(write=False)
        self._order = order
        self.rows: I64 = order if index_rows is None else _frozen(index_rows[order])
        self.codes_array: U64 = _frozen(view.morton[order])
        self.codes: memoryview = _ints(self.codes_array)
        lon_key, lat_key = view.lon_key, view.lat_key
        self.lon_strip_array: I64 = _frozen(np.sort(lon_key * _STRIP + (lat_key + _STRIP_OFFSET)))
        self.lat_strip_array: I64 = _frozen(np.sort(lat_key * _STRIP + (lon_key + _STRIP_OFFSET)))
        self.lon_strip: memoryview = _ints(self.lon_strip_array)
        self.lat_strip: memoryview = _ints(self.lat_strip_array)
        self._build_hints()

    def _build_hints(self) -> None:
        self.hint_bits = _hint_bits(self.n)
        self.lon_hint = _strip_hint(self._lon_key, self._lat_key, self.hint_bits)
        self.lat_hint = _strip_hint(self._lat_key, self._lon_key, self.hint_bits)
        self.stale = 0
        """Points that left since the hints were built (their bytes may be 1 for nobody)."""

    def _patch(self, view: IndexView, carry: QuadtreeCarry) -> bool:
        """Take the carried columns patched with the delta since the carry's view; False if it cannot."""
        curve = view.curve
        view_of = self.view_of
        if curve is None or view_of is None or carry.index_len > len(view_of):
            return False
        prev = carry.counts
        delta = curve.recent[-1]
        gone_rows, new_rows = delta.removed_rows, delta.added_rows
        if (
            delta.source != carry.source
            or delta.seq != carry.seq + 1
            or len(gone_rows) != len(delta.removed_lon_key)
            or len(new_rows) != len(delta.added_lon_key)
            or (len(gone_rows) + len(new_rows)) * self.PATCH_FRACTION > self.n
        ):
            return False
        gone = np.zeros(len(view_of), bool)
        gone[gone_rows] = True
        drop = np.flatnonzero(gone[prev.rows])
        new_view_rows = view_of[new_rows]
        if len(drop) != len(gone_rows) or (new_view_rows < 0).any():
            return False
        lon_key, lat_key = self._lon_key[new_view_rows], self._lat_key[new_view_rows]
        new_codes = _codes(lon_key, lat_key)
        if not np.array_equal(
            np.sort(prev.codes_array[drop]), np.sort(_codes(delta.removed_lon_key, delta.removed_lat_key))
        ):
            return False
        by_code = np.argsort(new_codes, kind="stable")
        new_codes = new_codes[by_code]
        kept = np.delete(prev.codes_array, drop)
        at = np.searchsorted(kept, new_codes)
        lon_strip = _patch_sorted(
            prev.lon_strip_array,
            delta.removed_lon_key * _STRIP + (delta.removed_lat_key + _STRIP_OFFSET),
            lon_key * _STRIP + (lat_key + _STRIP_OFFSET),
        )
        lat_strip = _patch_sorted(
            prev.lat_strip_array,
            delta.removed_lat_key * _STRIP + (delta.removed_lon_key + _STRIP_OFFSET),
            lat_key * _STRIP + (lon_key + _STRIP_OFFSET),
        )
        if lon_strip is None or lat_strip is None or len(kept) + len(new_codes) != self.n:
            return False
        self.codes_array = _frozen(np.insert(kept, at, new_codes))
        self.codes = _ints(self.codes_array)
        self.rows = _frozen(np.insert(np.delete(prev.rows, drop), at, new_rows[by_code]))
        self.lon_strip_array, self.lon_strip = lon_strip, _ints(lon_strip)
        self.lat_strip_array, self.lat_strip = lat_strip, _ints(lat_strip)
        stale = prev.stale + len(gone_rows)
        if _hint_bits(self.n) != prev.hint_bits or stale * self.PATCH_FRACTION > self.n:
            self._build_hints()
        else:
            self.hint_bits = prev.hint_bits
            self.lon_hint = _strip_hint_add(prev.lon_hint, lon_key, lat_key, prev.hint_bits)
            self.lat_hint = _strip_hint_add(prev.lat_hint, lat_key, lon_key, prev.hint_bits)
            self.stale = stale
        return True

    def carry(self, view: IndexView) -> QuadtreeCarry | None:
        """What the next view of the same index can start from (None for a view without a curve)."""
        if view.curve is None or self.view_of is None:
            return None
        return QuadtreeCarry(self, view.curve.source, view.curve.seq, len(self.view_of))

    @classmethod
    def of(cls, view: IndexView) -> QuadtreeCounts:
        """The cached instance of ``view`` (built on first use)."""
        qt = view.cache.get(cls.CACHE_KEY)
        if qt is None:
            qt = view.cache[cls.CACHE_KEY] = cls(view)
        return qt

    @property
    def order(self) -> I64:
        """The view rows in code order (built on first use from the sorted rows)."""
        if self._order is None:
            order = self.rows if self.view_of is None else self.view_of[self.rows].astype(np.int64)
            order.setflags(write=False)
            self._order = order
        return self._order

    def members(self, i: int, j: int) -> I64:
        """View rows of the users at code positions ``[i, j)``."""
        if self._order is not None:
            return self._order[i:j]
        rows = self.rows[i:j]
        return rows if self.view_of is None else self.view_of[rows].astype(np.int64)

    def row_columns(self) -> tuple[memoryview, memoryview, memoryview]:
        """``(pos, lon_key, lat_key)`` indexed by view row, as zero-copy memoryviews for single calls.

        ``pos[row]`` is an index of the row's Morton code in :attr:`codes` (the inverse of
        :attr:`order`), so a single call finds the querier without a bisect over all codes and
        without interleaving its bits in Python; :func:`grid_of_key` turns a key into its grid
        coordinate. O(n) once per view.
        """
        if self.at_row is None:
            lon, lat = np.ascontiguousarray(self._lon_key), np.ascontiguousarray(self._lat_key)
            self.at_row = (_ints(self.positions()), _ints(lon), _ints(lat))
        return self.at_row

    def positions(self) -> I64:
        """``pos[row]``: an index of view row ``row``'s code in :attr:`codes_array` (built on first use)."""
        if self._pos is None:
            order = self.order
            pos = np.empty(self.n, np.int64)
            pos[order] = np.arange(self.n, dtype=np.int64)
            self._pos = _frozen(pos)
        return self._pos

    def grid(self, row: int) -> tuple[int, int]:
        """Level-29 grid coordinates of view row ``row`` (as ``view.gx[row], view.gy[row]``)."""
        _, lon_keys, lat_keys = self.at_row or self.row_columns()
        return grid_of_key(lon_keys[row], LON_TOP_KEY), grid_of_key(lat_keys[row], LAT_TOP_KEY)

    def locate(self, gx: int, gy: int) -> tuple[int, int]:
        """Morton code of a present user's grid position and the first index of it in :attr:`codes`."""
        code = _interleave(gx, gy)
        return code, bisect_left(self.codes, code)

    def root_count(self, root: Root) -> int:
        """Users in a root cell (memoized; the whole grid holds everyone)."""
        n = self.root_counts.get(root)
        if n is None:
            n = self.root_counts[root] = self.count(*root)
        return n

    def count_range(self, lo: int, hi: int) -> int:
        """Users whose level-29 Morton code lies in ``[lo, hi)``."""
        codes = self.codes
        i = bisect_left(codes, lo)
        return bisect_left(codes, hi, i) - i

    def count(self, level: int, cx: int, cy: int) -> int:
        """Users in cell ``(level, cx, cy)`` (half-open, the grid's assignment); equals ``view.count_cell``."""
        return self.count_range(*cell_code_base(level, cx, cy))

    def edge_extra(self, lon0: int, lat0: int, lon1: int, lat1: int) -> int:
        """Users strictly inside the published box of ``[lon0, lon1) × [lat0, lat1)`` but outside it.

        They sit strictly between a published lower edge and the cells' lower edge: lon key
        ``2·lon0 − 1`` (left strip) or lat key ``2·lat0 − 1`` (bottom strip, corner counted once).
        The same number as ``view.edge_extras`` for a box away from the world edge. An edge on a
        multiple of 2^6 µdeg (any cell of level ≤ 23) is looked up in :class:`AlignedStrips`,
        others behind the occupancy bytes in the full strips.
        """
        klon = 2 * lon0 - 1
        extra = 0
        if (lon0 + GRID_OFFSET) & ALIGN_MASK == 0:
            al = self.aligned or self._aligned()
            if klon in al.lon_keys:
                extra = _strip_count(al.lon_strip, klon, 2 * lat0 - 2, 2 * lat1)
        elif _maybe(self.lon_hint, self.hint_bits, lon0 - 1, lat0 - 1, lat1 - 1):
            extra = _strip_count(self.lon_strip, klon, 2 * lat0 - 2, 2 * lat1)
        klat = 2 * lat0 - 1
        if (lat0 + GRID_OFFSET) & ALIGN_MASK == 0:
            al = self.aligned or self._aligned()
            if klat in al.lat_keys:
                extra += _strip_count(al.lat_strip, klat, 2 * lon0 - 2, 2 * lon1, klon)
        elif _maybe(self.lat_hint, self.hint_bits, lat0 - 1, lon0 - 1, lon1 - 1):
            extra += _strip_count(self.lat_strip, klat, 2 * lon0 - 2, 2 * lon1, klon)
        return extra

    def _aligned(self) -> AlignedStrips:
        if self.aligned is None:
            self.aligned = AlignedStrips.of_keys(self._lon_key, self._lat_key)
        return self.aligned

    def edge_extras(self, rect: I64) -> I64:
        """Vectorized :meth:`edge_extra` for an ``(m, 4)`` array of half-open micro-degree rectangles.

        As there, aligned edges are searched in :class:`AlignedStrips`, others only where their
        occupancy bytes are set.
        """
        lon0, lat0, lon1, lat1 = rect[:, 0], rect[:, 1], rect[:, 2], rect[:, 3]
        out = np.zeros(len(rect), np.int64)
        lon_aligned = ((lon0 + GRID_OFFSET) & ALIGN_MASK) == 0
        lat_aligned = ((lat0 + GRID_OFFSET) & ALIGN_MASK) == 0
        al = self._aligned() if (lon_aligned | lat_aligned).any() else None
        self._add_strip_counts(out, lon_aligned, al, "lon", lon0, lat0, lat1)
        self._add_strip_counts(out, lat_aligned, al, "lat", lat0, lon0, lon1)
        return out

    def _add_strip_counts(
        self,
        out: I64,
        edge_aligned: npt.NDArray[np.bool_],
        al: AlignedStrips | None,
        axis: Literal["lon", "lat"],
        e0: I64,
        a0: I64,
        a1: I64,
    ) -> None:
        """Add to ``out`` the users of the strip below each box's lower ``axis`` edge ``e0``, across ``[a0, a1)``:
        aligned edges from ``al`` (only those whose key some strip user has), others from the full strip
        behind its occupancy bytes. The bottom (``lat``) strip leaves out the corner the left strip already
        counted."""
        lon = axis == "lon"
        strip, hint = (self.lon_strip_array, self.lon_hint) if lon else (self.lat_strip_array, self.lat_hint)
        for aligned in (True, False):
            source = strip if not aligned else None if al is None else al.lon_strip_array if lon else al.lat_strip_array
            i = np.flatnonzero(edge_aligned if aligned else ~edge_aligned)
            if not len(i) or source is None:
                continue
            own = 2 * e0[i] - 1
            if al is not None and aligned:  # the usual case: few aligned edges have a user strictly below
                keys = al.lon_key_array if lon else al.lat_key_array
                hit = np.flatnonzero((al.lon_key_bytes if lon else al.lat_key_bytes)[_key_slot(own)])
                if len(hit):
                    at = np.minimum(np.searchsorted(keys, own[hit]), len(keys) - 1)
                    hit = hit[keys[at] == own[hit]]
            else:
                hit = np.flatnonzero(_maybe_many(hint, self.hint_bits, e0[i] - 1, a0[i] - 1, a1[i] - 1))
            if not len(hit):
                continue
            i = i[hit]
            base = own[hit] * _STRIP + _STRIP_OFFSET
            extra = search(source, base + 2 * a1[i], "left", base + 2 * a0[i] - 2, "right")
            if axis == "lat":
                corner = base + (2 * a0[i] - 1)
                extra = extra - search(source, corner, "right", corner, "left")
            out[i] += extra


ALIGN_BITS = 6
ALIGN_MASK = (1 << ALIGN_BITS) - 1


class AlignedStrips:
    """The edge-strip users that a cell of level ≤ 29 − :data:`ALIGN_BITS` can meet, apart.

    A strip user of a published lower edge ``e`` (micro-degrees) has the odd key ``2·e − 1`` on
    that axis; a cell's lower edge is a multiple of 2^(29 − level) on the grid, so for the usual
    cells only users whose key is ``2·e − 1`` with ``e`` a multiple of 2^6 on the grid can count:
    about one odd-keyed user in 64. Their keys (a set: is anyone on this edge at all) and their
    strip keys (the same composite keys as the full strips, sorted, a small array that stays in
    cache) answer the usual edge counts exactly with one set lookup. Built from the view's keys
    on first use (O(n), also on a view whose other columns were patched: about 18 ms at 1M users).
    """

    __slots__ = (
        "lat_key_array",
        "lat_key_bytes",
        "lat_keys",
        "lat_strip",
        "lat_strip_array",
        "lon_key_array",
        "lon_key_bytes",
        "lon_keys",
        "lon_strip",
        "lon_strip_array",
    )

    def __init__(self, lon_strip_array: I64, lat_strip_array: I64) -> None:
        self.lon_strip_array = lon_strip_array
        self.lat_strip_array = lat_strip_array
        self.lon_strip = _ints(lon_strip_array)
        self.lat_strip = _ints(lat_strip_array)
        self.lon_key_array: I64 = np.unique(lon_strip_array >> 31)  # the own-axis key of a strip key
        self.lat_key_array: I64 = np.unique(lat_strip_array >> 31)
        self.lon_key_bytes = _key_bytes(self.lon_key_array)
        self.lat_key_bytes = _key_bytes(self.lat_key_array)
        self.lon_keys = frozenset(self.lon_key_array.tolist())
        self.lat_keys = frozenset(self.lat_key_array.tolist())

    @classmethod
    def of_keys(cls, lon_key: I64, lat_key: I64) -> AlignedStrips:
        """Built from the view's keys (O(n))."""
        lon = _aligned_odd(lon_key)
        lat = _aligned_odd(lat_key)
        return cls(
            _frozen(np.sort(lon_key[lon] * _STRIP + (lat_key[lon] + _STRIP_OFFSET))),
            _frozen(np.sort(lat_key[lat] * _STRIP + (lon_key[lat] + _STRIP_OFFSET))),
        )


_KEY_SLOTS = 1 << 16


def _key_slot(key: I64) -> I64:
    """Hashed slot of an aligned strip key ``2·e − 1`` (``e + 2^28`` a multiple of 2^ALIGN_BITS)."""
    slot: I64 = (((key + (1 + 2 * GRID_OFFSET)) >> (ALIGN_BITS + 1)) & (_KEY_SLOTS - 1)).astype(np.intp)
    return slot


def _key_bytes(keys: I64) -> npt.NDArray[np.bool_]:
    """One flag per hashed slot, set where some key falls (a clear flag proves a key absent)."""
    out = np.zeros(_KEY_SLOTS, bool)
    out[_key_slot(keys)] = True
    return out


def _aligned_odd(key: I64) -> npt.NDArray[np.bool_]:
    """Odd keys ``2·e − 1`` whose upper micro-degree ``e`` is a multiple of 2^ALIGN_BITS on the grid."""
    # key = 2·e − 1 with e + 2^28 ≡ 0 (mod 2^6)  ⇔  key + 1 + 2^29 ≡ 0 (mod 2^7) (which makes it odd)
    out: npt.NDArray[np.bool_] = ((key + (1 + 2 * GRID_OFFSET)) & (2 * ALIGN_MASK + 1)) == 0
    return out


def _strip_count(strip: Sequence[int], key: int, lo: int, hi: int, corner: int | None = None) -> int:
    """Users of a sorted strip with own-axis ``key`` and other-axis key in ``(lo, hi)``, less those
    whose other-axis key is ``corner`` (the corner of the two strips is counted once)."""
    base = key * _STRIP + _STRIP_OFFSET
    i = bisect_right(strip, base + lo)
    j = bisect_left(strip, base + hi, i)
    if corner is not None and j > i:
        c = base + corner
        j -= bisect_right(strip, c, i, j) - bisect_left(strip, c, i, j)
    return j - i


def search(
    sorted_values: npt.NDArray[np.int64] | U64,
    hi: npt.NDArray[np.int64] | U64,
    hi_side: Literal["left", "right"],
    lo: npt.NDArray[np.int64] | U64,
    lo_side: Literal["left", "right"],
) -> I64:
    """``searchsorted(hi) − searchsorted(lo)`` with the needles visited in sorted order.

    NumPy's binary search reuses the previous position when needles increase, so sorting them
    first (one argsort) makes a batch of searches several times faster on large arrays.
    """
    order = np.argsort(lo)
    out = np.empty(len(lo), np.int64)
    out[order] = np.searchsorted(sorted_values, hi[order], hi_side) - np.searchsorted(sorted_values, lo[order], lo_side)
    return out


_HINT_SHIFT = 10  # rows of the strip hint: 1024 µdeg (≈ 110 m) of the other axis


def _hint_bits(n: int) -> tuple[int, int]:
    """(column bits, row bits) of the strip hints: about 64 buckets per user, 2^12 … 2^24 in all."""
    total = min(max((64 * max(n, 1) - 1).bit_length(), 12), 24)
    return total // 2, total - total // 2


def _strip_hint_cells(own_key: I64, other_key: I64, bits: tuple[int, int]) -> I64:
    col_bits, row_bits = bits
    odd = (own_key & 1) == 1
    col = (own_key[odd] >> 1) & ((1 << col_bits) - 1)
    row = ((other_key[odd] >> 1) >> _HINT_SHIFT) & ((1 << row_bits) - 1)
    cells: I64 = (col << row_bits) | row
    return cells


def _strip_hint(own_key: I64, other_key: I64, bits: tuple[int, int]) -> Hint:
    """A byte per (micro-degree column of the own axis, 1024-µdeg row of the other), hashed modulo.

    1 where some user lies strictly inside that column (odd key): a 0 proves an edge strip empty,
    so the common case (no user between a published edge and the cells' edge) needs no bisect.
    """
    hint = np.zeros(1 << sum(bits), np.uint8)
    hint[_strip_hint_cells(own_key, other_key, bits)] = 1
    return hint.tobytes()


def _strip_hint_add(hint: Hint, own_key: I64, other_key: I64, bits: tuple[int, int]) -> Hint:
    """A copy of ``hint`` with the bytes of more users set. Bytes of users who left stay 1: a 1 only
    sends the count to the exact bisect, so the result is the same (the caller rebuilds the hints
    when too many such bytes may have gathered)."""
    out = bytearray(hint)
    np.frombuffer(out, np.uint8)[_strip_hint_cells(own_key, other_key, bits)] = 1
    return out


def _codes(lon_key: I64, lat_key: I64) -> U64:
    return morton_codes(grid_coords(lon_key, "lon"), grid_coords(lat_key, "lat"))


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.setflags(write=False)
    return a


def _ints(a: npt.NDArray[Any]) -> memoryview:
    """A read-only int sequence over a sorted column, without copying it: ``bisect`` on it runs in C
    (faster than on a list of ints, whose objects are scattered in memory)."""
    return a.data.cast("B").cast("Q" if a.dtype == np.uint64 else "q")


def _patch_sorted(array: I64, removed: I64, added: I64) -> I64 | None:
    """A sorted multiset minus ``removed`` plus ``added``; None when some removed value is not in it
    (the caller then builds from scratch)."""
    removed = np.sort(removed)
    n = len(array)
    # Equal removed values take consecutive positions of their run: rank within the equal values.
    drop = np.searchsorted(array, removed) + (np.arange(len(removed)) - np.searchsorted(removed, removed))
    if len(drop) and (int(drop[-1]) >= n or not np.array_equal(array[drop], removed)):
        return None
    kept = np.delete(array, drop)
    added = np.sort(added)
    return _frozen(np.insert(kept, np.searchsorted(kept, added), added))


def _maybe(hint: Hint, bits: tuple[int, int], column: int, lo: int, hi: int) -> bool:
    """Whether a strip (micro-degree ``column``, other axis floor µdeg in ``[lo, hi]``) may hold a user."""
    r0 = lo >> _HINT_SHIFT
    r1 = hi >> _HINT_SHIFT
    if r1 - r0 > 3:
        return True
    col_bits, row_bits = bits
    base = (column & ((1 << col_bits) - 1)) << row_bits
    mask = (1 << row_bits) - 1
    return any(hint[base | (r & mask)] for r in range(r0, r1 + 1))


def _maybe_many(hint: Hint, bits: tuple[int, int], column: I64, lo: I64, hi: I64) -> npt.NDArray[np.bool_]:
    """Vectorized :func:`_maybe`."""
    r0 = lo >> _HINT_SHIFT
    r1 = hi >> _HINT_SHIFT
    out: npt.NDArray[np.bool_] = (r1 - r0) > 3
    col_bits, row_bits = bits
    base = (column & ((1 << col_bits) - 1)) << row_bits
    mask = (1 << row_bits) - 1
    occupied = np.frombuffer(hint, np.uint8)
    for d in range(4):
        r = r0 + d
        out |= (r <= r1) & (occupied[base | (r & mask)] != 0)
    return out


def touches_world_edge(lon0: int, lat0: int, lon1: int, lat1: int) -> bool:
    """Whether the published box of this rectangle reaches the world edge (clipped or on it).

    There strictness is waived (contract §0: a user on ±180° / ±90° counts), so the edge strips do
    not describe the extra users and the count comes from ``view.count_in``.
    """
    return (
        lon0 - 1 <= -WORLD_LON_UDEG or lat0 - 1 <= -WORLD_LAT_UDEG or lon1 >= WORLD_LON_UDEG or lat1 >= WORLD_LAT_UDEG
    )


def rect_region(
    view: IndexView, qt: QuadtreeCounts, algorithm: str, rect: tuple[int, int, int, int], in_cells: int, anon_set: I64
) -> Region:
    """The region of a cell rectangle, independent of any profile: bbox (§2.2), area, exact ``k_achieved``.

    ``in_cells`` is the rectangle's grid count; ``k_achieved`` adds the edge strips, which makes
    it equal to ``view.count_in(bbox)`` (tested); where the box reaches the world edge it *is*
    ``view.count_in(bbox)``. Depends only on the view and the rectangle, so it is memoized.
    """
    lon0, lat0, lon1, lat1 = rect
    if touches_world_edge(lon0, lat0, lon1, lat1):
        bbox = rect_bbox(lon0, lat0, lon1, lat1)
        return Region(bbox, view.count_in(bbox), bbox.area_m2, algorithm, view.epoch, anon_set)
    # Away from the world edge the box's edges lie strictly inside the world and are ordered.
    bbox = trusted_bbox(lon0 - 1, lat0 - 1, lon1, lat1)
    k_achieved = in_cells + qt.edge_extra(lon0, lat0, lon1, lat1)
    # bbox.area_m2 without its intermediate list (same operations, same float)
    area = bbox_area_m2((lon0 - 1) / UDEG_PER_DEG, (lat0 - 1) / UDEG_PER_DEG, lon1 / UDEG_PER_DEG, lat1 / UDEG_PER_DEG)
    return new_region(bbox, k_achieved, area, algorithm, view.epoch, anon_set)


def fit_profile(view: IndexView, region: Region, profile: PrivacyProfile) -> CloakResult:
    """Judge a rectangle's region against the profile on its final bbox (§2.2, §3.3).

    Below ``min_area_m2`` it grows (§2.5; only a root can be that small) and is recounted; above
    ``max_area_m2`` the request is refused ``area_exceeded``.
    """
    area = region.area_m2
    if area < profile.min_area_m2:
        return finish_region(view, region.bbox, profile, algorithm=region.algorithm, anon_set=region.anon_set)
    if area > profile.max_area_m2:
        return AREA_EXCEEDED
    if region.k_achieved < profile.k:  # only where the world edge makes strictness impossible
        return _INTERNAL_SHORT
    return region


_LOWER_EDGES = np.array([1, 1, 0, 0], np.int64)


def group_ids(level: I64, codes: U64, kind: I64 | int) -> I64:
    """Vectorized :func:`group_id` of the rectangles at ``level`` holding the queriers' ``codes``
    (a pair is named by its lower-left cell: the x bit (kind 1) or the y bit (kind 2) cleared)."""
    prefix = (codes >> (2 * (GRID_BITS - level)).astype(np.uint64)).astype(np.int64)
    kinds = np.int64(kind) if isinstance(kind, int) else kind
    out: I64 = (((np.int64(1) << (2 * level)) | (prefix & ~kinds)) << 2) | kinds
    return out


def group_runs(values: I64) -> tuple[I64, I64]:
    """Runs of equal consecutive values: the first index of each run and each element's run number.

    The batch requests are in code order, so requests answered by the same rectangle mostly sit
    next to each other; the profile-free work is then done once per run (a rectangle met in two
    runs is simply computed twice, with the same result)."""
    new = np.empty(len(values), bool)
    new[:1] = True
    np.not_equal(values[1:], values[:-1], out=new[1:])
    run = np.cumsum(new) - 1
    return np.flatnonzero(new), run


def sorted_counts(sorted_values: U64, lo: U64, hi: U64) -> I64:
    """``searchsorted(hi) − searchsorted(lo)`` for needles already (about) in ascending order."""
    out: I64 = np.searchsorted(sorted_values, hi) - np.searchsorted(sorted_values, lo)
    return out


def publish_rects(
    view: IndexView,
    qt: QuadtreeCounts,
    out: BatchResult,
    idx: I64,
    group: I64,
    run: I64,
    level: I64,
    cx0: I64,
    cy0: I64,
    cx1: I64,
    cy1: I64,
    in_cells: I64,
    profiles: ProfileArrays,
) -> I64:
    """Vectorized :func:`rect_region` and :func:`fit_profile` into ``out`` at request indices ``idx``.

    ``group`` is each request's :func:`group_id`; ``run[i]`` the number of its rectangle in the
    per-rectangle columns ``level`` … ``in_cells`` (grid count), from :func:`group_runs`: bbox,
    area and ``k_achieved`` are computed once per rectangle, the profile is applied per request.

    Returns the request indices whose rectangle is below ``min_area_m2``; the caller sends them
    through the scalar path (they need the §2.5 growth and a recount).
    """
    s = GRID_BITS - level
    rect = np.empty((len(level), 4), np.int64)
    rect[:, 0] = (cx0 << s) - GRID_OFFSET
    rect[:, 1] = (cy0 << s) - GRID_OFFSET
    rect[:, 2] = ((cx1 + 1) << s) - GRID_OFFSET
    rect[:, 3] = ((cy1 + 1) << s) - GRID_OFFSET
    bboxes = rect - _LOWER_EDGES  # lower edges one micro-degree below the cells' (§2.2)
    edge = (rect[:, 0] - 1 <= -WORLD_LON_UDEG) | (rect[:, 1] - 1 <= -WORLD_LAT_UDEG)
    edge |= (rect[:, 2] >= WORLD_LON_UDEG) | (rect[:, 3] >= WORLD_LAT_UDEG)
    ci = np.flatnonzero(edge)
    if len(ci):  # boxes reaching the world edge: clipped to it (only they can be)
        r = rect[ci]
        bboxes[ci, 0] = np.maximum(r[:, 0] - 1, -WORLD_LON_UDEG)
        bboxes[ci, 1] = np.maximum(r[:, 1] - 1, -WORLD_LAT_UDEG)
        bboxes[ci, 2] = np.minimum(np.maximum(r[:, 2], -WORLD_LON_UDEG + 1), WORLD_LON_UDEG)
        bboxes[ci, 3] = np.minimum(np.maximum(r[:, 3], -WORLD_LAT_UDEG + 1), WORLD_LAT_UDEG)
    deg = bboxes / UDEG_PER_DEG
    area_g = bbox_area_m2_array(deg[:, 0], deg[:, 1], deg[:, 2], deg[:, 3])
    k_ach_g = in_cells + qt.edge_extras(rect)
    if len(ci):
        k_ach_g[ci] = view.count_in_many(bboxes[ci])
    area = area_g[run]
    small = area < profiles.min_area_m2[idx]
    too_big = ~small & (area > profiles.max_area_m2[idx])
    out.status[idx[too_big]] = ST_AREA
    keep = np.flatnonzero(~small & ~too_big)
    sel = idx[keep]
    rk = run[keep]
    k_ach = k_ach_g[rk]
    out.status[sel[k_ach < profiles.k[sel]]] = ST_K
    out.bbox[sel] = bboxes[rk]
    out.area_m2[sel] = area[keep]
    out.k_achieved[sel] = k_ach
    out.group[sel] = group[keep]
    small_idx: I64 = idx[small]
    return small_idx


# -- level search ------------------------------------------------------------------------------


_GALLOP = 64


def run_start(codes: Sequence[int], x: int, p: int) -> int:
    """First index whose code is ≥ ``x``, given ``codes[p] ≥ x``: a bisect over the 64 codes before
    ``p`` when the run starts there (the usual case: runs hold a few k), else over ``[0, p]``."""
    lo = p - _GALLOP
    if lo >= 0 and codes[lo] < x:
        return bisect_left(codes, x, lo + 1, p + 1)
    return bisect_left(codes, x, 0, p + 1)


def run_end(codes: Sequence[int], x: int, p: int) -> int:
    """First index whose code is ≥ ``x``, given ``codes[p] < x`` (the mirror of :func:`run_start`)."""
    hi = p + _GALLOP
    if hi < len(codes) and codes[hi] >= x:
        return bisect_left(codes, x, p + 1, hi)
    return bisect_left(codes, x, p + 1)


def deepest_level(
    qt: QuadtreeCounts, p: int, code: int, gx: int, gy: int, k: int, min_area_m2: float, lo: int, hi: int
) -> int:
    """Deepest level in ``[lo, hi]`` whose cell on the querier's path holds ≥ k users and has area ≥ A_min.

    ``p`` is an index of the querier's code in ``qt.codes``; level ``lo`` is taken as qualifying.
    Both predicates are monotone along the root path (a child is a subset of its parent).

    Count: the querier's cell at level ℓ holds ≥ k users iff some k consecutive sorted codes
    around ``p`` (a window ``[w, w + k − 1]`` with ``p − k < w ≤ p``) lie in it, i.e. iff both ends
    share the querier's level-ℓ prefix (the codes between them do too). So the deepest such
    level comes from ``min over w of max(bitlen(code ^ codes[w]), bitlen(code ^ codes[w + k − 1]))``;
    the first term does not increase with ``w`` and the second does not decrease, so the minimum
    sits where they cross: a binary search over the k windows (⌈log2 k⌉ steps of two reads and
    two XORs, no bisect over the codes). Area: a binary search over the levels, only when
    ``min_area_m2 > 0``.
    """
    codes = qt.codes
    wl = p - k + 1
    if wl < 0:
        wl = 0
    wr = qt.n - k
    if wr > p:
        wr = p
    if wr < wl:  # fewer than k users in all
        return lo
    k1 = k - 1
    a, b = wl, wr
    while a < b:  # first window whose left end is no farther (in bits) from the querier than its right end
        mid = (a + b) >> 1
        if (code ^ codes[mid]).bit_length() <= (code ^ codes[mid + k1]).bit_length():
            b = mid
        else:
            a = mid + 1
    bits = (code ^ codes[a + k1]).bit_length()
    left = (code ^ codes[a]).bit_length()
    if left > bits:
        bits = left
    if a > wl:
        left = (code ^ codes[a - 1]).bit_length()  # window a − 1: its left end is the farther one
        if left < bits:
            bits = left
    level = GRID_BITS - ((bits + 1) >> 1)
    if level > hi:
        level = hi
    if level <= lo:
        return lo
    if min_area_m2 > 0:
        top = level
        level = lo
        while level < top:
            mid = (level + top + 1) >> 1
            s = GRID_BITS - mid
            if cell_area_m2(mid, gx >> s, gy >> s) < min_area_m2:
                top = mid - 1
            else:
                level = mid
    return level


_POW4 = np.array([1 << (2 * j) for j in range(GRID_BITS + 1)], np.uint64)
"""4^0 … 4^29: ``searchsorted(_POW4, x, "right")`` is ⌈bitlen(x) / 2⌉ for a uint64 ``x``."""


def deepest_levels(
    qt: QuadtreeCounts, p: I64, codes: U64, gx: I64, gy: I64, k: I64, min_area_m2: F64, lo: I64, hi: I64
) -> I64:
    """Vectorized :func:`deepest_level` (``p``: an index of each querier's code in ``qt.codes_array``).

    The same window search for all requests at once: ⌈log2 max k⌉ rounds of two gathers each, then
    the area search (rounds of cell areas) for the requests with ``min_area_m2 > 0`` only.
    """
    n = qt.n
    s_codes = qt.codes_array
    wl = np.maximum(p - k + 1, 0)
    wr = np.minimum(p, n - k)
    valid = wr >= wl  # else fewer than k users in all
    a = wl
    b = np.where(valid, wr, wl)
    k1 = np.where(valid, k - 1, 0)  # (an invalid search reads in bounds and is overruled below)
    # The same number of halvings for all (a finished search, a == b, stays put): no compaction.
    rounds = int(np.max(b - a, initial=0)).bit_length()
    for _ in range(rounds):
        mid = (a + b) >> 1
        x = codes ^ s_codes[mid]
        y = codes ^ s_codes[mid + k1]
        closer = (x & ~y) <= y  # bitlen(x) <= bitlen(y), integers only
        b = np.where(closer, mid, b)
        a = np.where(closer, a, np.minimum(mid + 1, b))
    far = np.maximum(codes ^ s_codes[np.minimum(a + k1, n - 1)], codes ^ s_codes[a])
    prev = np.flatnonzero(a > wl)
    far[prev] = np.minimum(far[prev], codes[prev] ^ s_codes[a[prev] - 1])
    level = GRID_BITS - np.searchsorted(_POW4, far, "right").astype(np.int64)
    level = np.where(valid, np.maximum(np.minimum(level, hi), lo), lo)
    need = np.flatnonzero((min_area_m2 > 0) & (level > lo))
    if len(need):
        level[need] = _deepest_area_levels(gx[need], gy[need], min_area_m2[need], lo[need], level[need])
    return level


def _deepest_area_levels(gx: I64, gy: I64, min_area_m2: F64, lo: I64, hi: I64) -> I64:
    """Deepest level in ``[lo, hi]`` whose cell has area ≥ A_min (``lo`` taken as qualifying)."""
    lo = lo.copy()
    hi = hi.copy()
    while True:
        act = np.flatnonzero(lo < hi)
        if len(act) == 0:
            return lo
        a_lo = lo[act]
        a_hi = hi[act]
        mid = (a_lo + a_hi + 1) >> 1
        s = GRID_BITS - mid
        cx = gx[act] >> s
        cy = gy[act] >> s
        good = cell_areas_m2(mid, cx, cy, cx, cy) >= min_area_m2[act]
        lo[act] = np.where(good, mid, a_lo)
        hi[act] = np.where(good, a_hi, mid - 1)


def range_counts(qt: QuadtreeCounts, lo: U64, hi: U64) -> I64:
    """Vectorized count of codes in ``[lo, hi)``."""
    return search(qt.codes_array, hi, "left", lo, "left")


def cell_base(codes: U64, level: I64) -> tuple[U64, U64]:
    """Vectorized half-open code range of the cells at ``level`` that hold ``codes``."""
    sh = (2 * (GRID_BITS - level)).astype(np.uint64)
    base = (codes >> sh) << sh
    return base, base + (np.uint64(1) << sh)


def shortfall(n_present: int, k: int) -> CloakResult:
    """Refusal when no region of the algorithm holds ``k`` users (§3.3: ``k_unreachable`` only if n < k)."""
    return K_UNREACHABLE if n_present < k else AREA_EXCEEDED


BATCH_SLICE = 4096
"""Requests per slice of a quadtree ``cloak_batch``. The batch is put in code order once, then
worked through in slices: every temporary column of a slice (≤ 32 KiB of int64) stays below the
allocator's mmap threshold (128 KiB, :func:`kcloak.core.memory.fix_mmap_threshold`), so it is
neither mapped nor faulted in afresh, and stays in the CPU cache. Whole-batch columns of 20,000
requests were each mapped and unmapped again, which doubled the batch's CPU time."""


def code_order_slices(qt: QuadtreeCounts, rows: I64, size: int = BATCH_SLICE) -> Iterator[tuple[I64, I64]]:
    """The request indices of a batch in code order (ties by request index), with an index of each
    one's code in the sorted codes, in slices of ``size`` requests."""
    m = len(rows)
    size = max(1, size)
    # Requests in code order: every later search then walks the sorted codes forwards (≈7× faster),
    # and requests answered by the same rectangle sit next to each other (see group_runs).
    key = qt.positions()[rows]
    b = max(m - 1, 1).bit_length()
    if max(qt.n - 1, 1).bit_length() + b > 62:  # combined keys would not fit an int64
        idx = np.argsort(key, kind="stable")
        key = key[idx]
        for lo in range(0, m, size):
            yield idx[lo : lo + size], key[lo : lo + size]
        return
    # One in-place sort of combined ``p · 2^b + request`` keys (about 3× faster than an argsort);
    # request and position are split off per slice.
    key <<= b
    key |= np.arange(m, dtype=np.int64)
    key.sort()
    mask = (1 << b) - 1
    for lo in range(0, m, size):
        part = key[lo : lo + size]
        yield part & mask, part >> b


def batch_prologue(
    qt: QuadtreeCounts,
    view: IndexView,
    out: BatchResult,
    rows: I64,
    profiles: ProfileArrays,
    root: Root,
    idx: I64,
    p: I64,
    *,
    check_root: bool = True,
) -> tuple[I64, I64, U64, I64, I64]:
    """Common start of a slice of a quadtree ``cloak_batch`` (request indices ``idx`` in code order,
    ``p`` an index of each one's code, from :func:`code_order_slices`): refusals for l, k and the
    root; the live requests.

    Returns ``(live request indices, an index of each one's code in the sorted codes, their codes,
    gx, gy)``, in code order.
    """
    level, rcx, rcy = root
    k = profiles.k[idx]
    r = rows[idx]
    gx = view.gx[r]
    gy = view.gy[r]
    s0 = GRID_BITS - level
    ok = ((gx >> s0) == rcx) & ((gy >> s0) == rcy)
    if check_root:
        ok &= qt.root_count(root) >= k
    else:
        ok &= k <= qt.n
    status = np.where(ok, 0, np.where(k > qt.n, ST_K, ST_AREA)).astype(np.int8)
    status[profiles.l[idx] > 1] = ST_UNSUPPORTED
    out.status[idx] = status
    keep = np.flatnonzero(status == 0)
    p = p[keep]
    return idx[keep], p, qt.codes_array[p], gx[keep], gy[keep]


# -- the cloaker -----------------------------------------------------------------------------


class BatchJob(NamedTuple):
    """What every slice of one quadtree ``cloak_batch`` shares."""

    view: IndexView
    qt: QuadtreeCounts
    out: BatchResult
    rows: I64
    profiles: ProfileArrays


class QuadtreeCarrier:
    """The quadtree cloakers' access to a view's :class:`QuadtreeCounts`: built from the counts this
    cloaker prepared for the previous view of the same index when that view directly precedes it."""

    name: ClassVar[str]
    _carry: QuadtreeCarry | None = None
    batch_slice: int = BATCH_SLICE
    """Requests per slice of :meth:`cloak_batch` (the answers do not depend on it)."""

    def cloak_batch(self, view: IndexView, rows: I64, profiles: ProfileArrays) -> BatchResult:
        """Vectorized :meth:`cloak`, one slice of the requests in code order at a time (:func:`code_order_slices`)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = BatchResult.empty(self.name, view.epoch, len(rows))
        if len(rows) == 0:
            return out
        qt = self.counts(view)
        job = BatchJob(view, qt, out, rows, profiles)
        for idx, p in code_order_slices(qt, rows, self.batch_slice):
            self._batch_slice(job, idx, p)
        return out

    def _batch_slice(self, job: BatchJob, idx: I64, p: I64) -> None:
        """Answer the requests ``idx`` of one slice into ``out`` (``p``: an index of each one's code)."""
        raise NotImplementedError

    def counts(self, view: IndexView) -> QuadtreeCounts:
        """The view's counts (cached in ``view.cache``, shared by every quadtree cloaker)."""
        qt: QuadtreeCounts | None = view.cache.get(QuadtreeCounts.CACHE_KEY)
        if qt is None:
            qt = view.cache[QuadtreeCounts.CACHE_KEY] = QuadtreeCounts(view, self._carry)
            self._carry = qt.carry(view)
        return qt

    def __getstate__(self) -> dict[str, Any]:
        """A copy or pickle of the cloaker leaves the carried counts behind (they hold memoryviews)."""
        state = dict(self.__dict__)
        state.pop("_carry", None)
        return state

    def carried_over(self, view: IndexView) -> bool:
        """Whether the view's counts were patched from the previous view's (False before first use)."""
        qt: QuadtreeCounts | None = view.cache.get(QuadtreeCounts.CACHE_KEY)
        return qt is not None and qt.carried


def reciprocal_partition(view: IndexView, root: Root, deepest: int) -> tuple[I64, npt.NDArray[np.bool_]]:
    """The reciprocal quadtree of §4.2 [design]: each view row's leaf level, and whether its leaf stands alone.

    A node is split iff every non-empty child can stand alone (holds ≥ the largest stored k of its
    users and has area ≥ their largest stored A_min) and the depth limit allows; the leaves depend
    on the view and the stored profiles only. Built top-down one level at a time over the
    Morton-sorted users (``reduceat`` per level). Only the root can be a leaf that does not stand
    alone. Rows outside the root get level −1. Cached per view.
    """
    key = ("kcloak.interval.partition", root, deepest)
    cached: tuple[I64, npt.NDArray[np.bool_]] | None = view.cache.get(key)
    if cached is not None:
        return cached
    qt = QuadtreeCounts.of(view)
    order = qt.order
    codes = qt.codes_array
    n = qt.n
    root_level, rcx, rcy = root
    s0 = GRID_BITS - root_level
    gx = view.gx[order]
    gy = view.gy[order]
    k = view.k[order]
    a_min = view.min_area_m2[order]
    leaf = np.full(n, -1, np.int64)
    stands = np.zeros(n, bool)
    idx = np.flatnonzero(((gx >> s0) == rcx) & ((gy >> s0) == rcy))  # sorted positions still descending
    if len(idx):
        stands[idx] = len(idx) >= k[idx].max() and cell_area_m2(*root) >= a_min[idx].max()
    level = root_level
    while len(idx) and level < deepest:
        child = level + 1
        sc = GRID_BITS - child
        prefix = codes[idx] >> np.uint64(2 * sc)
        starts = np.flatnonzero(np.concatenate(([True], prefix[1:] != prefix[:-1])))
        counts = np.diff(np.append(starts, len(idx)))
        cx = gx[idx[starts]] >> sc
        cy = gy[idx[starts]] >> sc
        area = cell_areas_m2(np.full(len(starts), child, np.int64), cx, cy, cx, cy)
        alone = (counts >= np.maximum.reduceat(k[idx], starts)) & (area >= np.maximum.reduceat(a_min[idx], starts))
        parent = prefix[starts] >> np.uint64(2)
        pstarts = np.flatnonzero(np.concatenate(([True], parent[1:] != parent[:-1])))
        split = np.minimum.reduceat(alone.astype(np.uint8), pstarts).astype(bool)
        user_split = np.repeat(np.repeat(split, np.diff(np.append(pstarts, len(starts)))), counts)
        leaf[idx[~user_split]] = level
        idx = idx[user_split]
        stands[idx] = True  # children of a split node all stand alone
        level = child
    leaf[idx] = level
    out_leaf = np.empty(n, np.int64)
    out_leaf[order] = leaf
    out_stands = np.empty(n, bool)
    out_stands[order] = stands
    out_leaf.setflags(write=False)
    out_stands.setflags(write=False)
    view.cache[key] = (out_leaf, out_stands)
    return out_leaf, out_stands


class IntervalCloak(QuadtreeCarrier):
    """Gruteser–Grunwald interval cloaking with the ``A_min`` stop rule (CONCEPTS §4.2).

    Not reciprocal (test ``recip_quadtree``). Counts come from the view's sorted Morton codes, so a
    request costs a handful of bisects; ``cloak_batch`` runs the same level search on arrays.

    Keyword arguments:
        root: the quadtree's root cell ``(level, cx, cy)`` on the micro-degree grid (default
            ``(0, 0, 0)``, the whole grid).
        depth_max: how many levels below the root the descent may go (default: down to level 29).
        reciprocal_partition: serve the querier's leaf of the reciprocal quadtree instead (§4.2
            [design]; default False). The leaves come from the view and the *stored* profiles, so
            every member of a leaf gets the same region; a request stricter than its leaf allows
            (an override) is refused rather than coarsened. The class attribute ``reciprocal``
            stays False (it is per class); :attr:`partition_reciprocal` tells the instance's.
    """

    name: ClassVar[str] = "interval"
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    vectorized: ClassVar[bool] = True
    incremental_views: ClassVar[bool] = True

    def __init__(
        self, *, root: Root = WORLD_ROOT, depth_max: int | None = None, reciprocal_partition: bool = False
    ) -> None:
        self._root_level, self._deepest = levels_of(root, depth_max)
        self.root = root
        self.depth_max = self._deepest - self._root_level
        self.reciprocal_partition = reciprocal_partition

    @property
    def partition_reciprocal(self) -> bool:
        """Whether this instance is reciprocal (the reciprocal-quadtree variant)."""
        return self.reciprocal_partition

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        """Cloak the request of view row ``row`` (§4.2 pseudocode, binary search over levels)."""
        if profile.l > 1:
            return UNSUPPORTED_L
        qt = view.cache.get(QuadtreeCounts.CACHE_KEY) or self.counts(view)
        k = profile.k
        pos, lon_keys, lat_keys = qt.at_row or qt.row_columns()
        kx = lon_keys[row]
        ky = lat_keys[row]
        gx = (kx >> 1) + GRID_OFFSET - (kx == LON_TOP_KEY)  # grid_of_key, inlined
        gy = (ky >> 1) + GRID_OFFSET - (ky == LAT_TOP_KEY)
        root = self.root
        if self._root_level:
            s0 = GRID_BITS - root[0]
            if gx >> s0 != root[1] or gy >> s0 != root[2]:
                return shortfall(qt.n, k) if qt.n < k else OUTSIDE_ROOT
        p = pos[row]
        codes = qt.codes
        code = codes[p]
        if self.reciprocal_partition:
            leaf, stands = reciprocal_partition(view, root, self._deepest)
            if not stands[row]:
                return shortfall(qt.n, k)
            level = int(leaf[row])
        else:
            if qt.root_count(root) < k:
                return shortfall(qt.n, k)
            level = deepest_level(qt, p, code, gx, gy, k, profile.min_area_m2, self._root_level, self._deepest)
        s = GRID_BITS - level
        sh = 2 * s
        key = ((1 << (2 * level)) | (code >> sh)) << 2  # group_id(level, cx, cy, KIND_CELL)
        memo = qt.regions[self.name]
        region = memo.get(key)
        if region is None:
            base = (code >> sh) << sh
            i = run_start(codes, base, p)
            j = run_end(codes, base + (1 << sh), p)
            lon0 = ((gx >> s) << s) - GRID_OFFSET
            lat0 = ((gy >> s) << s) - GRID_OFFSET
            w = 1 << s
            rect = (lon0, lat0, lon0 + w, lat0 + w)
            region = memo[key] = rect_region(view, qt, self.name, rect, j - i, qt.members(i, j))
        if len(region.anon_set) < k:  # reciprocal variant: the group itself must hold k (§1.5)
            return shortfall(qt.n, k)
        return fit_profile(view, region, profile)

    def _batch_slice(self, job: BatchJob, idx: I64, p: I64) -> None:
        """:meth:`cloak` for the requests ``idx`` of a slice (the level binary search on all at once)."""
        view, qt, out, rows, profiles = job
        live, pos, codes, gx, gy = batch_prologue(
            qt, view, out, rows, profiles, self.root, idx, p, check_root=not self.reciprocal_partition
        )
        if self.reciprocal_partition:
            leaf, stands = reciprocal_partition(view, self.root, self._deepest)
            level = np.maximum(leaf[rows[live]], 0)
            ok = stands[rows[live]]
            bad = live[~ok]
            out.status[bad] = np.where(profiles.k[bad] > qt.n, ST_K, ST_AREA)
            live, codes, gx, gy, level = live[ok], codes[ok], gx[ok], gy[ok], level[ok]
        else:
            m = len(live)
            level = deepest_levels(
                qt,
                pos,
                codes,
                gx,
                gy,
                profiles.k[live],
                profiles.min_area_m2[live],
                np.full(m, self._root_level, np.int64),
                np.full(m, self._deepest, np.int64),
            )
        group = group_ids(level, codes, KIND_CELL)
        first, run = group_runs(group)
        lv = level[first]
        lo, hi = cell_base(codes[first], lv)
        n_in = sorted_counts(qt.codes_array, lo, hi)
        if self.reciprocal_partition:  # the leaf itself must hold k (§1.5)
            short = n_in[run] < profiles.k[live]
            bad = live[short]
            out.status[bad] = np.where(profiles.k[bad] > qt.n, ST_K, ST_AREA)
            live, group, run = live[~short], group[~short], run[~short]
        s = GRID_BITS - lv
        cx = gx[first] >> s
        cy = gy[first] >> s
        small = publish_rects(view, qt, out, live, group, run, lv, cx, cy, cx, cy, n_in, profiles)
        for i in small.tolist():
            out.set(i, self.cloak(view, int(rows[i]), profiles[i]))


__all__ = [
    "BATCH_SLICE",
    "KIND_CELL",
    "KIND_HPAIR",
    "KIND_VPAIR",
    "WORLD_ROOT",
    "BatchJob",
    "IntervalCloak",
    "QuadtreeCarrier",
    "QuadtreeCounts",
    "Root",
    "cell_area_m2",
    "cell_areas_m2",
    "cell_bbox",
    "cell_code_base",
    "cell_rect_udeg",
    "code_order_slices",
    "deepest_level",
    "deepest_levels",
    "fit_profile",
    "grid_coord",
    "group_id",
    "group_ids",
    "group_runs",
    "levels_of",
    "publish_rects",
    "rect_bbox",
    "rect_region",
    "run_end",
    "run_start",
    "sorted_counts",
    "udeg_box_area_m2",
]
