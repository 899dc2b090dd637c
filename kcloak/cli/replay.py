"""``kcloak replay`` (contract §9): recorded trajectories sent as live traffic (:mod:`kcloak.simulators.replay`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kcloak.cli import _client as client
from kcloak.cli.main import SubParsers, UsageError

if TYPE_CHECKING:
    from kcloak.simulators.replay import ReplayPlan


def add_parser(subparsers: SubParsers) -> None:
    p = subparsers.add_parser(
        "replay",
        help="send recorded trajectories (CSV, GeoLife, GPX, AIS) as live traffic",
        formatter_class=client.FORMATTER,
        description=(
            "Replay trajectories read with kcloak's readers (bad rows are skipped and counted). Each\n"
            "source trajectory becomes a user (P000001… or the tokens file's users in order). Times are\n"
            "shifted to now: the earliest fix is sent 1 s after the start, every other (t - t_min)/speed\n"
            "later, stamped with its send time; each user's order is kept. Before sending, it prints how\n"
            "long the replay will take (recorded span / --speed): raise --speed to compress time, or cap\n"
            "the run with --max-duration. --sample replays a bundled hour of real AIS traffic (295 vessels).\n"
            "Ctrl-C or SIGTERM ends the replay early: the last answers are awaited and the summary printed.\n"
            'JSON: {"users", "sent", "accepted" (null over MQTT), "refused": {code: n}, "bad_rows",\n'
            '"duration_s", "queries", "answers", ...}.'
        ),
        epilog=client.CLIENT_EPILOG,
    )
    p.add_argument("input", type=Path, nargs="?", default=None, metavar="INPUT", help="file or GeoLife folder")
    p.add_argument(
        "--sample",
        action="store_true",
        help="replay the bundled sample instead of INPUT: 1 h of 295 vessels in New York harbour (AIS) (off)",
    )
    p.add_argument(
        "--max-duration",
        type=float,
        default=None,
        metavar="S",
        help="send only the fixes due within S seconds, then stop (whole input)",
    )
    p.add_argument("--format", choices=client.FORMATS, default=None, help="input format (by suffix / folder / header)")
    p.add_argument("--speed", type=float, default=1.0, metavar="F", help="time acceleration (1.0)")
    p.add_argument("--interpolate", type=float, default=None, metavar="S", help="resample every S source seconds (off)")
    p.add_argument("--queries-per-min", type=float, default=0.0, metavar="Q", help="queries per active user/min (0)")
    p.add_argument("--query-kind", choices=client.QUERY_KINDS, default="mix", help="range, knn or mix (mix)")
    p.add_argument("--user-prefix", default="r", metavar="P", help="user ids P000001… in open mode (r)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="send only the N earliest fixes (all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for queries (random)")
    client.client_flags(p)
    p.set_defaults(func=run_replay_cmd)


def duration_text(seconds: float) -> str:
    """``3 h 20 min``, ``4 min 5 s``, ``12 s``, ``26 days 1 h``: a length for people."""
    s = round(seconds)
    days, s = divmod(s, 86_400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days} day{'s' if days > 1 else ''} {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {s} s" if minutes else f"{s} s"


LONG_REPLAY_S = 15 * 60
"""Above this the start-up line suggests a --speed that plays the input in :data:`SUGGESTED_S`."""
SUGGESTED_S = 5 * 60


def replay_eta(plan: ReplayPlan, speed: float, max_duration_s: float | None) -> str:
    """The start-up line: what is replayed, how long it takes and, when long, how to shorten it."""
    users = len(plan.users)
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + plan.eta_s))
    line = (
        f"kcloak replay: {len(plan):,} fixes of {users:,} user{'s' if users != 1 else ''} "
        f"({duration_text(plan.source_span_s)} recorded) at speed {speed:g}: "
        f"about {duration_text(plan.eta_s)}, until {until}"
    )
    if plan.dropped and max_duration_s is not None:
        line += f"; {plan.dropped:,} later fixes left out by --max-duration {max_duration_s:g}"
    elif plan.eta_s > LONG_REPLAY_S:
        fit = plan.source_span_s / SUGGESTED_S
        line += f" (--speed {fit:.3g} plays it in {duration_text(SUGGESTED_S)}; --max-duration S stops after S seconds)"
    return line


def run_replay_cmd(args: argparse.Namespace) -> int:
    from kcloak.simulators.replay import ReplayConfig, load_plan, run_replay, sample_path

    if (args.input is None) == (not args.sample):
        raise UsageError("give INPUT or --sample (the bundled sample), not both" if args.sample else "INPUT: required")
    cfg = ReplayConfig(
        input=sample_path() if args.sample else args.input,
        max_duration_s=args.max_duration,
        format=args.format,
        speed=args.speed,
        interpolate_s=args.interpolate,
        queries_per_min=args.queries_per_min,
        user_prefix=args.user_prefix,
        limit=args.limit,
        broker=args.broker,
        tokens=args.tokens,
        query_kind=args.query_kind,
        seed=args.seed,
    )
    # Input first: a bad file is exit 2 whatever the broker does.
    plan, _ = load_plan(cfg)
    return client.run_and_report(
        args,
        "replay",
        lambda update, stop: run_replay(cfg, plan=plan, on_progress=update, stop=stop),
        announce=replay_eta(plan, cfg.speed, cfg.max_duration_s),
        fixes={"area_exceeded": "the recorded users are too far apart for the profiles' k"},
        stoppable=True,
    )
