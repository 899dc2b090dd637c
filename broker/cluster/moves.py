"""The cluster's movement history and window publication on a timer (docs/cluster.md "Window publication").

Every router publishes the **accepted** fixes of a micro-batch to stream ``KCLOAK_MOVES`` as one message
(subject ``kcloak.moves.<p>``, body ``{"m": [[<user token>, t, lat, lon], …]}``, message id
``mv/<p>/<digest of the body>``, so a retry is stored once) in the same PubAck batch as the fixes' cell
events, so an intake message is acknowledged only once its moves are stored too. A rejected fix is never
published there. (Readers also take the earlier one-move body ``{"u", "t", "lat", "lon"}``.)

A window ``[t_start, t_end)`` holds the moves whose **fix time** ``t`` is in it (the single process's
``fixes_between``, so the same fixes make the same window). The stream's own timestamps only bound the read:
a fix is accepted only while ``now ≥ t − max_clock_skew_s``, so no move of the window was stored before
``t_start − max_clock_skew_s`` (:data:`CLOCK_MARGIN_S` more for clocks of different hosts). The window closes
as in the single process: once ``now ≥ t_end + max_update_age_s`` no fix of it can be accepted any more
(``too_old``); :class:`WindowTimer` waits ``grace_s`` more for the last accepted moves' PubAcks, then reads.
A move stored after that (its router's publish retried for longer than ``grace_s``) is not in the window.
A move stored twice (a router's failover) is read once: a user's fix times strictly increase.

:class:`WindowTimer` runs in every worker (``kcloak serve --cluster``) or in ``kcloak cluster publish
--follow``: each closed window, from the one holding the oldest stored move on, goes through
:class:`~kcloak.broker.cluster.coordinator.WindowCoordinator`, whose ledger lets exactly one of the racing
workers publish it (the others get ``WindowBusy`` and try again on the next tick, then find it final).
Anonymization runs on Dask when a scheduler address is given, else in this process (in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kcloak.broker.cluster.codec import encode
from kcloak.broker.cluster.coordinator import WindowBusy, WindowCoordinator, WindowOutcome
from kcloak.broker.cluster.pinned import read_to_end
from kcloak.broker.cluster.topology import MOVES_STREAM, Layout, ensure_publication_layout, moves_filter
from kcloak.broker.config import Config
from kcloak.broker.publication import PI_S_MAX, Window, window_start
from kcloak.cloaking.cells import CellMap
from kcloak.core.logs import log_event
from kcloak.core.readers import FixTable
from kcloak.streams.partitioned import PartParams, anonymize_partitioned
from kcloak.streams.publish import Release

log = logging.getLogger("kcloak.cluster.publication")

CLOCK_MARGIN_S = 60.0
"""Read a window's moves from this long before ``t_start − max_clock_skew_s`` (hosts' clocks differ)."""


def moves_body(moves: list[tuple[str, float, float, float]]) -> bytes:
    """The ``KCLOAK_MOVES`` message of accepted fixes ``(user token, t, lat, lon)``."""
    return encode({"m": moves})


def moves_of(data: bytes) -> list[tuple[str, float, float, float]]:
    """The moves ``(user token, t, lat, lon)`` of one ``KCLOAK_MOVES`` message (either body); raises
    ValueError, KeyError or TypeError on a malformed one."""
    body = json.loads(data)
    if "m" in body:
        return [(str(u), float(t), float(lat), float(lon)) for u, t, lat, lon in body["m"]]
    return [(str(body["u"]), float(body["t"]), float(body["lat"]), float(body["lon"]))]


async def read_window_moves(nc: Any, window: Window, *, read_from: float, timeout_s: float = 60.0) -> FixTable:
    """The window's fixes (``t_start ≤ t < t_end``) from ``KCLOAK_MOVES``, reading the messages stored at or
    after Unix time ``read_from`` up to the stream's end when the read starts; ``traj_id`` = user token."""
    seen: dict[tuple[str, float], tuple[float, float]] = {}
    async for m in read_to_end(
        nc, MOVES_STREAM, moves_filter(), start_time=read_from, timeout_s=timeout_s, what="reading the window's moves"
    ):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            for user, t, lat, lon in moves_of(m.data):
                if window.t_start <= t < window.t_end:
                    seen[(user, t)] = (lat, lon)
    keys = sorted(seen)
    return FixTable(
        np.array([k[0] for k in keys], dtype=str),
        np.array([k[1] for k in keys], dtype=np.float64),
        np.array([seen[k][0] for k in keys], dtype=np.float64),
        np.array([seen[k][1] for k in keys], dtype=np.float64),
    )


