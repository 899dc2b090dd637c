"""Anatomy (Xiao & Tao, VLDB 2006; CONCEPTS §8.13): exact QIs and exact sensitive values in two tables.

Rows are bucketed by sensitive value; each group takes one row from each of the ``l`` largest buckets, the
at most ``l − 1`` residual rows join a group that lacks their value. Groups are then merged (smallest first)
until each has ``k`` rows and satisfies every requested criterion. The quasi-identifier table keeps the QI
values exactly plus ``group_id`` (sensitive column removed); the sensitive table lists ``group_id``, value,
count. Group ids are assigned in random order and both tables are shuffled independently (§7.7).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import Unsatisfiable
from kcloak.cloaking.tabular._groups import repair
from kcloak.cloaking.tabular._release import TabularRelease, achieved
from kcloak.cloaking.tabular._table import Table

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def anatomy_groups(codes: IntArray, l: int, rng: np.random.Generator) -> list[IntArray]:  # noqa: E741
    """The l-diverse grouping of [S000 §3.2]: rows of the ``l`` largest buckets, then residual rows."""
    n = len(codes)
    if n == 0:
        return []
    m = int(codes.max()) + 1
    buckets: list[list[int]] = [[] for _ in range(m)]
    for i in rng.permutation(n).tolist():
        buckets[int(codes[i])].append(i)
    if max(len(b) for b in buckets) * l > n:
        raise Unsatisfiable(f"no {l}-diverse grouping exists: a sensitive value occurs in more than 1/{l} of the rows")
    groups: list[list[int]] = []
    while sum(1 for b in buckets if b) >= l:
        chosen = sorted((s for s in range(m) if buckets[s]), key=lambda s: (-len(buckets[s]), s))[:l]
        groups.append([buckets[s].pop() for s in chosen])
    for s in range(m):
        for r in buckets[s]:
            g = next(g for g in groups if all(int(codes[x]) != s for x in g))
            g.append(r)
    return [np.asarray(g, dtype=np.int64) for g in groups]


def run_anatomy(table: Table, rows: Sequence[Mapping[str, Any]], rng: np.random.Generator) -> TabularRelease:
    crit = table.criteria
    sens = crit.sensitive
    assert sens is not None
    l_value = max(int(getattr(c, "l", 1)) for c in crit.criteria)
    groups = anatomy_groups(sens.codes, l_value, rng) if table.n else []

    def by_size(g: IntArray, others: list[IntArray]) -> FloatArray:
        return np.asarray([len(o) for o in others], dtype=np.float64)

    groups, suppressed = repair(groups, table, by_size)
    gids = rng.permutation(len(groups)) + 1
    qit: list[dict[str, str]] = []
    st: list[dict[str, str | int]] = []
    for gid, g in zip(gids.tolist(), groups, strict=True):
        for i in g.tolist():
            row = {key: ("" if v is None else str(v)) for key, v in rows[i].items() if key != sens.name}
            row["group_id"] = str(gid)
            qit.append(row)
        values, counts = np.unique(sens.codes[g], return_counts=True)
        for v, cnt in zip(values.tolist(), counts.tolist(), strict=True):
            st.append({"group_id": gid, sens.name: sens_value(rows, g, sens.codes, v, sens.name), "count": int(cnt)})
    qit = [qit[i] for i in rng.permutation(len(qit)).tolist()]
    st = [st[i] for i in rng.permutation(len(st)).tolist()]
    k_ach, l_ach, t_ach = achieved(crit, groups)
    sizes = [len(g) for g in groups]
    n_sup = len(suppressed)
    metrics: dict[str, float | None] = {
        "ncp": 0.0 if table.n else None,
        "discernibility": float(sum(s * s for s in sizes) + table.n * n_sup),
        "prec": None,
        "whd": None,
        "modification_rate": (n_sup / table.n) if table.n else None,
    }
    return TabularRelease(qit, n_sup, len(groups), k_ach, l_ach, t_ach, metrics, st)


def sens_value(rows: Sequence[Mapping[str, Any]], group: IntArray, codes: IntArray, code: int, name: str) -> str:
    """The original string of the first row of ``group`` whose sensitive code is ``code``."""
    i = int(group[np.flatnonzero(codes[group] == code)[0]])
    return str(rows[i][name])
