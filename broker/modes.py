"""Cloaking modes: how a query's region is obtained, chosen by the cloaker's declared ``cloak_mode``.

- :class:`SnapshotCloaking` (:attr:`CloakMode.SNAPSHOT`): a cloak worker serves every query
  waiting at once from one immutable view taken after each of their fixes was applied
  (micro-batching with ``cloak_batch`` when the cloaker declares ``vectorized``);
- :class:`HeldCloaking` (:attr:`CloakMode.HELD`, CliqueCloak): the query is held until a clique
  of senders forms or its deadline passes (one timer for the whole pool, CONCEPTS §5.2);
- :class:`TemporalCloaking` (:attr:`CloakMode.TEMPORAL`): the query is held until k users
  visited its cell (CONCEPTS §5.1).

Each reads the positions through :class:`~kcloak.broker.positions.PositionReader` only, and
takes a user and its effective profile: no fix intake, no query parsing, no upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from kcloak.broker.config import CloakingConfig, QueuesConfig
from kcloak.broker.forwarding import Timing
from kcloak.broker.history import RecentFixes
from kcloak.broker.metrics import Metrics
from kcloak.broker.positions import PositionReader
from kcloak.cloaking.cloakers import REFUSAL_MESSAGES, Cloaker, CloakMode, Refusal, Region, cloaker_class
from kcloak.cloaking.cloakers.clique import CliqueCloak, CliqueRelease, CliqueRequest
from kcloak.cloaking.index import IndexView
from kcloak.cloaking.temporal import TemporalCloak
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

log = logging.getLogger("kcloak.pipeline")

BATCH_MIN = 16
"""Waiting queries from which the cloak worker uses the vectorized ``cloak_batch``."""
HISTORY_MARGIN_S = 600.0
"""Recent fixes are kept this much longer than the look-back and the maximum fix age."""


@dataclass(frozen=True, slots=True)
class Cloaked:
    """A region ready to forward, with the view it was cloaked (or counted) on (None for a
    temporal one) and the querier's position the results are filtered against."""

    region: Region
    view: IndexView | None
    lat: float
    lon: float


class QueryCloaking(Protocol):
    """One way of cloaking queries (a mode). ``run`` is its worker or timer, until cancelled."""

    cloak_mode: ClassVar[CloakMode]
    algorithm: str
    supports_l: bool
    continuous_refusal: str | None
    """Why a continuous query cannot start a session in this mode; None when it can."""
    lost_group: ReasonCode
    """The refusal when a session's first region no longer holds the querier and k users."""

    def full(self) -> bool:
        """True while a new query cannot be queued (``overloaded``)."""
        ...

    async def cloak(self, user: str, profile: PrivacyProfile, timing: Timing) -> Cloaked | Refusal: ...

    async def run(self) -> None: ...


def build_cloaker(algorithm: str, *, cloaking: CloakingConfig, places: PlacesLayer | None = None) -> Any:
    """The cloaker of ``cloaking.algorithm`` (a cloaker that declares ``supports_l`` gets ``places``)."""
    if algorithm == TemporalCloak.name:
        return TemporalCloak(lookback_s=cloaking.temporal_lookback_s)
    cls = cloaker_class(algorithm)
    return cls(places=places) if cls.supports_l and places is not None else cls()


def history_for(cloaker: Any, cloaking: CloakingConfig) -> RecentFixes | None:
    """The recent-fix history a cloaker's mode reads (only :attr:`CloakMode.TEMPORAL` reads one)."""
    if cloaker.cloak_mode is not CloakMode.TEMPORAL:
        return None
    return RecentFixes(cloaking.temporal_lookback_s + HISTORY_MARGIN_S + cloaking.max_update_age_s)


