"""Admission and rate limits: what a query or a profile change must pass before the work starts.

The first checks of contract §2's order that need no position and no cloaker: the ``query_id``
and duplicates (:meth:`Admission.admit`, before a door promises an answer), then ``shutdown``,
``rate_limited`` (per-user query rate, pending queries, sessions) and ``overloaded``
(:meth:`Admission.refusal`). The per-user fix rate is fix intake's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from kcloak.broker.config import LimitsConfig
from kcloak.broker.errors import BrokerError
from kcloak.broker.ratelimit import DedupWindow, TokenBuckets
from kcloak.core.profile import ReasonCode
from kcloak.wire.payloads import InvalidInput, Query, parse_query


class Duplicate(BrokerError):
    """The ``query_id`` was already used by this user within the dedup window."""


class QueryRejected(BrokerError):
    """A query refused before it entered the pipeline proper (HTTP error statuses)."""

    def __init__(self, code: ReasonCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class Admission:
    """Per-user query and profile rates, pending queries and the dedup window (contract §1, §2).

    Keyword arguments: ``limits`` (rates, bursts, ``pending_queries_per_user``,
    ``dedup_window_s``), ``can_start_session`` (whether the user may start one more session).
    After :meth:`begin_shutdown` every query is refused ``shutdown``.
    """

    def __init__(self, *, limits: LimitsConfig, can_start_session: Callable[[str], bool]) -> None:
        self.limits = limits
        self.can_start_session = can_start_session
        self.closing = False
        self._query_buckets = TokenBuckets(limits.query_rate, limits.query_burst)
        self._profile_buckets = TokenBuckets(limits.profile_rate, limits.profile_burst)
        self._dedup = DedupWindow(limits.dedup_window_s)
        self._pending_per_user: dict[str, int] = {}

    def begin_shutdown(self) -> None:
        self.closing = True

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

    def profile_rate_ok(self, user: str) -> bool:
        return self._profile_buckets.take(user)

    def refusal(self, user: str, q: Query, *, queue_full: bool) -> tuple[ReasonCode, str] | None:
        """The first of ``shutdown``, ``rate_limited``, ``overloaded`` (cloaking queue ``queue_full``)
        that refuses this query, or None. Takes one token of the user's query rate once not closing."""
        if self.closing:
            return ReasonCode.SHUTDOWN, "the broker is shutting down"
        if not self._query_buckets.take(user):
            return ReasonCode.RATE_LIMITED, "query rate limit reached"
        if self._pending_per_user.get(user, 0) >= self.limits.pending_queries_per_user:
            return ReasonCode.RATE_LIMITED, "too many pending queries"
        if q.continuous and not self.can_start_session(user):
            return ReasonCode.RATE_LIMITED, "too many active sessions"
        if queue_full:
            return ReasonCode.OVERLOADED, "the cloaking queue is full"
        return None

    @contextlib.contextmanager
    def pending(self, user: str) -> Iterator[None]:
        """Count one pending query of ``user`` while the block runs."""
        self._pending_per_user[user] = self._pending_per_user.get(user, 0) + 1
        try:
            yield
        finally:
            left = self._pending_per_user.get(user, 1) - 1
            if left <= 0:
                self._pending_per_user.pop(user, None)
            else:
                self._pending_per_user[user] = left


__all__ = ["Admission", "Duplicate", "QueryRejected"]
