"""Privacy criteria as objects an algorithm asks "do these groups satisfy you?" (CONCEPTS §8.12, §8.14).

Every criterion answers for many groups at once: ``accepts(sizes, counts)`` gets the group sizes and, when it
needs them, the histogram of sensitive values per group (``counts[g, s]``, codes of
:class:`SensitiveColumn`) and returns one boolean per group. All criteria here are monotone under merging
groups, so any search algorithm can enforce any combination of them (STYLE: ARX model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import InvalidTableInput, NotApplicable
from kcloak.cloaking.tabular.hierarchy import CategoricalHierarchy, format_number

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

LKind = Literal["distinct", "entropy", "recursive"]
_EPS = 1e-12


class Criterion(Protocol):
    """A privacy criterion checked group by group."""

    @property
    def needs_counts(self) -> bool: ...

    def accepts(self, sizes: IntArray, counts: IntArray | None) -> BoolArray: ...


@dataclass(frozen=True, slots=True)
class KAnonymity:
    """Every class holds at least ``k`` rows [S001 Def. 1]."""

    k: int
    needs_counts: bool = False

    def accepts(self, sizes: IntArray, counts: IntArray | None) -> BoolArray:
        return np.asarray(sizes >= self.k)


@dataclass(frozen=True, slots=True)
class DistinctLDiversity:
    """At least ``l`` distinct sensitive values per class [S004 Def. 5.1]."""

    l: int  # noqa: E741 - the model's name
    needs_counts: bool = True

    def accepts(self, sizes: IntArray, counts: IntArray | None) -> BoolArray:
        assert counts is not None
        return np.asarray((counts > 0).sum(axis=1) >= self.l)


def entropy(counts: IntArray) -> FloatArray:
    """Natural-log entropy of each row's value distribution."""
    sizes = counts.sum(axis=1, keepdims=True).astype(np.float64)
    p = np.divide(counts, sizes, out=np.zeros(counts.shape, dtype=np.float64), where=sizes > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return np.asarray(terms.sum(axis=1), dtype=np.float64)


def entropy_l(counts: IntArray) -> FloatArray:
    """``e^H`` of each row (the ℓ its entropy reaches), exact where it is an integer.

    A row whose present values are equally frequent reaches exactly ℓ = its number of distinct values
    (``[4, 4, 4]`` → 3, not ``2.9999999999999996``); other rows get ``e^H`` snapped to the nearest
    integer when within ``1e-9`` relative of it, so a report never shows float noise as a shortfall.
    """
    c = np.asarray(counts, dtype=np.int64)
    out = np.exp(entropy(c))
    present = c > 0
    distinct = present.sum(axis=1)
    hi = np.where(present, c, np.iinfo(np.int64).min).max(axis=1, initial=np.iinfo(np.int64).min)
    lo = np.where(present, c, np.iinfo(np.int64).max).min(axis=1, initial=np.iinfo(np.int64).max)
    equal = (distinct > 0) & (hi == lo)
    out = np.where(equal, distinct.astype(np.float64), out)
    near = np.rint(out)
    snap = np.abs(out - near) <= 1e-9 * np.maximum(near, 1.0)
    return np.asarray(np.where(snap, near, out), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class EntropyLDiversity:
    """``−Σ p ln p ≥ ln l`` in every class (Machanavajjhala et al.)."""

    l: float  # noqa: E741
    needs_counts: bool = True

    def accepts(self, sizes: IntArray, counts: IntArray | None) -> BoolArray:
        assert counts is not None
        return np.asarray(entropy(counts) >= math.log(self.l) - _EPS)


@dataclass(frozen=True, slots=True)
class RecursiveCLDiversity:
    """Recursive (c, l)-diversity: ``r_1 < c·(r_l + … + r_m)`` on sorted counts; fails with fewer than ``l``."""

    c: float
    l: int  # noqa: E741
    needs_counts: bool = True

    def accepts(self, sizes: IntArray, counts: IntArray | None) -> BoolArray:
        assert counts is not None
        r = -np.sort(-counts, axis=1)
        if r.shape[1] < self.l:
            return np.zeros(r.shape[0], dtype=np.bool_)
        tail = r[:, self.l - 1 :].sum(axis=1)
        return np.asarray((r[:, self.l - 1] > 0) & (r[:, 0] < self.c * tail))


# --------------------------------------------------------------------------- t-closeness


@dataclass(frozen=True, slots=True)
class OrderedDistance:
    """EMD with ground distance ``|i − j| / (m − 1)`` over the ordered domain (CONCEPTS §8.14).

    The domain is the values present in the measured table, i.e. where ``q > 0`` (plus any value of ``p``
    outside it): a value held only by suppressed rows is not in the released file, so it does not count in
    ``m``. Over the whole input (every code in ``q``) this is the plain formula; after suppression it is the
    EMD a reader of the release computes.
    """

    def emd(self, p: FloatArray, q: FloatArray) -> FloatArray:
        steps = np.abs(np.cumsum(p - q, axis=1))
        if bool((q > 0).all()):  # every code present (no suppression yet): the plain formula
            m = p.shape[1]
            if m <= 1:
                return np.zeros(p.shape[0])
            return np.asarray(steps.sum(axis=1) / (m - 1), dtype=np.float64)
        present = (q > 0) | (p > 0)
        n_present = present.sum(axis=1)
        total = np.where(present, steps, 0.0).sum(axis=1)
        out = np.divide(total, n_present - 1, out=np.zeros(p.shape[0]), where=n_present > 1)
        return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class HierarchicalDistance:
    """EMD with ground distance = height of the lowest common ancestor / H (CONCEPTS §8.14).

    ``children`` is a leaf-membership matrix with one column per child of an internal node, ``owner`` the
    internal node of each column and ``weights`` = height(node)/H per internal node. A flat hierarchy (height 1)
    gives the equal-distance EMD ``½ Σ |p − q|``.
    """

    children: FloatArray
    owner: IntArray
    weights: FloatArray

    @classmethod
    def from_hierarchy(cls, hierarchy: CategoricalHierarchy, domain: Sequence[str]) -> HierarchicalDistance:
        index = {v: i for i, v in enumerate(domain)}
        height = hierarchy.height
        cols: list[FloatArray] = []
        owners: list[int] = []
        weights: list[float] = []
        node_ids: dict[tuple[int, tuple[str, ...]], int] = {}
        for level in range(1, height + 1):
            kids: dict[tuple[str, ...], dict[tuple[str, ...], list[int]]] = {}
            for leaf in hierarchy.leaves:
                parent = hierarchy.node_key(leaf, level)
                child = hierarchy.node_key(leaf, level - 1)
                kids.setdefault(parent, {}).setdefault(child, []).append(index[leaf])
            for parent, children in kids.items():
                nid = node_ids.setdefault((level, parent), len(node_ids))
                weights.append(level / height)
                for members in children.values():
                    col = np.zeros(len(domain))
                    col[members] = 1.0
                    cols.append(col)
                    owners.append(nid)
        return cls(np.stack(cols, axis=1), np.asarray(owners, dtype=np.int64), np.asarray(weights))

    def emd(self, p: FloatArray, q: FloatArray) -> FloatArray:
        extra = (p - q) @ self.children  # (G, n_children)
        n_nodes = len(self.weights)
        pos = np.zeros((p.shape[0], n_nodes))
        neg = np.zeros((p.shape[0], n_nodes))
        for col, nid in enumerate(self.owner):
            e = extra[:, col]
            pos[:, nid] += np.maximum(e, 0.0)
            neg[:, nid] += np.maximum(-e, 0.0)
        return np.asarray(np.minimum(pos, neg) @ self.weights, dtype=np.float64)


GroundDistance = OrderedDistance | HierarchicalDistance


@dataclass(frozen=True, slots=True)
class TCloseness:
    """EMD between each class's sensitive distribution and ``q`` is at most ``t`` [Li et al. ICDE 2007].

    ``q`` starts as the input's distribution; an algorithm that suppresses classes re-measures against the
    released rows (:meth:`CriteriaSet.rebased`), which is what the published table shows (CONCEPTS §8.14).
    """

    t: float
    q: FloatArray
    distance: GroundDistance
    needs_counts: bool = True

    def distances(self, counts: IntArray) -> FloatArray:
        sizes = counts.sum(axis=1, keepdims=True).astype(np.float64)
        p = np.divide(counts, sizes, out=np.zeros(counts.shape, dtype=np.float64), where=sizes > 0)
        return self.distance.emd(p, np.broadcast_to(self.q, p.shape))

    def accepts(self, sizes: IntArray, counts: IntArray | None) -> BoolArray:
        assert counts is not None
        return np.asarray(self.distances(counts) <= self.t + 1e-9)

    def with_q(self, q: FloatArray) -> TCloseness:
        return TCloseness(self.t, q, self.distance)


# --------------------------------------------------------------------------- sensitive column and criteria set


@dataclass(frozen=True, slots=True)
class SensitiveColumn:
    """The sensitive attribute as codes over an ordered domain (numbers by value, else hierarchy/sorted order)."""

    name: str
    domain: tuple[str, ...]
    codes: IntArray
    numeric: bool
    distance: GroundDistance

    @property
    def m(self) -> int:
        return len(self.domain)

    @classmethod
    def build(cls, name: str, raw: Sequence[Any], hierarchy: CategoricalHierarchy | None = None) -> SensitiveColumn:
        if any(v is None for v in raw):
            raise InvalidTableInput(f"column {name!r}: missing sensitive value")
        strings = [str(v) for v in raw]
        if hierarchy is not None:
            domain = hierarchy.leaves
            index = {v: i for i, v in enumerate(domain)}
            missing = sorted({s for s in strings if s not in index})
            if missing:
                raise InvalidTableInput(f"column {name!r}: value(s) not in the sensitive hierarchy: {missing[:5]}")
            codes = np.fromiter((index[s] for s in strings), dtype=np.int64, count=len(strings))
            return cls(name, domain, codes, False, HierarchicalDistance.from_hierarchy(hierarchy, domain))
        try:
            numbers = np.asarray(strings, dtype=np.float64) if strings else np.zeros(0)
            numeric = bool(len(strings)) and bool(np.all(np.isfinite(numbers)))
        except ValueError:
            numeric = False
        if numeric:
            uniq, inverse = np.unique(numbers, return_inverse=True)
            domain = tuple(format_number(float(u)) for u in uniq)
            return cls(name, domain, inverse.astype(np.int64).reshape(-1), True, OrderedDistance())
        uniq_s = sorted(set(strings))
        index = {v: i for i, v in enumerate(uniq_s)}
        codes = np.fromiter((index[s] for s in strings), dtype=np.int64, count=len(strings))
        flat = CategoricalHierarchy.flat(uniq_s)
        return cls(name, tuple(uniq_s), codes, False, HierarchicalDistance.from_hierarchy(flat, tuple(uniq_s)))

    def distribution(self, rows: IntArray | None = None) -> FloatArray:
        codes = self.codes if rows is None else self.codes[rows]
        counts = np.bincount(codes, minlength=self.m).astype(np.float64)
        total = counts.sum()
        return counts / total if total else counts


@dataclass(frozen=True, slots=True)
class CriteriaSet:
    """The conjunction of the requested criteria, asked per group by every algorithm."""

    criteria: tuple[Criterion, ...]
    sensitive: SensitiveColumn | None
    l_kind: LKind = "distinct"
    c: float | None = None
    requested: Mapping[str, float] = field(default_factory=dict)

    @property
    def needs_counts(self) -> bool:
        return any(c.needs_counts for c in self.criteria)

    @property
    def k(self) -> int:
        return next((c.k for c in self.criteria if isinstance(c, KAnonymity)), 1)

    @property
    def t_criterion(self) -> TCloseness | None:
        return next((c for c in self.criteria if isinstance(c, TCloseness)), None)

    def accepts(self, sizes: IntArray, counts: IntArray | None) -> BoolArray:
        ok = np.ones(len(sizes), dtype=np.bool_)
        for crit in self.criteria:
            ok &= crit.accepts(sizes, counts)
        return ok

    def counts_of(self, group_ids: IntArray, n_groups: int) -> IntArray | None:
        """Histogram of sensitive values per group for rows labelled ``group_ids`` (None when not needed)."""
        if not self.needs_counts or self.sensitive is None:
            return None
        m = self.sensitive.m
        flat = np.bincount(group_ids * m + self.sensitive.codes, minlength=n_groups * m)
        return flat.reshape(n_groups, m).astype(np.int64)

    def accepts_rows(self, groups: Sequence[IntArray]) -> BoolArray:
        """Per group of row indices: does it satisfy every criterion?"""
        sizes = np.asarray([len(g) for g in groups], dtype=np.int64)
        counts = None
        if self.needs_counts and self.sensitive is not None:
            counts = np.stack([np.bincount(self.sensitive.codes[g], minlength=self.sensitive.m) for g in groups])
        return self.accepts(sizes, counts)

    def rebased(self, released: IntArray) -> CriteriaSet:
        """Same criteria with t-closeness measured against the distribution of the ``released`` rows."""
        tc = self.t_criterion
        if tc is None or self.sensitive is None:
            return self
        q = self.sensitive.distribution(released)
        crits = tuple(tc.with_q(q) if c is tc else c for c in self.criteria)
        return CriteriaSet(crits, self.sensitive, self.l_kind, self.c, self.requested)


def build_criteria(
    *,
    k: int,
    l: int | None,  # noqa: E741
    l_kind: LKind,
    c: float | None,
    t: float | None,
    sensitive: SensitiveColumn | None,
) -> CriteriaSet:
    """Validate the parameters and build the criteria set (k always; ℓ and t need a sensitive column)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidTableInput("k must be an integer >= 1")
    crits: list[Criterion] = [KAnonymity(k)]
    if l_kind not in ("distinct", "entropy", "recursive"):
        raise InvalidTableInput(f"unknown l_kind {l_kind!r}")
    if l is not None:
        if isinstance(l, bool) or not isinstance(l, int) or l < 1:
            raise InvalidTableInput("l must be an integer >= 1")
        if sensitive is None:
            raise NotApplicable("l-diversity needs a sensitive column")
        if l_kind == "distinct":
            crits.append(DistinctLDiversity(l))
        elif l_kind == "entropy":
            crits.append(EntropyLDiversity(float(l)))
        else:
            if c is None or not c > 0:
                raise NotApplicable("recursive (c,l)-diversity needs c > 0")
            crits.append(RecursiveCLDiversity(float(c), l))
    elif c is not None and l_kind == "recursive":
        raise NotApplicable("recursive (c,l)-diversity needs l")
    if t is not None:
        if not 0 < t <= 1:
            raise InvalidTableInput("t must be in (0, 1]")
        if sensitive is None:
            raise NotApplicable("t-closeness needs a sensitive column")
        crits.append(TCloseness(float(t), sensitive.distribution(), sensitive.distance))
    return CriteriaSet(tuple(crits), sensitive, l_kind, c)


def l_achieved(counts: IntArray, l_kind: LKind, c: float | None) -> float:
    """The ℓ every class reaches: min distinct count, min ``e^H``, or the largest ℓ of recursive (c, ℓ)."""
    if counts.shape[0] == 0:
        return 0.0
    if l_kind == "entropy":
        return float(entropy_l(counts).min())
    distinct = (counts > 0).sum(axis=1)
    if l_kind == "recursive" and c is not None:
        r = -np.sort(-counts, axis=1)
        tails = np.cumsum(r[:, ::-1], axis=1)[:, ::-1]  # tails[:, j] = r_{j+1} + ... + r_m
        best = np.zeros(r.shape[0], dtype=np.int64)
        for j in range(r.shape[1]):
            ok = (r[:, j] > 0) & (r[:, 0] < c * tails[:, j])
            best = np.where(ok, j + 1, best)
        return float(best.min())
    return float(distinct.min())
