"""Generalization hierarchies and the written forms of generalized values (CONCEPTS §8.2, contract §8).

A hierarchy is a chain of domains ``D_0 ≤ D_1 ≤ … ≤ D_h`` whose value mappings form a tree [S001 §2.1]:
level 0 is the exact value, each level maps every value of the level below to exactly one value, and the top
is a single value (usually ``*``, suppressed). :meth:`Hierarchy.encode` turns the column(s) of one
quasi-identifier into integer codes per level (equal codes = same generalized value) plus the written form of
each generalized value, so that search algorithms never handle strings:

* :class:`CategoricalHierarchy` — a value generalization tree given as leaf → ancestors;
* :class:`PrefixHierarchy` — drop rightmost characters (ZIP codes ``941**``);
* :class:`IntervalHierarchy` — recoding of numbers into nested half-open intervals ``[a,b)``; the time
  hierarchy (minute → 15 min → hour → day → ISO week → ``*``) is one of them;
* :class:`GridHierarchy` — geohash or quadtree cells for a (lat, lon) pair, written as one interval per column.

Every written form is truthful: each original value satisfies it (contract §8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import InvalidTableInput

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

SUPPRESSED = "*"
# Time levels (CONCEPTS §8.2): minute, 15 min, hour, day, ISO week; anchored on Monday 1970-01-05 00:00 UTC.
TIME_WIDTHS_S: tuple[int, ...] = (60, 900, 3600, 86400, 604800)
ISO_WEEK_ORIGIN_S = 345600
GEOHASH_MAX_LEN = 7


def format_number(x: float) -> str:
    """Canonical written form of a number: integers without a fraction, other floats by ``repr`` (round-trips)."""
    if math.isfinite(x) and x == math.floor(x) and abs(x) < 2**53:
        return str(int(x))
    return repr(float(x))


def parse_numbers(values: Sequence[Any], column: str) -> FloatArray:
    """Parse a column as finite floats; :class:`InvalidTableInput` names the column on failure."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidTableInput(f"column {column!r}: non-numeric value in a numeric quasi-identifier") from exc
    if arr.ndim != 1 or not np.all(np.isfinite(arr)):
        raise InvalidTableInput(f"column {column!r}: missing or non-finite value in a numeric quasi-identifier")
    return arr


