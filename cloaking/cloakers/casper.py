"""Casper: bottom-up cloaking on a pyramid with sibling pairs (Mokbel, Chow, Aref, VLDB 2006; CONCEPTS §4.3).

``basic`` is the paper's bottom-up algorithm on the complete pyramid of the micro-degree quadtree:
from the querier's lowest cell upwards, return the first cell that holds ``k`` users with area ≥
``A_min``, or the first horizontal/vertical sibling pair that does. It is computed without the
climb (see :func:`_casper_region`): a binary search finds the deepest level ``h*`` whose own cell
qualifies, and only the pairs one level below can beat that cell.

``adaptive`` serves each user from its leaf in Casper's incomplete pyramid (split a leaf iff one of
its users is satisfiable at the children's level, merge four leaves iff none is). For snapshot
cloaking the leaf levels are derived per view with numpy; :class:`AdaptivePyramid` maintains the
same pyramid incrementally under add / move / remove, as the paper's anonymizer does.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.cloakers.base import CloakMode, CloakResult, Region
from kcloak.cloaking.cloakers.interval import (
    KIND_CELL,
    KIND_HPAIR,
    KIND_VPAIR,
    LAT_TOP_KEY,
    LON_TOP_KEY,
    OUTSIDE_ROOT,
    ST_AREA,
    ST_K,
    UNSUPPORTED_L,
    WORLD_ROOT,
    BatchJob,
    QuadtreeCarrier,
    QuadtreeCounts,
    Root,
    batch_prologue,
    cell_area_m2,
    cell_areas_m2,
    cell_base,
    cell_rect_udeg,
    deepest_level,
    deepest_levels,
    fit_profile,
    grid_coord,
    group_ids,
    group_runs,
    levels_of,
    publish_rects,
    range_counts,
    rect_region,
    run_end,
    run_start,
    shortfall,
)
from kcloak.cloaking.grid import GRID_BITS, GRID_OFFSET
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import coordinate_key
from kcloak.core.profile import PrivacyProfile, ReasonCode

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]
Cell = tuple[int, int, int]
Rect = tuple[int, int, int, int, int]
"""A cell rectangle ``(level, cx0, cy0, cx1, cy1)``: one cell, or a sibling pair."""

Variant = Literal["basic", "adaptive"]
Tie = Literal["horizontal", "vertical"]


# -- the fast basic algorithm (scalar) --------------------------------------------------------
#
# Why only level h* + 1 needs its pairs checked. Let h* be the deepest level whose own cell on the
# querier's path satisfies (N ≥ k and area ≥ A_min); both quantities shrink along the root path,
# so the satisfying own cells are exactly the levels root … h*. A sibling pair at level h lies
# inside the parent cell at level h − 1, so N(pair) ≤ N(parent) and area(pair) ≤ area(parent): a
# satisfying pair at level h makes the parent satisfy, i.e. h − 1 ≤ h*. Hence no pair deeper than
# h* + 1 satisfies, and no own cell deeper than h* does. The literal climb from the lowest level
# therefore passes every level below h* + 1 without returning, at h* + 1 returns a satisfying pair
# if there is one (its own cell fails there), and otherwise returns the own cell at h*. If the root
# itself fails, every pair fails as well (pairs lie inside the root) and the climb refuses.


def _casper_region(
    view: IndexView,
    qt: QuadtreeCounts,
    algorithm: str,
    p: int,
    code: int,
    gx: int,
    gy: int,
    k: int,
    a_min: float,
    root_level: int,
    bottom: int,
    tie_h: bool,
) -> Region:
    """Casper's profile-free region for one request whose code ``code`` sits at index ``p`` of ``qt.codes``.

    The querier's cell at ``h*`` or a sibling pair at ``h* + 1`` (see above), taken from the view's
    memo of published regions or built (bbox, area, exact ``k_achieved``, the users by code ranges:
    one range, or two for a vertical pair). The caller has checked that the root holds ``k`` users
    and has area ≥ ``a_min``; ``bottom`` is the level the climb starts from.
    """
    codes = qt.codes
    h = deepest_level(qt, p, code, gx, gy, k, a_min, root_level, bottom)
    i1 = j1 = 0
    if h < bottom:
        level = h + 1
        s = GRID_BITS - level
        sh = 2 * s
        # The parent (the own cell at h*) has four children in consecutive Morton ranges, child
        # q = (y bit << 1) | x bit: two bisects bound the parent, three more (inside it) split it.
        # The five bounds are kept per view, keyed by the parent's locational code.
        pkey = (code >> (sh + 2)) | (1 << (2 * h))
        b = qt.parent_bounds.get(pkey)
        if b is None:
            size = 1 << sh
            pbase = (code >> (sh + 2)) << (sh + 2)
            b0 = run_start(codes, pbase, p)
            b4 = run_end(codes, pbase + 4 * size, p)
            b1 = bisect_left(codes, pbase + size, b0, b4)
            b2 = bisect_left(codes, pbase + 2 * size, b1, b4)
            b3 = bisect_left(codes, pbase + 3 * size, b2, b4)
            b = qt.parent_bounds[pkey] = (b0, b1, b2, b3, b4)
        q = (code >> sh) & 3
        n_c = b[q + 1] - b[q]
        n_hp = n_c + b[(q ^ 1) + 1] - b[q ^ 1]  # horizontal neighbour: the other x bit
        n_vp = n_c + b[(q ^ 2) + 1] - b[q ^ 2]  # vertical neighbour: the other y bit
        sat_h = n_hp >= k
        sat_v = n_vp >= k
        if a_min > 0:
            cx = gx >> s
            cy = gy >> s
            sat_h = sat_h and cell_area_m2(level, cx & ~1, cy, cx | 1, cy) >= a_min
            sat_v = sat_v and cell_area_m2(level, cx, cy & ~1, cx, cy | 1) >= a_min
        # Prefer the pair closer to k; on a tie the configured direction (⚠ §4.3: horizontal).
        if sat_h and (not sat_v or n_hp < n_vp or (n_hp == n_vp and tie_h)):
            kind = KIND_HPAIR
            key = (((1 << (2 * level)) | ((code >> sh) & ~1)) << 2) | KIND_HPAIR
            r = q & 2  # the row's two children are adjacent in Morton order
            i0, j0 = b[r], b[r + 2]
        elif sat_v:
            kind = KIND_VPAIR
            key = (((1 << (2 * level)) | ((code >> sh) & ~2)) << 2) | KIND_VPAIR
            c = q & 1  # the column's two children are not
            i0, j0, i1, j1 = b[c], b[c + 1], b[c + 2], b[c + 3]
        else:  # the own cell at h* is the parent
            level = h
            kind = KIND_CELL
            key = ((1 << (2 * h)) | (code >> (sh + 2))) << 2
            i0, j0 = b[0], b[4]
        region = qt.regions[algorithm].get(key)
        if region is not None:
            return region
    else:
        level = h
        kind = KIND_CELL
        sh = 2 * (GRID_BITS - h)
        key = ((1 << (2 * h)) | (code >> sh)) << 2
        region = qt.regions[algorithm].get(key)
        if region is not None:
            return region
        base = (code >> sh) << sh
        i0, j0 = run_start(codes, base, p), run_end(codes, base + (1 << sh), p)
    # Not published yet in this view: the rectangle's cells, its users, its region.
    s = GRID_BITS - level
    x0 = x1 = gx >> s
    y0 = y1 = gy >> s
    if kind == KIND_VPAIR:
        y0 &= ~1
        y1 |= 1
        anon = np.concatenate((qt.members(i0, j0), qt.members(i1, j1)))
    else:
        if kind == KIND_HPAIR:
            x0 &= ~1
            x1 |= 1
        anon = qt.members(i0, j0)
    rect = cell_rect_udeg(level, x0, y0, x1, y1)
    region = qt.regions[algorithm][key] = rect_region(view, qt, algorithm, rect, (j0 - i0) + (j1 - i1), anon)
    return region


# -- the fast basic algorithm (vectorized) ----------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class CasperArrays:
    """Casper's answers for many requests: rectangle per request, its kind and grid count.

    ``ok`` is False where even the root fails (area below ``A_min``; the count was checked before).
    """

    ok: npt.NDArray[np.bool_]
    level: I64
    cx0: I64
    cy0: I64
    cx1: I64
    cy1: I64
    kind: I64
    in_cells: I64


def casper_arrays(
    qt: QuadtreeCounts,
    p: I64,
    codes: U64,
    gx: I64,
    gy: I64,
    k: I64,
    a_min: F64,
    root: Root,
    bottom: I64,
    tie_h: bool,
) -> CasperArrays:
    """Vectorized :func:`_casper_region`'s choice (requests already known to lie in a root holding ≥ k users;
    ``p``: an index of each one's code in ``qt.codes_array``)."""
    m = len(codes)
    root_level = root[0]
    s0 = GRID_BITS - root_level
    ok = np.ones(m, bool)
    need = np.flatnonzero(a_min > 0)
    if len(need):
        rx, ry = gx[need] >> s0, gy[need] >> s0
        ok[need] = cell_areas_m2(np.full(len(need), root_level, np.int64), rx, ry, rx, ry) >= a_min[need]
    h = deepest_levels(qt, p, codes, gx, gy, k, a_min, np.full(m, root_level, np.int64), bottom)
    kind = np.zeros(m, np.int64)
    cand = ok & (h < bottom)
    if cand.all():  # the usual case: every request may be answered by a pair one level below h*
        kind, in_cells = _pair_choice(qt, codes, gx, gy, h, k, a_min, tie_h)
    else:
        in_cells = np.empty(m, np.int64)
        rest = np.flatnonzero(~cand)
        lo, hi = cell_base(codes[rest], h[rest])
        in_cells[rest] = range_counts(qt, lo, hi)
        c = np.flatnonzero(cand)
        if len(c):
            kind[c], in_cells[c] = _pair_choice(qt, codes[c], gx[c], gy[c], h[c], k[c], a_min[c], tie_h)
    level = h + (kind != KIND_CELL)
    s = GRID_BITS - level
    x = gx >> s
    y = gy >> s
    xb = kind & 1  # a horizontal pair spans x & ~1 … x | 1, a vertical one y & ~1 … y | 1
    yb = kind >> 1
    return CasperArrays(ok, level, x & ~xb, y & ~yb, x | xb, y | yb, kind, in_cells)


