"""``kcloak load`` (contract §9): open-loop load at a target rate (:mod:`kcloak.simulators.load`)."""

from __future__ import annotations

import argparse
from typing import Any

from kcloak.cli import _client as client
from kcloak.cli.main import SubParsers


def add_parser(subparsers: SubParsers) -> None:
    p = subparsers.add_parser(
        "load",
        help="open-loop load at a target message rate, latency from intended send time",
        formatter_class=client.FORMATTER,
        description=(
            "Offer --rate messages per second for --duration seconds, open loop: message i is due at\n"
            "start + i/rate whatever the broker does, so a slow broker shows up as latency instead of\n"
            "silently lowering the load (no coordinated omission). A --query-fraction of messages are\n"
            "queries, the rest single fixes on each user's own topic or route. Latency = answer (or HTTP\n"
            "response) time - intended send time; over MQTT only queries are answered by kcloak.\n"
            "Time: first every user sends one fix (setup), then the timed run stops at --duration even when\n"
            "the sender fell behind (messages still due are counted as unsent, never sent late), then the\n"
            "last answers are awaited up to 10 s; stderr shows each phase's seconds (JSON: phases_s).\n"
            'JSON: {"target_rate", "achieved_rate", "duration_s", "sent_updates", "sent_queries",\n'
            '"answers_ok", "answers_refused", "errors": {code: n}, "latency_ms": {"p50", "p90", "p99", "max"}, ...}.'
        ),
        epilog=client.CLIENT_EPILOG,
    )
    p.add_argument("--rate", type=float, default=1000.0, metavar="R", help="messages per second (1000)")
    p.add_argument("--duration", type=float, default=30.0, metavar="S", help="seconds (30)")
    p.add_argument("--users", type=int, default=10_000, metavar="N", help="users (10000)")
    p.add_argument("--query-fraction", type=float, default=0.1, metavar="F", help="share of queries (0.1)")
    p.add_argument("--query-kind", choices=client.QUERY_KINDS, default="mix", help="range, knn or mix (mix)")
    p.add_argument("--model", choices=client.MODELS, default="waypoint", help="mobility model (waypoint)")
    p.add_argument("--http-connections", type=int, default=256, metavar="N", help="HTTP query connections (256)")
    p.add_argument("--seed", type=int, default=None, help="random seed (random)")
    client.client_flags(p)
    p.set_defaults(func=run_load_cmd)


def run_load_cmd(args: argparse.Namespace) -> int:
    from kcloak.simulators.load import LoadConfig, run_load

    cfg = LoadConfig(
        rate=args.rate,
        duration_s=args.duration,
        users=args.users,
        query_fraction=args.query_fraction,
        query_kind=args.query_kind,
        model=args.model,
        broker=args.broker,
        tokens=args.tokens,
        seed=args.seed,
        query_connections=args.http_connections,
    )
    code = client.run_and_report(
        args,
        "load",
        lambda update, _stop: run_load(cfg, on_progress=update),
        announce=(
            f"kcloak load: placing {args.users:,} users (one fix each), then {args.rate:g} messages/s for "
            f"{args.duration:g} s, then up to {cfg.drain_s:g} s for the last answers"
        ),
        after=phases_line,
        fixes={
            "area_exceeded": "load spreads its users over the whole bundled extract to measure latency; "
            "kcloak simulate measures success rates",
        },
    )
    return code


def phases_line(summary: dict[str, Any]) -> str | None:
    """Where the time went (stderr): set-up, the timed run, the last answers; and what the sender could not send."""
    import time

    from kcloak.cli.demo import process_started

    ph = summary.get("phases_s") or {}
    if not ph:
        return None
    total = time.monotonic() - process_started()
    other = max(total - sum(ph.values()), 0.0)
    line = (
        f"took {max(total, sum(ph.values())):.1f} s: start-up {other:.1f} s (Python, broker probe, connecting), "
        f"setup {ph['setup']:.1f} s (users placed, one fix each), sending {ph['send']:.1f} s (--duration), "
        f"last answers {ph['drain']:.1f} s"
    )
    unsent = int(summary.get("unsent") or 0)
    due = unsent + int(summary.get("sent_updates") or 0) + int(summary.get("sent_queries") or 0)
    if unsent and unsent < 0.01 * due:
        line += f"; {unsent:,} messages due in the last instants were not sent"
    elif unsent:
        line += (
            f"; {summary['unsent']:,} messages were still due at the end and not sent: this machine could not "
            f"send {summary['target_rate']:g}/s (achieved {summary['achieved_rate']:g}/s)"
        )
    return line
