"""Full-domain generalization over the lattice of hierarchy levels: Samarati, Incognito, OLA (CONCEPTS §8.4–§8.7).

A node is a vector of levels, one per QI. Evaluating a node groups the rows by their generalized codes, asks
the criteria about every class, and suppresses the rows of failing classes (AG_TS model); the node is
*feasible* when at most MaxSup rows are suppressed. The three searches share :class:`LatticeProblem` and differ
only in how they walk the lattice and which feasible node they return.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import Unsatisfiable
from kcloak.cloaking.tabular._table import Outcome, Table
from kcloak.cloaking.tabular.hierarchy import EncodedHierarchy, factorize
from kcloak.cloaking.tabular.metrics import discernibility

IntArray = npt.NDArray[np.int64]
Node = tuple[int, ...]
OlaMetric = Literal["prec", "height", "discernibility"]


@dataclass(frozen=True, slots=True)
class NodeResult:
    """Evaluation of one (sub-)lattice node: class labels, which classes are released, suppressed rows."""

    group_ids: IntArray
    released_class: npt.NDArray[np.bool_]
    sizes: IntArray
    suppressed: int
    feasible: bool


@dataclass(slots=True)
class LatticeProblem:
    """The lattice of a table's QI hierarchies with a cache of evaluated nodes (CONCEPTS §8.4)."""

    table: Table
    encoded: tuple[EncodedHierarchy, ...] = field(init=False)
    heights: tuple[int, ...] = field(init=False)
    evaluations: int = 0
    _cache: dict[tuple[tuple[int, ...], Node], NodeResult] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.encoded = self.table.encoded()
        self.heights = tuple(e.height for e in self.encoded)

    @property
    def top(self) -> Node:
        return self.heights

    @property
    def bottom(self) -> Node:
        return tuple(0 for _ in self.heights)

    def evaluate(self, node: Node, attrs: Sequence[int] | None = None) -> NodeResult:
        """Group rows by the generalized values of ``attrs`` (default all QIs) at ``node`` and count suppression."""
        attrs_t = tuple(range(len(self.heights))) if attrs is None else tuple(attrs)
        key = (attrs_t, node)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        self.evaluations += 1
        n = self.table.n
        gid = np.zeros(n, dtype=np.int64)
        for a, level in zip(attrs_t, node, strict=True):
            codes = self.encoded[a].codes[level]
            if n:
                gid = factorize(gid * (int(codes.max()) + 1) + codes)
        n_groups = int(gid.max()) + 1 if n else 0
        sizes = np.bincount(gid, minlength=n_groups).astype(np.int64)
        crit = self.table.criteria
        ok = crit.accepts(sizes, crit.counts_of(gid, n_groups))
        if crit.t_criterion is not None:
            # t-closeness is measured against the released rows (their distribution and, for ordered values,
            # their domain): suppressing classes moves both, so re-check until the released set is stable.
            # Every round that does not stop drops at least one class, so this ends within n_groups rounds.
            while True:
                released_rows = np.flatnonzero(ok[gid])
                if len(released_rows) == 0:
                    break
                rebased = crit.rebased(released_rows)
                again = ok & rebased.accepts(sizes, rebased.counts_of(gid, n_groups))
                if np.array_equal(again, ok):
                    break
                ok = again
        suppressed = int(sizes[~ok].sum())
        result = NodeResult(gid, ok, sizes, suppressed, suppressed <= self.table.max_sup)
        self._cache[key] = result
        return result

    def suppression(self, node: Node, attrs: Sequence[int] | None = None) -> int:
        return self.evaluate(node, attrs).suppressed

    def feasible(self, node: Node, attrs: Sequence[int] | None = None) -> bool:
        return self.evaluate(node, attrs).feasible

    def vectors_at_height(self, h: int, low: Node | None = None, high: Node | None = None) -> Iterator[Node]:
        """All nodes ``low ≤ v ≤ high`` with ``Σ v = h`` in lexicographic order."""
        lo = self.bottom if low is None else low
        hi = self.top if high is None else high

        def rec(i: int, remaining: int, prefix: tuple[int, ...]) -> Iterator[Node]:
            if i == len(lo):
                if remaining == 0:
                    yield prefix
                return
            rest_lo = sum(lo[i + 1 :])
            rest_hi = sum(hi[i + 1 :])
            for v in range(lo[i], hi[i] + 1):
                if rest_lo <= remaining - v <= rest_hi:
                    yield from rec(i + 1, remaining - v, (*prefix, v))

        yield from rec(0, h, ())

    def prec_loss(self, node: Node) -> float:
        """Mean of level/height over the QIs (CONCEPTS §8.7)."""
        return sum(v / h if h else 0.0 for v, h in zip(node, self.heights, strict=True)) / max(1, len(node))

    def dm(self, node: Node) -> float:
        res = self.evaluate(node)
        kept = res.sizes[res.released_class]
        return discernibility(kept.tolist(), self.table.n, res.suppressed)

    def outcome(self, node: Node) -> Outcome:
        """The released classes of ``node`` with their written forms (global recoding)."""
        res = self.evaluate(node)
        if not res.feasible:
            raise Unsatisfiable("the criteria cannot be met within the suppression budget")
        order = np.argsort(res.group_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(res.group_ids[order])) + 1
        groups = np.split(order, bounds) if len(order) else []
        classes: list[IntArray] = []
        written: list[dict[str, str]] = []
        ncp: list[float] = []
        modified = 0
        suppressed: list[IntArray] = []
        qis = self.table.qis
        for g in groups:
            if not res.released_class[res.group_ids[g[0]]]:
                suppressed.append(g)
                continue
            rep = int(g[0])
            cells: dict[str, str] = {}
            loss = 0.0
            for a, (qi, enc) in enumerate(zip(qis, self.encoded, strict=True)):
                level = node[a]
                strings = enc.write(level, rep)
                cells.update(zip(qi.columns, strings, strict=True))
                loss += enc.ncp(level, rep)
                if level > 0:
                    modified += _changed_cells(enc, level, g, strings)
            classes.append(g)
            written.append(cells)
            ncp.append(loss / len(qis))
        sup = np.concatenate(suppressed) if suppressed else np.zeros(0, dtype=np.int64)
        return Outcome(classes, written, sup, ncp, [node] * len(classes), self.heights, modified)


