"""``kcloak simulate`` (contract §9): simulated users moving and querying (:mod:`kcloak.simulators.traffic`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kcloak.cli import _client as client
from kcloak.cli.main import SubParsers, UsageError
from kcloak.simulators.area import (
    MAX_SIDE_KM,
    MIN_SIDE_KM,
    USERS_PER_KM2,
    BBox,
    parse_bbox,
    populated_area,
    side_for_users,
    side_km,
    square_around,
)


def add_parser(subparsers: SubParsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulated users sending fixes and Poisson queries",
        formatter_class=client.FORMATTER,
        description=(
            "Simulate N users moving with a mobility model. Each sends a location fix every --dt seconds\n"
            "within --area (by default a square around central Beijing sized so that k = 20 is reachable)\n"
            "and LBS queries (range or knn) as a Poisson process of --query-rate per user per minute.\n"
            "Before traffic starts, each user's stored profile is set from --profile-mix, a JSON list\n"
            '[{"weight": w, "profile": {"k": 10, ...}}, ...] (default 50 % k=5, 30 % k=10, 20 % k=20).\n'
            "Open mode sends each step's fixes as batch messages; with --tokens every user publishes on\n"
            "its own topic or route. Query latency is measured from each query's intended send time.\n"
            "Ctrl-C or SIGTERM ends the run early: the last answers are awaited and the summary printed.\n"
            'JSON: {"users", "sent", "accepted" (null over MQTT), "refused": {code: n}, "duration_s",\n'
            '"queries", "answers": {"ok", "refused", "unanswered", "reasons"}, ...}.'
        ),
        epilog=client.CLIENT_EPILOG,
    )
    p.add_argument("--users", type=int, default=1000, metavar="N", help="simulated users (1000)")
    p.add_argument("--model", choices=client.MODELS, default="street", help="mobility model (street)")
    p.add_argument("--osm", type=Path, default=None, metavar="FILE", help="OSM XML or zip for street (bundled Beijing)")
    p.add_argument(
        "--area",
        default="auto",
        metavar="KM|auto|whole",
        help=(
            f"users live in a square of KM km around central Beijing; auto: sized for {USERS_PER_KM2:g} users per "
            f"km2, {MIN_SIDE_KM:g} to {MAX_SIDE_KM:g} km wide; whole: the whole bundled extract, about 40 x 34 km, "
            "where few queries find k users within max_area_m2 (auto; whole with --osm)"
        ),
    )
    p.add_argument(
        "--bbox",
        type=_bbox,
        default=None,
        metavar="MIN_LON,MIN_LAT,MAX_LON,MAX_LAT",
        help="users live in this box instead of --area (none)",
    )
    p.add_argument("--dt", type=float, default=1.0, metavar="S", help="seconds between a user's fixes (1.0)")
    p.add_argument("--query-rate", type=float, default=1.0, metavar="Q", help="queries per user per minute (1.0)")
    p.add_argument("--query-kind", choices=client.QUERY_KINDS, default="mix", help="range, knn or mix (mix)")
    p.add_argument("--profile-mix", type=Path, default=None, metavar="FILE.json", help="profile mix (see above)")
    p.add_argument("--duration", type=float, default=60.0, metavar="S", help="seconds of traffic (60)")
    p.add_argument("--seed", type=int, default=None, help="random seed (random)")
    client.client_flags(p)
    p.set_defaults(func=run_simulate)


def _bbox(text: str) -> BBox:
    try:
        return parse_bbox(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def users_area(area: str, bbox: BBox | None, users: int, osm: Path | None) -> tuple[BBox | None, str]:
    """The box the users keep to (None: the whole network) and its description for the start-up line."""
    if bbox is not None:
        w, h = side_km(bbox)
        return bbox, f"the box {w:.1f} km x {h:.1f} km of --bbox"
    if area == "whole" or (area == "auto" and osm is not None):
        return None, "the whole street network" if osm is not None else "the whole bundled Beijing extract"
    if osm is not None:
        raise UsageError("--area: a square around central Beijing needs the bundled streets; with --osm give --bbox")
    if area == "auto":
        side = side_for_users(users)
        return populated_area(users), f"a {side:.1f} km square around central Beijing ({users / side**2:.0f} users/km2)"
    try:
        side = float(area)
        box = square_around(side)
    except ValueError:
        raise UsageError("--area: expected a side in km (> 0), auto or whole") from None
    return box, f"a {side:g} km square around central Beijing ({users / side**2:.1f} users/km2)"


def run_simulate(args: argparse.Namespace) -> int:
    from kcloak.simulators.traffic import DEFAULT_MIX, NullObserver, SimulationConfig, load_profile_mix, run_simulation

    mix = load_profile_mix(args.profile_mix) if args.profile_mix is not None else DEFAULT_MIX
    bbox, where = users_area(args.area, args.bbox, args.users, args.osm)
    cfg = SimulationConfig(
        users=args.users,
        model=args.model,
        osm=args.osm,
        dt_s=args.dt,
        query_rate_per_min=args.query_rate,
        profile_mix=mix,
        duration_s=args.duration,
        seed=args.seed,
        broker=args.broker,
        tokens=args.tokens,
        query_kind=args.query_kind,
        bbox=bbox,
    )
    if args.osm is not None and not args.osm.is_file():
        raise UsageError("--osm: no such file")

    class Ticker(NullObserver):
        def __init__(self, update: client.Progress | None) -> None:
            self.sent = 0
            self.update = update

        def on_updates(self, n: int) -> None:
            self.sent += n
            if self.update is not None:
                self.update(self.sent, self.sent)

    return client.run_and_report(
        args,
        "simulate",
        lambda update, stop: run_simulation(cfg, observer=Ticker(update), stop=stop),
        announce=f"kcloak simulate: {args.users:,} users ({args.model}) in {where}, for {args.duration:g} s",
        fixes={
            "k_unreachable": "run more --users",
            "area_exceeded": "put the users closer together (a smaller --area or more --users)",
        },
        stoppable=True,
    )
