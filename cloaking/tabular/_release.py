"""``anonymize_table``: one entry point for every tabular algorithm (CONCEPTS §8, contract §8)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import InvalidTableInput, NotApplicable
from kcloak.cloaking.tabular._table import Outcome, QuasiIdentifier, Table
from kcloak.cloaking.tabular.criteria import (
    CriteriaSet,
    LKind,
    OrderedDistance,
    SensitiveColumn,
    build_criteria,
    l_achieved,
)
from kcloak.cloaking.tabular.hierarchy import CategoricalHierarchy
from kcloak.cloaking.tabular.metrics import release_metrics
from kcloak.core.names import TabularAlgorithm, values

IntArray = npt.NDArray[np.int64]

ALGORITHMS: tuple[str, ...] = values(TabularAlgorithm)


@dataclass(frozen=True, slots=True)
class TabularRelease:
    """A released table (contract §8): written forms, shuffled rows, no ``row_id`` (the caller adds it).

    ``rows`` keep every input column; QI columns hold written forms (Anatomy: exact values plus
    ``group_id``, sensitive column removed and published in ``sensitive_table`` as ``group_id, <sensitive>,
    count``). ``metrics`` has ``ncp``, ``discernibility``, ``prec``, ``whd``, ``modification_rate``.
    """

    rows: list[dict[str, str]]
    suppressed_rows: int
    classes: int
    k_achieved: int
    l_achieved: float | None
    t_achieved: float | None
    metrics: dict[str, float | None]
    sensitive_table: list[dict[str, str | int]] | None = None


_EMPTY = SensitiveColumn("", ("",), np.zeros(1, dtype=np.int64), False, OrderedDistance())


def _run(name: str) -> Callable[[Table, np.random.Generator], Outcome]:
    if name in ("samarati", "incognito", "ola"):
        from kcloak.cloaking.tabular import lattice

        return {"samarati": lattice.run_samarati, "incognito": lattice.run_incognito, "ola": lattice.run_ola}[name]
    if name in ("mondrian", "mondrian-relaxed"):
        from kcloak.cloaking.tabular import mondrian

        return mondrian.run_strict if name == "mondrian" else mondrian.run_relaxed
    if name == "mdav":
        from kcloak.cloaking.tabular import mdav

        return mdav.run_mdav
    if name == "kaca":
        from kcloak.cloaking.tabular import kaca

        return kaca.run_kaca
    raise NotApplicable(f"unknown tabular algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")


def _cell(v: Any) -> str:
    return "" if v is None else str(v)


def anonymize_table(
    rows: Sequence[Mapping[str, Any]],
    *,
    quasi_identifiers: Sequence[QuasiIdentifier],
    sensitive: str | None,
    algorithm: str,
    k: int,
    l: int | None = None,  # noqa: E741 - the model's name
    l_kind: LKind = "distinct",
    c: float | None = None,
    t: float | None = None,
    max_suppression: float = 0.01,
    seed: int | None = None,
    sensitive_hierarchy: CategoricalHierarchy | None = None,
) -> TabularRelease:
    """Anonymize ``rows`` with ``algorithm`` so that every class satisfies k (and ℓ, t when given).

    ``max_suppression`` is the fraction of rows that may be removed (MaxSup = ⌊max_suppression·n⌋, CONCEPTS
    §8); ``sensitive_hierarchy`` selects the hierarchical ground distance for t-closeness on a categorical
    sensitive attribute (default: equal distance; numbers use the ordered distance). Raises
    :class:`NotApplicable` (exit 2) for combinations that do not apply or bad input and
    :class:`Unsatisfiable` (exit 1) when the criteria cannot be met within the budget.
    """
    if algorithm not in ALGORITHMS:
        raise NotApplicable(f"unknown tabular algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if not quasi_identifiers:
        raise NotApplicable("at least one quasi-identifier is needed")
    if not (0.0 <= max_suppression <= 1.0) or math.isnan(max_suppression):
        raise InvalidTableInput("max_suppression must be in [0, 1]")
    qi_cols = [c_ for q in quasi_identifiers for c_ in q.columns]
    if len(set(qi_cols)) != len(qi_cols) or len({q.name for q in quasi_identifiers}) != len(quasi_identifiers):
        raise InvalidTableInput("quasi-identifier names and columns must be distinct")
    if sensitive is not None and sensitive in qi_cols:
        raise InvalidTableInput(f"column {sensitive!r} cannot be both quasi-identifier and sensitive")
    n = len(rows)
    needed = [*qi_cols, *([sensitive] if sensitive is not None else [])]
    columns: dict[str, list[Any]] = {}
    for col in needed:
        try:
            columns[col] = [r[col] for r in rows]
        except KeyError as exc:
            raise InvalidTableInput(f"missing column {col!r}") from exc
    for col in qi_cols:
        if any(v is None or v == "" for v in columns[col]):
            raise InvalidTableInput(f"column {col!r}: empty quasi-identifier value")
    if n == 0:
        build_criteria(k=k, l=l, l_kind=l_kind, c=c, t=t, sensitive=None if sensitive is None else _EMPTY)
        if algorithm == "anatomy" and (sensitive is None or l is None):
            raise NotApplicable("anatomy needs a sensitive column and l")
        metrics: dict[str, float | None] = dict.fromkeys(("ncp", "discernibility", "prec", "whd", "modification_rate"))
        return TabularRelease([], 0, 0, 0, None, None, metrics, [] if algorithm == "anatomy" else None)
    sens = SensitiveColumn.build(sensitive, columns[sensitive], sensitive_hierarchy) if sensitive is not None else None
    criteria = build_criteria(k=k, l=l, l_kind=l_kind, c=c, t=t, sensitive=sens)
    if algorithm == "anatomy" and (sens is None or l is None):
        raise NotApplicable("anatomy needs a sensitive column and l")
    table = Table(n, tuple(quasi_identifiers), columns, criteria, math.floor(max_suppression * n + 1e-9))
    rng = np.random.default_rng(seed)
    if algorithm == "anatomy":
        from kcloak.cloaking.tabular.anatomy import run_anatomy

        return run_anatomy(table, rows, rng)
    outcome = _run(algorithm)(table, rng)
    return _assemble(table, rows, outcome, criteria, rng)


def achieved(criteria: CriteriaSet, classes: Sequence[IntArray]) -> tuple[int, float | None, float | None]:
    """``k_achieved`` (smallest class), ``l_achieved`` and ``t_achieved`` (largest EMD) of released classes."""
    k_ach = min((len(cl) for cl in classes), default=0)
    sens = criteria.sensitive
    if sens is None:
        return k_ach, None, None
    if not classes:
        return k_ach, None, None
    counts = np.stack([np.bincount(sens.codes[cl], minlength=sens.m) for cl in classes]).astype(np.int64)
    l_ach = l_achieved(counts, criteria.l_kind, criteria.c)
    released = np.concatenate(classes)
    q = sens.distribution(released)
    sizes = counts.sum(axis=1, keepdims=True).astype(np.float64)
    p = counts / sizes
    t_ach = float(sens.distance.emd(p, np.broadcast_to(q, p.shape)).max())
    return k_ach, l_ach, t_ach


def _written_rows(
    rows: Sequence[Mapping[str, Any]], outcome: Outcome, rng: np.random.Generator
) -> list[dict[str, str]]:
    """Released rows in random order: input columns as strings, QI columns replaced by the class's forms."""
    if not outcome.classes:
        return []
    sizes = np.asarray([len(c) for c in outcome.classes], dtype=np.int64)
    members = np.concatenate(outcome.classes)
    order = rng.permutation(len(members))
    row_ids = members[order].tolist()
    class_of = np.repeat(np.arange(len(sizes)), sizes)[order].tolist()
    keys = list(rows[row_ids[0]].keys())
    written_cols = list(outcome.written[0].keys())
    key_set = set(keys)
    n_keys = len(keys)
    if all(len(rows[i]) == n_keys for i in row_ids) and all(c in key_set for c in written_cols):
        columns: list[list[str]] = []
        try:
            for key in keys:
                if key in outcome.written[0]:
                    per_class = [w[key] for w in outcome.written]
                    columns.append([per_class[c] for c in class_of])
                else:
                    columns.append(["" if (v := rows[i][key]) is None else str(v) for i in row_ids])
        except KeyError:
            pass  # rows with different columns: the general path below
        else:
            return [dict(zip(keys, vals, strict=True)) for vals in zip(*columns, strict=True)]
    out: list[dict[str, str]] = []
    for i, c in zip(row_ids, class_of, strict=True):
        row = {key: _cell(v) for key, v in rows[i].items()}
        row.update(outcome.written[c])
        out.append(row)
    return out


def _assemble(
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    outcome: Outcome,
    criteria: CriteriaSet,
    rng: np.random.Generator,
) -> TabularRelease:
    shuffled = _written_rows(rows, outcome, rng)
    k_ach, l_ach, t_ach = achieved(criteria, outcome.classes)
    n_qi_cols = len(table.qi_columns)
    return TabularRelease(
        rows=shuffled,
        suppressed_rows=len(outcome.suppressed),
        classes=len(outcome.classes),
        k_achieved=k_ach,
        l_achieved=l_ach,
        t_achieved=t_ach,
        metrics=release_metrics(outcome, table.n, len(table.qis), n_qi_cols),
    )
