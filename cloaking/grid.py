"""The equal-angle quadtree grid shared by the grid cloakers (CONCEPTS §2.1 rule 1).

The root square spans ±2^28 micro-degrees in both axes (±268.435456°, the whole world
inside), so the cell of level ``h`` is ``2^(29-h)`` micro-degrees wide: every cell edge is a
whole micro-degree and a cell is an exact lat/lon box, published with no conversion. Level 29
cells are one micro-degree (≈ 0.11 m). A point's grid coordinate is its floor micro-degree
(``key >> 1``, see :mod:`kcloak.core.geometry`) plus ``2^28``; Morton codes interleave the two.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

GRID_BITS = 29
GRID_OFFSET = 1 << 28
MAX_LEVEL = GRID_BITS

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


def grid_coords(keys: I64, axis: str) -> I64:
    """Grid coordinate (0 … 2^29 − 1) of coordinates given by their exact keys.

    ``axis`` is ``"lon"`` or ``"lat"``. A coordinate exactly on the upper world edge (+180° or
    +90°) is placed in the cell just below it, so that every cell holding it is published with
    that edge, where it counts (contract §0: strictness is waived at the world edge).
    """
    top_key = 2 * (180_000_000 if axis == "lon" else 90_000_000)
    out: I64 = (keys >> 1) + GRID_OFFSET
    on_top = keys == top_key
    if on_top.any():
        out = out - on_top
    return out


def _spread(v: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    v = v & np.uint64(0x00000000FFFFFFFF)
    v = (v | (v << np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    v = (v | (v << np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    v = (v | (v << np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    v = (v | (v << np.uint64(2))) & np.uint64(0x3333333333333333)
    v = (v | (v << np.uint64(1))) & np.uint64(0x5555555555555555)
    return v


def morton_codes(gx: I64, gy: I64) -> U64:
    """Level-29 Morton codes (x in the even bits, y in the odd bits)."""
    out: U64 = _spread(gx.astype(np.uint64)) | (_spread(gy.astype(np.uint64)) << np.uint64(1))
    return out


def morton_code(gx: int, gy: int) -> int:
    """Scalar :func:`morton_codes`."""
    return int(morton_codes(np.array([gx], np.int64), np.array([gy], np.int64))[0])


def cell_code_range(level: int, cx: int, cy: int) -> tuple[int, int]:
    """Half-open range of level-29 Morton codes covered by a cell."""
    prefix = morton_code(cx, cy)
    shift = 2 * (GRID_BITS - level)
    return prefix << shift, (prefix + 1) << shift


def cell_udeg(level: int, cx: int, cy: int) -> tuple[int, int, int, int]:
    """Exact micro-degree bounds ``(lon0, lat0, lon1, lat1)`` of a cell (half-open)."""
    s = GRID_BITS - level
    lon0 = (cx << s) - GRID_OFFSET
    lat0 = (cy << s) - GRID_OFFSET
    return lon0, lat0, lon0 + (1 << s), lat0 + (1 << s)
