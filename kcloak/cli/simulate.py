"""``kcloak simulate``, ``kcloak replay``, ``kcloak load`` and ``kcloak bench simulate`` (contract §9).

Thin parsing only: the work is done by :mod:`kcloak.simulators.traffic`, :mod:`kcloak.simulators.replay`,
:mod:`kcloak.simulators.load` and :mod:`kcloak.simulators.bench`, imported when a command runs so that
``kcloak --help`` stays fast. Exit codes: 0 success, 1 broker unreachable, not kcloak
(:mod:`kcloak.simulators.preflight`) or connection lost, 2 bad flags or input. ``--json`` prints one
object on stdout; progress bars go to stderr (off with ``--no-progress`` or when stderr is not a TTY).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kcloak.cli.bench_cloak import bench_subparsers, rich_bar
from kcloak.cli.main import UsageError

if TYPE_CHECKING:
    from kcloak.simulators.transport import TransportError

    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

# Choices spelled out here so that ``kcloak --help`` imports no simulator module (numpy, scipy);
# tests check them against kcloak.simulators.bench.MODELS, kcloak.simulators.traffic.QUERY_KINDS and
# kcloak.core.readers.FORMATS.
MODELS: tuple[str, ...] = ("waypoint", "street", "hotspot")
QUERY_KINDS: tuple[str, ...] = ("range", "knn", "mix")
FORMATS: tuple[str, ...] = ("csv", "geolife", "gpx", "ais")

T = TypeVar("T")

CLIENT_EPILOG = (
    "--broker URL is mqtt://HOST[:PORT] (default port 1883) or http://HOST[:PORT] (default port\n"
    '8470); the broker must answer as kcloak (retained kcloak/v1/broker/status "up" over MQTT,\n'
    "GET /healthz over HTTP). --tokens FILE holds plaintext user:token lines: the client then acts\n"
    "as those users, each on its own topic or route with its own credentials; without it (open\n"
    "mode) one gateway connection carries every user. Progress goes to stderr (off when stderr is\n"
    "not a terminal). Exit codes: 0 success, 1 broker unreachable, not kcloak or connection lost,\n"
    "2 bad flags or input."
)


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", metavar="URL", help="broker (mqtt://127.0.0.1:1883)")
    p.add_argument("--tokens", type=Path, default=None, metavar="FILE", help="user:token lines (open mode if absent)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_parser(subparsers: SubParsers) -> None:
    """Add ``simulate``, ``replay``, ``load`` and ``bench simulate``."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "simulate",
        help="simulated users sending fixes and Poisson queries",
        formatter_class=fmt,
        description=(
            "Simulate N users moving with a mobility model. Each sends a location fix every --dt seconds\n"
            "and LBS queries (range or knn) as a Poisson process of --query-rate per user per minute.\n"
            "Before traffic starts, each user's stored profile is set from --profile-mix, a JSON list\n"
            '[{"weight": w, "profile": {"k": 10, ...}}, ...] (default 50 % k=5, 30 % k=10, 20 % k=20).\n'
            "Open mode sends each step's fixes as batch messages; with --tokens every user publishes on\n"
            "its own topic or route. Query latency is measured from each query's intended send time.\n"
            'JSON: {"users", "sent", "accepted" (null over MQTT), "refused": {code: n}, "duration_s",\n'
            '"queries", "answers": {"ok", "refused", "unanswered", "reasons"}, ...}.'
        ),
        epilog=CLIENT_EPILOG,
    )
    p.add_argument("--users", type=int, default=1000, metavar="N", help="simulated users (1000)")
    p.add_argument("--model", choices=MODELS, default="street", help="mobility model (street)")
    p.add_argument("--osm", type=Path, default=None, metavar="FILE", help="OSM XML or zip for street (bundled Beijing)")
    p.add_argument("--dt", type=float, default=1.0, metavar="S", help="seconds between a user's fixes (1.0)")
    p.add_argument("--query-rate", type=float, default=1.0, metavar="Q", help="queries per user per minute (1.0)")
    p.add_argument("--query-kind", choices=QUERY_KINDS, default="mix", help="range, knn or mix (mix)")
    p.add_argument("--profile-mix", type=Path, default=None, metavar="FILE.json", help="profile mix (see above)")
    p.add_argument("--duration", type=float, default=60.0, metavar="S", help="seconds of traffic (60)")
    p.add_argument("--seed", type=int, default=None, help="random seed (random)")
    _client_flags(p)
    p.set_defaults(func=run_simulate)

    p = subparsers.add_parser(
        "replay",
        help="send recorded trajectories (CSV, GeoLife, GPX, AIS) as live traffic",
        formatter_class=fmt,
        description=(
            "Replay trajectories read with kcloak's readers (bad rows are skipped and counted). Each\n"
            "source trajectory becomes a user (P000001… or the tokens file's users in order). Times are\n"
            "shifted to now: the earliest fix is sent 1 s after the start, every other (t - t_min)/speed\n"
            "later, stamped with its send time; each user's order is kept.\n"
            'JSON: {"users", "sent", "accepted" (null over MQTT), "refused": {code: n}, "bad_rows",\n'
            '"duration_s", "queries", "answers", ...}.'
        ),
        epilog=CLIENT_EPILOG,
    )
    p.add_argument("input", type=Path, metavar="INPUT", help="file or GeoLife folder")
    p.add_argument("--format", choices=FORMATS, default=None, help="input format (by suffix / folder / header)")
    p.add_argument("--speed", type=float, default=1.0, metavar="F", help="time acceleration (1.0)")
    p.add_argument("--interpolate", type=float, default=None, metavar="S", help="resample every S source seconds (off)")
    p.add_argument("--queries-per-min", type=float, default=0.0, metavar="Q", help="queries per active user/min (0)")
    p.add_argument("--query-kind", choices=QUERY_KINDS, default="mix", help="range, knn or mix (mix)")
    p.add_argument("--user-prefix", default="r", metavar="P", help="user ids P000001… in open mode (r)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="send only the N earliest fixes (all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for queries (random)")
    _client_flags(p)
    p.set_defaults(func=run_replay_cmd)

    p = subparsers.add_parser(
        "load",
        help="open-loop load at a target message rate, latency from intended send time",
        formatter_class=fmt,
        description=(
            "Offer --rate messages per second for --duration seconds, open loop: message i is due at\n"
            "start + i/rate whatever the broker does, so a slow broker shows up as latency instead of\n"
            "silently lowering the load (no coordinated omission). A --query-fraction of messages are\n"
            "queries, the rest single fixes on each user's own topic or route. Latency = answer (or HTTP\n"
            "response) time - intended send time; over MQTT only queries are answered by kcloak.\n"
            'JSON: {"target_rate", "achieved_rate", "duration_s", "sent_updates", "sent_queries",\n'
            '"answers_ok", "answers_refused", "errors": {code: n}, "latency_ms": {"p50", "p90", "p99", "max"}, ...}.'
        ),
        epilog=CLIENT_EPILOG,
    )
    p.add_argument("--rate", type=float, default=1000.0, metavar="R", help="messages per second (1000)")
    p.add_argument("--duration", type=float, default=30.0, metavar="S", help="seconds (30)")
    p.add_argument("--users", type=int, default=10_000, metavar="N", help="users (10000)")
    p.add_argument("--query-fraction", type=float, default=0.1, metavar="F", help="share of queries (0.1)")
    p.add_argument("--query-kind", choices=QUERY_KINDS, default="mix", help="range, knn or mix (mix)")
    p.add_argument("--model", choices=MODELS, default="waypoint", help="mobility model (waypoint)")
    p.add_argument("--http-connections", type=int, default=256, metavar="N", help="HTTP query connections (256)")
    p.add_argument("--seed", type=int, default=None, help="random seed (random)")
    _client_flags(p)
    p.set_defaults(func=run_load_cmd)

    bench = bench_subparsers(subparsers)
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


# -- helpers -----------------------------------------------------------------------------------
@contextmanager
def _progress(enabled: bool, label: str) -> Iterator[Callable[[int, int], None] | None]:
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with rich_bar() as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _run_client(broker: str, tokens: Path | None, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Probe ``broker`` (must be a running kcloak), then run ``work()``; bad input becomes :class:`UsageError`.

    The probe uses the tokens file's first user over MQTT. Raises
    :class:`~kcloak.simulators.transport.TransportError` (exit 1) when the broker is unreachable or not kcloak.
    """
    import asyncio

    from kcloak.simulators.client import ClientInputError, load_client_tokens
    from kcloak.simulators.preflight import probe_broker
    from kcloak.simulators.traffic import SimulationInputError

    try:
        credentials = load_client_tokens(tokens)[0] if tokens is not None else None
    except ClientInputError as exc:
        raise UsageError(str(exc)) from None

    async def checked() -> T:
        await probe_broker(broker, credentials=credentials)
        return await work()

    try:
        return asyncio.run(checked())
    except SimulationInputError as exc:
        raise UsageError(str(exc)) from None


def _emit(obj: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(obj) + "\n")
        return
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{title}[/bold]")
    for key, value in obj.items():
        console.print(f"  {key}: {json.dumps(value)}")


def _unreachable(exc: TransportError) -> int:
    print(f"kcloak: error: {exc}", file=sys.stderr)
    return 1


# -- commands ----------------------------------------------------------------------------------
def run_simulate(args: argparse.Namespace) -> int:
    from kcloak.simulators.traffic import (
        DEFAULT_MIX,
        NullObserver,
        SimulationConfig,
        SimulationInputError,
        load_profile_mix,
        run_simulation,
    )
    from kcloak.simulators.transport import TransportError

    try:
        mix = load_profile_mix(args.profile_mix) if args.profile_mix is not None else DEFAULT_MIX
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
        )
    except SimulationInputError as exc:
        raise UsageError(str(exc)) from None
    if args.osm is not None and not args.osm.is_file():
        raise UsageError("--osm: no such file")

    with _progress(not args.no_progress, "simulate") as update:

        class Ticker(NullObserver):
            def __init__(self) -> None:
                self.sent = 0

            def on_updates(self, n: int) -> None:
                self.sent += n
                if update is not None:
                    update(self.sent, self.sent)

        try:
            summary = _run_client(args.broker, args.tokens, lambda: run_simulation(cfg, observer=Ticker()))
        except TransportError as exc:
            return _unreachable(exc)
    _emit(summary.to_json(), args.json, "kcloak simulate")
    return 0


def run_replay_cmd(args: argparse.Namespace) -> int:
    from kcloak.simulators.replay import ReplayConfig, load_plan, run_replay
    from kcloak.simulators.traffic import SimulationInputError
    from kcloak.simulators.transport import TransportError

    try:
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
    except SimulationInputError as exc:
        raise UsageError(str(exc)) from None
    with _progress(not args.no_progress, "replay") as update:
        try:
            summary = _run_client(args.broker, args.tokens, lambda: run_replay(cfg, plan=plan, on_progress=update))
        except TransportError as exc:
            return _unreachable(exc)
    _emit(summary.to_json(), args.json, "kcloak replay")
    return 0


def run_load_cmd(args: argparse.Namespace) -> int:
    from kcloak.simulators.load import LoadConfig, run_load
    from kcloak.simulators.traffic import SimulationInputError
    from kcloak.simulators.transport import TransportError

    try:
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
    except SimulationInputError as exc:
        raise UsageError(str(exc)) from None
    with _progress(not args.no_progress, "load") as update:
        try:
            summary = _run_client(args.broker, args.tokens, lambda: run_load(cfg, on_progress=update))
        except TransportError as exc:
            return _unreachable(exc)
    _emit(summary.to_json(), args.json, "kcloak load")
    return 0


def run_bench_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kcloak.simulators.bench import measure_models, measure_transports
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
