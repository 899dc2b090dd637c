"""Mondrian multidimensional partitioning, strict and relaxed (LeFevre, DeWitt, Ramakrishnan, ICDE 2006; §8.9).

Rows are points with one axis per QI column (categories ranked in their order). A partition is cut at the
lower median of its widest axis (normalized range; ties by QI order): strict sends ``≤ median`` left and
``> median`` right, relaxed splits the sorted rows into two halves so that rows equal to the median may go to
either side. A cut is allowable when both sides satisfy the criteria; a partition with no allowable cut is an
equivalence class, released with the tight range (``[min,max]``) or set of its values.

Vectorized: each partition is an index array; axis ranges, medians (``np.partition``) and sides are numpy
operations, so the cost is O(n log n) numpy work plus O(n/k) small Python steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import Unsatisfiable
from kcloak.cloaking.tabular._table import Axis, Outcome, Table
from kcloak.cloaking.tabular.criteria import CriteriaSet, DistinctLDiversity, KAnonymity
from kcloak.cloaking.tabular.hierarchy import format_number

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Cut:
    """A recorded cut: partition size, axis column, median value, sizes of both sides (for tests/traces)."""

    size: int
    column: str
    median: float
    left: int
    right: int


def _simple_l(crit: CriteriaSet) -> int | None:
    """ℓ when the criteria are only k-anonymity and distinct ℓ-diversity (a fast path), else None."""
    ls = [c.l for c in crit.criteria if isinstance(c, DistinctLDiversity)]
    if len(ls) == 1 and all(isinstance(c, KAnonymity | DistinctLDiversity) for c in crit.criteria):
        return ls[0]
    return None


def _allowable(crit: CriteriaSet, lhs: IntArray, rhs: IntArray, total: IntArray | None, simple_l: int | None) -> bool:
    """Both sides keep k rows and satisfy every criterion (``total``: sensitive counts of the partition)."""
    k = crit.k
    if len(lhs) < k or len(rhs) < k:
        return False
    if total is None:
        return True  # k-anonymity is the only criterion that needs no counts
    assert crit.sensitive is not None
    left = np.bincount(crit.sensitive.codes[lhs], minlength=crit.sensitive.m)
    if simple_l is not None:
        return bool(np.count_nonzero(left) >= simple_l and np.count_nonzero(total - left) >= simple_l)
    sizes = np.asarray([len(lhs), len(rhs)], dtype=np.int64)
    counts = np.empty((2, len(total)), dtype=np.int64)
    counts[0] = left
    counts[1] = total - left
    return bool(crit.accepts(sizes, counts).all())


def partition(table: Table, relaxed: bool, trace: list[Cut] | None = None) -> list[IntArray]:
    """Greedy top-down median partitioning; returns the classes as row-index arrays."""
    axes = table.axes()
    crit = table.criteria
    k = crit.k
    n = table.n
    if n == 0:
        return []
    num = [d for d, a in enumerate(axes) if not a.categorical]
    cat = [d for d, a in enumerate(axes) if a.categorical]
    matrix = np.stack([axes[d].values for d in num], axis=1) if num else np.zeros((n, 0))
    span = matrix.max(axis=0) - matrix.min(axis=0) if num else np.zeros(0)
    safe_span = np.where(span > 0, span, 1.0)
    n_distinct = {d: len(np.unique(axes[d].values)) for d in cat}
    codes = crit.sensitive.codes if (crit.needs_counts and crit.sensitive is not None) else None
    m = crit.sensitive.m if crit.sensitive is not None else 1
    simple_l = _simple_l(crit)
    everything = np.arange(n, dtype=np.int64)
    if not crit.accepts_rows([everything]).all():
        return []  # the caller decides between suppressing everything and Unsatisfiable
    classes: list[IntArray] = []
    stack: list[IntArray] = [everything]
    widths = np.zeros(len(axes))
    while stack:
        idx = stack.pop()
        size = len(idx)
        if size < 2 * k:
            classes.append(idx)
            continue
        block = matrix[idx] if num else matrix
        if num:
            widths[num] = np.where(span > 0, (block.max(axis=0) - block.min(axis=0)) / safe_span, 0.0)
        for d in cat:
            nd = n_distinct[d]
            widths[d] = 0.0 if nd <= 1 else (len(np.unique(axes[d].values[idx])) - 1) / (nd - 1)
        total = np.bincount(codes[idx], minlength=m) if codes is not None else None
        done = False
        for d in np.argsort(-widths, kind="stable").tolist():
            if widths[d] <= 0:
                break
            x = block[:, num.index(d)] if d in num else axes[d].values[idx]
            if relaxed:
                half = size // 2
                order = np.argpartition(x, half - 1)
                lhs, rhs = idx[order[:half]], idx[order[half:]]
                median = float(x[order[half - 1]])
            else:
                mid = (size - 1) // 2
                median = float(np.partition(x, mid)[mid])
                mask = x <= median
                lhs, rhs = idx[mask], idx[~mask]
            if _allowable(crit, lhs, rhs, total, simple_l):
                if trace is not None:
                    trace.append(Cut(size, axes[d].column, median, len(lhs), len(rhs)))
                stack.append(rhs)
                stack.append(lhs)
                done = True
                break
        if not done:
            classes.append(idx)
    return classes


def summarize(
    axes: tuple[Axis, ...], classes: list[IntArray], n_qi: int
) -> tuple[list[dict[str, str]], list[float], int]:
    """Written forms (tight closed interval / set / exact), per-class NCP and number of modified cells."""
    if not classes:
        return [], [], 0
    order = np.concatenate(classes)
    sizes = np.asarray([len(c) for c in classes], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    written: list[dict[str, str]] = [{} for _ in classes]
    loss = np.zeros((len(classes), n_qi))
    per_qi_cols = np.zeros(n_qi)
    modified = 0
    for a in axes:
        per_qi_cols[a.qi] += 1
        v = a.values[order]
        lo = np.minimum.reduceat(v, starts)
        hi = np.maximum.reduceat(v, starts)
        exact = lo == hi
        modified += int(sizes[~exact].sum())
        if a.categorical:
            total = len(a.labels)
            cls_of = np.repeat(np.arange(len(classes)), sizes)
            pairs = np.unique(np.stack([cls_of, v.astype(np.int64)]), axis=1)
            splits = np.flatnonzero(np.diff(pairs[0])) + 1
            for ci, members in zip(pairs[0][np.r_[0, splits]].tolist(), np.split(pairs[1], splits), strict=True):
                labels = sorted(a.labels[m] for m in members.tolist())
                written[ci][a.column] = labels[0] if len(labels) == 1 else "{" + "|".join(labels) + "}"
                loss[ci, a.qi] += 0.0 if len(labels) == 1 else len(labels) / total
        else:
            full = float(a.values.max() - a.values.min())
            lo_s = [format_number(x) for x in lo.tolist()]
            hi_s = [format_number(x) for x in hi.tolist()]
            for ci in range(len(classes)):
                written[ci][a.column] = lo_s[ci] if exact[ci] else f"[{lo_s[ci]},{hi_s[ci]}]"
            if full > 0:
                loss[:, a.qi] += (hi - lo) / full
    ncp = (loss / np.maximum(per_qi_cols, 1)).mean(axis=1)
    return written, ncp.tolist(), modified


def _run(table: Table, relaxed: bool) -> Outcome:
    classes = partition(table, relaxed)
    suppressed = np.zeros(0, dtype=np.int64)
    if not classes and table.n:
        if table.n > table.max_sup:
            raise Unsatisfiable("the whole table violates the criteria and cannot be suppressed within the budget")
        suppressed = np.arange(table.n, dtype=np.int64)
    written, ncp, modified = summarize(table.axes(), classes, len(table.qis))
    return Outcome(classes, written, suppressed, ncp, None, None, modified)


def run_strict(table: Table, rng: np.random.Generator) -> Outcome:
    return _run(table, relaxed=False)


def run_relaxed(table: Table, rng: np.random.Generator) -> Outcome:
    return _run(table, relaxed=True)
