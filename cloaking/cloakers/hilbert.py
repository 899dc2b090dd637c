"""Hilbert Cloak: reciprocal buckets of users along a Hilbert curve (CONCEPTS §4.4; Kalnis et al., TKDE 2007).

Once per view, the present users are sorted by the Hilbert value of their micro-degree grid cell
(ties by a salted hash) and cut into consecutive buckets with kcloak's personalized rule: a bucket
closes when its size reaches the largest *stored* ``k`` among its members, and the leftover is
merged backwards. The region of a bucket depends on the bucket only, so every member gets the same
region (reciprocity, §1.5). A request stricter than its stored profile is served by an aligned
super-bucket, chosen so that reciprocity still holds for everyone sending the same override.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import numpy.typing as npt
import shapely

from kcloak.cloaking.cloakers.base import (
    STATUS_OF,
    BatchResult,
    CloakMode,
    CloakResult,
    Refusal,
    Region,
    ViewRef,
    refuse,
)
from kcloak.cloaking.cloakers.hilbert_segments import (
    SEGMENT_FACTOR,
    curve_segments,
    partition_segments,
    segment_threshold,
)
from kcloak.cloaking.curve import ViewDelta, hilbert_indices
from kcloak.cloaking.grid import GRID_BITS, GRID_OFFSET, grid_coords
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import (
    EARTH_RADIUS_M,
    MAX_REGION_AREA_M2,
    UDEG_PER_DEG,
    WORLD_LAT_UDEG,
    WORLD_LON_UDEG,
    BBox,
    bbox_around_keys,
    expand_to_area,
    key_bounds_array,
)
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

if TYPE_CHECKING:  # cells imports this module (hilbert_indices): the map is only a type here
    from kcloak.cloaking.cells import CellMap

I64 = npt.NDArray[np.int64]
Keys = npt.NDArray[np.int64] | npt.NDArray[np.int32]
"""Exact coordinate keys (int32 in the kept Hilbert order, int64 in a view\'s columns)."""
F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]

_MASK64 = (1 << 64) - 1
_UNSUPPORTED = refuse(ReasonCode.UNSUPPORTED, "hilbert: l > 1 is not supported (no place diversity)")
_K_UNREACHABLE = refuse(ReasonCode.K_UNREACHABLE)
# k users are present, but the population is smaller than its own largest stored k, so no bucket
# can be formed: the algorithm builds no region (contract §2: area_exceeded, not k_unreachable).
_NOT_PLACED = refuse(
    ReasonCode.AREA_EXCEEDED,
    "hilbert puts every present user in a group as large as the largest k any of them stored, and fewer "
    "users are present than that k, so no group holds you yet: retry when more users are around",
)
_AREA_EXCEEDED = refuse(ReasonCode.AREA_EXCEEDED)
_EDGE_CHECK = refuse(ReasonCode.K_UNREACHABLE, "internal check: region holds fewer than k users")
_UNCOUNTED = -1  # k_achieved of a bucket whose users are not counted yet
_UNGROWABLE = -2  # k_achieved of a bucket that cannot be grown to its stored A_min
_NO_SUPER_BUCKET = refuse(ReasonCode.AREA_EXCEEDED, "no aligned super-bucket holds k users with this override")


# -- pure functions (exposed for tests) ------------------------------------------------------


def hilbert_index(n: int, x: int, y: int) -> int:
    """Hilbert index of cell ``(x, y)`` on an ``n × n`` grid, ``n`` a power of two (§4.4, standard form)."""
    d, s = 0, n // 2
    while s > 0:
        rx = 1 if x & s else 0
        ry = 1 if y & s else 0
        d += s * s * ((3 * rx) ^ ry)
        if ry == 0:
            if rx == 1:
                x, y = n - 1 - x, n - 1 - y
            x, y = y, x
        s //= 2
    return d


def tie_keys(salt: npt.ArrayLike, seed: int) -> U64:
    """Tie-break keys: SplitMix64 of each user's salt mixed with the view's epoch seed (§4.4).

    Never the user id or arrival order, so the order inside a cell leaks neither.
    """
    z = np.array(salt, dtype=np.uint64) ^ np.uint64(_splitmix64(seed & _MASK64))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # uint64 products wrap, as intended
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: U64 = z ^ (z >> np.uint64(31))
    return out


