"""Gruteser–Grunwald temporal cloaking, the pure part: no I/O and no clock (CONCEPTS §5.1, §9.2).

Instead of enlarging the region, the query is held until enough distinct users have visited a
fixed one. Two decisions live here, both deterministic functions of their inputs:

1. :func:`temporal_cell`: the region, the largest quadtree cell containing the querier whose
   published bbox has area ≤ ``max_area_m2`` (and ≥ ``min_area_m2``), on the same micro-degree
   grid as ``interval`` and ``casper``;
2. :func:`temporal_window`: ``t_start`` aligned to a fixed time grid within the look-back, and the
   earliest whole second ``t_end`` at which ``k`` distinct users had a fix strictly inside the
   region during ``[t_start, t_end]`` (``None`` while fewer have).

The broker supplies the movement store through the small :class:`FixHistory` protocol, holds the
query until its clock reaches ``t_end`` and refuses it ``expired`` after ``max_delay_s`` (§5.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.cloakers.base import CloakMode, Refusal, Region, refuse
from kcloak.cloaking.cloakers.interval import WORLD_ROOT, Root, cell_bbox, grid_coord, levels_of
from kcloak.cloaking.grid import GRID_BITS
from kcloak.core.geometry import BBox, coordinate_key, coordinate_keys
from kcloak.core.profile import PrivacyProfile, ReasonCode

F64 = npt.NDArray[np.float64]

ALGORITHM = "temporal"
DEFAULT_LOOKBACK_S = 300.0
"""Contract ``cloaking.temporal_lookback_s``: how far before the fix ``t_start`` may reach."""
DEFAULT_WINDOW_S = 60.0
"""Length of the time grid that ``t_start`` is aligned to [design, §5.1]."""


@dataclass(frozen=True, slots=True, eq=False)
class Fixes:
    """Columns of accepted fixes: user id, time (Unix s), latitude, longitude."""

    user: npt.NDArray[Any]
    t: F64
    lat: F64
    lon: F64

    def __len__(self) -> int:
        return len(self.t)

    @classmethod
    def of(cls, user: npt.ArrayLike, t: npt.ArrayLike, lat: npt.ArrayLike, lon: npt.ArrayLike) -> Fixes:
        fixes = cls(
            np.asarray(user), np.asarray(t, np.float64), np.asarray(lat, np.float64), np.asarray(lon, np.float64)
        )
        if not len(fixes.user) == len(fixes.t) == len(fixes.lat) == len(fixes.lon):
            raise ValueError("fixes: every column must have one entry per fix")
        return fixes


@runtime_checkable
class FixHistory(Protocol):
    """Read access to the movement store (the broker's store implements it)."""

    def fixes_in(self, bbox: BBox, t_from: float, t_to: float) -> Fixes:
        """Fixes with ``t_from ≤ t ≤ t_to`` inside ``bbox``.

        May return a superset (e.g. an inclusive float filter in SQL): callers re-select the fixes
        strictly inside with exact keys and re-check the time range.
        """
        ...


class ArrayFixHistory:
    """A :class:`FixHistory` over in-memory arrays (tests, replays, audits); exact strict filtering."""

    def __init__(self, user: npt.ArrayLike, t: npt.ArrayLike, lat: npt.ArrayLike, lon: npt.ArrayLike) -> None:
        fixes = Fixes.of(user, t, lat, lon)
        order = np.argsort(fixes.t, kind="stable")
        self._fixes = Fixes(fixes.user[order], fixes.t[order], fixes.lat[order], fixes.lon[order])
        self._lat_key = coordinate_keys(self._fixes.lat)
        self._lon_key = coordinate_keys(self._fixes.lon)

    def __len__(self) -> int:
        return len(self._fixes)

    def fixes_in(self, bbox: BBox, t_from: float, t_to: float) -> Fixes:
        f = self._fixes
        i = int(np.searchsorted(f.t, t_from, "left"))
        j = int(np.searchsorted(f.t, t_to, "right"))
        sel = i + np.flatnonzero(bbox.contains_keys(self._lon_key[i:j], self._lat_key[i:j]))
        return Fixes(f.user[sel], f.t[sel], f.lat[sel], f.lon[sel])


@dataclass(frozen=True, slots=True)
class TemporalCell:
    """The spatial extent of a temporally cloaked query: a quadtree cell and its published bbox."""

    level: int
    cx: int
    cy: int
    bbox: BBox
    area_m2: float


@dataclass(frozen=True, slots=True)
class TemporalWindow:
    """``[t_start, t_end]`` of a temporally cloaked query (whole seconds, rounded outward).

    ``t_end`` is None while fewer than ``k`` distinct users had a fix inside; ``k_achieved`` is the
    number of distinct users with a fix strictly inside during ``[t_start, t_end]`` (so far, when
    pending).
    """

    t_start: int
    t_end: int | None
    k_achieved: int

    @property
    def ready(self) -> bool:
        return self.t_end is not None


def temporal_cell(
    lat: float,
    lon: float,
    *,
    max_area_m2: float,
    min_area_m2: float = 0.0,
    root: Root = WORLD_ROOT,
    depth_max: int | None = None,
) -> TemporalCell | Refusal:
    """The largest quadtree cell holding ``(lat, lon)`` whose published bbox fits the area bounds (§5.1).

    The largest cell minimises the delay [design]. Published bboxes shrink along the root path, so
    a binary search finds the shallowest level within ``max_area_m2``; if that cell is below
    ``min_area_m2``, no cell fits (deeper ones are smaller still) and the request is refused
    ``area_exceeded``, as it is when the querier lies outside ``root``.
    """
    root_level, deepest = levels_of(root, depth_max)
    gx = grid_coord(coordinate_key(lon), "lon")
    gy = grid_coord(coordinate_key(lat), "lat")
    s0 = GRID_BITS - root_level
    if gx >> s0 != root[1] or gy >> s0 != root[2]:
        return refuse(ReasonCode.AREA_EXCEEDED, "the querier lies outside the quadtree's root cell")

    def published(level: int) -> BBox:
        s = GRID_BITS - level
        return cell_bbox(level, gx >> s, gy >> s, gx >> s, gy >> s)

    lo, hi = root_level, deepest
    if published(hi).area_m2 > max_area_m2:
        return refuse(ReasonCode.AREA_EXCEEDED, "no quadtree cell is small enough for max_area_m2")
    while lo < hi:
        mid = (lo + hi) >> 1
        if published(mid).area_m2 <= max_area_m2:
            hi = mid
        else:
            lo = mid + 1
    bbox = published(lo)
    area = bbox.area_m2
    if area < min_area_m2:
        return refuse(ReasonCode.AREA_EXCEEDED, "no quadtree cell has an area within the profile bounds")
    s = GRID_BITS - lo
    return TemporalCell(lo, gx >> s, gy >> s, bbox, area)


def aligned_start(t_fix: float, *, lookback_s: float = DEFAULT_LOOKBACK_S, window_s: float = DEFAULT_WINDOW_S) -> int:
    """``t_start``: the start of the fix's window on the fixed time grid, but not before the look-back (§5.1).

    ``max(floor(t_fix / window) · window, ceil(t_fix − lookback))``, an integer ≤ ``t_fix``. Every
    query whose fix falls in the same window shares it (with ``lookback_s ≥ window_s``), so the
    forwarded interval does not reveal the request time. Only when ``lookback_s < 1`` and
    ``t_fix`` is fractional can no integer satisfy both bounds; ``floor(t_fix)`` is returned then.
    """
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError("window_s: must be positive")
    if not (lookback_s >= 0 and math.isfinite(lookback_s)):
        raise ValueError("lookback_s: must be non-negative")
    q = math.floor(t_fix / window_s)
    while q * window_s > t_fix:  # guard the division's rounding
        q -= 1
    while (q + 1) * window_s <= t_fix:
        q += 1
    t_start = max(math.floor(q * window_s), math.ceil(t_fix - lookback_s))
    return t_start if t_start <= t_fix else math.floor(t_fix)


def temporal_window(
    history: FixHistory,
    bbox: BBox,
    t_fix: float,
    k: int,
    *,
    lookback_s: float = DEFAULT_LOOKBACK_S,
    window_s: float = DEFAULT_WINDOW_S,
    until: float = math.inf,
) -> TemporalWindow:
    """The forwarded interval for region ``bbox``: aligned ``t_start`` and the earliest ``t_end`` (§5.1, §9.2).

    Considers the fixes with ``t_start ≤ t ≤ until`` strictly inside ``bbox`` (exact keys,
    ``BBox.contains_keys``: on the edge counts only at the world edge, contract §0). With
    ``v_i`` the first such fix time of each distinct user and ``v_(k)`` the k-th smallest,
    ``t_end = max(ceil(t_fix), ceil(v_(k)))``: the smallest integer ≥ ``t_fix`` for which ``k``
    distinct users had a fix inside during ``[t_start, t_end]``. The broker forwards once its
    clock reaches ``t_end``; calling again then with ``until ≥ t_end`` gives the final
    ``k_achieved`` (fixes up to ``t_end`` that arrived meanwhile count too).
    """
    if k < 1:
        raise ValueError("k: must be at least 1")
    t_start = aligned_start(t_fix, lookback_s=lookback_s, window_s=window_s)
    fixes = history.fixes_in(bbox, t_start, until)
    first = first_visits(fixes, bbox, t_start, until)
    if len(first) < k:
        return TemporalWindow(t_start, None, len(first))
    v_k = float(np.partition(first, k - 1)[k - 1])
    t_end = max(math.ceil(t_fix), math.ceil(v_k))
    return TemporalWindow(t_start, t_end, int(np.count_nonzero(first <= t_end)))


def first_visits(fixes: Fixes, bbox: BBox, t_from: float, t_to: float) -> F64:
    """Earliest fix time of each distinct user with a fix strictly inside ``bbox`` during ``[t_from, t_to]``."""
    if len(fixes) == 0:
        return np.empty(0)
    inside = bbox.contains_keys(coordinate_keys(fixes.lon), coordinate_keys(fixes.lat))
    inside &= (fixes.t >= t_from) & (fixes.t <= t_to)
    users = fixes.user[inside]
    t = fixes.t[inside]
    if len(t) == 0:
        return np.empty(0)
    _, inverse = np.unique(users, return_inverse=True)
    first = np.full(int(inverse.max()) + 1, np.inf)
    np.minimum.at(first, inverse, t)
    return first


def temporal_cloak(
    history: FixHistory,
    lat: float,
    lon: float,
    t_fix: float,
    profile: PrivacyProfile,
    *,
    lookback_s: float = DEFAULT_LOOKBACK_S,
    window_s: float = DEFAULT_WINDOW_S,
    until: float = math.inf,
    root: Root = WORLD_ROOT,
    depth_max: int | None = None,
) -> Region | Refusal | None:
    """Cell choice and interval together: a forwardable :class:`Region` with ``t_start``/``t_end``,
    a refusal (``unsupported`` for l > 1, ``area_exceeded`` when no cell fits), or None while the
    query must still be held. Expiry after ``max_delay_s`` is the caller's (it owns the clock).
    """
    if profile.l > 1:
        return refuse(ReasonCode.UNSUPPORTED, "temporal: l > 1 is not supported (no place diversity)")
    cell = temporal_cell(
        lat, lon, max_area_m2=profile.max_area_m2, min_area_m2=profile.min_area_m2, root=root, depth_max=depth_max
    )
    if isinstance(cell, Refusal):
        return cell
    window = temporal_window(
        history, cell.bbox, t_fix, profile.k, lookback_s=lookback_s, window_s=window_s, until=until
    )
    if window.t_end is None:
        return None
    return Region(
        bbox=cell.bbox,
        k_achieved=window.k_achieved,
        area_m2=cell.area_m2,
        algorithm=ALGORITHM,
        t_start=window.t_start,
        t_end=window.t_end,
    )


class TemporalCloak:
    """Temporal cloaking as a held cloaker declares it (``cloak_mode`` :attr:`CloakMode.TEMPORAL`): the
    region is chosen once, from the fix (:meth:`cell`), and the interval as fixes arrive
    (:meth:`window`); the caller holds the query and owns the clock (§5.1, §5.2).

    Keyword argument: ``lookback_s``, how far before the fix ``t_start`` may reach (default 300).
    """

    name: ClassVar[str] = ALGORITHM
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.TEMPORAL

    def __init__(self, *, lookback_s: float = DEFAULT_LOOKBACK_S) -> None:
        self.lookback_s = lookback_s

    def cell(self, lat: float, lon: float, profile: PrivacyProfile) -> TemporalCell | Refusal:
        """:func:`temporal_cell` under the profile's area bounds."""
        return temporal_cell(lat, lon, max_area_m2=profile.max_area_m2, min_area_m2=profile.min_area_m2)

    def window(self, history: FixHistory, bbox: BBox, t_fix: float, k: int, *, until: float) -> TemporalWindow:
        """:func:`temporal_window` with this cloaker's look-back."""
        return temporal_window(history, bbox, t_fix, k, lookback_s=self.lookback_s, until=until)


__all__ = [
    "ALGORITHM",
    "DEFAULT_LOOKBACK_S",
    "DEFAULT_WINDOW_S",
    "ArrayFixHistory",
    "FixHistory",
    "Fixes",
    "TemporalCell",
    "TemporalCloak",
    "TemporalWindow",
    "aligned_start",
    "first_visits",
    "temporal_cell",
    "temporal_cloak",
    "temporal_window",
]
