"""(k,δ)-anonymous trajectory publication algorithms (CONCEPTS §7.2–§7.5).

Each algorithm takes :class:`~kcloak.streams.trajectory.Trajectory` objects with ≥ 2 instants and returns a
:class:`KDeltaResult`: the anonymized trajectories (still under their input ids; :mod:`kcloak.streams.publish`
gives them fresh ids and shuffles them), the resampled originals they replace, the groups and the trash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import InputError
from kcloak.core.geometry import EARTH_RADIUS_M
from kcloak.streams.errors import StreamsError
from kcloak.streams.trajectory import Trajectory

F64 = npt.NDArray[np.float64]


class KDeltaError(StreamsError, InputError, ValueError):
    """Invalid parameters of a (k,δ) algorithm (``k < 2``, ``delta < 0``, ``trash_max`` outside [0, 1], …)."""


@dataclass(frozen=True, slots=True, eq=False)
class KDeltaResult:
    """Outcome of a (k,δ) algorithm (CONCEPTS §7.3, §7.8).

    ``published[i]`` replaces ``originals[i]`` (the input resampled at the published instants, same id;
    for W4M, the input at each point's source instant, so ``|t_out − t_in|`` is the time shift);
    ``groups`` are index tuples into ``published``; ``trash`` holds the ids never published;
    ``trash_limit`` is ``floor(trash_max · n_in)``. When :attr:`ok` is false nothing may be published.
    """

    published: tuple[Trajectory, ...]
    originals: tuple[Trajectory, ...]
    groups: tuple[tuple[int, ...], ...]
    trash: tuple[str, ...]
    n_in: int
    trash_limit: int
    trash_reasons: tuple[tuple[TrashReason, int], ...] = ()
    small_classes: tuple[SmallClass, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether the trash stays within ``trash_max`` (contract §7); otherwise the release fails."""
        return len(self.trash) <= self.trash_limit

    def trash_by_reason(self) -> dict[str, int]:
        """Trashed trajectories per :class:`TrashReason` (only the reasons that occurred)."""
        return {str(r): n for r, n in self.trash_reasons if n}


class TrashReason(StrEnum):
    """Why a trajectory went to the trash (report ``trash_reasons``; CONCEPTS §7.3, §7.4)."""

    SPAN_SHORTER_THAN_PI = "span_shorter_than_pi"
    """NWA: the span trimmed to multiples of π is empty."""
    CLASS_SMALLER_THAN_K = "class_smaller_than_k"
    """NWA: fewer than k trajectories share its trimmed time span (W4M: its time-connected group)."""
    BEYOND_RADIUS = "beyond_radius"
    """No k−1 others within the clustering radius (and no cluster to join)."""
    NO_MATCH_WITHIN_BOUNDS = "no_match_within_bounds"
    """W4M: no k−1 others it can be aligned with within the time-shift bound and the radius."""


@dataclass(frozen=True, slots=True)
class SmallClass:
    """A group of trajectories too small to publish: its time span (Unix s) and its size (< k)."""

    t_start: float
    t_end: float
    n: int


def check_params(k: int, delta_m: float, trash_max: float) -> None:
    """Reject parameters no (k,δ) algorithm accepts."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise KDeltaError("k: must be an integer ≥ 2")
    if not math.isfinite(delta_m) or delta_m < 0:
        raise KDeltaError("delta: must be a finite number ≥ 0 (metres)")
    if not 0.0 <= trash_max <= 1.0:
        raise KDeltaError("trash_max: must be within [0, 1]")


def trash_limit(n_in: int, trash_max: float) -> int:
    """Largest allowed trash: ``floor(trash_max · n_in)`` (with a hair of slack for float products)."""
    return math.floor(trash_max * n_in + 1e-9)


def to_unit(lat: npt.ArrayLike, lon: npt.ArrayLike) -> F64:
    """Unit vectors (…, 3) of positions on the contract sphere."""
    p = np.radians(np.asarray(lat, dtype=np.float64))
    lam = np.radians(np.asarray(lon, dtype=np.float64))
    cp = np.cos(p)
    return np.stack([cp * np.cos(lam), cp * np.sin(lam), np.sin(p)], axis=-1)


def from_unit(v: F64) -> tuple[F64, F64]:
    """``(lat, lon)`` degrees of (not necessarily normalized) vectors (…, 3)."""
    lat = np.degrees(np.arctan2(v[..., 2], np.hypot(v[..., 0], v[..., 1])))
    lon = np.degrees(np.arctan2(v[..., 1], v[..., 0]))
    return lat, lon


def angle_between(u: F64, v: F64) -> F64:
    """Great-circle angle (radians) between unit vectors, accurate at small angles (atan2 form)."""
    out: F64 = np.arctan2(np.linalg.norm(np.cross(u, v), axis=-1), np.sum(u * v, axis=-1))
    return out


def arc_m(u: F64, v: F64) -> F64:
    """Great-circle distance in metres between unit vectors on the contract sphere."""
    return EARTH_RADIUS_M * angle_between(u, v)


__all__ = [
    "KDeltaError",
    "KDeltaResult",
    "SmallClass",
    "TrashReason",
    "angle_between",
    "arc_m",
    "check_params",
    "from_unit",
    "to_unit",
    "trash_limit",
]