def _pair_choice(
    qt: QuadtreeCounts, codes: U64, gx: I64, gy: I64, h: I64, k: I64, a_min: F64, tie_h: bool
) -> tuple[I64, I64]:
    """Per request below the root and above the bottom: the kind of Casper's answer (the own cell at
    ``h`` = h*, or a sibling pair at h* + 1) and the grid count of that rectangle."""
    c = h + 1
    sc = GRID_BITS - c
    sh = (2 * sc).astype(np.uint64)
    # The four children of the parent (the own cell at h*) are consecutive Morton ranges: 5
    # boundaries, searched once per run of requests with the same parent (they come in code order).
    parent = (codes >> (sh + np.uint64(2))) << (sh + np.uint64(2))
    first, run = group_runs((parent | (np.uint64(1) << sh)).view(np.int64))
    u = len(first)
    step = np.uint64(1) << sh[first]
    needles = np.empty((5, u), np.uint64)
    needles[0] = parent[first]
    for j in range(1, 5):
        needles[j] = needles[j - 1] + step
    bounds = np.searchsorted(qt.codes_array, needles.ravel())  # row j of the (5, u) bounds, flattened
    q = ((codes >> sh) & np.uint64(3)).astype(np.int64)  # child index (y bit << 1) | x bit
    at = q * u + run
    n_c = bounds[at + u] - bounds[at]
    r = (q & 2) * u + run  # the row's two children are adjacent in Morton order
    n_hp = bounds[r + 2 * u] - bounds[r]
    v = (q ^ 2) * u + run
    n_vp = n_c + bounds[v + u] - bounds[v]
    n_parent = bounds[run + 4 * u] - bounds[run]
    sat_h = n_hp >= k
    sat_v = n_vp >= k
    need = np.flatnonzero(a_min > 0)
    if len(need):
        x, y, cn, ac = gx[need] >> sc[need], gy[need] >> sc[need], c[need], a_min[need]
        sat_h[need] &= cell_areas_m2(cn, x & ~1, y, x | 1, y) >= ac
        sat_v[need] &= cell_areas_m2(cn, x, y & ~1, x, y | 1) >= ac
    # Prefer the pair closer to k; on a tie the configured direction (⚠ §4.3: horizontal).
    closer = n_hp <= n_vp if tie_h else n_hp < n_vp
    pick_h = sat_h & (~sat_v | closer)
    pick_v = sat_v & ~pick_h
    kind = pick_h * KIND_HPAIR + pick_v * KIND_VPAIR
    in_cells = np.where(pick_h, n_hp, np.where(pick_v, n_vp, n_parent))
    return kind.astype(np.int64), in_cells


