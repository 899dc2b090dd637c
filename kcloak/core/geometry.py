"""Geodesy and exact bbox publication (CONCEPTS §2.1, §2.2, §2.5; contract §0).

Published bboxes have edges on whole micro-degrees (at most 6 fractional digits), serialized as
the float nearest to that decimal (its ``repr`` is the decimal itself). A client reads both the
edges and the coordinates it sent as float64, or as the exact decimals of their JSON text, and
counts strictly. So containment is decided on the coordinates *as floats*, not on their exact
binary values: a float ``v`` that is the float of a whole micro-degree ``m`` (``v == m / 1e6``,
e.g. ``116.30395``, whose binary value is slightly off that decimal) sits **on** that
micro-degree. Every coordinate is turned into an integer **key**: ``2 * m`` when ``v`` is the
float of micro-degree ``m``, ``2 * floor(v * 1e6) + 1`` otherwise (exact real product: ``v`` is
then strictly between the floats of two consecutive micro-degrees). A micro-degree edge ``m`` has
key ``2 * m``, so ``lo < v < hi`` is ``2 * lo < key(v) < 2 * hi``.

Why this is exact for every reader: rounding a decimal to the nearest float is monotone, so
``float(edge_text) > v`` implies that the edge's decimal exceeds every decimal text that parses
to ``v`` (up to 17 significant digits or more), and the exact binary value of ``v`` as well.
Keys compare exactly like ``float(edge_text)`` against ``v``, hence like all of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

EARTH_RADIUS_M = 6_371_008.8
"""Sphere radius of the contract (§0); every distance and area is judged on it."""

UDEG_PER_DEG = 1_000_000
"""Published edges are integers in this unit (micro-degrees, quantum 1e-6°)."""

WORLD_LON_UDEG = 180 * UDEG_PER_DEG
WORLD_LAT_UDEG = 90 * UDEG_PER_DEG
MAX_REGION_AREA_M2 = 2.5e9
"""Cap on any region (a 50 km square): the range where the local frames are accurate."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_SPLITTER = 134217729.0  # 2**27 + 1, Veltkamp split for the exact product
_SCALE_HI = float(np.float64(_SPLITTER * 1e6) - (np.float64(_SPLITTER * 1e6) - 1e6))
_SCALE_LO = 1e6 - _SCALE_HI


