"""``kcloak serve`` (contract §9): flags over TOML over the shipped defaults, then run the broker."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcloak.core.logs import log_event, setup_logging

if TYPE_CHECKING:
    import asyncio

    from kcloak.broker.auth import TokenStore
    from kcloak.broker.config import Config
    from kcloak.broker.service import Service
    from kcloak.cli.main import SubParsers

# kcloak.broker.auth, kcloak.broker.config (numpy through the profile) and asyncio are imported when the
# command runs, so that ``kcloak --help`` stays fast.

log = logging.getLogger("kcloak.serve")

# flag dest -> TOML key
_FLAG_KEYS = {
    "http": "http.listen",
    "mqtt_listen": "mqtt.listen",
    "mqtt_password_file": "mqtt.password_file",
    "mqtt_ingest_connections": "mqtt.ingest_connections",
    "upstream": "upstream.url",
    "upstream_timeout_s": "upstream.timeout_s",
    "upstream_retries": "upstream.retries",
    "upstream_token_file": "upstream.token_file",
    "algorithm": "cloaking.algorithm",
    "places": "cloaking.places",
    "stale_after_s": "cloaking.stale_after_s",
    "max_update_age_s": "cloaking.max_update_age_s",
    "data_dir": "storage.data_dir",
    "tokens": "auth.tokens",
    "publish_window_s": "publish.window_s",
    "publish_k": "publish.k",
    "publish_delta_m": "publish.delta_m",
    "publish_method": "publish.method",
    "map_min_k": "map.min_k",
    "map_streets": "map.streets",
    "log_level": "log.level",
    "log_format": "log.format",
    "access_log": "log.access",
    "stats_interval_s": "log.stats_interval_s",
}


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser(
        "serve",
        help="run the anonymizer broker (HTTP and MQTT in, cloaked queries out)",
        description=(
            "Run the trusted anonymizer. Apps send location updates and queries over HTTP "
            "(default 127.0.0.1:8470) and MQTT; each query is cloaked to a region with at least k "
            "users and forwarded, under a fresh pseudonym, to the upstream LBS. Configuration: "
            "shipped defaults < --config FILE.toml < flags. Serving beyond loopback requires a "
            "tokens file."
        ),
    )
    p.add_argument("--config", metavar="FILE.toml", help="TOML configuration file (see --print-config)")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    p.add_argument("--http", metavar="HOST:PORT|none", help="HTTP listen address (127.0.0.1:8470)")
    p.add_argument(
        "--mqtt",
        metavar="embedded|none|mqtt://[USER@]HOST[:PORT]",
        help="MQTT ingress: embedded broker, none, or an external broker (embedded)",
    )
    p.add_argument("--mqtt-listen", metavar="HOST:PORT", help="embedded MQTT listen address (127.0.0.1:1883)")
    p.add_argument("--mqtt-password-file", metavar="FILE", help="service account password for an external broker")
    p.add_argument(
        "--mqtt-ingest-connections",
        type=int,
        metavar="N",
        help=(
            "MQTT intake connections (1); more share one subscription on an external broker, which spreads "
            "the load but no longer keeps one user's messages in order (a late fix is refused out_of_order)"
        ),
    )
    p.add_argument("--upstream", metavar="URL", help="upstream LBS base URL (http://127.0.0.1:8471)")
    p.add_argument("--upstream-timeout-s", type=float, metavar="S", help="per-attempt timeout (2.0)")
    p.add_argument("--upstream-retries", type=int, metavar="N", help="retries after the first attempt (2)")
    p.add_argument("--upstream-token-file", metavar="FILE", help="operator-wide bearer token for the upstream")
    p.add_argument(
        "--algorithm",
        metavar="NAME",
        help="nn, interval, casper, hilbert (default, reciprocal), clique, privacygrid or temporal",
    )
    p.add_argument("--places", metavar="FILE", help="places layer for l > 1 (bundled Beijing POIs)")
    p.add_argument("--stale-after-s", type=float, metavar="S", help="presence window of a fix (60)")
    p.add_argument("--max-update-age-s", type=float, metavar="S", help="oldest accepted fix (120)")
    p.add_argument("--data-dir", metavar="DIR", help="data directory (./kcloak-data)")
    p.add_argument("--tokens", metavar="FILE", help="tokens file (default <data-dir>/tokens if it exists)")
    p.add_argument("--publish-window-s", type=int, metavar="S", help="trajectory publication window (900)")
    p.add_argument("--publish-k", type=int, metavar="K", help="k of published trajectories (5)")
    p.add_argument("--publish-delta-m", type=float, metavar="M", help="delta of published trajectories (500)")
    p.add_argument("--publish-method", metavar="NAME", help="nwa, w4m or microagg (nwa)")
    p.add_argument(
        "--map-min-k",
        type=int,
        metavar="K",
        help="the live map (GET /map) hides density cells with fewer users than this or profile.k (10)",
    )
    p.add_argument("--map-streets", metavar="FILE", help="GeoJSON street lines drawn under the live map (none)")
    p.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning, error (info)")
    p.add_argument("--log-format", metavar="json|text", help="log line format (json)")
    p.add_argument(
        "--access-log",
        action="store_const",
        const=True,
        help="one log line per HTTP request: route pattern, method, status, duration, bytes (never a path "
        "with its ids, a query string or a token); off by default",
    )
    p.add_argument(
        "--stats-interval-s",
        type=float,
        metavar="S",
        help="a counts-only stats line every S seconds (60; 0 = off)",
    )
    c = p.add_argument_group(
        "cluster mode (docs/cluster.md)",
        "With --cluster this process is one worker of a kcloak cluster on NATS JetStream: its HTTP and "
        "MQTT doors publish every app message to the replicated intake stream and acknowledge it only "
        "after the stream's acknowledgement; its worker routes users and owns cells. Every process of "
        "one cluster must be given the same --cells, --partitions and --replicas.",
    )
    c.add_argument(
        "--cluster",
        metavar="URLS",
        help="comma-separated NATS URLs (nats://h1:4222,nats://h2:4222); their presence turns cluster mode on",
    )
    c.add_argument(
        "--cells", metavar="FILE", help="cell boundaries, kcloak.cells/1 JSON from 'kcloak cells' (one cell)"
    )
    c.add_argument("--partitions", type=int, metavar="P", help="intake partitions, each user in one (16)")
    c.add_argument("--replicas", type=int, metavar="R", help="replicas of every stream and bucket: 1, 3 or 5 (3)")
    c.add_argument("--worker-name", metavar="NAME", help="this worker's name, unique in the cluster (hostname-pid)")
    c.add_argument(
        "--dask-scheduler",
        metavar="ADDR",
        help="Dask scheduler (tcp://h1:8786) anonymizing the published windows (default: in this process)",
    )
    c.add_argument(
        "--gateway-only",
        action="store_true",
        help="run only the HTTP/MQTT gateway, no worker (more doors in front of the same workers)",
    )
    p.set_defaults(func=run)


def effective_config(args: argparse.Namespace) -> Config:
    from kcloak.broker.config import Config

    cfg = Config.from_toml_file(args.config) if args.config else Config()
    values: dict[str, Any] = {key: getattr(args, dest) for dest, key in _FLAG_KEYS.items()}
    if args.mqtt is not None:
        values["mqtt.mode"] = args.mqtt
        if args.mqtt.startswith("mqtt://") and "@" in args.mqtt[7:]:
            values["mqtt.username"] = args.mqtt[7:].split("@", 1)[0]
    return cfg.with_values(values)


def resolve_tokens(cfg: Config) -> TokenStore | None:
    from kcloak.broker.auth import TokenStore

    path = cfg.auth.tokens
    if not path:
        default = Path(cfg.storage.data_dir) / "tokens"
        if not default.exists():
            return None
        path = str(default)
    return TokenStore.from_file(path)


def check_exposure(cfg: Config, tokens: TokenStore | None) -> None:
    """Refuse to listen beyond loopback in open mode (contract §9)."""
    from kcloak.broker.config import ConfigError, is_loopback, parse_listen

    if tokens is not None:
        return
    if cfg.http.listen != "none" and not is_loopback(parse_listen(cfg.http.listen)[0]):
        raise ConfigError("http.listen: serving beyond loopback needs a tokens file (--tokens)")
    if cfg.mqtt.mode == "embedded" and not is_loopback(parse_listen(cfg.mqtt.listen)[0]):
        raise ConfigError("mqtt.listen: serving beyond loopback needs a tokens file (--tokens)")


SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval in ``kcloak serve`` (:func:`sys.setswitchinterval`)."""


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kcloak.broker.config import ConfigError
    from kcloak.wire.tokens import TokensFileError

    try:
        cfg = effective_config(args)
        if args.print_config:
            sys.stdout.write(cfg.to_toml())
            return 0
        tokens = resolve_tokens(cfg)
        check_exposure(cfg, tokens)
    except (ConfigError, TokensFileError) as exc:
        print(f"kcloak serve: {exc}", file=sys.stderr)
        return 2
    if args.cluster is not None:
        return run_cluster(args, cfg, tokens)
    for flag in ("cells", "partitions", "replicas", "worker_name", "dask_scheduler"):
        if getattr(args, flag) is not None:
            print(f"kcloak serve: --{flag.replace('_', '-')} needs --cluster", file=sys.stderr)
            return 2
    if args.gateway_only:
        print("kcloak serve: --gateway-only needs --cluster", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, cfg.log.format)
    # A store's writer thread takes the interpreter lock back after each SQLite call; while the event
    # loop's thread runs, it waits the switch interval for it (5 ms by default), several times per
    # commit, and the clients whose answers wait for that commit wait as long.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(_serve(cfg, tokens))


