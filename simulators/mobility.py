"""Vectorized mobility models: random waypoint and POI hotspots (issue 5; CONCEPTS §9.0 fixtures).

Every model moves all its users at once with numpy (one ``step(dt_s)`` is a handful of array
operations over every user, plus small passes over the users that reached a waypoint), is seeded,
and reports positions as ``(lat, lon)`` arrays. Street movement is in :mod:`kcloak.simulators.streets`.

Local frame. The waypoint models move users in an equirectangular frame anchored at the south-west
corner of their bbox: ``y = (lat - min_lat)·R·π/180``, ``x = (lon - min_lon)·R·π/180·cos φ*`` with
``φ*`` the latitude of the bbox closest to the equator (``R`` = contract sphere, §0). Because
``cos φ ≤ cos φ*`` everywhere in the box, a frame distance is never shorter than the great-circle
distance it represents: a user never moves faster than its speed under the contract haversine
(it moves up to ``1 - cos φ_far / cos φ*`` slower, 0.3 % across a 40 km Beijing box). The bbox is
a rectangle in the frame, so users stay inside it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kcloak.core.geometry import EARTH_RADIUS_M, BBox

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

M_PER_DEG_LAT = EARTH_RADIUS_M * math.pi / 180.0
"""Metres per degree along a meridian on the contract sphere."""


@runtime_checkable
class MobilityModel(Protocol):
    """A population of simulated users moved all at once; seeded, so a run is reproducible."""

    @property
    def users(self) -> int:
        """Number of simulated users (rows of :meth:`positions`)."""
        ...

    def positions(self) -> tuple[FloatArray, FloatArray]:
        """Current ``(lat, lon)`` of every user, in degrees (new arrays)."""
        ...

    def step(self, dt_s: float) -> None:
        """Advance every user by ``dt_s`` seconds of simulated time."""
        ...


class HasLatLon(Protocol):
    """Anything with ``lat``/``lon`` columns, such as :class:`kcloak.core.places.PoiSet`."""

    @property
    def lat(self) -> FloatArray: ...

    @property
    def lon(self) -> FloatArray: ...


def bbox_degrees(bbox: BBox | Sequence[float]) -> tuple[float, float, float, float]:
    """``(min_lon, min_lat, max_lon, max_lat)`` in degrees from a :class:`BBox` or a GeoJSON-order sequence."""
    if isinstance(bbox, BBox):
        a, b, c, d = bbox.to_geojson()
    else:
        if len(bbox) != 4:
            raise ValueError("bbox: expected (min_lon, min_lat, max_lon, max_lat)")
        a, b, c, d = (float(v) for v in bbox)
    if not all(math.isfinite(v) for v in (a, b, c, d)):
        raise ValueError("bbox: coordinates must be finite")
    if not (-180.0 <= a < c <= 180.0 and -90.0 < b < d < 90.0):
        raise ValueError("bbox: need -180 <= min_lon < max_lon <= 180 and -90 < min_lat < max_lat < 90")
    return a, b, c, d


def _check_range(name: str, bounds: tuple[float, float], *, positive: bool) -> tuple[float, float]:
    lo, hi = float(bounds[0]), float(bounds[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi and (lo > 0.0 if positive else lo >= 0.0)):
        raise ValueError(f"{name}: need finite {'0 <' if positive else '0 <='} min <= max, got {bounds!r}")
    return lo, hi


class _WaypointFrame:
    """The equirectangular frame of the module docstring, over one bbox."""

    __slots__ = ("height_m", "kx", "lat_max", "lat_min", "lon_max", "lon_min", "width_m")

    def __init__(self, bbox: BBox | Sequence[float]) -> None:
        self.lon_min, self.lat_min, self.lon_max, self.lat_max = bbox_degrees(bbox)
        lat_star = 0.0 if self.lat_min <= 0.0 <= self.lat_max else min(abs(self.lat_min), abs(self.lat_max))
        self.kx = M_PER_DEG_LAT * math.cos(math.radians(lat_star))
        self.width_m = (self.lon_max - self.lon_min) * self.kx
        self.height_m = (self.lat_max - self.lat_min) * M_PER_DEG_LAT

    def to_frame(self, lat: FloatArray, lon: FloatArray) -> tuple[FloatArray, FloatArray]:
        x = np.clip((lon - self.lon_min) * self.kx, 0.0, self.width_m)
        y = np.clip((lat - self.lat_min) * M_PER_DEG_LAT, 0.0, self.height_m)
        return x, y

    def to_degrees(self, x: FloatArray, y: FloatArray) -> tuple[FloatArray, FloatArray]:
        lat = y * (1.0 / M_PER_DEG_LAT)
        lat += self.lat_min
        np.clip(lat, self.lat_min, self.lat_max, out=lat)
        lon = x * (1.0 / self.kx)
        lon += self.lon_min
        np.clip(lon, self.lon_min, self.lon_max, out=lon)
        return lat, lon


class _WaypointMotion:
    """Shared engine of the waypoint models: move straight to a target at a per-leg speed, pause, repeat.

    Subclasses supply :meth:`_draw_targets` (frame coordinates of new waypoints).
    """

    def __init__(
        self,
        n: int,
        bbox: BBox | Sequence[float],
        *,
        speed_mps: tuple[float, float],
        pause_s: tuple[float, float],
        seed: int | None,
    ) -> None:
        if n < 0:
            raise ValueError("users: must be >= 0")
        self._n = int(n)
        self._frame = _WaypointFrame(bbox)
        self.speed_mps = _check_range("speed_mps", speed_mps, positive=True)
        self.pause_s = _check_range("pause_s", pause_s, positive=False)
        self._rng = np.random.default_rng(seed)
        self._x, self._y = self._draw_targets(self._n)
        self._tx, self._ty = self._draw_targets(self._n)
        self._speed = self._draw_speeds(self._n)
        self._pause = np.zeros(self._n)

    # -- drawing -------------------------------------------------------------------------------
    def _draw_targets(self, m: int) -> tuple[FloatArray, FloatArray]:
        raise NotImplementedError

    def _draw_speeds(self, m: int) -> FloatArray:
        lo, hi = self.speed_mps
        return self._rng.uniform(lo, hi, m) if hi > lo else np.full(m, lo)

    def _draw_pauses(self, m: int) -> FloatArray:
        lo, hi = self.pause_s
        return self._rng.uniform(lo, hi, m) if hi > lo else np.full(m, lo)

    # -- public API ----------------------------------------------------------------------------
    @property
    def users(self) -> int:
        return self._n

    @property
    def paused(self) -> npt.NDArray[np.bool_]:
        """Users waiting at a waypoint at the current time."""
        out: npt.NDArray[np.bool_] = self._pause > 0.0
        return out

    def positions(self) -> tuple[FloatArray, FloatArray]:
        return self._frame.to_degrees(self._x, self._y)

    def step(self, dt_s: float) -> None:
        """Pause first, then walk; a user reaching its waypoint starts a pause and a new leg with the time left."""
        if not (math.isfinite(dt_s) and dt_s >= 0.0):
            raise ValueError("dt_s: must be finite and >= 0")
        if self._n == 0 or dt_s == 0.0:
            return
        # Full pass over every user, in place.
        used = np.minimum(self._pause, dt_s)
        self._pause -= used
        t_move = np.subtract(dt_s, used, out=used)
        rows, left = self._move(self._x, self._y, self._tx, self._ty, self._speed, t_move)
        if rows.size:
            self._arrive(rows)
        # Small passes over the users that arrived with time to spare (each pass starts a new leg).
        while rows.size:
            keep = left > 0.0
            rows, left = rows[keep], left[keep]
            if not rows.size:
                break
            used = np.minimum(self._pause[rows], left)
            self._pause[rows] -= used
            x, y = self._x[rows], self._y[rows]
            sub, sub_left = self._move(x, y, self._tx[rows], self._ty[rows], self._speed[rows], left - used)
            self._x[rows], self._y[rows] = x, y
            rows, left = rows[sub], sub_left
            if rows.size:
                self._arrive(rows)

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _move(
        x: FloatArray, y: FloatArray, tx: FloatArray, ty: FloatArray, speed: FloatArray, t_move: FloatArray
    ) -> tuple[IntArray, FloatArray]:
        """Move ``x, y`` in place towards ``tx, ty``; return the rows that reached it and their time left."""
        dx = tx - x
        dy = ty - y
        dist = np.hypot(dx, dy)
        reach = speed * t_move
        arrive = reach >= dist
        frac = np.divide(reach, dist, out=np.ones_like(dist), where=~arrive)
        dx *= frac
        dy *= frac
        x += dx
        y += dy
        rows = np.flatnonzero(arrive)
        if not rows.size:
            return rows, np.empty(0)
        x[rows] = tx[rows]
        y[rows] = ty[rows]
        left = t_move[rows] - dist[rows] / speed[rows]
        np.maximum(left, 0.0, out=left)
        return rows, left

    def _arrive(self, rows: IntArray) -> None:
        m = rows.size
        self._pause[rows] = self._draw_pauses(m)
        self._tx[rows], self._ty[rows] = self._draw_targets(m)
        self._speed[rows] = self._draw_speeds(m)


class RandomWaypoint(_WaypointMotion):
    """Random waypoint (Johnson & Maltz 1996): uniform waypoints in ``bbox``, uniform speed per leg, uniform pauses.

    Users start at uniform positions, moving (no pause) towards a first waypoint; the speed range
    must start above 0 (a zero minimum makes the mean speed decay forever: Yoon, Liu & Noble,
    INFOCOM 2003). Moves happen in the frame of the module docstring.

    Keyword-only parameters:
        speed_mps: ``(min, max)`` leg speed in m/s, drawn uniformly per leg; default ``(0.5, 15.0)``.
        pause_s: ``(min, max)`` pause at each waypoint in seconds; default ``(0.0, 60.0)``.
        seed: seed of the model's ``numpy.random.Generator``; default ``0``.
    """

    def __init__(
        self,
        n: int,
        bbox: BBox | Sequence[float],
        *,
        speed_mps: tuple[float, float] = (0.5, 15.0),
        pause_s: tuple[float, float] = (0.0, 60.0),
        seed: int | None = 0,
    ) -> None:
        super().__init__(n, bbox, speed_mps=speed_mps, pause_s=pause_s, seed=seed)

    def _draw_targets(self, m: int) -> tuple[FloatArray, FloatArray]:
        f = self._frame
        return self._rng.uniform(0.0, f.width_m, m), self._rng.uniform(0.0, f.height_m, m)


class HotspotModel(_WaypointMotion):
    """Waypoints drawn towards POIs: a share of legs end near a random POI, the rest anywhere in the bbox.

    A POI waypoint is the POI plus an isotropic Gaussian offset of ``spread_m`` (clipped to the
    bbox); POIs are picked uniformly, or in proportion to ``weights``. Users start at a waypoint
    drawn the same way, so the population is clustered from the first step. The motion is the
    random-waypoint motion of :class:`RandomWaypoint`.

    Keyword-only parameters:
        bbox: where users live; default the POIs' bounding box grown by ``3·spread_m`` on each side.
        poi_share: probability that a waypoint is drawn near a POI, else uniform in the bbox; default ``0.8``.
        spread_m: standard deviation of the offset around a POI in metres; default ``300.0``.
        weights: one non-negative weight per POI (not all zero); default ``None`` (uniform).
        speed_mps: ``(min, max)`` leg speed in m/s; default ``(0.5, 15.0)``.
        pause_s: ``(min, max)`` pause at each waypoint in seconds; default ``(0.0, 300.0)``.
        seed: seed of the model's ``numpy.random.Generator``; default ``0``.
    """

    def __init__(
        self,
        n: int,
        pois: HasLatLon,
        *,
        bbox: BBox | Sequence[float] | None = None,
        poi_share: float = 0.8,
        spread_m: float = 300.0,
        weights: npt.ArrayLike | None = None,
        speed_mps: tuple[float, float] = (0.5, 15.0),
        pause_s: tuple[float, float] = (0.0, 300.0),
        seed: int | None = 0,
    ) -> None:
        lat = np.asarray(pois.lat, dtype=np.float64)
        lon = np.asarray(pois.lon, dtype=np.float64)
        if lat.size == 0 or lat.shape != lon.shape:
            raise ValueError("pois: need at least one POI with lat and lon")
        if not (0.0 <= poi_share <= 1.0):
            raise ValueError("poi_share: must be within [0, 1]")
        if not (math.isfinite(spread_m) and spread_m >= 0.0):
            raise ValueError("spread_m: must be finite and >= 0")
        if weights is None:
            self._p: FloatArray | None = None
        else:
            w = np.asarray(weights, dtype=np.float64)
            if w.shape != lat.shape or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
                raise ValueError("weights: one finite non-negative weight per POI, not all zero")
            self._p = w / w.sum()
        if bbox is None:
            pad_lat = 3.0 * spread_m / M_PER_DEG_LAT
            far = max(abs(float(lat.min())), abs(float(lat.max()))) + pad_lat
            pad_lon = pad_lat / max(math.cos(math.radians(min(far, 89.0))), 1e-6)
            bbox = (
                max(float(lon.min()) - pad_lon, -180.0),
                max(float(lat.min()) - pad_lat, -89.999999),
                min(float(lon.max()) + pad_lon, 180.0),
                min(float(lat.max()) + pad_lat, 89.999999),
            )
        self.poi_share = float(poi_share)
        self.spread_m = float(spread_m)
        frame = _WaypointFrame(bbox)
        self._poi_x, self._poi_y = frame.to_frame(lat, lon)
        super().__init__(n, bbox, speed_mps=speed_mps, pause_s=pause_s, seed=seed)

    def _draw_targets(self, m: int) -> tuple[FloatArray, FloatArray]:
        f, rng = self._frame, self._rng
        x = rng.uniform(0.0, f.width_m, m)
        y = rng.uniform(0.0, f.height_m, m)
        near = np.flatnonzero(rng.random(m) < self.poi_share)
        if near.size:
            pick = rng.choice(self._poi_x.size, size=near.size, p=self._p)
            off = rng.normal(0.0, self.spread_m, (2, near.size))
            x[near] = np.clip(self._poi_x[pick] + off[0], 0.0, f.width_m)
            y[near] = np.clip(self._poi_y[pick] + off[1], 0.0, f.height_m)
        return x, y
