"""``kcloak release TABLE INPUT -o OUT`` (contract §8, §9): build a table, anonymize it, write it.

Exit codes: 0 released; 1 the requirements cannot be met within ``--max-suppression``; 2 bad
flags, an unreadable source or a combination that does not apply.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from broker.cli import UsageError
from cloaking.places import PoiFileError, PoiSet, load_pois
from streams.release import (
    ReleaseError,
    ReleaseOutcome,
    ReleaseParams,
    ReleaseUnsatisfiable,
    check_params,
    release_table,
)
from streams.tables import (
    SOURCE_FORMATS,
    BuildOptions,
    TableError,
    TableKind,
    build_table,
    write_table_csv,
)

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

_STAGES = ("reading and building the table", "anonymizing", "writing")


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser(
        "release",
        help="release trips, stay points, visited places or the query log as an anonymized table",
        description=(
            "Build a table (trips, staypoints, places or querylog) from trajectories, a kcloak data directory "
            "or a CSV that already holds the table, anonymize it (k-anonymity with optional l-diversity and "
            "t-closeness; k^m-anonymity for places) and write a CSV with fresh row ids in random order. "
            "Direct identifiers are dropped; suppressed rows are removed and counted in the report."
        ),
    )
    p.add_argument(
        "table", choices=[k.value for k in TableKind], metavar="TABLE", help="trips|staypoints|places|querylog"
    )
    p.add_argument("input", metavar="INPUT", help="trajectory file or folder, data directory, or table CSV")
    p.add_argument("-o", dest="output", required=True, metavar="OUT", help="released CSV (.gz allowed)")
    p.add_argument("--k", type=int, required=True, metavar="K", help="k (every class, or every ≤ m items, ≥ k rows)")
    p.add_argument("--l", type=int, default=None, metavar="L", help="l-diversity of the sensitive column")
    p.add_argument("--l-kind", choices=("distinct", "entropy", "recursive"), default="distinct", help="(distinct)")
    p.add_argument("--c", type=float, default=None, metavar="C", help="c of recursive (c,l)-diversity")
    p.add_argument("--t", type=float, default=None, metavar="T", help="t-closeness, 0 < T ≤ 1")
    p.add_argument("--m", type=int, default=None, metavar="M", help="places only: attacker knows ≤ M items (2)")
    p.add_argument("--algorithm", default=None, metavar="NAME", help="mondrian (tables) / acd (places) by default")
    p.add_argument("--max-suppression", type=float, default=0.01, metavar="F", help="largest suppressed fraction")
    p.add_argument("--format", choices=SOURCE_FORMATS, default=None, help="input format (default: auto)")
    p.add_argument("--pois", default=None, metavar="FILE", help="POIs for stay point categories (bundled Beijing)")
    p.add_argument("--stay-radius-m", type=float, default=200.0, metavar="M", help="stay point radius (200)")
    p.add_argument("--stay-min-s", type=float, default=1200.0, metavar="S", help="stay point minimum duration (1200)")
    p.add_argument("--place-precision", type=int, default=7, metavar="N", help="geohash length of places (7)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed of row ids and order (random)")
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the release report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


@contextmanager
def _stages(enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with bar:
        yield bar


def sensitive_path(output: Path) -> Path:
    """``<OUT stem>.sensitive.csv`` (``.gz`` kept) next to ``OUT`` (contract §8, Anatomy)."""
    name = output.name
    gz = name.lower().endswith(".gz")
    base = name[:-3] if gz else name
    if base.lower().endswith(".csv"):
        base = base[:-4]
    return output.with_name(f"{base}.sensitive.csv" + (".gz" if gz else ""))


def run(args: argparse.Namespace) -> int:
    kind = TableKind(args.table)
    params = ReleaseParams(
        k=args.k,
        algorithm=args.algorithm,
        l=args.l,
        l_kind=args.l_kind,
        c=args.c,
        t=args.t,
        m=args.m,
        max_suppression=args.max_suppression,
        seed=args.seed,
    )
    err = Console(stderr=True)
    try:
        options = BuildOptions(
            stay_radius_m=args.stay_radius_m, stay_min_s=args.stay_min_s, place_precision=args.place_precision
        )
        check_params(kind, params)
        pois: PoiSet | None = load_pois(args.pois) if kind is TableKind.STAYPOINTS else None
    except (TableError, ReleaseError, PoiFileError) as exc:
        raise UsageError(str(exc)) from None
    progress = not args.no_progress and sys.stderr.isatty()
    with _stages(progress) as bar:
        task = bar.add_task(_STAGES[0], total=len(_STAGES)) if bar is not None else None
        try:
            table = build_table(args.input, kind, fmt=args.format, options=options, pois=pois)
        except TableError as exc:
            raise UsageError(str(exc)) from None
        if bar is not None and task is not None:
            bar.update(task, advance=1, description=f"{_STAGES[1]} {len(table)} rows")
        provenance: dict[str, Any] = {"input": str(args.input), "output": str(args.output)}
        try:
            outcome = release_table(table, params, provenance=provenance)
        except ReleaseError as exc:
            raise UsageError(str(exc)) from None
        except ReleaseUnsatisfiable as exc:
            err.print(f"[red]not released[/red]: {exc}; nothing written")
            return 1
        if bar is not None and task is not None:
            bar.update(task, advance=1, description=_STAGES[2])
        try:
            _write(Path(args.output), outcome, args.report)
        except OSError as exc:
            err.print(f"[red]cannot write the release[/red]: {exc.strerror or type(exc).__name__}")
            return 1
        if bar is not None and task is not None:
            bar.update(task, advance=1)
    rep = outcome.report
    err.print(
        f"released {rep['n_out']} of {rep['n_in']} {kind.value} rows with {rep['algorithm']} "
        f"(k={rep['k']}, k achieved {rep['k_achieved']}, suppressed {rep['suppressed_rows']}, "
        f"bad input rows {table.n_bad_rows}) in {rep['runtime_s']:.2f} s"
    )
    return 0


def _write(output: Path, outcome: ReleaseOutcome, report_path: str | None) -> None:
    write_table_csv(output, outcome.columns, outcome.rows)
    if outcome.sensitive_columns is not None and outcome.sensitive_rows is not None:
        write_table_csv(sensitive_path(output), outcome.sensitive_columns, outcome.sensitive_rows)
    if report_path:
        Path(report_path).write_text(json.dumps(outcome.report, indent=1) + "\n", encoding="utf-8")


__all__ = ["add_parser", "run", "sensitive_path"]
