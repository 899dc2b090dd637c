"""User id ↔ row of the position index, without a Python object per user (§2.4, memory).

A ``dict[str, int]`` of a million users costs ~125 MB: the id strings (~57 B each), the dict's
entries and an ``int`` object per row. :class:`UserRows` keeps

- the ids as UTF-8 bytes in one ``bytearray``, with each row's start and length (12 B a row);
- an open-addressing table (linear probing, at most half full) of int32 rows, probed by Python's
  ``hash`` of the id (kept per row, 8 B), every hit checked against the row's stored bytes, so two
  ids that share a hash are still told apart;
- a small dict of the users looked up or written lately (at most ``hot_max``): a fix of a user that
  sends often costs one dict lookup, as before; the table is read for the others.

At a million 8-character ids that is ~45 MB with a full ``hot`` dict, instead of ~125 MB.

Python's ``hash`` of a ``str`` is SipHash keyed at random per process, so a client can neither
predict nor provoke probe chains. Rows are the caller's: it says which row a new user takes
(:meth:`add`), and :meth:`remove` hands a user's row back.

Views read the ids as they were at their snapshot through :meth:`frozen`: the bytes are only ever
appended to (a compaction writes a new buffer), and the start/length arrays are copied before a
row that a frozen copy may read changes hands (copy on write).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import numpy.typing as npt

HOT_MAX = 1 << 16
"""Users kept in the dict of recent lookups before it is emptied (at most ~9 MB)."""

COMPACT_ABOVE = 1 << 20
"""Bytes of removed ids kept in the buffer before a compaction is considered."""

_EMPTY = -1
_GONE = -2  # a removed entry: probing goes on past it


class FrozenIds:
    """Row → user id as at one instant (see :meth:`UserRows.frozen`)."""

    __slots__ = ("_buf", "_size", "_start")

    def __init__(self, buf: bytearray, start: array[int], size: array[int]) -> None:
        self._buf = buf
        self._start = start
        self._size = size

    def __getitem__(self, row: int) -> str:
        s = self._start[row]
        return self._buf[s : s + self._size[row]].decode("utf-8", "surrogatepass")

    def is_user(self, row: int, user: str) -> bool:
        """Whether ``row`` held ``user`` (exact bytes)."""
        s = self._start[row]
        return self._buf[s : s + self._size[row]] == user.encode("utf-8", "surrogatepass")

    def users(self, rows: list[int]) -> list[str]:
        buf, start, size = bytes(self._buf), self._start, self._size
        return [buf[start[r] : start[r] + size[r]].decode("utf-8", "surrogatepass") for r in rows]

    def of_rows(self, rows: npt.NDArray[np.int64]) -> UserIds:
        """The ids of ``rows`` as a sequence that makes each string when it is read."""
        return UserIds(self, rows)


class UserIds(Sequence[str]):
    """The ids of some rows, read one at a time (``ids[i]``: the id of ``rows[i]``) without a
    string per user made in advance; iterating makes them all."""

    __slots__ = ("_ids", "_rows")

    def __init__(self, ids: FrozenIds, rows: npt.NDArray[np.int64]) -> None:
        self._ids = ids
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return self._ids.users(self._rows[i].tolist())
        return self._ids[self._rows.item(i)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids.users(self._rows.tolist()))


class UserRows:
    """User id → row and row → user id (module docstring). ``hot_max``: size of the recent-users
    dict; ``compact_above``: bytes of removed ids kept before the buffer is compacted (once they are
    also half of it)."""

    def __init__(self, *, hot_max: int = HOT_MAX, compact_above: int = COMPACT_ABOVE) -> None:
        self.hot: dict[str, int] = {}
        """Users looked up or added lately → row (each also in the table); read it first."""
        self.hot_max = max(hot_max, 1)
        self.compact_above = compact_above
        self._table = array("i", [_EMPTY]) * 16  # slot → row, _EMPTY or _GONE
        self._mask = 15
        self._filled = 0  # slots not _EMPTY
        self._count = 0
        self._hash = array("q")  # row → hash of its user
        self._start = array("q")  # row → offset of its user's bytes in _buf
        self._size = array("i")  # row → length of those bytes (-1: no user)
        self._buf = bytearray()
        self._garbage = 0  # bytes of _buf no row reads any more
        self._shared = False  # a FrozenIds reads _start/_size: copy them before changing a row

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held, the ``hot`` dict and its strings aside."""
        arrays = (self._table, self._hash, self._start, self._size)
        return sum(a.buffer_info()[1] * a.itemsize for a in arrays) + len(self._buf)

    def get(self, user: str) -> int | None:
        """The user's row, or None. O(1): a dict lookup for a recent user."""
        row = self.hot.get(user)
        if row is not None:
            return row
        return self.find(user)

    def find(self, user: str) -> int | None:
        """:meth:`get` through the table (then kept in ``hot``)."""
        slot = self._slot(user, hash(user))
        if slot < 0:
            return None
        row = self._table[slot]
        hot = self.hot
        if len(hot) >= self.hot_max:
            hot.clear()
        hot[user] = row
        return row

    def _slot(self, user: str, h: int) -> int:
        """The table slot holding ``user`` (whose hash is ``h``), or -1 if it is not held."""
        table, hashes, mask = self._table, self._hash, self._mask
        slot = h & mask
        while True:
            row = table[slot]
            if row == _EMPTY:
                return -1
            if row >= 0 and hashes[row] == h and self._holds(row, user):
                return slot
            slot = (slot + 1) & mask

    def _holds(self, row: int, user: str) -> bool:
        s = self._start[row]
        return self._buf[s : s + self._size[row]] == user.encode("utf-8", "surrogatepass")

    def user(self, row: int) -> str:
        """The user of ``row`` (a row :meth:`add` gave and :meth:`remove` did not take back)."""
        s = self._start[row]
        return self._buf[s : s + self._size[row]].decode("utf-8", "surrogatepass")

    def users(self) -> list[str]:
        """Every user held, in row order."""
        table = np.frombuffer(self._table, np.int32)
        rows = np.sort(table[table >= 0]).tolist()
        del table  # releases the buffer export (the table may be resized later)
        return FrozenIds(self._buf, self._start, self._size).users(rows)

    def add(self, user: str, row: int) -> None:
        """Map ``user`` (not held) to ``row`` (≤ the highest row so far + 1, not in use)."""
        data = user.encode("utf-8", "surrogatepass")
        h = hash(user)
        if row < len(self._size):
            if self._shared:
                self._start, self._size = array("q", self._start), array("i", self._size)
                self._shared = False
            self._start[row] = len(self._buf)
            self._size[row] = len(data)
            self._hash[row] = h
        else:
            for _ in range(len(self._size), row):  # rows skipped by the caller hold no user
                self._start.append(0)
                self._size.append(0)
                self._hash.append(0)
            self._start.append(len(self._buf))
            self._size.append(len(data))
            self._hash.append(h)
        self._buf += data
        if 2 * (self._filled + 1) > len(self._table):
            self._rebuild(2 * len(self._table) if 4 * (self._count + 1) > len(self._table) else len(self._table))
        table, mask = self._table, self._mask
        slot = h & mask
        while table[slot] >= 0:
            slot = (slot + 1) & mask
        if table[slot] == _EMPTY:
            self._filled += 1
        table[slot] = row
        self._count += 1
        hot = self.hot
        if len(hot) >= self.hot_max:
            hot.clear()
        hot[user] = row

    def remove(self, user: str) -> int | None:
        """Forget ``user``; returns its row (None if not held)."""
        slot = self._slot(user, hash(user))
        if slot < 0:
            return None
        row = self._table[slot]
        self._table[slot] = _GONE
        self._count -= 1
        self.hot.pop(user, None)
        self._garbage += self._size[row]
        if self._garbage > self.compact_above and 2 * self._garbage >= len(self._buf):
            self._compact()
        return row

    def frozen(self) -> FrozenIds:
        """Row → user as now, unaffected by later changes (rows handed back by :meth:`remove` keep
        their last user)."""
        self._shared = True
        return FrozenIds(self._buf, self._start, self._size)

    def _live_rows(self) -> np.ndarray[tuple[int], np.dtype[np.int32]]:
        table = np.frombuffer(self._table, np.int32)
        rows = table[table >= 0]  # a copy: the export of the table ends with `table`
        return rows

    def _rebuild(self, slots: int) -> None:
        """A table of ``slots`` slots (a power of two) holding every user, with no removed entries."""
        rows = self._live_rows()
        hashes = np.frombuffer(self._hash, np.int64)[rows]
        table = np.full(slots, _EMPTY, np.int32)
        mask = slots - 1
        slot = hashes & mask
        pending = np.arange(len(rows))
        while len(pending):  # place the first claimant of each free slot; the others probe on
            want = slot[pending]
            free = np.flatnonzero(table[want] == _EMPTY)
            taken, first = np.unique(want[free], return_index=True)
            table[taken] = rows[pending[free[first]]]
            placed = np.zeros(len(pending), bool)
            placed[free[first]] = True
            pending = pending[~placed]
            slot[pending] = (slot[pending] + 1) & mask
        out = array("i")
        out.frombytes(table.tobytes())
        self._table, self._mask, self._filled = out, mask, len(rows)

    def _compact(self) -> None:
        """Copy the bytes still read into a new buffer (frozen copies keep the old one)."""
        rows = np.sort(self._live_rows()).tolist()
        old, start, size = bytes(self._buf), self._start, self._size
        buf = bytearray()
        new_start = array("q", bytes(8 * len(start)))
        new_size = array("i", bytes(4 * len(size)))
        for r in rows:
            s, n = start[r], size[r]
            new_start[r] = len(buf)
            new_size[r] = n
            buf += old[s : s + n]
        self._buf, self._start, self._size = buf, new_start, new_size
        self._garbage = 0
        self._shared = False


__all__ = ["COMPACT_ABOVE", "HOT_MAX", "FrozenIds", "UserIds", "UserRows"]