# -- adaptive: the per-view leaf levels ---------------------------------------------------------


def leaf_levels(view: IndexView, root: Root, deepest: int, tie_h: bool) -> I64:
    """Level of each view row's leaf in Casper's adaptive pyramid built from the stored profiles.

    A node at level ℓ is split iff some user in it is satisfiable at level ℓ + 1 (own child cell or
    a sibling pair with ≥ its k users and area ≥ its A_min, §4.3). Satisfiability is monotone
    upwards, so a user ``w`` is satisfiable at ℓ + 1 iff its basic answer level ``s_w`` is ≥ ℓ + 1:
    the node is split iff max(s_w) over it exceeds ℓ, and a user's leaf is the first level ℓ
    with max(s_w) over its cell ≤ ℓ (or the depth limit). Rows outside the root get −1.
    """
    key = ("kcloak.casper.leaves", root, deepest, tie_h)
    cached: I64 | None = view.cache.get(key)
    if cached is not None:
        return cached
    qt = QuadtreeCounts.of(view)
    n = qt.n
    root_level, rcx, rcy = root
    s0 = GRID_BITS - root_level
    inside = ((view.gx >> s0) == rcx) & ((view.gy >> s0) == rcy)
    k = view.k
    answer = np.full(n, root_level - 1, np.int64)
    order = qt.order
    at = np.flatnonzero((inside & (qt.root_count(root) >= k))[order])  # in code order: searches walk forwards
    live = order[at]
    if len(live):
        arr = casper_arrays(
            qt,
            at,
            qt.codes_array[at],
            view.gx[live],
            view.gy[live],
            k[live],
            view.min_area_m2[live],
            root,
            np.full(len(live), deepest, np.int64),
            tie_h,
        )
        answer[live] = np.where(arr.ok, arr.level, root_level - 1)
    leaf = np.full(n, -1, np.int64)
    leaf[inside] = deepest
    s_sorted = answer[order]
    open_ = inside[order].copy()
    codes = qt.codes_array
    lo = max(root_level, int(answer[inside].min()) if inside.any() else root_level)
    for level in range(lo, deepest):
        if not open_.any():
            break
        prefix = codes >> np.uint64(2 * (GRID_BITS - level))
        starts = np.flatnonzero(np.concatenate(([True], prefix[1:] != prefix[:-1])))
        seg_max = np.maximum.reduceat(s_sorted, starts)
        per_row = np.repeat(seg_max, np.diff(np.append(starts, n)))
        done = open_ & (per_row <= level)
        leaf[order[done]] = level
        open_ &= ~done
    leaf.setflags(write=False)
    view.cache[key] = leaf
    return leaf


