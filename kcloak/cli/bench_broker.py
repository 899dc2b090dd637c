"""``kcloak bench broker`` (contract §9): flags in, JSON or a table out."""

from __future__ import annotations

import argparse
import json
import sys

from kcloak.cli.main import SubParsers, UsageError


def add_parser(bench: SubParsers) -> None:
    """Add ``bench broker`` to the ``bench`` group."""
    p = bench.add_parser(
        "broker",
        help="sustained updates/s and queries/s over MQTT and HTTP, and the latency the broker adds",
        description=(
            "Start a real `kcloak serve` (with a spawned mosquitto if it is on PATH, else the embedded "
            "MQTT broker) and an instant upstream, drive it from client processes, and report the rates "
            "the broker sustained (read from its own counters; queries/s counts queries answered ok, "
            "refusals are shown beside it) and its added latency (p50/p99, upstream excluded) at half "
            "the sustained query rate. Fix intake is measured beside two yardsticks in the same run: "
            "the same MQTT fix generators publishing into a mosquitto of their own with one counting "
            "subscriber (pass-through), and the same HTTP fix generators against an empty aiohttp "
            "handler; with kcloak's CPU microseconds per accepted fix (utime+stime from /proc) and the "
            "generators' CPU. Each phase runs --duration seconds."
        ),
    )
    p.add_argument("--duration", type=float, default=10.0, metavar="S", help="seconds per phase (10)")
    p.add_argument("--users", type=int, default=10_000, metavar="N", help="simulated users (10000)")
    p.add_argument(
        "--mqtt", default=None, metavar="URL|embedded", help="mqtt://HOST:PORT, embedded, or mosquitto (default)"
    )
    p.add_argument("--algorithm", default="hilbert", metavar="NAME", help="cloaking algorithm (hilbert)")
    p.add_argument("--clients", type=int, default=2, metavar="N", help="client processes (2)")
    p.add_argument(
        "--client",
        choices=("mixed", "kcloak", "paho"),
        default="mixed",
        help=(
            "MQTT client of the load generators: mixed (default: fixes from paho-mqtt, queries and "
            "answers with kcloak's client), kcloak (both with kcloak's client) or paho (both with paho-mqtt)"
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kcloak.broker.bench import BrokerBenchConfig, run_broker_bench

    if args.duration <= 0 or args.users < 10 or args.clients < 1:
        raise UsageError("--duration must be > 0, --users ≥ 10, --clients ≥ 1")
    if args.algorithm not in ("nn", "interval", "casper", "hilbert", "privacygrid", "clique"):
        raise UsageError("--algorithm: unknown or not a snapshot algorithm")
    cfg = BrokerBenchConfig(
        duration_s=args.duration,
        users=args.users,
        mqtt=args.mqtt,
        algorithm=args.algorithm,
        client_processes=args.clients,
        mqtt_client=args.client,
    )
    err = Console(stderr=True)
    report = run_broker_bench(cfg, log=lambda msg: err.print(f"[dim]phase:[/dim] {msg}"))
    for row in report["results"]:  # why a transport answered 0 queries ok per second, on stderr in every mode
        if row.get("queries_note"):
            err.print(
                f"kcloak bench broker: {row['transport']}: 0 queries answered ok: {row['queries_note']}",
                highlight=False,
            )
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    table = Table(title=f"kcloak bench broker ({cfg.users} users, {cfg.algorithm})")
    columns = (
        "transport",
        "mqtt",
        "updates/s",
        "queries ok/s",
        "refused/s",
        "latency at q/s",
        "added p50 ms",
        "added p99 ms",
    )
    for col in columns:
        table.add_column(col)
    for r in report["results"]:
        table.add_row(
            r["transport"],
            r["mqtt"],
            f"{r['updates_per_s']:.0f}",
            f"{r['queries_per_s']:.0f}",
            f"{r['queries_refused_per_s']:.0f}",
            f"{r['latency_at_qps']:.0f}",
            str(r["added_latency_ms_p50"]),
            str(r["added_latency_ms_p99"]),
        )
    out = Console()
    out.print(table)
    intake = Table(
        title="fix intake beside its yardstick, measured in this run (generators' CPU: kcloak's phase, yardstick's)"
    )
    for col in ("transport", "updates/s", "yardstick", "yardstick/s", "ratio", "CPU µs/fix", "generators cores"):
        intake.add_column(col)
    for r in report["results"]:
        y = r["yardstick"]
        intake.add_row(
            r["transport"],
            f"{r['updates_per_s']:.0f}",
            "mosquitto" if y["name"].startswith("mosquitto") else y["name"],
            "-" if y.get("per_s") is None else f"{y['per_s']:.0f}",
            "-" if r["updates_vs_yardstick"] is None else f"{r['updates_vs_yardstick']:.2f}",
            "-" if r["cpu_us_per_fix"] is None else f"{r['cpu_us_per_fix']:.1f}",
            f"{r['update_generator_cpu_cores']} ({y.get('generator_cpu_cores')})",
        )
    out.print(intake)
    for r in report["results"]:
        if r["queries_note"]:
            out.print(f"{r['transport']} queries: {r['queries_note']}")
    return 0
