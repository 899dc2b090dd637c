"""``kcloak bench soak``: the broker under street users at half its sustained rate, watched for leaks and drift."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kcloak.cli.main import SubParsers, UsageError

DESCRIPTION = """\
Start a real `kcloak serve` (embedded MQTT, the shipped configuration, a data directory of its own)
and a real `kcloak lbs` on free loopback ports; measure the broker's sustained query rate (closed-loop
kNN queries over MQTT from two client processes for --calibrate seconds, answered ok per second from
its counters), unless --rate gives it; then drive --users street users on the bundled Beijing network
(profiles k = 5/10/20; a fix each second, range and kNN queries as a Poisson process) at half that
query rate, over MQTT, for --duration seconds.

Every --sample-every seconds it looks at the broker from outside: resident memory (RSS) and open files
of its process (/proc; children such as the publication worker apart), the size of every SQLite file
in its data directory (-wal and -shm included), the queue depths (kcloak_queue_depth) and counters of
its /metrics, and the p99 latency the clients measured (intended send time -> answer, upstream
included) for the answers of that interval, beside the p99 the broker itself adds (its
kcloak_added_latency_seconds). A separate MQTT connection counts every answer per query id.

Pass when, after --warmup seconds (120):
  rss_growth    the broker's RSS never grows more than 5 % over its value at the end of warm-up;
  p99_drift     the median per-interval p99 of the last quarter of the intervals is at most 20 % above
                that of the first quarter;
  refusals      no query is refused for a reason other than a profile-driven one (k_unreachable,
                area_exceeded, l_unreachable, expired); overloaded, internal, rate_limited,
                upstream_error, stale_position, shutdown, invalid and every other code are failures;
  exactly_once  every query sent got exactly one answer, and no answer came for an unknown query id;
  load_held     every interval after warm-up answered at least 80 % of the target rate (else the
                clients fell behind and the soak did not run the load it claims).