def factorize(values: npt.NDArray[Any]) -> IntArray:
    """Dense codes 0..c-1 of the distinct values (sorted order)."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    _, inverse = np.unique(values, return_inverse=True)
    return inverse.astype(np.int64).reshape(-1)


def _leaves_per_code(codes0: IntArray, codes: IntArray) -> IntArray:
    """Number of distinct level-0 codes under each code of a coarser level."""
    if len(codes0) == 0:
        return np.zeros(0, dtype=np.int64)
    pairs = np.unique(np.stack([codes, codes0]), axis=1)
    return np.bincount(pairs[0], minlength=int(codes.max()) + 1).astype(np.int64)


@dataclass(frozen=True, slots=True)
class EncodedHierarchy:
    """One QI encoded against its hierarchy: codes per level and the written form of any (level, row).

    ``codes[level][row]`` are equal for two rows iff their values generalize to the same value at ``level``;
    ``write(level, row)`` is that value's written form, one string per column of the QI; ``ncp(level, row)``
    its normalized certainty penalty (CONCEPTS §8.16), 0 at level 0 and 1 for ``*``.
    """

    height: int
    codes: tuple[IntArray, ...]
    writer: Callable[[int, int], tuple[str, ...]]
    penalty: Callable[[int, int], float]

    def write(self, level: int, row: int) -> tuple[str, ...]:
        return self.writer(level, row)

    def ncp(self, level: int, row: int) -> float:
        return self.penalty(level, row)


class Hierarchy(Protocol):
    """A generalization hierarchy for one quasi-identifier (one column, or two for a lat/lon pair)."""

    @property
    def n_columns(self) -> int: ...

    def encode(self, columns: Sequence[Sequence[Any]], names: Sequence[str]) -> EncodedHierarchy: ...


# --------------------------------------------------------------------------- categorical trees


@dataclass(frozen=True, slots=True)
class CategoricalHierarchy:
    """A value generalization tree: ``paths[leaf]`` lists the leaf's ancestors from its parent to the root.

    ``written="set"`` writes an internal node as the set of its leaves (``{divorced|married|widow}``, contract
    §8) and the root as ``*``; ``written="label"`` writes the node's own name (``been married``, as the seeds
    print it), ``*`` for a node named ``*``. All paths have the same length (the height).
    """

    paths: Mapping[str, tuple[str, ...]]
    written: Literal["set", "label"] = "set"

    def __post_init__(self) -> None:
        if not self.paths:
            raise InvalidTableInput("a categorical hierarchy needs at least one leaf")
        heights = {len(p) for p in self.paths.values()}
        if len(heights) != 1 or 0 in heights:
            raise InvalidTableInput("every leaf of a categorical hierarchy needs the same number (>= 1) of ancestors")
        parent: dict[tuple[int, str], tuple[str, ...]] = {}
        for path in self.paths.values():
            for level, name in enumerate(path):
                above = tuple(path[level + 1 :])
                if parent.setdefault((level, name), above) != above:
                    raise InvalidTableInput(f"node {name!r} has two different parents (the hierarchy must be a tree)")
        if len({p[-1] for p in self.paths.values()}) != 1:
            raise InvalidTableInput("a categorical hierarchy must have a single root")

    @classmethod
    def flat(cls, values: Sequence[str]) -> CategoricalHierarchy:
        """Height-1 hierarchy: every value generalizes directly to ``*`` (default for categorical QIs)."""
        return cls({v: (SUPPRESSED,) for v in sorted(set(values))})

    @property
    def height(self) -> int:
        return len(next(iter(self.paths.values())))

    @property
    def leaves(self) -> tuple[str, ...]:
        """Leaves in the mapping's order (the order Mondrian uses for this attribute)."""
        return tuple(self.paths)

    @property
    def n_columns(self) -> int:
        return 1

    def node_key(self, leaf: str, level: int) -> tuple[str, ...]:
        """The node above ``leaf`` at ``level`` as its path to the root (unique even if names repeat)."""
        return (leaf,) if level == 0 else self.paths[leaf][level - 1 :]

    def leaves_under(self, level: int, leaf: str) -> tuple[str, ...]:
        """Sorted leaves of the node above ``leaf`` at ``level``."""
        key = self.node_key(leaf, level)
        return tuple(sorted(x for x in self.paths if self.node_key(x, level) == key))

    def write_node(self, level: int, leaf: str) -> str:
        if level == 0:
            return leaf
        if self.written == "label":
            return self.paths[leaf][level - 1]
        members = self.leaves_under(level, leaf)
        if len(members) == len(self.paths):
            return SUPPRESSED
        return members[0] if len(members) == 1 else "{" + "|".join(members) + "}"

    def encode(self, columns: Sequence[Sequence[Any]], names: Sequence[str]) -> EncodedHierarchy:
        values = [str(v) for v in columns[0]]
        unknown = sorted({v for v in values if v not in self.paths})
        if unknown:
            raise InvalidTableInput(f"column {names[0]!r}: value(s) not in the hierarchy: {unknown[:5]}")
        leaf_index = {leaf: i for i, leaf in enumerate(self.paths)}
        leaf_codes = np.fromiter((leaf_index[v] for v in values), dtype=np.int64, count=len(values))
        height = self.height
        codes: list[IntArray] = []
        cache: dict[tuple[int, int], tuple[str, float]] = {}
        leaves = list(self.paths)
        for level in range(height + 1):
            keys = {leaf: self.node_key(leaf, level) for leaf in leaves}
            key_ids: dict[tuple[str, ...], int] = {}
            per_leaf = np.array([key_ids.setdefault(keys[leaf], len(key_ids)) for leaf in leaves], dtype=np.int64)
            codes.append(per_leaf[leaf_codes] if len(values) else np.zeros(0, dtype=np.int64))
        dom = len(self.paths)

        def info(level: int, row: int) -> tuple[str, float]:
            leaf = values[row]
            key = (level, leaf_index[leaf])
            if key not in cache:
                n_under = len(self.leaves_under(level, leaf)) if level else 1
                cache[key] = (self.write_node(level, leaf), 0.0 if level == 0 else n_under / dom)
            return cache[key]

        return EncodedHierarchy(
            height=height,
            codes=tuple(codes),
            writer=lambda level, row: (info(level, row)[0],),
            penalty=lambda level, row: info(level, row)[1],
        )


# --------------------------------------------------------------------------- prefixes (ZIP codes)


