"""Where simulated users live: a square around central Beijing sized for the number of users.

Whether a query can be cloaked depends on how many users stand near its querier (CONCEPTS §9:
success depends on density), not on how many users there are in all: 2,000 users spread over
the whole 40 × 34 km street extract are 1.5 per km², and a k = 20 region then needs about
13 km², far above the shipped 4 km² ``max_area_m2``. So ``kcloak simulate`` and ``kcloak demo``
put their users in a square holding :data:`USERS_PER_KM2` of them per km² (at most
:data:`MAX_SIDE_KM` wide, about the 3rd Ring Road, and at least :data:`MIN_SIDE_KM`).

Pure arithmetic (no numpy), so the command line can show these values in ``--help`` cheaply.
"""

from __future__ import annotations

import math
from typing import Final

BBox = tuple[float, float, float, float]
"""``(min_lon, min_lat, max_lon, max_lat)`` in degrees (GeoJSON order)."""

CITY_CENTRE: Final = (39.905, 116.39)
"""Centre of the area (lat, lon): central Beijing, near Tiananmen."""

USERS_PER_KM2: Final = 15.0
"""User density of the default area: k = 20 is then reachable within the shipped 4 km² ``max_area_m2``."""

MAX_SIDE_KM: Final = 14.5
"""Largest side of the default area: about the 3rd Ring Road."""

MIN_SIDE_KM: Final = 2.0
"""Smallest side of the default area (a few users still walk a few streets)."""

EARTH_RADIUS_M: Final = 6_371_008.8


def side_for_users(users: int) -> float:
    """Side (km) of the square that holds ``users`` at :data:`USERS_PER_KM2`, within [MIN_SIDE_KM, MAX_SIDE_KM]."""
    return min(MAX_SIDE_KM, max(MIN_SIDE_KM, math.sqrt(users / USERS_PER_KM2)))


def square_around(side_km: float, centre: tuple[float, float] = CITY_CENTRE) -> BBox:
    """The square of ``side_km`` centred on ``centre`` (lat, lon), rounded to micro-degrees."""
    if not (math.isfinite(side_km) and side_km > 0):
        raise ValueError("area: the side must be finite and > 0 km")
    half_lat = math.degrees(side_km * 500.0 / EARTH_RADIUS_M)
    half_lon = half_lat / math.cos(math.radians(centre[0]))
    lat, lon = centre
    return (round(lon - half_lon, 6), round(lat - half_lat, 6), round(lon + half_lon, 6), round(lat + half_lat, 6))


def populated_area(users: int) -> BBox:
    """The default area of ``users`` simulated users: :func:`square_around` of :func:`side_for_users`."""
    return square_around(side_for_users(users))


def side_km(bbox: BBox) -> tuple[float, float]:
    """``(width, height)`` of ``bbox`` in km, the width at its middle latitude."""
    lo_lon, lo_lat, hi_lon, hi_lat = bbox
    per_deg = math.radians(1.0) * EARTH_RADIUS_M / 1000.0
    mid = math.radians((lo_lat + hi_lat) / 2.0)
    return (hi_lon - lo_lon) * per_deg * math.cos(mid), (hi_lat - lo_lat) * per_deg


def parse_bbox(text: str) -> BBox:
    """``"min_lon,min_lat,max_lon,max_lat"`` as a :data:`BBox`; ValueError says what is wrong."""
    parts = text.split(",")
    if len(parts) != 4:
        raise ValueError("expected MIN_LON,MIN_LAT,MAX_LON,MAX_LAT (4 numbers)")
    try:
        a, b, c, d = (float(p) for p in parts)
    except ValueError:
        raise ValueError("expected MIN_LON,MIN_LAT,MAX_LON,MAX_LAT (4 numbers)") from None
    if not all(math.isfinite(v) for v in (a, b, c, d)):
        raise ValueError("the coordinates must be finite")
    if not (-180.0 <= a < c <= 180.0 and -90.0 < b < d < 90.0):
        raise ValueError("need -180 <= min_lon < max_lon <= 180 and -90 < min_lat < max_lat < 90")
    return a, b, c, d


__all__ = [
    "CITY_CENTRE",
    "MAX_SIDE_KM",
    "MIN_SIDE_KM",
    "USERS_PER_KM2",
    "BBox",
    "parse_bbox",
    "populated_area",
    "side_for_users",
    "side_km",
    "square_around",
]
