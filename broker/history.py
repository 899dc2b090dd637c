"""Recent accepted fixes in memory: the movement history temporal cloaking reads (CONCEPTS §5.1).

Every accepted fix is appended (it is also in the durable movement store, from which the
history is reloaded at start-up); fixes older than ``keep_s`` are dropped. ``fixes_in`` returns
the fixes of a time range inside a bbox's float envelope — a superset that
:func:`kcloak.cloaking.temporal.temporal_window` narrows with exact keys.
"""

from __future__ import annotations

import numpy as np

from kcloak.cloaking.temporal import Fixes
from kcloak.core.geometry import UDEG_PER_DEG, BBox


class RecentFixes:
    """Implements :class:`kcloak.cloaking.temporal.FixHistory` over the last ``keep_s`` seconds."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._users: list[str] = []
        self._t: list[float] = []
        self._lat: list[float] = []
        self._lon: list[float] = []
        self._frozen: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._t)

    def append(self, user: str, t: float, lat: float, lon: float) -> None:
        self._users.append(user)
        self._t.append(t)
        self._lat.append(lat)
        self._lon.append(lon)
        self._frozen = None

    def prune(self, now: float) -> None:
        """Forget fixes older than ``now − keep_s`` (fixes arrive roughly in time order)."""
        cutoff = now - self.keep_s
        t = self._t
        i = 0
        while i < len(t) and t[i] < cutoff:
            i += 1
        if i:
            del self._users[:i], self._t[:i], self._lat[:i], self._lon[:i]
            self._frozen = None

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._frozen is None:
            self._frozen = (
                np.asarray(self._users, dtype=object),
                np.asarray(self._t, dtype=np.float64),
                np.asarray(self._lat, dtype=np.float64),
                np.asarray(self._lon, dtype=np.float64),
            )
        return self._frozen

    def fixes_in(self, bbox: BBox, t_from: float, t_to: float) -> Fixes:
        users, t, lat, lon = self._arrays()
        pad = 1.0 / UDEG_PER_DEG
        lon0, lat0, lon1, lat1 = bbox.to_geojson()
        sel = (
            (t >= t_from)
            & (t <= t_to)
            & (lat >= lat0 - pad)
            & (lat <= lat1 + pad)
            & (lon >= lon0 - pad)
            & (lon <= lon1 + pad)
        )
        return Fixes.of(users[sel], t[sel], lat[sel], lon[sel])
