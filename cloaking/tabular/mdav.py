"""MDAV microaggregation (Domingo-Ferrer & Torra, DMKD 2005; CONCEPTS §8.10).

Groups of ``k`` close records (the last one ``k … 2k − 1``) built around the records farthest from the
centroid, then QI values replaced by the group mean (timestamps rounded to the second, other numbers to 6
decimals): perturbative, not truthful (contract §8: "exact … replaced (e.g. MDAV centroid)"). Works on
numeric, time and lat/lon QIs, standardized; categorical QIs do not apply. Groups failing ℓ or t are merged
into the group with the nearest centroid.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import NotApplicable
from kcloak.cloaking.tabular._groups import repair
from kcloak.cloaking.tabular._table import Outcome, Table
from kcloak.cloaking.tabular.hierarchy import format_number

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

MEAN_DECIMALS = 6


def mdav_groups(x: FloatArray, k: int) -> list[IntArray]:
    """Partition the rows of ``x`` (n × d, already standardized) into MDAV groups of row indices."""
    n = x.shape[0]
    remaining = np.arange(n, dtype=np.int64)
    groups: list[IntArray] = []

    def take(seed: int) -> None:
        nonlocal remaining
        pts = x[remaining]
        d = ((pts - x[seed]) ** 2).sum(axis=1)
        d[remaining == seed] = -1.0  # the seed itself, even among duplicates
        sel = np.argpartition(d, k - 1)[:k]
        groups.append(remaining[sel])
        remaining = np.delete(remaining, sel)

    def farthest_from(point: FloatArray) -> int:
        d = ((x[remaining] - point) ** 2).sum(axis=1)
        return int(remaining[int(np.argmax(d))])

    while len(remaining) >= 3 * k:
        r = farthest_from(x[remaining].mean(axis=0))
        take(r)
        s = farthest_from(x[r])
        take(s)
    if len(remaining) >= 2 * k:
        take(farthest_from(x[remaining].mean(axis=0)))
    if len(remaining):
        groups.append(remaining)
    return groups


def run_mdav(table: Table, rng: np.random.Generator) -> Outcome:
    if any(q.kind == "categorical" for q in table.qis):
        raise NotApplicable("mdav applies to numeric, time and lat/lon quasi-identifiers only")
    axes = table.axes()
    if table.n == 0:
        return Outcome([], [], np.zeros(0, dtype=np.int64), [], None, None, 0)
    raw = np.stack([a.values for a in axes], axis=1)
    std = raw.std(axis=0)
    x = (raw - raw.mean(axis=0)) / np.where(std > 0, std, 1.0)
    groups = mdav_groups(x, table.criteria.k)

    def centroid_distance(g: IntArray, others: list[IntArray]) -> FloatArray:
        c = x[g].mean(axis=0)
        return np.asarray([float(((x[o].mean(axis=0) - c) ** 2).sum()) for o in others])

    groups, suppressed = repair(groups, table, centroid_distance)
    written: list[dict[str, str]] = []
    ncp: list[float] = []
    modified = 0
    spans = raw.max(axis=0) - raw.min(axis=0) if len(raw) else np.zeros(len(axes))
    per_qi = np.bincount([a.qi for a in axes], minlength=len(table.qis)).astype(np.float64)
    for g in groups:
        cells: dict[str, str] = {}
        loss = np.zeros(len(table.qis))
        for d, a in enumerate(axes):
            vals = raw[g, d]
            mean = float(vals.mean())
            value = float(round(mean)) if table.qis[a.qi].kind == "time" else round(mean, MEAN_DECIMALS)
            cells[a.column] = format_number(value)
            modified += int((vals != value).sum())
            if spans[d] > 0:
                loss[a.qi] += float(vals.max() - vals.min()) / float(spans[d])
        written.append(cells)
        ncp.append(float((loss / np.maximum(per_qi, 1)).mean()))
    return Outcome(groups, written, suppressed, ncp, None, None, modified)
