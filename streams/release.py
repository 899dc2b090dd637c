"""Table releases (contract §8; CONCEPTS §8): built table in, released rows and report out.

``places`` goes through k^m-anonymity (:mod:`kcloak.cloaking.tabular.km`, ACD or AA); ``trips``,
``staypoints`` and ``querylog`` through :func:`kcloak.cloaking.tabular.anonymize_table`. Either way
direct identifiers are dropped, every released row gets a fresh random ``row_id`` (contract §1)
and rows are written in random order.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from kcloak import __version__
from kcloak.cloaking.tabular import ALGORITHMS, NotApplicable, QuasiIdentifier, Unsatisfiable, anonymize_table
from kcloak.cloaking.tabular.km import KmAlgorithm, KmError, KmUnsatisfiable, release_places
from kcloak.core.errors import InputError
from kcloak.streams.errors import StreamsError
from kcloak.streams.publish import fresh_ids
from kcloak.streams.tables import BEFORE_COLUMNS, IDENTIFIERS, Table, TableError, TableKind

LKind = Literal["distinct", "entropy", "recursive"]

KM_ALGORITHMS: tuple[str, ...] = tuple(a.value for a in KmAlgorithm)
DEFAULT_ALGORITHM: dict[TableKind, str] = {
    TableKind.TRIPS: "mondrian",
    TableKind.STAYPOINTS: "mondrian",
    TableKind.QUERYLOG: "mondrian",
    TableKind.PLACES: KmAlgorithm.ACD.value,
}
DEFAULT_M = 2

QUASI_IDENTIFIERS: dict[TableKind, tuple[QuasiIdentifier, ...]] = {
    TableKind.TRIPS: (
        QuasiIdentifier("origin", "latlon", ("origin_lat", "origin_lon")),
        QuasiIdentifier("destination", "latlon", ("dest_lat", "dest_lon")),
        QuasiIdentifier("start_t", "time", ("start_t",)),
        QuasiIdentifier("duration_s", "numeric", ("duration_s",)),
    ),
    TableKind.STAYPOINTS: (
        QuasiIdentifier("position", "latlon", ("lat", "lon")),
        QuasiIdentifier("arrival_t", "time", ("arrival_t",)),
        QuasiIdentifier("duration_s", "numeric", ("duration_s",)),
    ),
    TableKind.QUERYLOG: (
        QuasiIdentifier("t", "time", ("t",)),
        QuasiIdentifier("position", "latlon", ("lat", "lon")),
    ),
}
"""Quasi-identifiers per tabular table; a position is one ``latlon`` QI (geohash grid hierarchy)."""

REPORTED_QIS: dict[TableKind, list[str]] = {
    TableKind.TRIPS: ["origin", "destination", "start_t", "duration_s"],
    TableKind.STAYPOINTS: ["lat", "lon", "arrival_t", "duration_s"],
    TableKind.PLACES: ["places"],
    TableKind.QUERYLOG: ["t", "lat", "lon"],
}
"""The report's ``quasi_identifiers``, in the contract's words (§8 table)."""

SENSITIVE: dict[TableKind, str | None] = {
    TableKind.TRIPS: "mode",
    TableKind.STAYPOINTS: "category",
    TableKind.PLACES: None,
    TableKind.QUERYLOG: "category",
}


class ReleaseError(StreamsError, InputError, ValueError):
    """A parameter combination that does not apply (exit 2)."""


class ReleaseUnsatisfiable(StreamsError, RuntimeError):
    """The privacy requirements cannot be met within the suppression budget (exit 1)."""


class NothingToRelease(StreamsError, RuntimeError):
    """The trajectories yield no row of the table (exit 1): the message says why."""


def check_not_empty(table: Table, name: str, *, from_table_rows: bool) -> None:
    """Refuse a built table without rows: :class:`TableError` (exit 2) when no input row was usable
    (``from_table_rows``: the source held the table itself), :class:`NothingToRelease` (exit 1) when
    usable trajectories yield no row. ``name`` names the source in the message."""
    if len(table):
        return
    if from_table_rows or table.n_trajectories == 0:
        raise TableError(f"{name}: no usable input rows ({table.n_bad_rows} bad rows)")
    if table.kind is TableKind.QUERYLOG:
        raise NothingToRelease(f"{name} holds no forwarded query")
    raise NothingToRelease(
        f"no {table.kind.value} rows in the {table.n_trajectories} trajectories of {name} (stay points:"
        " see --stay-radius-m and --stay-min-s)"
    )


@dataclass(frozen=True, slots=True)
class ReleaseParams:
    """Parameters of ``kcloak release`` (contract §9); ``None`` = not given."""

    k: int
    algorithm: str | None = None
    l: int | None = None  # noqa: E741 - the model's name
    l_kind: LKind = "distinct"
    c: float | None = None
    t: float | None = None
    m: int | None = None
    max_suppression: float = 0.01
    seed: int | None = None


@dataclass(frozen=True, slots=True, eq=False)
class ReleaseOutcome:
    """Released rows (with ``row_id``, random order), their columns, the report, Anatomy's sensitive table."""

    columns: tuple[str, ...]
    rows: list[dict[str, str]]
    report: dict[str, Any]
    sensitive_columns: tuple[str, ...] | None = None
    sensitive_rows: list[dict[str, str]] | None = None


