"""``kcloak bench lbs`` (contract §5, §9): flags in, report out; the benchmark is :mod:`kcloak.broker.lbs_bench`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from kcloak.cli._progress import rich_bar
from kcloak.cli.main import UsageError

if TYPE_CHECKING:
    from kcloak.broker.lbs_bench import LbsBenchConfig
    from kcloak.cli.main import SubParsers


def add_parser(bench: SubParsers) -> None:
    """Add ``bench lbs`` to the ``bench`` group."""
    p = bench.add_parser(
        "lbs",
        help="reference LBS search time and candidate-set size",
        description=(
            "Time the reference LBS provider's kNN and range searches in-process over a seeded stream of "
            "typical cloaked regions, and compare each candidate set with the exact answer at a random point "
            "of its region (sizes, and violations of the inclusiveness guarantee, which must be 0)."
        ),
    )
    p.add_argument("--pois", metavar="FILE", default=None, help="POI file, CSV or GeoJSON (default: bundled Beijing)")
    p.add_argument("--requests", type=int, default=2000, metavar="N", help="regions in the stream (2000)")
    p.add_argument("--max-area-m2", type=float, default=4e6, metavar="A", help="largest region area (4e6)")
    p.add_argument("--n-max", type=int, default=10, metavar="N", help="kNN n drawn from 1..N (10)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the stream (0)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> LbsBenchConfig:
    """Validate the flags (bad values raise :class:`UsageError`, exit 2)."""
    from kcloak.broker.lbs_bench import MIN_AREA_M2, LbsBenchConfig

    if args.requests < 1:
        raise UsageError("--requests: must be at least 1")
    if not (math.isfinite(args.max_area_m2) and args.max_area_m2 >= MIN_AREA_M2):
        raise UsageError(f"--max-area-m2: must be a finite number >= {MIN_AREA_M2:g}")
    if args.n_max < 1:
        raise UsageError("--n-max: must be at least 1")
    if args.seed < 0:
        raise UsageError("--seed: must be non-negative")
    return LbsBenchConfig(requests=args.requests, max_area_m2=args.max_area_m2, n_max=args.n_max, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    """``kcloak bench lbs``: 0, or 1 when a candidate set missed an exact answer."""
    from kcloak.broker.lbs_bench import run_lbs_bench
    from kcloak.core.places import PoiFileError, load_pois

    config = config_from_args(args)
    try:
        pois = load_pois(args.pois)
    except PoiFileError as exc:
        raise UsageError(str(exc)) from None
    if len(pois) == 0:
        raise UsageError("POI file: no usable POIs")
    if not args.no_progress and sys.stderr.isatty():
        with rich_bar() as bar:
            task = bar.add_task("bench lbs", total=config.requests)
            rows = run_lbs_bench(pois, config, on_request=lambda: bar.advance(task))
    else:
        rows = run_lbs_bench(pois, config)
    if args.json:
        sys.stdout.write(json.dumps({"bench": "lbs", "results": rows}) + "\n")
    else:
        print_table(rows)
    return 1 if any(r["violations"] for r in rows) else 0


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a readable table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench lbs — reference LBS searches (in-process)", title_justify="left")
    for name in ("kind", "category", "requests", "p50 µs", "p99 µs", "cpu p50 µs", "cpu p99 µs", "|C|", "|exact|"):
        table.add_column(name, justify="left" if name in ("kind", "category") else "right")
    table.add_column("|C|/|exact|", justify="right")
    table.add_column("violations", justify="right")
    for r in rows:
        ratio = r["candidates_over_exact"]
        table.add_row(
            r["kind"],
            r["category"],
            str(r["requests"]),
            f"{r['us_p50']:,.0f}",
            f"{r['us_p99']:,.0f}",
            f"{r['cpu_us_p50']:,.0f}",
            f"{r['cpu_us_p99']:,.0f}",
            f"{r['candidates_mean']:.2f}",
            f"{r['exact_mean']:.2f}",
            "—" if ratio is None else f"{ratio:.2f}",
            str(r["violations"]),
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)
