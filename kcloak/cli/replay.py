"""``kcloak replay`` (contract §9): recorded trajectories sent as live traffic (:mod:`kcloak.simulators.replay`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kcloak.cli import _client as client
from kcloak.cli.main import SubParsers


def add_parser(subparsers: SubParsers) -> None:
    p = subparsers.add_parser(
        "replay",
        help="send recorded trajectories (CSV, GeoLife, GPX, AIS) as live traffic",
        formatter_class=client.FORMATTER,
        description=(
            "Replay trajectories read with kcloak's readers (bad rows are skipped and counted). Each\n"
            "source trajectory becomes a user (P000001… or the tokens file's users in order). Times are\n"
            "shifted to now: the earliest fix is sent 1 s after the start, every other (t - t_min)/speed\n"
            "later, stamped with its send time; each user's order is kept.\n"
            'JSON: {"users", "sent", "accepted" (null over MQTT), "refused": {code: n}, "bad_rows",\n'
            '"duration_s", "queries", "answers", ...}.'
        ),
        epilog=client.CLIENT_EPILOG,
    )
    p.add_argument("input", type=Path, metavar="INPUT", help="file or GeoLife folder")
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


def run_replay_cmd(args: argparse.Namespace) -> int:
    from kcloak.simulators.replay import ReplayConfig, load_plan, run_replay

    cfg = ReplayConfig(
        input=args.input,
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
    return client.run_and_report(args, "replay", lambda update: run_replay(cfg, plan=plan, on_progress=update))