class Views:
    """Immutable index views, shared by every query: a new one when a query needs fixes the
    current one lacks, or after a second (CONCEPTS §2.4)."""

    def __init__(self, *, positions: PositionReader, metrics: Metrics, clock: Callable[[], float] = time.time) -> None:
        self.positions = positions
        self.metrics = metrics
        self.clock = clock
        self._view: IndexView | None = None
        self._view_version = -1
        self._view_t = -math.inf
        self._epoch = 0

    def fresh(self, needed_version: int) -> IndexView:
        """A view holding at least the fixes of version ``needed_version``."""
        now = self.clock()
        if self._view is None or self._view_version < needed_version or now - self._view_t > 1.0:
            self._epoch += 1
            self._view = self.positions.snapshot(now, epoch=self._epoch, seed=self._epoch)
            self._view_version = self.positions.version
            self._view_t = now
            self.metrics.users_present.set(len(self._view))
        return self._view

    def latest(self) -> IndexView:
        """A view holding every fix applied so far."""
        return self.fresh(self.positions.version)


def serving_mode(
    cloaker: Any, *, positions: PositionReader, views: Views, metrics: Metrics, queues: QueuesConfig
) -> QueryCloaking:
    """The mode the cloaker declares, serving its queries."""
    match cloaker.cloak_mode:
        case CloakMode.SNAPSHOT:
            return SnapshotCloaking(cloaker, positions=positions, views=views, metrics=metrics, capacity=queues.cloak)
        case CloakMode.HELD:
            return HeldCloaking(cloaker, positions=positions, views=views, metrics=metrics, capacity=queues.hold)
        case CloakMode.TEMPORAL:
            return TemporalCloaking(cloaker, positions=positions, views=views, metrics=metrics, capacity=queues.hold)
    raise ValueError("cloaker: unknown mode")


@dataclass(slots=True)
class _CloakJob:
    user: str
    profile: PrivacyProfile
    needed_version: int
    future: asyncio.Future[tuple[Region | Refusal, IndexView]]


class SnapshotCloaking:
    """Snapshot cloakers behind a bounded queue and one cloak worker (:meth:`run`) that serves
    every waiting query from one view (micro-batching)."""

    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    continuous_refusal: str | None = None
    lost_group = ReasonCode.K_UNREACHABLE

    def __init__(
        self, cloaker: Cloaker, *, positions: PositionReader, views: Views, metrics: Metrics, capacity: int
    ) -> None:
        self.cloaker = cloaker
        self.algorithm = cloaker.name
        self.supports_l = cloaker.supports_l
        self.positions = positions
        self.views = views
        self.metrics = metrics
        self._queue: asyncio.Queue[_CloakJob] = asyncio.Queue(maxsize=capacity)
        metrics.queue_depth.labels(queue="cloak").set_function(self._queue.qsize)  # read when scraped

    def full(self) -> bool:
        return self._queue.full()

    async def cloak(self, user: str, profile: PrivacyProfile, timing: Timing) -> Cloaked | Refusal:
        fut: asyncio.Future[tuple[Region | Refusal, IndexView]] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait(_CloakJob(user, profile, self.positions.user_version(user), fut))
        except asyncio.QueueFull:
            return Refusal(ReasonCode.OVERLOADED, "the cloaking queue is full")
        result, view = await fut
        if isinstance(result, Refusal):
            return result
        fix = self.positions.fix(user)
        assert fix is not None
        return Cloaked(result, view, fix[0], fix[1])

    async def run(self) -> None:
        """The cloak worker; runs until cancelled."""
        while True:
            job = await self._queue.get()
            jobs = [job]
            while not self._queue.empty() and len(jobs) < 4096:
                jobs.append(self._queue.get_nowait())
            self._cloak_jobs(jobs)

    def _cloak_jobs(self, jobs: list[_CloakJob]) -> None:
        view = self.views.fresh(max(j.needed_version for j in jobs))
        if len(jobs) >= BATCH_MIN and self.cloaker.vectorized:
            jobs = self._cloak_batched(view, jobs)
        for job in jobs:
            if job.future.done():
                continue
            started = time.perf_counter()
            row = view.row(job.user)
            result: Region | Refusal
            if row is None:
                result = Refusal(ReasonCode.STALE_POSITION, REFUSAL_MESSAGES[ReasonCode.STALE_POSITION])
            else:
                try:
                    result = self.cloaker.cloak(view, row, job.profile)
                except Exception:
                    log.exception("cloak_failed", extra={"kcloak_fields": {"algorithm": self.algorithm}})
                    result = Refusal(ReasonCode.INTERNAL, "internal error")
            self.metrics.cloak_seconds.labels(algorithm=self.algorithm).observe(time.perf_counter() - started)
            job.future.set_result((result, view))

    def _cloak_batched(self, view: IndexView, jobs: list[_CloakJob]) -> list[_CloakJob]:
        """Micro-batch: cloak every waiting plain query with one ``cloak_batch`` call; returns the
        jobs left for one-by-one handling (no present position, or l > 1)."""
        rest: list[_CloakJob] = []
        batch: list[tuple[_CloakJob, int]] = []
        for job in jobs:
            row = view.row(job.user)
            if row is None or job.profile.l > 1 or job.future.done():
                rest.append(job)
            else:
                batch.append((job, row))
        if not batch:
            return rest
        started = time.perf_counter()
        try:
            rows = np.fromiter((r for _, r in batch), np.int64, len(batch))
            result = self.cloaker.cloak_batch(view, rows, ProfileArrays.from_profiles([j.profile for j, _ in batch]))
        except Exception:
            log.exception("cloak_batch_failed", extra={"kcloak_fields": {"algorithm": self.algorithm}})
            return rest + [j for j, _ in batch]
        per_query = (time.perf_counter() - started) / len(batch)
        hist = self.metrics.cloak_seconds.labels(algorithm=self.algorithm)
        for i, (job, _) in enumerate(batch):
            hist.observe(per_query)
            job.future.set_result((result[i], view))
        return rest


