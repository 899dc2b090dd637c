"""Information-loss metrics of a release (CONCEPTS §8.16; contract §8 report ``metrics``).

All are normalized per row and QI except discernibility; suppressed rows count as fully generalized
(NCP 1, level = height, WHD 1, every QI cell modified). ``prec`` is Sweeney's precision (1 = nothing
generalized; the loss is ``1 − prec``). Metrics that need hierarchy levels are None for hierarchy-free
algorithms (Mondrian, MDAV, Anatomy).
"""

from __future__ import annotations

from collections.abc import Sequence

from kcloak.cloaking.tabular._table import Outcome

WHD_BETA = 1.0


def whd(level: int, height: int, beta: float = WHD_BETA) -> float:
    """Weighted hierarchical distance of generalizing a leaf ``level`` steps up a hierarchy of ``height`` steps.

    [S003 §3.1]: levels numbered 1 (root) … h = height + 1 (leaves), weight ``w_{j,j−1} = 1/(j−1)^β``
    (β = 0: uniform weights); ``WHD(p, q) = Σ_{j=q+1}^{p} w / Σ_{j=2}^{h} w`` with p = h, q = h − level.
    """
    if height <= 0 or level <= 0:
        return 0.0
    weights: list[float] = [1.0 / float(j) ** beta for j in range(1, height + 1)]  # weights[j-1] = w_{j+1,j}
    return float(sum(weights[height - level :]) / sum(weights))


def discernibility(class_sizes: Sequence[int], n_in: int, suppressed: int) -> float:
    """DM = ``Σ |E|² + |D| · #suppressed`` (Bayardo & Agrawal)."""
    return float(sum(s * s for s in class_sizes) + n_in * suppressed)


def release_metrics(outcome: Outcome, n_in: int, n_qi: int, n_qi_columns: int) -> dict[str, float | None]:
    """The report's ``metrics`` object for an algorithm outcome."""
    sizes = [len(c) for c in outcome.classes]
    n_sup = len(outcome.suppressed)
    if n_in == 0:
        return {"ncp": None, "discernibility": 0.0, "prec": None, "whd": None, "modification_rate": None}
    ncp: float | None = None
    if outcome.ncp is not None:
        ncp = (sum(s * v for s, v in zip(sizes, outcome.ncp, strict=True)) + n_sup) / n_in
    prec: float | None = None
    whd_mean: float | None = None
    if outcome.levels is not None and outcome.heights is not None and n_qi:
        heights = outcome.heights
        loss = n_sup * 1.0
        dist = n_sup * 1.0
        for s, lv in zip(sizes, outcome.levels, strict=True):
            loss += s * sum(a / h if h else 0.0 for a, h in zip(lv, heights, strict=True)) / n_qi
            dist += s * sum(whd(a, h) for a, h in zip(lv, heights, strict=True)) / n_qi
        prec = 1.0 - loss / n_in
        whd_mean = dist / n_in
    mod = None
    if n_qi_columns:
        mod = (outcome.modified_cells + n_sup * n_qi_columns) / (n_in * n_qi_columns)
    return {
        "ncp": ncp,
        "discernibility": discernibility(sizes, n_in, n_sup),
        "prec": prec,
        "whd": whd_mean,
        "modification_rate": mod,
    }
