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
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import numpy as np
import numpy.typing as npt

from cloaking import geohash

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

Itemset = tuple[int, ...]
"""A sub-bag as block ids (block start indices), in the count tree's order."""


class KmAlgorithm(StrEnum):
    """``--algorithm`` values of the ``places`` table (contract §8)."""

    ACD = "acd"
    AA = "aa"


class KmError(ValueError):
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

    Items are the integer codes of :mod:`cloaking.geohash`; level ``j`` drops ``j`` characters.
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


class _Data:
    """Records as sorted value indices, postings per distinct value, and the current cut."""

    def __init__(self, records: Sequence[Sequence[int]]) -> None:
        flat = np.fromiter((v for r in records for v in r), np.int64)
        self.vals: I64 = np.unique(flat)
        self.n_records = len(records)
        self.recs: list[I64] = [np.sort(np.searchsorted(self.vals, np.asarray(r, np.int64))) for r in records]
        rec_of = np.repeat(np.arange(self.n_records), [len(r) for r in records])
        vi = np.searchsorted(self.vals, flat)
        pair = vi.astype(np.int64) * max(self.n_records, 1) + rec_of
        uniq, mult = np.unique(pair, return_counts=True)
        self.post_val = uniq // max(self.n_records, 1)
        self.post_rec = uniq % max(self.n_records, 1)
        self.post_mul = mult.astype(np.int64)
        self.post_ptr = np.searchsorted(self.post_val, np.arange(len(self.vals) + 1))
        self.alive = np.ones(self.n_records, bool)
        self.total_items = len(flat)
        self.extent = float(self.vals[-1] - self.vals[0]) if len(self.vals) else 0.0
        self.starts = np.ones(len(self.vals), bool)  # block boundaries of the cut
        self.level = np.zeros(len(self.vals), np.int64)  # AA: hierarchy level of each value's block
        self.refresh()

    def refresh(self) -> None:
        """Recompute counts of alive occurrences and block bookkeeping after a change."""
        alive_post = self.alive[self.post_rec]
        self.cnt = np.bincount(self.post_val[alive_post], weights=self.post_mul[alive_post], minlength=len(self.vals))
        self.cum_cnt = np.concatenate([[0.0], np.cumsum(self.cnt)])
        self.block_starts = np.flatnonzero(self.starts)
        self.block_ends = np.append(self.block_starts[1:] - 1, len(self.vals) - 1)
        self.block_of = np.maximum.accumulate(np.where(self.starts, np.arange(len(self.vals)), 0))

    def end_of(self, b: int) -> int:
        return int(self.block_ends[np.searchsorted(self.block_starts, b)])

    def count_in(self, lo: int, hi: int) -> float:
        return float(self.cum_cnt[hi + 1] - self.cum_cnt[lo])

    def support(self, tokens: Sequence[tuple[int, int]]) -> int:
        """Alive records holding the bag of value-index ranges ``tokens`` (with repeats)."""
        need = Counter(tokens)
        ok = self.alive.copy()
        for (lo, hi), c in need.items():
            a, b = self.post_ptr[lo], self.post_ptr[hi + 1]
            per_rec = np.bincount(self.post_rec[a:b], weights=self.post_mul[a:b], minlength=self.n_records)
            ok &= per_rec >= c
        return int(np.count_nonzero(ok))

    def holders(self, tokens: Sequence[tuple[int, int]]) -> npt.NDArray[np.intp]:
        need = Counter(tokens)
        ok = self.alive.copy()
        for (lo, hi), c in need.items():
            a, b = self.post_ptr[lo], self.post_ptr[hi + 1]
            per_rec = np.bincount(self.post_rec[a:b], weights=self.post_mul[a:b], minlength=self.n_records)
            ok &= per_rec >= c
        return np.flatnonzero(ok)

    def count_subbags(self, i: int) -> Counter[Itemset]:
        """Supports of every ``i``-sub-bag of the generalized alive records (the count tree's level ``i``).

        Items of a record are ordered by their block's support (descending), then by value, so
        that sub-bags sharing frequent prefixes share tree paths (S002 §3.2).
        """
        order = self._order_keys()
        counts: Counter[Itemset] = Counter()
        for r, rec in enumerate(self.recs):
            if not self.alive[r] or len(rec) < i:
                continue
            blocks = self.block_of[rec]
            toks = sorted(blocks.tolist(), key=order.__getitem__)
            counts.update(set(itertools.combinations(toks, i)))
        return counts

    def _order_keys(self) -> dict[int, tuple[int, int]]:
        ones: Counter[int] = Counter()
        for r, rec in enumerate(self.recs):
            if self.alive[r]:
                ones.update(set(self.block_of[rec].tolist()))
        return {b: (-ones.get(b, 0), b) for b in self.block_starts.tolist()}

    def current(self, b: int) -> int:
        """The current block holding value index ``b`` (blocks only merge)."""
        return int(self.block_of[b])


