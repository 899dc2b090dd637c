"""Segments of the Hilbert order: bucket chains that restart at fixed points of the curve (docs/views.md).

With one greedy chain over the whole curve, a single insertion shifts every later bucket bound, so
the buckets of a view cannot be patched locally. Here the curve is cut into *segments*, each the
users of one run of Hilbert values, and each segment's users are cut into buckets on their own
(:func:`partition_segments`, the personalized rule of :func:`~.hilbert.partition_buckets` applied
per segment). A move then re-buckets only the segments it leaves and enters.

The cut points are a pure function of the view's Hilbert values and one threshold ``T``
(:func:`curve_segments`): the curve-aligned quadtree (a node at depth ``d`` is one run of
``4^(order − d)`` Hilbert values) is split wherever a node holds at least ``2T`` users; every leaf
with at least ``T`` users ("big") ends a segment, and the leaves between two big leaves (fewer
than ``T`` users each) join the segment of the next big leaf (those after the last one join the
last). Every segment so holds at least ``T`` users, and ``T`` is at least the largest stored
``k`` of the view (:func:`segment_threshold`), so every user is placed; with fewer than ``2T``
users (or no big leaf) there is one segment, the single chain of before. Being a function of the
view only, the cut points are the same for an incremental view and one built from nothing, and the
same for every member of a bucket (reciprocity). A cut point moves only when a quadtree node's
population crosses ``T`` or ``2T``, and then only the segments around that node change.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

SEGMENT_FACTOR = 4
"""Default ``T`` in units of the largest stored ``k`` (rounded up to a power of two)."""


def segment_threshold(kmax: int, factor: int) -> int:
    """``T``: ``factor`` times the largest stored ``k`` rounded up to a power of two (0: no segments).

    The power of two keeps ``T`` (and so the cut points) unchanged while the largest ``k`` varies
    within one octave.
    """
    if factor <= 0:
        return 0
    return factor * (1 << max(0, int(kmax) - 1).bit_length())


def curve_segments(hv_sorted: I64, order: int, threshold: int) -> I64:
    """First Hilbert value of each segment (ascending, the first is 0) for users sorted by value.

    See the module docstring; ``threshold`` 0 (or fewer than ``2 · threshold`` users) gives one
    segment.
    """
    n = len(hv_sorted)
    if threshold <= 0 or n < 2 * threshold:
        return np.zeros(1, np.int64)
    leaf_lo: list[I64] = []
    leaf_hi: list[I64] = []
    leaf_pop: list[I64] = []
    lo = np.zeros(1, np.int64)  # the nodes to split, by first value, and their first/last positions
    p_lo = np.zeros(1, np.int64)
    p_hi = np.full(1, n, np.int64)
    four = np.arange(4, dtype=np.int64)
    for d in range(order):  # split the nodes of depth d into their four children
        w = np.int64(1) << np.int64(2 * (order - d - 1))
        clo = (lo[:, None] + four * w).ravel()
        cpos = np.empty((len(lo), 5), np.int64)  # children's first positions, then the parent's end
        cpos[:, 0] = p_lo
        cpos[:, 4] = p_hi
        cpos[:, 1:4] = np.searchsorted(hv_sorted, (lo[:, None] + four[1:] * w).ravel()).reshape(-1, 3)
        start = cpos[:, :4].ravel()
        end = cpos[:, 1:].ravel()
        pop = end - start
        split = pop >= 2 * threshold
        if d + 1 == order:
            split[:] = False
        leaf = ~split
        leaf_lo.append(clo[leaf])
        leaf_hi.append(clo[leaf] + w)
        leaf_pop.append(pop[leaf])
        lo, p_lo, p_hi = clo[split], start[split], end[split]
        if not len(lo):
            break
    los = np.concatenate(leaf_lo)
    order_ = np.argsort(los, kind="stable")
    his = np.concatenate(leaf_hi)[order_]
    big = np.flatnonzero(np.concatenate(leaf_pop)[order_] >= threshold)
    if len(big) <= 1:
        return np.zeros(1, np.int64)
    return np.concatenate([np.zeros(1, np.int64), his[big[:-1]]])


def _suffix_max_in_segments(k: I64, seg_start: I64) -> I64:
    """``max(k[i : end of i's segment])`` for every ``i`` (segments given by their starts, each non-empty)."""
    m = len(k)
    s = len(seg_start)
    lengths = np.diff(np.append(seg_start, m))
    big = np.int64(int(k.max()) + 1)
    # Offsets that grow towards the front: a running maximum from the back restarts at each segment.
    offset = np.repeat((s - 1 - np.arange(s, dtype=np.int64)) * big, lengths)
    out: I64 = np.maximum.accumulate((k + offset)[::-1])[::-1] - offset
    return out


def partition_segments(k_sorted: I64, seg_start: I64, bucket_ends: I64) -> I64:
    """Bucket starts (ascending) when each segment of ``k_sorted`` is cut with the personalized rule.

    ``seg_start`` are the segments' first positions (the first is 0), ``bucket_ends`` the greedy
    end from every start over the whole column (:func:`~.hilbert._bucket_ends`: windows that cross
    a segment's end give an end past it, which is then no end). Each segment must hold at least its
    largest ``k`` (as :func:`curve_segments` ensures). The result is what
    :func:`~.hilbert.partition_buckets` gives each segment on its own, without its final ``n``.
    """
    k = np.maximum(k_sorted, 1)
    m = len(k)
    s = len(seg_start)
    seg_end = np.append(seg_start[1:], m)
    ends = bucket_ends.copy()
    seg_of = np.repeat(np.arange(s, dtype=np.int64), np.diff(np.append(seg_start, m)))
    ends[ends > seg_end[seg_of]] = m + 1
    chain = [seg_start]
    cur = seg_start.copy()
    active = np.arange(s, dtype=np.int64)
    leftover = np.zeros(s, bool)
    while len(active):
        e = ends[cur[active]]
        stuck = e > m
        leftover[active[stuck]] = True
        active, e = active[~stuck], e[~stuck]
        more = e < seg_end[active]
        active, e = active[more], e[more]
        chain.append(e)
        cur[active] = e
    starts = np.concatenate(chain)
    owner = seg_of[starts]
    starts_sorted = np.argsort(starts, kind="stable")
    starts, owner = starts[starts_sorted], owner[starts_sorted]
    if leftover.any():  # merge each leftover backwards: keep starts up to the last valid one
        # max(k[b : segment end]) for each start b: per-bucket maxima, then from the back per segment
        first = np.searchsorted(owner, np.arange(s))
        suffix = _suffix_max_in_segments(np.maximum.reduceat(k, starts), first)
        valid = seg_end[owner] - starts >= suffix
        idx = np.arange(len(starts), dtype=np.int64)
        last_valid = np.maximum.reduceat(np.where(valid, idx, -1), first)
        keep = ~leftover[owner] | (idx <= last_valid[owner])
        starts = starts[keep]
    return starts


__all__ = ["SEGMENT_FACTOR", "curve_segments", "partition_segments", "segment_threshold"]
