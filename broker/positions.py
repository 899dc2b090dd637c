"""The broker's live positions: what fix intake writes and cloaking reads (CONCEPTS §2.4).

:class:`Positions` holds the position index, the recent-fix history temporal cloaking reads, and
a version that counts the batches applied, so that a query can wait for a view at least as new as
its user's last fix. Intake writes through :meth:`Positions.apply`; cloaking only needs the read
interface :class:`PositionReader`, so either runs without the other (a cluster runs them in
different processes).
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import itemgetter
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kcloak.broker.history import RecentFixes
from kcloak.cloaking.index import IndexView, PositionIndex


class PositionReader(Protocol):
    """What cloaking reads of the positions: present fixes, immutable views, recent history."""

    @property
    def version(self) -> int:
        """Batches of fixes applied so far."""
        ...

    @property
    def history(self) -> RecentFixes | None:
        """Recent accepted fixes (kept only when the cloaker is temporal)."""
        ...

    def user_version(self, user: str) -> int:
        """The version that holds the user's latest applied fix."""
        ...

    def fix(self, user: str) -> tuple[float, float, float] | None:
        """The user's latest fix ``(lat, lon, t)``, or None."""
        ...

    def is_present(self, user: str, now: float) -> bool: ...

    def present_count(self, now: float) -> int:
        """Users present at ``now``, without making a view."""
        ...

    def snapshot(self, now: float, *, epoch: int = 0, seed: int = 0) -> IndexView: ...


BATCH_UPDATE_ROWS = 16
"""Batches of at least this many fixes are written into the index column by column."""


class Positions:
    """The position index with its history and version (implements :class:`PositionReader`).

    Keyword arguments: ``index`` (the :class:`PositionIndex`), ``history`` (the recent fixes
    temporal cloaking reads; None, the default, keeps none).
    """

    def __init__(self, *, index: PositionIndex, history: RecentFixes | None = None) -> None:
        self.index = index
        self._history = history
        self._version = 0
        # The version of each index row's latest applied fix (0: none since the last restore), an
        # array rather than a dict of user → version (which cost ~40 B a user at a million users).
        self._row_version: npt.NDArray[np.int64] = np.zeros(1024, np.int64)

    @property
    def version(self) -> int:
        return self._version

    @property
    def history(self) -> RecentFixes | None:
        return self._history

    def __len__(self) -> int:
        return len(self.index)

    def apply(self, fixes: Iterable[tuple[str, float, float, float]]) -> None:
        """Apply one batch of accepted fixes ``(user, t, lat, lon)``, in order, as one new version."""
        self._version += 1
        version = self._version
        index, history = self.index, self._history
        rows = fixes if isinstance(fixes, list) else list(fixes)
        if len(rows) >= BATCH_UPDATE_ROWS:  # one array assignment per column, not four per fix
            # Column by column: zip(*rows) would make an iterator object per row (and the cyclic
            # garbage collector would run more often, traversing them; a tenth of the loop's time).
            users = list(map(itemgetter(0), rows))
            ts, lats, lons = (list(map(itemgetter(k), rows)) for k in (1, 2, 3))
            written = index.update_batch(users, lats, lons, ts)
            self._versions_for(int(written.max()))[written] = version
        elif rows:
            written_rows = [index.update(user, lat, lon, t) for user, t, lat, lon in rows]
            self._versions_for(max(written_rows))[written_rows] = version
        if history is not None:
            for user, t, lat, lon in rows:
                history.append(user, t, lat, lon)

    def _versions_for(self, row: int) -> npt.NDArray[np.int64]:
        """The row → version array, grown (doubling) to hold ``row``."""
        if row >= len(self._row_version):
            grown = np.zeros(max(2 * len(self._row_version), row + 1), np.int64)
            grown[: len(self._row_version)] = self._row_version
            self._row_version = grown
        return self._row_version

    def restore(
        self, latest: Iterable[tuple[str, float, float, float]], recent: Iterable[tuple[str, float, float, float]]
    ) -> None:
        """Reload after a restart: each user's ``latest`` fix into the index, ``recent`` fixes into the history."""
        for user, t, lat, lon in latest:
            self.index.update(user, lat, lon, t)
        if self._history is not None:
            for user, t, lat, lon in recent:
                self._history.append(user, t, lat, lon)
        self._version += 1

    def user_version(self, user: str) -> int:
        row = self.index.row_of(user)
        version = 0 if row is None or row >= len(self._row_version) else int(self._row_version[row])
        return version or self._version

    def fix(self, user: str) -> tuple[float, float, float] | None:
        return self.index.fix(user)

    def latest_t(self, user: str) -> float | None:
        """``t`` of the user's latest applied fix, or None."""
        return self.index.latest_t(user)

    def is_present(self, user: str, now: float) -> bool:
        return self.index.is_present(user, now)

    def present_count(self, now: float) -> int:
        return self.index.present_count(now)

    def snapshot(self, now: float, *, epoch: int = 0, seed: int = 0) -> IndexView:
        return self.index.snapshot(now, epoch=epoch, seed=seed)


__all__ = ["PositionReader", "Positions"]