@dataclass(frozen=True, slots=True)
class PrefixHierarchy:
    """Drop ``drops[i-1]`` rightmost characters at level ``i`` (ZIP ``94139`` → ``9413*`` → ``941**``).

    ``pad=True`` writes one ``*`` per dropped character (the seeds' notation), otherwise a single ``*`` (the
    contract's prefix form). With ``suppress_top`` a final level ``*`` is added.
    """

    drops: tuple[int, ...]
    pad: bool = False
    suppress_top: bool = True

    def __post_init__(self) -> None:
        if any(d <= 0 for d in self.drops) or list(self.drops) != sorted(set(self.drops)):
            raise InvalidTableInput("prefix drops must be positive and strictly increasing")

    @property
    def n_columns(self) -> int:
        return 1

    @property
    def height(self) -> int:
        return len(self.drops) + (1 if self.suppress_top else 0)

    def encode(self, columns: Sequence[Sequence[Any]], names: Sequence[str]) -> EncodedHierarchy:
        values = [str(v) for v in columns[0]]
        arr = np.asarray(values, dtype=object)
        codes: list[IntArray] = [factorize(arr)]
        for d in self.drops:
            codes.append(factorize(np.asarray([v[: max(len(v) - d, 0)] for v in values], dtype=object)))
        if self.suppress_top:
            codes.append(np.zeros(len(values), dtype=np.int64))
        dom = int(codes[0].max()) + 1 if len(values) else 1
        counts = [_leaves_per_code(codes[0], c) for c in codes]
        n_prefix_levels = len(self.drops)

        def write(level: int, row: int) -> tuple[str, ...]:
            v = values[row]
            if level == 0:
                return (v,)
            if level > n_prefix_levels:
                return (SUPPRESSED,)
            d = self.drops[level - 1]
            prefix = v[: max(len(v) - d, 0)]
            if not prefix:
                return (SUPPRESSED,)
            return (prefix + ("*" * min(d, len(v)) if self.pad else "*"),)

        def ncp(level: int, row: int) -> float:
            if level == 0:
                return 0.0
            if level > n_prefix_levels:
                return 1.0
            return float(counts[level][codes[level][row]]) / dom

        return EncodedHierarchy(self.height, tuple(codes), write, ncp)


# --------------------------------------------------------------------------- numeric intervals and time


def _decimals_for(width: float) -> int:
    """Decimals kept on interval bounds so that ``39.900000000000006`` prints as ``39.9``."""
    return int(min(15, max(0, 6 - math.floor(math.log10(width)))))


def _bin_bounds(origin: float, width: float, j: IntArray) -> tuple[FloatArray, FloatArray]:
    d = _decimals_for(width)
    lo = np.round(origin + j.astype(np.float64) * width, d)
    hi = np.round(origin + (j + 1).astype(np.float64) * width, d)
    return lo, hi


def _bins(x: FloatArray, origin: float, width: float) -> IntArray:
    """Bin index of each value such that ``lo <= x < hi`` holds for the *printed* bounds."""
    j = np.floor((x - origin) / width).astype(np.int64)
    lo, hi = _bin_bounds(origin, width, j)
    return j - (x < lo).astype(np.int64) + (x >= hi).astype(np.int64)


