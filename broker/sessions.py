"""Continuous-query sessions in memory (contract §6; CONCEPTS §6.5).

A session belongs to one user, whatever the transport that started it, and holds what is fixed
at its start: the query's ``kind`` and parameters, the effective profile E and the shared group
(:class:`~kcloak.cloaking.continuous.SharedGroup`, k-sharing with memorization). The table enforces
``sessions.per_user`` active sessions per user and the ``idle_s`` / ``max_s`` expiry; sessions
never touch the disk and do not survive a restart. Session ids are 128 random bits from
:mod:`secrets` and never leave the broker except to their owner. :class:`ContinuousQueries`
starts, refreshes and stops sessions from a cloaked first region and the shared index views.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from kcloak.broker.forwarding import Background, Forwarder, Timing
from kcloak.broker.metrics import Metrics
from kcloak.broker.modes import Cloaked, Views
from kcloak.broker.positions import PositionReader
from kcloak.cloaking.cloakers import REFUSAL_MESSAGES, Refusal
from kcloak.cloaking.continuous import SessionError, SharedGroup, ends_session
from kcloak.core.logs import log_event
from kcloak.core.profile import PrivacyProfile, ReasonCode
from kcloak.wire.answers import Answer, SessionBrief
from kcloak.wire.payloads import Fix, Query

log = logging.getLogger("kcloak.pipeline")


class SessionState(enum.StrEnum):
    """The ``state`` of a session object (contract §6) and label of ``kcloak_sessions_closed_total``."""

    ACTIVE = "active"
    STOPPED = "stopped"
    EXPIRED = "expired"
    ENDED = "ended"


@dataclass(slots=True, eq=False)
class Session:
    """One continuous query: what its start fixed, its group and its clock."""

    session_id: str
    user: str
    kind: str
    radius_m: float | None
    n: int | None
    category: str | None
    profile: PrivacyProfile
    group: SharedGroup
    started_t: float
    expires_t: float
    last_refresh_t: float | None = None
    refreshes: int = 0
    state: SessionState = SessionState.ACTIVE

    def mismatch(self, q: Query) -> str | None:
        """The first field of a refresh that repeats a start parameter with another value, if any."""
        if q.kind is not None and q.kind != self.kind:
            return "kind"
        if q.radius_m is not None and q.radius_m != self.radius_m:
            return "radius_m"
        if q.n is not None and q.n != self.n:
            return "n"
        if q.category is not None and q.category != self.category:
            return "category"
        return None

    def brief(self) -> SessionBrief:
        """The ``session`` member of an answer: id, state, and ``expires_t`` while active."""
        expires_t = self.expires_t if self.state is SessionState.ACTIVE else None
        return SessionBrief(self.session_id, self.state.value, expires_t)

    def to_json(self) -> dict[str, Any]:
        """The session object of the GET route (contract §6)."""
        out: dict[str, Any] = {"session_id": self.session_id, "state": self.state.value, "kind": self.kind}
        if self.kind == "range":
            out["radius_m"] = self.radius_m
        else:
            out["n"] = self.n
        out.update(
            category=self.category,
            started_t=self.started_t,
            last_refresh_t=self.last_refresh_t,
            expires_t=self.expires_t,
            refreshes=self.refreshes,
        )
        return out


class SessionTable:
    """Active sessions of every user, with the per-user limit and expiry (contract §6).

    Keyword arguments: ``metrics`` (``kcloak_sessions_active``, ``kcloak_sessions_closed_total``),
    ``clock`` (Unix seconds), ``idle_s`` (a session with no refresh for this long expires, default
    120), ``max_s`` (lifetime cap, default 3600), ``per_user`` (active sessions per user, default 4).
    ``on_expired`` is called with every session closed ``expired`` (the broker publishes the
    status message from it), whether the sweep of :meth:`expire_due` or a lookup found it.
    """

    def __init__(
        self,
        *,
        metrics: Metrics,
        clock: Callable[[], float],
        idle_s: float = 120.0,
        max_s: float = 3600.0,
        per_user: int = 4,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.idle_s = idle_s
        self.max_s = max_s
        self.per_user = per_user
        self.on_expired: Callable[[Session], None] | None = None
        self._by_id: dict[str, Session] = {}
        self._by_user: dict[str, dict[str, Session]] = {}
        self._starting: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    # -- the per-user limit --------------------------------------------------------------------
    def can_start(self, user: str) -> bool:
        """True while the user has fewer than ``per_user`` active (or starting) sessions."""
        own = self._by_user.get(user)
        if own:
            now = self.clock()
            for s in [s for s in own.values() if now >= s.expires_t]:
                self.close(s, SessionState.EXPIRED)
        return len(self._by_user.get(user, ())) + self._starting.get(user, 0) < self.per_user

    def reserve(self, user: str) -> bool:
        """Hold a slot for a start in progress (give it back with :meth:`release` once opened or refused)."""
        if not self.can_start(user):
            return False
        self._starting[user] = self._starting.get(user, 0) + 1
        return True

    def release(self, user: str) -> None:
        left = self._starting.get(user, 0) - 1
        if left <= 0:
            self._starting.pop(user, None)
        else:
            self._starting[user] = left

    # -- lifecycle -----------------------------------------------------------------------------
    def open(self, user: str, q: Query, profile: PrivacyProfile, group: SharedGroup) -> Session:
        """Register a session whose first region was forwarded; returns it (state ``active``)."""
        assert q.kind is not None
        now = self.clock()
        sid = secrets.token_hex(16)
        while sid in self._by_id:
            sid = secrets.token_hex(16)
        session = Session(
            session_id=sid,
            user=user,
            kind=q.kind,
            radius_m=q.radius_m,
            n=q.n,
            category=q.category,
            profile=profile,
            group=group,
            started_t=now,
            expires_t=now + min(self.idle_s, self.max_s),
        )
        self._by_id[sid] = session
        self._by_user.setdefault(user, {})[sid] = session
        self.metrics.sessions_active.set(len(self._by_id))
        return session

    def peek(self, user: str, session_id: str) -> Session | None:
        """The user's session ``session_id`` if it is in the table (no expiry check)."""
        session = self._by_id.get(session_id)
        return session if session is not None and session.user == user else None

    def get(self, user: str, session_id: str) -> Session | None:
        """The user's active session ``session_id``; None when unknown, closed, expired or another
        user's. A session found past its expiry is closed ``expired`` here."""
        session = self.peek(user, session_id)
        if session is None:
            return None
        if self.clock() >= session.expires_t:
            self.close(session, SessionState.EXPIRED)
            return None
        return session

    def touch(self, session: Session) -> None:
        """A refresh reached the session: restart its idle clock (never past ``max_s``)."""
        now = self.clock()
        session.last_refresh_t = now
        session.refreshes += 1
        session.expires_t = min(now + self.idle_s, session.started_t + self.max_s)

    def close(self, session: Session, state: SessionState) -> None:
        """End an active session for good (``stopped``, ``expired`` or ``ended``)."""
        if session.state is not SessionState.ACTIVE:
            return
        session.state = state
        del self._by_id[session.session_id]
        own = self._by_user[session.user]
        del own[session.session_id]
        if not own:
            del self._by_user[session.user]
        self.metrics.sessions_closed.labels(state=state.value).inc()
        self.metrics.sessions_active.set(len(self._by_id))
        if state is SessionState.EXPIRED and self.on_expired is not None:
            self.on_expired(session)

    def expire_due(self) -> int:
        """Close every session whose expiry has passed; returns how many."""
        now = self.clock()
        due = [s for s in self._by_id.values() if now >= s.expires_t]
        for s in due:
            self.close(s, SessionState.EXPIRED)
        return len(due)

    def next_expiry(self) -> float | None:
        return min((s.expires_t for s in self._by_id.values()), default=None)