class HeldCloaking:
    """CliqueCloak (CONCEPTS §4.5, §5.2): each query is held until a clique of senders forms or its
    deadline passes; :meth:`run` is the one timer that expires the pool."""

    cloak_mode: ClassVar[CloakMode] = CloakMode.HELD
    continuous_refusal: str | None = None
    lost_group = ReasonCode.EXPIRED

    def __init__(
        self, clique: CliqueCloak, *, positions: PositionReader, views: Views, metrics: Metrics, capacity: int
    ) -> None:
        self.clique = clique
        self.algorithm = clique.name
        self.supports_l = clique.supports_l
        self.positions = positions
        self.views = views
        self.metrics = metrics
        self.capacity = capacity
        self._held: dict[str, asyncio.Future[CliqueRelease | None]] = {}
        self._wakeup = asyncio.Event()

    def full(self) -> bool:
        return False  # the hold pool refuses in cloak(), after the checks that come first

    async def cloak(self, user: str, profile: PrivacyProfile, timing: Timing) -> Cloaked | Refusal:
        if len(self._held) >= self.capacity:
            return Refusal(ReasonCode.OVERLOADED, "the hold queue is full")
        fix = self.positions.fix(user)
        assert fix is not None
        rid = secrets.token_hex(16)
        request = CliqueRequest.from_profile(rid, user, fix[0], fix[1], time.monotonic(), profile)
        fut: asyncio.Future[CliqueRelease | None] = asyncio.get_running_loop().create_future()
        self._held[rid] = fut
        started = time.monotonic()
        for formed in self.clique.submit(request, started):
            for member in formed.members:
                waiting = self._held.pop(member.request_id, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(formed)
        self._wakeup.set()
        self.metrics.queue_depth.labels(queue="hold").set(len(self._held))
        try:
            release = await fut
        finally:
            self._held.pop(rid, None)
            held = time.monotonic() - started
            timing.hold += held
            self.metrics.hold_seconds.labels(algorithm=self.algorithm).observe(held)
            self.metrics.queue_depth.labels(queue="hold").set(len(self._held))
        if release is None:
            return Refusal(ReasonCode.EXPIRED, "no clique formed within max_delay_s")
        view = self.views.latest()
        region = Region(
            bbox=release.bbox,
            k_achieved=view.count_in(release.bbox),
            area_m2=release.area_m2,
            algorithm=self.algorithm,
            epoch=view.epoch,
        )
        if region.k_achieved < profile.k:
            return Refusal(ReasonCode.EXPIRED, "the clique's members are no longer present")
        now_fix = self.positions.fix(user)
        assert now_fix is not None
        return Cloaked(region, view, now_fix[0], now_fix[1])

    async def run(self) -> None:
        """Refuse held requests whose deadline passed (one timer for the whole pool, §5.2)."""
        while True:
            deadline = self.clique.next_deadline()
            self._wakeup.clear()
            if deadline is None:
                await self._wakeup.wait()
                continue
            delay = max(0.0, deadline - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wakeup.wait()
            for request in self.clique.expire(time.monotonic()):
                fut = self._held.pop(request.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)


class TemporalCloaking:
    """Gruteser–Grunwald temporal cloaking (CONCEPTS §5.1, §5.2): hold the query until k distinct
    users had a fix inside its cell during [t_start, t_end], forward at ``t_end``, or expire."""

    cloak_mode: ClassVar[CloakMode] = CloakMode.TEMPORAL
    continuous_refusal: str | None = "temporal cloaking cannot hold a continuous session"
    lost_group = ReasonCode.K_UNREACHABLE

    def __init__(
        self, temporal: TemporalCloak, *, positions: PositionReader, views: Views, metrics: Metrics, capacity: int
    ) -> None:
        self.temporal = temporal
        self.algorithm = temporal.name
        self.supports_l = temporal.supports_l
        self.positions = positions
        self.views = views
        self.metrics = metrics
        self.capacity = capacity
        self._held = 0

    def full(self) -> bool:
        return False  # the hold pool refuses in cloak(), after the checks that come first

    async def cloak(self, user: str, profile: PrivacyProfile, timing: Timing) -> Cloaked | Refusal:
        history = self.positions.history
        assert history is not None
        clock = self.views.clock
        if self._held >= self.capacity:
            return Refusal(ReasonCode.OVERLOADED, "the hold queue is full")
        fix = self.positions.fix(user)
        assert fix is not None
        lat, lon, t_fix = fix
        cell = self.temporal.cell(lat, lon, profile)
        if isinstance(cell, Refusal):
            return cell
        started = time.monotonic()
        deadline = started + profile.max_delay_s
        self._held += 1
        self.metrics.queue_depth.labels(queue="hold").set(self._held)
        try:
            while True:
                window = self.temporal.window(history, cell.bbox, t_fix, profile.k, until=clock())
                if window.t_end is not None:
                    wait = window.t_end - clock()
                    if time.monotonic() + max(wait, 0.0) > deadline:
                        break
                    if wait > 0:
                        await asyncio.sleep(wait)
                    final = self.temporal.window(history, cell.bbox, t_fix, profile.k, until=window.t_end)
                    region = Region(
                        bbox=cell.bbox,
                        k_achieved=final.k_achieved,
                        area_m2=cell.area_m2,
                        algorithm=self.algorithm,
                        t_start=final.t_start,
                        t_end=final.t_end,
                    )
                    self._held_for(started, timing)
                    return Cloaked(region, None, lat, lon)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.sleep(min(0.25, remaining))
        finally:
            self._held -= 1
            self.metrics.queue_depth.labels(queue="hold").set(self._held)
        self._held_for(started, timing)
        return Refusal(ReasonCode.EXPIRED, "fewer than k users visited the region in time")

    def _held_for(self, started: float, timing: Timing) -> None:
        held = time.monotonic() - started
        timing.hold += held
        self.metrics.hold_seconds.labels(algorithm=self.algorithm).observe(held)

    async def run(self) -> None:
        """Nothing to run: each held query keeps its own time."""
        return


__all__ = [
    "BATCH_MIN",
    "Cloaked",
    "HeldCloaking",
    "QueryCloaking",
    "SnapshotCloaking",
    "TemporalCloaking",
    "Views",
    "build_cloaker",
    "history_for",
    "serving_mode",
]
