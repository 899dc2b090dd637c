"""KACA: k-anonymization by clustering in attribute hierarchies (Li, Wong, Fu, Pei, DaWaK 2006; CONCEPTS §8.11).

Local recoding: start from the classes of identical QI tuples and repeatedly merge a class that fails the
criteria (chosen at random, seeded) into the class that is cheapest to merge with; both are generalized to the
tuple of per-attribute lowest common ancestors ``g``. ``merge_cost(C, D) = |C|·WHD(C → g) + |D|·WHD(D → g)``
⚠ with the weighted hierarchical distance of :func:`kcloak.cloaking.tabular.metrics.whd`. Ties: the smaller merged
class, then a seeded random choice. Cost O(|E|² · Σ heights) for |E| initial classes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import Unsatisfiable
from kcloak.cloaking.tabular._table import Outcome, Table
from kcloak.cloaking.tabular.hierarchy import factorize
from kcloak.cloaking.tabular.lattice import _changed_cells
from kcloak.cloaking.tabular.metrics import whd

IntArray = npt.NDArray[np.int64]


def kaca_classes(table: Table, rng: np.random.Generator) -> tuple[list[IntArray], list[tuple[int, ...]]]:
    """Run the merge loop; returns released classes (row indices) and their per-QI levels."""
    enc = table.encoded()
    q = len(enc)
    n = table.n
    crit = table.criteria
    if n == 0:
        return [], []
    gid = np.zeros(n, dtype=np.int64)
    for e in enc:
        gid = factorize(gid * (int(e.codes[0].max()) + 1) + e.codes[0])
    n_cls = int(gid.max()) + 1
    order = np.argsort(gid, kind="stable")
    members: list[IntArray] = np.split(order, np.flatnonzero(np.diff(gid[order])) + 1)
    rep = np.asarray([int(m[0]) for m in members], dtype=np.int64)
    sizes = np.asarray([len(m) for m in members], dtype=np.int64)
    counts = crit.counts_of(gid, n_cls)
    levels = np.zeros((n_cls, q), dtype=np.int64)
    alive = np.ones(n_cls, dtype=np.bool_)
    whd_tab = [np.asarray([whd(lv, e.height) for lv in range(e.height + 1)]) for e in enc]
    ok = crit.accepts(sizes, counts)
    while True:
        failing = np.flatnonzero(alive & ~ok)
        if len(failing) == 0:
            break
        live = np.flatnonzero(alive)
        if len(live) == 1:
            raise Unsatisfiable("the criteria cannot be met even with every row in one class")
        c = int(rng.choice(failing))
        others = live[live != c]
        cost = np.zeros(len(others))
        lca = np.zeros((len(others), q), dtype=np.int64)
        for a, e in enumerate(enc):
            start = np.maximum(levels[others, a], levels[c, a])
            best = np.full(len(others), e.height, dtype=np.int64)
            for lv in range(e.height, -1, -1):
                codes = e.codes[lv]
                eq = codes[rep[others]] == codes[rep[c]]
                best = np.where(eq & (lv >= start), lv, best)
            lca[:, a] = best
            cost += sizes[c] * (whd_tab[a][best] - whd_tab[a][levels[c, a]])
            cost += sizes[others] * (whd_tab[a][best] - whd_tab[a][levels[others, a]])
        merged = sizes[others] + sizes[c]
        best_cost = cost.min()
        tied = np.flatnonzero(np.isclose(cost, best_cost, rtol=1e-12, atol=1e-12))
        tied = tied[merged[tied] == merged[tied].min()]
        j = int(tied[int(rng.integers(len(tied)))]) if len(tied) > 1 else int(tied[0])
        d = int(others[j])
        levels[d] = lca[j]
        sizes[d] += sizes[c]
        members[d] = np.concatenate([members[d], members[c]])
        if counts is not None:
            counts[d] += counts[c]
        alive[c] = False
        ok[d] = bool(crit.accepts(sizes[d : d + 1], None if counts is None else counts[d : d + 1])[0])
    live = np.flatnonzero(alive)
    return [members[i] for i in live], [tuple(int(v) for v in levels[i]) for i in live]


def run_kaca(table: Table, rng: np.random.Generator) -> Outcome:
    enc = table.encoded()
    try:
        classes, levels = kaca_classes(table, rng)
        suppressed = np.zeros(0, dtype=np.int64)
    except Unsatisfiable:
        if table.n > table.max_sup:
            raise
        classes, levels, suppressed = [], [], np.arange(table.n, dtype=np.int64)
    written: list[dict[str, str]] = []
    ncp: list[float] = []
    modified = 0
    for g, lv in zip(classes, levels, strict=True):
        rep = int(g[0])
        cells: dict[str, str] = {}
        loss = 0.0
        for a, (qi, e) in enumerate(zip(table.qis, enc, strict=True)):
            strings = e.write(lv[a], rep)
            cells.update(zip(qi.columns, strings, strict=True))
            loss += e.ncp(lv[a], rep)
            if lv[a] > 0:
                modified += _changed_cells(e, lv[a], g, strings)
        written.append(cells)
        ncp.append(loss / len(enc))
    heights = tuple(e.height for e in enc)
    return Outcome(classes, written, suppressed, ncp, levels, heights, modified)
