"""Shared step of the clustering algorithms: merge groups that fail a criterion into their nearest group."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import Unsatisfiable
from kcloak.cloaking.tabular._table import Table

IntArray = npt.NDArray[np.int64]


def repair(
    groups: list[IntArray], table: Table, distance: Callable[[IntArray, list[IntArray]], npt.NDArray[np.float64]]
) -> tuple[list[IntArray], IntArray]:
    """Merge every group failing the criteria into the group ``distance`` ranks closest, until all pass.

    Merging preserves k, ℓ (all variants) and t (EMD is convex), so this terminates with every group passing
    or with one failing group; that group is suppressed when it fits the budget, else :class:`Unsatisfiable`.
    Returns the groups and the suppressed rows.
    """
    crit = table.criteria
    groups = [g for g in groups if len(g)]
    while groups:
        ok = crit.accepts_rows(groups)
        if ok.all():
            return groups, np.zeros(0, dtype=np.int64)
        if len(groups) == 1:
            break
        bad = int(np.flatnonzero(~ok)[0])
        target = groups.pop(bad)
        d = distance(target, groups)
        j = int(np.argmin(d))
        groups[j] = np.concatenate([groups[j], target])
    if table.n > table.max_sup:
        raise Unsatisfiable("the whole table violates the criteria and cannot be suppressed within the budget")
    return [], np.arange(table.n, dtype=np.int64)