@dataclass(frozen=True, slots=True)
class IntervalHierarchy:
    """Recoding of a number into nested half-open intervals ``[origin + j·w, origin + (j+1)·w)`` [S004 Def. 4.1].

    ``widths`` go from fine to coarse and each must be a multiple of the previous one (the intervals nest,
    so the mapping is a tree); ``suppress_top`` adds a final ``*`` level.
    """

    widths: tuple[float, ...]
    origin: float = 0.0
    suppress_top: bool = True

    def __post_init__(self) -> None:
        prev = None
        for w in self.widths:
            if not (w > 0 and math.isfinite(w)):
                raise InvalidTableInput("interval widths must be positive")
            if prev is not None:
                ratio = w / prev
                if ratio < 1.5 or abs(ratio - round(ratio)) > 1e-9 * ratio:
                    raise InvalidTableInput(
                        "each interval width must be an integer multiple (>= 2) of the previous one"
                    )
            prev = w
        if not self.widths and not self.suppress_top:
            raise InvalidTableInput("an interval hierarchy needs at least one level")

    @classmethod
    def time(cls) -> IntervalHierarchy:
        """Unix seconds → minute → 15 min → hour → day → ISO week (UTC) → ``*`` (CONCEPTS §8.2)."""
        return cls(tuple(float(w) for w in TIME_WIDTHS_S), float(ISO_WEEK_ORIGIN_S))

    @classmethod
    def from_data(cls, values: FloatArray, levels: int = 6) -> IntervalHierarchy:
        """Default hierarchy: ``levels`` doubling widths from a round width near range/2^levels, then ``*``."""
        if len(values) == 0:
            return cls((), 0.0)
        span = float(values.max() - values.min())
        if span <= 0:
            return cls((), 0.0)
        raw = span / 2**levels
        exp = math.floor(math.log10(raw))
        base = next(m * 10.0**exp for m in (1.0, 2.0, 5.0, 10.0) if m * 10.0**exp >= raw)
        return cls(tuple(base * 2**i for i in range(levels + 1)), 0.0)

    @property
    def n_columns(self) -> int:
        return 1

    @property
    def height(self) -> int:
        return len(self.widths) + (1 if self.suppress_top else 0)

    def encode(self, columns: Sequence[Sequence[Any]], names: Sequence[str]) -> EncodedHierarchy:
        x = parse_numbers(columns[0], names[0])
        codes: list[IntArray] = [factorize(x)]
        codes.extend(_bins(x, self.origin, w) for w in self.widths)
        if self.suppress_top:
            codes.append(np.zeros(len(x), dtype=np.int64))
        span = float(x.max() - x.min()) if len(x) else 0.0
        n_levels = len(self.widths)

        def write(level: int, row: int) -> tuple[str, ...]:
            if level == 0:
                return (format_number(float(x[row])),)
            if level > n_levels:
                return (SUPPRESSED,)
            j = codes[level][row : row + 1]
            lo, hi = _bin_bounds(self.origin, self.widths[level - 1], j)
            return (f"[{format_number(float(lo[0]))},{format_number(float(hi[0]))})",)

        def ncp(level: int, row: int) -> float:
            if level == 0:
                return 0.0
            if level > n_levels:
                return 1.0
            return 0.0 if span == 0 else min(1.0, self.widths[level - 1] / span)

        return EncodedHierarchy(self.height, tuple(codes), write, ncp)


# --------------------------------------------------------------------------- spatial cells


