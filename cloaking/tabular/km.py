"""k^m-anonymity of bags of ordered items: ACD and Apriori Anonymization (CONCEPTS §8.15, S002).

A dataset of records, each a *bag* of integer items (duplicates allowed), is **k^m-anonymous**
when every sub-bag of size ≤ ``m`` of every record is contained (as a sub-multiset) in at least
``k`` records. Both algorithms use **global recoding**: the sorted distinct items are cut into
contiguous blocks, and every occurrence of an item is released as its block.

* **ACD** (Gkountouna et al., S002 Algs. 1–3) builds the hierarchy on the fly: for ``i = 1..m``
  it counts the ``i``-sub-bags of the generalized data (the dynamic count tree, each record's
  items ordered by support), and fixes every rare leaf ``f`` by merging it with a sibling (a
  leaf sharing the already frequent prefix) into the smallest range holding both, the
  cheapest merge (dataset NCP) that reaches support ``k``; when no sibling does, it climbs to
  ``f``'s parent and merges both paths position by position (S002 Alg. 3, lines 9–11, 16–18).
* **AA** (Terrovitis, Mamoulis, Kalnis, PVLDB 2008 ⚠ as summarised in S002 §4) uses a fixed
  hierarchy (:class:`FixedHierarchy`, e.g. geohash prefixes): for each rare ``i``-sub-bag it
  raises the levels of its items along the hierarchy, choosing the cheapest combination of
  levels that makes it frequent, and keeps earlier choices (the cut only coarsens).

NCP (S002 §3.3): an item released as a range ``[g_min, g_max]`` costs ``(g_max − g_min)/|I|``
(``|I|`` the active domain's extent, capped at 1; a top-level ``*`` costs 1); the dataset NCP is
the mean over all released items. With bags, full generalization may still leave a rare
sub-bag (e.g. fewer than ``k`` records hold ``m`` items): such records are **suppressed**
(removed and counted) within ``floor(max_suppression · n)``; beyond it the release is
:class:`KmUnsatisfiable`.

Bookkeeping (same releases as rebuilding everything after each rule, to the last bit of NCP;
``tests/cloaking/tabular/test_km.py`` holds digests of the straightforward implementation's
releases): a rule rewrites only its span of the cut (block of each value, block ends, ACD's
per-value NCP); counts change only on suppression; level 1 of the count tree is one numpy
pass over the postings; supports of narrow ranges are read from their postings; ACD prices a
rare leaf's nearest siblings first and widens only when its cheapest merges are not yet
provably cheaper than every farther one.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.errors import CloakingError
from kcloak.core import geohash
from kcloak.core.errors import InputError
from kcloak.core.names import PlacesAlgorithm

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

Itemset = tuple[int, ...]
"""A sub-bag as block ids (block start indices), in the count tree's order."""


KmAlgorithm = PlacesAlgorithm
"""``--algorithm`` values of the ``places`` table (contract §8), named in :mod:`kcloak.core.names`."""


class KmError(CloakingError, InputError, ValueError):
    """Bad parameters or records."""


class KmUnsatisfiable(KmError):
    """k^m-anonymity needs more suppressed records than ``max_suppression`` allows."""


class FixedHierarchy(Protocol):
    """A chain hierarchy over integer items whose nodes are contiguous ranges of the item order.

    Level 0 is the item itself; level ``height`` is the whole domain (written ``*``). Every node
    must be a contiguous range and nodes of one level must partition the domain (C1, C2 of
    CONCEPTS §8.2).
    """

    @property
    def height(self) -> int: ...

    def node_range(self, values: I64, level: int) -> tuple[I64, I64]:
        """Inclusive integer range ``[lo, hi]`` of each value's ancestor at ``level`` (< height)."""
        ...

    def node_extent(self, level: int) -> float:
        """``g_max − g_min`` of a node at ``level`` (< height), for NCP; 0 at level 0."""
        ...

    def label(self, value: int, level: int) -> str:
        """Written form of ``value``'s ancestor at ``level`` (< height)."""
        ...


@dataclass(frozen=True, slots=True)
class GeohashPrefixHierarchy:
    """Geohash cells of one precision → shorter prefixes → ``*`` (CONCEPTS §8.2), e.g. ``wx4g*``.

    Items are the integer codes of :mod:`kcloak.core.geohash`; level ``j`` drops ``j`` characters.
    """

    precision: int

    @property
    def height(self) -> int:
        return self.precision

    def node_range(self, values: I64, level: int) -> tuple[I64, I64]:
        shift = 5 * level
        lo = (values >> shift) << shift
        return lo, lo + ((1 << shift) - 1)

    def node_extent(self, level: int) -> float:
        return float((1 << (5 * level)) - 1)

    def label(self, value: int, level: int) -> str:
        if level == 0:
            return geohash.string_of(value, self.precision)
        return geohash.string_of(value >> (5 * level), self.precision - level) + "*"


