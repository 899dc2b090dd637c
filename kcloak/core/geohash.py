"""Geohash cells as integers and strings (CONCEPTS §8.2 "Geohash prefix").

A geohash of length ``L`` interleaves ``5L`` bits, longitude first, written in the base-32
alphabet ``0123456789bcdefghjkmnpqrstuvwxyz``. That alphabet is in ASCII order, so for cells
of one length the string order, the integer order of :func:`encode_codes` and the geohash
(Z-) order are the same; a prefix is a contiguous range of that order. Everything here is
vectorized over numpy arrays.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import CoreError, InputError

ALPHABET = "0123456789bcdefghjkmnpqrstuvwxyz"
_DIGIT = {c: i for i, c in enumerate(ALPHABET)}
_CHARS = np.array(list(ALPHABET))
MAX_PRECISION = 12

I64 = npt.NDArray[np.int64]


class GeohashError(CoreError, InputError, ValueError):
    """A precision out of range or a string that is not a geohash."""


def _check_precision(precision: int) -> None:
    if not 1 <= precision <= MAX_PRECISION:
        raise GeohashError(f"precision: must be within [1, {MAX_PRECISION}]")


def encode_codes(lat: npt.ArrayLike, lon: npt.ArrayLike, precision: int) -> I64:
    """Integer codes (``5·precision`` bits, longitude bit first) of the cells holding the points."""
    _check_precision(precision)
    la = np.asarray(lat, dtype=np.float64)
    lo = np.asarray(lon, dtype=np.float64)
    bits = 5 * precision
    n_lon = (bits + 1) // 2
    n_lat = bits // 2
    lon_idx = np.clip(np.floor((lo + 180.0) / 360.0 * (1 << n_lon)), 0, (1 << n_lon) - 1).astype(np.int64)
    lat_idx = np.clip(np.floor((la + 90.0) / 180.0 * (1 << n_lat)), 0, (1 << n_lat) - 1).astype(np.int64)
    code = np.zeros(np.broadcast(la, lo).shape, np.int64)
    for b in range(bits):  # b = 0 is the most significant bit
        idx, nbits = (lon_idx, n_lon) if b % 2 == 0 else (lat_idx, n_lat)
        bit = (idx >> (nbits - 1 - b // 2)) & 1
        code = (code << 1) | bit
    return code


def codes_to_strings(codes: npt.ArrayLike, precision: int) -> list[str]:
    """The geohash strings of integer codes of one precision."""
    _check_precision(precision)
    c = np.asarray(codes, dtype=np.int64)
    if c.size == 0:
        return []
    digits = np.stack([(c >> (5 * (precision - 1 - j))) & 31 for j in range(precision)], axis=-1)
    chars = _CHARS[digits]
    return ["".join(row) for row in chars.reshape(-1, precision).tolist()]


def encode(lat: npt.ArrayLike, lon: npt.ArrayLike, precision: int) -> list[str]:
    """Geohash strings of the points (vectorized)."""
    return codes_to_strings(encode_codes(lat, lon, precision), precision)


def code_of(cell: str) -> int:
    """Integer code of one geohash string (its length is the precision)."""
    if not 1 <= len(cell) <= MAX_PRECISION:
        raise GeohashError("geohash: length must be within [1, 12]")
    code = 0
    for ch in cell:
        d = _DIGIT.get(ch)
        if d is None:
            raise GeohashError("geohash: characters must be in the base-32 geohash alphabet")
        code = (code << 5) | d
    return code


def string_of(code: int, precision: int) -> str:
    """Geohash string of one integer code."""
    _check_precision(precision)
    if not 0 <= code < 1 << (5 * precision):
        raise GeohashError("geohash code out of range for the precision")
    return "".join(ALPHABET[(code >> (5 * (precision - 1 - j))) & 31] for j in range(precision))


def cell_bounds(cell: str) -> tuple[float, float, float, float]:
    """``(min_lon, min_lat, max_lon, max_lat)`` of a geohash cell."""
    precision = len(cell)
    code = code_of(cell)
    bits = 5 * precision
    n_lon = (bits + 1) // 2
    n_lat = bits // 2
    lon_idx = lat_idx = 0
    for b in range(bits):
        bit = (code >> (bits - 1 - b)) & 1
        if b % 2 == 0:
            lon_idx = (lon_idx << 1) | bit
        else:
            lat_idx = (lat_idx << 1) | bit
    dlon = 360.0 / (1 << n_lon)
    dlat = 180.0 / (1 << n_lat)
    return (
        -180.0 + lon_idx * dlon,
        -90.0 + lat_idx * dlat,
        -180.0 + (lon_idx + 1) * dlon,
        -90.0 + (lat_idx + 1) * dlat,
    )


__all__ = [
    "ALPHABET",
    "MAX_PRECISION",
    "GeohashError",
    "cell_bounds",
    "code_of",
    "codes_to_strings",
    "encode",
    "encode_codes",
    "string_of",
]
