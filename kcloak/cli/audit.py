"""``kcloak audit cloaking`` and ``kcloak audit trajectories`` (contract §9): flags in, report out."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kcloak.cli._progress import phase_progress
from kcloak.cli.main import UsageError
from kcloak.core.names import InputFormat, SpatialAlgorithm, values

if TYPE_CHECKING:
    from kcloak.cli.main import SubParsers
    from kcloak.cloaking.audit import AuditReport

# Spelled out so that building the ``kcloak`` parser imports neither numpy nor the attacks; tests
# check them against kcloak.cloaking.audit (DEFAULT_KS, DEFAULT_SYNTHETIC_USERS).
DEFAULT_KS: tuple[int, ...] = (5, 10, 20)
DEFAULT_SYNTHETIC_USERS = 3000
FORMATS: tuple[str, ...] = values(InputFormat)
SPATIAL_ALGORITHMS: tuple[str, ...] = values(SpatialAlgorithm)


def add_parser(subparsers: SubParsers) -> None:
    audit = subparsers.add_parser(
        "audit",
        help="what an attacker learns: attacks on cloaked requests and on published trajectories",
        description="Run the attacks of the threat model and report their success next to the 1/k baseline.",
    )
    sub = audit.add_subparsers(dest="audit", metavar="AUDIT")
    sub.required = True
    c = sub.add_parser(
        "cloaking",
        help="attack the regions every cloaking algorithm forwards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Each algorithm cloaks a request of every present user at every snapshot (what an attacker who\n"
            "knows the algorithm and the positions can recompute); the attacks centre, boundary, observation,\n"
            "restricted_space, homogeneity then target --queries requests spread over the snapshots, and\n"
            "query_tracking_naive / query_tracking_session follow continuous queries over all snapshots.\n"
            "Each row: success_rate next to baseline 1/k, trials, and a tolerance = upper end of the 99.9 %\n"
            "Wilson interval of a rate equal to 1/k over that many trials, minus 1/k.\n\n"
            "Population: a synthetic clustered city around Beijing that moves between snapshots (30 s apart),\n"
            "with homes and users standing at bundled POIs; or --data: successive snapshots of a trace\n"
            "(homes = night-time, else longest, stay points)."
        ),
    )
    c.add_argument("--data", metavar="CSV", help="trace to audit on (default: synthetic clustered city)")
    c.add_argument("--algorithms", default=",".join(SPATIAL_ALGORITHMS), metavar="A,B", help="algorithms (all six)")
    c.add_argument("--k", default=",".join(map(str, DEFAULT_KS)), metavar="K,K", help="k values (5,10,20)")
    c.add_argument("--snapshots", type=int, default=20, metavar="N", help="snapshots (20)")
    c.add_argument("--queries", type=int, default=1000, metavar="N", help="attacked requests per row (1000)")
    c.add_argument("--observed-fraction", type=float, default=0.1, metavar="F", help="observation attack (0.1)")
    c.add_argument(
        "--users", type=int, metavar="N", help=f"synthetic population size ({DEFAULT_SYNTHETIC_USERS}; not with --data)"
    )
    c.add_argument("--seed", type=int, metavar="N", help="seed of population, queriers and observers (random)")
    c.add_argument(
        "--report", metavar="DIR", help="write audit_cloaking.json and pictures here (pictures: the report extra)"
    )
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar with the time left on a terminal, else a line every 10 s)",
    )
    c.set_defaults(func=run_audit_cloaking)

    t = sub.add_parser(
        "trajectories",
        help="verify (k,δ) of a published file and attack it with known points",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Verify (k,δ)-anonymity of PUBLISHED from the file alone, then run the km linkage attack: the\n"
            "attacker knows m fixes of a victim's original trajectory, scores every published trajectory by\n"
            "its largest distance to them at the same instants, and names one of those within delta of the\n"
            "best score uniformly. Targets: the raw data, PUBLISHED (only with --mapping, the ground truth),\n"
            "and each --methods anonymization of ORIGINAL. Exit 1 if PUBLISHED is not (k,δ)-anonymous."
        ),
    )
    t.add_argument("published", metavar="PUBLISHED", help="published contract CSV")
    t.add_argument("--original", required=True, metavar="ORIGINAL", help="the original trajectories")
    t.add_argument("--k", type=int, required=True, metavar="K", help="k of the publication")
    t.add_argument("--delta", type=float, required=True, metavar="M", help="delta of the publication (m)")
    t.add_argument("--m", default="1,2,3", metavar="M,M", help="known points (1,2,3)")
    t.add_argument("--mapping", metavar="FILE.csv", help="published_id,traj_id (ground truth for PUBLISHED)")
    t.add_argument("--methods", default="", metavar="A,B", help="also anonymize ORIGINAL with these (nwa,w4m,microagg)")
    t.add_argument("--format", choices=FORMATS, default=None, help="format of ORIGINAL (by suffix)")
    t.add_argument("--seed", type=int, metavar="N", help="seed of the known points and anonymizations (random)")
    t.add_argument(
        "--report", metavar="DIR", help="write audit_trajectories.json and pictures here (pictures: the report extra)"
    )
    t.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    t.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    t.set_defaults(func=run_audit_trajectories)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise UsageError(f"{flag}: must be comma-separated integers") from None
    if not values:
        raise UsageError(f"{flag}: give at least one value")
    return values


def _seed(value: int | None) -> int:
    from kcloak.streams.attacks import LinkageError, audit_seed

    try:
        return audit_seed(value)
    except LinkageError as exc:
        raise UsageError(str(exc)) from None


def run_audit_cloaking(args: argparse.Namespace) -> int:
    """``kcloak audit cloaking``: exit 0 (an audit measures; it does not fail on a broken defence)."""
    from kcloak.cloaking.audit import (
        AuditConfig,
        AuditError,
        audit_world,
        check_population,
        run_audit,
        write_figures,
    )
    from kcloak.core.extras import require_pictures
    from kcloak.core.readers import ReaderError, read_fixes

    algorithms = tuple(dict.fromkeys(a.strip() for a in args.algorithms.split(",") if a.strip()))
    ks = _ints(args.k, "--k")
    if args.report:  # before the work, not after minutes of it
        require_pictures()
    try:
        check_population(
            snapshots=args.snapshots,
            users=args.users,
            with_data=args.data is not None,
            observed_fraction=args.observed_fraction,
        )
        seed = _seed(args.seed)
        config = AuditConfig(
            algorithms=algorithms,
            ks=ks,
            queries=args.queries,
            observed_fraction=args.observed_fraction,
            seed=seed,
        )
        if not args.no_progress:
            doing = f"reading {Path(args.data).name} and taking" if args.data is not None else "building"
            print(
                f"kcloak audit cloaking: {doing} {args.snapshots} snapshots (seed {seed})", file=sys.stderr, flush=True
            )
        fixes = None if args.data is None else read_fixes(args.data)
        source = Path(args.data).name if args.data else "data"
        world = audit_world(fixes, users=args.users, snapshots=args.snapshots, seed=seed, source=source)
    except (AuditError, ReaderError) as exc:
        raise UsageError(str(exc)) from None
    with phase_progress(not args.no_progress) as bar:
        report = run_audit(world, config, progress=bar)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "audit_cloaking.json").write_text(json.dumps(report.detailed_json(), indent=1) + "\n", encoding="utf-8")
        write_figures(report, out)
    if args.json:
        sys.stdout.write(json.dumps(report.to_json()) + "\n")
    else:
        print_cloaking_table(report)
    return 0


def cloaking_verdict(rate: float | None, baseline: float, tolerance: float | None) -> str:
    """What the numbers of one audit row say, as printed: at most 1/k; above 1/k but within the sampling
    tolerance (not distinguishable from a perfect cloak with this many trials); or above both (red)."""
    if rate is None or tolerance is None:
        return "—"
    if rate <= baseline:
        return "≤ 1/k"
    if rate <= baseline + tolerance:
        return "> 1/k, within tolerance"
    return "[red]> 1/k + tolerance[/red]"


def print_cloaking_table(report: AuditReport) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if sys.stdout.isatty() else 140)
    table = Table(
        title=f"audit cloaking — {report.world.get('source')}, seed {report.config.seed}", title_justify="left"
    )
    for name in ("algorithm", "k", "attack", "success", "1/k", "tolerance", "trials", "verdict"):
        table.add_column(name, justify="left" if name in ("algorithm", "attack", "verdict") else "right")
    for r in report.rows:
        verdict = cloaking_verdict(r.success_rate, r.baseline, r.tolerance)
        table.add_row(
            r.algorithm,
            str(r.k),
            r.attack,
            "—" if r.success_rate is None else f"{r.success_rate:.3f}",
            f"{r.baseline:.3f}",
            "—" if r.tolerance is None else f"{r.tolerance:.3f}",
            str(r.trials),
            verdict,
        )
    out.print(table)


def read_mapping(path: str) -> dict[str, str]:
    """``published_id,traj_id`` CSV (written by ``kcloak anonymize --mapping``)."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None or [h.strip() for h in header[:2]] != ["published_id", "traj_id"]:
                raise UsageError("--mapping: header must be published_id,traj_id")
            out: dict[str, str] = {}
            for row in reader:
                if len(row) >= 2 and row[0]:
                    out[row[0]] = row[1]
            return out
    except OSError as exc:
        raise UsageError(f"--mapping: cannot read ({exc.strerror})") from None


