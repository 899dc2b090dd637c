"""``python -m kcloak.cli.cluster_worker``: one cluster worker without a gateway (tests, benchmarks).

The worker of docs/cluster.md "Workers" (:class:`kcloak.broker.cluster.worker.Worker`): routers for every
intake partition and owners for every cell; ``kcloak serve --cluster`` runs the same worker behind its
gateway. Prints ``worker_started`` once it has joined every group; SIGTERM or Ctrl-C stops it (unpinning).
With ``KCLOAK_WORKER_PROFILE=FILE`` in the environment it writes a cProfile of its run there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
from pathlib import Path

from kcloak.broker.cluster.moves import moves_max_age_s, timer_params
from kcloak.broker.cluster.topology import Layout
from kcloak.broker.cluster.worker import Worker, default_name
from kcloak.broker.config import Config
from kcloak.broker.metrics import Metrics
from kcloak.cloaking.cells import CellMap


async def _main(args: argparse.Namespace) -> None:
    cells = CellMap.from_json(Path(args.cells).read_text()) if args.cells else CellMap([])
    layout = Layout(
        partitions=args.partitions,
        cells=cells.cells,
        replicas=args.replicas,
        pinned_timeout_s=args.pinned_timeout,
        moves_max_age_s=moves_max_age_s(args.publish_window_s or 900, args.max_update_age_s),
    )
    config = Config()
    config = dataclasses.replace(
        config,
        upstream=dataclasses.replace(config.upstream, url=args.upstream),
        storage=dataclasses.replace(config.storage, data_dir=args.data_dir),
        cloaking=dataclasses.replace(config.cloaking, max_update_age_s=args.max_update_age_s),
        publish=dataclasses.replace(
            config.publish, window_s=args.publish_window_s, k=args.publish_k, delta_m=args.publish_delta_m
        ),
    )
    metrics = Metrics(version="cluster", algorithm=config.cloaking.algorithm)
    worker = Worker(
        servers=args.servers.split(","),
        layout=layout,
        cells=cells,
        config=config,
        metrics=metrics,
        name=args.name,
        debug_status=args.debug_status,
        timer=timer_params(config, grace_s=args.publish_grace_s),
        dask_scheduler=args.dask_scheduler,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    print("worker_started", flush=True)
    await stop.wait()
    await worker.stop()


def main(argv: list[str] | None = None) -> None:
    """Parse the options and run one worker until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(prog="kcloak-cluster-worker")
    parser.add_argument("--servers", required=True)
    parser.add_argument("--cells", default="")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--pinned-timeout", type=float, default=5.0)
    parser.add_argument("--upstream", default="http://127.0.0.1:8471")
    parser.add_argument("--data-dir", default="./kcloak-data")
    parser.add_argument("--name", default=default_name())
    parser.add_argument("--debug-status", action="store_true")
    parser.add_argument("--publish-window-s", type=int, default=0, help="window publication on a timer (0: off)")
    parser.add_argument("--publish-k", type=int, default=5)
    parser.add_argument("--publish-delta-m", type=float, default=500.0)
    parser.add_argument("--publish-grace-s", type=float, default=2.0)
    parser.add_argument("--max-update-age-s", type=float, default=120.0)
    parser.add_argument("--dask-scheduler", default=None)
    profile_path = os.environ.get("KCLOAK_WORKER_PROFILE")
    if not profile_path:
        asyncio.run(_main(parser.parse_args(argv)))
        return
    import cProfile  # measuring where a worker's CPU goes (scripts/bench_worker.py --profile)

    with cProfile.Profile() as prof:
        asyncio.run(_main(parser.parse_args(argv)))
    prof.dump_stats(profile_path)


if __name__ == "__main__":
    main()


__all__ = ["main"]
