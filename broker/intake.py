"""Fix intake: validate (contract §1 order) → write ahead to the movement store → apply to the positions.

Needs only the movement store and the positions it writes to (no cloaker, no query state). Fixes
are decided in the order they arrive; a query waits for the fixes of its user received before it
(:meth:`FixIntake.own_fixes_decided`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any

from kcloak.broker.config import CloakingConfig, LimitsConfig
from kcloak.broker.metrics import Metrics
from kcloak.broker.positions import Positions
from kcloak.broker.ratelimit import TokenBuckets
from kcloak.broker.stores import MovementStore
from kcloak.core.logs import log_event
from kcloak.core.profile import ReasonCode
from kcloak.wire.payloads import Fix, InvalidInput, parse_fix

log = logging.getLogger("kcloak.pipeline")

FIX_CHUNK = 500
"""Most fixes of one batch handled in one event-loop turn (:meth:`FixIntake.submit_fix_batch`)."""


@dataclass(slots=True)
class _OpenBatch:
    """Single fixes of one event-loop turn (:meth:`FixIntake.decide_fix`), decided as one submission."""

    transport: str
    decided: asyncio.Future[None]
    items: list[tuple[str, Any]] = field(default_factory=list)
    waiters: list[asyncio.Future[ReasonCode | None]] = field(default_factory=list)


@dataclass(slots=True)
class FixResult:
    """Per-item outcome of a batch of fixes: ``None`` = accepted, else a reason code."""

    codes: list[ReasonCode | None] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(1 for c in self.codes if c is None)


class FixIntake:
    """Validates, durably stores and applies fixes; every fix is counted once, accepted or rejected.

    Keyword arguments: ``cloaking`` (clock skew, maximum age, ``stale_after_s``), ``limits`` (the
    per-user update rate), ``metrics``, ``movement`` (the write-ahead store), ``positions`` (where
    accepted fixes are applied), ``clock`` (Unix seconds), ``bucket_clock`` (the monotonic seconds
    that refill the update rate's token buckets). After :meth:`begin_shutdown` every fix
    is rejected ``shutdown``.
    """

    def __init__(
        self,
        *,
        cloaking: CloakingConfig,
        limits: LimitsConfig,
        metrics: Metrics,
        movement: MovementStore,
        positions: Positions,
        clock: Callable[[], float] = time.time,
        bucket_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cloaking = cloaking
        self.metrics = metrics
        self.movement = movement
        self.positions = positions
        self.clock = clock
        self.closing = False
        self._update_buckets = TokenBuckets(limits.update_rate, limits.update_burst, clock=bucket_clock)
        self._pending_t: dict[str, float] = {}
        """``t`` of each user's latest fix that passed the checks but is not applied to the positions
        yet (being stored). A user's latest accepted ``t`` is the newer of this and the position
        index's: no dict of every user's last time beside the index's own column."""
        self._batch_order = asyncio.Lock()  # submit_fix_batch: batches are validated in arrival order
        self._fixes_in_flight: dict[str, asyncio.Future[None]] = {}
        """Per user, the marker of the latest fix submission that held a fix of the user
        (:meth:`enqueue_fixes`, :meth:`decide_fix`): done once it and every earlier one are decided."""
        self._submissions: deque[tuple[asyncio.Future[Any], asyncio.Future[None]]] = deque()
        """Submissions not yet decided or with an earlier one not yet decided, in the order received,
        each with its marker."""
        self._open_batch: _OpenBatch | None = None
        """The single fixes received in this event-loop turn (:meth:`decide_fix`), until it is decided."""
        self._batch_tasks: set[asyncio.Task[None]] = set()

    def begin_shutdown(self) -> None:
        self.closing = True

    def restore(self) -> int:
        """Reload the latest fixes of users still present from the movement store (after a restart)."""
        now = self.clock()
        latest = self.movement.latest_per_user(now - self.cloaking.stale_after_s)
        history = self.positions.history
        recent = [] if history is None else self.movement.fixes_between(now - history.keep_s, math.inf)
        self.positions.restore(latest, recent)
        return len(latest)

    def _last_t(self, user: str) -> float | None:
        """The user's latest accepted (or being stored) fix time, or None."""
        pending = self._pending_t.get(user)
        return pending if pending is not None else self.positions.latest_t(user)

    def _settle(self, users: Iterable[str]) -> None:
        """Forget the pending times of ``users`` that the positions now hold (or that were refused)."""
        pending, latest_t = self._pending_t, self.positions.index.latest_t
        for user in users:
            t = pending.get(user)
            if t is not None and (applied := latest_t(user)) is not None and applied >= t:
                del pending[user]

    async def submit_fixes(
        self, transport: str, items: list[tuple[str, Any]], *, source: str = "update", urgent: bool = False
    ) -> FixResult:
        """Validate, durably store and apply fixes; each item is ``(user, fix object or Fix)``;
        ``urgent``: the senders wait for the outcome (the commit does not linger for more writes).

        The checks, in contract §1 order, per fix: shutdown, types and ranges, clock skew, age,
        order (newer than the user's last accepted fix, this call's earlier fixes included), rate."""
        now = self.clock()
        cfg = self.cloaking
        newest, oldest = now + cfg.max_clock_skew_s, now - cfg.max_update_age_s
        codes: list[ReasonCode | None] = [None] * len(items)
        rows: list[tuple[str, float, float, float]] = []
        where: list[int] = []
        previous: dict[str, float | None] = {}
        pending, applied_t = self._pending_t, self.positions.index.latest_t  # as _last_t, inlined: per fix
        buckets = self._update_buckets
        bucket_now = buckets.clock()
        take = buckets.taker(bucket_now)
        add_row, add_where = rows.append, where.append
        if self.closing:  # nothing below awaits: it cannot change during the loop
            codes = [ReasonCode.SHUTDOWN] * len(items)
            items = []
        for i, (user, raw) in enumerate(items):
            if isinstance(raw, Fix):
                fix = raw
            else:
                try:
                    fix, _ = parse_fix(raw)
                except InvalidInput:
                    codes[i] = ReasonCode.INVALID
                    continue
            t = fix.t
            if t > newest:
                codes[i] = ReasonCode.INVALID
                continue
            if t < oldest:
                codes[i] = ReasonCode.TOO_OLD
                continue
            held = pending.get(user)
            last = held if held is not None else applied_t(user)
            if last is not None and t <= last:
                codes[i] = ReasonCode.OUT_OF_ORDER
                continue
            if not take(user):
                codes[i] = ReasonCode.RATE_LIMITED
                continue
            if user not in previous:
                previous[user] = held
            pending[user] = t
            add_row((user, t, fix.lat, fix.lon))
            add_where(i)
        buckets.prune(bucket_now)
        if rows and not self.movement.writer.try_reserve(len(rows)):
            self._refuse(codes, where, previous)
            rows = []
        if rows:
            mine = {user: pending[user] for user in previous}  # the times this call set
            try:
                await self.movement.append(rows, reserved=True, urgent=urgent)
            except Exception:
                log_event(log, "store_write_failed", logging.ERROR, store="movement", fixes=len(rows))
                self._refuse(codes, where, previous)
                rows = []
        if rows:
            self.positions.apply(rows)
            # The positions now hold each of these users' times: a pending time still the one this
            # call set is done with (a later call's newer one stays until that call is applied).
            for user, t in mine.items():
                if pending.get(user) is t:
                    del pending[user]
        else:
            self._settle(previous)
        n_ok = len(rows)
        if n_ok:
            self.metrics.updates_accepted.labels(transport=transport, source=source).inc(n_ok)
        if n_ok != len(codes):
            for outcome in codes:
                if outcome is not None:
                    self.metrics.updates_rejected.labels(transport=transport, reason=outcome.value).inc()
        self.metrics.users_indexed.set(len(self.positions))
        return FixResult(codes)

    def _refuse(self, codes: list[ReasonCode | None], where: list[int], previous: dict[str, float | None]) -> None:
        """The fixes at ``where`` passed every check but cannot be stored: ``overloaded``, and each
        user's pending time back to what it was before this call (None: none pending)."""
        for i in where:
            codes[i] = ReasonCode.OVERLOADED
        for user, t in previous.items():
            if t is None:
                self._pending_t.pop(user, None)
            else:
                self._pending_t[user] = t

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
        them (:meth:`own_fixes_decided`), so a query sees every fix of its user that was received
        before it, whatever the transport and whatever the size of the message that carried it."""
        coro = self.submit_fix_batch(transport, items) if batch else self.submit_fixes(transport, items, source=source)
        task = asyncio.create_task(coro)
        self._received(items, task)
        task.add_done_callback(self._decided)
        return task

    def decide_fix(
        self, transport: str, user: str, fix: Any, waiter: asyncio.Future[ReasonCode | None] | None = None
    ) -> asyncio.Future[ReasonCode | None]:
        """Submit one fix as received (one HTTP request); the future of its outcome: ``None`` =
        accepted (committed and applied), else the reason code (a future, not a coroutine: the
        request awaits it without a coroutine layer per fix). The fix counts as received at once,
        and a query of its user received later waits for it, as with :meth:`enqueue_fixes`. The
        single fixes received in one event-loop turn are one submission, without a task each: one
        check pass in the order received, one hand-over to the movement store, committed without
        its linger, and one wake-up per commit. Another submission received meanwhile closes the
        turn's batch, so fixes are still decided in the order received.

        ``waiter``: the caller's own future to resolve (and return) instead of a new one: a subclass
        may act on the outcome as it is set, a turn of the event loop before a done-callback would
        (the HTTP fast path writes its answer there)."""
        loop = asyncio.get_running_loop()
        batch = self._open_batch
        if batch is None or batch.transport != transport or len(batch.items) >= FIX_CHUNK:
            batch = _OpenBatch(transport, loop.create_future())
            self._received([(user, fix)], batch.decided)  # closes any open batch
            self._open_batch = batch
            task = loop.create_task(self._decide_batch(batch))  # runs after what was received before it
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)
        else:
            self._fixes_in_flight[user] = self._submissions[-1][1]  # the open batch's marker
        if waiter is None:
            waiter = loop.create_future()
        batch.items.append((user, fix))
        batch.waiters.append(waiter)
        return waiter

    async def _decide_batch(self, batch: _OpenBatch) -> None:
        if self._open_batch is batch:
            self._open_batch = None
        try:
            result = await self.submit_fixes(batch.transport, batch.items, urgent=True)
        except Exception as exc:  # a bug: every request of the batch fails alike (answered 500)
            _fail(batch.waiters, exc)
        except BaseException:  # cancelled (the loop is ending)
            _fail(batch.waiters, RuntimeError("fix batch cancelled"))
            raise
        else:
            for waiter, code in zip(batch.waiters, result.codes, strict=True):
                if not waiter.done():  # a request whose caller went away
                    waiter.set_result(code)
        finally:
            batch.decided.set_result(None)
            self._decided()

    def _received(self, items: list[tuple[str, Any]], pending: asyncio.Future[Any]) -> None:
        """Hold queries of the users of ``items`` until ``pending`` and every submission received
        before it are done (:meth:`own_fixes_decided`); :meth:`_decided` is called once it is done.

        One marker per submission, in order, rather than each user's set of pending submissions:
        the bookkeeping is one dictionary update per submission, not Python work per fix."""
        self._open_batch = None  # later single fixes are decided after this submission
        marker: asyncio.Future[None] = pending.get_loop().create_future()
        self._fixes_in_flight.update(zip(map(itemgetter(0), items), repeat(marker)))
        self._submissions.append((pending, marker))

    def _decided(self, _: asyncio.Future[Any] | None = None) -> None:
        """Mark the submissions decided in order, up to the first that is not; with none left
        undecided, forget every user's marker (all are done)."""
        submissions = self._submissions
        while submissions and submissions[0][0].done():
            _, marker = submissions.popleft()
            marker.set_result(None)
        if not submissions:
            self._fixes_in_flight.clear()

    async def own_fixes_decided(self, user: str) -> None:
        """Wait until the fixes of ``user`` received before now are decided (later ones are not
        waited for, so a steady stream of fixes never holds a query up)."""
        marker = self._fixes_in_flight.get(user)
        if marker is not None and not marker.done():
            await asyncio.wait((marker,))  # not the marker itself: a cancelled query must not cancel it


def _fail(waiters: list[asyncio.Future[ReasonCode | None]], exc: Exception) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_exception(exc)


__all__ = ["FIX_CHUNK", "FixIntake", "FixResult"]
