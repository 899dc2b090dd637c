"""``kcloak anonymize INPUT -o OUTPUT`` (contract §9): publish trajectories only as (k,δ)-anonymous ones."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import time
from pathlib import Path
from typing import Any

from kcloak import __version__
from kcloak.cli.main import SubParsers, UsageError
from kcloak.core.names import InputFormat, TrajectoryDistance, values

# Spelled out so that building the ``kcloak`` parser imports neither numpy nor scipy; a test checks
# it against kcloak.streams.kdelta.w4m.DEFAULT_TAU_S. The algorithms are imported when the command runs.
FORMATS: tuple[str, ...] = values(InputFormat)
DEFAULT_TAU_S = 60.0
DEFAULT_MAX_TIME_SHIFT_S = 3600.0
DEFAULT_W4M_MAX_RADIUS = 0.9
OUTLIER_DELTAS = 10
"""A published point moved by more than this many δ is worth a warning (outliers joined a group)."""
DISTANCES: tuple[str, ...] = values(TrajectoryDistance)


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser(
        "anonymize",
        help="publish trajectories only as (k,δ)-anonymous ones (Never Walk Alone, Wait For Me, microaggregation)",
        description=(
            "Read trajectories (contract CSV, GeoLife .plt folders, GPX or AIS CSV), anonymize them so that "
            "every published trajectory has at least k−1 others within delta metres at every instant, and "
            "write a contract CSV with fresh ids and randomized row order. Outliers go to a bounded trash. "
            "The output is written only on success; too few trajectories or a trash over --trash-max exit 1."
        ),
    )
    p.add_argument("input", metavar="INPUT", help="trajectory file or folder")
    p.add_argument("-o", dest="output", required=True, metavar="OUTPUT", help="published CSV (.gz allowed)")
    p.add_argument("--k", type=int, required=True, metavar="K", help="group size k (≥ 2)")
    p.add_argument("--delta", type=float, required=True, metavar="M", help="delta in metres")
    p.add_argument("--method", default="nwa", metavar="NAME", help="nwa (default), w4m or microagg")
    p.add_argument("--format", choices=FORMATS, default=None, help="input format (default: by suffix or folder)")
    p.add_argument("--trash-max", type=float, default=0.1, metavar="F", help="largest trashed fraction (0.1)")
    p.add_argument("--report", metavar="FILE.json", help="write the report (contract §7 fields) here")
    p.add_argument("--mapping", metavar="FILE.csv", help="audit only: write published_id,traj_id")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed of ids and row order (random)")
    p.add_argument(
        "--tau-s", type=float, default=None, metavar="S", help=f"w4m: time tolerance of a match ({DEFAULT_TAU_S:g} s)"
    )
    p.add_argument("--distance", choices=DISTANCES, default="edr", help="w4m: edit distance (edr)")
    p.add_argument(
        "--max-time-shift-s",
        type=float,
        default=None,
        metavar="S",
        help=f"w4m: largest time shift of a published point ({DEFAULT_MAX_TIME_SHIFT_S:g} s = an hour)",
    )
    p.add_argument(
        "--max-radius",
        type=float,
        default=None,
        metavar="R",
        help=(
            "clustering radius beyond which a trajectory is trash: w4m, normalized edit distance in [0, 1] "
            f"({DEFAULT_W4M_MAX_RADIUS:g}); nwa, root-mean-square metres per instant from the pivot (unbounded)"
        ),
    )
    p.add_argument("--pi-s", type=float, default=60.0, metavar="S", help="nwa: time granularity of the classes (60)")
    p.add_argument(
        "--no-suggest",
        action="store_true",
        help="when refused, do not try the other methods on the same input to say which would publish it",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kcloak.core.readers import ReaderError, read_fixes, write_contract_csv
    from kcloak.streams.kdelta import KDeltaError
    from kcloak.streams.publish import (
        anonymize,
        check_anonymize_params,
        other_methods,
        refusal_reason,
        small_class_lines,
    )

    try:
        check_anonymize_params(
            method=args.method,
            k=args.k,
            delta_m=args.delta,
            trash_max=args.trash_max,
            pi_s=args.pi_s,
            tau_s=args.tau_s,
            distance=args.distance,
            max_time_shift_s=args.max_time_shift_s,
            max_radius=args.max_radius,
        )
    except KDeltaError as exc:
        raise UsageError(str(exc)) from None
    for flag, target in (("-o", args.output), ("--report", args.report), ("--mapping", args.mapping)):
        if target is not None and not Path(target).resolve().parent.is_dir():
            raise UsageError(f"{flag} {target}: its folder does not exist")
    err = Console(stderr=True)
    show = not args.no_progress and err.is_terminal

    def phase(text: str) -> contextlib.AbstractContextManager[Any]:
        return err.status(text) if show else contextlib.nullcontext()

    with phase(f"reading {args.input}"):
        try:
            fixes = read_fixes(args.input, args.format)
        except ReaderError as exc:
            raise UsageError(str(exc)) from None
    started = time.perf_counter()
    with phase(f"anonymizing {len(fixes.t)} fixes with {args.method} (k={args.k}, delta={args.delta:g} m)"):
        try:
            release = anonymize(
                fixes,
                method=args.method,
                k=args.k,
                delta_m=args.delta,
                trash_max=args.trash_max,
                seed=args.seed,
                tau_s=args.tau_s,
                distance=args.distance,
                pi_s=args.pi_s,
                max_time_shift_s=args.max_time_shift_s,
                max_radius=args.max_radius,
            )
        except KDeltaError as exc:
            raise UsageError(str(exc)) from None
    report: dict[str, Any] = {
        "kcloak_version": __version__,
        "input": str(args.input),
        "output": str(args.output),
        "format": args.format or "auto",
        "seed": args.seed,
        **release.report,
    }
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if not release.ok:
        err.print(
            f"[red]not published[/red]: {refusal_reason(report)}; nothing written", highlight=False, soft_wrap=True
        )
        if release.small_classes:
            err.print("  too small for k (span, trajectories):", highlight=False)
            for line in small_class_lines(release.small_classes):
                err.print(f"    {line}", highlight=False, soft_wrap=True)
        if not args.no_suggest and report["n_in"] >= args.k:
            with phase("trying the other methods on the same input"):
                for line in other_methods(fixes, report, pi_s=args.pi_s, tau_s=args.tau_s, distance=args.distance):
                    err.print(f"  {line}", highlight=False, soft_wrap=True)
        return 1
    write_contract_csv(args.output, release.table)
    if args.mapping:
        with open(args.mapping, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["published_id", "traj_id"])
            w.writerows(sorted(release.mapping.items()))
    tr, ts = report["translation_m"], report["time_shift_s"]
    if args.delta > 0 and tr["max"] > OUTLIER_DELTAS * args.delta:
        err.print(
            f"[yellow]warning[/yellow]: some published points moved more than {OUTLIER_DELTAS}×delta "
            f"(largest {tr['max']:,.0f} m)"
            + (
                "; --max-radius trashes trajectories beyond the clustering radius instead"
                if args.method in ("nwa", "w4m")
                else "; microaggregation has no radius: --method nwa or w4m with --max-radius bounds it"
            ),
            highlight=False,
            soft_wrap=True,
        )
    err.print(
        f"published {report['n_out']} of {report['n_in']} trajectories in {report['n_groups']} groups "
        f"(trash {report['n_trash']}, mean translation {report['mean_translation_m']:.1f} m; translation "
        f"median/p95/max {tr['median']:.0f}/{tr['p95']:.0f}/{tr['max']:.0f} m, time shift "
        f"{ts['median']:.0f}/{ts['p95']:.0f}/{ts['max']:.0f} s) in {time.perf_counter() - started:.1f} s",
        highlight=False,
        soft_wrap=True,
    )
    return 0