Output: a table of the samples and the verdict (plain lines when stdout is not a terminal), or with
--json one object {"bench": "soak", "results": [sample, ...], "verdict": {...}, ...}; --plot FILE draws
RSS, p99 and refusals over time. Progress, with the time left, goes to stderr. Exit codes: 0 pass,
1 fail (the reasons are printed) or the broker could not start, 2 bad flags, 130 interrupted:
Ctrl-C or SIGTERM ends the traffic at once, stops the broker and the LBS, and still prints the samples
taken so far (the verdict then fails on "interrupted"). The full soak (--duration 1200) takes about
22 minutes and is not part of the default test run."""


def add_parser(bench: SubParsers) -> None:
    """Add ``bench soak`` to the ``bench`` group."""
    p = bench.add_parser(
        "soak",
        help="the broker under street users at half its sustained rate for 20 minutes: leaks, drift, exactly-once",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=1200.0, metavar="S", help="seconds of traffic (1200)")
    p.add_argument("--sample-every", type=float, default=60.0, metavar="S", help="seconds between samples (60)")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        metavar="S",
        help="seconds before memory and latency are judged (120, or a tenth of --duration when shorter than 20 min)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="QPS",
        help="the broker's sustained query rate, instead of measuring it; the soak runs at half of it",
    )
    p.add_argument(
        "--calibrate", type=float, default=20.0, metavar="S", help="seconds to measure the sustained rate (20)"
    )
    p.add_argument(
        "--users", type=int, default=2000, metavar="N", help="street users, each sending a fix a second (2000)"
    )
    p.add_argument("--algorithm", default="hilbert", metavar="NAME", help="the broker's cloaking algorithm (hilbert)")
    p.add_argument(
        "--query-kind", choices=("range", "knn", "mix"), default="mix", help="the users' queries (mix of range and knn)"
    )
    p.add_argument("--seed", type=int, default=1, metavar="N", help="seed of the users' movements and queries (1)")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="S",
        help="the broker's publication window in seconds (the shipped 900), e.g. 120 to see a window in a short run",
    )
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep the broker's data and logs in DIR")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE", help="draw RSS, p99 and refusals over time (PNG)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"--{name}: must be finite and > 0")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console

    from kcloak.cli._demo_run import DemoStartupError
    from kcloak.cli._signals import signals_stop
    from kcloak.cli._soak_run import SoakConfig, plot_soak, run_soak
    from kcloak.core.names import SpatialAlgorithm, values
    from kcloak.simulators.soak import Criteria

    for name in ("duration", "sample_every", "rate", "calibrate", "window"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.warmup is not None and not (math.isfinite(args.warmup) and 0 <= args.warmup < args.duration):
        raise UsageError("--warmup: must be >= 0 and shorter than --duration")
    if args.sample_every > args.duration:
        raise UsageError("--sample-every: must not exceed --duration")
    if args.users < 10:
        raise UsageError("--users: must be >= 10")
    if args.algorithm not in values(SpatialAlgorithm):
        raise UsageError(f"--algorithm: must be one of {', '.join(values(SpatialAlgorithm))}")
    if args.plot is not None and not args.plot.parent.is_dir():
        raise UsageError(f"--plot: no folder {args.plot.parent}")
    warmup = args.warmup if args.warmup is not None else min(120.0, args.duration / 10.0)
    cfg = SoakConfig(
        duration_s=args.duration,
        sample_every_s=args.sample_every,
        rate=args.rate,
        calibrate_s=args.calibrate,
        users=args.users,
        algorithm=args.algorithm,
        query_kind=args.query_kind,
        criteria=Criteria(warmup_s=warmup),
        seed=args.seed,
        keep_dir=args.keep,
        window_s=args.window,
    )
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def say(message: str) -> None:
        if not args.no_progress:
            err.print(f"[dim]soak:[/dim] {message}")

    async def soak() -> dict[str, Any]:
        stop = asyncio.Event()
        with signals_stop(stop):  # Ctrl-C or SIGTERM: stop the children, report what was measured
            return await run_soak(cfg, say=say, stop=stop)

    try:
        report = asyncio.run(soak())
    except DemoStartupError as exc:
        print(f"kcloak: error: {exc}", file=sys.stderr)
        return 1
    if args.plot is not None:
        plot_soak(report, args.plot)
        say(f"picture: {args.plot}")
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        print_report(report, Console())
    if not report["verdict"]["passed"]:
        for reason in report["verdict"]["reasons"]:
            print(f"kcloak: soak failed: {reason}", file=sys.stderr)
        return 130 if report["interrupted"] else 1
    return 0


def print_report(report: dict[str, Any], console: Any) -> None:
    """The samples as a table and the verdict, one check a line (plain lines off a terminal)."""
    from rich.table import Table

    rows = report["results"]
    header = (
        "min",
        "RSS MiB",
        "child MiB",
        "files",
        "SQLite MiB",
        "WAL MiB",
        "queues",
        "answers/s",
        "p99 ms",
        "added p99",
        "win",
        "load",
        "refused",
        "upstream failed",
    )

    def cells(r: dict[str, Any]) -> tuple[str, ...]:
        wal = sum(v for k, v in r["sqlite_bytes"].items() if k.endswith("-wal"))
        queues = " ".join(f"{k}={v:.0f}" for k, v in sorted(r["queue_depths"].items())) or "–"
        refused = ", ".join(f"{k} {v}" for k, v in r["refusals"].items()) or "0"
        failed = ", ".join(f"{k} {v}" for k, v in r.get("upstream_failures", {}).items()) or "0"
        load = r.get("loadavg_1m")
        return (
            f"{r['t_s'] / 60:.1f}",
            f"{r['rss_bytes'] / 2**20:.1f}",
            f"{r['children_rss_bytes'] / 2**20:.1f}",
            str(r["open_files"]),
            f"{r['sqlite_total_bytes'] / 2**20:.1f}",
            f"{wal / 2**20:.1f}",
            queues,
            f"{r['answers'] / r['interval_s']:,.0f}",
            "–" if r["p99_ms"] is None else f"{r['p99_ms']:.1f}",
            "–" if r["added_p99_ms"] is None else f"{r['added_p99_ms']:.1f}",
            str(r.get("windows", 0) or ""),
            "–" if load is None else f"{load:.1f}",
            refused,
            failed,
        )

    sustained = report["sustained_qps"]
    title = (
        f"kcloak bench soak: {report['users']:,} street users, {report['target_qps']:,.0f} queries/s "
        f"(half of {'measured' if sustained['measured'] else 'given'} sustained rate), {report['algorithm']}"
    )
    verdict = report["verdict"]
    if console.is_terminal:
        table = Table(title=title, title_justify="left")
        for col in header:
            table.add_column(col, justify="left" if col in ("queues", "refused", "upstream failed") else "right")
        for r in rows:
            table.add_row(*cells(r))
        console.print(table)
    else:
        lines = [header, *(cells(r) for r in rows)]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        console.print(title, highlight=False, soft_wrap=True)
        for line in lines:
            text = "  ".join(
                v.ljust(w) if h in ("queues", "refused", "upstream failed") else v.rjust(w)
                for v, w, h in zip(line, widths, header, strict=True)
            )
            console.print(text.rstrip(), highlight=False, soft_wrap=True)
    for c in verdict["checks"]:
        console.print(
            f"{'pass' if c['passed'] else 'FAIL'}  {c['name']}: {c['detail']}", highlight=False, soft_wrap=True
        )
    console.print(f"verdict: {'pass' if verdict['passed'] else 'FAIL'}", highlight=False)