@dataclass(frozen=True, slots=True)
class IntervalHierarchy:
    """Left-open intervals ``(origin + (j−1)·w, origin + j·w]`` of width ``w = leaf_width·fanout^(level−1)``.

    The numeric hierarchy of S002's example (Fig. 1, ``(10000-20000]``); ``levels`` interval
    levels sit between the values and ``*``.
    """

    origin: int
    leaf_width: int
    fanout: int
    levels: int

    @property
    def height(self) -> int:
        return self.levels + 1

    def _width(self, level: int) -> int:
        return int(self.leaf_width * self.fanout ** (level - 1))

    def node_range(self, values: I64, level: int) -> tuple[I64, I64]:
        if level == 0:
            return values, values
        w = self._width(level)
        idx = -((self.origin - values) // w)  # ceil((v − origin) / w)
        return self.origin + (idx - 1) * w + 1, self.origin + idx * w

    def node_extent(self, level: int) -> float:
        return 0.0 if level == 0 else float(self._width(level))

    def label(self, value: int, level: int) -> str:
        if level == 0:
            return str(value)
        lo, hi = self.node_range(np.array([value], np.int64), level)
        return f"({int(lo[0]) - 1}-{int(hi[0])}]"


class ItemFormat(Protocol):
    """Written forms of released items (contract §8)."""

    def exact(self, value: int) -> str: ...

    def range(self, lo: int, hi: int) -> str:
        """An ACD range holding the observed items ``lo ≤ x ≤ hi``."""
        ...


@dataclass(frozen=True, slots=True)
class GeohashFormat:
    """Geohash cells: exact ``wx4g0b7``; ranges half-open in geohash order ``[wx4g0b7,wx4g0c3)``."""

    precision: int

    def exact(self, value: int) -> str:
        return geohash.string_of(value, self.precision)

    def range(self, lo: int, hi: int) -> str:
        if hi + 1 < 1 << (5 * self.precision):
            return f"[{self.exact(lo)},{self.exact(hi + 1)})"
        return f"[{self.exact(lo)},{self.exact(hi)}]"  # the last cell: its bound is an observed maximum


@dataclass(frozen=True, slots=True)
class NumberFormat:
    """Plain integers; ranges closed ``[20000,30500]`` (S002 Table 3)."""

    def exact(self, value: int) -> str:
        return str(value)

    def range(self, lo: int, hi: int) -> str:
        return f"[{lo},{hi}]"


@dataclass(frozen=True, slots=True)
class KmRelease:
    """Result of :func:`anonymize_km`.

    ``records`` is aligned with the input: each released record's written items (sorted), or
    ``None`` when the record was suppressed. ``ncp`` is S002's dataset NCP, the mean over all
    input items, a suppressed record's items counting 1; ``k_achieved`` is the smallest support
    of any sub-bag of size ≤ m of the release (``None`` when nothing is released).
    """

    records: tuple[tuple[str, ...] | None, ...]
    algorithm: KmAlgorithm
    k: int
    m: int
    suppressed_rows: int
    ncp: float
    k_achieved: int | None
    generalized_items: int
    """Released item occurrences that are not exact."""


_SMALL_POSTINGS = 512
"""Support queries reading at most this many postings use Python sets; larger ones numpy (same counts)."""


class _Data:
    """Records as sorted value indices, postings per distinct value, and the current cut.

    The cut (contiguous blocks of the sorted distinct values) changes only by :meth:`merge`,
    which rewrites the merged span's entries and nothing else; the counts of alive occurrences
    change only when records are suppressed (:meth:`suppress`). Both bump :attr:`version`, so
    that derived arrays (prefix sums of a cut's NCP, the list of block starts) are rebuilt only
    when something changed.
    """

    def __init__(self, records: Sequence[Sequence[int]]) -> None:
        n = len(records)
        lens = np.fromiter((len(r) for r in records), np.int64, n)
        flat = np.fromiter((v for r in records for v in r), np.int64)
        self.vals: I64 = np.unique(flat)
        self.n_records = n
        vi = np.searchsorted(self.vals, flat).astype(np.int64)
        rec_of = np.repeat(np.arange(n, dtype=np.int64), lens)
        self.rec_ptr: list[int] = [0, *np.cumsum(lens).tolist()]
        self.rec_vals: I64 = vi[np.lexsort((vi, rec_of))]  # each record's value indices, ascending, record by record
        flat_vals = self.rec_vals.tolist()
        self.recs: list[list[int]] = [flat_vals[self.rec_ptr[r] : self.rec_ptr[r + 1]] for r in range(n)]
        self.multi: list[int] = np.flatnonzero(lens >= 2).tolist()  # records that hold 2-sub-bags or larger
        pair = vi * max(n, 1) + rec_of
        uniq, mult = np.unique(pair, return_counts=True)
        self.post_val: I64 = uniq // max(n, 1)
        self.post_rec: I64 = uniq % max(n, 1)
        self.post_mul: I64 = mult.astype(np.int64)
        self.post_ptr: I64 = np.searchsorted(self.post_val, np.arange(len(self.vals) + 1))
        self._post_rec = self.post_rec.tolist()
        self._post_mul = self.post_mul.tolist()
        self._post_ptr = self.post_ptr.tolist()
        self.alive = np.ones(n, bool)
        self._alive = [True] * n
        self.total_items = len(flat)
        self.extent = float(self.vals[-1] - self.vals[0]) if len(self.vals) else 0.0
        n_vals = len(self.vals)
        self.starts = np.ones(n_vals, bool)  # block boundaries of the cut
        self.block_of: I64 = np.arange(n_vals, dtype=np.int64)  # each value's block (its first value index)
        self.block_end: I64 = np.arange(n_vals, dtype=np.int64)  # each value's block's last value index
        self.level = np.zeros(n_vals, np.int64)  # AA: hierarchy level of each value's block
        self.version = 0
        self._blocks_at = -1
        self._block_starts: I64 = np.arange(n_vals, dtype=np.int64)
        self._block_ends: I64 = np.arange(n_vals, dtype=np.int64)
        self._count()

    def _count(self) -> None:
        alive_post = self.alive[self.post_rec]
        self.cnt = np.bincount(self.post_val[alive_post], weights=self.post_mul[alive_post], minlength=len(self.vals))
        self.cum_cnt = np.concatenate([[0.0], np.cumsum(self.cnt)])

    def _sync_blocks(self) -> None:
        if self._blocks_at != self.version:
            self._block_starts = np.flatnonzero(self.starts)
            self._block_ends = np.append(self._block_starts[1:] - 1, len(self.vals) - 1)
            self._blocks_at = self.version

    @property
    def block_starts(self) -> I64:
        self._sync_blocks()
        return self._block_starts

    @property
    def block_ends(self) -> I64:
        self._sync_blocks()
        return self._block_ends

    def merge(self, lo: int, hi: int) -> bool:
        """Global recoding: the values ``lo..hi`` become one block; whether the span was a union of blocks.

        A span made of whole blocks (every caller's case) rewrites only its own entries; any
        other span splits a block and the cut is rebuilt from the boundaries.
        """
        n_vals = len(self.vals)
        aligned = bool(self.starts[lo]) and (hi + 1 >= n_vals or bool(self.starts[hi + 1]))
        self.starts[lo + 1 : hi + 1] = False
        self.starts[lo] = True
        if hi + 1 < n_vals:
            self.starts[hi + 1] = True
        self.version += 1
        if aligned:
            self.block_of[lo : hi + 1] = lo
            self.block_end[lo : hi + 1] = hi
        else:
            self.block_of = np.maximum.accumulate(np.where(self.starts, np.arange(n_vals), 0))
            self.block_end = self.block_ends[np.searchsorted(self.block_starts, self.block_of)]
        return aligned

    def suppress(self, rows: npt.NDArray[np.intp]) -> None:
        self.alive[rows] = False
        for r in rows.tolist():
            self._alive[r] = False
        self.version += 1
        self._count()

    def n_suppressed(self) -> int:
        return int(np.count_nonzero(~self.alive))

    def end_of(self, b: int) -> int:
        """Last value index of the block starting at ``b``."""
        return int(self.block_end[b])

    def count_in(self, lo: int, hi: int) -> float:
        return float(self.cum_cnt[hi + 1] - self.cum_cnt[lo])

    def matching(self, tokens: Sequence[tuple[int, int]]) -> set[int] | npt.NDArray[np.bool_]:
        """Alive records holding the bag of value-index ranges ``tokens`` (with repeats).

        Narrow ranges (few postings, the usual case) are answered with Python sets over the
        postings; wide ones with one ``bincount`` per range over all records.
        """
        need = {tokens[0]: 1} if len(tokens) == 1 else Counter(tokens)
        ptr = self._post_ptr
        if sum(ptr[hi + 1] - ptr[lo] for lo, hi in need) > _SMALL_POSTINGS:
            ok = self.alive.copy()
            for (lo, hi), c in need.items():
                a, b = ptr[lo], ptr[hi + 1]
                per_rec = np.bincount(self.post_rec[a:b], weights=self.post_mul[a:b], minlength=self.n_records)
                ok &= per_rec >= c
            return ok
        alive, post_rec, post_mul = self._alive, self._post_rec, self._post_mul
        found: set[int] | None = None
        for (lo, hi), c in need.items():
            a, b = ptr[lo], ptr[hi + 1]
            if c == 1:
                rows = {r for r in post_rec[a:b] if alive[r]}
            else:
                held: dict[int, int] = {}
                for r, mul in zip(post_rec[a:b], post_mul[a:b], strict=True):
                    if alive[r]:
                        held[r] = held.get(r, 0) + mul
                rows = {r for r, x in held.items() if x >= c}
            found = rows if found is None else found & rows
            if not found:
                break
        return found if found is not None else {r for r in range(self.n_records) if alive[r]}

    def support(self, tokens: Sequence[tuple[int, int]]) -> int:
        return _n_matching(self.matching(tokens))

    def block_support(self) -> I64:
        """Alive records holding each block (indexed by the block's first value index)."""
        n = max(self.n_records, 1)
        alive_post = self.alive[self.post_rec]
        pairs = np.unique(self.block_of[self.post_val[alive_post]] * n + self.post_rec[alive_post])
        out: I64 = np.bincount(pairs // n, minlength=len(self.vals))
        return out

    def count_subbags(self, i: int) -> Counter[Itemset]:
        """Supports of every ``i``-sub-bag of the generalized alive records (the count tree's level ``i``).

        Items of a record are ordered by their block's support (descending), then by value, so
        that sub-bags sharing frequent prefixes share tree paths (S002 §3.2). Level 1 is the
        block supports themselves.
        """
        ones = self.block_support()
        if i == 1:
            nz = np.flatnonzero(ones)
            return Counter(dict(zip([(b,) for b in nz.tolist()], ones[nz].tolist(), strict=True)))
        counts: Counter[Itemset] = Counter()
        key = (-ones).tolist()
        block_of = self.block_of.tolist()
        for r in self.multi:
            rec = self.recs[r]
            if not self._alive[r] or len(rec) < i:
                continue
            toks = sorted((block_of[v] for v in rec), key=lambda b: (key[b], b))
            counts.update(set(itertools.combinations(toks, i)))
        return counts

    def current(self, b: int) -> int:
        """The current block holding value index ``b`` (blocks only merge)."""
        return int(self.block_of[b])

    def row_values(self, r: int) -> I64:
        return self.rec_vals[self.rec_ptr[r] : self.rec_ptr[r + 1]]


def _n_matching(found: set[int] | npt.NDArray[np.bool_]) -> int:
    return len(found) if isinstance(found, set) else int(np.count_nonzero(found))


def _rows_matching(found: set[int] | npt.NDArray[np.bool_]) -> npt.NDArray[np.intp]:
    if isinstance(found, set):
        return np.array(sorted(found), dtype=np.intp)
    return np.flatnonzero(found)


def _apply_merges(data: _Data, spans: Sequence[tuple[int, int]]) -> bool:
    """Global recoding of each span ``[lo, hi]``; whether every span was a union of blocks."""
    aligned = True
    for lo, hi in spans:
        aligned = data.merge(lo, hi) and aligned
    return aligned


def _union(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


# -- shared --------------------------------------------------------------------------------
class _Cut:
    """Per-value NCP of the current cut and prefix sums to price merges (S002 §3.3 units)."""

    def __init__(self, data: _Data, ncp_v: F64) -> None:
        self.data = data
        self.ncp_v = ncp_v
        self.cum = np.concatenate([[0.0], np.cumsum(data.cnt * ncp_v)])

    def old(self, lo: int, hi: int) -> float:
        return float(self.cum[hi + 1] - self.cum[lo])

    def suppression(self, rows: npt.NDArray[np.intp]) -> float:
        """NCP added by suppressing ``rows``: each of their items goes to 1.

        A row's loss is summed left to right when it has fewer than 8 items, which is exactly
        what ``np.sum`` does on such short arrays (its pairwise summation starts at 8), and with
        ``np.sum`` otherwise: the figure does not depend on which path computed it.
        """
        ncp_v = self.ncp_v
        per_row: list[float] = []
        for r in rows.tolist():
            vals = self.data.recs[r]
            if len(vals) < 8:
                s = 0.0
                for v in vals:
                    s += 1.0 - float(ncp_v[v])
                per_row.append(s)
            else:
                per_row.append(float(np.sum(1.0 - ncp_v[self.data.row_values(r)])))
        return float(sum(per_row))


def _suppress_rows(data: _Data, rows: npt.NDArray[np.intp]) -> None:
    data.suppress(rows)


def _can_suppress(data: _Data, rows: npt.NDArray[np.intp], budget: int) -> bool:
    return data.n_suppressed() + len(rows) <= budget


def _unsatisfiable(budget: int) -> KmUnsatisfiable:
    return KmUnsatisfiable(
        f"k^m-anonymity needs more than {budget} suppressed records (max_suppression); "
        "lower k or m, or allow more suppression"
    )


Fix = Callable[[Itemset, Itemset, Counter[Itemset], npt.NDArray[np.intp]], bool]
"""``fix(f, image, counts, holders)``: repair one rare sub-bag; whether records were suppressed."""


def _run(data: _Data, k: int, m: int, fix: Fix) -> None:
    """The apriori loop shared by ACD and AA (S002 Alg. 2): sizes ``1..m``, recount until no rare sub-bag.

    ``fix(f, image, counts, holders)`` repairs one rare sub-bag (``holders`` are the alive
    records holding its current image) and returns whether records were suppressed (supports
    then drop, so the loop restarts at size 1).
    """
    i = 1
    while i <= m:
        counts = data.count_subbags(i)
        rare = sorted(f for f, c in counts.items() if c < k)
        if not rare:
            i += 1
            continue
        for f in rare:
            img = tuple(data.current(b) for b in f)
            found = data.matching([(b, data.end_of(b)) for b in img])
            if _n_matching(found) >= k:
                continue  # fixed by an earlier rule of this pass
            if fix(f, img, counts, _rows_matching(found)):
                i = 0
                break
        i = max(i, 1)


# -- ACD -------------------------------------------------------------------------------------
def _acd_ncp(data: _Data) -> F64:
    width = (data.vals[data.block_ends] - data.vals[data.block_starts]).astype(np.float64)
    per_block = np.minimum(1.0, width / max(data.extent, 1.0))
    idx = np.searchsorted(data.block_starts, data.block_of)
    out: F64 = per_block[idx]
    return out


class _AcdCut:
    """ACD's per-value NCP, updated span by span as rules are applied, and its :class:`_Cut` per data version."""

    def __init__(self, data: _Data) -> None:
        self.data = data
        self.ncp_v = _acd_ncp(data)
        self._cut: _Cut | None = None
        self._at = -1

    def cut(self) -> _Cut:
        if self._cut is None or self._at != self.data.version:
            self._cut, self._at = _Cut(self.data, self.ncp_v), self.data.version
        return self._cut

    def merge(self, spans: Sequence[tuple[int, int]]) -> None:
        data = self.data
        if not _apply_merges(data, spans):
            self.ncp_v = _acd_ncp(data)
            return
        extent = max(data.extent, 1.0)
        for lo, hi in spans:
            self.ncp_v[lo : hi + 1] = min(1.0, float(data.vals[hi] - data.vals[lo]) / extent)


def _acd(data: _Data, k: int, m: int, d: float, budget: int) -> None:
    tree: list[Counter[Itemset]] = []
    by_prefix: dict[Itemset, list[Itemset]] = {}
    last_cache: dict[Itemset, I64] = {}
    state = _AcdCut(data)

    def fix(f: Itemset, img: Itemset, counts: Counter[Itemset], holders: npt.NDArray[np.intp]) -> bool:
        if not tree or tree[0] is not counts:  # a new count tree: index its leaves by prefix
            tree[:] = [counts]
            by_prefix.clear()
            last_cache.clear()
            for leaf in counts:
                for ell in range(1, len(leaf) + 1):
                    by_prefix.setdefault(leaf[: ell - 1], []).append(leaf)
        return _acd_fix(data, state, f, img, holders, by_prefix, last_cache, k, d, budget)

    _run(data, k, m, fix)


def _acd_fix(
    data: _Data,
    state: _AcdCut,
    f: Itemset,
    img: Itemset,
    holders: npt.NDArray[np.intp],
    by_prefix: dict[Itemset, list[Itemset]],
    last_cache: dict[Itemset, I64],
    k: int,
    d: float,
    budget: int,
) -> bool:
    """Repair rare ``img`` (S002 Alg. 3): cheapest sibling merge reaching ``k``, climbing when none does.

    Suppressing the records that hold ``img`` competes at the cost of setting their items to
    NCP 1, within the budget. Returns whether records were suppressed.
    """
    cut = state.cut()
    total = max(data.total_items, 1)
    extent = max(data.extent, 1.0)
    sup_cost = cut.suppression(holders) / total if _can_suppress(data, holders, budget) else math.inf
    i = len(f)
    fallback: tuple[float, list[tuple[int, int]]] | None = None
    for ell in range(i, 0, -1):
        cheapest: tuple[float, list[tuple[int, int]]] | None = None
        for ncp, spans, bound in _acd_candidates(data, f, img, by_prefix, ell, cut, extent, last_cache, k):
            cheapest = cheapest or (ncp, spans)
            if bound >= k and _support_after(data, img, spans) >= k:  # records with the bag ≤ occurrences
                if ncp < d or ell == 1:
                    if sup_cost < ncp:
                        _suppress_rows(data, holders)
                        return True
                    state.merge(spans)
                    return False
                break
        if cheapest is not None and (fallback is None or cheapest[0] < fallback[0]):
            fallback = cheapest
    if math.isfinite(sup_cost):
        _suppress_rows(data, holders)
        return True
    if fallback is None:
        fallback = _neighbour_merge(data, img, cut, extent)
    if fallback is None:
        raise _unsatisfiable(budget)
    state.merge(fallback[1])  # no merge suffices yet: take the cheapest step and recount
    return False


def _distinct_sorted(a: I64) -> I64:
    """``np.unique`` of an already sorted array."""
    if a.size == 0:
        return a
    keep = np.empty(a.size, bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    out: I64 = a[keep]
    return out


def _cheapest_first(cost: F64, lo: I64, head: int = 16) -> Iterator[npt.NDArray[np.intp]]:
    """``np.lexsort((lo, cost))`` in two instalments: the ``head`` cheapest (ties included), then the rest.

    A rare leaf usually takes one of its first few candidates, so the full sort is rarely needed;
    the concatenated instalments are exactly the full sort's order (ties by ``lo``, then position).
    """
    if cost.size > head:
        bound = cost[np.argpartition(cost, head - 1)[head - 1]]
        first = np.flatnonzero(cost <= bound)
        yield first[np.lexsort((lo[first], cost[first]))]
        rest = np.flatnonzero(~(cost <= bound))  # NaN-safe complement
        yield rest[np.lexsort((lo[rest], cost[rest]))]
        return
    yield np.lexsort((lo, cost))


Candidate = tuple[float, list[tuple[int, int]], float]
"""A merge: its dataset NCP, its spans, an upper bound of the merged sub-bag's support (``inf``: none)."""

_WINDOW = 4
"""Sibling leaves priced on each side of a rare block beyond the first merge that could reach k."""


def _sibling_merges(
    data: _Data, b: int, last: I64, cut: _Cut, extent: float, total: int, k: int
) -> Iterator[Candidate]:
    """Block ``b`` merged with each other current block of the leaves ``last``, cheapest first.

    The order is that of pricing every sibling at once and sorting by (NCP, ``lo``, position),
    but siblings are priced nearest first, in windows growing eightfold (the first reaching
    just past the nearest merge on each side that holds ``k`` item occurrences): merging with a block
    further away covers a superset of the values, so its exact cost is no smaller (S002 §3.3:
    every value of a wider range costs at least as much). A candidate of a window is final
    once its computed cost is below the outermost candidates' by more than the floating-point
    error of the prefix sums (bounded in units of the roundoff); the last window is everything.
    After the first candidate, those holding fewer than ``k`` item occurrences (so fewer than
    ``k`` records) are left out: they cannot be taken.
    """
    b_end = data.end_of(b)
    n_left = int(np.searchsorted(last, b, "left"))  # leaves before b's block
    n_right = len(last) - int(np.searchsorted(last, b_end, "right"))  # leaves after it
    # First windows: past the nearest sibling on each side whose merge holds k occurrences.
    cum_cnt = data.cum_cnt
    wl = wr = _WINDOW
    lo_k = int(np.searchsorted(cum_cnt, float(cum_cnt[b_end + 1]) - k, "right")) - 1
    if 0 <= lo_k < b:
        wl += n_left - int(np.searchsorted(last, int(data.block_of[lo_k]), "left"))
    hi_k = int(np.searchsorted(cum_cnt, float(cum_cnt[b]) + k, "left")) - 1
    if b_end < hi_k < len(data.vals):
        wr += int(np.searchsorted(last, hi_k, "right")) - (len(last) - n_right)
    n_done = 0  # length of the final prefix of the order already handed out (or left out)
    while True:
        near = np.concatenate([last[max(0, n_left - wl) : n_left], last[len(last) - n_right :][:wr]])
        sib = _distinct_sorted(data.block_of[near])  # blocks only merge, so block_of keeps the order
        if sib.size == 0:
            return
        cost, lo, hi, occurrences, x = _price_merges(data, b, b_end, sib, cut, extent, total)
        outer = ([float(x[0])] if n_left > wl else []) + ([float(x[-1])] if n_right > wr else [])
        if outer:
            u = 2.0**-53
            scale = float(data.cum_cnt[-1])  # every prefix sum and price is at most the alive occurrences
            margin = 12 * (len(data.vals) + 4) * u * scale + 8 * u * (scale + max(abs(v) for v in outer))
            final = np.flatnonzero(cost < (min(outer) - margin) / total)
        else:
            final = np.arange(cost.size)
        pos = 0
        for part in _cheapest_first(cost[final], lo[final]):
            sel = final[part]
            at = np.arange(pos, pos + sel.size)
            pos += sel.size
            sel = sel[(at >= n_done) & ((occurrences[sel] >= k) | (at == 0))]
            cols = (cost[sel].tolist(), lo[sel].tolist(), hi[sel].tolist(), occurrences[sel].tolist())
            for c, a, z, occ in zip(*cols, strict=True):
                yield c, [(a, z)], occ
        if not outer:
            return
        n_done = max(n_done, final.size)
        wl, wr = 8 * wl, 8 * wr


def _price_merges(
    data: _Data, b: int, b_end: int, sib: I64, cut: _Cut, extent: float, total: int
) -> tuple[F64, I64, I64, F64, F64]:
    """Cost (dataset NCP), span and item occurrences of merging block ``b`` with each block of ``sib``."""
    s_end = data.block_end[sib]
    lo = np.minimum(b, sib)
    hi = np.maximum(b_end, s_end)
    width = (data.vals[hi] - data.vals[lo]).astype(np.float64)
    occurrences = data.cum_cnt[hi + 1] - data.cum_cnt[lo]
    new = occurrences * np.minimum(1.0, width / extent)
    x = new - (cut.cum[hi + 1] - cut.cum[lo])
    cost = x / total
    return cost, lo, hi, occurrences, x


def _acd_candidates(
    data: _Data,
    f: Itemset,
    img: Itemset,
    by_prefix: dict[Itemset, list[Itemset]],
    ell: int,
    cut: _Cut,
    extent: float,
    last_cache: dict[Itemset, I64],
    k: int = 0,
) -> Iterator[Candidate]:
    """Merges at level ``ell``, cheapest first: ``img`` with another leaf under ``f``'s prefix, position by position.

    Sibling merges (``ell`` = ``len(f)``) that cannot reach support ``k`` are left out after
    the first one.
    """
    total = max(data.total_items, 1)
    leaves = by_prefix.get(f[: ell - 1], [])
    i = len(f)
    if ell == i:  # siblings of the leaf: one merge each
        key = f[: ell - 1]
        last = last_cache.get(key)
        if last is None:
            last = last_cache[key] = np.unique(np.fromiter((leaf[-1] for leaf in leaves), np.int64, len(leaves)))
        yield from _sibling_merges(data, img[-1], last, cut, extent, total, k)
        return
    seen: set[tuple[tuple[int, int], ...]] = set()
    out: list[tuple[float, list[tuple[int, int]]]] = []
    block_of = data.block_of
    for leaf in leaves:
        other = tuple(int(block_of[x]) for x in leaf)
        if other[ell - 1] == img[ell - 1]:
            continue
        pairs = tuple(
            sorted((min(a, b), max(a, b)) for a, b in zip(img[ell - 1 :], other[ell - 1 :], strict=True) if a != b)
        )
        if pairs in seen:
            continue
        seen.add(pairs)
        spans = _union([(lo, data.end_of(hi)) for lo, hi in pairs])
        out.append((_merge_cost(data, cut, spans, extent) / total, spans))
    out.sort(key=lambda c: (c[0], c[1]))
    for c, spans in out:
        yield c, spans, math.inf


def _merge_cost(data: _Data, cut: _Cut, spans: Sequence[tuple[int, int]], extent: float) -> float:
    total = 0.0
    for lo, hi in spans:
        width = float(data.vals[hi] - data.vals[lo])
        total += data.count_in(lo, hi) * min(1.0, width / extent) - cut.old(lo, hi)
    return total


def _neighbour_merge(data: _Data, img: Itemset, cut: _Cut, extent: float) -> tuple[float, list[tuple[int, int]]] | None:
    """Cheapest merge of one of ``img``'s blocks with an adjacent block (progress when no sibling exists)."""
    best: tuple[float, list[tuple[int, int]]] | None = None
    for b in set(img):
        j = int(np.searchsorted(data.block_starts, b))
        for nb in (j - 1, j + 1):
            if 0 <= nb < len(data.block_starts):
                lo = int(min(data.block_starts[j], data.block_starts[nb]))
                hi = int(max(data.block_ends[j], data.block_ends[nb]))
                c = _merge_cost(data, cut, [(lo, hi)], extent)
                if best is None or c < best[0]:
                    best = (c, [(lo, hi)])
    return best


def _support_after(data: _Data, img: Itemset, spans: Sequence[tuple[int, int]]) -> int:
    tokens = []
    for b in img:
        for lo, hi in spans:
            if lo <= b <= hi:
                tokens.append((lo, hi))
                break
        else:
            tokens.append((b, data.end_of(b)))
    return data.support(tokens)


# -- AA --------------------------------------------------------------------------------------
def _aa_ext(data: _Data, h: FixedHierarchy) -> F64:
    """NCP of a node at each level ``0..height`` (the top ``*`` is 1)."""
    extent = max(data.extent, 1.0)
    return np.array([min(1.0, h.node_extent(lv) / extent) for lv in range(h.height)] + [1.0])


def _node_span(data: _Data, h: FixedHierarchy, b: int, level: int) -> tuple[int, int]:
    if level >= h.height:
        return 0, len(data.vals) - 1
    lo_v, hi_v = h.node_range(data.vals[b : b + 1], level)
    lo = int(np.searchsorted(data.vals, lo_v[0], "left"))
    hi = int(np.searchsorted(data.vals, hi_v[0], "right")) - 1
    return lo, hi


def _aa(data: _Data, h: FixedHierarchy, k: int, m: int, budget: int) -> None:
    ext = _aa_ext(data, h)

    def fix(f: Itemset, img: Itemset, counts: Counter[Itemset], holders: npt.NDArray[np.intp]) -> bool:
        return _aa_fix(data, h, ext, img, holders, k, budget)

    _run(data, k, m, fix)


def _aa_fix(
    data: _Data, h: FixedHierarchy, ext: F64, img: Itemset, holders: npt.NDArray[np.intp], k: int, budget: int
) -> bool:
    """Raise ``img``'s items to the cheapest combination of levels that makes it frequent.

    Suppressing its holders competes as in ACD. Returns whether records were suppressed.
    """
    cut = _Cut(data, ext[data.level])
    total = max(data.total_items, 1)
    sup_cost = cut.suppression(holders) / total if _can_suppress(data, holders, budget) else math.inf
    distinct = sorted(set(img))
    choices = [range(int(data.level[b]), h.height + 1) for b in distinct]
    cands: list[tuple[float, tuple[int, ...], list[tuple[int, int, int]]]] = []
    for levels in itertools.product(*choices):
        if all(lv == int(data.level[b]) for lv, b in zip(levels, distinct, strict=True)):
            continue
        nodes = _maximal([(*_node_span(data, h, b, lv), lv) for b, lv in zip(distinct, levels, strict=True)])
        cost = sum(data.count_in(lo, hi) * float(ext[lv]) - cut.old(lo, hi) for lo, hi, lv in nodes)
        cands.append((cost / total, levels, nodes))
    cands.sort(key=lambda c: (c[0], c[1]))
    for ncp, _, nodes in cands:
        if ncp > sup_cost:
            break
        tokens = [next(((lo, hi) for lo, hi, _ in nodes if lo <= b <= hi), (b, data.end_of(b))) for b in img]
        if data.support(tokens) >= k:
            _apply_merges(data, [(lo, hi) for lo, hi, _ in nodes])
            for lo, hi, lv in nodes:
                data.level[lo : hi + 1] = lv
            return False
    if math.isfinite(sup_cost):
        _suppress_rows(data, holders)
        return True
    raise _unsatisfiable(budget)


def _maximal(nodes: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Drop hierarchy nodes contained in others (nodes are nested or disjoint)."""
    out: list[tuple[int, int, int]] = []
    for lo, hi, lv in sorted(nodes, key=lambda n: (n[0], -n[1])):
        if out and lo >= out[-1][0] and hi <= out[-1][1]:
            continue
        out.append((lo, hi, lv))
    return out


# -- entry point -----------------------------------------------------------------------------
def anonymize_km(
    records: Sequence[Sequence[int]],
    *,
    k: int,
    m: int = 2,
    algorithm: KmAlgorithm | str = KmAlgorithm.ACD,
    hierarchy: FixedHierarchy | None = None,
    item_format: ItemFormat | None = None,
    ncp_threshold: float = 1.0,
    max_suppression: float = 0.0,
) -> KmRelease:
    """k^m-anonymize bags of integer items by global recoding (CONCEPTS §8.15).

    ``hierarchy`` is AA's fixed hierarchy (required for ``aa``); ``item_format`` writes the
    released items (default plain integers). ``ncp_threshold`` is ACD's ``d`` ⚠ (a merge is
    accepted only below it; 1.0 accepts any). At most ``floor(max_suppression · n)`` records
    are suppressed; more raises :class:`KmUnsatisfiable`.
    """
    algo = KmAlgorithm(algorithm)
    if k < 1 or m < 1:
        raise KmError("k and m: must be integers ≥ 1")
    if not 0.0 <= max_suppression <= 1.0:
        raise KmError("max_suppression: must be within [0, 1]")
    if algo is KmAlgorithm.AA and hierarchy is None:
        raise KmError("aa: needs a fixed hierarchy")
    fmt: ItemFormat = item_format if item_format is not None else NumberFormat()
    n = len(records)
    budget = math.floor(max_suppression * n + 1e-9)
    if not any(len(r) for r in records):
        return KmRelease(tuple(() for _ in records), algo, k, m, 0, 0.0, None, 0)  # nothing to protect
    data = _Data(records)
    if algo is KmAlgorithm.ACD:
        _acd(data, k, m, ncp_threshold, budget)
    else:
        assert hierarchy is not None
        _aa(data, hierarchy, k, m, budget)
    return _release(data, algo, k, m, hierarchy, fmt)


def _release(
    data: _Data, algo: KmAlgorithm, k: int, m: int, hierarchy: FixedHierarchy | None, fmt: ItemFormat
) -> KmRelease:
    labels: dict[int, str] = {}
    ncp_of: dict[int, float] = {}
    extent = max(data.extent, 1.0)

    def describe(b: int) -> None:  # written form and NCP of the block starting at b
        e = data.end_of(b)
        if algo is KmAlgorithm.AA:
            assert hierarchy is not None
            lv = int(data.level[b])
            if lv >= hierarchy.height:
                labels[b], ncp_of[b] = "*", 1.0
            else:
                labels[b] = hierarchy.label(int(data.vals[b]), lv)
                ncp_of[b] = min(1.0, hierarchy.node_extent(lv) / extent)
        elif b == e:
            labels[b], ncp_of[b] = fmt.exact(int(data.vals[b])), 0.0
        else:
            labels[b] = fmt.range(int(data.vals[b]), int(data.vals[e]))
            ncp_of[b] = min(1.0, float(data.vals[e] - data.vals[b]) / extent)

    block_of = data.block_of.tolist()
    out: list[tuple[str, ...] | None] = []
    total = generalized = 0
    loss = 0.0
    for r, rec in enumerate(data.recs):
        if not data.alive[r]:
            out.append(None)
            total += len(rec)
            loss += len(rec)  # a suppressed item is fully generalized
            continue
        blocks = [block_of[v] for v in rec]
        for b in blocks:
            if b not in labels:
                describe(b)
        out.append(tuple(sorted(labels[b] for b in blocks)))
        total += len(blocks)
        loss += sum(ncp_of[b] for b in blocks)
        generalized += sum(1 for b in blocks if ncp_of[b] > 0 or labels[b] == "*")
    k_achieved: int | None = None
    for i in range(1, m + 1):
        counts = data.count_subbags(i)
        if counts:
            low = min(counts.values())
            k_achieved = low if k_achieved is None else min(k_achieved, low)
    if k_achieved is not None and k_achieved < k:  # pragma: no cover - the loops above guarantee it
        raise AssertionError("k^m-anonymization left a rare sub-bag")
    suppressed = data.n_suppressed()
    return KmRelease(tuple(out), algo, k, m, suppressed, loss / total if total else 0.0, k_achieved, generalized)


def release_places(
    bags: Sequence[Sequence[str]],
    *,
    k: int,
    m: int = 2,
    algorithm: KmAlgorithm | str = KmAlgorithm.ACD,
    ncp_threshold: float = 1.0,
    max_suppression: float = 0.01,
) -> KmRelease:
    """k^m-anonymize bags of geohash cells of one precision (the ``places`` table, contract §8).

    AA uses the geohash-prefix hierarchy; ACD ranges are written ``[wx4g0b7,wx4g0c3)``.
    """
    lengths = {len(c) for bag in bags for c in bag}
    if len(lengths) > 1:
        raise KmError("places: every cell must have the same geohash precision")
    precision = lengths.pop() if lengths else 7
    records = [[geohash.code_of(c) for c in bag] for bag in bags]
    return anonymize_km(
        records,
        k=k,
        m=m,
        algorithm=algorithm,
        hierarchy=GeohashPrefixHierarchy(precision),
        item_format=GeohashFormat(precision),
        ncp_threshold=ncp_threshold,
        max_suppression=max_suppression,
    )


__all__ = [
    "FixedHierarchy",
    "GeohashFormat",
    "GeohashPrefixHierarchy",
    "IntervalHierarchy",
    "ItemFormat",
    "KmAlgorithm",
    "KmError",
    "KmRelease",
    "KmUnsatisfiable",
    "NumberFormat",
    "anonymize_km",
    "release_places",
]