def session_status(session: Session, now: float) -> dict[str, Any]:
    """The ``kind: "session"`` status message (MQTT ``kcloak/v1/status/{user}``) of a closed session."""
    return {"kind": "session", "session_id": session.session_id, "state": session.state.value, "t": now}


class ContinuousQueries:
    """Starts, refreshes and stops sessions, and reports their expiry (contract §6; CONCEPTS §6.5).

    A start forwards the first region of a continuous query and opens the session only if that
    succeeds. A refresh forwards the bbox of the group's present members (never a new cloak), with
    the kind, parameters and effective profile fixed at the start; ``k_unreachable`` and
    ``area_exceeded`` end the session, ``stale_position`` keeps it.

    Keyword arguments: ``table`` (the :class:`SessionTable`), ``positions``, ``views`` (the shared
    index views), ``forwarder``, ``metrics``, ``algorithm`` (metric label), ``background`` (status
    messages are sent in it), ``clock``. ``notify`` publishes a session status message (``kind:
    session``) to a user; set it when MQTT is configured.
    """

    def __init__(
        self,
        *,
        table: SessionTable,
        positions: PositionReader,
        views: Views,
        forwarder: Forwarder,
        metrics: Metrics,
        algorithm: str,
        background: Background,
        clock: Callable[[], float],
    ) -> None:
        self.table = table
        self.positions = positions
        self.views = views
        self.forwarder = forwarder
        self.metrics = metrics
        self.algorithm = algorithm
        self.background = background
        self.clock = clock
        self.notify: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None
        table.on_expired = self._expired

    def kind_label(self, user: str, q: Query) -> str:
        """Metric ``kind`` of a query; a refresh that does not repeat ``kind`` counts as its session's."""
        if q.kind is None and q.session_id is not None and not q.stop:
            session = self.table.peek(user, q.session_id)
            if session is not None:
                return session.kind
        return q.metric_kind

    async def start(
        self, q: Query, user: str, profile: PrivacyProfile, cloaked: Cloaked, lost_group: ReasonCode, timing: Timing
    ) -> Answer:
        """Forward the first region; the session exists only if that succeeds.

        ``cloaked.view`` is the snapshot the region was cloaked (or counted) on: the group G is the
        present users strictly inside the region in it (k-sharing with memorization). When it no
        longer holds the querier and k users, the query is refused ``lost_group``.
        """
        assert cloaked.view is not None
        try:
            group = SharedGroup.start(cloaked.view, user, cloaked.region, profile)
        except SessionError:
            message = "the first region no longer holds the querier and k users"
            return Answer.refused(q.query_id, lost_group, message, self.clock())
        answer = await self.forwarder.forward(q, profile, cloaked.region, cloaked.lat, cloaked.lon, timing)
        if answer.status != "ok":
            return answer
        session = self.table.open(user, q, profile, group)
        log_event(log, "session_started", algorithm=self.algorithm, members=len(group.members))
        return answer.with_session(session.brief())

    async def refresh(
        self, user: str, q: Query, timing: Timing, carry: Callable[[Fix], Awaitable[ReasonCode | None]]
    ) -> Answer:
        """A refresh or a stop of one of the user's sessions; ``carry`` submits its carried fix."""
        qid = q.query_id
        assert q.session_id is not None
        session = self.table.get(user, q.session_id)
        if session is None:
            return Answer.refused(qid, ReasonCode.UNKNOWN_SESSION, "unknown session", self.clock())
        mismatch = session.mismatch(q)
        if mismatch is not None:
            message = f"{mismatch}: must equal the value the session started with"
            return self._refused(qid, ReasonCode.INVALID, message, session)
        if q.fix is not None:
            code = await carry(q.fix)
            if code is ReasonCode.INVALID or code is ReasonCode.SHUTDOWN:
                return self._refused(qid, code, "t: outside the accepted clock skew", session)
        if session.state is not SessionState.ACTIVE:  # closed while its carried fix was written
            return Answer.refused(qid, ReasonCode.UNKNOWN_SESSION, "unknown session", self.clock())
        if q.stop:
            self.table.close(session, SessionState.STOPPED)
            return Answer.stopped(qid, session.brief(), self.clock())
        self.table.touch(session)
        if not self.positions.is_present(user, self.clock()):
            return self._refused(qid, ReasonCode.STALE_POSITION, REFUSAL_MESSAGES[ReasonCode.STALE_POSITION], session)
        started = time.perf_counter()
        # The newest view: every member's latest accepted fix, not only the querier's.
        view = self.views.latest()
        result = session.group.refresh(view, user, session.profile)
        self.metrics.cloak_seconds.labels(algorithm=self.algorithm).observe(time.perf_counter() - started)
        if isinstance(result, Refusal):
            if ends_session(result):
                self.table.close(session, SessionState.ENDED)
                log_event(log, "session_closed", state="ended", reason=result.reason.value)
            return self._refused(qid, result.reason, result.message, session)
        fix = self.positions.fix(user)
        assert fix is not None
        fixed = replace(q, kind=session.kind, radius_m=session.radius_m, n=session.n, category=session.category)
        answer = await self.forwarder.forward(fixed, session.profile, result, fix[0], fix[1], timing)
        return answer.with_session(session.brief())

    def _refused(self, query_id: str, code: ReasonCode, message: str, session: Session) -> Answer:
        """A refusal carrying the session (every answer to a session's refresh or stop does)."""
        return Answer.refused(query_id, code, message, self.clock()).with_session(session.brief())

    def session_object(self, user: str, session_id: str) -> dict[str, Any] | None:
        """The session object of ``GET …/sessions/{id}``; None when unknown to this user (contract §6)."""
        session = self.table.get(user, session_id)
        return None if session is None else session.to_json()

    def stop(self, user: str, session_id: str) -> bool:
        """``DELETE …/sessions/{id}``: stop the user's active session; False when unknown."""
        session = self.table.get(user, session_id)
        if session is None:
            return False
        self.table.close(session, SessionState.STOPPED)
        return True

    def _expired(self, session: Session) -> None:
        log_event(log, "session_closed", state="expired")
        if self.notify is not None:
            self.background.spawn(self._notify(session.user, session_status(session, self.clock())))

    async def _notify(self, user: str, body: dict[str, Any]) -> None:
        assert self.notify is not None
        try:
            await self.notify(user, body)
        except Exception:
            log_event(log, "session_status_failed", logging.WARNING)

    async def run(self) -> None:
        """Expire idle or over-age sessions (contract §6) about once a second; runs until cancelled."""
        while True:
            self.table.expire_due()
            nxt = self.table.next_expiry()
            delay = 1.0 if nxt is None else min(1.0, max(nxt - self.clock(), 0.02))
            await asyncio.sleep(delay)


__all__ = ["ContinuousQueries", "Session", "SessionState", "SessionTable", "session_status"]