def after_columns(kind: TableKind) -> tuple[str, ...]:
    """Released columns of ``kind`` (contract §8 "after")."""
    return ("row_id", *(c for c in BEFORE_COLUMNS[kind] if c not in IDENTIFIERS))


def check_params(kind: TableKind, p: ReleaseParams) -> str:
    """The algorithm to run; :class:`ReleaseError` for values or combinations that do not apply."""
    if isinstance(p.k, bool) or p.k < 1:
        raise ReleaseError("--k: must be an integer ≥ 1")
    if not (0.0 <= p.max_suppression <= 1.0) or math.isnan(p.max_suppression):
        raise ReleaseError("--max-suppression: must be within [0, 1]")
    algo = p.algorithm or DEFAULT_ALGORITHM[kind]
    if kind is TableKind.PLACES:
        if algo not in KM_ALGORITHMS:
            raise ReleaseError(f"--algorithm: places takes {' or '.join(KM_ALGORITHMS)}")
        for flag, value in (("--l", p.l), ("--c", p.c), ("--t", p.t)):
            if value is not None:
                raise ReleaseError(f"{flag}: does not apply to places (no sensitive column; k^m-anonymity)")
        if p.l_kind != "distinct":
            raise ReleaseError("--l-kind: does not apply to places")
        if p.m is not None and p.m < 1:
            raise ReleaseError("--m: must be an integer ≥ 1")
        return algo
    if algo not in ALGORITHMS:
        if algo in KM_ALGORITHMS:
            raise ReleaseError(f"--algorithm {algo}: applies to places only")
        raise ReleaseError(f"--algorithm: must be one of {', '.join(ALGORITHMS)}")
    if p.m is not None:
        raise ReleaseError("--m: applies to places only")
    if p.c is not None and p.l_kind != "recursive":
        raise ReleaseError("--c: applies to --l-kind recursive only")
    if p.l_kind != "distinct" and p.l is None:
        raise ReleaseError("--l-kind: needs --l")
    if p.l is not None and (isinstance(p.l, bool) or p.l < 1):
        raise ReleaseError("--l: must be an integer ≥ 1")
    if p.c is not None and not (math.isfinite(p.c) and p.c > 0):
        raise ReleaseError("--c: must be a finite number > 0")
    if p.l_kind == "recursive" and p.c is None:
        raise ReleaseError("--l-kind recursive: needs --c")
    if p.t is not None and not (0.0 < p.t <= 1.0):
        raise ReleaseError("--t: must be within (0, 1]")
    if algo == "anatomy" and p.l is None:
        raise ReleaseError("--algorithm anatomy: needs --l (it publishes l-diverse groups of the sensitive column)")
    return algo


def _rng(seed: int | None) -> random.Random:
    return secrets.SystemRandom() if seed is None else random.Random(seed)


def release_table(table: Table, params: ReleaseParams, *, provenance: dict[str, Any] | None = None) -> ReleaseOutcome:
    """Anonymize a built table (contract §8); raises :class:`ReleaseError` / :class:`ReleaseUnsatisfiable`."""
    algo = check_params(table.kind, params)
    started = time.perf_counter()
    if table.kind is TableKind.PLACES:
        outcome = _release_places(table, params, algo)
    else:
        outcome = _release_tabular(table, params, algo)
    runtime = time.perf_counter() - started
    report: dict[str, Any] = {
        "kcloak_version": __version__,
        "table": table.kind.value,
        "algorithm": algo,
        "input": None,
        "output": None,
        "k": params.k,
        "l": params.l,
        "l_kind": params.l_kind,
        "c": params.c,
        "t": params.t,
        "m": (params.m if params.m is not None else DEFAULT_M) if table.kind is TableKind.PLACES else None,
        "max_suppression": params.max_suppression,
        "quasi_identifiers": REPORTED_QIS[table.kind],
        "sensitive": SENSITIVE[table.kind],
        "n_in": len(table),
        "n_out": len(outcome.rows),
        **outcome.report,
        "runtime_s": round(runtime, 6),
        "seed": params.seed,
        "n_bad_rows": table.n_bad_rows,
    }
    if provenance:
        report.update(provenance)
    return ReleaseOutcome(outcome.columns, outcome.rows, report, outcome.sensitive_columns, outcome.sensitive_rows)