def _apply_merges(data: _Data, spans: Sequence[tuple[int, int]]) -> None:
    """Global recoding: every value in each span ``[lo, hi]`` (aligned with blocks) becomes one block."""
    for lo, hi in spans:
        data.starts[lo + 1 : hi + 1] = False
        data.starts[lo] = True
        if hi + 1 < len(data.starts):
            data.starts[hi + 1] = True
    data.refresh()


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
        """NCP added by suppressing ``rows``: each of their items goes to 1."""
        return float(sum(float(np.sum(1.0 - self.ncp_v[self.data.recs[r]])) for r in rows.tolist()))


def _suppress_rows(data: _Data, rows: npt.NDArray[np.intp]) -> None:
    data.alive[rows] = False
    data.refresh()


def _can_suppress(data: _Data, rows: npt.NDArray[np.intp], budget: int) -> bool:
    return int(np.count_nonzero(~data.alive)) + len(rows) <= budget


def _unsatisfiable(budget: int) -> KmUnsatisfiable:
    return KmUnsatisfiable(
        f"k^m-anonymity needs more than {budget} suppressed records (max_suppression); "
        "lower k or m, or allow more suppression"
    )


def _run(data: _Data, k: int, m: int, fix: Callable[[Itemset, Itemset, Counter[Itemset]], bool]) -> None:
    """The apriori loop shared by ACD and AA (S002 Alg. 2): sizes ``1..m``, recount until no rare sub-bag.

    ``fix(f, image, counts)`` repairs one rare sub-bag and returns whether records were
    suppressed (supports then drop, so the loop restarts at size 1).
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
            if data.support([(b, data.end_of(b)) for b in img]) >= k:
                continue  # fixed by an earlier rule of this pass
            if fix(f, img, counts):
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


def _acd(data: _Data, k: int, m: int, d: float, budget: int) -> None:
    tree: list[Counter[Itemset]] = []
    by_prefix: dict[Itemset, list[Itemset]] = {}
    last_cache: dict[Itemset, I64] = {}

    def fix(f: Itemset, img: Itemset, counts: Counter[Itemset]) -> bool:
        if not tree or tree[0] is not counts:  # a new count tree: index its leaves by prefix
            tree[:] = [counts]
            by_prefix.clear()
            last_cache.clear()
            for leaf in counts:
                for ell in range(1, len(leaf) + 1):
                    by_prefix.setdefault(leaf[: ell - 1], []).append(leaf)
        return _acd_fix(data, f, img, by_prefix, last_cache, k, d, budget)

    _run(data, k, m, fix)


def _acd_fix(
    data: _Data,
    f: Itemset,
    img: Itemset,
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
    cut = _Cut(data, _acd_ncp(data))
    total = max(data.total_items, 1)
    extent = max(data.extent, 1.0)
    holders = data.holders([(b, data.end_of(b)) for b in img])
    sup_cost = cut.suppression(holders) / total if _can_suppress(data, holders, budget) else math.inf
    i = len(f)
    fallback: tuple[float, list[tuple[int, int]]] | None = None
    for ell in range(i, 0, -1):
        cheapest: tuple[float, list[tuple[int, int]]] | None = None
        for ncp, spans in _acd_candidates(data, f, img, by_prefix, ell, cut, extent, last_cache):
            cheapest = cheapest or (ncp, spans)
            if _support_after(data, img, spans) >= k:
                if ncp < d or ell == 1:
                    if sup_cost < ncp:
                        _suppress_rows(data, holders)
                        return True
                    _apply_merges(data, spans)
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
    _apply_merges(data, fallback[1])  # no merge suffices yet: take the cheapest step and recount
    return False


def _acd_candidates(
    data: _Data,
    f: Itemset,
    img: Itemset,
    by_prefix: dict[Itemset, list[Itemset]],
    ell: int,
    cut: _Cut,
    extent: float,
    last_cache: dict[Itemset, I64],
) -> Iterator[tuple[float, list[tuple[int, int]]]]:
    """Merges at level ``ell``, cheapest first: ``img`` with another leaf under ``f``'s prefix, position by position."""
    total = max(data.total_items, 1)
    leaves = by_prefix.get(f[: ell - 1], [])
    i = len(f)
    if ell == i:  # siblings of the leaf: one merge each, priced all at once
        key = f[: ell - 1]
        last = last_cache.get(key)
        if last is None:
            last = last_cache[key] = np.unique(np.fromiter((leaf[-1] for leaf in leaves), np.int64, len(leaves)))
        sib = np.unique(data.block_of[last])
        sib = sib[sib != img[-1]]
        if sib.size == 0:
            return
        b, b_end = img[-1], data.end_of(img[-1])
        s_end = data.block_ends[np.searchsorted(data.block_starts, sib)]
        lo = np.minimum(b, sib)
        hi = np.maximum(b_end, s_end)
        width = (data.vals[hi] - data.vals[lo]).astype(np.float64)
        new = (data.cum_cnt[hi + 1] - data.cum_cnt[lo]) * np.minimum(1.0, width / extent)
        cost = (new - (cut.cum[hi + 1] - cut.cum[lo])) / total
        for j in np.lexsort((lo, cost)).tolist():
            yield float(cost[j]), [(int(lo[j]), int(hi[j]))]
        return
    seen: set[tuple[tuple[int, int], ...]] = set()
    out: list[tuple[float, list[tuple[int, int]]]] = []
    for leaf in leaves:
        other = tuple(data.current(x) for x in leaf)
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
    yield from out


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

    def fix(f: Itemset, img: Itemset, counts: Counter[Itemset]) -> bool:
        return _aa_fix(data, h, ext, img, k, budget)

    _run(data, k, m, fix)


def _aa_fix(data: _Data, h: FixedHierarchy, ext: F64, img: Itemset, k: int, budget: int) -> bool:
    """Raise ``img``'s items to the cheapest combination of levels that makes it frequent.

    Suppressing its holders competes as in ACD. Returns whether records were suppressed.
    """
    cut = _Cut(data, ext[data.level])
    total = max(data.total_items, 1)
    holders = data.holders([(b, data.end_of(b)) for b in img])
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
    for b, e in zip(data.block_starts.tolist(), data.block_ends.tolist(), strict=True):
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
    out: list[tuple[str, ...] | None] = []
    total = generalized = 0
    loss = 0.0
    for r, rec in enumerate(data.recs):
        if not data.alive[r]:
            out.append(None)
            total += len(rec)
            loss += len(rec)  # a suppressed item is fully generalized
            continue
        blocks = data.block_of[rec].tolist()
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
    suppressed = int(np.count_nonzero(~data.alive))
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
