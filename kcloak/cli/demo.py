"""``kcloak demo`` (contract §9): flags → :class:`kcloak.cli._demo_run.DemoConfig` →
:func:`kcloak.cli._demo_run.run_demo`.

Exit codes: 0 when the report is written (also after Ctrl-C), 1 when a part cannot start (port
in use, MQTT broker unreachable) or the report cannot be written, 2 for a bad flag, 130 when
Ctrl-C comes before users move (nothing to report).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from kcloak.cli.main import SubParsers
from kcloak.core.names import BROKER_ALGORITHMS
from kcloak.simulators.area import MAX_SIDE_KM, USERS_PER_KM2

# The broker's algorithms (kcloak.broker.config.ALGORITHMS is the same tuple); the demo itself is
# imported when the command runs.
ALGORITHMS: tuple[str, ...] = BROKER_ALGORITHMS

MAX_USERS = 100_000

# The demo's settings (shown in --help, used by kcloak.cli._demo_run).
DEMO_QUERIES_PER_MIN = 3.0
"""Queries per simulated user per minute (``kcloak simulate`` defaults to 1)."""
DEMO_QUERY_KIND = "mix"
"""Half range queries (radius 200–2000 m), half k-nearest (n 1–10), as ``kcloak simulate``."""
DEMO_PUBLISH_WINDOW_S = 20
"""Live trajectory-publication windows (shipped: 900 s), so that a one-minute run publishes some."""
DEMO_MAX_UPDATE_AGE_S = 15.0
"""``cloaking.max_update_age_s`` (shipped: 120 s): a window closes this long after its end (§7)."""
DEMO_USERS_PER_KM2 = USERS_PER_KM2
"""User density of the demo area (a square around central Beijing sized for ``--users``)."""
DEMO_MAX_AREA_SIDE_KM = MAX_SIDE_KM
"""Largest demo area side: about the 3rd Ring Road."""
DEMO_TAIL_RESERVE_S = 2.5
"""Users stop this long before the end of ``--duration``: time for the last answers and the report."""
DEMO_MIN_TRAFFIC_SHARE = 0.5
"""Users move for at least this share of ``--duration``, however long the start-up took."""


def process_started() -> float:
    """When this process started, on the :func:`time.monotonic` clock, so that ``--duration`` also
    covers the interpreter's start-up; now if unknown (not Linux) or if the process is older than a
    minute (the demo run from a long-lived process, such as a test session)."""
    now = time.monotonic()
    try:
        fields = Path("/proc/self/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0.0 <= age < 60.0 else now


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be an integer") from None
    if not 1 <= n <= MAX_USERS:
        raise argparse.ArgumentTypeError(f"must be within [1, {MAX_USERS}]")
    return n


def _duration(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds") from None
    if not (math.isfinite(s) and 1.0 <= s <= 86_400.0):
        raise argparse.ArgumentTypeError("must be within [1, 86400] seconds")
    return s


def add_parser(subparsers: SubParsers) -> None:
    """Register ``demo`` on the ``kcloak`` subcommand parser."""
    p = subparsers.add_parser(
        "demo",
        help="see kcloak work in one minute: broker, LBS and simulated Beijing users, with a report",
        description=(
            "Start the kcloak broker (kcloak serve with embedded MQTT) and the reference LBS with the bundled "
            "Beijing POIs as child processes on free loopback ports over a temporary data directory, drive "
            "simulated users along the Beijing streets with a mix of privacy profiles (k = 5, 10, 20), show "
            "live progress and a live map in the browser (its URL is printed; --open opens it), stop by itself "
            "about --duration seconds after the start, start-up included "
            "(or at Ctrl-C), print a summary and write a report folder: summary.json, "
            "map.png (users and recent cloaked regions over the streets), cloak_area.png, achieved_k.png, "
            "latency.png (the pictures need the report extra: pip install 'kcloak[report]')."
        ),
        epilog=(
            "Demo settings: users drive on the streets of a square around central Beijing sized for "
            f"{DEMO_USERS_PER_KM2:g} users per km2 (at most {DEMO_MAX_AREA_SIDE_KM:g} km wide, about the 3rd Ring "
            f"Road; 3000 users fill it); each sends a fix every second and {DEMO_QUERIES_PER_MIN:g} queries a "
            "minute (Poisson, half range queries of radius 200-2000 m, half k-nearest of n 1-10; kcloak "
            "simulate defaults to 1 query a minute), so that one minute yields thousands of answers for the "
            "distributions. "
            f"Trajectory publication uses {DEMO_PUBLISH_WINDOW_S} s windows closed {DEMO_MAX_UPDATE_AGE_S:g} s "
            "after their end (shipped: 900 s and 120 s) so that a one-minute run publishes some. "
            "In summary.json: queries counts queries sent, ok and refused count answers, unanswered the "
            "queries still without an answer when the run ended (queries = ok + refused + unanswered), "
            "success_rate = ok / (ok + refused), latency is query due -> answer received (p50, p99), "
            "cloak_area_m2_median and achieved_k_mean are over ok answers, duration_s is the time users moved "
            f"(until {DEMO_TAIL_RESERVE_S:g} s before the end of --duration, at least "
            f"{DEMO_MIN_TRAFFIC_SHARE:.0%} of it), updates_per_s = updates / "
            "duration_s, and skipped_steps counts one-second steps skipped because the machine fell behind."
        ),
    )
    p.add_argument("--users", type=_positive_int, default=3000, metavar="N", help="simulated users (3000)")
    p.add_argument(
        "--duration", type=_duration, default=60.0, metavar="S", help="seconds the demo runs, start-up included (60)"
    )
    p.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default="hilbert",
        metavar="NAME",
        help="cloaking algorithm: " + ", ".join(ALGORITHMS) + " (hilbert)",
    )
    p.add_argument(
        "--report",
        type=Path,
        default=Path("kcloak-demo-report"),
        metavar="DIR",
        help="report folder (./kcloak-demo-report)",
    )
    p.add_argument(
        "--no-pictures",
        action="store_true",
        help="write summary.json only, no pictures (also when the report extra, matplotlib, is not installed)",
    )
    p.add_argument("--no-progress", action="store_true", help="no live table on stderr (also off when not a TTY)")
    p.add_argument(
        "--open",
        action="store_true",
        dest="open_map",
        help="open the live map (http://127.0.0.1:PORT/map, printed at start) in a browser",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = process_started()
    print(
        f"kcloak demo: starting ({time.monotonic() - started:.1f} s): loading kcloak, then the broker, the "
        "reference LBS and the streets",
        file=sys.stderr,
        flush=True,
    )
    from rich.console import Console

    from kcloak.cli._demo_run import DemoConfig, DemoStartupError, print_summary, run_demo
    from kcloak.core.logs import setup_logging
    from kcloak.simulators.transport import TransportError

    err = Console(stderr=True)
    report: Path = args.report
    if report.exists() and not report.is_dir():
        print(f"kcloak demo: error: --report: {report} exists and is not a folder", file=sys.stderr)
        return 2
    from kcloak.core.extras import PICTURES, REPORT, hint, pictures_available

    pictures = not args.no_pictures and pictures_available()
    if not args.no_pictures and not pictures:
        print(f"kcloak demo: note: summary.json only: {hint(PICTURES, REPORT)}", file=sys.stderr)
    cfg = DemoConfig(
        users=args.users,
        duration_s=args.duration,
        algorithm=args.algorithm,
        report_dir=report,
        open_map=args.open_map,
        pictures=pictures,
    )
    setup_logging("warning", "text")
    live = not args.no_progress and sys.stderr.isatty()
    try:
        import asyncio

        result = asyncio.run(run_demo(cfg, live=live, console=err, started=started))
    except (DemoStartupError, TransportError) as exc:
        print(f"kcloak demo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kcloak demo: interrupted before users moved; no report", file=sys.stderr)
        return 130
    except OSError as exc:
        print(f"kcloak demo: error: {exc.strerror or type(exc).__name__}", file=sys.stderr)
        return 1
    print_summary(result, cfg, Console(width=None if sys.stdout.isatty() else 120))
    return 0