def _with_row_ids(rows: list[dict[str, str]], columns: tuple[str, ...], rng: random.Random) -> list[dict[str, str]]:
    ids = fresh_ids(len(rows), rng)
    out = [{"row_id": i, **{c: r[c] for c in columns if c != "row_id"}} for i, r in zip(ids, rows, strict=True)]
    rng.shuffle(out)
    return out


def _release_places(table: Table, params: ReleaseParams, algo: str) -> ReleaseOutcome:
    m = params.m if params.m is not None else DEFAULT_M
    bags = [r["places"].split(" ") for r in table.rows]
    try:
        km = release_places(bags, k=params.k, m=m, algorithm=algo, max_suppression=params.max_suppression)
    except KmUnsatisfiable as exc:
        raise ReleaseUnsatisfiable(str(exc)) from None
    except KmError as exc:
        raise ReleaseError(str(exc)) from None
    released = [{"places": " ".join(rec)} for rec in km.records if rec is not None]
    columns = after_columns(TableKind.PLACES)
    rows = _with_row_ids(released, columns, _rng(params.seed))
    n_items = sum(len(r) for r in km.records if r is not None)
    report = {
        "suppressed_rows": km.suppressed_rows,
        "classes": None,
        "k_achieved": km.k_achieved,
        "l_achieved": None,
        "t_achieved": None,
        "metrics": {
            "ncp": km.ncp,
            "discernibility": None,
            "prec": None,
            "whd": None,
            "modification_rate": km.generalized_items / n_items if n_items else None,
        },
    }
    return ReleaseOutcome(columns, rows, report)


def _release_tabular(table: Table, params: ReleaseParams, algo: str) -> ReleaseOutcome:
    rows_in = [{c: v for c, v in r.items() if c not in IDENTIFIERS} for r in table.rows]
    try:
        rel = anonymize_table(
            rows_in,
            quasi_identifiers=QUASI_IDENTIFIERS[table.kind],
            sensitive=SENSITIVE[table.kind],
            algorithm=algo,
            k=params.k,
            l=params.l,
            l_kind=params.l_kind,
            c=params.c,
            t=params.t,
            max_suppression=params.max_suppression,
            seed=params.seed,
        )
    except Unsatisfiable as exc:
        raise ReleaseUnsatisfiable(str(exc)) from None
    except NotApplicable as exc:
        raise ReleaseError(str(exc)) from None
    rng = _rng(params.seed)
    columns = after_columns(table.kind)
    sens_cols: tuple[str, ...] | None = None
    sens_rows: list[dict[str, str]] | None = None
    if rel.sensitive_table is not None:
        sensitive = SENSITIVE[table.kind]
        columns = (*(c for c in columns if c != sensitive), "group_id")
        sens_cols = ("group_id", str(sensitive), "count")
        sens_rows = [{c: str(r[c]) for c in sens_cols} for r in rel.sensitive_table]
        rng.shuffle(sens_rows)
    rows = _with_row_ids(rel.rows, columns, rng)
    report = {
        "suppressed_rows": rel.suppressed_rows,
        "classes": rel.classes,
        "k_achieved": rel.k_achieved,
        "l_achieved": rel.l_achieved,
        "t_achieved": rel.t_achieved,
        "metrics": dict(rel.metrics),
    }
    return ReleaseOutcome(columns, rows, report, sens_cols, sens_rows)


__all__ = [
    "DEFAULT_ALGORITHM",
    "KM_ALGORITHMS",
    "QUASI_IDENTIFIERS",
    "REPORTED_QIS",
    "SENSITIVE",
    "NothingToRelease",
    "ReleaseError",
    "ReleaseOutcome",
    "ReleaseParams",
    "ReleaseUnsatisfiable",
    "after_columns",
    "check_not_empty",
    "check_params",
    "release_table",
]
