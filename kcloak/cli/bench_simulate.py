"""``kcloak bench simulate`` (contract §9): mobility-model steps/s; simulator send rate vs broker accepted rate."""

from __future__ import annotations

import argparse
import json
import math
import sys

from kcloak.cli.main import SubParsers, UsageError


def add_parser(bench: SubParsers) -> None:
    """Add ``bench simulate`` to the ``bench`` group."""
    p = bench.add_parser(
        "simulate",
        help="mobility-model steps/s, and simulator send rate vs broker accepted rate",
        description=(
            "Rows {model, users, user_steps_per_s} for waypoint, street and hotspot (each stepped for "
            "--duration seconds), then {transport, updates_per_s, broker_accepted_per_s} for mqtt and "
            "http: one simulator process sends open-mode batches as fast as possible to a real kcloak "
            "serve (spawned, with mosquitto when on PATH) and the broker's kcloak_updates_accepted_total "
            "gives what it accepted; simulator_only_updates_per_s is the simulator with no network. "
            'JSON: {"bench": "simulate", "users", "duration_s", "results": [row, ...]}. Phases are logged on '
            "stderr. Exit codes: 0 success, 1 the spawned broker failed, 2 bad flags."
        ),
    )
    p.add_argument("--users", type=int, default=100_000, metavar="N", help="simulated users (100000)")
    p.add_argument("--duration", type=float, default=10.0, metavar="S", help="seconds per row (10)")
    p.add_argument("--models-only", action="store_true", help="skip the transport rows (no broker)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no phase lines on stderr")
    p.set_defaults(func=run_bench_simulate)


def run_bench_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kcloak.cli._bench_transports import measure_transports
    from kcloak.simulators.bench import measure_models
    from kcloak.simulators.transport import TransportError

    if args.users < 1:
        raise UsageError("--users: must be >= 1")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise UsageError("--duration: must be finite and > 0")
    err = Console(stderr=True)

    def phase(message: str) -> None:
        if not args.no_progress:
            err.print(f"[dim]phase:[/dim] {message}")

    phase("mobility models")
    rows: list[dict[str, object]] = list(measure_models(users=args.users, duration_s=args.duration))
    if not args.models_only:
        try:
            rows += measure_transports(users=args.users, duration_s=args.duration, log=phase)
        except (TransportError, TimeoutError, OSError) as exc:
            print(f"kcloak: error: broker for the transport rows failed ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 1
    report = {"bench": "simulate", "users": args.users, "duration_s": args.duration, "results": rows}
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    console = Console()
    for row in rows:
        console.print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0
