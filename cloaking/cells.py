"""Population-balanced Hilbert cells: the spatial partition of a city (issue 15, CONCEPTS §4.4).

The Hilbert curve of :class:`~kcloak.cloaking.cloakers.hilbert.HilbertCloak` (same grid, same
order) is cut into ``C`` cells, each a contiguous range of Hilbert values. The cut points are
**public configuration**: a sorted array ``boundaries`` of ``C − 1`` Hilbert values, chosen from a
population sample so that each cell holds about the same number of users. Cell ``c`` holds the
values ``[boundaries[c − 1], boundaries[c])`` (``0`` and ``4^order`` at the ends); a value equal to
a cut point belongs to the upper cell. Several equal cut points (a sample with many users on one
grid cell) leave empty cells in between: the cell count never changes.

The map is a function of positions only, never of user ids, so the users of one cell are the users
of one area: a region computed from one cell's own users holds at least ``k`` of them, and users of
other cells inside it only add to the real count (under-counting is safe).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.cloakers.hilbert import hilbert_indices
from kcloak.cloaking.errors import CloakingError
from kcloak.cloaking.grid import GRID_BITS, grid_coords
from kcloak.core.errors import InputError
from kcloak.core.geometry import coordinate_keys

I64 = npt.NDArray[np.int64]

FORMAT = "kcloak.cells/1"
"""Value of the ``format`` member of a published cell map (see ``docs/cluster.md`` "Cells")."""


class CellMapError(CloakingError, InputError, ValueError):
    """A cell map, a sample or a position that cannot be used (message never echoes the values)."""


def _float_column(values: npt.ArrayLike, name: str) -> npt.NDArray[np.float64]:
    try:
        a = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise CellMapError(f"{name}: must be numbers") from None
    return a


def _positions(lat: npt.ArrayLike, lon: npt.ArrayLike) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    la = _float_column(lat, "lat")
    lo = _float_column(lon, "lon")
    if len(la) != len(lo):
        raise CellMapError("lat and lon must have the same length")
    if not (np.isfinite(la).all() and np.isfinite(lo).all()):
        raise CellMapError("positions must be finite numbers (NaN or infinity given)")
    if len(la) and (np.abs(la).max() > 90.0 or np.abs(lo).max() > 180.0):
        raise CellMapError("positions must lie within lat [-90, 90] and lon [-180, 180]")
    return la, lo


class CellMap:
    """Cut points of the Hilbert curve into ``cells`` contiguous, public cells.

    Arguments:
        boundaries: ``cells − 1`` non-decreasing Hilbert values in ``[0, 4^order]``.
        order: the curve order (as :class:`HilbertCloak`'s ``order``; default 29).
    """

    __slots__ = ("_hash", "boundaries", "order")

    def __init__(self, boundaries: npt.ArrayLike, *, order: int = GRID_BITS) -> None:
        if isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= GRID_BITS:
            raise CellMapError(f"order: must be an integer within [1, {GRID_BITS}]")
        raw = np.asarray(boundaries)
        if raw.ndim != 1 or (len(raw) and raw.dtype.kind not in "iu"):
            raise CellMapError("boundaries: must be a flat list of integers")
        b = raw.astype(np.int64)
        if len(b) and (int(b[0]) < 0 or int(b[-1]) > 4**order):
            raise CellMapError(f"boundaries: must lie within [0, 4^{order}]")
        if len(b) > 1 and bool((np.diff(b) < 0).any()):
            raise CellMapError("boundaries: must be sorted (non-decreasing)")
        b.setflags(write=False)
        self.boundaries: I64 = b
        self.order = order
        self._hash = hash((order, b.tobytes()))

    @property
    def cells(self) -> int:
        """Number of cells ``C`` (``len(boundaries) + 1``)."""
        return len(self.boundaries) + 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CellMap):
            return NotImplemented
        return self.order == other.order and np.array_equal(self.boundaries, other.boundaries)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"CellMap(cells={self.cells}, order={self.order})"

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def balanced(cls, lat: npt.ArrayLike, lon: npt.ArrayLike, *, cells: int, order: int = GRID_BITS) -> CellMap:
        """Cut points giving each of ``cells`` cells about the same share of a population sample.

        The cut before cell ``c`` is the Hilbert value of the sample's ``⌊c·n/C⌋``-th user in curve
        order, so with distinct values every cell holds ``⌊n/C⌋`` or ``⌈n/C⌉`` sample users.
        """
        if isinstance(cells, bool) or not isinstance(cells, int) or cells < 1:
            raise CellMapError("cells: must be an integer >= 1")
        la, lo = _positions(lat, lon)
        n = len(la)
        if n == 0:
            raise CellMapError("population sample: empty")
        hv = np.sort(_hilbert_values(la, lo, order))
        cut = (np.arange(1, cells, dtype=np.int64) * n) // cells
        return cls(hv[cut], order=order)

    # -- lookup ------------------------------------------------------------------------------------
    def cell_of_values(self, hv: npt.ArrayLike) -> I64:
        """Cell of each Hilbert value (``searchsorted``; a value on a cut point is in the upper cell)."""
        out: I64 = np.searchsorted(self.boundaries, np.asarray(hv, dtype=np.int64), side="right").astype(np.int64)
        return out

    def cell_of_grid(self, gx: I64, gy: I64) -> I64:
        """Cell of level-29 grid coordinates (as :attr:`IndexView.gx`, :attr:`IndexView.gy`)."""
        shift = GRID_BITS - self.order
        return self.cell_of_values(hilbert_indices(gx >> shift, gy >> shift, self.order))

    def cell_of(self, lat: npt.ArrayLike, lon: npt.ArrayLike) -> I64:
        """Cell of each position (vectorized); raises :class:`CellMapError` on NaN or out-of-world input."""
        la, lo = _positions(lat, lon)
        return self.cell_of_values(_hilbert_values(la, lo, self.order))

    # -- public file -----------------------------------------------------------------------------
    def to_json(self) -> str:
        """The public file: ``{"format": "kcloak.cells/1", "order": …, "cells": C, "boundaries": […]}``."""
        doc = {"format": FORMAT, "order": self.order, "cells": self.cells, "boundaries": self.boundaries.tolist()}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> CellMap:
        """Parse :meth:`to_json`'s output; every inconsistency is a :class:`CellMapError`."""
        try:
            doc: Any = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            raise CellMapError("cell map: not valid JSON") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CellMapError(f"cell map: expected an object with format {FORMAT!r}")
        order, cells, bounds = doc.get("order"), doc.get("cells"), doc.get("boundaries")
        if not isinstance(bounds, list) or not all(type(v) is int for v in bounds):
            raise CellMapError("cell map: boundaries must be a list of integers")
        if type(cells) is not int or cells != len(bounds) + 1:
            raise CellMapError("cell map: cells must equal the number of boundaries + 1")
        if type(order) is not int:
            raise CellMapError("cell map: order must be an integer")
        if any(not 0 <= v <= 4**GRID_BITS for v in bounds):
            raise CellMapError(f"boundaries: must lie within [0, 4^{GRID_BITS}]")
        return cls(np.asarray(bounds, dtype=np.int64), order=order)


def _hilbert_values(lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64], order: int) -> I64:
    """Hilbert values of positions exactly as :class:`HilbertCloak` computes them from a view."""
    gx = grid_coords(coordinate_keys(lon), "lon")
    gy = grid_coords(coordinate_keys(lat), "lat")
    shift = GRID_BITS - order
    return hilbert_indices(gx >> shift, gy >> shift, order)


__all__ = ["FORMAT", "CellMap", "CellMapError"]