def _changed_cells(enc: EncodedHierarchy, level: int, rows: IntArray, strings: tuple[str, ...]) -> int:
    """Released cells of ``rows`` whose written form differs from the exact one (CONCEPTS §8.16)."""
    changed = 0
    for r in rows.tolist():
        exact = enc.write(0, r)
        changed += sum(1 for a, b in zip(exact, strings, strict=True) if a != b)
    return changed


# --------------------------------------------------------------------------- Samarati (§8.5)


@dataclass(frozen=True, slots=True)
class SamaratiResult:
    node: Node
    trace: tuple[tuple[int, tuple[Node, ...]], ...]  # (height tried, feasible vectors at it)


def samarati(problem: LatticeProblem) -> SamaratiResult:
    """Binary search on the lattice height for the lowest height with a feasible vector [S001 §4.1].

    Among the feasible vectors of the final height the one with least suppression is returned (ties: the
    lexicographically smallest), a minimum-absolute-distance k-minimal generalization.
    """
    low, high = 0, sum(problem.heights)
    sol: Node | None = None
    trace: list[tuple[int, tuple[Node, ...]]] = []
    while low < high:
        h = (low + high) // 2
        ok = tuple(v for v in problem.vectors_at_height(h) if problem.feasible(v))
        trace.append((h, ok))
        if ok:
            sol = min(ok, key=lambda v: (problem.suppression(v), v))
            high = h
        else:
            low = h + 1
    if sol is None:
        if not problem.feasible(problem.top):
            raise Unsatisfiable("even the fully generalized table violates the criteria beyond the suppression budget")
        sol = problem.top
    return SamaratiResult(sol, tuple(trace))


# --------------------------------------------------------------------------- Incognito (§8.6)


@dataclass(frozen=True, slots=True)
class IncognitoResult:
    satisfying: frozenset[Node]  # all feasible full-QI nodes
    minimal: tuple[Node, ...]
    per_subset: dict[tuple[int, ...], frozenset[Node]]
    checked: dict[tuple[int, ...], tuple[Node, ...]]  # nodes actually evaluated per subset, in order


def _dominates(w: Node, v: Node) -> bool:
    return all(a >= b for a, b in zip(w, v, strict=True))


