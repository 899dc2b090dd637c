"""``kcloak bench cloak`` (contract §9): flags in, report out (a benchmark of the group :mod:`kcloak.cli.bench`)."""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcloak.cli._progress import phase_progress
from kcloak.cli.main import UsageError
from kcloak.core.names import SpatialAlgorithm, values

if TYPE_CHECKING:
    from rich.console import Console, JustifyMethod

    from kcloak.cli.main import SubParsers
    from kcloak.cloaking.bench import CloakBenchConfig, CloakBenchReport, Population

DEFAULT_USERS = 100_000

# Spelled out so that building the ``kcloak`` parser imports neither numpy nor the cloakers; tests
# check them against kcloak.cloaking.bench. The benchmark itself imports the real ones when it runs.
SPATIAL_ALGORITHMS: tuple[str, ...] = values(SpatialAlgorithm)
K_LEVEL_WEIGHTS: tuple[float, float, float] = (0.25, 0.5, 0.25)
DEFAULT_K_SPREAD = 0.5


def add_parser(bench: SubParsers) -> None:
    """Add ``bench cloak`` to the ``bench`` group (:mod:`kcloak.cli.bench`)."""
    lo, mid, hi = K_LEVEL_WEIGHTS
    p = bench.add_parser(
        "cloak",
        help="cloaking quality and speed of every spatial algorithm",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Cloak a seeded stream of requests with each algorithm and report quality (success rate,\n"
            "achieved k: achieved_k_mean = users in the region, as in the demo's summary, and\n"
            "achieved_k_ratio_mean = achieved k / requested k; areas, median area relative to the MBR\n"
            "of the querier and its k-1 nearest users) and cost (per-call latency, single and batch\n"
            "throughput, index updates, index memory per user).\n\n"
            "Population: clustered synthetic users around Beijing (39.9 N, 116.4 E), or with --data a\n"
            "snapshot of a trace (contract CSV or AIS, .gz ok): the latest fix of every trajectory at the\n"
            "instant T that maximizes the trajectories with a fix in [T - W, T]. W (--window-s) defaults\n"
            "to the 90th percentile of the trace's consecutive-fix gaps rounded up to a minute (at least\n"
            "60 s; T-Drive: 360 s); 0 takes the last fix of every trajectory. The JSON reports T and W.\n\n"
            f"Stored profiles: k = ceil(K/2), K or floor(3K/2) with probabilities {lo}, {mid}, {hi};\n"
            "min_area_m2 0; max_area_m2 from --max-area-m2. Each request uses the querier's stored\n"
            "profile. clique is run as a stream over simulated time (each user queries once a minute)."
        ),
    )
    p.add_argument(
        "--users",
        type=int,
        metavar="N",
        help=f"population size ({DEFAULT_USERS}; with --data: a random "
        "subset of at most N snapshot users, default all)",
    )
    p.add_argument("--k", type=int, default=10, metavar="K", help="central k of the stored profiles (10)")
    p.add_argument(
        "--k-spread",
        type=float,
        default=DEFAULT_K_SPREAD,
        metavar="F",
        help="stored k is K·(1−F), K or K·(1+F) (0.25/0.5/0.25); 0 = every user asks for K (0.5)",
    )
    p.add_argument(
        "--algorithms",
        default=",".join(SPATIAL_ALGORITHMS),
        metavar="A,B",
        help=f"algorithms to run ({','.join(SPATIAL_ALGORITHMS)})",
    )
    p.add_argument("--data", metavar="CSV", help="trace to snapshot instead of the synthetic population")
    p.add_argument("--requests", type=int, default=100_000, metavar="N", help="requests per algorithm (100000)")
    p.add_argument("--max-area-m2", type=float, default=4.0e6, metavar="A", help="max_area_m2 of every profile (4e6)")
    p.add_argument("--seed", type=int, metavar="N", help="seed of population, profiles and requests (random)")
    p.add_argument(
        "--window-s",
        type=float,
        metavar="S",
        help="with --data: staleness window W in seconds (auto, see above; 0 = last fix of every trajectory)",
    )
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=300.0,
        metavar="S",
        help="stop an algorithm's single-call stream after S seconds; the row is marked truncated (300)",
    )
    p.add_argument(
        "--view-batches",
        default="1000,10000",
        metavar="B,B",
        help="views section: after each batch of B moved users, time a fresh view incrementally and "
        "from scratch, and compare them ('none' skips it; 1000,10000)",
    )
    p.add_argument("--view-rounds", type=int, default=3, metavar="N", help="views section: batches of each size (3)")
    p.add_argument(
        "--broker-rss",
        nargs="?",
        const="also",
        choices=("also", "only"),
        metavar="only",
        help="also start a real `kcloak serve` (loopback, its own data dir, instant upstream), load --users "
        "synthetic users through POST /v1/locations, let it prepare views (kNN queries, housekeeping) "
        "and report its resident memory (broker_rss_mb, broker_peak_mb, target 400 MB at 1M users; "
        "4–7 min at 1M on two shared cores); 'only' skips the algorithm runs",
    )
    p.add_argument(
        "--broker-settle-s",
        type=float,
        default=35.0,
        metavar="S",
        help="--broker-rss: wait after the queries before the reading (35: one period of the broker's malloc_trim)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(func=run_bench_cloak)


# -- running ----------------------------------------------------------------------------------
def parse_algorithms(text: str) -> tuple[str, ...]:
    """Comma-separated algorithm names, checked against the registry, duplicates dropped."""
    from kcloak.cloaking.cloakers import SPATIAL_ALGORITHMS

    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise UsageError("--algorithms: name at least one algorithm")
    for a in names:
        if a not in SPATIAL_ALGORITHMS:
            raise UsageError(f"--algorithms: unknown algorithm {a!r} (known: {', '.join(SPATIAL_ALGORITHMS)})")
    return tuple(dict.fromkeys(names))


def config_from_args(args: argparse.Namespace) -> CloakBenchConfig:
    """Validate the flags (bad values raise :class:`UsageError`, exit 2)."""
    from kcloak.cloaking.bench import CloakBenchConfig
    from kcloak.core.profile import MAX_AREA_CAP_M2

    if not 1 <= args.k <= 1000:
        raise UsageError("--k: must be within [1, 1000]")
    if not 0 <= args.k_spread < 1:
        raise UsageError("--k-spread: must be within [0, 1)")
    if args.requests < 1:
        raise UsageError("--requests: must be at least 1")
    if not (math.isfinite(args.max_area_m2) and 0 < args.max_area_m2 <= MAX_AREA_CAP_M2):
        raise UsageError(f"--max-area-m2: must be within (0, {MAX_AREA_CAP_M2:g}]")
    if args.users is not None and args.users < 1:
        raise UsageError("--users: must be at least 1")
    if args.seed is not None and args.seed < 0:
        raise UsageError("--seed: must be non-negative")
    if args.window_s is not None and not (math.isfinite(args.window_s) and args.window_s >= 0):
        raise UsageError("--window-s: must be 0 or a positive number of seconds")
    if args.window_s is not None and args.data is None:
        raise UsageError("--window-s: only applies with --data")
    if not (math.isfinite(args.time_limit_s) and args.time_limit_s > 0):
        raise UsageError("--time-limit-s: must be positive")
    if not (math.isfinite(args.broker_settle_s) and args.broker_settle_s >= 0):
        raise UsageError("--broker-settle-s: must be 0 or a positive number of seconds")
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    view_batches = parse_view_batches(args.view_batches)
    if args.view_rounds < 1:
        raise UsageError("--view-rounds: must be at least 1")
    return CloakBenchConfig(
        algorithms=parse_algorithms(args.algorithms),
        k=args.k,
        requests=args.requests,
        max_area_m2=args.max_area_m2,
        seed=seed,
        time_limit_s=args.time_limit_s,
        k_spread=args.k_spread,
        view_batches=view_batches,
        view_rounds=args.view_rounds,
    )


def parse_view_batches(text: str) -> tuple[int, ...]:
    """``--view-batches``: positive batch sizes, comma-separated, or ``none``."""
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise UsageError(f"--view-batches: not a list of batch sizes: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError("--view-batches: give positive batch sizes, e.g. 1000,10000, or none")
    return sizes


def load_population(args: argparse.Namespace, seed: int) -> Population:
    """The synthetic population, or the snapshot of ``--data`` (unreadable data: exit 2)."""
    from kcloak.cloaking.bench import clustered_population, snapshot_population
    from kcloak.core.errors import BenchError
    from kcloak.core.readers import ReaderError, read_fixes

    try:
        if args.data is None:
            return clustered_population(args.users if args.users is not None else DEFAULT_USERS, seed=seed)
        path = Path(args.data)
        fixes = read_fixes(path)
        return snapshot_population(fixes, window_s=args.window_s, max_users=args.users, seed=seed, source=path.name)
    except (ReaderError, BenchError) as exc:
        raise UsageError(str(exc)) from exc


def run_bench_cloak(args: argparse.Namespace) -> int:
    """``kcloak bench cloak``: 0 when at least one algorithm was measured, else 1."""
    from kcloak.cloaking.bench import run_cloak_bench
    from kcloak.core.memory import fix_mmap_threshold

    fix_mmap_threshold()  # as `kcloak serve` does: the resident sizes reported are the broker's
    config = config_from_args(args)
    if args.broker_rss == "only":
        return run_broker_rss(args)
    pop = load_population(args, config.seed)
    show = not args.no_progress and sys.stderr.isatty()
    with phase_progress(show) as progress:
        report = run_cloak_bench(pop, config, progress=progress)
    broker = broker_memory(args) if args.broker_rss else None
    for row in report.rows:
        if "error" in row.extra:
            print(f"kcloak: warning: {row.algorithm}: {row.extra['error']}", file=sys.stderr)
    if args.json:
        out = report.to_json()
        if broker is not None:
            out["broker_memory"] = broker
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        print_table(report)
        if broker is not None:
            print_broker_memory(broker)
    return 1 if report.failed else 0


def broker_memory(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--broker-rss`` phase: a real broker's resident memory holding ``--users`` users."""
    from kcloak.broker.bench_rss import BrokerRssConfig, measure_broker_rss

    cfg = BrokerRssConfig(users=args.users if args.users is not None else DEFAULT_USERS, settle_s=args.broker_settle_s)
    say = None if args.no_progress else (lambda text: print(text, file=sys.stderr, flush=True))
    return measure_broker_rss(cfg, log=say)


def run_broker_rss(args: argparse.Namespace) -> int:
    """``--broker-rss only``: the broker phase alone, as ``{"bench": "cloak", "results": [], "broker_memory": …}``."""
    broker = broker_memory(args)
    if args.json:
        sys.stdout.write(json.dumps({"bench": "cloak", "results": [], "broker_memory": broker}) + "\n")
    else:
        print_broker_memory(broker)
    return 0 if broker["accepted"] == broker["users"] else 1


def print_broker_memory(b: dict[str, Any]) -> None:
    """The ``--broker-rss`` figures, one paragraph."""
    verdict = "met" if b["met"] else "NOT met"
    print(
        f"broker memory — kcloak serve ({b['algorithm']}) holding {b['users']:,} users "
        f"({b['accepted']:,} fixes accepted in {b['load_s']:.0f} s, {b['users_present']} present), "
        f"after {b['queries']} queries and {b['settle_s']:.0f} s: RSS {b['broker_rss_mb']:,.0f} MB, "
        f"peak {b['broker_peak_mb']:,.0f} MB; target < {b['target_mb']:,.0f} MB: {verdict}. "
        f"Idle {b['rss_mb_idle']:,.0f} MB, loaded {b['rss_mb_loaded']:,.0f} MB, "
        f"after queries {b['rss_mb_after_queries']:,.0f} MB; SQLite files "
        f"{sum(b['sqlite_mb'].values()):,.0f} MB."
    )


# -- the readable table -----------------------------------------------------------------------
def _fmt(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def print_table(report: CloakBenchReport, console: Console | None = None) -> None:
    """The report as a table on stdout (``--json`` absent)."""
    from rich.console import Console
    from rich.table import Table

    from kcloak.cloaking.bench import k_levels

    out = console if console is not None else Console(width=None if sys.stdout.isatty() else 160)
    d = report.to_json()
    pop = d["population"]
    snap = pop.get("snapshot")
    where = (
        f"{pop['source']}: snapshot at t={snap['t']:.0f}, window {snap['window_s']:.0f} s, "
        f"{pop['users']} users of {snap['trajectories']} trajectories"
        if snap
        else f"synthetic clustered population, {pop['users']} users"
    )
    c = report.config
    table = Table(
        title=f"bench cloak — {where}; k ≈ {c.k} ({'/'.join(map(str, k_levels(c.k, c.k_spread)))}), "
        f"max area {c.max_area_m2:,.0f} m², seed {c.seed}",
        title_justify="left",
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("algorithm", "left"),
        ("requests", "right"),
        ("success", "right"),
        ("k mean", "right"),
        ("k/req", "right"),
        ("area med m²", "right"),
        ("area p95 m²", "right"),
        ("×nn", "right"),
        ("p50 µs", "right"),
        ("p99 µs", "right"),
        ("cloaks/s", "right"),
        ("batch/s", "right"),
        ("prep ms", "right"),
        ("upd/s", "right"),
        ("batch upd/s", "right"),
        ("B/user", "right"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name == "algorithm")
    for r in d["results"]:
        if r.get("error"):
            table.add_row(r["algorithm"], str(r["requests"]), "[red]error[/red]")
            continue
        table.add_row(
            r["algorithm"],
            str(r["requests"]),
            _fmt(r["success_rate"], ".1%"),
            _fmt(r["achieved_k_mean"], ".1f"),
            _fmt(r.get("achieved_k_ratio_mean"), ".2f"),
            _fmt(r["area_m2_median"], ",.0f"),
            _fmt(r["area_m2_p95"], ",.0f"),
            _fmt(r["area_ratio_to_nn"], ".2f"),
            _fmt(r["cloak_us_p50"], ".1f"),
            _fmt(r["cloak_us_p99"], ".1f"),
            _fmt(r["cloaks_per_s"], ",.0f"),
            _fmt(r["batch_cloaks_per_s"], ",.0f"),
            _fmt(r.get("prepare_ms"), ".1f"),
            _fmt(r["updates_per_s"], ",.0f"),
            _fmt(r["batch_updates_per_s"], ",.0f"),
            _fmt(r["bytes_per_user"], ".0f"),
        )
    out.print(table)
    if "views" in d:
        print_views(d["views"], out)
    for r in d["results"]:
        if r.get("error"):
            out.print(f"{r['algorithm']}: {r['error']}", highlight=False, markup=False)
        refusals = r.get("refusals")
        if refusals:
            text = ", ".join(f"{code} {n}" for code, n in refusals.items())
            out.print(f"{r['algorithm']}: refusals {text}", highlight=False)


def print_views(v: dict[str, Any], out: Console) -> None:
    """The views section: view preparation after a batch of moves, incremental and from scratch."""
    from rich.table import Table

    rss, peak = v.get("rss_mb"), v.get("peak_rss_mb")
    table = Table(
        title=f"views — {v['users']:,} users; a fresh view after B moved users (σ {v['move_sigma_m']:.0f} m), "
        f"median of {v['rounds']} [min–max]; process RSS {_fmt(rss, ',.0f')} MB, peak {_fmt(peak, ',.0f')} MB",
        title_justify="left",
    )
    for name in (
        "algorithm",
        "B",
        "incremental ms",
        "of which snapshot",
        "from scratch ms",
        "speed-up",
        "single p50 µs",
        "single p99 µs",
        "mismatches",
    ):
        table.add_column(name, justify="left" if name == "algorithm" else "right")

    def span(s: dict[str, float]) -> str:
        return f"{s['median']:,.0f} [{s['min']:,.0f}–{s['max']:,.0f}]"

    for r in v["results"]:
        if r.get("error"):
            table.add_row(r["algorithm"], "", "[red]error[/red]")
            continue
        name = r["algorithm"] + ("" if r["incremental_state"] else " (view only)")
        for i, b in enumerate(r["batches"]):
            first = i == 0
            table.add_row(
                name if first else "",
                f"{b['moved']:,}",
                span(b["incremental_ms"]),
                span(b["incremental_snapshot_ms"]),
                span(b["scratch_ms"]),
                f"{b['speedup']:.1f}×",
                _fmt(r["single_us_p50"], ".1f") if first else "",
                _fmt(r["single_us_p99"], ".1f") if first else "",
                str(r["mismatches"]) if first else "",
            )
    out.print(table)