@dataclass(frozen=True, slots=True)
class GridHierarchy:
    """Nested grid cells for a (lat, lon) pair: geohash prefixes or quadtree keys (CONCEPTS §8.2).

    ``levels[i]`` = (longitude bits, latitude bits) of level ``i + 1`` (fine to coarse) over the box
    ``[lat0, lat1] × [lon0, lon1]``; a cell is written as one interval per column, ``[lo,hi)`` (closed on
    the box's upper edge), so every original coordinate satisfies it.
    """

    lat0: float
    lat1: float
    lon0: float
    lon1: float
    levels: tuple[tuple[int, int], ...]
    suppress_top: bool = True

    def __post_init__(self) -> None:
        if not (self.lat0 < self.lat1 and self.lon0 < self.lon1):
            raise InvalidTableInput("grid hierarchy box must have positive extent")
        for (bx, by), (cx, cy) in zip(self.levels, self.levels[1:], strict=False):
            if cx > bx or cy > by:
                raise InvalidTableInput("grid levels must go from fine to coarse")

    @classmethod
    def geohash(cls, max_len: int = GEOHASH_MAX_LEN, min_len: int = 1) -> GridHierarchy:
        """Geohash prefixes of length ``max_len`` … ``min_len``, then ``*``: ``⌈5L/2⌉`` lon, ``⌊5L/2⌋`` lat bits."""
        if not 1 <= min_len <= max_len <= 12:
            raise InvalidTableInput("geohash lengths must satisfy 1 <= min_len <= max_len <= 12")
        lv = tuple(((5 * n + 1) // 2, (5 * n) // 2) for n in range(max_len, min_len - 1, -1))
        return cls(-90.0, 90.0, -180.0, 180.0, lv)

    @classmethod
    def quadtree(cls, lat0: float, lat1: float, lon0: float, lon1: float, depth: int) -> GridHierarchy:
        """Quadtree cells of the box at depth ``depth`` … 1 (parent ``(i >> 1, j >> 1)``), then ``*``."""
        if not 1 <= depth <= 30:
            raise InvalidTableInput("quadtree depth must be in 1..30")
        return cls(lat0, lat1, lon0, lon1, tuple((h, h) for h in range(depth, 0, -1)))

    @property
    def n_columns(self) -> int:
        return 2

    @property
    def height(self) -> int:
        return len(self.levels) + (1 if self.suppress_top else 0)

    def _axis_cells(self, v: FloatArray, lo0: float, hi0: float, bits: int) -> IntArray:
        n = 1 << bits
        step = (hi0 - lo0) / n
        j = np.clip(np.floor((v - lo0) / step).astype(np.int64), 0, n - 1)
        lo = lo0 + j * step
        hi = lo0 + (j + 1) * step
        j = j - ((v < lo) & (j > 0)).astype(np.int64) + ((v >= hi) & (j < n - 1)).astype(np.int64)
        return j

    def _interval(self, lo0: float, hi0: float, bits: int, j: int) -> str:
        n = 1 << bits
        step = (hi0 - lo0) / n
        lo, hi = lo0 + j * step, lo0 + (j + 1) * step
        close = "]" if j == n - 1 else ")"
        return f"[{format_number(lo)},{format_number(hi)}{close}"

    def encode(self, columns: Sequence[Sequence[Any]], names: Sequence[str]) -> EncodedHierarchy:
        lat = parse_numbers(columns[0], names[0])
        lon = parse_numbers(columns[1], names[1])
        if np.any((lat < self.lat0) | (lat > self.lat1) | (lon < self.lon0) | (lon > self.lon1)):
            raise InvalidTableInput(f"columns {names[0]!r}/{names[1]!r}: coordinate outside the hierarchy's box")
        codes: list[IntArray] = [_pair_codes(lat, lon)]
        cells: list[tuple[IntArray, IntArray]] = []
        for bx, by in self.levels:
            ix = self._axis_cells(lon, self.lon0, self.lon1, bx)
            iy = self._axis_cells(lat, self.lat0, self.lat1, by)
            cells.append((ix, iy))
            codes.append((ix << by) | iy)
        if self.suppress_top:
            codes.append(np.zeros(len(lat), dtype=np.int64))
        span_lat = float(lat.max() - lat.min()) if len(lat) else 0.0
        span_lon = float(lon.max() - lon.min()) if len(lon) else 0.0
        n_levels = len(self.levels)

        def write(level: int, row: int) -> tuple[str, ...]:
            if level == 0:
                return (format_number(float(lat[row])), format_number(float(lon[row])))
            if level > n_levels:
                return (SUPPRESSED, SUPPRESSED)
            bx, by = self.levels[level - 1]
            ix, iy = cells[level - 1]
            return (
                self._interval(self.lat0, self.lat1, by, int(iy[row])),
                self._interval(self.lon0, self.lon1, bx, int(ix[row])),
            )

        def ncp(level: int, row: int) -> float:
            if level == 0:
                return 0.0
            if level > n_levels:
                return 1.0
            bx, by = self.levels[level - 1]
            h_lat = (self.lat1 - self.lat0) / (1 << by)
            h_lon = (self.lon1 - self.lon0) / (1 << bx)
            a = 0.0 if span_lat == 0 else min(1.0, h_lat / span_lat)
            b = 0.0 if span_lon == 0 else min(1.0, h_lon / span_lon)
            return (a + b) / 2

        return EncodedHierarchy(self.height, tuple(codes), write, ncp)


def _pair_codes(a: FloatArray, b: FloatArray) -> IntArray:
    """Dense codes of distinct (a, b) pairs."""
    if len(a) == 0:
        return np.zeros(0, dtype=np.int64)
    ca, cb = factorize(a), factorize(b)
    return factorize(ca * (int(cb.max()) + 1) + cb)


def default_hierarchy(kind: str, columns: Sequence[Sequence[Any]], names: Sequence[str]) -> Hierarchy:
    """The hierarchy used when a QI gives none (CONCEPTS §8.2): data-driven intervals for numbers, the time
    chain for timestamps, a flat tree for categories, geohash prefixes (length 7 … 1) for lat/lon pairs."""
    if kind == "numeric":
        return IntervalHierarchy.from_data(parse_numbers(columns[0], names[0]))
    if kind == "time":
        return IntervalHierarchy.time()
    if kind == "categorical":
        return CategoricalHierarchy.flat([str(v) for v in columns[0]])
    if kind == "latlon":
        return GridHierarchy.geohash()
    raise InvalidTableInput(f"unknown quasi-identifier kind {kind!r}")