def cluster_urls(text: str) -> list[str]:
    """The ``--cluster`` URLs; raises :class:`ConfigError` (naming no URL) when there is none or one is not nats://."""
    from kcloak.broker.config import ConfigError

    urls = [part.strip() for part in text.split(",") if part.strip()]
    if not urls:
        raise ConfigError("--cluster: give at least one nats://HOST:PORT URL")
    for url in urls:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in ("nats", "tls"):
            raise ConfigError("--cluster: every URL must start with nats:// or tls://")
    return urls


def run_cluster(args: argparse.Namespace, cfg: Config, tokens: TokenStore | None) -> int:
    """``kcloak serve --cluster``: the gateway (and one worker) until SIGINT/SIGTERM."""
    import asyncio

    from kcloak.broker.cluster.moves import moves_max_age_s
    from kcloak.broker.cluster.topology import Layout
    from kcloak.broker.config import ConfigError
    from kcloak.cloaking.cells import CellMap, CellMapError

    try:
        urls = cluster_urls(args.cluster)
        if cfg.mqtt.mode not in ("embedded", "none"):
            raise ConfigError("--mqtt: a cluster gateway serves MQTT itself (embedded) or not at all (none)")
        if args.cells:
            try:
                text = Path(args.cells).read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"--cells: cannot read the file ({exc.strerror})") from None
            cells = CellMap.from_json(text)
        else:
            cells = CellMap([])
        layout = Layout(
            partitions=16 if args.partitions is None else args.partitions,
            cells=cells.cells,
            replicas=3 if args.replicas is None else args.replicas,
            moves_max_age_s=moves_max_age_s(cfg.publish.window_s, cfg.cloaking.max_update_age_s),
        )
    except (ConfigError, CellMapError) as exc:
        print(f"kcloak serve: {exc}", file=sys.stderr)
        return 2
    from kcloak.broker.cluster.gateway import default_worker_name

    name = args.worker_name or default_worker_name()
    if re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name) is None:
        print("kcloak serve: --worker-name: 1-64 letters, digits, '.', '-' or '_'", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, cfg.log.format)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(
            _serve_cluster(cfg, tokens, urls, layout, cells, name, not args.gateway_only, args.dask_scheduler)
        )