# -- the cloaker -----------------------------------------------------------------------------


class CasperCloak(QuadtreeCarrier):
    """Casper, basic or adaptive (CONCEPTS §4.3); not reciprocal.

    Keyword arguments:
        variant: ``"basic"`` (default) climbs the complete pyramid from the querier's lowest cell;
            ``"adaptive"`` climbs from its leaf in the incomplete pyramid of the stored profiles
            (same regions; an effective profile looser than the stored one is served from the
            lowest cell instead, so the two variants always agree).
        tie: which sibling pair wins when both hold the same number of users: ``"horizontal"``
            (default, ⚠ as recalled from the paper) or ``"vertical"``.
        root: the pyramid's root cell ``(level, cx, cy)`` (default ``(0, 0, 0)``, the whole grid).
        depth_max: how many levels below the root the pyramid goes (default: down to level 29).
    """

    name: ClassVar[str] = "casper"
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    vectorized: ClassVar[bool] = True
    incremental_views: ClassVar[bool] = True

    def __init__(
        self,
        *,
        variant: Variant = "basic",
        tie: Tie = "horizontal",
        root: Root = WORLD_ROOT,
        depth_max: int | None = None,
    ) -> None:
        if variant not in ("basic", "adaptive"):
            raise ValueError("variant: must be 'basic' or 'adaptive'")
        if tie not in ("horizontal", "vertical"):
            raise ValueError("tie: must be 'horizontal' or 'vertical'")
        self._root_level, self._deepest = levels_of(root, depth_max)
        self.variant = variant
        self.tie = tie
        self.root = root
        self.depth_max = self._deepest - self._root_level
        self._tie_h = tie == "horizontal"

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        """Cloak the request of view row ``row`` (the §4.3 pseudocode, computed as described above)."""
        if profile.l > 1:
            return UNSUPPORTED_L
        qt = view.cache.get(QuadtreeCounts.CACHE_KEY) or self.counts(view)
        k = profile.k
        a_min = profile.min_area_m2
        pos, lon_keys, lat_keys = qt.at_row or qt.row_columns()
        kx = lon_keys[row]
        ky = lat_keys[row]
        gx = (kx >> 1) + GRID_OFFSET - (kx == LON_TOP_KEY)  # grid_of_key, inlined
        gy = (ky >> 1) + GRID_OFFSET - (ky == LAT_TOP_KEY)
        root_level = self._root_level
        if root_level:
            root = self.root
            s0 = GRID_BITS - root_level
            if gx >> s0 != root[1] or gy >> s0 != root[2]:
                return shortfall(qt.n, k) if qt.n < k else OUTSIDE_ROOT
            if qt.root_count(root) < k:
                return shortfall(qt.n, k)
        elif qt.n < k:  # the whole grid holds everyone
            return shortfall(qt.n, k)
        if (
            a_min > 0
            and cell_area_m2(root_level, gx >> (GRID_BITS - root_level), gy >> (GRID_BITS - root_level)) < a_min
        ):
            return shortfall(qt.n, k)  # even the root is too small
        bottom = self._deepest
        if self.variant == "adaptive" and k >= view.k[row] and a_min >= view.min_area_m2[row]:
            bottom = int(leaf_levels(view, self.root, bottom, self._tie_h)[row])
        p = pos[row]
        region = _casper_region(view, qt, self.name, p, qt.codes[p], gx, gy, k, a_min, root_level, bottom, self._tie_h)
        if region.area_m2 < a_min or region.area_m2 > profile.max_area_m2 or region.k_achieved < k:
            return fit_profile(view, region, profile)
        return region

    def _batch_slice(self, job: BatchJob, idx: I64, p: I64) -> None:
        """:meth:`cloak` for the requests ``idx`` of a slice (level search and pair counts on all at once)."""
        view, qt, out, rows, profiles = job
        live, pos, codes, gx, gy = batch_prologue(qt, view, out, rows, profiles, self.root, idx, p)
        k = profiles.k[live]
        a_min = profiles.min_area_m2[live]
        bottom = np.full(len(live), self._deepest, np.int64)
        if self.variant == "adaptive":
            r = rows[live]
            stricter = (k >= view.k[r]) & (a_min >= view.min_area_m2[r])
            bottom = np.where(stricter, leaf_levels(view, self.root, self._deepest, self._tie_h)[r], bottom)
        arr = casper_arrays(qt, pos, codes, gx, gy, k, a_min, self.root, bottom, self._tie_h)
        failed = live[~arr.ok]
        out.status[failed] = np.where(profiles.k[failed] > qt.n, ST_K, ST_AREA)
        sel = np.flatnonzero(arr.ok)
        group = group_ids(arr.level[sel], codes[sel], arr.kind[sel])
        first, run = group_runs(group)
        f = sel[first]
        small = publish_rects(
            view,
            qt,
            out,
            live[sel],
            group,
            run,
            arr.level[f],
            arr.cx0[f],
            arr.cy0[f],
            arr.cx1[f],
            arr.cy1[f],
            arr.in_cells[f],
            profiles,
        )
        for i in small.tolist():
            out.set(i, self.cloak(view, int(rows[i]), profiles[i]))