def minimal_nodes(nodes: Sequence[Node] | frozenset[Node]) -> tuple[Node, ...]:
    """Nodes with no other node of the set componentwise below them, sorted."""
    s = set(nodes)
    return tuple(sorted(n for n in s if not any(m != n and _dominates(n, m) for m in s)))


def incognito(problem: LatticeProblem) -> IncognitoResult:
    """Bottom-up search of the lattices of all QI subsets with subset and generalization pruning [S000 §3.1]."""
    q = len(problem.heights)
    good: dict[tuple[int, ...], frozenset[Node]] = {}
    checked: dict[tuple[int, ...], tuple[Node, ...]] = {}
    for size in range(1, q + 1):
        for subset in itertools.combinations(range(q), size):
            ranges = [range(problem.heights[a] + 1) for a in subset]
            nodes = [
                v
                for v in itertools.product(*ranges)
                if size == 1
                or all(
                    tuple(x for j, x in enumerate(v) if j != drop)
                    in good[tuple(a for a in subset if a != subset[drop])]
                    for drop in range(size)
                )
            ]
            sat: set[Node] = set()
            evaluated: list[Node] = []
            for v in sorted(nodes, key=lambda v: (sum(v), v)):
                if v in sat:
                    continue
                evaluated.append(v)
                if problem.feasible(v, subset):
                    sat |= {w for w in nodes if _dominates(w, v)}
            good[subset] = frozenset(sat)
            checked[subset] = tuple(evaluated)
    full = good[tuple(range(q))]
    return IncognitoResult(full, minimal_nodes(full), good, checked)


# --------------------------------------------------------------------------- OLA (§8.7)


@dataclass(frozen=True, slots=True)
class OlaResult:
    node: Node
    k_minimal: tuple[Node, ...]
    evaluations: int


def ola(problem: LatticeProblem, metric: OlaMetric = "prec") -> OlaResult:
    """Find all k-minimal nodes by binary search with predictive tagging, return the cheapest [S003 §4.2].

    Tags are kept implicitly: a node above a known feasible node is feasible, one below a known infeasible
    node is infeasible; only untagged nodes are evaluated.
    """
    good: list[Node] = []
    bad: list[Node] = []
    tags: dict[Node, bool] = {}

    def test(n: Node) -> bool:
        if n in tags:
            return tags[n]
        if any(_dominates(n, g) for g in good):
            result = True
        elif any(_dominates(b, n) for b in bad):
            result = False
        else:
            result = problem.feasible(n)
            (good if result else bad).append(n)
        tags[n] = result
        return result

    kmin: set[Node] = set()
    visited: set[tuple[Node, Node]] = set()

    def search(bottom: Node, top: Node) -> None:
        if (bottom, top) in visited:
            return
        visited.add((bottom, top))
        hb, ht = sum(bottom), sum(top)
        if ht - hb <= 1:
            for n in (bottom, top):
                if test(n):
                    kmin.add(n)
                    return
            return
        mid = (hb + ht) // 2
        for n in problem.vectors_at_height(mid, bottom, top):
            if test(n):
                search(bottom, n)
            else:
                search(n, top)

    search(problem.bottom, problem.top)
    minimal = minimal_nodes(frozenset(kmin))
    if not minimal:
        raise Unsatisfiable("even the fully generalized table violates the criteria beyond the suppression budget")
    cost: Callable[[Node], float] = {
        "prec": problem.prec_loss,
        "height": lambda n: float(sum(n)),
        "discernibility": problem.dm,
    }[metric]
    best = min(minimal, key=lambda n: (cost(n), sum(n), n))
    return OlaResult(best, minimal, problem.evaluations)


# --------------------------------------------------------------------------- entry points


def run_samarati(table: Table, rng: np.random.Generator) -> Outcome:
    problem = LatticeProblem(table)
    return problem.outcome(samarati(problem).node)


def run_incognito(table: Table, rng: np.random.Generator) -> Outcome:
    """Incognito returns every feasible node; kcloak releases the lowest one (least suppression, then order)."""
    problem = LatticeProblem(table)
    result = incognito(problem)
    if not result.minimal:
        raise Unsatisfiable("even the fully generalized table violates the criteria beyond the suppression budget")
    node = min(result.minimal, key=lambda v: (sum(v), problem.suppression(v), v))
    return problem.outcome(node)


def run_ola(table: Table, rng: np.random.Generator) -> Outcome:
    problem = LatticeProblem(table)
    return problem.outcome(ola(problem).node)
