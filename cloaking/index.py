"""The position index: latest fix per user in numpy columns, and immutable views (§2.3, §2.4).

``PositionIndex`` is mutable and cheap to update (O(1) per fix, vectorized batches).
``IndexView`` is an immutable snapshot of the *present* users at one instant; every cloaker
reads a view, never the mutating index, so a decision can be replayed and checked. Views
build their search structures lazily and cache them, and cloakers cache their per-view state
(Hilbert buckets, …) in :attr:`IndexView.cache`.
"""

from __future__ import annotations

import bisect
import secrets
import weakref
from array import array
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import shapely

from kcloak.cloaking.curve import CurveOrder, ViewCurve
from kcloak.cloaking.grid import cell_code_range, cell_udeg, grid_coords, morton_codes
from kcloak.cloaking.userrows import HOT_MAX, FrozenIds, UserIds, UserRows
from kcloak.core.geometry import (
    WORLD_LAT_UDEG,
    WORLD_LON_UDEG,
    BBox,
    coordinate_keys,
    key_bounds_array,
)
from kcloak.core.profile import PrivacyProfile

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

_DEFAULT = PrivacyProfile()


class PositionIndex:
    """Latest accepted fix of every user, as numpy columns plus a user → row map.

    Columns: ``lat``, ``lon``, ``t`` (the fix), ``alive`` (row in use), and the stored-profile
    columns that partition-based cloakers need for everyone (``k``, ``min_area_m2``,
    ``max_area_m2``), plus a
    random per-user ``salt`` used to break ties without leaking arrival order or ids.

    Keyword arguments:
        stale_after_s: a user is present while its fix is at most this old (default 60).
        capacity: initial number of rows (default 1024); the columns double when full.
        default_profile: stored-profile values for users that have none (default: contract).
        hot_users: users whose row is kept in a dict for the fastest lookup (see
            :class:`~kcloak.cloaking.userrows.UserRows`; default :data:`~kcloak.cloaking.userrows.HOT_MAX`).
    """

    def __init__(
        self,
        *,
        stale_after_s: float = 60.0,
        capacity: int = 1024,
        default_profile: PrivacyProfile = _DEFAULT,
        hot_users: int = HOT_MAX,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.default_profile = default_profile
        self._users = UserRows(hot_max=hot_users)  # user ↔ row, without a str and an int per user
        self._hot = self._users.hot  # users looked up lately → row: read first (a dict lookup)
        self._n_rows = 0  # rows ever used (a freed row is reused before a new one is taken)
        self._free: list[int] = []
        self._lat: F64 = np.zeros(0)
        self._lon: F64 = np.zeros(0)
        self._t: F64 = np.zeros(0)
        self._alive: npt.NDArray[np.bool_] = np.zeros(0, bool)
        self._touched: npt.NDArray[np.bool_] = np.zeros(0, bool)  # fix set since the last snapshot
        self._k: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self._min_area: F64 = np.zeros(0)
        self._max_area: F64 = np.zeros(0)
        self._salt: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self._alloc(max(capacity, 16))
        self._rng = np.random.default_rng(secrets.randbits(64))
        self._removals = 0
        self._curve = CurveOrder()
        # The journal (see _Journal): old values of the rows written since the latest snapshot.
        self._profiled: npt.NDArray[np.bool_] = np.zeros(len(self._lat), bool)  # profile logged since then
        self._fixes_kept = True  # lat, lon, t as the latest snapshot saw them are kept (or unneeded)
        self._profile_log: list[tuple[int, int, float, float, int]] = []
        self._profile_rows = array("q")  # rows whose profile or salt was written since then
        self._journal = _Journal()
        self._present_rows: tuple[npt.NDArray[np.bool_], I64, npt.NDArray[np.int32]] | None = None
        # Smallest and largest value of each stored-profile column over one present set (the
        # latest view's mask, by identity), valid until the next snapshot after a profile write.
        self._ranges: dict[str, tuple[npt.NDArray[np.bool_], float, float]] = {}

    def _alloc(self, capacity: int) -> None:
        n_old = len(self._lat)
        lat = np.zeros(capacity)
        lon = np.zeros(capacity)
        t = np.full(capacity, -np.inf)
        alive = np.zeros(capacity, bool)
        touched = np.zeros(capacity, bool)
        k = np.full(capacity, self.default_profile.k, np.int32)
        min_area = np.full(capacity, self.default_profile.min_area_m2)
        max_area = np.full(capacity, self.default_profile.max_area_m2)
        salt = np.zeros(capacity, np.uint64)
        if n_old:
            lat[:n_old] = self._lat
            lon[:n_old] = self._lon
            t[:n_old] = self._t
            alive[:n_old] = self._alive
            touched[:n_old] = self._touched
            k[:n_old] = self._k
            min_area[:n_old] = self._min_area
            max_area[:n_old] = self._max_area
            salt[:n_old] = self._salt
        self._lat, self._lon, self._t, self._alive, self._touched = lat, lon, t, alive, touched
        profiled = np.zeros(capacity, bool)
        if n_old:
            profiled[:n_old] = self._profiled
        self._profiled = profiled
        self._k, self._min_area, self._max_area, self._salt = k, min_area, max_area, salt

    def _keep_fixes(self) -> None:
        """Before the first fix written after a snapshot: copy ``lat``, ``lon``, ``t`` as that
        snapshot saw them if a view of it may still read one of them (O(n) once per snapshot, so
        that each write costs nothing more)."""
        self._fixes_kept = True
        if self._journal.reads_fixes():
            n = self._n_rows
            self._journal.fixes.append((self._curve.seq, np.array((self._lat[:n], self._lon[:n], self._t[:n]))))

    def _log_profile(self, row: int) -> None:
        """Keep the row's stored profile and salt as the latest snapshot saw them (once per snapshot)."""
        if not self._profiled[row]:
            self._profiled[row] = True
            self._profile_rows.append(row)
            if not self._journal.views:
                return
            self._profile_log.append(
                (
                    row,
                    self._k.item(row),
                    self._min_area.item(row),
                    self._max_area.item(row),
                    self._salt.item(row),
                )
            )

    def __len__(self) -> int:
        return len(self._users)

    def __contains__(self, user: object) -> bool:
        return isinstance(user, str) and self._users.get(user) is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by the numpy columns and the user ↔ row map (its dict of recent users aside)."""
        return int(
            self._users.nbytes
            + self._lat.nbytes
            + self._lon.nbytes
            + self._t.nbytes
            + self._alive.nbytes
            + self._touched.nbytes
            + self._profiled.nbytes
            + self._k.nbytes
            + self._min_area.nbytes
            + self._max_area.nbytes
            + self._salt.nbytes
        )

    def _new_row(self, user: str) -> int:
        if self._free:
            row = self._free.pop()
        else:
            row = self._n_rows
            if row >= len(self._lat):
                self._alloc(2 * len(self._lat))
            self._n_rows += 1
        self._users.add(user, row)
        self._log_profile(row)
        self._alive[row] = True
        self._salt[row] = self._rng.integers(0, 2**63, dtype=np.uint64)
        self._k[row] = self.default_profile.k
        self._min_area[row] = self.default_profile.min_area_m2
        self._max_area[row] = self.default_profile.max_area_m2
        return row

    def update(self, user: str, lat: float, lon: float, t: float) -> int:
        """Set the latest fix of ``user`` (adds the user if new); returns the user's row. O(1)."""
        row = self._hot.get(user)
        if row is None:
            row = self._users.find(user)
            if row is None:
                row = self._new_row(user)
        if not self._fixes_kept:
            self._keep_fixes()
        self._lat[row] = lat
        self._lon[row] = lon
        self._t[row] = t
        self._touched[row] = True
        return row

    def update_batch(self, users: Sequence[str], lat: npt.ArrayLike, lon: npt.ArrayLike, t: npt.ArrayLike) -> I64:
        """Apply many fixes at once; for a user named twice the later item wins. Returns the row of
        each item's user (one entry per item)."""
        get = self._hot.get
        rows = [get(u, -1) for u in users]
        if -1 in rows:
            find = self._users.find
            for i, r in enumerate(rows):
                if r == -1:
                    got = find(users[i])
                    rows[i] = got if got is not None else self._new_row(users[i])
        idx = item_rows = np.asarray(rows, dtype=np.int64)
        lat_a = np.asarray(lat, dtype=np.float64)
        lon_a = np.asarray(lon, dtype=np.float64)
        t_a = np.asarray(t, dtype=np.float64)
        if len(set(rows)) != len(rows):  # a user named twice (a set of ints: cheaper than np.unique)
            last = {r: i for i, r in enumerate(rows)}
            keep = np.fromiter(last.values(), np.int64, len(last))
            idx, lat_a, lon_a, t_a = idx[keep], lat_a[keep], lon_a[keep], t_a[keep]
        if not self._fixes_kept:
            self._keep_fixes()
        self._lat[idx] = lat_a
        self._lon[idx] = lon_a
        self._t[idx] = t_a
        self._touched[idx] = True
        return item_rows

    def row_of(self, user: str) -> int | None:
        """The user's row (stable for as long as the user is not removed), or None."""
        return self._users.get(user)

    def latest_t(self, user: str) -> float | None:
        """``t`` of the user's latest fix, or None (no fix, or removed)."""
        row = self._hot.get(user)
        if row is None:
            row = self._users.find(user)
            if row is None:
                return None
        t: float = self._t.item(row)
        return None if t == -np.inf else t

    def user_ids(self) -> list[str]:
        """Every user the index holds (present or not)."""
        return self._users.users()

    def remove(self, user: str) -> None:
        """Forget ``user`` entirely. O(1)."""
        row = self._users.remove(user)
        if row is None:
            return
        self._removals += 1
        if not self._fixes_kept:
            self._keep_fixes()
        self._touched[row] = True
        self._alive[row] = False
        self._t[row] = -np.inf
        self._free.append(row)

    def set_profile(self, user: str, profile: PrivacyProfile | None) -> None:
        """Record the stored profile of ``user`` (``None``: the default) for group-based cloakers."""
        row = self._users.get(user)
        if row is None:
            row = self._new_row(user)
        p = profile if profile is not None else self.default_profile
        if self._k[row] == p.k and self._min_area[row] == p.min_area_m2 and self._max_area[row] == p.max_area_m2:
            return
        self._log_profile(row)
        self._k[row] = p.k
        self._min_area[row] = p.min_area_m2
        self._max_area[row] = p.max_area_m2

    def fix(self, user: str) -> tuple[float, float, float] | None:
        """``(lat, lon, t)`` of the user's latest fix, or ``None``."""
        row = self._users.get(user)
        if row is None or self._t[row] == -np.inf:
            return None
        return float(self._lat[row]), float(self._lon[row]), float(self._t[row])

    def is_present(self, user: str, now: float) -> bool:
        row = self._users.get(user)
        return row is not None and bool(self._t[row] >= now - self.stale_after_s)

    def present_count(self, now: float) -> int:
        """Users present at ``now`` (``len(self.snapshot(now))`` without making a view)."""
        n = self._n_rows
        return int(np.count_nonzero(self._alive[:n] & (self._t[:n] >= now - self.stale_after_s)))

    def snapshot(self, now: float, *, epoch: int = 0, seed: int = 0) -> IndexView:
        """An immutable view of the users present at ``now`` (fix ``t ≥ now − stale_after_s``).

        The view comes with its users in Hilbert order, taken from the index's
        :class:`~kcloak.cloaking.curve.CurveOrder` (patched with the fixes applied since the
        previous snapshot), and with what changed since that snapshot. It copies no column: each
        (``lat`` … ``salt``, the exact keys) is read from the index on first use, with the values
        the rows had at this snapshot (the index keeps the old values of the rows written since,
        for as long as a view may read them: :class:`_Journal`).
        """
        n = self._n_rows
        present = self._alive[:n] & (self._t[:n] >= now - self.stale_after_s)
        kept = self._present_rows
        if kept is not None and len(kept[0]) == n and np.array_equal(kept[0], present):
            present, rows, view_of = kept  # the same users as the previous view: same numbering
        else:
            rows = np.flatnonzero(present)
            if len(rows) == n:
                view_of = np.arange(n, dtype=np.int32)
            else:
                view_of = np.full(n, -1, np.int32)  # index row → view row (int32: 4 B/user)
                view_of[rows] = np.arange(len(rows), dtype=np.int32)
            for a in (present, rows, view_of):
                a.setflags(write=False)
            self._present_rows = (present, rows, view_of)
        touched = np.flatnonzero(self._touched[:n])
        self._touched[touched] = False
        before = self._curve.seq
        self._journal.freeze(before, self._profile_log)
        profile_rows = np.frombuffer(self._profile_rows, np.int64).copy()
        if len(profile_rows):
            self._ranges.clear()
        self._profiled[profile_rows] = False
        self._profile_log = []
        self._profile_rows = array("q")
        step = self._curve.advance(self._lat[:n], self._lon[:n], present, touched, profile_rows)
        columns = _Columns(self, self._curve.seq, rows, present)
        self._journal.views.append(weakref.ref(columns))
        oldest = self._journal.prune()
        self._fixes_kept = False
        self._curve.drop_key_undo(oldest)
        view = IndexView(
            user_ids=None,
            lat=None,
            lon=None,
            t=None,
            now=now,
            epoch=epoch,
            seed=seed,
            lookup=_IndexLookup(self, self._users.frozen(), rows, view_of),
            columns=columns,
        )
        if len(rows) == n:  # view rows are index rows
            curve_rows = step.rows
        else:
            curve_rows = view_of[step.rows]
            curve_rows.setflags(write=False)
        view.curve = ViewCurve(curve_rows, step.hv, step.sorted_lon_key, step.sorted_lat_key, step.recent)
        return view

    def _gather(self, name: str, seq: int, rows: I64, ascending: bool) -> npt.NDArray[Any]:
        """Column ``name`` of the index rows ``rows`` (distinct; ``ascending``: in ascending order) as
        snapshot ``seq`` saw them."""
        if name in ("lon_key", "lat_key"):
            base = self._curve.lon_key if name == "lon_key" else self._curve.lat_key
            out: npt.NDArray[Any] = base[rows]
            undo: list[Undo] = [(g, r, lk if name == "lon_key" else tk) for g, r, lk, tk in self._curve.key_undo]
        else:
            if name in _FIX_COLUMNS:  # the copy of the oldest generation at or after seq, if any
                kept = [(g, v) for g, v in self._journal.fixes if g >= seq]
                col: F64 = (
                    min(kept, key=lambda e: e[0])[1][_FIX_COLUMNS.index(name)] if kept else getattr(self, _COLUMN[name])
                )
                fix: F64 = col[rows]
                return fix
            out = getattr(self, _COLUMN[name])[rows]
            if name == "k":
                out = out.astype(np.int64)
            undo = self._journal.entries(name, self._profile_log, self._curve.seq)
        undo = [u for u in undo if u[0] >= seq]
        if not undo or not len(rows):
            return out
        by = None if ascending else np.argsort(rows)
        srt = rows if by is None else rows[by]
        for _, r, values in reversed(undo):  # newest first: the oldest at or after seq wins
            at = np.minimum(np.searchsorted(srt, r), len(srt) - 1)
            hit = srt[at] == r
            out[at[hit] if by is None else by[at[hit]]] = values[hit]
        return out

    def _profile_range(self, name: str, seq: int, present: npt.NDArray[np.bool_]) -> tuple[float, float] | None:
        """Smallest and largest value of a stored-profile column (``k``, ``min_area_m2``,
        ``max_area_m2``) among the rows ``present`` at snapshot ``seq``, read on the index's column
        without a copy, when no stored profile was written since (None: read the view's column)."""
        if self._profile_rows or any(g >= seq for g, _, _ in self._journal.profiles):
            return None
        got = self._ranges.get(name)
        if got is not None and got[0] is present:  # no profile written since it was computed
            return got[1], got[2]
        n = len(present)
        if not present.any():
            return (0.0, 0.0)
        col = getattr(self, _COLUMN[name])[:n]
        if present.all():
            lo, hi = float(col.min()), float(col.max())
        else:
            f = col.dtype.kind == "f"
            top, bottom = (np.inf, -np.inf) if f else (np.iinfo(col.dtype).max, np.iinfo(col.dtype).min)
            lo, hi = float(np.min(col, where=present, initial=top)), float(np.max(col, where=present, initial=bottom))
        if self._present_rows is not None and present is self._present_rows[0]:
            self._ranges[name] = (present, lo, hi)
        return lo, hi

    def snapshot_from_scratch(self, now: float, *, epoch: int = 0, seed: int = 0) -> IndexView:
        """The same view as :meth:`snapshot` built from nothing: no kept order, no carried state, its
        own user list and map (the reference incremental views are measured and checked against)."""
        n = self._n_rows
        rows = np.flatnonzero(self._alive[:n] & (self._t[:n] >= now - self.stale_after_s))
        return IndexView(
            user_ids=self._users.frozen().users(rows.tolist()),
            lat=self._lat[rows],
            lon=self._lon[rows],
            t=self._t[rows],
            k=self._k[rows].astype(np.int64),
            min_area_m2=self._min_area[rows],
            max_area_m2=self._max_area[rows],
            salt=self._salt[rows],
            now=now,
            epoch=epoch,
            seed=seed,
        )

    @property
    def curve_nbytes(self) -> int:
        """Bytes held by the Hilbert order kept between views."""
        return self._curve.nbytes


_COLUMN = {
    "lat": "_lat",
    "lon": "_lon",
    "t": "_t",
    "k": "_k",
    "min_area_m2": "_min_area",
    "max_area_m2": "_max_area",
    "salt": "_salt",
}
_FIX_COLUMNS = ("lat", "lon", "t")
_PROFILE_COLUMNS = ("k", "min_area_m2", "max_area_m2", "salt")
_PROFILE_DTYPES = (np.int32, np.float64, np.float64, np.uint64)

Undo = tuple[int, I64, npt.NDArray[Any]]


class _Journal:
    """Old values of index rows, so that views read the index's columns instead of copying them.

    Between snapshot ``g`` and the next, the index copies the fix columns (``lat``, ``lon``,
    ``t``) whole before the first fix written (generation ``g``: the values snapshot ``g`` saw), and
    logs each row's stored profile and salt before their first change; at the next snapshot that
    log is frozen as generation ``g``. A view of snapshot ``g`` reads a fix column from the copy of
    the oldest generation ``≥ g`` (none: nothing was written since, the index's column), and a
    profile column as the index's current values overwritten by the logs of generations ``≥ g``,
    newest first (the oldest such log holds the value at ``g``). Copies and logs older than every
    live view that still has a column to read are dropped at each snapshot.
    """

    __slots__ = ("fixes", "profiles", "views")

    def __init__(self) -> None:
        self.fixes: list[tuple[int, F64]] = []  # (generation, (3, n) lat/lon/t)
        self.profiles: list[tuple[int, I64, tuple[npt.NDArray[Any], ...]]] = []
        self.views: list[weakref.ref[_Columns]] = []

    def freeze(
        self,
        gen: int,
        profile_log: list[tuple[int, int, float, float, int]],
    ) -> None:
        """Keep the current profile log as generation ``gen`` (if a view may need it)."""
        if self.views and profile_log:
            rows = np.fromiter((e[0] for e in profile_log), np.int64, len(profile_log))
            cols = tuple(
                np.fromiter((e[i + 1] for e in profile_log), dt, len(profile_log))
                for i, dt in enumerate(_PROFILE_DTYPES)
            )
            self.profiles.append((gen, rows, cols))

    def reads_fixes(self) -> bool:
        """Whether a live view may still read ``lat``, ``lon`` or ``t`` from the index."""
        return any((c := ref()) is not None and not c.pending.isdisjoint(_FIX_COLUMNS) for ref in self.views)

    def prune(self) -> int:
        """Drop the views that are gone or read everything, and the logs none of the others needs;
        returns the oldest generation still needed."""
        live = [ref for ref in self.views if (c := ref()) is not None and c.pending]
        self.views = live
        gens = [c.seq for ref in live if (c := ref()) is not None]
        oldest = min(gens) if gens else 1 << 62
        fix_gens = [c.seq for ref in live if (c := ref()) is not None and not c.pending.isdisjoint(_FIX_COLUMNS)]
        self.fixes = [e for e in self.fixes if fix_gens and e[0] >= min(fix_gens)]
        self.profiles = [e for e in self.profiles if e[0] >= oldest]
        return oldest

    def entries(
        self,
        name: str,
        profile_log: list[tuple[int, int, float, float, int]],
        current: int,
    ) -> list[Undo]:
        """The logs of profile column ``name``, oldest first, the current (not yet frozen) one last."""
        i = _PROFILE_COLUMNS.index(name)
        out: list[Undo] = [(g, r, cols[i]) for g, r, cols in self.profiles]
        if profile_log:
            rows = np.fromiter((e[0] for e in profile_log), np.int64, len(profile_log))
            out.append((current, rows, np.fromiter((e[i + 1] for e in profile_log), _PROFILE_DTYPES[i], len(rows))))
        return out


class _Columns:
    """Where a view of a :class:`PositionIndex` reads its columns from, on first use."""

    __slots__ = ("__weakref__", "everyone", "index", "pending", "present", "rows", "seq")

    def __init__(self, index: PositionIndex, seq: int, rows: I64, present: npt.NDArray[np.bool_]) -> None:
        self.index: PositionIndex | None = index
        self.seq = seq
        self.rows = rows
        self.present = present
        self.everyone = len(rows) == len(present)
        """Every index row is present: view rows are index rows."""
        self.pending = {*_COLUMN, "lon_key", "lat_key"}

    def gather(self, name: str) -> npt.NDArray[Any]:
        index = self.index
        assert index is not None, "every column was read already"
        out = index._gather(name, self.seq, self.rows, True)
        out.setflags(write=False)
        self.pending.discard(name)
        if not self.pending:
            self.index = None
        return out

    def gather_at(self, name: str, view_rows: I64) -> npt.NDArray[Any]:
        assert self.index is not None
        return self.index._gather(name, self.seq, view_rows if self.everyone else self.rows[view_rows], False)

    def profile_range(self, name: str) -> tuple[float, float] | None:
        return None if self.index is None else self.index._profile_range(name, self.seq, self.present)


class _IndexLookup:
    """How a view taken from a :class:`PositionIndex` finds a user's row without a dict of its own.

    ``ids`` is the index's row → user map as at the snapshot (:meth:`UserRows.frozen`), ``rows`` the view's index
    rows, ``view_of`` index row → view row (−1: not in the view). The index's own user → row map
    answers for as long as no user was removed from the index (rows are only reused after a
    removal); after one, the view builds its own map.
    """

    __slots__ = ("ids", "index", "removals", "rows", "view_of")

    def __init__(self, index: PositionIndex, ids: FrozenIds, rows: I64, view_of: npt.NDArray[np.int32]) -> None:
        self.index = index
        self.ids = ids
        self.rows = rows
        self.view_of = view_of
        self.removals = index._removals

    def user_ids(self) -> UserIds:
        return self.ids.of_rows(self.rows)

    def row(self, user: str) -> int | None:
        """The user's view row; raises LookupError when only the view's own map can tell."""
        r = self.index._users.get(user)
        if r is not None and r < len(self.view_of):
            v = int(self.view_of[r])
            if v >= 0 and self.ids.is_user(r, user):
                return v
        if self.index._removals != self.removals:
            raise LookupError(user)
        return None


class IndexView:
    """Present users at one instant; rows ``0 … n−1`` are the view's own numbering.

    Arrays are read-only. Search structures are built on first use: Morton-sorted codes for
    quadtree cell counts, sorted keys for edge strips, an STR-tree for arbitrary boxes.
    """

    def __init__(
        self,
        *,
        user_ids: Sequence[str] | None,
        lat: F64 | None,
        lon: F64 | None,
        t: F64 | None,
        k: I64 | None = None,
        min_area_m2: F64 | None = None,
        max_area_m2: F64 | None = None,
        salt: npt.NDArray[np.uint64] | None = None,
        now: float = 0.0,
        epoch: int = 0,
        seed: int = 0,
        lookup: _IndexLookup | None = None,
        columns: _Columns | None = None,
    ) -> None:
        if user_ids is None and lookup is None:
            raise ValueError("IndexView: user_ids are required")
        n = len(user_ids) if user_ids is not None else len(lookup.rows)  # type: ignore[union-attr]
        self._user_ids = user_ids
        self._lookup = lookup
        self._n = n
        self._columns = columns
        if columns is None:
            if lat is None or lon is None or t is None:
                raise ValueError("IndexView: lat, lon and t are required")
            cols = self.__dict__
            cols["lat"] = np.asarray(lat, dtype=np.float64)
            cols["lon"] = np.asarray(lon, dtype=np.float64)
            cols["t"] = np.asarray(t, dtype=np.float64)
            cols["k"] = np.asarray(k if k is not None else np.full(n, _DEFAULT.k), dtype=np.int64)
            cols["min_area_m2"] = np.asarray(
                min_area_m2 if min_area_m2 is not None else np.full(n, _DEFAULT.min_area_m2), dtype=np.float64
            )
            cols["max_area_m2"] = np.asarray(
                max_area_m2 if max_area_m2 is not None else np.full(n, _DEFAULT.max_area_m2), dtype=np.float64
            )
            if salt is None:
                salt = np.array([hash_user(u) for u in self.user_ids], dtype=np.uint64)
            cols["salt"] = np.asarray(salt, dtype=np.uint64)
            for name in ("lat", "lon", "t", "k", "min_area_m2", "max_area_m2", "salt"):
                a = cols[name]
                if len(a) != n:
                    raise ValueError("IndexView: every column must have one entry per user")
                a.setflags(write=False)
        self.now = now
        self.epoch = epoch
        self.seed = seed
        self.cache: dict[Any, Any] = {}
        """Per-view state of cloakers, keyed by whatever the cloaker chooses."""
        self.curve: ViewCurve | None = None
        """Rows in Hilbert order and the change since the previous view, when the index keeps them."""

    # Columns (read-only, one entry per view row). A view of a PositionIndex reads each from the
    # index on first use (the values at its snapshot); other views are given them.
    @cached_property
    def lat(self) -> F64:
        return self._gathered("lat")

    @cached_property
    def lon(self) -> F64:
        return self._gathered("lon")

    @cached_property
    def t(self) -> F64:
        return self._gathered("t")

    @cached_property
    def k(self) -> I64:
        """Stored k of each user."""
        return self._gathered("k")

    @cached_property
    def min_area_m2(self) -> F64:
        return self._gathered("min_area_m2")

    @cached_property
    def max_area_m2(self) -> F64:
        return self._gathered("max_area_m2")

    @cached_property
    def salt(self) -> npt.NDArray[np.uint64]:
        """Random per-user tie-break salt."""
        return self._gathered("salt")

    def _gathered(self, name: str) -> npt.NDArray[Any]:
        assert self._columns is not None
        return self._columns.gather(name)

    def column_at(self, name: str, rows: I64) -> npt.NDArray[Any]:
        """``getattr(view, name)[rows]`` (a column or ``lon_key``/``lat_key``) without reading the
        whole column when it was not read yet."""
        if name in self.__dict__ or self._columns is None or self._columns.index is None:
            out: npt.NDArray[Any] = getattr(self, name)[rows]
            return out
        return self._columns.gather_at(name, np.asarray(rows, dtype=np.int64))

    @cached_property
    def k_max(self) -> int:
        """Largest stored k of the view's users (0 for an empty view)."""
        return int(self.profile_range("k")[1])

    def profile_range(self, name: str) -> tuple[float, float]:
        """Smallest and largest value of ``k``, ``min_area_m2`` or ``max_area_m2`` over the view's
        users ((0, 0) for an empty view), without reading the whole column when it was not read yet."""
        if not self._n:
            return (0.0, 0.0)
        if self._columns is not None and name not in self.__dict__:
            got = self._columns.profile_range(name)
            if got is not None:
                return got
        col = getattr(self, name)
        return float(col.min()), float(col.max())

    @classmethod
    def from_points(
        cls,
        user_ids: Iterable[str],
        lat: npt.ArrayLike,
        lon: npt.ArrayLike,
        *,
        t: npt.ArrayLike | None = None,
        k: npt.ArrayLike | None = None,
        min_area_m2: npt.ArrayLike | None = None,
        max_area_m2: npt.ArrayLike | None = None,
        now: float = 0.0,
        epoch: int = 0,
        seed: int = 0,
    ) -> IndexView:
        """A view from plain arrays (tests, benchmarks, replays of a recorded snapshot)."""
        ids = list(user_ids)
        lat_a = np.asarray(lat, dtype=np.float64)
        return cls(
            user_ids=ids,
            lat=lat_a,
            lon=np.asarray(lon, dtype=np.float64),
            t=np.asarray(t, dtype=np.float64) if t is not None else np.full(len(ids), now),
            k=np.asarray(k, dtype=np.int64) if k is not None else None,
            min_area_m2=np.asarray(min_area_m2, dtype=np.float64) if min_area_m2 is not None else None,
            max_area_m2=np.asarray(max_area_m2, dtype=np.float64) if max_area_m2 is not None else None,
            now=now,
            epoch=epoch,
            seed=seed,
        )

    def __len__(self) -> int:
        return self._n

    @property
    def user_ids(self) -> Sequence[str]:
        """User id of each view row (for a view of a :class:`PositionIndex`, a sequence that makes
        each id's string when it is read: no string per user held)."""
        if self._user_ids is None:
            assert self._lookup is not None
            self._user_ids = self._lookup.user_ids()
        return self._user_ids

    @property
    def index_rows(self) -> tuple[I64, npt.NDArray[np.int32]] | None:
        """For a view of a :class:`PositionIndex`: (view row → index row, index row → view row or −1)."""
        return None if self._lookup is None else (self._lookup.rows, self._lookup.view_of)

    @cached_property
    def row_of(self) -> dict[str, int]:
        """User id → view row."""
        return {u: i for i, u in enumerate(self.user_ids)}

    def row(self, user: str) -> int | None:
        """The user's view row, or None when the user is not in the view."""
        if self._lookup is not None and "row_of" not in self.__dict__:
            try:
                return self._lookup.row(user)
            except LookupError:
                pass
        return self.row_of.get(user)

    # -- exact coordinates -------------------------------------------------------------------
    @cached_property
    def lon_key(self) -> I64:
        """Exact integer keys of the longitudes (see :mod:`kcloak.core.geometry`)."""
        if self._columns is not None:
            return self._gathered("lon_key")
        k = coordinate_keys(self.lon)
        k.setflags(write=False)
        return k

    @cached_property
    def lat_key(self) -> I64:
        if self._columns is not None:
            return self._gathered("lat_key")
        k = coordinate_keys(self.lat)
        k.setflags(write=False)
        return k

    @cached_property
    def gx(self) -> I64:
        """Level-29 grid column of each user."""
        return grid_coords(self.lon_key, "lon")

    @cached_property
    def gy(self) -> I64:
        return grid_coords(self.lat_key, "lat")

    @cached_property
    def morton(self) -> npt.NDArray[np.uint64]:
        """Level-29 Morton code of each user."""
        return morton_codes(self.gx, self.gy)

    @cached_property
    def _morton_sorted(self) -> list[int]:
        codes: list[int] = np.sort(self.morton).tolist()
        return codes

    def count_cell(self, level: int, cx: int, cy: int) -> int:
        """Users whose grid position falls in a cell (half-open). O(log n)."""
        lo, hi = cell_code_range(level, cx, cy)
        codes = self._morton_sorted
        return bisect.bisect_left(codes, hi) - bisect.bisect_left(codes, lo)

    # -- strict counts in published boxes ----------------------------------------------------
    @cached_property
    def _lon_key_sorted(self) -> tuple[list[int], I64]:
        order = np.argsort(self.lon_key, kind="stable")
        return self.lon_key[order].tolist(), order

    @cached_property
    def _lat_key_sorted(self) -> tuple[list[int], I64]:
        order = np.argsort(self.lat_key, kind="stable")
        return self.lat_key[order].tolist(), order

    def _rows_with_key(self, axis: int, key: int) -> I64:
        keys, order = self._lon_key_sorted if axis == 0 else self._lat_key_sorted
        i = bisect.bisect_left(keys, key)
        j = bisect.bisect_right(keys, key, lo=i)
        return order[i:j]

    def cell_rect_bbox(self, level: int, cx0: int, cy0: int, cx1: int, cy1: int) -> BBox:
        """Published bbox of the cell rectangle ``[cx0, cx1] × [cy0, cy1]`` (inclusive, level ``level``).

        Its lower edges sit one micro-degree below the cells' so that users on them are strictly
        inside; upper edges are the cells' own. Clipped at the world edge.
        """
        lon0, lat0, _, _ = cell_udeg(level, cx0, cy0)
        _, _, lon1, lat1 = cell_udeg(level, cx1, cy1)
        return BBox(
            max(lon0 - 1, -WORLD_LON_UDEG),
            max(lat0 - 1, -WORLD_LAT_UDEG),
            min(max(lon1, -WORLD_LON_UDEG + 1), WORLD_LON_UDEG),
            min(max(lat1, -WORLD_LAT_UDEG + 1), WORLD_LAT_UDEG),
        )

    def edge_extras(self, bbox: BBox, cell_lon0: int, cell_lat0: int) -> int:
        """Users strictly inside ``bbox`` but outside the cell rectangle it was published for.

        These can only sit strictly between the published lower edge and the cells' lower edge
        (keys ``2·lon0 − 1`` and ``2·lat0 − 1``); each is counted once.
        """
        extra = 0
        klon = 2 * cell_lon0 - 1
        klat = 2 * cell_lat0 - 1
        lo_lon, lo_lat, hi_lon, hi_lat = bbox.key_bounds()
        if klon >= lo_lon:
            rows = self._rows_with_key(0, klon)
            if len(rows):
                lk = self.lat_key[rows]
                extra += int(np.count_nonzero((lk >= lo_lat) & (lk <= hi_lat)))
        if klat >= lo_lat:
            rows = self._rows_with_key(1, klat)
            if len(rows):
                ok = self.lon_key[rows]
                extra += int(np.count_nonzero((ok >= lo_lon) & (ok <= hi_lon) & (ok != klon)))
        return extra

    @cached_property
    def strtree(self) -> shapely.STRtree:
        """STR-tree over the users' exact keys (integers, exact in float64)."""
        pts = shapely.points(self.lon_key.astype(np.float64), self.lat_key.astype(np.float64))
        return shapely.STRtree(pts)

    def rows_in(self, bbox: BBox) -> I64:
        """View rows inside a published bbox: strictly, except on the world edge (exact)."""
        a, b, c, d = bbox.key_bounds()
        if len(self) == 0 or a > c or b > d:
            return np.empty(0, np.int64)
        out: I64 = self.strtree.query(shapely.box(a, b, c, d)).astype(np.int64)
        return out

    def count_in(self, bbox: BBox) -> int:
        """Present users inside a published bbox (strict but at the world edge; exact)."""
        return len(self.rows_in(bbox))

    def count_in_many(self, bboxes: npt.NDArray[np.int64]) -> I64:
        """Strict counts for an ``(m, 4)`` array of micro-degree boxes ``[lon0, lat0, lon1, lat1]``."""
        m = len(bboxes)
        if m == 0 or len(self) == 0:
            return np.zeros(m, np.int64)
        kb = key_bounds_array(bboxes)
        usable = (kb[:, 2] >= kb[:, 0]) & (kb[:, 3] >= kb[:, 1])
        boxes = shapely.box(kb[:, 0], kb[:, 1], kb[:, 2], kb[:, 3])
        boxes[~usable] = None
        pairs = self.strtree.query(boxes)
        out: I64 = np.bincount(pairs[0], minlength=m).astype(np.int64)
        return out


def hash_user(user: str) -> int:
    """A stable 63-bit salt for views built from plain arrays (tests, replays)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(user.encode(), digest_size=8).digest(), "little") >> 1
