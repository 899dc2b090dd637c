"""The trajectory model (CONCEPTS §7.1): one object's fixes, strictly increasing in time.

Between samples an object moves on the straight segment at constant speed, so :meth:`Trajectory.at`
interpolates linearly (in latitude/longitude, which at sampling distances is the segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kcloak.core.readers import FixTable

F64 = npt.NDArray[np.float64]

MIN_INSTANTS = 2
"""Trajectories with fewer distinct instants are excluded before anonymization (``n_too_short``)."""


@dataclass(frozen=True, slots=True, eq=False)
class Trajectory:
    """One trajectory ``τ = ⟨(lat_i, lon_i, t_i)⟩`` with strictly increasing ``t`` (CONCEPTS §7.1).

    Build it with :meth:`of`, which sorts by ``t`` and keeps the first fix of a repeated instant.
    """

    traj_id: str
    t: F64
    lat: F64
    lon: F64

    @classmethod
    def of(cls, traj_id: str, t: npt.ArrayLike, lat: npt.ArrayLike, lon: npt.ArrayLike) -> Trajectory:
        """Sort by time (stable) and drop repeated instants, keeping the first occurrence."""
        ta = np.asarray(t, dtype=np.float64)
        order = np.argsort(ta, kind="stable")
        ts = ta[order]
        keep = np.ones(len(ts), bool)
        keep[1:] = ts[1:] != ts[:-1]
        idx = order[keep]
        return cls(traj_id, ts[keep], np.asarray(lat, dtype=np.float64)[idx], np.asarray(lon, dtype=np.float64)[idx])

    def __len__(self) -> int:
        return len(self.t)

    @property
    def t_start(self) -> float:
        return float(self.t[0])

    @property
    def t_end(self) -> float:
        return float(self.t[-1])

    @property
    def too_short(self) -> bool:
        """Fewer than 2 distinct instants: no time span, excluded before anonymization (§7.1)."""
        return len(self.t) < MIN_INSTANTS

    def at(self, times: npt.ArrayLike) -> tuple[F64, F64]:
        """``(lat, lon)`` at ``times`` by linear interpolation; clamped to the end points outside the span."""
        tt = np.asarray(times, dtype=np.float64)
        return np.interp(tt, self.t, self.lat), np.interp(tt, self.t, self.lon)


def trajectories_from_fixes(table: FixTable) -> list[Trajectory]:
    """Every trajectory of ``table`` (too short ones included), ordered by id; one sort for all (§7.1)."""
    n = len(table)
    if n == 0:
        return []
    order = np.lexsort((np.arange(n), table.t, table.traj_id))
    ids = table.traj_id[order]
    t, lat, lon = table.t[order], table.lat[order], table.lon[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], n]
    out: list[Trajectory] = []
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        ts = t[a:b]
        keep = np.ones(b - a, bool)
        keep[1:] = ts[1:] != ts[:-1]  # readers already drop repeats; this keeps the model's invariant
        out.append(Trajectory(str(ids[a]), ts[keep], lat[a:b][keep], lon[a:b][keep]))
    return out


def split_too_short(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """The trajectories with ≥ 2 distinct instants and the number left out (``n_too_short``, contract §7)."""
    kept = [tr for tr in trajectories if not tr.too_short]
    return kept, len(trajectories) - len(kept)


def fixes_of(trajectories: Sequence[Trajectory]) -> FixTable:
    """The fixes of ``trajectories`` as one table, trajectory after trajectory (inverse of the grouping)."""
    if not trajectories:
        e = np.empty(0, np.float64)
        return FixTable(np.empty(0, np.str_), e, e.copy(), e.copy())
    ids = np.repeat(np.array([tr.traj_id for tr in trajectories], dtype=np.str_), [len(tr) for tr in trajectories])
    return FixTable(
        ids,
        np.concatenate([tr.t for tr in trajectories]),
        np.concatenate([tr.lat for tr in trajectories]),
        np.concatenate([tr.lon for tr in trajectories]),
    )


__all__ = ["MIN_INSTANTS", "Trajectory", "fixes_of", "split_too_short", "trajectories_from_fixes"]
