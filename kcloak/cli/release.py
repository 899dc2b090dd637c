"""``kcloak release TABLE INPUT -o OUT`` (contract §8, §9): build a table, anonymize it, write it.

Exit codes: 0 released; 1 the requirements cannot be met within ``--max-suppression``, the input
yields no rows of the table, or the output cannot be written; 2 bad flags, an unreadable, empty
or unrecognised source, a combination that does not apply, or an output folder that does not
exist. Nothing is written unless the whole release succeeds (each file goes to a temporary name
first, then is renamed). Heavy modules are imported when the command runs, so that
``kcloak --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcloak.cli._progress import rich_bar
from kcloak.cli.main import UsageError
from kcloak.core.names import PlacesAlgorithm, TabularAlgorithm, values

if TYPE_CHECKING:
    from rich.progress import Progress

    from kcloak.cli.main import SubParsers
    from kcloak.streams.release import ReleaseOutcome

# Choices spelled out here so that building the parser imports nothing heavy; tests check them
# against kcloak.streams.tables (TableKind, SOURCE_FORMATS, owned by the table builders).
TABLES: tuple[str, ...] = ("trips", "staypoints", "places", "querylog")
SOURCE_FORMATS: tuple[str, ...] = ("csv", "geolife", "gpx", "ais", "table", "datadir")
L_KINDS: tuple[str, ...] = ("distinct", "entropy", "recursive")
TABULAR_ALGORITHMS: tuple[str, ...] = values(TabularAlgorithm)
PLACES_ALGORITHMS: tuple[str, ...] = values(PlacesAlgorithm)

_STAGES = ("reading and building the table", "anonymizing", "writing")

_EPILOG = (
    "Output: OUT holds the table's released columns (row_id first, rows in random order, suppressed "
    "rows removed); with --algorithm anatomy OUT holds the quasi-identifiers and group_id, and "
    "<OUT stem>.sensitive.csv holds group_id,<sensitive>,count. --report FILE.json gets the release "
    "report (kcloak_version, table, algorithm, input, output, k, l, l_kind, c, t, m, max_suppression, "
    "quasi_identifiers, sensitive, n_in, n_out, suppressed_rows, classes, k_achieved, l_achieved, "
    "t_achieved, metrics, runtime_s, seed, n_bad_rows). A one-line summary goes to stderr. Nothing is "
    "written unless the release succeeds. "
    "Exit codes: 0 released; 1 requirements not met within --max-suppression, nothing to release, or "
    "output not writable; 2 bad flags, unreadable, empty or unrecognised input, a combination that "
    "does not apply (e.g. --m outside places, --l with places, anatomy without --l)."
)


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
        epilog=_EPILOG,
    )
    p.add_argument("table", choices=TABLES, metavar="TABLE", help="trips|staypoints|places|querylog")
    p.add_argument("input", metavar="INPUT", help="trajectory file or folder, data directory, or table CSV")
    p.add_argument("-o", dest="output", required=True, metavar="OUT", help="released CSV (.gz allowed)")
    p.add_argument("--k", type=int, required=True, metavar="K", help="k (every class, or every ≤ m items, ≥ k rows)")
    p.add_argument("--l", type=int, default=None, metavar="L", help="l-diversity of the sensitive column (none)")
    p.add_argument("--l-kind", choices=L_KINDS, default="distinct", help="l-diversity variant (distinct)")
    p.add_argument(
        "--c",
        type=float,
        default=None,
        metavar="C",
        help="c of --l-kind recursive (none)",
    )
    p.add_argument("--t", type=float, default=None, metavar="T", help="t-closeness, 0 < T ≤ 1 (none)")
    p.add_argument("--m", type=int, default=None, metavar="M", help="places only: attacker knows ≤ M items (2)")
    p.add_argument(
        "--algorithm",
        default=None,
        metavar="NAME",
        help=f"{', '.join(TABULAR_ALGORITHMS)} (default mondrian); places: {' or '.join(PLACES_ALGORITHMS)} (acd)",
    )
    p.add_argument("--max-suppression", type=float, default=0.01, metavar="F", help="most rows suppressed (0.01)")
    p.add_argument(
        "--format", choices=SOURCE_FORMATS, default=None, help="input format (auto: data directory, table CSV, suffix)"
    )
    p.add_argument("--pois", default=None, metavar="FILE", help="POIs for stay point categories (bundled Beijing)")
    p.add_argument("--stay-radius-m", type=float, default=200.0, metavar="M", help="stay point radius (200)")
    p.add_argument("--stay-min-s", type=float, default=1200.0, metavar="S", help="stay point minimum duration (1200)")
    p.add_argument("--place-precision", type=int, default=7, metavar="N", help="geohash length of places (7)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed of row ids and order (random)")
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the release report here (none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


@contextmanager
def _stages(enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    with rich_bar() as bar:
        yield bar


def sensitive_path(output: Path) -> Path:
    """``<OUT stem>.sensitive.csv`` (``.gz`` kept) next to ``OUT`` (contract §8, Anatomy)."""
    name = output.name
    gz = name.lower().endswith(".gz")
    base = name[:-3] if gz else name
    if base.lower().endswith(".csv"):
        base = base[:-4]
    return output.with_name(f"{base}.sensitive.csv" + (".gz" if gz else ""))


def check_writable(path: Path, flag: str) -> None:
    """Usage error (exit 2) unless ``path`` can be created: its folder exists and is writable, it is no folder."""
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"{flag}: {path.name} is a folder, not a file")
    if not folder.is_dir():
        raise UsageError(f"{flag}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: folder {folder} is not writable")


def _say(message: str) -> None:
    """One line on stderr (never wrapped: logs and scripts read it whole)."""
    print(message, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from kcloak.core.places import PoiFileError, PoiSet, load_pois
    from kcloak.streams.release import (
        NothingToRelease,
        ReleaseError,
        ReleaseParams,
        ReleaseUnsatisfiable,
        check_not_empty,
        check_params,
        release_table,
    )
    from kcloak.streams.tables import BuildOptions, TableError, TableKind, build_table, source_format

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
    output = Path(args.output)
    report_path = Path(args.report) if args.report else None
    try:
        options = BuildOptions(
            stay_radius_m=args.stay_radius_m, stay_min_s=args.stay_min_s, place_precision=args.place_precision
        )
        check_params(kind, params)
        check_writable(output, "-o")
        if report_path is not None:
            check_writable(report_path, "--report")
            if report_path.resolve() == output.resolve():
                raise UsageError("--report: must differ from -o")
        source = source_format(args.input, kind, args.format)
        pois: PoiSet | None = load_pois(args.pois) if kind is TableKind.STAYPOINTS else None
    except (TableError, ReleaseError, PoiFileError) as exc:
        raise UsageError(str(exc)) from None
    progress = not args.no_progress and sys.stderr.isatty()
    with _stages(progress) as bar:
        task = bar.add_task(_STAGES[0], total=len(_STAGES)) if bar is not None else None
        try:
            table = build_table(args.input, kind, fmt=args.format, options=options, pois=pois)
            check_not_empty(table, Path(args.input).name, from_table_rows=source == "table")
        except TableError as exc:
            raise UsageError(str(exc)) from None
        except NothingToRelease as exc:
            _say(f"kcloak: error: nothing to release: {exc}; nothing written")
            return 1
        if bar is not None and task is not None:
            bar.update(task, advance=1, description=f"{_STAGES[1]} {len(table)} rows")
        provenance: dict[str, Any] = {"input": str(args.input), "output": str(args.output)}
        try:
            outcome = release_table(table, params, provenance=provenance)
        except ReleaseError as exc:
            raise UsageError(str(exc)) from None
        except ReleaseUnsatisfiable as exc:
            _say(f"kcloak: error: not released: {exc}; nothing written")
            return 1
        if bar is not None and task is not None:
            bar.update(task, advance=1, description=_STAGES[2])
        try:
            write_release(output, outcome, report_path)
        except OSError as exc:
            _say(f"kcloak: error: cannot write the release ({exc.strerror or type(exc).__name__}); nothing written")
            return 1
        if bar is not None and task is not None:
            bar.update(task, advance=1)
    rep = outcome.report
    _say(
        f"released {rep['n_out']} of {rep['n_in']} {kind.value} rows with {rep['algorithm']} "
        f"(k={rep['k']}, k achieved {rep['k_achieved']}, suppressed {rep['suppressed_rows']}, "
        f"bad input rows {table.n_bad_rows}) in {rep['runtime_s']:.2f} s"
    )
    if rep.get("l") is not None and rep.get("l_achieved") is not None:
        _say(l_verdict(rep["l_kind"], int(rep["l"]), float(rep["l_achieved"])))
    return 0


def l_verdict(l_kind: str, l_required: int, l_reached: float) -> str:
    """One line: the ℓ required, the ℓ every class reaches (an integer printed as one) and the verdict."""
    shown = f"{l_reached:.0f}" if float(l_reached).is_integer() else f"{l_reached:.3f}"
    verdict = "met" if l_reached >= l_required else "NOT met"
    return f"{l_kind} l-diversity: required {l_required}, every class reaches {shown}: {verdict}"


def _temp_name(path: Path) -> Path:
    """A hidden sibling of ``path`` with the same suffix (``.gz`` decides compression)."""
    return path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}")


def write_release(output: Path, outcome: ReleaseOutcome, report_path: Path | None) -> None:
    """Write OUT, Anatomy's sensitive table and the report, all or none (temporary files, then renames)."""
    from kcloak.streams.tables import write_table_csv

    pending: list[tuple[Path, Path]] = []
    try:
        tmp = _temp_name(output)
        pending.append((tmp, output))
        write_table_csv(tmp, outcome.columns, outcome.rows)
        if outcome.sensitive_columns is not None and outcome.sensitive_rows is not None:
            sens = sensitive_path(output)
            tmp = _temp_name(sens)
            pending.append((tmp, sens))
            write_table_csv(tmp, outcome.sensitive_columns, outcome.sensitive_rows)
        if report_path is not None:
            tmp = _temp_name(report_path)
            pending.append((tmp, report_path))
            tmp.write_text(json.dumps(outcome.report, indent=1) + "\n", encoding="utf-8")
        for tmp, final in pending:
            os.replace(tmp, final)
    finally:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)


__all__ = ["add_parser", "check_writable", "run", "sensitive_path", "write_release"]
