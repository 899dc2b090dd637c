"""``kcloak lbs``: run the reference LBS provider (contract §5, §9; CONCEPTS §5.3).

Flags: ``--pois FILE`` (bundled Beijing POIs), ``--http HOST:PORT`` (127.0.0.1:8471; port 0 picks a
free one), ``--log-level``. Exit codes: 2 for a bad flag or an unreadable/empty POI file, 1 when the
address cannot be bound, 0 after SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import sys
from typing import TYPE_CHECKING

from kcloak import __version__
from kcloak.core.logs import log_event, setup_logging

if TYPE_CHECKING:
    from kcloak.cli.main import SubParsers
    from kcloak.core.places import PoiSet

# The server (aiohttp), the POI layer (numpy) and asyncio are imported when the command runs, so
# that ``kcloak --help`` stays fast.

log = logging.getLogger("kcloak.lbs")

DEFAULT_LISTEN = "127.0.0.1:8471"
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_parser(subparsers: SubParsers) -> None:
    """Register ``lbs`` on the ``kcloak`` subcommand parser."""
    p = subparsers.add_parser(
        "lbs",
        help="run the reference LBS provider (the broker's default upstream)",
        description=(
            "Serve the upstream LBS API of contract §5 (POST /v1/search, GET /v1/categories, "
            "/v1/openapi.json, /healthz, /metrics): inclusive range and kNN candidate sets over a "
            "cloaked region."
        ),
    )
    p.add_argument("--pois", metavar="FILE", default=None, help="POI file, CSV or GeoJSON (default: bundled Beijing)")
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        type=parse_listen,
        default=DEFAULT_LISTEN,
        help=f"listen address ({DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (info)")
    p.set_defaults(func=run)


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → ``(host, port)``; a usage error (exit 2) otherwise."""
    host, sep, port_s = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise argparse.ArgumentTypeError("expected HOST:PORT with a port in [0, 65535]")
    return host, int(port_s)


def run(args: argparse.Namespace) -> int:
    """Load the POIs, then serve until SIGINT/SIGTERM."""
    import asyncio

    from kcloak.core.places import PoiFileError, load_pois

    host, port = args.http
    setup_logging(args.log_level)
    try:
        pois = load_pois(args.pois)
    except PoiFileError as exc:
        print(f"kcloak lbs: error: {exc}", file=sys.stderr)
        return 2
    if len(pois) == 0:
        print("kcloak lbs: error: POI file: no usable POIs", file=sys.stderr)
        return 2
    if pois.bad_rows:
        print(f"kcloak lbs: warning: skipped {pois.bad_rows} bad POI rows", file=sys.stderr)
    return asyncio.run(_serve(pois, host, port))


async def _serve(pois: PoiSet, host: str, port: int) -> int:
    import asyncio

    from kcloak.broker.lbs_server import LbsServer
    from kcloak.cli.serve import settle_gc

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = LbsServer(pois, host=host, port=port)
    try:
        await server.__aenter__()
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or type(exc).__name__)
        print(f"kcloak lbs: error: cannot listen on {host}:{port}: {reason}", file=sys.stderr)
        return 1
    try:
        n_cats = len({p.category for p in pois.pois})
        print(
            f"kcloak lbs {__version__}: serving {len(pois)} POIs in {n_cats} categories on {server.url} "
            "(SIGINT/SIGTERM to stop)",
            file=sys.stderr,
            flush=True,
        )
        log_event(log, "lbs_started", pois=len(pois), categories=n_cats, port=server.port)
        settle_gc()
        await stop.wait()
    finally:
        await server.__aexit__(None, None, None)
    log_event(log, "lbs_stopped")
    print("kcloak lbs: stopped", file=sys.stderr, flush=True)
    return 0
