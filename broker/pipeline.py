"""The one pipeline behind both doors (MQTT and HTTP): fixes, profiles and queries.

Fixes: validate (contract §1 order) → write ahead to the movement store → apply to the
position index. Queries: duplicate → schema → shutdown → rate limits → overload → sessions →
effective profile → carried position → presence → support → cloak → upstream → exact
filtering → exactly one answer (contract §2). Cloaking reads immutable index views (CONCEPTS
§2.4); a cloak worker serves every query waiting at once from one view, taken after each of
their fixes was applied (micro-batching).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import sqlite3
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kcloak.broker.config import Config
from kcloak.broker.errors import BrokerError
from kcloak.broker.history import RecentFixes
from kcloak.broker.metrics import Metrics
from kcloak.broker.ratelimit import DedupWindow, TokenBuckets
from kcloak.broker.sessions import Session, SessionState, SessionTable, session_status
from kcloak.broker.stores import MovementStore, ProfileStore, QueryLog, StoredProfile, StoreError
from kcloak.broker.upstream import Candidate, SearchRequest, UpstreamClient, UpstreamError
from kcloak.cloaking.cloakers import Refusal, Region, get_cloaker
from kcloak.cloaking.cloakers.clique import CliqueCloak, CliqueRelease, CliqueRequest
from kcloak.cloaking.continuous import SessionError, SharedGroup, ends_session
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.cloaking.temporal import temporal_cell, temporal_window
from kcloak.core.geometry import haversine_m
from kcloak.core.logs import log_event
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ProfileError, ReasonCode
from kcloak.wire.payloads import Fix, InvalidInput, Query, parse_fix, parse_query

log = logging.getLogger("kcloak.pipeline")

MAX_RANGE_RESULTS = 1000
SNAPSHOT_ALGORITHMS = ("nn", "interval", "casper", "hilbert", "privacygrid")
BATCH_ALGORITHMS = ("nn", "interval", "casper", "hilbert")
BATCH_MIN = 16
"""Waiting queries from which the cloak worker uses the vectorized ``cloak_batch``."""
FIX_CHUNK = 500
"""Most fixes of one batch handled in one event-loop turn (:meth:`Pipeline.submit_fix_batch`)."""


class Duplicate(BrokerError):
    """The ``query_id`` was already used by this user within the dedup window."""


class QueryRejected(BrokerError):
    """A query refused before it entered the pipeline proper (HTTP error statuses)."""

    def __init__(self, code: ReasonCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(slots=True)
class _CloakJob:
    user: str
    profile: PrivacyProfile
    needed_version: int
    future: asyncio.Future[tuple[Region | Refusal, IndexView | None]]


@dataclass(slots=True)
class QueryOutcome:
    """The one answer of a query, and what the transports need to report it."""

    answer: dict[str, Any]
    kind_label: str
    status: str
    reason: str


@dataclass(slots=True)
class FixResult:
    """Per-item outcome of a batch of fixes: ``None`` = accepted, else a reason code."""

    codes: list[ReasonCode | None] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(1 for c in self.codes if c is None)


def _now() -> float:
    return time.time()


class Pipeline:
    """Business logic of the broker; transports call :meth:`submit_fixes`, :meth:`set_profile`,
    :meth:`get_profile` and :meth:`query`. Owned and torn down by :class:`kcloak.broker.service.Broker`."""

    def __init__(
        self,
        *,
        config: Config,
        metrics: Metrics,
        profiles: ProfileStore,
        movement: MovementStore,
        querylog: QueryLog,
        upstream: UpstreamClient,
        places: PlacesLayer | None = None,
        clock: Callable[[], float] = _now,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.profiles = profiles
        self.movement = movement
        self.querylog = querylog
        self.upstream = upstream
        self.clock = clock
        self.algorithm = config.cloaking.algorithm
        self.default_profile = config.profile.to_profile()
        self.index = PositionIndex(stale_after_s=config.cloaking.stale_after_s, default_profile=self.default_profile)
        params: dict[str, Any] = {}
        if self.algorithm == "privacygrid" and places is not None:
            params["places"] = places
        self.cloaker = get_cloaker(self.algorithm, **params) if self.algorithm in SNAPSHOT_ALGORITHMS else None
        self.clique: CliqueCloak | None = CliqueCloak() if self.algorithm == "clique" else None
        self.history: RecentFixes | None = None
        if self.algorithm == "temporal":
            self.history = RecentFixes(config.cloaking.temporal_lookback_s + 600.0 + config.cloaking.max_update_age_s)
        self._temporal_held = 0
        self._held: dict[str, asyncio.Future[CliqueRelease | None]] = {}
        self._hold_wakeup = asyncio.Event()
        self._stored: dict[str, StoredProfile] = dict(profiles.all())
        for user, sp in self._stored.items():
            self.index.set_profile(user, sp.profile)
        lim = config.limits
        self._update_buckets = TokenBuckets(lim.update_rate, lim.update_burst)
        self._query_buckets = TokenBuckets(lim.query_rate, lim.query_burst)
        self._profile_buckets = TokenBuckets(lim.profile_rate, lim.profile_burst)
        self._dedup = DedupWindow(lim.dedup_window_s)
        self._pending_per_user: dict[str, int] = {}
        self._last_t: dict[str, float] = {}
        self._batch_order = asyncio.Lock()  # submit_fix_batch: batches are validated in arrival order
        self._fixes_in_flight: dict[str, set[asyncio.Task[FixResult]]] = {}
        """Per user, the fix submissions received and not yet decided (:meth:`enqueue_fixes`)."""
        self._user_version: dict[str, int] = {}
        self._version = 0
        self._view: IndexView | None = None
        self._view_version = -1
        self._view_t = -math.inf
        self._epoch = 0
        self._cloak_queue: asyncio.Queue[_CloakJob] = asyncio.Queue(maxsize=config.queues.cloak)
        self._inflight: set[asyncio.Task[QueryOutcome]] = set()
        self._bg_tasks: set[asyncio.Task[None]] = set()
        self.closing = False
        sc = config.sessions
        self.sessions = SessionTable(
            metrics=metrics, clock=clock, idle_s=sc.idle_s, max_s=sc.max_s, per_user=sc.per_user
        )
        self.sessions.on_expired = self._session_expired
        self.session_status: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None
        """Publishes a session status message (``kind: session``) to a user; set when MQTT is configured."""
        self.retention_floor: Callable[[], float | None] | None = None
        """Fixes at or after the time this returns are never deleted (set by trajectory publication)."""
        for name in ("ingest", "cloak", "hold", "upstream", "store"):
            metrics.queue_capacity.labels(queue=name).set(getattr(config.queues, name))

    # -- lifecycle -----------------------------------------------------------------------------
    def restore_positions(self) -> int:
        """Reload the latest fixes of users still present from the movement store (after a restart)."""
        since = self.clock() - self.config.cloaking.stale_after_s
        n = 0
        for user, t, lat, lon in self.movement.latest_per_user(since):
            self.index.update(user, lat, lon, t)
            self._last_t[user] = t
            n += 1
        if self.history is not None:
            for user, t, lat, lon in self.movement.fixes_between(self.clock() - self.history.keep_s, math.inf):
                self.history.append(user, t, lat, lon)
        self._version += 1
        return n

    async def run_workers(self) -> None:
        """The cloak worker; runs until cancelled."""
        while True:
            job = await self._cloak_queue.get()
            jobs = [job]
            while not self._cloak_queue.empty() and len(jobs) < 4096:
                jobs.append(self._cloak_queue.get_nowait())
            self._cloak_jobs(jobs)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_done)

    def _bg_done(self, task: asyncio.Task[None]) -> None:
        self._bg_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(log, "store_write_failed", logging.ERROR, store="querylog")

    def begin_shutdown(self) -> None:
        self.closing = True

    async def drain(self, grace_s: float) -> None:
        """Let in-flight queries finish within ``grace_s``; the rest are answered ``shutdown``."""
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        if self._bg_tasks:
            await asyncio.wait(set(self._bg_tasks), timeout=5.0)

    # -- fixes ---------------------------------------------------------------------------------
    async def submit_fixes(self, transport: str, items: list[tuple[str, Any]], *, source: str = "update") -> FixResult:
        """Validate, durably store and apply fixes; each item is ``(user, fix object or Fix)``."""
        now = self.clock()
        cfg = self.config.cloaking
        result = FixResult([None] * len(items))
        accepted: list[tuple[int, str, Fix]] = []
        previous: dict[str, float | None] = {}
        for i, (user, raw) in enumerate(items):
            code = self._check_fix(user, raw, now, cfg.max_clock_skew_s, cfg.max_update_age_s)
            if isinstance(code, ReasonCode):
                result.codes[i] = code
                continue
            accepted.append((i, user, code))
            previous.setdefault(user, self._last_t.get(user))
            self._last_t[user] = code.t
        if accepted and not self.movement.writer.try_reserve(len(accepted)):
            for i, _, _ in accepted:
                result.codes[i] = ReasonCode.OVERLOADED
            accepted = []
            self._restore_last_t(previous)
        if accepted:
            try:
                await self.movement.append(((u, f.t, f.lat, f.lon) for _, u, f in accepted), reserved=True)
            except Exception:
                log_event(log, "store_write_failed", logging.ERROR, store="movement", fixes=len(accepted))
                for i, _, _ in accepted:
                    result.codes[i] = ReasonCode.OVERLOADED
                accepted = []
                self._restore_last_t(previous)
            self._version += 1
            for _, user, fix in accepted:
                self.index.update(user, fix.lat, fix.lon, fix.t)
                self._user_version[user] = self._version
                if self.history is not None:
                    self.history.append(user, fix.t, fix.lat, fix.lon)
        n_ok = sum(1 for outcome in result.codes if outcome is None)
        if n_ok:
            self.metrics.updates_accepted.labels(transport=transport, source=source).inc(n_ok)
        if n_ok != len(result.codes):
            for outcome in result.codes:
                if outcome is not None:
                    self.metrics.updates_rejected.labels(transport=transport, reason=outcome.value).inc()
        self.metrics.users_indexed.set(len(self.index))
        return result

    async def submit_fix_batch(self, transport: str, items: list[tuple[str, Any]]) -> FixResult:
        """:meth:`submit_fixes` for a batch message of any size: handed over :data:`FIX_CHUNK` fixes
        per event-loop turn, so that queries and answers arriving meanwhile are not held up behind
        thousands of fixes. Batches are validated in the order they arrive, every chunk of one
        before any of the next (a later, smaller batch of the same users never overtakes the rest
        of a large one), and committed and applied in that order (the store has one writer, first
        in first out), so the outcome of a batch is that of one call."""
        chunks: list[asyncio.Task[FixResult]] = []
        async with self._batch_order:  # first come, first served (asyncio's lock wakes waiters in order)
            for start in range(0, len(items), FIX_CHUNK):
                if chunks:
                    await asyncio.sleep(0)
                chunks.append(asyncio.create_task(self.submit_fixes(transport, items[start : start + FIX_CHUNK])))
        results = await asyncio.gather(*chunks)
        return FixResult([code for r in results for code in r.codes])

    def enqueue_fixes(
        self, transport: str, items: list[tuple[str, Any]], *, batch: bool = False, source: str = "update"
    ) -> asyncio.Task[FixResult]:
        """Submit fixes as they are received, without waiting: :meth:`submit_fix_batch` when
        ``batch``, else :meth:`submit_fixes`. The task resolves when every fix is decided (accepted,
        i.e. committed and applied, or rejected). Until then a query of any of these users waits for
        them (:meth:`_own_fixes_decided`), so a query sees every fix of its user that was received
        before it, whatever the transport and whatever the size of the message that carried it."""
        coro = self.submit_fix_batch(transport, items) if batch else self.submit_fixes(transport, items, source=source)
        task = asyncio.create_task(coro)
        users = {user for user, _ in items}
        for user in users:
            self._fixes_in_flight.setdefault(user, set()).add(task)

        def decided(done: asyncio.Task[FixResult]) -> None:
            for user in users:
                tasks = self._fixes_in_flight.get(user)
                if tasks is not None:
                    tasks.discard(done)
                    if not tasks:
                        del self._fixes_in_flight[user]

        task.add_done_callback(decided)
        return task

    async def _own_fixes_decided(self, user: str) -> None:
        """Wait until the fixes of ``user`` received before now are decided (later ones are not
        waited for, so a steady stream of fixes never holds a query up)."""
        tasks = self._fixes_in_flight.get(user)
        if tasks:
            await asyncio.wait(set(tasks))

    def _restore_last_t(self, previous: dict[str, float | None]) -> None:
        for user, t in previous.items():
            if t is None:
                self._last_t.pop(user, None)
            else:
                self._last_t[user] = t

    def _check_fix(self, user: str, raw: Any, now: float, skew_s: float, max_age_s: float) -> Fix | ReasonCode:
        if self.closing:
            return ReasonCode.SHUTDOWN
        if isinstance(raw, Fix):
            fix = raw
        else:
            try:
                fix, _ = parse_fix(raw)
            except InvalidInput:
                return ReasonCode.INVALID
        if fix.t > now + skew_s:
            return ReasonCode.INVALID
        if fix.t < now - max_age_s:
            return ReasonCode.TOO_OLD
        last = self._last_t.get(user)
        if last is not None and fix.t <= last:
            return ReasonCode.OUT_OF_ORDER
        if not self._update_buckets.take(user):
            return ReasonCode.RATE_LIMITED
        return fix

    # -- profiles ------------------------------------------------------------------------------
    def get_profile(self, user: str) -> tuple[PrivacyProfile, str, float | None]:
        sp = self._stored.get(user)
        if sp is None:
            return self.default_profile, "default", None
        return sp.profile, "stored", sp.updated_t

    def profile_rate_ok(self, user: str) -> bool:
        return self._profile_buckets.take(user)

    async def set_profile(self, user: str, data: dict[str, Any] | None) -> PrivacyProfile:
        """Replace (or with ``None`` reset) the stored profile; raises :class:`ProfileError`."""
        if data is None:
            await asyncio.to_thread(self.profiles.delete, user)
            self._stored.pop(user, None)
            self.index.set_profile(user, None)
            return self.default_profile
        profile = PrivacyProfile.from_mapping(data, self.default_profile)
        t = self.clock()
        await asyncio.to_thread(self.profiles.put, user, profile, t)
        self._stored[user] = StoredProfile(profile, t)
        self.index.set_profile(user, profile)
        return profile

    # -- queries -------------------------------------------------------------------------------
    def admit(self, user: str, obj: dict[str, Any]) -> str:
        """The checks a transport needs before it can promise an answer: the ``query_id`` and
        duplicates. Returns the query id; raises :class:`QueryRejected` or :class:`Duplicate`."""
        qid = obj.get("query_id")
        if not isinstance(qid, str) or not qid or len(qid) > 64:
            raise QueryRejected(ReasonCode.INVALID, "query_id: required, 1-64 chars of [A-Za-z0-9._:-]", "query_id")
        try:
            parse_query({"query_id": qid, "kind": "knn", "n": 1})
        except InvalidInput as exc:
            raise QueryRejected(ReasonCode.INVALID, str(exc), "query_id") from None
        if not self._dedup.first_time(user, qid):
            raise Duplicate(qid)
        return qid

    async def query(self, transport: str, user: str, query_id: str, obj: dict[str, Any]) -> QueryOutcome:
        """Run an admitted query to its one answer. Never raises; cancellation of the caller does
        not stop the query (its answer is then discarded)."""
        return await asyncio.shield(self.start_query(transport, user, query_id, obj))

    def start_query(self, transport: str, user: str, query_id: str, obj: dict[str, Any]) -> asyncio.Task[QueryOutcome]:
        """Start an admitted query; the task never raises and the broker's shutdown waits for it."""
        task = asyncio.create_task(self._run_query(transport, user, query_id, obj, time.monotonic()))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    async def _run_query(
        self, transport: str, user: str, query_id: str, obj: dict[str, Any], received: float
    ) -> QueryOutcome:
        timing = {"upstream": 0.0, "hold": 0.0}
        kind_label = "unknown"
        try:
            try:
                q = parse_query(obj)
                kind_label = self._kind_label(user, q)
            except InvalidInput as exc:
                kind = obj.get("kind")
                kind_label = kind if kind in ("range", "knn") else "unknown"
                return self._refused(transport, kind_label, query_id, ReasonCode.INVALID, str(exc), received, timing)
            answer = await self._process(transport, user, q, timing)
        except asyncio.CancelledError:
            answer = self._refusal_body(query_id, ReasonCode.SHUTDOWN, "the broker is shutting down")
        except Exception:
            log.exception("query_failed", extra={"kcloak_fields": {"error": "internal"}})
            answer = self._refusal_body(query_id, ReasonCode.INTERNAL, "internal error")
        return self._finish(transport, kind_label, answer, received, timing)

    def _refused(
        self,
        transport: str,
        kind_label: str,
        query_id: str,
        code: ReasonCode,
        message: str,
        received: float,
        timing: dict[str, float],
    ) -> QueryOutcome:
        return self._finish(transport, kind_label, self._refusal_body(query_id, code, message), received, timing)

    def _refusal_body(self, query_id: str, code: ReasonCode, message: str) -> dict[str, Any]:
        return {"query_id": query_id, "status": "refused", "reason": code.value, "message": message, "t": self.clock()}

    def _finish(
        self, transport: str, kind_label: str, answer: dict[str, Any], received: float, timing: dict[str, float]
    ) -> QueryOutcome:
        status = answer["status"]
        reason = answer.get("reason", "none")
        self.metrics.queries.labels(transport=transport, kind=kind_label, status=status, reason=reason).inc()
        added = time.monotonic() - received - timing["upstream"] - timing["hold"]
        self.metrics.added_latency.labels(transport=transport).observe(max(added, 0.0))
        return QueryOutcome(answer, kind_label, status, reason)

    async def _process(self, transport: str, user: str, q: Query, timing: dict[str, float]) -> dict[str, Any]:
        qid = q.query_id
        if self.closing:
            return self._refusal_body(qid, ReasonCode.SHUTDOWN, "the broker is shutting down")
        if not self._query_buckets.take(user):
            return self._refusal_body(qid, ReasonCode.RATE_LIMITED, "query rate limit reached")
        pending = self._pending_per_user.get(user, 0)
        if pending >= self.config.limits.pending_queries_per_user:
            return self._refusal_body(qid, ReasonCode.RATE_LIMITED, "too many pending queries")
        if q.continuous and not self.sessions.can_start(user):
            return self._refusal_body(qid, ReasonCode.RATE_LIMITED, "too many active sessions")
        if self._cloak_queue.full():
            return self._refusal_body(qid, ReasonCode.OVERLOADED, "the cloaking queue is full")
        self._pending_per_user[user] = pending + 1
        try:
            return await self._admitted(transport, user, q, timing)
        finally:
            left = self._pending_per_user.get(user, 1) - 1
            if left <= 0:
                self._pending_per_user.pop(user, None)
            else:
                self._pending_per_user[user] = left

    async def _process_admitted(self, transport: str, user: str, q: Query, timing: dict[str, float]) -> dict[str, Any]:
        qid = q.query_id
        stored, _, _ = self.get_profile(user)
        try:
            effective = stored.tightened(q.profile)
        except ProfileError as exc:
            return self._refusal_body(qid, exc.code, str(exc))
        if q.fix is not None:
            res = await self.submit_fixes(transport, [(user, q.fix)], source="query")
            if res.codes[0] in (ReasonCode.INVALID, ReasonCode.SHUTDOWN):
                code = res.codes[0]
                assert code is not None
                return self._refusal_body(qid, code, "t: outside the accepted clock skew")
        now = self.clock()
        if not self.index.is_present(user, now):
            return self._refusal_body(qid, ReasonCode.STALE_POSITION, "no present position for this user")
        if q.continuous and self.history is not None:
            return self._refusal_body(qid, ReasonCode.UNSUPPORTED, "temporal cloaking cannot hold a continuous session")
        if q.continuous and effective.l > 1:
            return self._refusal_body(qid, ReasonCode.UNSUPPORTED, "l > 1 is not supported for continuous queries")
        if self.history is not None:
            return await self._hold_temporal(q, user, effective, timing)
        if effective.l > 1 and (self.cloaker is None or not self.cloaker.supports_l):
            return self._refusal_body(qid, ReasonCode.UNSUPPORTED, "l > 1 needs the privacygrid algorithm")
        if self.clique is not None:
            return await self._hold_clique(q, user, effective, timing)
        if self.cloaker is None:
            return self._refusal_body(qid, ReasonCode.UNSUPPORTED, "this algorithm is not available in the broker")
        fut: asyncio.Future[tuple[Region | Refusal, IndexView | None]] = asyncio.get_running_loop().create_future()
        job = _CloakJob(user, effective, self._user_version.get(user, self._version), fut)
        try:
            self._cloak_queue.put_nowait(job)
        except asyncio.QueueFull:
            return self._refusal_body(qid, ReasonCode.OVERLOADED, "the cloaking queue is full")
        self.metrics.queue_depth.labels(queue="cloak").set(self._cloak_queue.qsize())
        result, view = await fut
        if isinstance(result, Refusal):
            return self._refusal_body(qid, result.reason, result.message)
        fix = self.index.fix(user)
        assert fix is not None
        if q.continuous and view is not None:
            return await self._start_session(q, user, effective, result, view, timing)
        return await self._forward(q, effective, result, fix[0], fix[1], timing)

    async def _hold_clique(
        self, q: Query, user: str, profile: PrivacyProfile, timing: dict[str, float]
    ) -> dict[str, Any]:
        """CliqueCloak (CONCEPTS §4.5, §5.2): hold until a clique of senders forms or the deadline."""
        assert self.clique is not None
        if len(self._held) >= self.config.queues.hold:
            return self._refusal_body(q.query_id, ReasonCode.OVERLOADED, "the hold queue is full")
        fix = self.index.fix(user)
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
        self._hold_wakeup.set()
        self.metrics.queue_depth.labels(queue="hold").set(len(self._held))
        try:
            release = await fut
        finally:
            self._held.pop(rid, None)
            held = time.monotonic() - started
            timing["hold"] += held
            self.metrics.hold_seconds.labels(algorithm=self.algorithm).observe(held)
            self.metrics.queue_depth.labels(queue="hold").set(len(self._held))
        if release is None:
            return self._refusal_body(q.query_id, ReasonCode.EXPIRED, "no clique formed within max_delay_s")
        view = self._fresh_view(self._version)
        region = Region(
            bbox=release.bbox,
            k_achieved=view.count_in(release.bbox),
            area_m2=release.area_m2,
            algorithm="clique",
            epoch=view.epoch,
        )
        if region.k_achieved < profile.k:
            return self._refusal_body(q.query_id, ReasonCode.EXPIRED, "the clique's members are no longer present")
        now_fix = self.index.fix(user)
        assert now_fix is not None
        if q.continuous:
            return await self._start_session(q, user, profile, region, view, timing)
        return await self._forward(q, profile, region, now_fix[0], now_fix[1], timing)

    async def _hold_temporal(
        self, q: Query, user: str, profile: PrivacyProfile, timing: dict[str, float]
    ) -> dict[str, Any]:
        """Gruteser–Grunwald temporal cloaking (CONCEPTS §5.1, §5.2): hold the query until k distinct
        users had a fix inside its cell during [t_start, t_end], forward at ``t_end``, or expire."""
        assert self.history is not None
        if profile.l > 1:
            return self._refusal_body(q.query_id, ReasonCode.UNSUPPORTED, "l > 1 needs the privacygrid algorithm")
        if self._temporal_held >= self.config.queues.hold:
            return self._refusal_body(q.query_id, ReasonCode.OVERLOADED, "the hold queue is full")
        fix = self.index.fix(user)
        assert fix is not None
        lat, lon, t_fix = fix
        cfg = self.config.cloaking
        cell = temporal_cell(lat, lon, max_area_m2=profile.max_area_m2, min_area_m2=profile.min_area_m2)
        if isinstance(cell, Refusal):
            return self._refusal_body(q.query_id, cell.reason, cell.message)
        started = time.monotonic()
        deadline = started + profile.max_delay_s
        self._temporal_held += 1
        self.metrics.queue_depth.labels(queue="hold").set(self._temporal_held)
        try:
            while True:
                window = temporal_window(
                    self.history, cell.bbox, t_fix, profile.k, lookback_s=cfg.temporal_lookback_s, until=self.clock()
                )
                if window.t_end is not None:
                    wait = window.t_end - self.clock()
                    if time.monotonic() + max(wait, 0.0) > deadline:
                        break
                    if wait > 0:
                        await asyncio.sleep(wait)
                    final = temporal_window(
                        self.history,
                        cell.bbox,
                        t_fix,
                        profile.k,
                        lookback_s=cfg.temporal_lookback_s,
                        until=window.t_end,
                    )
                    region = Region(
                        bbox=cell.bbox,
                        k_achieved=final.k_achieved,
                        area_m2=cell.area_m2,
                        algorithm="temporal",
                        t_start=final.t_start,
                        t_end=final.t_end,
                    )
                    held = time.monotonic() - started
                    timing["hold"] += held
                    self.metrics.hold_seconds.labels(algorithm="temporal").observe(held)
                    return await self._forward(q, profile, region, lat, lon, timing)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.sleep(min(0.25, remaining))
        finally:
            self._temporal_held -= 1
            self.metrics.queue_depth.labels(queue="hold").set(self._temporal_held)
        held = time.monotonic() - started
        timing["hold"] += held
        self.metrics.hold_seconds.labels(algorithm="temporal").observe(held)
        return self._refusal_body(q.query_id, ReasonCode.EXPIRED, "fewer than k users visited the region in time")

    # -- continuous sessions (contract §6; CONCEPTS §6.5) --------------------------------------
    def _kind_label(self, user: str, q: Query) -> str:
        """Metric ``kind`` of a query; a refresh that does not repeat ``kind`` counts as its session's."""
        if q.kind is None and q.session_id is not None and not q.stop:
            session = self.sessions.peek(user, q.session_id)
            if session is not None:
                return session.kind
        return q.metric_kind

    async def _admitted(self, transport: str, user: str, q: Query, timing: dict[str, float]) -> dict[str, Any]:
        """Route an admitted query: a session refresh or stop, a session start (holding one of the
        user's session slots while it runs), or a one-shot query. Each first waits for the user's
        fixes received before it (a phone's fix, then its query, on one connection)."""
        await self._own_fixes_decided(user)
        if q.session_id is not None:
            return await self._session_query(transport, user, q, timing)
        if not q.continuous:
            return await self._process_admitted(transport, user, q, timing)
        if not self.sessions.reserve(user):
            return self._refusal_body(q.query_id, ReasonCode.RATE_LIMITED, "too many active sessions")
        try:
            return await self._process_admitted(transport, user, q, timing)
        finally:
            self.sessions.release(user)

    async def _start_session(
        self,
        q: Query,
        user: str,
        profile: PrivacyProfile,
        region: Region,
        view: IndexView,
        timing: dict[str, float],
    ) -> dict[str, Any]:
        """Forward the first region of a continuous query; the session exists only if that succeeds.

        ``view`` is the snapshot the region was cloaked (or counted) on: the group G is the present
        users strictly inside the region in it (k-sharing with memorization, CONCEPTS §6.5).
        """
        try:
            group = SharedGroup.start(view, user, region, profile)
        except SessionError:
            code = ReasonCode.EXPIRED if self.clique is not None else ReasonCode.K_UNREACHABLE
            return self._refusal_body(q.query_id, code, "the first region no longer holds the querier and k users")
        fix = self.index.fix(user)
        assert fix is not None
        answer = await self._forward(q, profile, region, fix[0], fix[1], timing)
        if answer["status"] != "ok":
            return answer
        session = self.sessions.open(user, q, profile, group)
        log_event(log, "session_started", algorithm=self.algorithm, members=len(group.members))
        answer["session"] = session.brief()
        return answer

    async def _session_query(self, transport: str, user: str, q: Query, timing: dict[str, float]) -> dict[str, Any]:
        """A refresh or a stop of one of the user's sessions (contract §6).

        A refresh forwards the bbox of the group's present members (never a new cloak), with the
        kind, parameters and effective profile fixed at the start; ``k_unreachable`` and
        ``area_exceeded`` end the session, ``stale_position`` keeps it.
        """
        qid = q.query_id
        assert q.session_id is not None
        session = self.sessions.get(user, q.session_id)
        if session is None:
            return self._refusal_body(qid, ReasonCode.UNKNOWN_SESSION, "unknown session")
        mismatch = session.mismatch(q)
        if mismatch is not None:
            message = f"{mismatch}: must equal the value the session started with"
            return _with_session(self._refusal_body(qid, ReasonCode.INVALID, message), session)
        if q.fix is not None:
            res = await self.submit_fixes(transport, [(user, q.fix)], source="query")
            code = res.codes[0]
            if code is ReasonCode.INVALID or code is ReasonCode.SHUTDOWN:
                return _with_session(self._refusal_body(qid, code, "t: outside the accepted clock skew"), session)
        if session.state is not SessionState.ACTIVE:  # closed while its carried fix was written
            return self._refusal_body(qid, ReasonCode.UNKNOWN_SESSION, "unknown session")
        if q.stop:
            self.sessions.close(session, SessionState.STOPPED)
            return {"query_id": qid, "status": "ok", "session": session.brief(), "t": self.clock()}
        self.sessions.touch(session)
        if not self.index.is_present(user, self.clock()):
            body = self._refusal_body(qid, ReasonCode.STALE_POSITION, "no present position for this user")
            return _with_session(body, session)
        started = time.perf_counter()
        # The newest view: every member's latest accepted fix, not only the querier's.
        view = self._fresh_view(self._version)
        result = session.group.refresh(view, user, session.profile)
        self.metrics.cloak_seconds.labels(algorithm=self.algorithm).observe(time.perf_counter() - started)
        if isinstance(result, Refusal):
            if ends_session(result):
                self.sessions.close(session, SessionState.ENDED)
                log_event(log, "session_closed", state="ended", reason=result.reason.value)
            return _with_session(self._refusal_body(qid, result.reason, result.message), session)
        fix = self.index.fix(user)
        assert fix is not None
        fixed = replace(q, kind=session.kind, radius_m=session.radius_m, n=session.n, category=session.category)
        answer = await self._forward(fixed, session.profile, result, fix[0], fix[1], timing)
        return _with_session(answer, session)

    def session_object(self, user: str, session_id: str) -> dict[str, Any] | None:
        """The session object of ``GET …/sessions/{id}``; None when unknown to this user (contract §6)."""
        session = self.sessions.get(user, session_id)
        return None if session is None else session.to_json()

    def stop_session(self, user: str, session_id: str) -> bool:
        """``DELETE …/sessions/{id}``: stop the user's active session; False when unknown."""
        session = self.sessions.get(user, session_id)
        if session is None:
            return False
        self.sessions.close(session, SessionState.STOPPED)
        return True

    def _session_expired(self, session: Session) -> None:
        log_event(log, "session_closed", state="expired")
        if self.session_status is not None:
            self._background(self._notify_session(session.user, session_status(session, self.clock())))

    async def _notify_session(self, user: str, body: dict[str, Any]) -> None:
        assert self.session_status is not None
        try:
            await self.session_status(user, body)
        except Exception:
            log_event(log, "session_status_failed", logging.WARNING)

    async def run_sessions(self) -> None:
        """Expire idle or over-age sessions (contract §6) about once a second; runs until cancelled."""
        while True:
            self.sessions.expire_due()
            nxt = self.sessions.next_expiry()
            delay = 1.0 if nxt is None else min(1.0, max(nxt - self.clock(), 0.02))
            await asyncio.sleep(delay)

    async def run_housekeeping(self, period_s: float = 60.0) -> None:
        """Retention of the movement store and the presence gauge (contract §11)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                deleted = await self.apply_retention()
            except (StoreError, sqlite3.Error) as exc:  # retried next period; never stops the broker
                log_event(log, "retention_failed", logging.ERROR, store="movement", error=type(exc).__name__)
                deleted = 0
            if self.history is not None:
                self.history.prune(self.clock())
            if deleted:
                log_event(log, "retention", store="movement", deleted=deleted)
            self.metrics.users_present.set(len(self.index.snapshot(self.clock())))

    async def apply_retention(self) -> int:
        """Delete fixes older than ``storage.retention_s``, never those of a window not yet committed."""
        cutoff = self.clock() - self.config.storage.retention_s
        keep_from = self.retention_floor() if self.retention_floor is not None else None
        return await self.movement.delete_older_than(cutoff, keep_from=keep_from)

    async def run_expiry(self) -> None:
        """Refuse held requests whose deadline passed (one timer for the whole pool, §5.2)."""
        while True:
            if self.clique is None:
                return
            deadline = self.clique.next_deadline()
            self._hold_wakeup.clear()
            if deadline is None:
                await self._hold_wakeup.wait()
                continue
            delay = max(0.0, deadline - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._hold_wakeup.wait()
            for request in self.clique.expire(time.monotonic()):
                fut = self._held.pop(request.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)

    def _fresh_view(self, needed_version: int) -> IndexView:
        now = self.clock()
        if self._view is None or self._view_version < needed_version or now - self._view_t > 1.0:
            self._epoch += 1
            self._view = self.index.snapshot(now, epoch=self._epoch, seed=self._epoch)
            self._view_version = self._version
            self._view_t = now
            self.metrics.users_present.set(len(self._view))
        return self._view

    def _cloak_jobs(self, jobs: list[_CloakJob]) -> None:
        view = self._fresh_view(max(j.needed_version for j in jobs))
        assert self.cloaker is not None
        if len(jobs) >= BATCH_MIN and self.algorithm in BATCH_ALGORITHMS:
            jobs = self._cloak_batched(view, jobs)
        for job in jobs:
            if job.future.done():
                continue
            started = time.perf_counter()
            row = view.row(job.user)
            result: Region | Refusal
            if row is None:
                result = Refusal(ReasonCode.STALE_POSITION, "no present position for this user")
            else:
                try:
                    result = self.cloaker.cloak(view, row, job.profile)
                except Exception:
                    log.exception("cloak_failed", extra={"kcloak_fields": {"algorithm": self.algorithm}})
                    result = Refusal(ReasonCode.INTERNAL, "internal error")
            self.metrics.cloak_seconds.labels(algorithm=self.algorithm).observe(time.perf_counter() - started)
            job.future.set_result((result, view))
        self.metrics.queue_depth.labels(queue="cloak").set(self._cloak_queue.qsize())

    def _cloak_batched(self, view: IndexView, jobs: list[_CloakJob]) -> list[_CloakJob]:
        """Micro-batch: cloak every waiting plain query with one ``cloak_batch`` call; returns the
        jobs left for one-by-one handling (no present position, or l > 1)."""
        assert self.cloaker is not None
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

    async def _forward(
        self,
        q: Query,
        profile: PrivacyProfile,
        region: Region,
        lat: float,
        lon: float,
        timing: dict[str, float],
    ) -> dict[str, Any]:
        assert q.kind is not None
        bbox = region.bbox.to_geojson()
        request = SearchRequest(
            kind=q.kind,
            bbox=bbox,
            radius_m=q.radius_m,
            n=q.n,
            category=q.category,
            t_start=region.t_start,
            t_end=region.t_end,
        )
        if self.upstream.waiting >= self.config.queues.upstream:
            return self._refusal_body(q.query_id, ReasonCode.OVERLOADED, "the upstream queue is full")
        started = time.monotonic()
        outcome = "ok"
        try:
            candidates = await self.upstream.search(request)
        except UpstreamError:
            outcome = "upstream_error"
            candidates = []
        finally:
            timing["upstream"] += time.monotonic() - started
            self.metrics.queue_depth.labels(queue="upstream").set(self.upstream.waiting)
        forwarded_t = self.clock()
        # The query log is written in the background: the answer does not wait for its commit
        # (the writer thread drains every queued row before the store closes).
        self._background(
            self.querylog.record(
                (
                    forwarded_t,
                    q.kind,
                    q.radius_m,
                    q.n,
                    q.category,
                    *bbox,
                    region.t_start,
                    region.t_end,
                    region.area_m2,
                    region.k_achieved,
                    self.algorithm,
                    outcome,
                )
            )
        )
        if outcome != "ok":
            return self._refusal_body(q.query_id, ReasonCode.UPSTREAM_ERROR, "the provider failed after retries")
        self.metrics.upstream_candidates.labels(kind=q.kind).observe(len(candidates))
        self.metrics.region_area.labels(algorithm=self.algorithm).observe(region.area_m2)
        self.metrics.k_ratio.labels(algorithm=self.algorithm).observe(region.k_achieved / profile.k)
        answer: dict[str, Any] = {
            "query_id": q.query_id,
            "status": "ok",
            "algorithm": self.algorithm,
            "k_achieved": region.k_achieved,
            "area_m2": region.area_m2,
            "region": _region_json(region),
        }
        if profile.l > 1 and region.l_achieved is not None:
            answer["l_achieved"] = region.l_achieved
        if q.kind == "range":
            assert q.radius_m is not None
            results, truncated = filter_range(candidates, lat, lon, q.radius_m)
            answer["results"] = results
            answer["truncated"] = truncated
        else:
            assert q.n is not None
            answer["results"] = filter_knn(candidates, lat, lon, q.n)
        answer["t"] = self.clock()
        return answer


def _with_session(answer: dict[str, Any], session: Session) -> dict[str, Any]:
    """Every answer to a session's refresh or stop carries its ``session`` (contract §6)."""
    answer["session"] = session.brief()
    return answer


