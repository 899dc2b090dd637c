"""``kcloak cluster``: a local cluster for trying it, its status, and window publication (issue 15, docs/cluster.md).

- ``kcloak cluster up --nodes 3 --workers N``: NATS nodes, ``kcloak serve --cluster`` workers, a Dask scheduler
  and Dask workers on loopback, one status table; Ctrl-C stops everything (:mod:`kcloak.cli._cluster_up`).
- ``kcloak cluster status --nats URLS``: streams, pinned consumers, pending per partition and per cell, the
  publication ledger's last windows (``--json`` for scripts).
- ``kcloak cluster publish --nats URLS --window ID --fixes FILE.csv``: anonymize one window on Dask and publish
  it exactly once (ledger in KV ``kcloak_windows``). Exit 0 when the window is published (or was already), 1
  when it is refused (the reason is printed) or cannot be published now, 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from kcloak.core.names import KDeltaMethod, values

if TYPE_CHECKING:
    from kcloak.cli.main import SubParsers


def _urls(value: str) -> list[str]:
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls or not all(u.startswith(("nats://", "tls://")) for u in urls):
        raise argparse.ArgumentTypeError("expected comma-separated nats:// URLs")
    return urls


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError("expected an integer >= 1")
    return int(value)


def _count(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError("expected an integer >= 0")
    return int(value)


def add_parser(subparsers: SubParsers) -> None:
    """Register ``cluster`` and its subcommands."""
    p = subparsers.add_parser(
        "cluster",
        help="a local NATS + Dask cluster, its status, and window publication on Dask",
        description="kcloak on NATS JetStream and Dask (docs/cluster.md). Needs the 'cluster' extra.",
    )
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)

    up = sub.add_parser("up", help="start a local cluster on loopback and show its status until Ctrl-C")
    up.add_argument("--nodes", type=_positive_int, default=3, help="NATS nodes (3; 1 for a one-node JetStream)")
    up.add_argument("--workers", type=_count, default=2, help="kcloak serve --cluster workers (2)")
    up.add_argument("--dask-workers", type=_count, default=2, help="Dask worker processes (2)")
    up.add_argument("--partitions", type=_positive_int, default=16, help="intake partitions P (16)")
    up.add_argument("--cells", metavar="FILE", help="kcloak.cells/1 cell map (default: one cell)")
    up.add_argument("--dir", metavar="DIR", help="folder for configs, stores and logs (default: a new temp folder)")
    up.add_argument("--refresh-s", type=float, default=2.0, help="status refresh period (2 s)")
    up.set_defaults(func=run_up)

    st = sub.add_parser("status", help="streams, pinned consumers, pending per partition and cell, the ledger")
    st.add_argument("--nats", type=_urls, required=True, metavar="URLS", help="comma-separated nats:// URLs")
    st.add_argument("--windows", type=_count, default=10, help="last ledger windows shown (10)")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    st.set_defaults(func=run_status)

    pub = sub.add_parser("publish", help="anonymize one window on Dask and publish it exactly once")
    pub.add_argument("--nats", type=_urls, required=True, metavar="URLS", help="comma-separated nats:// URLs")
    pub.add_argument("--window", required=True, metavar="T_START-T_END", help="window id (Unix seconds)")
    pub.add_argument("--fixes", required=True, metavar="FILE.csv", help="the window's fixes (traj_id,t,lat,lon)")
    pub.add_argument("--method", choices=values(KDeltaMethod), default="nwa", help="(k,δ) method (nwa)")
    pub.add_argument("--k", type=int, default=5, help="k (5)")
    pub.add_argument("--delta", type=float, default=500.0, help="δ in metres (500)")
    pub.add_argument("--trash-max", type=float, default=0.1, help="largest trashed fraction of the window (0.1)")
    pub.add_argument("--pi", type=float, default=None, help="NWA time granularity, s (min(60, window/10))")
    pub.add_argument("--parts", type=_positive_int, default=4, help="parts of the window, one Dask task each (4)")
    pub.add_argument("--cells", metavar="FILE", help="cell map for start-cell parts (w4m, microagg)")
    pub.add_argument("--scheduler", metavar="ADDR", help="Dask scheduler (default: an in-process LocalCluster)")
    pub.add_argument("--name", default=None, help="coordinator name in the ledger (hostname-pid)")
    pub.add_argument("--lease-s", type=float, default=300.0, help="lease of a coordinator on a window (300 s)")
    pub.add_argument("--part-rows", type=_positive_int, default=10_000, help="rows per published part (10000)")
    pub.add_argument("--replicas", type=int, choices=(1, 3, 5), default=3, help="replicas of the ledger (3)")
    pub.set_defaults(func=run_publish)


# -- status ---------------------------------------------------------------------------------------
def run_status(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from kcloak.broker.cluster.status import cluster_status

    status = asyncio.run(cluster_status(args.nats, windows=args.windows))
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        print_status(status, rich=sys.stdout.isatty())
    return 0


STREAM_COLUMNS = ("stream", "messages", "bytes", "consumers", "leader", "replicas")
CONSUMER_COLUMNS = ("consumer", "pending", "ack_pending", "pinned")
WINDOW_COLUMNS = ("window_id", "state", "coordinator", "hash", "parts", "n_out", "reason")


def status_tables(status: dict[str, Any]) -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    """The status as ``(title, columns, rows)`` tables of strings (shared by the plain and the rich view)."""

    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    streams = [
        [
            r["stream"],
            *(
                [
                    cell(r["messages"]),
                    cell(r["bytes"]),
                    cell(r["consumers"]),
                    cell(r["leader"]),
                    f"{r['current_replicas']}/{r['replicas']}",
                ]
                if r.get("state") == "ok"
                else ["missing", "-", "-", "-", "-"]
            ),
        ]
        for r in status.get("streams", [])
    ]
    consumers = [[cell(r.get(c)) for c in CONSUMER_COLUMNS] for r in status.get("consumers", [])]
    windows = [[cell(r.get(c)) for c in WINDOW_COLUMNS] for r in status.get("windows", [])]
    return [
        ("streams", STREAM_COLUMNS, streams),
        ("pinned consumers (pending per partition and per cell)", CONSUMER_COLUMNS, consumers),
        ("publication ledger (last windows)", WINDOW_COLUMNS, windows),
    ]


def print_status(status: dict[str, Any], *, rich: bool) -> None:
    tables = status_tables(status)
    if rich:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        for title, columns, rows in tables:
            table = Table(title=title)
            for c in columns:
                table.add_column(c)
            for row in rows:
                table.add_row(*row)
            console.print(table)
        return
    for title, columns, rows in tables:
        print(f"# {title}")
        print(" ".join(columns))
        for row in rows:
            print(" ".join(row))


# -- publish --------------------------------------------------------------------------------------
def run_publish(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from kcloak.broker.cluster.coordinator import CRASH_ENV
    from kcloak.broker.publication import PI_S_MAX, Window
    from kcloak.cli.main import UsageError

    window = Window.parse(args.window)
    if window is None:
        raise UsageError("--window: expected T_START-T_END in whole Unix seconds, T_START < T_END")
    pi_s = args.pi if args.pi is not None else min(PI_S_MAX, (window.t_end - window.t_start) / 10)
    name = args.name or f"{socket.gethostname()}-{os.getpid()}"
    crash_at = os.environ.get(CRASH_ENV) or None
    outcome = asyncio.run(_publish(args, window, pi_s, name, crash_at))
    print(json.dumps(outcome), flush=True)
    return 0 if outcome["state"] == "published" else 1


async def _publish(
    args: argparse.Namespace, window: Any, pi_s: float, name: str, crash_at: str | None
) -> dict[str, Any]:
    import asyncio
    from pathlib import Path

    from kcloak.broker.cluster.coordinator import WindowCoordinator
    from kcloak.broker.cluster.topology import (
        JetStreamApiError,
        Layout,
        connect_nats,
        ensure_publication_layout,
    )
    from kcloak.broker.cluster.windows import anonymize_on_dask, require_dask
    from kcloak.cli.main import UsageError
    from kcloak.cloaking.cells import CellMap
    from kcloak.core.readers import FixTable, read_contract_csv
    from kcloak.streams.partitioned import PartParams
    from kcloak.streams.publish import Release

    distributed = require_dask()
    params = PartParams(method=args.method, k=args.k, delta_m=args.delta, trash_max=args.trash_max, pi_s=pi_s)
    cells = None
    if args.cells:
        try:
            cells = CellMap.from_json(Path(args.cells).read_text(encoding="utf-8"))
        except OSError as exc:
            raise UsageError(f"--cells: cannot read the file ({exc.strerror or type(exc).__name__})") from None
    every = read_contract_csv(args.fixes)  # read before the ledger is touched: a bad file changes nothing
    inside = (every.t >= window.t_start) & (every.t < window.t_end)
    fixes = FixTable(every.traj_id[inside], every.t[inside], every.lat[inside], every.lon[inside], every.bad_rows)

    def compute() -> Release:
        if args.scheduler:
            with distributed.Client(args.scheduler) as client:
                return anonymize_on_dask(client, fixes, params, parts=args.parts, cells=cells)
        with (
            distributed.LocalCluster(
                n_workers=1, threads_per_worker=max(1, args.parts), processes=False, dashboard_address=None
            ) as cluster,
            distributed.Client(cluster) as client,
        ):
            return anonymize_on_dask(client, fixes, params, parts=args.parts, cells=cells)

    async def compute_async() -> Release:
        return await asyncio.to_thread(compute)

    nc = await connect_nats(args.nats)
    try:
        for attempt in range(5):  # a fresh cluster may not place an R3 stream until its peers are current
            try:
                await ensure_publication_layout(nc, Layout(replicas=args.replicas))
                break
            except (JetStreamApiError, TimeoutError):
                if attempt == 4:
                    raise
                await asyncio.sleep(1.0)
        coordinator = WindowCoordinator(
            nc, name=name, lease_s=args.lease_s, crash_at=crash_at, part_rows=args.part_rows
        )
        out = await coordinator.publish(window, compute_async)
    finally:
        await nc.close()
    return {
        "window_id": out.window_id,
        "state": out.state,
        "hash": out.content_hash,
        "parts": out.parts,
        "acted": out.acted,
        "reason": out.reason,
    }


# -- up -------------------------------------------------------------------------------------------
def run_up(args: argparse.Namespace) -> int:
    from kcloak.cli._cluster_up import run_local_cluster

    return run_local_cluster(args)