async def first_move_t(nc: Any) -> float | None:
    """The fix time of the oldest move still in the stream (None: no move stored)."""
    from nats.js.errors import NotFoundError

    js = nc.jetstream()
    try:
        info = await js.stream_info(MOVES_STREAM)
        if not info.state.messages:
            return None
        msg = await js.get_msg(MOVES_STREAM, seq=int(info.state.first_seq), subject=moves_filter(), next=True)
        return min(t for _, t, _, _ in moves_of(msg.data or b"{}"))
    except (NotFoundError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class TimerParams:
    """What the timer needs of ``[publish]`` and ``[cloaking]`` (``kcloak serve``'s configuration)."""

    window_s: int
    max_update_age_s: float
    max_clock_skew_s: float
    method: str = "nwa"
    k: int = 5
    delta_m: float = 500.0
    trash_max: float = 0.1
    parts: int = 4
    grace_s: float = 2.0

    @property
    def part_params(self) -> PartParams:
        pi_s = min(PI_S_MAX, self.window_s / 10)
        return PartParams(method=self.method, k=self.k, delta_m=self.delta_m, trash_max=self.trash_max, pi_s=pi_s)


def anonymize_window(
    fixes: FixTable, params: PartParams, *, parts: int, cells: CellMap | None, scheduler: str | None
) -> Release:
    """A window's release: on the Dask scheduler at ``scheduler``, else here (blocking: call in a thread)."""
    if scheduler:
        from kcloak.broker.cluster.windows import anonymize_on_dask, require_dask

        distributed = require_dask()
        with distributed.Client(scheduler) as client:
            return anonymize_on_dask(client, fixes, params, parts=parts, cells=cells)
    return anonymize_partitioned(fixes, params, parts=parts, cells=cells)


class WindowTimer:
    """Publishes every closed window from ``KCLOAK_MOVES`` exactly once (module docstring); run :meth:`run`."""

    def __init__(
        self,
        nc: Any,
        *,
        params: TimerParams,
        name: str,
        scheduler: str | None = None,
        cells: CellMap | None = None,
        lease_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        layout: Layout | None = None,
    ) -> None:
        if params.window_s <= 0:
            raise ValueError("window_s: must be > 0")
        self.nc = nc
        self.params = params
        self.name = name
        self.scheduler = scheduler
        self.cells = cells
        self.clock = clock
        self.coordinator = WindowCoordinator(nc, name=name, lease_s=lease_s, clock=clock)
        self.cursor: int | None = None
        self.layout = layout  # the publication layout is ensured on the first tick (retried while it fails)
        self._ensured = layout is None
        self.outcomes: list[WindowOutcome] = []

    def due(self, window: Window) -> bool:
        return self.clock() >= window.t_end + self.params.max_update_age_s + self.params.grace_s

    async def compute(self, window: Window) -> Release:
        p = self.params
        read_from = window.t_start - p.max_clock_skew_s - CLOCK_MARGIN_S
        fixes = await read_window_moves(self.nc, window, read_from=read_from)
        return await asyncio.to_thread(
            anonymize_window, fixes, p.part_params, parts=p.parts, cells=self.cells, scheduler=self.scheduler
        )

    async def step(self) -> list[WindowOutcome]:
        """Every due window from the cursor on (stops at one another coordinator holds: next tick)."""
        w = self.params.window_s
        if not self._ensured:
            assert self.layout is not None
            await ensure_publication_layout(self.nc, self.layout)
            self._ensured = True
        if self.cursor is None:
            first = await first_move_t(self.nc)
            if first is None:
                return []
            self.cursor = window_start(first, w)
        done: list[WindowOutcome] = []
        while self.due(window := Window(self.cursor, self.cursor + w)):
            try:
                out = await self.coordinator.publish(window, functools.partial(self.compute, window))
            except WindowBusy:
                break
            done.append(out)
            self.outcomes.append(out)
            self.cursor = window.t_end
        return done

    def _sleep_s(self, poll_s: float) -> float:
        if self.cursor is None:
            return poll_s
        due = self.cursor + self.params.window_s + self.params.max_update_age_s + self.params.grace_s
        return max(0.05, min(poll_s, due - self.clock()))

    async def run(self, *, poll_s: float = 1.0) -> None:
        """Publish due windows until cancelled; failures are logged and retried on the next tick."""
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never take the worker down; the window is retried
                log_event(log, "window_timer_failed", logging.WARNING, error=type(exc).__name__)
            await asyncio.sleep(self._sleep_s(poll_s))


def moves_max_age_s(window_s: int, max_update_age_s: float, windows: int = 4) -> float:
    """``KCLOAK_MOVES``'s ``max_age``: a few publication windows (and the lateness), so a window can still be
    read after a worker restart or a lease takeover."""
    return float(windows * (max(1, window_s) + math.ceil(max_update_age_s)))


def timer_params(config: Config, *, parts: int = 4, grace_s: float = 2.0) -> TimerParams | None:
    """The timer of ``kcloak serve --cluster``'s configuration (None: ``publish.window_s`` is 0, publication off)."""
    pub = config.publish
    if pub.window_s <= 0:
        return None
    return TimerParams(
        window_s=pub.window_s,
        max_update_age_s=config.cloaking.max_update_age_s,
        max_clock_skew_s=config.cloaking.max_clock_skew_s,
        method=pub.method,
        k=pub.k,
        delta_m=pub.delta_m,
        trash_max=pub.trash_max,
        parts=parts,
        grace_s=grace_s,
    )


__all__ = [
    "CLOCK_MARGIN_S",
    "TimerParams",
    "WindowTimer",
    "anonymize_window",
    "first_move_t",
    "moves_body",
    "moves_max_age_s",
    "moves_of",
    "read_window_moves",
    "timer_params",
]