def _region_json(region: Region) -> dict[str, Any]:
    out: dict[str, Any] = {"bbox": region.bbox.to_geojson()}
    if region.t_start is not None and region.t_end is not None:
        out["t_start"] = region.t_start
        out["t_end"] = region.t_end
    return out


def _result(c: Candidate, d: float) -> dict[str, Any]:
    return {
        "poi_id": c.poi_id,
        "lat": c.lat,
        "lon": c.lon,
        "category": c.category,
        "name": c.name,
        "distance_m": round(d, 3),
    }


def filter_range(
    candidates: list[Candidate], lat: float, lon: float, radius_m: float
) -> tuple[list[dict[str, Any]], bool]:
    """Every candidate within ``radius_m`` of the exact position, nearest first (ties by id),
    at most 1,000 (then ``truncated``)."""
    hits = [(haversine_m(lat, lon, c.lat, c.lon), c) for c in candidates]
    inside = sorted(((round(d, 3), c.poi_id, d, c) for d, c in hits if d <= radius_m), key=lambda x: (x[0], x[1]))
    truncated = len(inside) > MAX_RANGE_RESULTS
    return [_result(c, d) for _, _, d, c in inside[:MAX_RANGE_RESULTS]], truncated


def filter_knn(candidates: list[Candidate], lat: float, lon: float, n: int) -> list[dict[str, Any]]:
    """The ``n`` candidates nearest to the exact position (ties by ``poi_id``)."""
    ranked = sorted(
        ((round(d, 3), c.poi_id, d, c) for d, c in ((haversine_m(lat, lon, c.lat, c.lon), c) for c in candidates)),
        key=lambda x: (x[0], x[1]),
    )
    return [_result(c, d) for _, _, d, c in ranked[:n]]
