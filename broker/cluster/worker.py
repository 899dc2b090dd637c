"""A cluster worker (docs/cluster.md "Workers"): a member of every partition's and every cell's group.

One process per ``kcloak serve --cluster``; several processes = several workers, any of which can die
(``python -m kcloak.cli.cluster_worker`` runs one without a gateway, for tests and benchmarks).
A worker joins the priority group of each ``in-<p>`` consumer (a :class:`~kcloak.broker.cluster.router.Router`)
and of each ``cell-<c>`` consumer (a :class:`~kcloak.broker.cluster.owner.CellOwner`); the server pins each
consumer on one member at a time, and a dead member's consumers go to the others after ``priority_timeout``.

**Balance** (rendezvous hashing done by time): a worker's first pull on consumer ``X`` waits
``spread_s × h(X, name)`` with ``h`` a stable hash in [0, 1), so the worker with the lowest hash pulls first
and is pinned; with workers started together, worker i of N ends up with about P/N partitions and C/N
cells. The others keep a pull waiting as backups. Nothing moves back when a worker joins later.

With ``timer`` (``kcloak serve --cluster`` when ``publish.window_s > 0``) the worker also runs a
:class:`~kcloak.broker.cluster.moves.WindowTimer`: every closed window is published exactly once from
``KCLOAK_MOVES``, by whichever worker wins its ledger key; on Dask when ``dask_scheduler`` is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
from typing import Any

from kcloak.broker.cluster.moves import TimerParams, WindowTimer
from kcloak.broker.cluster.owner import CellOwner, querylog_path
from kcloak.broker.cluster.pinned import install_fast_header_parsing
from kcloak.broker.cluster.router import Router
from kcloak.broker.cluster.topology import Layout, ensure_layout, require_nats
from kcloak.broker.config import Config
from kcloak.broker.metrics import Metrics
from kcloak.broker.stores import QueryLog
from kcloak.broker.upstream import UpstreamClient
from kcloak.cloaking.cells import CellMap

log = logging.getLogger("kcloak.cluster")

DEBUG_STATUS_SUBJECT = "kcloak.debug.status"
"""Core-NATS subject every worker started with ``debug_status=True`` answers with its status and the
subject tokens of the users in its live indexes (for tests and operators; never coordinates)."""


def preference(consumer: str, worker: str) -> float:
    """A stable number in [0, 1) for (consumer, worker): lower = pulls first."""
    digest = hashlib.sha256(f"{consumer}\x00{worker}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    """Routers for every partition and owners for every cell, in one process (:meth:`start` / :meth:`stop`)."""

    def __init__(
        self,
        *,
        servers: list[str],
        layout: Layout,
        cells: CellMap,
        config: Config,
        metrics: Metrics,
        name: str,
        spread_s: float | None = None,
        debug_status: bool = False,
        timer: TimerParams | None = None,
        dask_scheduler: str | None = None,
    ) -> None:
        if cells.cells != layout.cells:
            raise ValueError("the cell map and the layout disagree on the number of cells")
        self.servers = servers
        self.layout = layout
        self.cells = cells
        self.config = config
        self.metrics = metrics
        self.name = name
        self.spread_s = min(2.0, layout.pinned_timeout_s / 2) if spread_s is None else spread_s
        self.debug_status = debug_status
        self.nc: Any = None
        self.routers: list[Router] = []
        self.owners: list[CellOwner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._upstream: UpstreamClient | None = None
        self._querylog: QueryLog | None = None
        self._debug_sub: Any = None
        self.timer_params = timer
        self.dask_scheduler = dask_scheduler
        self.timer: WindowTimer | None = None

    async def start(self) -> None:
        """Connect, create the layout (idempotent), join every partition's and every cell's group."""
        nats = require_nats()
        install_fast_header_parsing()
        self.nc = await nats.connect(
            servers=self.servers,
            name=f"kcloak-worker-{self.name}",
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=2,
            ping_interval=2,
            max_outstanding_pings=2,
        )
        await ensure_layout(self.nc, self.layout)
        self._upstream = UpstreamClient.from_config(self.config.upstream, metrics=self.metrics)
        await self._upstream.__aenter__()
        self._querylog = QueryLog(querylog_path(self.config, self.name))
        owner_seen: dict[int, float] = {}  # one live-owner check per cell and second for all the routers here
        for p in range(self.layout.partitions):
            self.routers.append(
                Router(
                    nc=self.nc,
                    layout=self.layout,
                    cells=self.cells,
                    config=self.config,
                    metrics=self.metrics,
                    partition=p,
                    start_delay_s=self.spread_s * preference(f"in-{p}", self.name),
                    owner_seen=owner_seen,
                )
            )
        for c in range(self.layout.cells):
            self.owners.append(
                CellOwner(
                    nc=self.nc,
                    layout=self.layout,
                    config=self.config,
                    metrics=self.metrics,
                    cell=c,
                    upstream=self._upstream,
                    querylog=self._querylog,
                    start_delay_s=self.spread_s * preference(f"cell-{c}", self.name),
                )
            )
        for member in [r.member for r in self.routers] + [o.member for o in self.owners]:
            self._tasks.append(asyncio.create_task(member.run()))
        if self.timer_params is not None:
            self.timer = WindowTimer(
                self.nc,
                params=self.timer_params,
                name=self.name,
                scheduler=self.dask_scheduler,
                cells=self.cells,
                layout=self.layout,
            )
            self._tasks.append(asyncio.create_task(self.timer.run()))
        if self.debug_status:
            self._debug_sub = await self.nc.subscribe(DEBUG_STATUS_SUBJECT, cb=self._on_debug)

    async def _on_debug(self, msg: Any) -> None:
        if msg.reply:
            body = self.status(users=True)
            await self.nc.publish(msg.reply, json.dumps(body, separators=(",", ":")).encode())

    async def stop(self) -> None:
        """Leave every group (unpin, so a backup takes over at once), drain, close."""
        for task in self._tasks[len(self.routers) + len(self.owners) :]:
            task.cancel()  # the window timer first: a window it held is taken over after its lease
        for owner in self.owners:
            await owner.member.stop(unpin=True)
            await owner.stop()
        for router in self.routers:
            await router.member.stop(unpin=True)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._querylog is not None:
            await asyncio.to_thread(self._querylog.close)
        if self._upstream is not None:
            await self._upstream.__aexit__(None, None, None)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    def status(self, *, users: bool = False) -> dict[str, Any]:
        """``{"name", "partitions": [pinned p…], "cells": [owned c…], counters}``; with ``users`` also the
        subject tokens held by each owned cell (``"users": {c: [token…]}``)."""
        out: dict[str, Any] = {
            "name": self.name,
            "partitions": [r.partition for r in self.routers if r.member.pinned],
            "cells": [o.cell for o in self.owners if o.live],
            "counters": {
                "router": _sum(r.counters for r in self.routers),
                "owner": _sum(o.counters for o in self.owners),
                "pins": _sum([r.member.counters for r in self.routers] + [o.member.counters for o in self.owners]),
            },
        }
        if users:
            out["users"] = {str(o.cell): o.users() for o in self.owners if o.live}
        return out


def _sum(dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total


__all__ = ["DEBUG_STATUS_SUBJECT", "Worker", "default_name", "preference"]
