"""The Hilbert order of the position index, kept between views (incremental views, CONCEPTS §2.4, §4.4).

A view of a million users used to start from nothing: exact coordinate keys, Hilbert values and a
sort of every present user. :class:`CurveOrder` keeps all three from one snapshot to the next and
patches them with the rows whose fix changed: their old entries leave the sorted order, their new
ones are placed by binary search. It also records which points left and entered the present set
since the previous snapshot (:class:`ViewDelta`), so that a cloaker can carry what depends on the
points only (user counts in a box) over from the previous view.

The order is by Hilbert value alone; users with equal values are left in no particular order here
and put in the view's salted tie order by the cloaker (that order changes with every epoch seed).
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.grid import GRID_BITS, grid_coords
from kcloak.core.geometry import coordinate_keys

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
F64 = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def hilbert_indices(x: npt.ArrayLike, y: npt.ArrayLike, order: int = GRID_BITS) -> I64:
    """Vectorized :func:`hilbert_index` on the ``2^order`` grid (the same iteration over bits, on arrays).

    Coordinates must lie in ``[0, 2^order)``, ``order ≤ 31``; the result fits in an int64. Works
    on cache-sized chunks (about 4× faster than whole arrays for a million points).
    """
    if not 1 <= order <= 31:
        raise ValueError("order: must be within [1, 31]")
    xs = np.array(x, dtype=np.int32).reshape(-1)
    ys = np.array(y, dtype=np.int32).reshape(-1)
    d = np.zeros(len(xs), np.int64)
    for lo in range(0, len(xs), _CHUNK):
        _hilbert_chunk(xs[lo : lo + _CHUNK], ys[lo : lo + _CHUNK], d[lo : lo + _CHUNK], order)
    return d


_CHUNK = 1 << 15


def _hilbert_chunk(xs: npt.NDArray[np.int32], ys: npt.NDArray[np.int32], d: I64, order: int) -> None:
    """The §4.4 iteration over bits, in place on one chunk (``xs``, ``ys`` are scratch)."""
    m = len(xs)
    rx = np.empty(m, np.int32)
    ry = np.empty(m, np.int32)
    tmp = np.empty(m, np.int32)
    for s in range(order - 1, -1, -1):
        np.right_shift(xs, s, out=rx)
        np.bitwise_and(rx, 1, out=rx)
        np.right_shift(ys, s, out=ry)
        np.bitwise_and(ry, 1, out=ry)
        d <<= 2
        np.multiply(rx, 3, out=tmp)
        np.bitwise_xor(tmp, ry, out=tmp)
        d |= tmp
        # Rotate where ry == 0: reflect when rx == 1, then swap. Only the bits below s matter from
        # here on, so reflecting those (x ^ (2^s − 1)) is the same as n − 1 − x.
        np.bitwise_xor(ry, 1, out=ry)
        np.bitwise_and(rx, ry, out=tmp)
        np.negative(tmp, out=tmp)
        np.bitwise_and(tmp, (1 << s) - 1, out=tmp)
        xs ^= tmp
        ys ^= tmp
        np.bitwise_xor(xs, ys, out=tmp)
        np.negative(ry, out=ry)
        tmp &= ry
        xs ^= tmp
        ys ^= tmp


def _no_rows() -> I64:
    return np.zeros(0, np.int64)


@dataclass(frozen=True, slots=True)
class ViewDelta:
    """Points (exact keys) that left and entered the present set since snapshot ``seq − 1`` of ``source``."""

    source: int
    seq: int
    removed_lon_key: I64
    removed_lat_key: I64
    added_lon_key: I64
    added_lat_key: I64
    removed_rows: I64 = field(default_factory=_no_rows)
    """Index rows of the points that left (one entry per point; empty when not recorded)."""
    added_rows: I64 = field(default_factory=_no_rows)
    """Index rows of the points that entered."""
    profile_rows: I64 = field(default_factory=_no_rows)
    """Index rows whose stored profile or salt was written in this step (present or not; a superset
    of the rows whose values changed)."""

    def __len__(self) -> int:
        return len(self.removed_lon_key) + len(self.added_lon_key)

    @classmethod
    def chain(cls, steps: list[ViewDelta]) -> ViewDelta:
        """One delta for consecutive steps (points are a multiset: each step's leavers were present)."""
        last = steps[-1]
        return cls(
            last.source,
            last.seq,
            np.concatenate([d.removed_lon_key for d in steps]),
            np.concatenate([d.removed_lat_key for d in steps]),
            np.concatenate([d.added_lon_key for d in steps]),
            np.concatenate([d.added_lat_key for d in steps]),
            np.concatenate([d.removed_rows for d in steps]),
            np.concatenate([d.added_rows for d in steps]),
            np.concatenate([d.profile_rows for d in steps]),
        )


@dataclass(frozen=True, slots=True)
class CurveStep:
    """One snapshot's share of the curve, in index rows.

    ``rows`` are the present index rows ordered by their level-29 Hilbert value ``hv`` (ascending;
    equal values in no particular order; int32); ``lon_key``/``lat_key`` the exact keys of every
    index row.
    """

    rows: I32
    hv: I64
    lon_key: I64
    lat_key: I64
    sorted_lon_key: I32
    sorted_lat_key: I32
    recent: tuple[ViewDelta, ...]


@dataclass(frozen=True, slots=True)
class ViewCurve:
    """A view's users in Hilbert order: view ``rows`` by level-29 value ``hv`` (ascending, equal values
    in no particular order; int32 or int64), and the ``delta`` since the previous snapshot of the
    same index."""

    rows: I64 | I32
    hv: I64
    lon_key: I32
    lat_key: I32
    recent: tuple[ViewDelta, ...]

    @property
    def seq(self) -> int:
        """This view's snapshot number."""
        return self.recent[-1].seq

    @property
    def source(self) -> int:
        return self.recent[-1].source

    def delta_since(self, source: int, seq: int) -> ViewDelta | None:
        """The change from snapshot ``seq`` of ``source`` to this view, if the recent steps reach it."""
        steps = [d for d in self.recent if d.seq > seq]
        if source != self.source or not steps or steps[0].seq != seq + 1:
            return None
        return steps[0] if len(steps) == 1 else ViewDelta.chain(steps)


class CurveOrder:
    """Index rows sorted by the Hilbert value of their latest fix, patched at each snapshot.

    :meth:`advance` compares the index's coordinate columns with the ones it last saw: rows that
    moved (or are new) get fresh keys and Hilbert values and are moved within the sorted order;
    O(n) memory moves plus O(B log n) work for B changed rows. When more than a
    ``1/REBUILD_FRACTION`` of the rows changed, the order is sorted again from scratch.
    """

    REBUILD_FRACTION = 8
    KEEP_DELTAS = 8
    """Deltas of this many recent snapshots go with each view, so that a cloaker can carry its state
    over snapshots it did not see (a presence count, another cloaker)."""

    def __init__(self) -> None:
        self.source = secrets.randbits(62)
        """Identifies this order: deltas of different indexes never chain."""
        self.seq = 0
        self._n = 0
        self._present: BoolArray = np.zeros(0, bool)
        self.lon_key: I64 = np.zeros(0, np.int64)
        self.lat_key: I64 = np.zeros(0, np.int64)
        self._hv: I64 = np.zeros(0, np.int64)
        self._rows: I32 = np.zeros(0, np.int32)  # index rows in Hilbert order (int32: 4 B/user)
        self._hv_sorted: I64 = np.zeros(0, np.int64)
        self._lk_sorted: I32 = np.zeros(0, np.int32)  # exact keys fit in int32 (|key| < 7.3e8)
        self._tk_sorted: I32 = np.zeros(0, np.int32)
        self._recent: deque[ViewDelta] = deque(maxlen=self.KEEP_DELTAS)
        self.key_undo: list[tuple[int, I64, I64, I64]] = []
        """``(seq, rows, lon keys, lat keys)``: the keys those index rows had at snapshot ``seq``,
        before a later step changed them (for views that read their keys on first use; the index
        drops entries no live view needs)."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the order's arrays."""
        arrays = (
            self._present,
            self.lon_key,
            self.lat_key,
            self._hv,
            self._rows,
            self._hv_sorted,
        )
        return int(sum(a.nbytes for a in arrays))

    def _grow(self, n: int) -> None:
        if n <= len(self._present):
            return
        cap = max(n, 2 * len(self._present), 16)

        def grown(a: npt.NDArray[np.generic], fill: object) -> npt.NDArray[np.generic]:
            out = np.full(cap, fill, dtype=a.dtype)
            out[: len(a)] = a
            return out

        self._present = grown(self._present, False)  # type: ignore[assignment]
        self.lon_key = grown(self.lon_key, 0)  # type: ignore[assignment]
        self.lat_key = grown(self.lat_key, 0)  # type: ignore[assignment]
        self._hv = grown(self._hv, 0)  # type: ignore[assignment]

    def advance(
        self, lat: F64, lon: F64, present: BoolArray, touched: I64, profile_rows: I64 | None = None
    ) -> CurveStep:
        """Bring the order up to the index's columns (rows ``0 … n−1``) and take one snapshot's step.

        ``touched``: the rows (ascending) whose fix may have changed since the previous step; rows
        from the previous step's ``n`` on are new and taken whatever it says. A touched row moved
        if its exact coordinate keys changed (a move within one micro-degree changes no key, no
        Hilbert value and no delta). The order keeps no copy of the coordinates. ``profile_rows``
        go into the step's delta as they are.

        The sorted arrays are never written in place (each change makes new ones), so a step's
        arrays stay valid; when every row is present they are the order's own, not copies.
        """
        n = len(lat)
        m = self._n
        if n > m:
            touched = np.concatenate([touched[touched < m], np.arange(m, n, dtype=np.int64)])  # ascending
        self._grow(n)
        lk_t = coordinate_keys(lon[touched])
        tk_t = coordinate_keys(lat[touched])
        differ = (touched >= m) | (lk_t != self.lon_key[touched]) | (tk_t != self.lat_key[touched])
        changed = touched[differ]
        was = self._present[:n]
        is_moved = np.zeros(n, bool)
        is_moved[changed] = True
        left = np.flatnonzero(was & (is_moved | ~present))
        entered = np.flatnonzero(present & (is_moved | ~was))
        removed_lon, removed_lat = self.lon_key[left], self.lat_key[left]  # the old keys

        if len(changed):
            lk, tk = lk_t[differ], tk_t[differ]
            hv = hilbert_indices(grid_coords(lk, "lon"), grid_coords(tk, "lat"))
            old = changed[changed < m]
            if len(old):
                self.key_undo.append((self.seq, old, self.lon_key[old], self.lat_key[old]))
            old_pos = self._sorted_positions(old) if len(changed) <= self.MERGE_LIMIT else None
            self.lon_key[changed] = lk
            self.lat_key[changed] = tk
            self._hv[changed] = hv
            if m == 0 or len(changed) * self.REBUILD_FRACTION > n:
                rows = np.argsort(self._hv[:n], kind="stable").astype(np.int32)
                self._rows, self._hv_sorted = rows, self._hv[rows]
                self._lk_sorted = self.lon_key[rows].astype(np.int32)
                self._tk_sorted = self.lat_key[rows].astype(np.int32)
            elif old_pos is not None:
                self._merge(old_pos, changed, hv, lk, tk)
            else:
                keep = ~is_moved[self._rows]
                base_hv = self._hv_sorted[keep]
                o = np.argsort(hv, kind="stable")
                at = np.searchsorted(base_hv, hv[o])
                self._rows = np.insert(self._rows[keep], at, changed[o])
                self._hv_sorted = np.insert(base_hv, at, hv[o])
                self._lk_sorted = np.insert(self._lk_sorted[keep], at, lk[o])
                self._tk_sorted = np.insert(self._tk_sorted[keep], at, tk[o])
            for a in (self._rows, self._hv_sorted, self._lk_sorted, self._tk_sorted):
                a.setflags(write=False)
        self._n = n
        self._present[:n] = present
        self.seq += 1
        delta = ViewDelta(
            self.source,
            self.seq,
            removed_lon,
            removed_lat,
            self.lon_key[entered],
            self.lat_key[entered],
            left,
            entered,
            profile_rows if profile_rows is not None else _no_rows(),
        )
        self._recent.append(delta)
        if present.all():  # nobody to leave out: the order's own (never written) arrays
            return CurveStep(
                self._rows,
                self._hv_sorted,
                self.lon_key[:n],
                self.lat_key[:n],
                self._lk_sorted,
                self._tk_sorted,
                tuple(self._recent),
            )
        p = present[self._rows]
        return CurveStep(
            self._rows[p],
            self._hv_sorted[p],
            self.lon_key[:n],
            self.lat_key[:n],
            self._lk_sorted[p],
            self._tk_sorted[p],
            tuple(self._recent),
        )

    MERGE_LIMIT = 2_000
    """Up to this many changed rows, :meth:`_merge` patches the sorted arrays by copying the runs
    between the changes (one pass, no masks); above, masks and ``np.insert`` are cheaper than its
    per-run copies."""
    _TIE_SCAN = 64
    """Steps :meth:`_sorted_positions` walks along runs of equal values before it gives up."""

    def _sorted_positions(self, rows: I64) -> I64 | None:
        """Positions of the given rows (already sorted) in the sorted arrays (before this step changes their
        values), ascending; None when runs of equal values are too long to walk."""
        hv_sorted, order_rows = self._hv_sorted, self._rows
        if not len(rows):
            return np.zeros(0, np.int64)
        pos = np.searchsorted(hv_sorted, self._hv[rows])
        last = len(order_rows) - 1
        todo = np.flatnonzero(order_rows[np.minimum(pos, last)] != rows)
        for _ in range(self._TIE_SCAN):  # equal values: the row is further along its run
            if not len(todo):
                return np.sort(pos)
            pos[todo] += 1
            todo = todo[order_rows[np.minimum(pos[todo], last)] != rows[todo]]
        return None

    def _merge(self, old_pos: I64, changed: I64, hv: I64, lk: I64, tk: I64) -> None:
        """The sorted arrays without the entries at ``old_pos`` and with the ``changed`` rows at
        their new values (each before the first kept entry of an equal or larger value, in row
        order among equal values: what the masks and ``np.insert`` give), new arrays copied run by
        run."""
        o = np.argsort(hv, kind="stable")
        new_hv = hv[o]
        old = self._hv_sorted
        q = np.searchsorted(old, new_hv)  # before old position q (entries deleted there are skipped)
        starts = np.union1d(np.union1d(old_pos, q), np.zeros(1, np.int64))  # runs start at 0 and at each cut
        ends = np.append(starts[1:], len(old))
        deleted = np.isin(starts, old_pos)
        src0 = (starts + deleted).tolist()
        src1 = ends.tolist()
        ins0 = np.searchsorted(q, starts, "left").tolist()
        ins1 = np.searchsorted(q, starts, "right").tolist()
        size = len(old) - len(old_pos) + len(new_hv)
        out = []
        for a, values in (
            (self._rows, changed[o].astype(np.int32)),
            (old, new_hv),
            (self._lk_sorted, lk[o]),
            (self._tk_sorted, tk[o]),
        ):
            b = np.empty(size, a.dtype)
            d = 0
            for s0, s1, i0, i1 in zip(src0, src1, ins0, ins1, strict=True):
                if i1 > i0:
                    b[d : d + i1 - i0] = values[i0:i1]
                    d += i1 - i0
                if s1 > s0:
                    b[d : d + s1 - s0] = a[s0:s1]
                    d += s1 - s0
            out.append(b)
        self._rows, self._hv_sorted, self._lk_sorted, self._tk_sorted = out

    def drop_key_undo(self, seq: int) -> None:
        """Forget the keys kept for snapshots before ``seq`` (no live view reads them)."""
        self.key_undo = [u for u in self.key_undo if u[0] >= seq]


__all__ = ["CurveOrder", "CurveStep", "ViewCurve", "ViewDelta", "hilbert_indices"]