# -- adaptive: the incremental pyramid ---------------------------------------------------------


@dataclass(slots=True)
class _Node:
    count: int
    profiles: dict[tuple[int, float], int]
    users: set[str] | None  # the users of a leaf; None for an internal node


@dataclass(slots=True)
class _User:
    gx: int
    gy: int
    k: int
    min_area_m2: float
    leaf: Cell


class AdaptivePyramid:
    """Casper's adaptive anonymizer: an incomplete pyramid maintained under user updates (§4.3).

    Only the cells some user needs are materialised. Invariant (⚠ as recalled from the paper): a
    leaf is split into its four children iff at least one of its users could be satisfied at the
    children's level (own child cell or a sibling pair with count ≥ the user's k and area ≥ the
    user's A_min); four sibling leaves are merged iff none of their users could. Every node keeps
    its count and a histogram of its users' stored (k, A_min); a move that changes leaf updates the
    counters below the two leaves' common ancestor only (``counter_updates`` counts them), then
    re-settles the nodes on the two paths. The pyramid is canonical: it depends only on the current
    users, never on the order of updates.

    Keyword arguments:
        root: the pyramid's root cell ``(level, cx, cy)`` (default ``(0, 0, 0)``, the whole grid).
        depth_max: how many levels below the root the pyramid may go (default: down to level 29).
        tie: sibling-pair tie rule used by :meth:`cloak` (default ``"horizontal"``).
    """

    def __init__(self, *, root: Root = WORLD_ROOT, depth_max: int | None = None, tie: Tie = "horizontal") -> None:
        self._root_level, self._deepest = levels_of(root, depth_max)
        self.root = root
        self._tie_h = tie == "horizontal"
        self._nodes: dict[Cell, _Node] = {root: _Node(0, {}, set())}
        self._users: dict[str, _User] = {}
        self.counter_updates = 0
        """Node counters incremented or decremented by add / move / remove (the paper's update cost)."""
        self.splits = 0
        self.merges = 0

    def __len__(self) -> int:
        return len(self._users)

    def __contains__(self, user: object) -> bool:
        return user in self._users

    # -- queries ------------------------------------------------------------------------------
    def leaf_of(self, user: str) -> Cell:
        """The materialised leaf holding ``user``."""
        return self._users[user].leaf

    def count(self, cell: Cell) -> int:
        """Users in a materialised cell (KeyError for a cell that is not materialised)."""
        return self._nodes[cell].count

    def leaves(self) -> Iterator[Cell]:
        return (c for c, node in self._nodes.items() if node.users is not None)

    @property
    def n_nodes(self) -> int:
        return len(self._nodes)

    def cloak(self, user: str, *, k: int | None = None, min_area_m2: float | None = None) -> Rect | ReasonCode:
        """``casper_basic`` started at the user's leaf (§4.3): a cell rectangle or a refusal code.

        ``k`` / ``min_area_m2`` default to the stored ones and may only be stricter (a looser
        request could be satisfiable below the leaf, which is not materialised).
        """
        rec = self._users[user]
        kk = rec.k if k is None else k
        a_min = rec.min_area_m2 if min_area_m2 is None else min_area_m2
        if kk < rec.k or a_min < rec.min_area_m2:
            raise ValueError("cloak: k and min_area_m2 may only be stricter than the stored profile")
        nodes = self._nodes
        level, cx, cy = rec.leaf
        while True:
            n = nodes[(level, cx, cy)].count
            if n >= kk and cell_area_m2(level, cx, cy) >= a_min:
                return (level, cx, cy, cx, cy)
            if level == self._root_level:
                return ReasonCode.K_UNREACHABLE if len(self._users) < kk else ReasonCode.AREA_EXCEEDED
            n_hp = n + nodes[(level, cx ^ 1, cy)].count
            n_vp = n + nodes[(level, cx, cy ^ 1)].count
            sat_h = n_hp >= kk and cell_area_m2(level, cx & ~1, cy, cx | 1, cy) >= a_min
            sat_v = n_vp >= kk and cell_area_m2(level, cx, cy & ~1, cx, cy | 1) >= a_min
            if sat_h and (not sat_v or n_hp < n_vp or (n_hp == n_vp and self._tie_h)):
                return (level, cx & ~1, cy, cx | 1, cy)
            if sat_v:
                return (level, cx, cy & ~1, cx, cy | 1)
            level, cx, cy = level - 1, cx >> 1, cy >> 1

    # -- updates ------------------------------------------------------------------------------
    def add(self, user: str, lat: float, lon: float, *, k: int, min_area_m2: float = 0.0) -> None:
        """Add a user with its position and stored ``(k, A_min)``."""
        if user in self._users:
            raise KeyError("add: user already present")
        gx, gy = self._grid(lat, lon)
        self._add_at(user, gx, gy, k, float(min_area_m2))

    def remove(self, user: str) -> None:
        """Remove a user."""
        rec = self._users.pop(user)
        node = self._nodes[rec.leaf]
        assert node.users is not None
        node.users.discard(user)
        self._walk(rec.gx, rec.gy, (rec.k, rec.min_area_m2), -1, self._root_level)
        self._settle_path(rec.gx, rec.gy, self._root_level)

    def move(self, user: str, lat: float, lon: float) -> None:
        """Move a user: counters change only below the common ancestor of its old and new leaves."""
        rec = self._users[user]
        gx, gy = self._grid(lat, lon)
        old_gx, old_gy = rec.gx, rec.gy
        leaf_level, lcx, lcy = rec.leaf
        s = GRID_BITS - leaf_level
        if gx >> s == lcx and gy >> s == lcy:
            rec.gx, rec.gy = gx, gy  # same leaf: no counter changes; its split status may change
            self._settle_path(gx, gy, leaf_level)
            return
        common = GRID_BITS - max((gx ^ old_gx).bit_length(), (gy ^ old_gy).bit_length())
        prof = (rec.k, rec.min_area_m2)
        old_leaf = self._nodes[rec.leaf]
        assert old_leaf.users is not None
        old_leaf.users.discard(user)
        self._walk(old_gx, old_gy, prof, -1, common + 1)
        new_leaf = self._walk(gx, gy, prof, +1, common + 1)
        node = self._nodes[new_leaf]
        assert node.users is not None
        node.users.add(user)
        rec.gx, rec.gy, rec.leaf = gx, gy, new_leaf
        self._settle_path(old_gx, old_gy, common)
        self._settle_path(gx, gy, common)

    def set_profile(self, user: str, *, k: int, min_area_m2: float = 0.0) -> None:
        """Change a user's stored profile (it changes histograms on its whole path)."""
        rec = self._users[user]
        self.remove(user)
        self._add_at(user, rec.gx, rec.gy, k, float(min_area_m2))

    # -- internals ----------------------------------------------------------------------------
    def _grid(self, lat: float, lon: float) -> tuple[int, int]:
        gx = grid_coord(coordinate_key(lon), "lon")
        gy = grid_coord(coordinate_key(lat), "lat")
        level, rcx, rcy = self.root
        s = GRID_BITS - level
        if gx >> s != rcx or gy >> s != rcy:
            raise ValueError("position: outside the pyramid's root cell")
        return gx, gy

    def _add_at(self, user: str, gx: int, gy: int, k: int, min_area_m2: float) -> None:
        leaf = self._walk(gx, gy, (k, min_area_m2), +1, self._root_level)
        node = self._nodes[leaf]
        assert node.users is not None
        node.users.add(user)
        self._users[user] = _User(gx, gy, k, min_area_m2, leaf)
        self._settle_path(gx, gy, self._root_level)

    def _walk(self, gx: int, gy: int, prof: tuple[int, float], delta: int, start: int) -> Cell:
        """Add ``delta`` to the counters on the path from level ``start`` down to the leaf; return the leaf."""
        nodes = self._nodes
        level = start
        while True:
            s = GRID_BITS - level
            cell = (level, gx >> s, gy >> s)
            node = nodes[cell]
            node.count += delta
            c = node.profiles.get(prof, 0) + delta
            if c:
                node.profiles[prof] = c
            else:
                del node.profiles[prof]
            self.counter_updates += 1
            if node.users is not None:
                return cell
            level += 1

    def _child_stats(self, cell: Cell, node: _Node) -> list[tuple[int, dict[tuple[int, float], int]]]:
        level, cx, cy = cell
        if node.users is None:
            out = []
            for q in range(4):
                child = self._nodes[(level + 1, 2 * cx + (q & 1), 2 * cy + (q >> 1))]
                out.append((child.count, child.profiles))
            return out
        s = GRID_BITS - level - 1
        counts = [0, 0, 0, 0]
        profs: list[dict[tuple[int, float], int]] = [{}, {}, {}, {}]
        for u in node.users:
            rec = self._users[u]
            q = ((rec.gx >> s) & 1) | (((rec.gy >> s) & 1) << 1)
            counts[q] += 1
            key = (rec.k, rec.min_area_m2)
            profs[q][key] = profs[q].get(key, 0) + 1
        return list(zip(counts, profs, strict=True))

    def _should_split(self, cell: Cell, node: _Node) -> bool:
        """Whether some user of ``cell`` is satisfiable at the children's level (the §4.3 invariant)."""
        level, cx, cy = cell
        if level >= self._deepest or node.count == 0:
            return False
        stats = self._child_stats(cell, node)
        c = level + 1
        x0, y0 = 2 * cx, 2 * cy
        area = [cell_area_m2(c, x0 + (q & 1), y0 + (q >> 1)) for q in range(4)]
        h_area = [cell_area_m2(c, x0, y0 + r, x0 + 1, y0 + r) for r in range(2)]
        v_area = [cell_area_m2(c, x0 + col, y0, x0 + col, y0 + 1) for col in range(2)]
        for q in range(4):
            n_c, profs = stats[q]
            if n_c == 0:
                continue
            options = (
                (n_c, area[q]),
                (n_c + stats[q ^ 1][0], h_area[q >> 1]),
                (n_c + stats[q ^ 2][0], v_area[q & 1]),
            )
            for k, a_min in profs:
                for n_opt, a_opt in options:
                    if k <= n_opt and a_min <= a_opt:
                        return True
        return False

    def _settle_path(self, gx: int, gy: int, start: int) -> None:
        """Re-establish the invariant on the path of ``(gx, gy)`` from level ``start`` down."""
        nodes = self._nodes
        level = start
        while True:
            s = GRID_BITS - level
            cell = (level, gx >> s, gy >> s)
            node = nodes.get(cell)
            if node is None:
                return
            want = self._should_split(cell, node)
            if node.users is None:
                if not want:
                    self._merge(cell, node)
                    return
                level += 1
                continue
            if want:
                self._settle_subtree(cell, node)
            return

    def _settle_subtree(self, cell: Cell, node: _Node) -> None:
        """Split a leaf that should be split, then settle its new children recursively."""
        self._split(cell, node)
        level, cx, cy = cell
        for q in range(4):
            child_cell = (level + 1, 2 * cx + (q & 1), 2 * cy + (q >> 1))
            child = self._nodes[child_cell]
            if self._should_split(child_cell, child):
                self._settle_subtree(child_cell, child)

    def _split(self, cell: Cell, node: _Node) -> None:
        assert node.users is not None
        level, cx, cy = cell
        c = level + 1
        s = GRID_BITS - c
        children = {(c, 2 * cx + (q & 1), 2 * cy + (q >> 1)): _Node(0, {}, set()) for q in range(4)}
        for u in node.users:
            rec = self._users[u]
            child_cell = (c, rec.gx >> s, rec.gy >> s)
            child = children[child_cell]
            child.count += 1
            key = (rec.k, rec.min_area_m2)
            child.profiles[key] = child.profiles.get(key, 0) + 1
            assert child.users is not None
            child.users.add(u)
            rec.leaf = child_cell
        node.users = None
        self._nodes.update(children)
        self.splits += 1

    def _merge(self, cell: Cell, node: _Node) -> None:
        users: set[str] = set()
        stack = [cell]
        while stack:
            level, cx, cy = stack.pop()
            for q in range(4):
                child_cell = (level + 1, 2 * cx + (q & 1), 2 * cy + (q >> 1))
                child = self._nodes.pop(child_cell)
                if child.users is None:
                    stack.append(child_cell)
                else:
                    users |= child.users
        for u in users:
            self._users[u].leaf = cell
        node.users = users
        self.merges += 1

    def check(self) -> list[str]:
        """Violations of the structure's invariants (empty when sound); brute force, for tests."""
        problems: list[str] = []
        for cell, node in self._nodes.items():
            level, cx, cy = cell
            s = GRID_BITS - level
            members = {u for u, r in self._users.items() if r.gx >> s == cx and r.gy >> s == cy}
            if node.count != len(members):
                problems.append(f"{cell}: count {node.count} != {len(members)}")
            want = self._should_split(cell, node)
            if node.users is None:
                if not want:
                    problems.append(f"{cell}: internal but no user is satisfiable at the children's level")
                for q in range(4):
                    if (level + 1, 2 * cx + (q & 1), 2 * cy + (q >> 1)) not in self._nodes:
                        problems.append(f"{cell}: missing child {q}")
            else:
                if want:
                    problems.append(f"{cell}: leaf but some user is satisfiable at the children's level")
                if node.users != members:
                    problems.append(f"{cell}: leaf users differ")
            if level > self._root_level:
                parent = self._nodes.get((level - 1, cx >> 1, cy >> 1))
                if parent is None or parent.users is not None:
                    problems.append(f"{cell}: parent not an internal node")
        for u, r in self._users.items():
            leaf = self._nodes.get(r.leaf)
            if leaf is None or leaf.users is None or u not in leaf.users:
                problems.append(f"{r.leaf}: a user's leaf pointer is wrong")
        return problems


__all__ = ["AdaptivePyramid", "CasperArrays", "CasperCloak", "casper_arrays", "leaf_levels"]
