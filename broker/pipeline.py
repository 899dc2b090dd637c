"""The one pipeline behind both doors (MQTT and HTTP): it wires the broker's parts by concern.

- fix intake (:mod:`~kcloak.broker.intake`): validate (contract §1 order) → write ahead to the
  movement store → apply to the positions (:mod:`~kcloak.broker.positions`);
- admission (:mod:`~kcloak.broker.admission`): ``query_id``, duplicates, shutdown, rate limits;
- profiles (:mod:`~kcloak.broker.profiles`);
- cloaking modes (:mod:`~kcloak.broker.modes`): snapshot with micro-batching, held clique,
  temporal, chosen by the cloaker's declared ``cloak_mode``;
- continuous sessions (:mod:`~kcloak.broker.sessions`);
- forwarding (:mod:`~kcloak.broker.forwarding`): upstream call, query log, exact filtering;
- housekeeping (:mod:`~kcloak.broker.housekeeping`): retention.

A query: duplicate → schema → shutdown → rate limits → overload → sessions → effective profile →
carried position → presence → support → cloak → upstream → exact filtering → exactly one
:class:`~kcloak.wire.answers.Answer` (contract §2).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kcloak.broker.admission import Admission, Duplicate, QueryRejected
from kcloak.broker.config import Config
from kcloak.broker.eager import eager_task
from kcloak.broker.forwarding import Background, Forwarder, Timing
from kcloak.broker.history import RecentFixes
from kcloak.broker.housekeeping import Housekeeping
from kcloak.broker.intake import FIX_CHUNK, FixIntake, FixResult
from kcloak.broker.livemap import LiveMap
from kcloak.broker.metrics import Metrics
from kcloak.broker.modes import Views, build_cloaker, history_for, serving_mode
from kcloak.broker.positions import Positions
from kcloak.broker.profiles import Profiles
from kcloak.broker.sessions import ContinuousQueries, SessionTable
from kcloak.broker.stores import MovementStore, ProfileStore, QueryLog
from kcloak.broker.upstream import Upstream
from kcloak.cloaking.cloakers import REFUSAL_MESSAGES, Refusal
from kcloak.cloaking.index import PositionIndex
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile, ProfileError, ReasonCode
from kcloak.wire.answers import Answer
from kcloak.wire.payloads import Fix, InvalidInput, Query, parse_query

log = logging.getLogger("kcloak.pipeline")


@dataclass(slots=True)
class QueryOutcome:
    """The one answer of a query, and what the transports need to report it."""

    answer: Answer
    kind_label: str
    status: str
    reason: str


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
        upstream: Upstream,
        places: PlacesLayer | None = None,
        clock: Callable[[], float] = _now,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.profiles = profiles
        self.movement = movement
        self.querylog = querylog
        self.upstream = upstream
        self._clock = clock
        cfg = config.cloaking
        self.algorithm = cfg.algorithm
        self.default_profile = config.profile.to_profile()
        self.cloaker: Any = build_cloaker(self.algorithm, cloaking=cfg, places=places)
        index = PositionIndex(stale_after_s=cfg.stale_after_s, default_profile=self.default_profile)
        self.positions = Positions(index=index, history=history_for(self.cloaker, cfg))
        self.profile_book = Profiles(store=profiles, index=index, default=self.default_profile, clock=clock)
        self.intake = FixIntake(
            cloaking=cfg,
            limits=config.limits,
            metrics=metrics,
            movement=movement,
            positions=self.positions,
            clock=clock,
        )
        self.views = Views(positions=self.positions, metrics=metrics, clock=clock)
        self.cloaking = serving_mode(
            self.cloaker, positions=self.positions, views=self.views, metrics=metrics, queues=config.queues
        )
        self.background = Background()
        self.livemap = LiveMap(config=config, metrics=metrics, positions=self.positions, clock=clock)
        self.forwarder = Forwarder(
            algorithm=self.algorithm,
            queue_capacity=config.queues.upstream,
            metrics=metrics,
            upstream=upstream,
            querylog=querylog,
            background=self.background,
            clock=clock,
            on_region=self.livemap.region,
        )
        sc = config.sessions
        self.sessions = SessionTable(
            metrics=metrics, clock=clock, idle_s=sc.idle_s, max_s=sc.max_s, per_user=sc.per_user
        )
        self.continuous = ContinuousQueries(
            table=self.sessions,
            positions=self.positions,
            views=self.views,
            forwarder=self.forwarder,
            metrics=metrics,
            algorithm=self.algorithm,
            background=self.background,
            clock=clock,
        )
        self.admission = Admission(limits=config.limits, can_start_session=self.sessions.can_start)
        self.housekeeping = Housekeeping(
            retention_s=config.storage.retention_s,
            metrics=metrics,
            movement=movement,
            positions=self.positions,
            clock=clock,
        )
        self._inflight: set[asyncio.Task[QueryOutcome]] = set()
        self._closing = False
        for name in ("ingest", "cloak", "hold", "upstream", "store"):
            metrics.queue_capacity.labels(queue=name).set(getattr(config.queues, name))

    # -- wiring --------------------------------------------------------------------------------
    @property
    def clock(self) -> Callable[[], float]:
        """Unix seconds; setting it sets every part's clock (the session table keeps its own)."""
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        for part in (self.profile_book, self.intake, self.views, self.forwarder, self.continuous, self.housekeeping):
            part.clock = clock

    @property
    def index(self) -> PositionIndex:
        return self.positions.index

    @property
    def history(self) -> RecentFixes | None:
        return self.positions.history

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def session_status(self) -> Callable[[str, dict[str, Any]], Awaitable[None]] | None:
        """Publishes a session status message (``kind: session``) to a user; set when MQTT is configured."""
        return self.continuous.notify

    @session_status.setter
    def session_status(self, publish: Callable[[str, dict[str, Any]], Awaitable[None]] | None) -> None:
        self.continuous.notify = publish

    @property
    def retention_floor(self) -> Callable[[], float | None] | None:
        """Fixes at or after the time this returns are never deleted (set by trajectory publication)."""
        return self.housekeeping.retention_floor

    @retention_floor.setter
    def retention_floor(self, floor: Callable[[], float | None] | None) -> None:
        self.housekeeping.retention_floor = floor

    # -- lifecycle -----------------------------------------------------------------------------
    def restore_positions(self) -> int:
        """Reload the latest fixes of users still present from the movement store (after a restart)."""
        return self.intake.restore()

    async def run_cloaking(self) -> None:
        """The cloaking mode's own work: the cloak worker (snapshot) or the hold pool's timer (held);
        runs until cancelled, or returns at once when the mode has none (temporal)."""
        await self.cloaking.run()

    async def run_housekeeping(self, period_s: float = 60.0) -> None:
        """Retention of the movement store and the presence gauge (contract §11)."""
        await self.housekeeping.run(period_s)

    async def apply_retention(self) -> int:
        return await self.housekeeping.apply_retention()

    async def run_sessions(self) -> None:
        """Expire idle or over-age sessions (contract §6); runs until cancelled."""
        await self.continuous.run()

    def begin_shutdown(self) -> None:
        self._closing = True
        self.intake.begin_shutdown()
        self.admission.begin_shutdown()

    async def drain(self, grace_s: float) -> None:
        """Let in-flight queries finish within ``grace_s``; the rest are answered ``shutdown``."""
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        await self.background.wait(5.0)

    # -- fixes ---------------------------------------------------------------------------------
    async def submit_fixes(self, transport: str, items: list[tuple[str, Any]], *, source: str = "update") -> FixResult:
        """Validate, durably store and apply fixes; each item is ``(user, fix object or Fix)``."""
        return await self.intake.submit_fixes(transport, items, source=source)

    async def submit_fix_batch(self, transport: str, items: list[tuple[str, Any]]) -> FixResult:
        """A batch message of any size, :data:`FIX_CHUNK` fixes per event-loop turn."""
        return await self.intake.submit_fix_batch(transport, items)

    def enqueue_fixes(
        self, transport: str, items: list[tuple[str, Any]], *, batch: bool = False, source: str = "update"
    ) -> asyncio.Task[FixResult]:
        """Submit fixes as they are received, without waiting (see :meth:`FixIntake.enqueue_fixes`)."""
        return self.intake.enqueue_fixes(transport, items, batch=batch, source=source)

    def decide_fix(
        self, transport: str, user: str, fix: Any, waiter: asyncio.Future[ReasonCode | None] | None = None
    ) -> Awaitable[ReasonCode | None]:
        """One fix as received, its outcome once decided (see :meth:`FixIntake.decide_fix`); with
        ``waiter``, that future is resolved and returned."""
        return self.intake.decide_fix(transport, user, fix, waiter)

    # -- profiles ------------------------------------------------------------------------------
    def get_profile(self, user: str) -> tuple[PrivacyProfile, str, float | None]:
        return self.profile_book.get(user)

    async def load_profile(self, user: str) -> tuple[PrivacyProfile, str, float | None]:
        """:meth:`get_profile` for a door that may wait (a cluster gateway reads a shared bucket)."""
        return self.get_profile(user)

    def profile_rate_ok(self, user: str) -> bool:
        return self.admission.profile_rate_ok(user)

    async def set_profile(self, user: str, data: dict[str, Any] | None) -> PrivacyProfile:
        """Replace (or with ``None`` reset) the stored profile; raises :class:`ProfileError`."""
        return await self.profile_book.set(user, data)

    # -- queries -------------------------------------------------------------------------------
    def admit(self, user: str, obj: dict[str, Any]) -> str:
        """The checks a transport needs before it can promise an answer: the ``query_id`` and
        duplicates. Returns the query id; raises :class:`QueryRejected` or :class:`Duplicate`."""
        return self.admission.admit(user, obj)

    async def is_answered(self, user: str, query_id: str) -> bool:
        """Whether the query was answered before :meth:`admit`'s window knew it: never in one process
        (a cluster gateway asks the answers stream, shared by every gateway)."""
        return False

    async def query(self, transport: str, user: str, query_id: str, obj: dict[str, Any]) -> QueryOutcome:
        """Run an admitted query to its one answer. Never raises; cancellation of the caller does
        not stop the query (its answer is then discarded)."""
        return await asyncio.shield(self.start_query(transport, user, query_id, obj))

    def start_query(
        self, transport: str, user: str, query_id: str, obj: dict[str, Any], *, eager: bool = False
    ) -> asyncio.Task[QueryOutcome]:
        """Start an admitted query; the task never raises and the broker's shutdown waits for it.

        ``eager``: the query's first step (its checks, up to the cloaking queue) runs in this call
        when it is made from a protocol callback, not in the loop's next pass (:func:`eager_task`).
        Only for a door that has nothing received before the query still waiting for that next
        pass: the query must not overtake its user's own earlier fixes or profile."""
        run = self._run_query(transport, user, query_id, obj, time.monotonic())
        task = eager_task(run) if eager else asyncio.create_task(run)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    def session_object(self, user: str, session_id: str) -> dict[str, Any] | None:
        """The session object of ``GET …/sessions/{id}``; None when unknown to this user (contract §6)."""
        return self.continuous.session_object(user, session_id)

    def stop_session(self, user: str, session_id: str) -> bool:
        """``DELETE …/sessions/{id}``: stop the user's active session; False when unknown."""
        return self.continuous.stop(user, session_id)

    async def _run_query(
        self, transport: str, user: str, query_id: str, obj: dict[str, Any], received: float
    ) -> QueryOutcome:
        timing = Timing()
        kind_label = "unknown"
        try:
            try:
                q = parse_query(obj)
                kind_label = self.continuous.kind_label(user, q)
            except InvalidInput as exc:
                kind = obj.get("kind")
                kind_label = kind if kind in ("range", "knn") else "unknown"
                answer = self._refused(query_id, ReasonCode.INVALID, str(exc))
                return self._finish(transport, kind_label, answer, received, timing)
            answer = await self._process(transport, user, q, timing)
        except asyncio.CancelledError:
            answer = self._refused(query_id, ReasonCode.SHUTDOWN, "the broker is shutting down")
        except Exception:
            log.exception("query_failed", extra={"kcloak_fields": {"error": "internal"}})
            answer = self._refused(query_id, ReasonCode.INTERNAL, "internal error")
        return self._finish(transport, kind_label, answer, received, timing)

    def _refused(self, query_id: str, code: ReasonCode, message: str) -> Answer:
        return Answer.refused(query_id, code, message, self._clock())

    def _finish(self, transport: str, kind_label: str, answer: Answer, received: float, timing: Timing) -> QueryOutcome:
        status, reason = answer.status, answer.reason_label
        self.metrics.queries.labels(transport=transport, kind=kind_label, status=status, reason=reason).inc()
        total = time.monotonic() - received
        self.livemap.answered(total)
        added = total - timing.upstream - timing.hold
        self.metrics.added_latency.labels(transport=transport).observe(max(added, 0.0))
        return QueryOutcome(answer, kind_label, status, reason)

    async def _process(self, transport: str, user: str, q: Query, timing: Timing) -> Answer:
        refusal = self.admission.refusal(user, q, queue_full=self.cloaking.full())
        if refusal is not None:
            return self._refused(q.query_id, *refusal)
        with self.admission.pending(user):
            return await self._admitted(transport, user, q, timing)

    async def _admitted(self, transport: str, user: str, q: Query, timing: Timing) -> Answer:
        """Route an admitted query: a session refresh or stop, a session start (holding one of the
        user's session slots while it runs), or a one-shot query. Each first waits for the user's
        fixes received before it (a phone's fix, then its query, on one connection)."""
        await self.intake.own_fixes_decided(user)
        if q.session_id is not None:

            async def carry(fix: Fix) -> ReasonCode | None:
                return await self._carry(transport, user, fix)

            return await self.continuous.refresh(user, q, timing, carry)
        if not q.continuous:
            return await self._cloak_and_forward(transport, user, q, timing)
        if not self.sessions.reserve(user):
            return self._refused(q.query_id, ReasonCode.RATE_LIMITED, "too many active sessions")
        try:
            return await self._cloak_and_forward(transport, user, q, timing)
        finally:
            self.sessions.release(user)

    async def _carry(self, transport: str, user: str, fix: Fix) -> ReasonCode | None:
        """Submit a query's carried position as a fix (contract §3, ``source="query"``)."""
        res = await self.intake.submit_fixes(transport, [(user, fix)], source="query")
        return res.codes[0]

    async def _cloak_and_forward(self, transport: str, user: str, q: Query, timing: Timing) -> Answer:
        """A one-shot query or a session start: effective profile, carried position, presence,
        support, then the mode's cloak and the forwarding (or the session's start)."""
        qid = q.query_id
        stored, _, _ = self.profile_book.get(user)
        try:
            effective = stored.tightened(q.profile)
        except ProfileError as exc:
            return self._refused(qid, exc.code, str(exc))
        if q.fix is not None:
            code = await self._carry(transport, user, q.fix)
            if code is ReasonCode.INVALID or code is ReasonCode.SHUTDOWN:
                return self._refused(qid, code, "t: outside the accepted clock skew")
        if not self.positions.is_present(user, self._clock()):
            return self._refused(qid, ReasonCode.STALE_POSITION, REFUSAL_MESSAGES[ReasonCode.STALE_POSITION])
        mode = self.cloaking
        if q.continuous and mode.continuous_refusal is not None:
            return self._refused(qid, ReasonCode.UNSUPPORTED, mode.continuous_refusal)
        if q.continuous and effective.l > 1:
            return self._refused(qid, ReasonCode.UNSUPPORTED, "l > 1 is not supported for continuous queries")
        if effective.l > 1 and not mode.supports_l:
            return self._refused(qid, ReasonCode.UNSUPPORTED, "l > 1 needs the privacygrid algorithm")
        cloaked = await mode.cloak(user, effective, timing)
        if isinstance(cloaked, Refusal):
            return self._refused(qid, cloaked.reason, cloaked.message)
        if q.continuous:
            return await self.continuous.start(q, user, effective, cloaked, mode.lost_group, timing)
        return await self.forwarder.forward(q, effective, cloaked.region, cloaked.lat, cloaked.lon, timing)


__all__ = ["FIX_CHUNK", "Duplicate", "FixResult", "Pipeline", "QueryOutcome", "QueryRejected"]