async def _serve_cluster(
    cfg: Config,
    tokens: TokenStore | None,
    urls: list[str],
    layout: Any,
    cells: Any,
    name: str,
    worker: bool,
    dask_scheduler: str | None = None,
) -> int:
    from kcloak.broker.cluster.gateway import ClusterGateway

    return await _run_until_stopped(
        lambda: ClusterGateway(
            config=cfg,
            tokens=tokens,
            servers=urls,
            layout=layout,
            cells=cells,
            name=name,
            worker=worker,
            dask_scheduler=dask_scheduler,
        )
    )


async def _run_until_stopped(make: Callable[[], Service]) -> int:
    """Start the service ``make`` builds, stop it gracefully on SIGINT/SIGTERM; 1 when it cannot start."""
    import asyncio

    from kcloak.broker.service import StartupError

    try:
        service = make()
        async with service:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(service.shutdown()))
            settle_gc()
            await service.wait_stopped()
    except StartupError as exc:
        log_event(log, "startup_failed", logging.ERROR, reason=str(exc))
        print(f"kcloak serve: {exc}", file=sys.stderr)
        return 1
    return 0


def event_loop_factory(default: str = "asyncio") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when ``KCLOAK_EVENT_LOOP`` (else ``default``) is ``uvloop`` and it is
    installed, else asyncio's (``None``).

    ``kcloak serve`` defaults to asyncio: with uvloop, ``kcloak bench broker`` took a third of the
    MQTT updates/s (its transports hand the intake protocol smaller chunks) and fewer HTTP updates/s.
    """
    if os.environ.get("KCLOAK_EVENT_LOOP", default) != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


GC_THRESHOLD = (10_000, 10, 10)
"""Young-generation collection every 10,000 allocations (Python's default: 700)."""


def settle_gc() -> None:
    """Keep the cyclic garbage collector out of a long-running server's latency tail.

    Called once the server has started: what exists then (code, configuration, restored state)
    lives as long as the process, so it is collected once and then frozen out of the collector's
    sight (:func:`gc.freeze`); and the young generation is collected every 10,000 allocations
    instead of 700, as a server allocates a few dozen objects per request. Under a saturating
    HTTP query load this cut the time spent collecting from about 0.8 s to 0.15 s per 20 s, and
    the full collections of 60-80 ms are gone (only the objects created since start are left to
    traverse). Garbage is still collected: reference counting frees what is not in a cycle.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


async def _serve(cfg: Config, tokens: TokenStore | None) -> int:
    from kcloak.broker.service import Broker

    return await _run_until_stopped(lambda: Broker(config=cfg, tokens=tokens))