def haversine_m(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance in metres on the contract's sphere."""
    p1 = math.radians(lat1)
    p2 = math.radians(lat2)
    a = math.sin((p2 - p1) / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(math.radians(lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_M * math.asin(math.sqrt(min(max(a, 0.0), 1.0)))


def haversine_m_array(lat1: npt.ArrayLike, lon1: npt.ArrayLike, lat2: npt.ArrayLike, lon2: npt.ArrayLike) -> FloatArray:
    """Vectorized :func:`haversine_m` (broadcasting)."""
    p1 = np.radians(np.asarray(lat1, dtype=np.float64))
    p2 = np.radians(np.asarray(lat2, dtype=np.float64))
    dl = np.radians(np.asarray(lon2, dtype=np.float64) - np.asarray(lon1, dtype=np.float64))
    a = np.sin((p2 - p1) / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    out: FloatArray = 2 * EARTH_RADIUS_M * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))
    return out


def bbox_area_m2(min_lon: float, min_lat: float, max_lon: float, max_lat: float) -> float:
    """Area of a lat/lon box with the contract formula (§0)."""
    return (
        EARTH_RADIUS_M
        * EARTH_RADIUS_M
        * math.radians(max_lon - min_lon)
        * abs(math.sin(math.radians(max_lat)) - math.sin(math.radians(min_lat)))
    )


def bbox_area_m2_array(
    min_lon: FloatArray, min_lat: FloatArray, max_lon: FloatArray, max_lat: FloatArray
) -> FloatArray:
    """Vectorized :func:`bbox_area_m2`."""
    out: FloatArray = (
        EARTH_RADIUS_M
        * EARTH_RADIUS_M
        * np.radians(max_lon - min_lon)
        * np.abs(np.sin(np.radians(max_lat)) - np.sin(np.radians(min_lat)))
    )
    return out


def coordinate_keys(values: npt.ArrayLike) -> IntArray:
    """Exact integer keys of float coordinates in degrees (see the module docstring).

    ``v`` is on micro-degree ``m`` iff ``m / 1e6 == v`` (IEEE division is correctly rounded, so
    ``m / 1e6`` is the float a client parses from the edge's text). Otherwise the product
    ``v * 1e6`` is computed with an error-free transformation (Dekker) to take its exact floor.
    """
    v = np.asarray(values, dtype=np.float64)
    p = v * 1e6
    c = _SPLITTER * v
    vh = c - (c - v)
    vl = v - vh
    err = ((vh * _SCALE_HI - p) + vh * _SCALE_LO + vl * _SCALE_HI) + vl * _SCALE_LO
    f = np.floor(p)
    # floor of the exact product: p integral and err < 0 means the exact product is just below p.
    floor_exact = f.astype(np.int64) - ((p == f) & (err < 0))
    key: IntArray = 2 * floor_exact + 1
    nearest = np.rint(p)
    on_udeg = nearest / 1e6 == v
    key[on_udeg] = 2 * nearest[on_udeg].astype(np.int64)
    return key


def coordinate_key(value: float) -> int:
    """Scalar :func:`coordinate_keys`."""
    return int(coordinate_keys(np.array([value]))[0])


def udeg_below_key(key: int) -> int:
    """Largest whole micro-degree strictly below the coordinate with this key."""
    return (key - 1) >> 1


def udeg_above_key(key: int) -> int:
    """Smallest whole micro-degree strictly above the coordinate with this key."""
    return (key >> 1) + 1


@dataclass(frozen=True, slots=True)
class BBox:
    """A published region: integer micro-degree edges, GeoJSON order, never across the antimeridian."""

    min_lon_udeg: int
    min_lat_udeg: int
    max_lon_udeg: int
    max_lat_udeg: int

    def __post_init__(self) -> None:
        if not (-WORLD_LON_UDEG <= self.min_lon_udeg <= self.max_lon_udeg <= WORLD_LON_UDEG):
            raise ValueError("bbox: longitudes must be ordered and within [-180, 180]")
        if not (-WORLD_LAT_UDEG <= self.min_lat_udeg <= self.max_lat_udeg <= WORLD_LAT_UDEG):
            raise ValueError("bbox: latitudes must be ordered and within [-90, 90]")

    def to_geojson(self) -> list[float]:
        """``[min_lon, min_lat, max_lon, max_lat]``; each float's repr has ≤ 6 fractional digits."""
        return [
            self.min_lon_udeg / UDEG_PER_DEG,
            self.min_lat_udeg / UDEG_PER_DEG,
            self.max_lon_udeg / UDEG_PER_DEG,
            self.max_lat_udeg / UDEG_PER_DEG,
        ]

    @property
    def area_m2(self) -> float:
        return bbox_area_m2(*self.to_geojson())

    def key_bounds(self) -> tuple[int, int, int, int]:
        """Inclusive key bounds ``(lon_lo, lat_lo, lon_hi, lat_hi)`` of the users inside.

        Strict on every side (``2·min < key < 2·max``), except at the world edge (±180°, ±90°)
        where strictness is impossible and the edge itself counts (contract §0).
        """
        return (
            2 * self.min_lon_udeg + (0 if self.min_lon_udeg == -WORLD_LON_UDEG else 1),
            2 * self.min_lat_udeg + (0 if self.min_lat_udeg == -WORLD_LAT_UDEG else 1),
            2 * self.max_lon_udeg - (0 if self.max_lon_udeg == WORLD_LON_UDEG else 1),
            2 * self.max_lat_udeg - (0 if self.max_lat_udeg == WORLD_LAT_UDEG else 1),
        )

    def contains_key(self, lon_key: int, lat_key: int) -> bool:
        """Containment of a coordinate given by its keys (strict but at the world edge)."""
        a, b, c, d = self.key_bounds()
        return a <= lon_key <= c and b <= lat_key <= d

    def contains_keys(self, lon_keys: IntArray, lat_keys: IntArray) -> npt.NDArray[np.bool_]:
        """Vectorized :meth:`contains_key`."""
        a, b, c, d = self.key_bounds()
        out: npt.NDArray[np.bool_] = (lon_keys >= a) & (lon_keys <= c) & (lat_keys >= b) & (lat_keys <= d)
        return out


def key_bounds_array(boxes: npt.ArrayLike) -> IntArray:
    """Vectorized :meth:`BBox.key_bounds` for an ``(m, 4)`` array of micro-degree boxes."""
    b = np.asarray(boxes, dtype=np.int64).reshape(-1, 4)
    out: IntArray = np.empty_like(b)
    out[:, 0] = 2 * b[:, 0] + (b[:, 0] != -WORLD_LON_UDEG)
    out[:, 1] = 2 * b[:, 1] + (b[:, 1] != -WORLD_LAT_UDEG)
    out[:, 2] = 2 * b[:, 2] - (b[:, 2] != WORLD_LON_UDEG)
    out[:, 3] = 2 * b[:, 3] - (b[:, 3] != WORLD_LAT_UDEG)
    return out


def bbox_around_keys(min_lon_key: int, min_lat_key: int, max_lon_key: int, max_lat_key: int) -> BBox:
    """Smallest micro-degree box strictly containing the key rectangle (clipped at the world edge)."""
    return BBox(
        max(udeg_below_key(min_lon_key), -WORLD_LON_UDEG),
        max(udeg_below_key(min_lat_key), -WORLD_LAT_UDEG),
        min(udeg_above_key(max_lon_key), WORLD_LON_UDEG),
        min(udeg_above_key(max_lat_key), WORLD_LAT_UDEG),
    )


def expand_to_area(box: BBox, min_area_m2: float) -> BBox | None:
    """Grow ``box`` about its own centre until its area is at least ``min_area_m2`` (§2.5).

    Width first (to ``√A``), then height; the result depends on the box only (never on who
    asks), so reciprocity survives. A box that would leave the world is translated inward,
    never clipped. Returns ``None`` when no such box fits in the world.
    """
    if min_area_m2 <= 0 or box.area_m2 >= min_area_m2:
        return box
    if min_area_m2 > MAX_REGION_AREA_M2 * 4:
        return None
    lon0, lat0, lon1, lat1 = box.to_geojson()
    clat = (lat0 + lat1) / 2
    clon = (lon0 + lon1) / 2
    coslat = max(math.cos(math.radians(clat)), 1e-6)
    w_m = EARTH_RADIUS_M * math.radians(lon1 - lon0) * coslat
    h_m = EARTH_RADIUS_M * math.radians(lat1 - lat0)
    w2 = max(w_m, math.sqrt(min_area_m2))
    h2 = max(h_m, min_area_m2 / w2)
    for _ in range(64):
        half_w = math.degrees(w2 / (EARTH_RADIUS_M * coslat)) / 2
        half_h = math.degrees(h2 / EARTH_RADIUS_M) / 2
        if half_w >= 180.0:  # near a pole: take every longitude and grow in latitude only
            return _full_width_band(box, clat, min_area_m2)
        n_lon0 = min(math.floor((clon - half_w) * UDEG_PER_DEG), box.min_lon_udeg)
        n_lon1 = max(math.ceil((clon + half_w) * UDEG_PER_DEG), box.max_lon_udeg)
        n_lat0 = min(math.floor((clat - half_h) * UDEG_PER_DEG), box.min_lat_udeg)
        n_lat1 = max(math.ceil((clat + half_h) * UDEG_PER_DEG), box.max_lat_udeg)
        shifted = _translate_inside(n_lon0, n_lat0, n_lon1, n_lat1)
        if shifted is None:
            return None
        grown = BBox(*shifted)
        if grown.area_m2 >= min_area_m2:
            return grown
        w2 *= 1.001
        h2 *= 1.001
    return None


def _full_width_band(box: BBox, clat: float, min_area_m2: float) -> BBox | None:
    """A band over all longitudes around ``clat`` holding ``box``, of area ≥ ``min_area_m2``."""
    need = min_area_m2 / (EARTH_RADIUS_M * EARTH_RADIUS_M * 2 * math.pi)  # |Δ sin(lat)| required
    if need > 2:
        return None
    s0 = math.sin(math.radians(clat))
    lo, hi = s0 - need / 2, s0 + need / 2
    if hi > 1:
        lo, hi = lo - (hi - 1), 1.0
    if lo < -1:
        lo, hi = -1.0, hi + (-1 - lo)
    lat0 = min(math.floor(math.degrees(math.asin(max(-1.0, lo))) * UDEG_PER_DEG), box.min_lat_udeg)
    lat1 = max(math.ceil(math.degrees(math.asin(min(1.0, hi))) * UDEG_PER_DEG), box.max_lat_udeg)
    for _ in range(64):
        band = BBox(-WORLD_LON_UDEG, max(lat0, -WORLD_LAT_UDEG), WORLD_LON_UDEG, min(lat1, WORLD_LAT_UDEG))
        if band.area_m2 >= min_area_m2:
            return band
        if band.min_lat_udeg == -WORLD_LAT_UDEG and band.max_lat_udeg == WORLD_LAT_UDEG:
            return None
        lat0 -= 1000
        lat1 += 1000
    return None


def _translate_inside(lon0: int, lat0: int, lon1: int, lat1: int) -> tuple[int, int, int, int] | None:
    if lon1 - lon0 > 2 * WORLD_LON_UDEG or lat1 - lat0 > 2 * WORLD_LAT_UDEG:
        return None
    if lon0 < -WORLD_LON_UDEG:
        lon1 += -WORLD_LON_UDEG - lon0
        lon0 = -WORLD_LON_UDEG
    if lon1 > WORLD_LON_UDEG:
        lon0 -= lon1 - WORLD_LON_UDEG
        lon1 = WORLD_LON_UDEG
    if lat0 < -WORLD_LAT_UDEG:
        lat1 += -WORLD_LAT_UDEG - lat0
        lat0 = -WORLD_LAT_UDEG
    if lat1 > WORLD_LAT_UDEG:
        lat0 -= lat1 - WORLD_LAT_UDEG
        lat1 = WORLD_LAT_UDEG
    return lon0, lat0, lon1, lat1


@dataclass(frozen=True, slots=True)
class Aeqd:
    """Azimuthal equidistant frame on the contract sphere, centred on (lat0, lon0).

    Distances from the centre are exact; transverse scale error is about ρ²/(6R²), 1e-5 at
    50 km (§2.1). Used by metric algorithms (CliqueCloak tolerances, NWA distances).
    """

    lat0: float
    lon0: float

    def forward(self, lat: npt.ArrayLike, lon: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
        p0 = math.radians(self.lat0)
        p = np.radians(np.asarray(lat, dtype=np.float64))
        dl = np.radians(np.asarray(lon, dtype=np.float64) - self.lon0)
        cos_c = np.clip(math.sin(p0) * np.sin(p) + math.cos(p0) * np.cos(p) * np.cos(dl), -1.0, 1.0)
        c = np.arccos(cos_c)
        sin_c = np.sin(c)
        kp = np.where(c < 1e-12, 1.0, c / np.where(sin_c == 0, 1.0, sin_c))
        x = EARTH_RADIUS_M * kp * np.cos(p) * np.sin(dl)
        y = EARTH_RADIUS_M * kp * (math.cos(p0) * np.sin(p) - math.sin(p0) * np.cos(p) * np.cos(dl))
        return x, y

    def inverse(self, x: npt.ArrayLike, y: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
        p0 = math.radians(self.lat0)
        xa = np.asarray(x, dtype=np.float64)
        ya = np.asarray(y, dtype=np.float64)
        rho = np.hypot(xa, ya)
        c = rho / EARTH_RADIUS_M
        sin_c, cos_c = np.sin(c), np.cos(c)
        safe = np.where(rho == 0, 1.0, rho)
        lat = np.arcsin(np.clip(cos_c * math.sin(p0) + ya * sin_c * math.cos(p0) / safe, -1.0, 1.0))
        lon = math.radians(self.lon0) + np.arctan2(xa * sin_c, rho * math.cos(p0) * cos_c - ya * math.sin(p0) * sin_c)
        lat = np.where(rho == 0, p0, lat)
        lon = np.where(rho == 0, math.radians(self.lon0), lon)
        lon_deg = (np.degrees(lon) + 540.0) % 360.0 - 180.0
        return np.degrees(lat), lon_deg
