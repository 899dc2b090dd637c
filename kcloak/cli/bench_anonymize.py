"""``kcloak bench anonymize`` (contract §9): NWA, W4M and microaggregation on seeded synthetic trajectories."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from kcloak.cli._progress import rich_bar
from kcloak.cli.main import UsageError

if TYPE_CHECKING:
    from kcloak.cli.main import SubParsers
    from kcloak.streams.bench import AnonymizeBenchConfig


def add_parser(bench: SubParsers) -> None:
    """Add ``bench anonymize`` to the ``bench`` group."""
    p = bench.add_parser(
        "anonymize",
        help="trajectory anonymization runtime, memory and quality per method and size",
        description=(
            "Anonymize seeded synthetic trajectories (hub-to-hub trips through a city, 10/20/30 s sampling, "
            "start times over five minutes) with each method at each size, every run in its own process: "
            "runtime of the anonymization, the run's peak resident memory, trash fraction, mean translation, "
            "time distortion and range-query distortion (contract §7). A run past --time-limit-s is stopped "
            'and reported with "status": "timeout"; one refused by the trash bound with "status": "failed".'
        ),
    )
    p.add_argument("--sizes", default="1000,10000,100000", metavar="N,N", help="trajectory counts (1000,10000,100000)")
    p.add_argument("--points", type=int, default=100, metavar="P", help="points per trajectory (100)")
    p.add_argument("--k", type=int, default=5, metavar="K", help="group size k (5)")
    p.add_argument("--delta", type=float, default=500.0, metavar="M", help="delta in metres (500)")
    p.add_argument("--methods", default="nwa,w4m,microagg", metavar="A,B", help="methods (nwa,w4m,microagg)")
    p.add_argument("--time-limit-s", type=float, default=600.0, metavar="S", help="per run (600)")
    p.add_argument(
        "--memory-limit-mb", type=float, default=8192.0, metavar="MB", help="address-space limit per run (8192)"
    )
    p.add_argument(
        "--ks", default=None, metavar="K,K", help="(k, δ) trade-off: sweep these k (with --deltas or --delta)"
    )
    p.add_argument(
        "--deltas", default=None, metavar="M,M", help="(k, δ) trade-off: sweep these δ in metres (with --ks or --k)"
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw the (k, δ) trade-off here (.png/.svg/.pdf; needs the report extra)",
    )
    p.add_argument("--trash-max", type=float, default=0.1, metavar="F", help="largest trashed fraction (0.1)")
    p.add_argument("--pi-s", type=float, default=60.0, metavar="S", help="nwa: time granularity pi_s (60)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the synthetic data (0)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers") from None
    if not values:
        raise UsageError(f"{flag}: give at least one value")
    return values


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated numbers") from None
    if not values:
        raise UsageError(f"{flag}: give at least one value")
    return values


def config_from_args(args: argparse.Namespace) -> AnonymizeBenchConfig:
    """Validate the flags (bad values raise :class:`UsageError`, exit 2)."""
    from kcloak.core.errors import BenchError
    from kcloak.streams.bench import AnonymizeBenchConfig, validate
    from kcloak.streams.publish import METHODS

    methods = tuple(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    if not 0 <= args.trash_max < 1:
        raise UsageError("--trash-max: must be within [0, 1)")
    if args.seed < 0:
        raise UsageError("--seed: must be non-negative")
    if not math.isfinite(args.memory_limit_mb):
        raise UsageError("--memory-limit-mb: must be a finite number")
    config = AnonymizeBenchConfig(
        sizes=_ints(args.sizes, "--sizes"),
        points=args.points,
        k=args.k,
        delta=args.delta,
        methods=methods,
        time_limit_s=args.time_limit_s,
        seed=args.seed,
        trash_max=args.trash_max,
        memory_limit_mb=args.memory_limit_mb,
        pi_s=args.pi_s,
        ks=_ints(args.ks, "--ks") if args.ks else (),
        deltas=_floats(args.deltas, "--deltas") if args.deltas else (),
    )
    try:
        validate(config, METHODS)
    except BenchError as exc:
        raise UsageError(str(exc)) from None
    return config


def run(args: argparse.Namespace) -> int:
    """``kcloak bench anonymize``: 0 when at least one run finished (ok or refused by the bound), else 1."""

    from kcloak.core.extras import require_pictures
    from kcloak.streams.bench import run_anonymize_bench

    config = config_from_args(args)
    if args.plot:  # before the runs, not after them
        require_pictures()
    show = not args.no_progress and sys.stderr.isatty()
    runs = len(config.specs())
    if show:
        with rich_bar() as bar:
            task = bar.add_task("bench anonymize", total=runs)
            rows = run_anonymize_bench(config, on_row=lambda _row: bar.advance(task))
    else:
        rows = run_anonymize_bench(config)
    sweep = bool(config.ks or config.deltas)
    if args.json:
        sys.stdout.write(json.dumps({"bench": "anonymize", "results": rows}) + "\n")
    else:
        print_table(rows)
        if sweep:
            print_tradeoff(rows)
    if args.plot:
        from kcloak.streams.bench import plot_tradeoff

        plot_tradeoff(rows, args.plot)
        print(f"trade-off picture: {args.plot}", file=sys.stderr)
    return 0 if any(r["status"] in ("ok", "failed") for r in rows) else 1


def print_tradeoff(rows: list[dict[str, Any]]) -> None:
    """Per method and size, one small table: k down, δ across; each cell the range-query distortion (PSI),
    the mean translation and the trash fraction, or the trash of a refused run."""
    from rich.console import Console
    from rich.table import Table

    from kcloak.streams.bench import tradeoff_grid

    console = Console(width=None if sys.stdout.isatty() else 160)
    rqd = tradeoff_grid(rows, "range_query_distortion")
    moved = tradeoff_grid(rows, "mean_translation_m")
    trash = tradeoff_grid(rows, "trash_fraction", failed_too=True)
    for key in sorted(rqd):
        ks = sorted({k for k, _ in rqd[key]})
        deltas = sorted({d for _, d in rqd[key]})
        table = Table(
            title=f"(k, δ) trade-off — {key[0]}, n={key[1]}: range-query distortion · mean translation · trash",
            title_justify="left",
        )
        table.add_column("k \\ δ (m)", justify="right")
        for d in deltas:
            table.add_column(format(d, "g"), justify="right")
        for k in ks:
            cells: list[str] = []
            for d in deltas:
                q, m, t = rqd[key].get((k, d)), moved[key].get((k, d)), trash[key].get((k, d))
                if q is None:
                    cells.append("refused" + ("" if t is None else f" (trash {t:.0%})"))
                else:
                    cells.append(f"{q:.3f} · {m:,.0f} m · {t:.0%}")
            table.add_row(str(k), *cells)
        console.print(table)


def _fmt(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a readable table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench anonymize — synthetic city trajectories", title_justify="left")
    for name in (
        "method",
        "n",
        "points",
        "k",
        "delta",
        "status",
        "runtime s",
        "peak MB",
        "trash",
        "transl. m",
        "time dist. s",
        "range dist.",
        "transl. p95",
        "transl. max",
        "shift max s",
    ):
        table.add_column(name, justify="left" if name in ("method", "status") else "right")
    for r in rows:
        table.add_row(
            r["method"],
            str(r["n_trajectories"]),
            str(r["points_per_trajectory"]),
            str(r["k"]),
            _fmt(r["delta"], "g"),
            r["status"],
            _fmt(r["runtime_s"], ".1f"),
            _fmt(r["peak_rss_mb"], ",.0f"),
            _fmt(r["trash_fraction"], ".1%"),
            _fmt(r["mean_translation_m"], ",.1f"),
            _fmt(r["time_distortion_s"], ",.0f"),
            _fmt(r["range_query_distortion"], ".3f"),
            _fmt(r.get("translation_p95_m"), ",.0f"),
            _fmt(r.get("translation_max_m"), ",.0f"),
            _fmt(r.get("time_shift_max_s"), ",.0f"),
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    for r in rows:
        if r.get("error"):
            print(f"{r['method']} n={r['n_trajectories']}: {r['error']}", file=sys.stderr)