def _splitmix64(v: int) -> int:
    z = (v + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def hilbert_sort(hv: I64, tie: U64) -> I64:
    """Rows ordered by ``(hv, tie)``: one argsort, then a lexsort of the (rare) tied runs only."""
    order = np.argsort(hv, kind="stable")
    hs = hv[order]
    eq = hs[1:] == hs[:-1]
    if eq.any():
        tied = np.zeros(len(hv), bool)
        tied[1:] |= eq
        tied[:-1] |= eq
        pos = np.flatnonzero(tied)
        sub = order[pos]
        order[pos] = sub[np.lexsort((tie[sub], hv[sub]))]
    return order


def order_ties(rows: I64, hv_sorted: I64, salt: U64 | Callable[[I64], U64], seed: int) -> tuple[I64, I64] | None:
    """How to put rows already ordered by Hilbert value (equal values in any order) in
    :func:`hilbert_sort`'s order with ``tie_keys(salt, seed)``: runs of equal values by ``(tie, row)``.

    Returns ``(pos, src)``: the positions in tied runs and, for each, the position whose row goes
    there (``out = rows.copy(); out[pos] = rows[src]`` is that order; see :func:`apply_ties`), or
    None when no value repeats. Only the tied runs are sorted, and only their tie keys computed.
    ``salt``: the salt of every row, or a function giving the salts of given rows.
    """
    eq = hv_sorted[1:] == hv_sorted[:-1]
    at = np.flatnonzero(eq)
    if not len(at):
        return None
    pos = np.union1d(at, at + 1)
    sub = rows[pos]
    salts = salt(sub) if callable(salt) else salt[sub]
    return pos, pos[np.lexsort((sub, tie_keys(salts, seed), hv_sorted[pos]))]


def tied_at(a: npt.NDArray[Any], ties: tuple[I64, I64] | None, at: I64) -> npt.NDArray[Any]:
    """``apply_ties(a, ties)[at]`` without the whole copy: ``a[at]`` with the tied positions among
    ``at`` read where :func:`order_ties` puts them from."""
    out = a[at]
    if ties is None or not len(at):
        return out
    pos, src = ties
    i = np.minimum(np.searchsorted(pos, at), len(pos) - 1)
    hit = pos[i] == at
    out[hit] = a[src[i[hit]]]
    return out


def apply_ties(a: npt.NDArray[Any], ties: tuple[I64, I64] | None) -> npt.NDArray[Any]:
    """``a`` (in curve order) with the tied runs put in :func:`order_ties`' order (``a`` itself
    when nothing repeats; otherwise a copy with only the tied positions written)."""
    if ties is None:
        return a
    pos, src = ties
    out = a.copy()
    out[pos] = a[src]
    return out


def partition_buckets(k_sorted: npt.ArrayLike) -> I64:
    """Cut users, given by their stored ``k`` in curve order, into buckets with the personalized rule (§4.4).

    A bucket closes as soon as its size reaches the largest ``k`` among its members; the leftover is
    merged backwards into the previous buckets until valid. Returns the bucket bounds
    ``[0, e1, …, n]`` (bucket ``i`` is ``[bounds[i], bounds[i+1])``), or ``[0]`` when nobody can be
    placed (the whole population is smaller than its largest ``k``).
    """
    k = np.maximum(np.asarray(k_sorted, dtype=np.int64), 1)
    n = len(k)
    if n == 0 or int(k.max()) > n:
        return np.zeros(1, np.int64)
    kmax = int(k.max())
    if int(k.min()) == kmax:  # uniform k: Kalnis et al.'s buckets of k, the last one up to 2k − 1
        bounds = np.arange(n // kmax + 1, dtype=np.int64) * kmax
        bounds[-1] = n
        return bounds
    nxt = _bucket_ends(k, kmax).item  # a chain of n / k steps: no list of all n ends
    out = [0]
    i = 0
    while i < n:
        e = nxt(i)
        if e > n:
            break
        out.append(e)
        i = e
    if i < n:  # leftover [i, n): merge backwards until the merged bucket is valid
        suffix_max = np.maximum.accumulate(k[::-1])[::-1].tolist()
        while n - out[-1] < suffix_max[out[-1]]:
            if len(out) == 1:
                return np.zeros(1, np.int64)
            out.pop()
        out.append(n)
    return np.asarray(out, dtype=np.int64)


_DENSE_LEVELS = 8
"""Up to this many distinct stored ``k``, :func:`_bucket_ends` works on whole columns (no gathers)."""


def _bucket_ends(k: I64, kmax: int) -> I64:
    """For every start ``i``: end of the bucket the greedy rule would close from ``i`` (``n + 1``: never).

    With few distinct ``k`` (profiles come in a few levels), on whole columns: the window maximum
    ``W_v[i] = max(k[i : i + v])`` for each level ``v``, then ``L ← W_L`` level by level in
    ascending order (``L`` only grows, so one pass reaches the fixpoint).
    """
    levels = np.flatnonzero(np.bincount(k)) if kmax <= 1 << 16 else np.unique(k)
    if len(levels) > _DENSE_LEVELS:
        return _bucket_ends_sparse(k, kmax)
    n = len(k)
    if kmax < 1 << 15:  # a quarter of the memory traffic
        k = k.astype(np.int16)
    doubling = [k]  # doubling[p][i] = max(k[i : i + 2^p]) (windows cut at n)
    while (1 << len(doubling)) <= kmax:
        prev, half = doubling[-1], min(1 << (len(doubling) - 1), n)
        cur = prev.copy()
        np.maximum(prev[: n - half], prev[half:], out=cur[: n - half])
        doubling.append(cur)
    window: dict[int, npt.NDArray[np.integer[Any]]] = {}
    for v in levels.tolist():
        p = v.bit_length() - 1
        w = doubling[p].copy()
        off = min(v - (1 << p), n)
        if off:
            np.maximum(w[: n - off], doubling[p][off:], out=w[: n - off])
        window[v] = w
    length = k.copy()
    for v in levels.tolist():
        at = length == v
        length[at] = window[v][at]
    ends = np.arange(n, dtype=np.int64)
    ends += length
    ends[ends > n] = n + 1
    return ends


def _bucket_ends_sparse(k: I64, kmax: int) -> I64:
    """:func:`_bucket_ends` for many distinct ``k``, on the active starts only.

    The bucket length is the least fixpoint ``L = max(k[i : i + L])``, reached by iterating
    ``L ← max(k[i : i + L])`` from ``L = k[i]`` (at most one step per distinct k), with a
    sparse table for the window maxima.
    """
    n = len(k)
    levels = max(1, int(kmax).bit_length())
    table = [k]
    for p in range(1, levels):
        prev = table[-1]
        half = 1 << (p - 1)
        cur = prev.copy()
        cur[: n - half] = np.maximum(prev[: n - half], prev[half:])
        table.append(cur)
    sparse = np.stack(table)
    log2 = np.zeros(kmax + 1, np.int64)
    log2[1:] = np.floor(np.log2(np.arange(1, kmax + 1))).astype(np.int64)
    start = np.arange(n, dtype=np.int64)
    length = k.copy()
    ends = np.full(n, n + 1, np.int64)
    active = start + length <= n
    idx = start[active]
    length_a = length[active]
    while len(idx):
        lv = log2[length_a]
        new = np.maximum(sparse[lv, idx], sparse[lv, idx + length_a - (1 << lv)])
        done = new == length_a
        ends[idx[done]] = idx[done] + length_a[done]
        keep = ~done & (idx + new <= n)
        idx, length_a = idx[keep], new[keep]
    return ends


def group_extents(values_sorted: npt.ArrayLike, bounds: npt.ArrayLike) -> tuple[I64, I64]:
    """Per-bucket minimum and maximum of a column in curve order (MBR sides), vectorized."""
    v = np.asarray(values_sorted)
    starts = np.asarray(bounds, dtype=np.int64)[:-1]
    return np.minimum.reduceat(v, starts), np.maximum.reduceat(v, starts)


def bboxes_around_keys(min_lon_key: I64, min_lat_key: I64, max_lon_key: I64, max_lat_key: I64) -> I64:
    """Vectorized :func:`kcloak.core.geometry.bbox_around_keys`: ``(m, 4)`` micro-degree boxes."""
    return np.stack(
        [
            np.maximum((min_lon_key - 1) >> 1, -WORLD_LON_UDEG),
            np.maximum((min_lat_key - 1) >> 1, -WORLD_LAT_UDEG),
            np.minimum((max_lon_key >> 1) + 1, WORLD_LON_UDEG),
            np.minimum((max_lat_key >> 1) + 1, WORLD_LAT_UDEG),
        ],
        axis=1,
    )


def bbox_areas_m2(boxes: I64) -> F64:
    """Contract areas of ``(m, 4)`` micro-degree boxes, bit-identical to :attr:`BBox.area_m2`.

    The sines go through :func:`math.sin` (numpy's may differ by an ulp), so batch and single
    answers report the very same float.
    """
    b = np.asarray(boxes, dtype=np.int64).reshape(-1, 4)
    lon0 = b[:, 0] / UDEG_PER_DEG
    lon1 = b[:, 2] / UDEG_PER_DEG
    s0 = np.fromiter(map(math.sin, np.radians(b[:, 1] / UDEG_PER_DEG).tolist()), np.float64, len(b))
    s1 = np.fromiter(map(math.sin, np.radians(b[:, 3] / UDEG_PER_DEG).tolist()), np.float64, len(b))
    out: F64 = EARTH_RADIUS_M * EARTH_RADIUS_M * np.radians(lon1 - lon0) * np.abs(s1 - s0)
    return out


def super_bucket_levels(sizes: npt.ArrayLike, k: int) -> I64:
    """Aligned super-bucket of every bucket for an override ``k`` (§4.4, made reciprocal) [design].

    Returns, per bucket, the level ``j`` of its super-bucket ``[m·2^j, (m+1)·2^j)`` (``m = b >> j``),
    ``-1`` for a bucket that already holds ``k`` users (it is served as is), or ``-2`` when no
    aligned super-bucket can serve it. Only *deficient* buckets (size < k) can be a querier's with
    this override, so the candidate set of a super-bucket is its deficient members. The binary
    tree of aligned blocks is split top-down while each child holds either ≥ k deficient members
    or none; a deficient bucket's super-bucket is the lowest block it reaches. Every deficient
    member of a block therefore computes the same block, and the block holds ≥ k of them.
    (§4.4's "smallest j with ≥ k users" is not reciprocal: with buckets of 3 and 30 users and
    k = 6, the 3 would get the pair while the 30 keep their own bucket, so the pair's candidate
    set would have 3 users.)
    """
    size = np.asarray(sizes, dtype=np.int64)
    nb = len(size)
    level = np.full(nb, -1, np.int64)
    weight = np.where(size < k, size, 0)
    deficient = weight > 0
    if not deficient.any():
        return level
    depth = max(0, (nb - 1).bit_length())
    w = [np.zeros(1 << depth, np.int64)]
    w[0][:nb] = weight
    for _ in range(depth):
        w.append(w[-1].reshape(-1, 2).sum(axis=1))
    if w[depth][0] < k:
        level[deficient] = -2
        return level
    is_open = np.ones(1, bool)  # nodes of the current level whose ancestors were all split
    lowest = np.full(1 << depth, depth, np.int64)
    for j in range(depth, 0, -1):
        child = w[j - 1]
        fine = (child >= k) | (child == 0)
        split = is_open & fine[0::2] & fine[1::2]
        is_open = np.repeat(split, 2)
        lowest[np.repeat(is_open, 1 << (j - 1))] = j - 1
    level[deficient] = lowest[:nb][deficient]
    return level


def cover_counts(
    hv_sorted: I64,
    lon_key_sorted: Keys,
    lat_key_sorted: Keys,
    boxes: npt.ArrayLike,
    *,
    order: int = GRID_BITS,
    budget: int = 4096,
) -> I64:
    """Exact number of users strictly inside each ``(m, 4)`` micro-degree box, from the curve order.

    Users are given in curve order (Hilbert values and exact coordinate keys). An aligned quadtree
    cell is one contiguous run of Hilbert values, so the users of the ≤ 3 × 3 cells (side ≥ half
    the box's) covering a box are ≤ 9 slices of the sorted users; they are tested on their exact
    keys (§2.2). Needs no spatial index. ``-1`` where the cover holds more than ``budget`` users
    (count those with :meth:`IndexView.count_in_many`).
    """
    b = np.asarray(boxes, dtype=np.int64).reshape(-1, 4)
    kb = key_bounds_array(b)
    m = len(b)
    out = np.full(m, -1, np.int64)
    if m == 0:
        return out
    base = GRID_BITS - order
    gx0 = b[:, 0] + GRID_OFFSET  # grid coordinates (floor micro-degrees) that may hold inside users
    gy0 = b[:, 1] + GRID_OFFSET
    gx1 = np.maximum(b[:, 2] - 1 + GRID_OFFSET, gx0)
    gy1 = np.maximum(b[:, 3] - 1 + GRID_OFFSET, gy0)
    half = (np.maximum(gx1 - gx0, gy1 - gy0) + 2) // 2
    exp = np.maximum(np.frexp((half - 1).astype(np.float64))[1].astype(np.int64), base)  # ⌈log2 half⌉
    cx0, cy0 = gx0 >> exp, gy0 >> exp
    ncx, ncy = (gx1 >> exp) - cx0 + 1, (gy1 >> exp) - cy0 + 1
    dx = np.tile(np.arange(3), 3)
    dy = np.repeat(np.arange(3), 3)
    valid = (dx[None, :] < ncx[:, None]) & (dy[None, :] < ncy[:, None])
    box_of, cell = np.nonzero(valid)
    e = exp[box_of]
    h = hilbert_indices((cx0[box_of] + dx[cell]) << e >> base, (cy0[box_of] + dy[cell]) << e >> base, order)
    t2 = 2 * (e - base)
    lo = (h >> t2) << t2
    start = np.searchsorted(hv_sorted, lo)
    length = np.searchsorted(hv_sorted, lo + (np.int64(1) << t2)) - start
    total = np.bincount(box_of, weights=length, minlength=m).astype(np.int64)
    small = total <= budget
    out[small] = 0
    keep = small[box_of]
    box_of, start, length = box_of[keep], start[keep], length[keep]
    # Gather in chunks of about 2^22 users to bound memory.
    ends = np.cumsum(length)
    chunk = 1 << 22
    cut = np.searchsorted(ends, np.arange(1, int(ends[-1]) // chunk + 1) * chunk) if len(ends) else np.zeros(0, int)
    for part in np.split(np.arange(len(length)), cut):
        ln = length[part]
        n_tot = int(ln.sum())
        if n_tot == 0:
            continue
        offs = np.repeat(start[part] - (np.cumsum(ln) - ln), ln) + np.arange(n_tot)
        owner = box_of[part]
        who = np.repeat(owner, ln)
        lk, tk = lon_key_sorted[offs], lat_key_sorted[offs]
        inside = lk >= np.repeat(kb[owner, 0], ln)
        inside &= lk <= np.repeat(kb[owner, 2], ln)
        inside &= tk >= np.repeat(kb[owner, 1], ln)
        inside &= tk <= np.repeat(kb[owner, 3], ln)
        out += np.bincount(who[inside], minlength=m)
    return out


# -- per-view state ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Group:
    """A bucket or super-bucket: its published MBR, the largest stored A_min and its anonymizing set."""

    gid: int
    mbr: BBox
    min_area_m2: float
    anon_set: I64
    max_area_m2: float = MAX_REGION_AREA_M2


def _box_hashes(boxes: I64, amin: F64) -> U64:
    """A 64-bit hash of each ``(box, A_min)`` (equal inputs, equal hashes; matches are verified)."""
    b = boxes.astype(np.uint64)
    h = b[:, 0] * np.uint64(0x9E3779B97F4A7C15)
    h ^= b[:, 1] * np.uint64(0xC2B2AE3D27D4EB4F)
    h ^= b[:, 2] * np.uint64(0x165667B19E3779F9)
    h ^= b[:, 3] * np.uint64(0x27D4EB2F165667C5)
    h ^= amin.view(np.uint64)
    out: U64 = h
    return out


def key_boxes(boxes: I64) -> npt.NDArray[np.object_]:
    """Shapely boxes over the exact keys strictly inside ``(m, 4)`` micro-degree boxes (on the world
    edge too, as :meth:`IndexView.count_in_many` counts); None for a box that can hold no point."""
    kb = key_bounds_array(boxes)
    geoms: npt.NDArray[np.object_] = shapely.box(kb[:, 0], kb[:, 1], kb[:, 2], kb[:, 3])
    geoms[(kb[:, 2] < kb[:, 0]) | (kb[:, 3] < kb[:, 1])] = None
    return geoms


SMALL_CHANGE_LIMIT = 1 << 22
"""Up to this many (box, point) candidates, :func:`count_change_sorted` counts a view's change
without shapely boxes; above, :func:`count_change` does with an STR-tree."""


_CHANGE_BANDS = 256
"""Latitude bands :func:`count_change_sorted` sorts the changed points into …"""
_CHANGE_BINS = 1024
"""… and longitude bins in each band."""


def count_change_sorted(boxes: I64, delta: ViewDelta, limit: int) -> I64 | None:
    """:func:`count_change` for ``(m, 4)`` micro-degree boxes, on the points sorted into a grid of
    latitude bands × longitude bins: each box's candidates are one run of points per band it
    overlaps (the bins its longitude range touches, found in a table of where each grid cell's
    points start), tested on both keys. None when there are more than ``limit`` candidates (a
    large change)."""
    m = len(boxes)
    n_added = len(delta.added_lon_key)
    lon = np.concatenate([delta.added_lon_key, delta.removed_lon_key])
    if m == 0 or len(lon) == 0:
        return np.zeros(m, np.int64)
    lat = np.concatenate([delta.added_lat_key, delta.removed_lat_key])
    lat0 = int(lat.min())
    lon0 = int(lon.min())
    height = (int(lat.max()) - lat0) // _CHANGE_BANDS + 1
    width = (int(lon.max()) - lon0) // _CHANGE_BINS + 1
    cell = (lat - lat0) // height * _CHANGE_BINS + (lon - lon0) // width
    order = np.argsort(cell, kind="stable")
    lat, lon = lat[order], lon[order]
    sign = np.where(order < n_added, 1, -1)
    first = np.zeros(_CHANGE_BANDS * _CHANGE_BINS + 1, np.int64)  # where each cell's points start
    np.cumsum(np.bincount(cell, minlength=_CHANGE_BANDS * _CHANGE_BINS), out=first[1:])
    kb = key_bounds_array(boxes)
    b0 = np.maximum((kb[:, 1] - lat0) // height, 0)
    span = np.maximum(np.minimum((kb[:, 3] - lat0) // height, _CHANGE_BANDS - 1) - b0 + 1, 0)
    box = np.repeat(np.arange(m), span)
    band = _ranges(b0, span) * _CHANGE_BINS
    x0 = np.clip((kb[box, 0] - lon0) // width, 0, _CHANGE_BINS - 1)
    x1 = np.clip((kb[box, 2] - lon0) // width, -1, _CHANGE_BINS - 1)
    lo = first[band + x0]
    length = np.maximum(first[band + x1 + 1] - lo, 0)
    total = int(length.sum())
    if total > limit:
        return None
    owner = np.repeat(box, length)
    at = _ranges(lo, length)
    inside = (lat[at] >= kb[owner, 1]) & (lat[at] <= kb[owner, 3])
    inside &= (lon[at] >= kb[owner, 0]) & (lon[at] <= kb[owner, 2])
    out: I64 = np.bincount(owner[inside], weights=sign[at[inside]], minlength=m).astype(np.int64)
    return out


def count_change(geoms: npt.NDArray[np.object_], delta: ViewDelta) -> I64:
    """Points that entered minus points that left each of :func:`key_boxes`' boxes."""
    m = len(geoms)
    lon = np.concatenate([delta.added_lon_key, delta.removed_lon_key]).astype(np.float64)
    lat = np.concatenate([delta.added_lat_key, delta.removed_lat_key]).astype(np.float64)
    if m == 0 or len(lon) == 0:
        return np.zeros(m, np.int64)
    point, box = shapely.STRtree(geoms).query(shapely.points(lon, lat))
    sign = np.where(point < len(delta.added_lon_key), 1, -1)
    out: I64 = np.bincount(box, weights=sign, minlength=m).astype(np.int64)
    return out


class _Carry:
    """A view's per-bucket boxes, areas and counts, kept for the next view of the same index.

    Keyed by ``(MBR, largest stored A_min)``: the final box and area are functions of these two,
    and the count of the final box changes only by the points that left or entered it (the
    :class:`~kcloak.cloaking.curve.ViewDelta` between the two views).
    """

    __slots__ = ("amin", "area", "bbox", "buckets", "geoms", "k_achieved", "mbr", "seq", "sized", "source")

    def __init__(self, st: _HilbertState, source: int, seq: int) -> None:
        # The state's own per-bucket arrays (not the view): boxes grown and counted lazily after
        # this carry was taken are carried too.
        self.source = source
        self.seq = seq
        self.mbr = st.mbr
        self.amin = st.amin_arr
        self.bbox = st.bbox
        self.area = st.area
        self.sized = st.sized
        self.k_achieved = st.k_achieved
        self.geoms = st.geoms
        self.buckets = _BucketCarry(st.buckets, st.view)

    def apply(self, st: _HilbertState, delta: ViewDelta) -> npt.NDArray[np.bool_]:
        """Fill ``st``'s buckets that match one of this view's; returns which did.

        The buckets of segments ``st`` kept (``st.buckets.kept_new``, from ``kept_old``) match by
        construction; the others are matched on their ``(MBR, A_min)``.
        """
        nb = st.n_buckets
        if len(self.mbr) == 0:
            return np.zeros(nb, bool)
        kept_new, kept_old = st.buckets.kept_new, st.buckets.kept_old
        rest = np.ones(nb, bool)
        rest[kept_new] = False
        idx = np.flatnonzero(rest)
        new, old = kept_new, kept_old
        # Candidates: the previous buckets not kept (a kept one is taken over by its new number).
        cand = np.ones(len(self.mbr), bool)
        cand[kept_old] = False
        cand_idx = np.flatnonzero(cand)
        if len(idx) and len(cand_idx):
            old_h = _box_hashes(self.mbr[cand_idx], self.amin[cand_idx])
            order = np.argsort(old_h, kind="stable")
            old_h = old_h[order]
            h = _box_hashes(st.mbr[idx], st.amin_arr[idx])
            pos = np.minimum(np.searchsorted(old_h, h), len(old_h) - 1)
            at = cand_idx[order[pos]]
            hit = (old_h[pos] == h) & (self.mbr[at] == st.mbr[idx]).all(axis=1) & (self.amin[at] == st.amin_arr[idx])
            new = np.concatenate([new, idx[hit]])
            old = np.concatenate([old, at[hit]])
        st.bbox[new] = self.bbox[old]
        st.area[new] = self.area[old]
        st.sized[new] = self.sized[old]
        k = self.k_achieved[old]
        counted = k >= 0
        if counted.any():
            # A counted box is final (sized): its shapely box, once made, is carried along.
            was = old[counted]
            geoms = self.geoms[was]
            change = count_change_sorted(self.bbox[was], delta, SMALL_CHANGE_LIMIT) if len(delta) else None
            if change is None and len(delta):
                missing = np.flatnonzero(shapely.is_missing(geoms))
                if len(missing):
                    geoms[missing] = key_boxes(self.bbox[was[missing]])
                change = count_change(geoms, delta)
            st.geoms[new[counted]] = geoms
            if change is not None:
                k[counted] += change
        st.k_achieved[new] = k
        out = np.zeros(nb, bool)
        out[new] = True
        return out


def _per_bucket(op: np.ufunc, view: IndexView, name: str, rows: I64, bounds: I64) -> F64:
    """``op`` over each bucket's values of a view's profile column (one value for all when the
    column is constant; otherwise only the given rows' values are read)."""
    lo, hi = view.profile_range(name)
    if lo == hi:
        return np.full(len(bounds) - 1, lo)
    values = getattr(view, name)[rows] if len(rows) == len(view) else view.column_at(name, rows)
    out: F64 = op.reduceat(values, bounds[:-1])
    return out


def _ranges(starts: I64, lengths: I64) -> I64:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorized."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    out: I64 = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total, dtype=np.int64)
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Buckets:
    """A view's buckets and the segments they were cut in (:mod:`.hilbert_segments`).

    Bucket ``b`` is curve positions ``[bounds[b], bounds[b + 1])``; segment ``s`` holds the users
    with Hilbert values from ``seg_lo[s]`` on, curve positions ``[seg_pos[s], seg_pos[s + 1])`` and
    buckets ``[seg_b[s], seg_b[s + 1])``. ``bucket_of`` is each view row's bucket (−1: not placed).
    """

    seg_lo: I64
    seg_pos: I64
    seg_b: I64
    bounds: I64
    bucket_of: npt.NDArray[np.int32]
    sizes: I64
    amin: F64
    amax: F64
    mbr: I64
    kept_new: I64
    """Buckets taken over unchanged from the previous view's (with the segment that holds them) …"""
    kept_old: I64
    """… and their numbers in the previous view."""
    kept_heads: int = 0
    """Segments cut again only from their first change on (the buckets before it kept)."""
    kept_tails: int = 0
    """Segments whose new chain met the previous view's after their last change (the buckets from
    there kept)."""


class _BucketCarry:
    """A view's :class:`Buckets` with what the next view of the same index needs to re-use them: the
    view's index rows (view row → index row and back) and its tie seed. No column is kept: the
    index's delta names the rows whose stored profile or salt was written in between."""

    __slots__ = ("buckets", "rows", "seed", "view_of")

    def __init__(self, buckets: Buckets, view: IndexView) -> None:
        self.buckets = buckets
        self.seed = view.seed
        link = view.index_rows
        self.rows: I64 | None = link[0] if link is not None else None
        self.view_of: npt.NDArray[np.int32] | None = link[1] if link is not None else None

    def dirty_hv(
        self, view: IndexView, delta: ViewDelta, hv_sorted: I64, ties: tuple[I64, I64] | None
    ) -> tuple[I64, I64 | None] | None:
        """Hilbert values (level 29) around which segments may have changed since this carry's view
        (the points that left or entered, users whose stored profile or salt was written, and every
        tie when the seed changed), and the previous view's row of each of ``view``'s rows when the
        rows were renumbered (users arrived, left or went stale; −1 for a row new to the view).
        None when nothing can be re-used."""
        link = view.index_rows
        b = self.buckets
        if (
            link is None
            or self.rows is None
            or self.view_of is None
            or (len(b.bounds) and int(b.bounds[-1]) != len(b.bucket_of))  # somebody was not placed
        ):
            return None
        rows, view_of = link
        remap: I64 | None = None
        if rows is not self.rows and not np.array_equal(rows, self.rows):
            old_of = self.view_of
            inside = rows < len(old_of)
            remap = np.full(len(rows), -1, np.int64)
            remap[inside] = old_of[rows[inside]]
        pr = delta.profile_rows
        pr = pr[pr < len(view_of)]
        vr = view_of[pr]
        at: I64 = vr[vr >= 0].astype(np.int64)
        lon = np.concatenate([delta.added_lon_key, delta.removed_lon_key, view.column_at("lon_key", at)])
        lat = np.concatenate([delta.added_lat_key, delta.removed_lat_key, view.column_at("lat_key", at)])
        hv = hilbert_indices(grid_coords(lon, "lon"), grid_coords(lat, "lat"))
        if view.seed != self.seed and ties is not None:  # tied users are put in a new order
            hv = np.concatenate([hv, hv_sorted[ties[0]]])
        return hv, remap


def _bucket_columns(view: IndexView, rows: I64, lon_key: Keys, lat_key: Keys, bounds: I64) -> tuple[F64, F64, I64]:
    """Largest stored A_min, smallest max area and MBR of each bucket of ``rows`` (curve order; the
    whole view's or, when few, only those rows' profile values are read)."""
    if len(bounds) < 2:
        return np.zeros(0), np.zeros(0), np.zeros((0, 4), np.int64)
    amin = _per_bucket(np.maximum, view, "min_area_m2", rows, bounds)
    amax = _per_bucket(np.minimum, view, "max_area_m2", rows, bounds)
    lon0, lon1 = group_extents(lon_key, bounds)
    lat0, lat1 = group_extents(lat_key, bounds)
    return amin, amax, bboxes_around_keys(lon0, lat0, lon1, lat1).astype(np.int64)  # keys may be int32


def segment_buckets(
    view: IndexView,
    rows: I64,
    hv_sorted: I64,
    keys_sorted: tuple[Keys, Keys],
    order: int,
    factor: int,
    prev: _BucketCarry | None = None,
    dirty_hv: I64 | None = None,
    remap: I64 | None = None,
    ties: tuple[I64, I64] | None = None,
) -> Buckets:
    """The buckets of a view whose users are ``rows`` in curve order (values ``hv_sorted``, exact
    coordinate keys ``keys_sorted``, in that order with the tied runs put in the order ``ties``
    gives, see :func:`tied_at`; ``rows`` already in it).

    Segments come from :func:`curve_segments` with :func:`segment_threshold` (``factor`` 0: one
    chain over everyone). With the previous view's carry and the values around which anything
    changed (``dirty_hv``), a segment that starts at the same value as one of the previous view's
    keeps that one's buckets up to the first value where the two may differ (a changed value, or
    the end of the shorter segment): those buckets are steps of the greedy chain over users and
    profiles both views share. Only the rest of the segment is cut again (the whole segment when
    that rest holds fewer users than its largest ``k``, whose leftover would merge into the kept
    buckets). ``remap``: the previous view's row of each view row when the rows were renumbered
    (None: the same rows).
    """
    n = len(rows)
    threshold = segment_threshold(view.k_max if n else 1, factor)
    seg_lo = curve_segments(hv_sorted, order, threshold)
    seg_pos = np.append(np.searchsorted(hv_sorted, seg_lo), n).astype(np.int64)
    s = len(seg_lo)
    seg_len = np.diff(seg_pos)
    keep_n = np.zeros(s, np.int64)  # the previous view's buckets each segment keeps (a prefix)
    cut_at = np.zeros(s, np.int64)  # where each segment is cut again (relative; seg_len: not at all)
    old_j = np.zeros(s, np.int64)
    if prev is not None and dirty_hv is not None:
        old = prev.buckets
        top = np.int64(1) << np.int64(2 * order)
        old_j = np.minimum(np.searchsorted(old.seg_lo, seg_lo), len(old.seg_lo) - 1)
        old_len = np.diff(old.seg_pos)[old_j]
        same = (old.seg_lo[old_j] == seg_lo) & (old_len > 0)
        # The first value from which a segment may differ from the previous view's.
        h_cut = np.minimum(np.append(seg_lo[1:], top), np.append(old.seg_lo[1:], top)[old_j])
        new_hi = np.append(seg_lo[1:], top)
        same_hi = same & (new_hi == np.append(old.seg_lo[1:], top)[old_j])
        tail_at = seg_len.copy()  # users from here on: alike in both views (same bounds only)
        if len(dirty_hv):
            dh = np.sort(dirty_hv)
            i = np.searchsorted(dh, seg_lo)
            h_cut = np.minimum(h_cut, np.where(i < len(dh), dh[np.minimum(i, len(dh) - 1)], top))
            i = np.searchsorted(dh, new_hi) - 1  # the last changed value before the segment's end
            h_last = dh[np.maximum(i, 0)]
            changed = (i >= 0) & (h_last >= seg_lo)
            tail_at[changed] = np.searchsorted(hv_sorted, h_last[changed], "right") - seg_pos[:-1][changed]
        same_len = np.searchsorted(hv_sorted, h_cut) - seg_pos[:-1]  # users before it: alike in both views
        whole = same & (same_len == seg_len) & (same_len == old_len)
        # The other segments keep the buckets that end at or before the shared users' end (and
        # before the old segment's end, which a merged leftover may have reached).
        last = old.seg_pos[old_j] + np.minimum(same_len, old_len - 1)
        b = np.searchsorted(old.bounds, last, "right") - 1
        keep_n = np.where(same, b - old.seg_b[old_j], 0)
        cut_at = np.where(same, old.bounds[b] - old.seg_pos[old_j], 0)
        keep_n[whole] = np.diff(old.seg_b)[old_j[whole]]
        cut_at[whole] = seg_len[whole]
        if 2 * int((seg_len - cut_at).sum()) > n:  # most users to re-bucket: one pass over everyone is cheaper
            keep_n[:] = 0
            cut_at[:] = 0
    lon_key, lat_key = keys_sorted
    if not keep_n.any():  # everything from the curve order
        if s == 1:
            bounds = partition_buckets(view.k[rows])
        else:
            k = np.maximum(view.k[rows], 1)
            bounds = np.append(partition_segments(k, seg_pos[:-1], _bucket_ends(k, int(k.max()))), n)
        nb = len(bounds) - 1
        sizes = np.diff(bounds)
        bucket_of = np.full(n, -1, np.int32)  # int32: 4 B/user
        if nb:
            bucket_of[rows[: bounds[-1]]] = np.repeat(np.arange(nb, dtype=np.int64), sizes)
        seg_b = np.searchsorted(bounds, seg_pos).astype(np.int64) if nb else np.zeros(s + 1, np.int64)
        amin, amax, mbr = _bucket_columns(view, rows, apply_ties(lon_key, ties), apply_ties(lat_key, ties), bounds)
        none = np.zeros(0, np.int64)
        return Buckets(seg_lo, seg_pos, seg_b, bounds, bucket_of, sizes, amin, amax, mbr, none, none)
    assert prev is not None
    old = prev.buckets
    # The previous view's buckets from a segment's tail on, taken over when its chain is met.
    tail_n = np.zeros(s, np.int64)
    tail_b = np.zeros(s, np.int64)
    b_end = seg_len.copy()  # where the buckets cut again end (relative)
    b_starts: list[I64] = []  # their first positions (absolute)
    todo = cut_at < seg_len
    # (only where that skips users: a window reaching the segment's end is cut the plain way)
    sync = np.flatnonzero(todo & same_hi & (tail_at + _MEET_MARGIN * max(int(view.k_max), 1) < seg_len))
    if len(sync):
        got = _meet_old_chain(
            view,
            rows,
            old,
            sync,
            old_j[sync],
            seg_pos[sync],
            cut_at[sync],
            seg_len[sync],
            tail_at[sync],
            seg_len[sync] - old_len[sync],
        )
        met, met_at, met_b, starts_at = got
        todo[met] = False
        b_end[met] = met_at
        tail_b[met] = met_b
        tail_n[met] = np.where(met_b >= 0, old.seg_b[old_j[met] + 1] - met_b, 0)
        b_starts.append(starts_at)
    while True:  # the rest of each other segment from its cut, laid end to end (d_start: where each starts)
        dirty = np.flatnonzero(todo)
        d_len = seg_len[dirty] - cut_at[dirty]
        dpos = _ranges(seg_pos[dirty] + cut_at[dirty], d_len)
        d_start = np.cumsum(d_len) - d_len
        k = np.maximum(view.column_at("k", rows[dpos]), 1)
        if not len(dpos):
            break
        short = (d_len < np.maximum.reduceat(k, d_start)) & (cut_at[dirty] > 0)
        if not short.any():
            break
        keep_n[dirty[short]] = 0  # a leftover would merge into kept buckets: cut the whole segment
        cut_at[dirty[short]] = 0
    if len(dpos):
        b_starts.append(dpos[partition_segments(k, d_start, _bucket_ends(k, int(k.max())))])
    # The buckets cut again, laid end to end: each segment's run [cut_at, b_end).
    recut = np.flatnonzero(cut_at < b_end)
    r_len = b_end[recut] - cut_at[recut]
    r_lo = seg_pos[recut] + cut_at[recut]
    r_start = np.cumsum(r_len) - r_len
    dpos = _ranges(r_lo, r_len)
    d_rows = rows[dpos]
    starts_abs = np.sort(np.concatenate(b_starts)) if b_starts else np.zeros(0, np.int64)
    owner = np.searchsorted(r_lo, starts_abs, "right") - 1
    local = starts_abs - r_lo[owner] + r_start[owner]
    d_bounds = np.append(local, len(dpos))
    d_sizes = np.diff(d_bounds)
    cnt_d = np.zeros(s, np.int64)
    cnt_d[recut] = np.bincount(owner, minlength=len(recut))
    d_amin, d_amax, d_mbr = _bucket_columns(
        view, d_rows, tied_at(lon_key, ties, dpos), tied_at(lat_key, ties, dpos), d_bounds
    )
    # Each segment's kept buckets first, then its new ones, then its kept tail, numbered after the
    # buckets before them.
    cnt = keep_n + cnt_d + tail_n
    seg_b = np.append(np.cumsum(cnt) - cnt, int(cnt.sum())).astype(np.int64)
    nb = int(seg_b[-1])
    head = np.flatnonzero(keep_n)
    tail = np.flatnonzero(tail_n)
    ob = np.concatenate([_ranges(old.seg_b[old_j[head]], keep_n[head]), _ranges(tail_b[tail], tail_n[tail])])
    nbi_c = np.concatenate(
        [_ranges(seg_b[head], keep_n[head]), _ranges(seg_b[tail] + keep_n[tail] + cnt_d[tail], tail_n[tail])]
    )
    shift = seg_pos[:-1] - old.seg_pos[old_j]
    moved_by = np.concatenate(
        [np.repeat(shift[head], keep_n[head]), np.repeat((shift + seg_len - old_len)[tail], tail_n[tail])]
    )
    nbi_d = _ranges(seg_b[recut] + keep_n[recut], cnt_d[recut])
    starts = np.empty(nb, np.int64)
    starts[nbi_c] = old.bounds[ob] + moved_by
    starts[nbi_d] = starts_abs
    sizes = np.empty(nb, np.int64)
    sizes[nbi_c] = old.sizes[ob]
    sizes[nbi_d] = d_sizes
    amin = np.empty(nb)
    amin[nbi_c] = old.amin[ob]
    amin[nbi_d] = d_amin
    amax = np.empty(nb)
    amax[nbi_c] = old.amax[ob]
    amax[nbi_d] = d_amax
    mbr = np.empty((nb, 4), np.int64)
    mbr[nbi_c] = old.mbr[ob]
    mbr[nbi_d] = d_mbr
    # Each row's bucket: the kept buckets renumbered through a small table, the others written.
    table = np.zeros(len(old.sizes), np.int32)
    table[ob] = nbi_c
    # table lookups: the table stays in cache (rows new to the view are all in re-cut segments)
    bucket_of = table[old.bucket_of] if remap is None else table[old.bucket_of[remap]]
    bucket_of[d_rows] = np.repeat(nbi_d, d_sizes)
    heads = int(np.count_nonzero((keep_n > 0) & (cnt_d > 0)))
    return Buckets(
        seg_lo, seg_pos, seg_b, np.append(starts, n), bucket_of, sizes, amin, amax, mbr, nbi_c, ob, heads, len(tail)
    )


_MEET_MARGIN = 4
"""Users past the last change :func:`_meet_old_chain` reads, in units of the largest stored ``k``."""


def _meet_old_chain(
    view: IndexView,
    rows: I64,
    old: Buckets,
    segs: I64,
    old_j: I64,
    seg_pos: I64,
    cut_at: I64,
    seg_len: I64,
    tail_at: I64,
    grew: I64,
) -> tuple[I64, I64, I64, I64]:
    """Walk the greedy chain of segments ``segs`` (the same bounds as the previous view's segments
    ``old_j``) from ``cut_at`` until it meets a start of the previous chain among the users both
    views share at the end (from ``tail_at``; the previous view's positions are ``grew`` fewer).

    From a start both chains share, both go on alike over the same users and stored profiles,
    and both merge the same leftover (the previous view's kept starts end at its last valid one,
    which is at or after the shared start), so the previous view's buckets from there are the new
    ones. Only a window of a few buckets past ``tail_at`` is read; segments whose chain does not
    meet the old one there, or runs out of the window, are left to the caller.

    Returns the segments done, where their new buckets end (relative: the meeting point, or the
    segment's end when the chain reached it exactly), the previous view's bucket met (−1: none)
    and the new buckets' first positions (absolute).
    """
    margin = _MEET_MARGIN * max(int(view.k_max), 1)
    w_hi = np.minimum(seg_len, tail_at + margin)
    w_len = w_hi - cut_at
    w_start = np.cumsum(w_len) - w_len
    w_end = w_start + w_len
    wpos = _ranges(seg_pos + cut_at, w_len)
    k = np.maximum(view.column_at("k", rows[wpos]), 1)
    ends = _bucket_ends(k, int(k.max()))
    to_end = w_hi == seg_len
    old_end = old.seg_b[old_j + 1]
    met_at = np.full(len(segs), -1, np.int64)
    met_b = np.full(len(segs), -1, np.int64)
    out_starts: list[I64] = []
    owners: list[I64] = []
    tail_abs = w_start + tail_at - cut_at  # where the shared users start (laid end to end)
    cur = w_start.copy()
    active = np.arange(len(segs), dtype=np.int64)
    meeting: list[I64] = []
    while len(active):  # up to the shared users: a plain walk
        c = cur[active]
        there = c >= tail_abs[active]
        meeting.append(active[there])
        active, c = active[~there], c[~there]
        out_starts.append(c)
        owners.append(active)
        e = ends[c]
        done = (e == w_end[active]) & to_end[active]  # the chain ends exactly at the segment's end
        met_at[active[done]] = seg_len[active[done]]
        go = e < w_end[active]
        active = active[go]
        cur[active] = e[go]
    active = np.concatenate(meeting)
    while len(active):  # among the shared users: until a start of the previous chain
        p = cur[active] - w_start[active] + cut_at[active]  # relative to the segment
        at_old = old.seg_pos[old_j[active]] + p - grew[active]
        bi = np.minimum(np.searchsorted(old.bounds, at_old), len(old.bounds) - 1)
        hit = (old.bounds[bi] == at_old) & (bi < old_end[active])
        met_at[active[hit]] = p[hit]
        met_b[active[hit]] = bi[hit]
        active = active[~hit]
        out_starts.append(cur[active])
        owners.append(active)
        e = ends[cur[active]]
        done = (e == w_end[active]) & to_end[active]
        met_at[active[done]] = seg_len[active[done]]
        go = e < w_end[active]
        active = active[go]
        cur[active] = e[go]
    met = met_at >= 0
    starts = np.concatenate(out_starts) if out_starts else np.zeros(0, np.int64)
    owner = np.concatenate(owners) if owners else np.zeros(0, np.int64)
    keep = met[owner]
    starts, owner = starts[keep], owner[keep]
    absolute = starts - w_start[owner] + cut_at[owner] + seg_pos[owner]
    return segs[met], met_at[met], met_b[met], absolute


class _HilbertState:
    """Buckets of one view (built once, §2.4) plus lazily grown regions and super-buckets."""

    @property
    def view(self) -> IndexView:
        """The view this state belongs to."""
        return self._view()

    def __init__(
        self,
        view: IndexView,
        order: int,
        algorithm: str,
        view_rows: I64 | None = None,
        carry: _Carry | None = None,
        segment_factor: int = SEGMENT_FACTOR,
    ) -> None:
        # Weakly (ViewRef), but a cell's sub-view, held by nothing else, strongly.
        self._view = ViewRef(view, strong=view_rows is not None)
        self.view_rows = view_rows
        """Rows of a larger view that ``view``'s rows stand for (a cell's users): anonymizing sets use them."""
        self.algorithm = algorithm
        n = len(view)
        self.n = n
        curve = view.curve if order == GRID_BITS and view_rows is None else None
        lon_key_sorted: Keys
        lat_key_sorted: Keys
        if curve is not None:  # the index kept the Hilbert order: only the tied runs are sorted
            hv_sorted = curve.hv
            curve_rows = cast(I64, curve.rows)  # int32 or int64: both index alike (members are made int64)
            ties = order_ties(curve_rows, hv_sorted, partial(view.column_at, "salt"), view.seed)
            rows = apply_ties(curve_rows, ties)
            # The keys stay in the kept order (no copy): counts do not depend on the order of users
            # with equal values; where a bucket's extent does, ``ties`` is applied (tied_at).
            lon_key_sorted, lat_key_sorted = curve.lon_key, curve.lat_key
        else:
            ties = None
            shift = GRID_BITS - order
            hv = hilbert_indices(view.gx >> shift, view.gy >> shift, order)
            rows = hilbert_sort(hv, tie_keys(view.salt, view.seed)).astype(np.int64)
            hv_sorted = hv[rows]
            lon_key_sorted, lat_key_sorted = view.lon_key[rows], view.lat_key[rows]
        rows.setflags(write=False)
        self.order = order
        self.rows = rows
        self.hv_sorted = hv_sorted
        self.lon_key_sorted = lon_key_sorted
        self.lat_key_sorted = lat_key_sorted
        """Exact keys in curve order; users with equal Hilbert values in the kept order, not ``rows``'
        (``ties`` puts them in that order)."""
        self.ties = ties
        prev = carry.buckets if carry is not None else None
        delta = curve.delta_since(carry.source, carry.seq) if curve is not None and carry is not None else None
        dirty = prev.dirty_hv(view, delta, hv_sorted, ties) if prev is not None and delta is not None else None
        dirty_hv, remap = dirty if dirty is not None else (None, None)
        bk = segment_buckets(
            view, rows, hv_sorted, (lon_key_sorted, lat_key_sorted), order, segment_factor, prev, dirty_hv, remap, ties
        )
        self.buckets: Buckets = bk
        """The buckets with their segments (what the next view re-uses where a segment is unchanged)."""
        bounds = bk.bounds
        self.bounds = bounds
        nb = len(bounds) - 1
        self.n_buckets = nb
        sizes = bk.sizes
        self.bucket_arr = bk.bucket_of
        self.size_arr = sizes
        self.size: list[int] = sizes.tolist()
        amin, amax, mbr = bk.amin, bk.amax, bk.mbr
        self.amin_arr: F64 = amin
        self.amin: list[float] = amin.tolist()
        # A bucket is served only if its region fits every member's stored max_area_m2: a member
        # refused on its own would shrink the candidate set below k (reciprocity, §1.5).
        self.amax_arr = amax
        self.amax: list[float] = amax.tolist()
        self.mbr: I64 = mbr
        # Final region of each bucket (after growth to its stored A_min): the box and area now for
        # the buckets that need no growth, lazily for the others (expand_to_area is scalar); exact
        # counts now from the curve order, lazily where a cover is too crowded. A bucket with the
        # same MBR and A_min as one of the previous view's takes that one's box, area and count
        # (the count corrected by the points that left or entered the box): all three depend on
        # the box and the points only.
        self.bbox: I64 = mbr.copy()
        self.area: F64 = np.zeros(nb)
        self.sized: npt.NDArray[np.bool_] = np.zeros(nb, bool)
        self.k_achieved: I64 = np.full(nb, _UNCOUNTED, np.int64)
        self.geoms: npt.NDArray[np.object_] = np.full(nb, None, object)
        """Shapely box of each counted bucket's final box, made when the next view carries it."""
        fresh = np.ones(nb, bool)
        if carry is not None and delta is not None and nb:
            fresh = ~carry.apply(self, delta)
        self.carried = nb - int(np.count_nonzero(fresh))
        """Buckets whose box, area and count were taken over from the previous view."""
        idx = np.flatnonzero(fresh)
        if len(idx):
            self.area[idx] = bbox_areas_m2(mbr[idx])
            self.sized[idx] = self.area[idx] >= amin[idx]
            plain = idx[self.sized[idx]]
            if len(plain):
                self.k_achieved[plain] = self.cover_counts(mbr[plain])
        self.regions: list[CloakResult | None] = [None] * nb
        self.super_levels: dict[int, list[int]] = {}
        self.blocks: dict[tuple[int, int, int], _Group] = {}
        self.block_regions: dict[tuple[int, int, int], CloakResult] = {}

    @property
    def bucket_of(self) -> list[int]:
        """Bucket of each view row (−1: not placed), as a list."""
        out: list[int] = self.bucket_arr.tolist()
        return out

    def carry(self) -> _Carry | None:
        """What the next view of the same index may take over from this one (None: nothing)."""
        curve = self.view.curve
        if curve is None or self.view_rows is not None or self.order != GRID_BITS:
            return None
        return _Carry(self, curve.source, curve.seq)

    def cover_counts(self, boxes: I64) -> I64:
        """:func:`cover_counts` on this view's sorted users; ``-1`` where the cover is crowded."""
        # A generous budget: scanning a crowded cover costs microseconds per thousand users, while
        # falling back to the view's STR-tree builds it over every user (a second at 1M users).
        return cover_counts(
            self.hv_sorted, self.lon_key_sorted, self.lat_key_sorted, boxes, order=self.order, budget=1 << 17
        )

    def count(self, boxes: I64) -> I64:
        """Exact strict counts of users in ``(m, 4)`` boxes (the view's STR-tree for crowded covers)."""
        out = self.cover_counts(boxes)
        crowded = out < 0
        if crowded.any():
            out[crowded] = self.view.count_in_many(boxes[crowded])
        return out

    # -- buckets --------------------------------------------------------------------------------
    def ensure_sized(self, buckets: I64) -> None:
        """Grow the given buckets to their stored A_min (once per bucket)."""
        for b in np.unique(buckets).tolist():
            if self.sized[b]:
                continue
            self.sized[b] = True
            grown = expand_to_area(self.bucket_mbr(b), float(self.amin_arr[b]))
            if grown is None:
                self.k_achieved[b] = _UNGROWABLE
                continue
            self.bbox[b] = (grown.min_lon_udeg, grown.min_lat_udeg, grown.max_lon_udeg, grown.max_lat_udeg)
            self.area[b] = grown.area_m2

    def ensure_counted(self, buckets: I64) -> None:
        """Count the users in the final boxes of the given (sized) buckets (once per bucket)."""
        ids = np.unique(buckets)
        ids = ids[self.k_achieved[ids] == _UNCOUNTED]
        if len(ids):
            self.k_achieved[ids] = self.count(self.bbox[ids])

    def bucket_mbr(self, b: int) -> BBox:
        m = self.mbr[b]
        return BBox(int(m[0]), int(m[1]), int(m[2]), int(m[3]))

    def bucket_members(self, b: int) -> I64:
        """Rows of bucket ``b``'s users (in :attr:`view_rows` when set)."""
        r = self.rows[self.bounds[b] : self.bounds[b + 1]].astype(np.int64)
        return r if self.view_rows is None else self.view_rows[r]

    def bucket_region(self, b: int, max_area_m2: float) -> CloakResult:
        """The region of bucket ``b`` under its members' stored profiles (cached once built).

        A box over ``max_area_m2`` is refused before its users are counted.
        """
        reg = self.regions[b]
        if reg is not None:
            return reg
        if not self.sized[b]:
            self.ensure_sized(np.array([b], np.int64))
        if self.k_achieved[b] == _UNGROWABLE or self.area[b] > self.amax_arr[b]:
            self.regions[b] = _AREA_EXCEEDED
            return _AREA_EXCEEDED
        if self.area[b] > max_area_m2:
            return _AREA_EXCEEDED
        if self.k_achieved[b] == _UNCOUNTED:
            self.ensure_counted(np.array([b], np.int64))
        bb = self.bbox[b]
        reg = Region(
            bbox=BBox(int(bb[0]), int(bb[1]), int(bb[2]), int(bb[3])),
            k_achieved=int(self.k_achieved[b]),
            area_m2=float(self.area[b]),
            algorithm=self.algorithm,
            epoch=self.view.epoch,
            anon_set=self.bucket_members(b),
        )
        self.regions[b] = reg
        return reg

    def grown_region(self, g: _Group, profile: PrivacyProfile) -> CloakResult:
        """A group's region grown to ``max(group A_min, profile A_min)`` (as :func:`finish_region`)."""
        grown = expand_to_area(g.mbr, max(g.min_area_m2, profile.min_area_m2))
        if grown is None:
            return _AREA_EXCEEDED
        area = grown.area_m2
        if area > profile.max_area_m2 or area > g.max_area_m2:
            return _AREA_EXCEEDED
        box = np.array([[grown.min_lon_udeg, grown.min_lat_udeg, grown.max_lon_udeg, grown.max_lat_udeg]])
        k_achieved = int(self.count(box)[0])
        if k_achieved < profile.k:
            return _EDGE_CHECK
        return Region(
            bbox=grown,
            k_achieved=k_achieved,
            area_m2=area,
            algorithm=self.algorithm,
            epoch=self.view.epoch,
            anon_set=g.anon_set,
        )

    # -- super-buckets --------------------------------------------------------------------------
    def levels_for(self, k: int) -> list[int]:
        lv = self.super_levels.get(k)
        if lv is None:
            lv = super_bucket_levels(self.size_arr, k).tolist()
            self.super_levels[k] = lv
        return lv

    def block(self, j: int, m: int, k: int) -> _Group:
        """Super-bucket ``[m·2^j, (m+1)·2^j)`` for override ``k``, around all its members.

        Its anonymizing set is its members in buckets of fewer than ``k`` users: exactly those that
        get this block when sending the same override.
        """
        key = (k, j, m)
        g = self.blocks.get(key)
        if g is None:
            b0 = m << j
            b1 = min((m + 1) << j, self.n_buckets)
            lo, hi = int(self.bounds[b0]), int(self.bounds[b1])
            rows = self.rows[lo:hi]
            at = np.arange(lo, hi, dtype=np.int64)
            lon_k, lat_k = tied_at(self.lon_key_sorted, self.ties, at), tied_at(self.lat_key_sorted, self.ties, at)
            mbr = bbox_around_keys(int(lon_k.min()), int(lat_k.min()), int(lon_k.max()), int(lat_k.max()))
            deficient = np.repeat(self.size_arr[b0:b1] < k, self.size_arr[b0:b1])
            anon = rows[deficient].astype(np.int64)
            max_area = float(self.view.column_at("max_area_m2", anon).min()) if len(anon) else MAX_REGION_AREA_M2
            if self.view_rows is not None:
                anon = self.view_rows[anon]
            anon.setflags(write=False)
            g = _Group(
                gid=self.n_buckets + ((m << 6) | j),
                mbr=mbr,
                min_area_m2=float(self.amin_arr[b0:b1].max()),
                anon_set=anon,
                max_area_m2=max_area,
            )
            self.blocks[key] = g
        return g

    def block_region(self, g: _Group, key: tuple[int, int, int], profile: PrivacyProfile) -> CloakResult:
        """Region of a super-bucket at its members' largest stored A_min (cached per block)."""
        reg = self.block_regions.get(key)
        if reg is None:
            reg = self.grown_region(g, PrivacyProfile(k=1, min_area_m2=0.0, max_area_m2=MAX_REGION_AREA_M2))
            self.block_regions[key] = reg
        if isinstance(reg, Refusal):
            return reg
        if reg.area_m2 > profile.max_area_m2:
            return _AREA_EXCEEDED
        if reg.k_achieved < profile.k:
            return _EDGE_CHECK
        return reg


class _CelledState:
    """Per-cell buckets of one view: each cell's users cloaked as an index holding them alone.

    The users of cell ``c`` (rows ``rows_of[c]``, ascending) form a sub-view with the same
    columns, seed and epoch, and get their own :class:`_HilbertState`: buckets restart at each
    cell, regions count only the cell's own users (under-counting is safe), and ``k_unreachable``
    is judged on the cell's population, exactly as a worker owning that cell alone would.
    """

    @property
    def view(self) -> IndexView:
        """The view this state belongs to."""
        return self._view()

    def __init__(
        self, view: IndexView, cells: CellMap, order: int, algorithm: str, segment_factor: int = SEGMENT_FACTOR
    ) -> None:
        self._view = ViewRef(view, strong=False)
        self.segment_factor = segment_factor
        self.order = order
        self.algorithm = algorithm
        self.n_cells = cells.cells
        cell = cells.cell_of_grid(view.gx, view.gy)
        self.cell = cell
        by_cell = np.argsort(cell, kind="stable")
        starts = np.searchsorted(cell[by_cell], np.arange(cells.cells + 1))
        self.rows_of = [by_cell[starts[c] : starts[c + 1]] for c in range(cells.cells)]
        local = np.empty(len(view), np.int64)
        for rows in self.rows_of:
            local[rows] = np.arange(len(rows), dtype=np.int64)
        self.local = local
        self.cell_list: list[int] = cell.tolist()
        self.local_list: list[int] = local.tolist()
        self._states: dict[int, _HilbertState] = {}

    def cell_state(self, c: int) -> _HilbertState:
        """The buckets of cell ``c``, built on first use."""
        st = self._states.get(c)
        if st is None:
            rows = self.rows_of[c]
            st = _HilbertState(
                cell_view(self.view, rows),
                self.order,
                self.algorithm,
                view_rows=rows,
                segment_factor=self.segment_factor,
            )
            self._states[c] = st
        return st


def cell_view(view: IndexView, rows: I64) -> IndexView:
    """A view holding only the given rows of ``view`` (same columns, instant, epoch and seed)."""
    return IndexView(
        user_ids=[view.user_ids[r] for r in rows.tolist()],
        lat=view.lat[rows],
        lon=view.lon[rows],
        t=view.t[rows],
        k=view.k[rows],
        min_area_m2=view.min_area_m2[rows],
        max_area_m2=view.max_area_m2[rows],
        salt=view.salt[rows],
        now=view.now,
        epoch=view.epoch,
        seed=view.seed,
    )


class HilbertCloak:
    """Hilbert Cloak with personalized buckets and aligned super-buckets (CONCEPTS §4.4).

    Reciprocal: buckets are a function of the view (positions, stored profiles, epoch seed) only,
    and a bucket's region depends on the bucket only. ``cloak`` is a cached O(1) lookup after an
    O(n log n) per-view build; ``cloak_batch`` is vectorized over the requests.

    Keyword arguments:
        order: Hilbert curve order on the micro-degree grid (default 29: one cell per micro-degree;
            a smaller order uses cells of ``2^(29 − order)`` micro-degrees).
        cells: a :class:`~kcloak.cloaking.cells.CellMap` of the same order, or ``None`` (default:
            one curve over everyone). With a map, buckets restart at each cell and each cell's
            users are cloaked as if the view held them alone (see :class:`_CelledState`); the
            ``group`` of a batch answer is then ``cell_group · cells + cell``.
        segment_factor: bucket chains restart at the curve's segments (:mod:`.hilbert_segments`),
            each holding at least this many times the largest stored ``k`` (rounded up to a power
            of two; default 4); a move then re-buckets only the segments it leaves and enters.
            0: one chain over the whole curve.
    """

    name: ClassVar[str] = "hilbert"
    reciprocal: ClassVar[bool] = True
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    vectorized: ClassVar[bool] = True
    incremental_views: ClassVar[bool] = True
    """A view of a :class:`PositionIndex` takes over the previous view's buckets where unchanged."""

    def __init__(
        self, *, order: int = GRID_BITS, cells: CellMap | None = None, segment_factor: int = SEGMENT_FACTOR
    ) -> None:
        if not 1 <= order <= GRID_BITS:
            raise ValueError(f"order: must be within [1, {GRID_BITS}]")
        if segment_factor < 0:
            raise ValueError("segment_factor: must be ≥ 0 (0: one bucket chain over the whole curve)")
        self.segment_factor = segment_factor
        if cells is not None and cells.order != order:
            raise ValueError("cells: the cell map's order must equal the cloaker's order")
        self.order = order
        self.cells = cells
        self._key: tuple[object, ...] = ("hilbert", order, segment_factor, cells)
        self._carry: _Carry | None = None

    def state(self, view: IndexView) -> _HilbertState:
        """The per-view buckets (built on first use, cached in ``view.cache``); without a cell map only."""
        if self.cells is not None:
            raise ValueError("state: this cloaker has a cell map (use celled_state)")
        st: _HilbertState | None = view.cache.get(self._key)
        if st is None:
            st = _HilbertState(view, self.order, self.name, carry=self._carry, segment_factor=self.segment_factor)
            view.cache[self._key] = st
            self._carry = st.carry()
        return st

    def celled_state(self, view: IndexView) -> _CelledState:
        """The per-cell buckets (with a cell map only; cached in ``view.cache``)."""
        if self.cells is None:
            raise ValueError("celled_state: this cloaker has no cell map")
        st: _CelledState | None = view.cache.get(self._key)
        if st is None:
            st = _CelledState(view, self.cells, self.order, self.name, self.segment_factor)
            view.cache[self._key] = st
        return st

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        """Region of the querier's bucket (or super-bucket), or the refusal of §3.3."""
        if self.cells is None:
            return self._cloak(self.state(view), row, profile)[0]
        cs = self.celled_state(view)
        c = cs.cell_list[row]
        return self._cloak(cs.cell_state(c), cs.local_list[row], profile)[0]

    def _cloak(self, st: _HilbertState, row: int, profile: PrivacyProfile) -> tuple[CloakResult, int]:
        if profile.l > 1:
            return _UNSUPPORTED, -1
        k = profile.k
        if k > st.n:
            return _K_UNREACHABLE, -1
        b = st.bucket_arr.item(row)
        if b < 0:
            return _NOT_PLACED, -1
        if k <= st.size[b] and profile.min_area_m2 <= st.amin[b]:
            reg = st.regions[b]
            if reg is None:
                reg = st.bucket_region(b, profile.max_area_m2)
            if isinstance(reg, Refusal):
                return reg, -1
            if reg.area_m2 > profile.max_area_m2:
                return _AREA_EXCEEDED, -1
            if reg.k_achieved < k:  # only with users on the world edge, which no bbox holds strictly
                return _EDGE_CHECK, -1
            return reg, b
        return self._stricter(st, b, profile)

    def _stricter(self, st: _HilbertState, b: int, profile: PrivacyProfile) -> tuple[CloakResult, int]:
        """Override stricter than the bucket: super-bucket for k, growth for min_area_m2 (§4.4)."""
        k = profile.k
        if k > st.size[b]:
            j = st.levels_for(k)[b]
            if j == -2:
                return _NO_SUPER_BUCKET, -1
            g = st.block(j, b >> j, k)
            if profile.min_area_m2 <= g.min_area_m2:
                reg = st.block_region(g, (k, j, b >> j), profile)
                return reg, (g.gid if isinstance(reg, Region) else -1)
        else:
            g = _Group(b, st.bucket_mbr(b), st.amin[b], st.bucket_members(b), st.amax[b])
        # The override's larger A_min makes the region depend on who asks (documented caveat, §4.4).
        res = st.grown_region(g, profile)
        return res, (g.gid if isinstance(res, Region) else -1)

    def cloak_batch(self, view: IndexView, rows: I64, profiles: ProfileArrays) -> BatchResult:
        """Vectorized over the requests; super-bucket and A_min-override requests go one by one.

        ``group`` is the querier's bucket, or ``n_buckets + (m << 6 | j)`` for the super-bucket
        ``[m·2^j, (m+1)·2^j)`` (with a cell map: that number times the cell count, plus the cell).
        """
        rows = np.asarray(rows, dtype=np.int64)
        if self.cells is None:
            return self._batch(self.state(view), rows, profiles)
        cs = self.celled_state(view)
        out = BatchResult.empty(self.name, view.epoch, len(rows))
        cell = cs.cell[rows]
        by_cell = np.argsort(cell, kind="stable")
        cuts = np.flatnonzero(np.diff(cell[by_cell])) + 1
        for idx in np.split(by_cell, cuts) if len(rows) else []:
            c = int(cell[idx[0]])
            sub = ProfileArrays(
                k=profiles.k[idx],
                l=profiles.l[idx],
                min_area_m2=profiles.min_area_m2[idx],
                max_area_m2=profiles.max_area_m2[idx],
                max_delay_s=profiles.max_delay_s[idx],
            )
            part = self._batch(cs.cell_state(c), cs.local[rows[idx]], sub)
            out.status[idx] = part.status
            out.bbox[idx] = part.bbox
            out.k_achieved[idx] = part.k_achieved
            out.area_m2[idx] = part.area_m2
            out.group[idx] = np.where(part.group >= 0, part.group * cs.n_cells + c, -1)
        return out

    def _batch(self, st: _HilbertState, rows: I64, profiles: ProfileArrays) -> BatchResult:
        view = st.view
        m = len(rows)
        out = BatchResult.empty(self.name, view.epoch, m)
        if m == 0:
            return out
        k = profiles.k
        unsupported = profiles.l > 1
        k_unreachable = ~unsupported & (k > st.n)
        b = st.bucket_arr[rows]
        not_placed = ~unsupported & ~k_unreachable & (b < 0)
        live = ~unsupported & ~k_unreachable & ~not_placed
        bb = np.where(b >= 0, b, 0)
        fast = np.zeros(m, bool)
        if st.n_buckets:  # otherwise nobody is placed and nothing is live
            fast = live & (k <= st.size_arr[bb]) & (profiles.min_area_m2 <= st.amin_arr[bb])
            unsized = fast & ~st.sized[bb]
            if unsized.any():
                st.ensure_sized(bb[unsized])
        status = out.status
        status[unsupported] = STATUS_OF[ReasonCode.UNSUPPORTED]
        status[k_unreachable] = STATUS_OF[ReasonCode.K_UNREACHABLE]
        status[not_placed] = STATUS_OF[ReasonCode.AREA_EXCEEDED]
        if fast.any():
            idx = np.flatnonzero(fast)
            fb = bb[idx]
            area = st.area[fb]
            fits = (st.k_achieved[fb] != _UNGROWABLE) & (area <= profiles.max_area_m2[idx]) & (area <= st.amax_arr[fb])
            uncounted = fits & (st.k_achieved[fb] == _UNCOUNTED)
            if uncounted.any():
                st.ensure_counted(fb[uncounted])
            kach = st.k_achieved[fb]
            good = fits & (kach >= k[idx])
            status[idx[~fits]] = STATUS_OF[ReasonCode.AREA_EXCEEDED]
            status[idx[fits & ~good]] = STATUS_OF[ReasonCode.K_UNREACHABLE]
            ok_idx, ok_b = idx[good], fb[good]
            out.bbox[ok_idx] = st.bbox[ok_b]
            out.k_achieved[ok_idx] = kach[good]
            out.area_m2[ok_idx] = area[good]
            out.group[ok_idx] = ok_b
        for i in np.flatnonzero(live & ~fast).tolist():
            res, gid = self._stricter(st, int(b[i]), profiles[i])
            out.set(i, res)
            out.group[i] = gid
        return out


__all__ = [
    "Buckets",
    "HilbertCloak",
    "apply_ties",
    "bbox_areas_m2",
    "bboxes_around_keys",
    "cell_view",
    "count_change",
    "count_change_sorted",
    "cover_counts",
    "group_extents",
    "hilbert_index",
    "hilbert_indices",
    "hilbert_sort",
    "key_boxes",
    "order_ties",
    "partition_buckets",
    "segment_buckets",
    "super_bucket_levels",
    "tie_keys",
]