def run_audit_trajectories(args: argparse.Namespace) -> int:
    """``kcloak audit trajectories``: exit 1 when PUBLISHED is not (k,δ)-anonymous (report still written)."""
    from rich.console import Console
    from rich.table import Table

    from kcloak.core.extras import require_pictures
    from kcloak.core.readers import ReaderError, read_fixes
    from kcloak.streams.attacks import (
        LinkageError,
        audit_trajectories,
        check_audit_params,
        write_trajectory_figures,
    )
    from kcloak.streams.kdelta import KDeltaError

    ms = _ints(args.m, "--m")
    methods = tuple(dict.fromkeys(x.strip() for x in args.methods.split(",") if x.strip()))
    try:
        check_audit_params(k=args.k, delta_m=args.delta, ms=ms, methods=methods)
    except LinkageError as exc:
        raise UsageError(str(exc)) from None
    seed = _seed(args.seed)
    if args.report:
        require_pictures()
    mapping = read_mapping(args.mapping) if args.mapping else None
    try:
        published = read_fixes(args.published, "csv")
        original = read_fixes(args.original, args.format)
    except ReaderError as exc:
        raise UsageError(str(exc)) from None
    err = Console(stderr=True)
    show = not args.no_progress and sys.stderr.isatty()

    def progress(what: str) -> None:
        if show:
            err.print(f"[dim]{what}…[/dim]")

    try:
        audit = audit_trajectories(
            original,
            published,
            k=args.k,
            delta_m=args.delta,
            ms=ms,
            mapping=mapping,
            methods=methods,
            seed=seed,
            progress=progress,
        )
    except (LinkageError, KDeltaError) as exc:
        raise UsageError(str(exc)) from None
    for note in audit.notes:
        print(f"kcloak: note: {note}", file=sys.stderr)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        detailed = audit.detailed_json()
        detailed["config"] = {"k": args.k, "delta": args.delta, "m": list(ms), "methods": list(methods), "seed": seed}
        (out / "audit_trajectories.json").write_text(json.dumps(detailed, indent=1) + "\n", encoding="utf-8")
        write_trajectory_figures(audit, out)
    if args.json:
        sys.stdout.write(json.dumps(audit.to_json()) + "\n")
    else:
        c = Console(width=None if sys.stdout.isatty() else 140)
        kd = audit.to_json()["kdelta"]
        c.print(
            f"(k,δ) of PUBLISHED: {'ok' if kd['ok'] else '[red]violated[/red]'} — "
            f"{kd['violations']} violations over {kd['trajectories']} trajectories"
        )
        table = Table(title_justify="left")
        for name in ("target", "m", "re-identification", "1/k", "trials"):
            table.add_column(name, justify="left" if name == "target" else "right")
        for r in audit.rows:
            rate = "—" if r.reidentification_rate is None else f"{r.reidentification_rate:.3f}"
            table.add_row(r.target, str(r.m), rate, f"{r.baseline:.3f}", str(r.trials))
        c.print(table)
    return 0 if audit.kdelta_ok else 1
