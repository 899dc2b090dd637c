"""The cluster gateway (docs/cluster.md "Gateway"): kcloak's own MQTT and HTTP doors in front of JetStream.

The doors (:mod:`kcloak.broker.mqtt`, :mod:`kcloak.broker.http_server`) run unchanged: they do the
transport checks (size, JSON, auth and ACL, retained input, topic user) and call a
:class:`ClusterPipeline` exactly as they call the single-process
:class:`~kcloak.broker.pipeline.Pipeline`. Instead of deciding, the cluster pipeline publishes each
message to the intake stream ``KCLOAK_IN`` on ``kcloak.in.<p>.<kind>.<token>`` and reports success to
the door only after the JetStream ``PubAck``, so an MQTT PUBACK or an HTTP response always follows the
moment the message is in the replicated stream (NATS's own MQTT listener acknowledges before that:
pinned fact 2). Envelope: body = the app's message as JSON; headers ``Nats-Msg-Id`` =
``<gateway name>/<counter>`` (a retried publish is stored once), ``Kcloak-Transport`` and, where the
door needs the router's outcome, ``Kcloak-Reply`` (a core-NATS inbox of this gateway).

- A publish that fails or times out (a stream leader failover takes about 5 s) is retried with the same
  message id until ``retry_budget_s`` has passed; then the message is refused ``overloaded``: an HTTP 503,
  or for MQTT no PUBACK (the door closes the connection, the app sends it again). Never acknowledged
  without a PubAck.
- One user's messages reach the stream in the order this gateway received them, retries included: each
  publish of a user waits for the PubAck (or the final failure) of the user's previous one.
- Fixes are batched per partition (and transport): while a partition's intake message is waiting for its
  PubAck, the fix messages that arrive for that partition queue up and go as one ``batch`` message next
  (at most ``BATCH_MAX_FIXES`` fixes, ``BATCH_MAX_BYTES`` bytes). No timer: a lone fix goes at once; under
  load a PubAck round trip gathers the next batch. One message in flight per partition keeps each user's
  order, retries included.
- A query: publish it with ``Kcloak-Reply`` (this gateway's inbox), wait for the stored answer that its
  router or cell owner sends there once it is in the answers stream (bounded: the contract's
  ``max_delay_s + upstream.deadline_s + 1 s``; then, if the stream holds no answer either, ``overloaded``,
  as the single process answers a query still waiting then). A query id whose answer is already stored is a
  ``duplicate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from kcloak.broker.admission import Admission, Duplicate, QueryRejected
from kcloak.broker.cluster.answers import read_answer
from kcloak.broker.cluster.codec import decode_any, encode
from kcloak.broker.cluster.topology import (
    PROFILES_BUCKET,
    Layout,
    ensure_layout,
    in_subject,
    partition_of,
    require_nats,
    subject_token,
)
from kcloak.broker.config import Config
from kcloak.broker.intake import FixResult
from kcloak.broker.metrics import LATENCY_BUCKETS, Counter, Histogram, Metrics
from kcloak.broker.pipeline import Pipeline, QueryOutcome
from kcloak.broker.service import Service, StartupError
from kcloak.broker.stores import StoreError
from kcloak.core.logs import log_event
from kcloak.core.profile import PrivacyProfile, ProfileError, ReasonCode
from kcloak.wire.answers import Answer
from kcloak.wire.payloads import Fix, InvalidInput, parse_query

if TYPE_CHECKING:
    from kcloak.broker.auth import TokenStore
    from kcloak.cloaking.cells import CellMap

log = logging.getLogger("kcloak.gateway")

PUBLISH_TIMEOUT_S = 2.0
"""One JetStream publish attempt waits this long for its PubAck."""
RETRY_BUDGET_S = 15.0
"""A message is retried (same ``Nats-Msg-Id``) until this long after its first attempt, then refused."""
REPLY_TIMEOUT_S = 15.0
"""How long an HTTP fix or a profile change waits for the router's outcome on ``Kcloak-Reply``."""
CONNECT_TIMEOUT_S = 10.0
BATCH_MAX_FIXES = 256
"""Most fixes in one intake ``batch`` message of a partition."""
BATCH_MAX_BYTES = 256 * 1024
"""Most bytes of one intake ``batch`` message (well under NATS's default ``max_payload`` of 1 MB)."""


def safe_endpoint(url: str) -> str:
    """``host:port`` of a NATS URL: never its user, password or token."""
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host = parts.hostname or "?"
        port = parts.port or 4222
    except ValueError:
        return "an unparseable URL"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class GatewayMetrics:
    """The gateway's own series, on the broker's registry (labels from fixed sets only)."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.publish_seconds = Histogram(
            "kcloak_gateway_publish_seconds",
            "From a message's first publish attempt to its JetStream PubAck",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.publish_retries = Counter(
            "kcloak_gateway_publish_retries", "Publish attempts repeated (same Nats-Msg-Id)", ["kind"], registry=r
        )
        self.publish_failed = Counter(
            "kcloak_gateway_publish_failed",
            "Messages refused overloaded: no PubAck within the retry budget",
            ["kind"],
            registry=r,
        )
        self.reply_timeouts = Counter(
            "kcloak_gateway_reply_timeouts",
            "Router outcomes or answers that did not arrive in time",
            ["kind"],
            registry=r,
        )


class _NatsHealth:
    """The NATS connection as one of ``/healthz``'s ``stores``: ``failing`` (503 degraded) while disconnected."""

    store = "nats"

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    @property
    def healthy(self) -> bool:
        return self._state.get("nats") == "connected"


class _NoUpstream:
    """The gateway calls no upstream (the cell owners do): ``/healthz`` reports it unknown."""

    healthy: bool | None = None


@dataclass(slots=True)
class StoredAnswer:
    """An answer as the answers stream holds it, with what the doors read of an :class:`Answer`."""

    body: dict[str, Any]
    status: str = field(init=False)
    reason: ReasonCode | None = field(init=False)
    message: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.status = "ok" if self.body.get("status") == "ok" else "refused"
        raw = self.body.get("reason")
        try:
            self.reason = ReasonCode(raw) if isinstance(raw, str) else None
        except ValueError:
            self.reason = ReasonCode.INTERNAL
        message = self.body.get("message")
        self.message = message if isinstance(message, str) else None

    @property
    def reason_label(self) -> str:
        return self.reason.value if self.reason is not None else "none"

    def to_json(self) -> dict[str, Any]:
        return self.body


@dataclass(slots=True, eq=False)
class _Tail:
    """A user's latest message at this gateway: ``done`` ends with its publish (True: PubAcked), ``queue`` is
    the partition queue it entered (batched fixes; None for others and before it entered)."""

    done: asyncio.Future[bool]
    queue: tuple[int, str] | None = None


@dataclass(slots=True, eq=False)
class _Queued:
    """One fix message waiting in its partition's queue (see :meth:`ClusterPipeline._enqueue_fixes`)."""

    user: str
    token: str
    kind: str
    data: bytes
    fixes: int
    tail: _Tail
    codes: asyncio.Future[list[ReasonCode | None]] | None

    @property
    def wire_size(self) -> int:
        """Its bytes in a ``batch`` message: the body, the user token and the item's JSON frame."""
        return len(self.data) + len(self.token) + 40


def _fix_object(raw: Any) -> Any:
    """A fix as JSON: a parsed :class:`Fix` (HTTP) or the app's object (MQTT, validated by the router)."""
    if isinstance(raw, Fix):
        return {"lat": raw.lat, "lon": raw.lon, "t": raw.t}
    return raw


def _reason(code: Any) -> ReasonCode | None:
    if code is None:
        return None
    try:
        return ReasonCode(code)
    except ValueError:
        return ReasonCode.INTERNAL


class ClusterPipeline:
    """The surface of :class:`~kcloak.broker.pipeline.Pipeline` that the doors call, over JetStream.

    Keyword arguments: ``nc`` (a connected ``nats.aio.client.Client``), ``config``, ``metrics``,
    ``layout``, ``name`` (this gateway's name, the prefix of its message ids), and the bounds
    ``publish_timeout_s``, ``retry_budget_s``, ``reply_timeout_s``. Call :meth:`start` before use.
    """

    def __init__(
        self,
        *,
        nc: Any,
        config: Config,
        metrics: Metrics,
        layout: Layout,
        name: str,
        publish_timeout_s: float = PUBLISH_TIMEOUT_S,
        retry_budget_s: float = RETRY_BUDGET_S,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=publish_timeout_s)
        self.config = config
        self.metrics = metrics
        self.layout = layout
        self.name = name
        self.upstream = _NoUpstream()
        self.publish_timeout_s = publish_timeout_s
        self.retry_budget_s = retry_budget_s
        self.reply_timeout_s = reply_timeout_s
        self.default_profile = config.profile.to_profile()
        self.gw = GatewayMetrics(metrics)
        self.admission = Admission(limits=config.limits, can_start_session=lambda _user: False)
        self._counter = itertools.count(1)
        self._tails: dict[str, _Tail] = {}
        self._queues: dict[tuple[int, str], deque[_Queued]] = {}
        self._draining: set[tuple[int, str]] = set()
        self._replies: dict[str, asyncio.Future[bytes]] = {}
        self._reply_prefix = ""
        self._reply_sub: Any = None
        self._profiles: dict[str, tuple[PrivacyProfile, str, float | None]] = {}
        self._inflight: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.session_status: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe to this gateway's reply inbox (``Kcloak-Reply`` subjects are ``<inbox>.<n>``)."""
        self._reply_prefix = self.nc.new_inbox()
        self._reply_sub = await self.nc.subscribe(self._reply_prefix + ".*", cb=self._on_reply)

    async def _on_reply(self, msg: Any) -> None:
        fut = self._replies.pop(msg.subject, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.data)

    @property
    def closing(self) -> bool:
        return self._closing

    def begin_shutdown(self) -> None:
        self._closing = True
        self.admission.begin_shutdown()

    async def drain(self, grace_s: float) -> None:
        """Let messages in flight reach the stream (and queries their answers) within ``grace_s``."""
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        if self._reply_sub is not None:
            with contextlib.suppress(Exception):
                await self._reply_sub.unsubscribe()

    def _track(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    # -- publishing ----------------------------------------------------------------------------
    def _subject(self, user: str, kind: str) -> str:
        token = subject_token(user)
        return in_subject(partition_of(token, self.layout.partitions), kind, token)

    async def publish(self, user: str, kind: str, body: Any, *, transport: str, reply: str | None = None) -> bool:
        """Publish one message of ``user`` to the intake stream after the user's previous one; True once
        PubAcked, False when the retry budget ran out (counted; the caller refuses it ``overloaded``)."""
        mine = _Tail(asyncio.get_running_loop().create_future())
        ok = False
        try:
            await self._after_previous(user, mine)
            payload = json.dumps(body, separators=(",", ":")).encode()
            ok = await self._publish(self._subject(user, kind), kind, payload, transport, reply)
            return ok
        finally:
            self._tail_done(user, mine, ok)

    async def _after_previous(self, user: str, mine: _Tail, queue: tuple[int, str] | None = None) -> None:
        """Make ``mine`` the user's latest message and wait until his previous one was published, unless it is
        already in the same partition queue (which keeps their order)."""
        previous = self._tails.get(user)
        self._tails[user] = mine
        if previous is None or previous.done.done() or (queue is not None and previous.queue == queue):
            return
        with contextlib.suppress(BaseException):
            await asyncio.shield(previous.done)

    def _tail_done(self, user: str, tail: _Tail, ok: bool) -> None:
        if not tail.done.done():
            tail.done.set_result(ok)
        if self._tails.get(user) is tail:
            del self._tails[user]

    async def _publish(
        self,
        subject: str,
        kind: str,
        payload: bytes,
        transport: str,
        reply: str | None,
        *,
        kinds: list[str] | None = None,
    ) -> bool:
        """One intake message, retried with one message id; a final failure counts each of ``kinds`` (the
        app messages it carried; default: ``kind``) as failed."""
        from nats.errors import Error as NatsError

        headers = {"Nats-Msg-Id": f"{self.name}/{next(self._counter)}", "Kcloak-Transport": transport}
        if reply is not None:
            headers["Kcloak-Reply"] = reply
        started = time.monotonic()
        deadline = started + self.retry_budget_s
        attempt = 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            try:
                await self.js.publish(
                    subject, payload, timeout=max(0.1, min(self.publish_timeout_s, left)), headers=headers
                )
            except (NatsError, TimeoutError) as exc:
                error = type(exc).__name__
            else:
                self.gw.publish_seconds.labels(kind=kind).observe(time.monotonic() - started)
                return True
            pause = min(0.25 * attempt, 1.0)
            if time.monotonic() + pause >= deadline:
                for failed in kinds or [kind]:
                    self.gw.publish_failed.labels(kind=failed).inc()
                log_event(log, "gateway_publish_failed", logging.WARNING, kind=kind, attempts=attempt, error=error)
                return False
            self.gw.publish_retries.labels(kind=kind).inc()
            await asyncio.sleep(pause)

    # -- fix batches per partition -------------------------------------------------------------------
    async def _enqueue_fixes(
        self, user: str, kind: str, body: Any, fixes: int, transport: str, *, want_codes: bool
    ) -> _Queued:
        """Queue one fix message of ``user`` on his partition's queue (after his previous message of another
        kind or queue was published); :meth:`_drain` publishes the queue in batches."""
        token = subject_token(user)
        key = (partition_of(token, self.layout.partitions), transport)
        loop = asyncio.get_running_loop()
        mine = _Tail(loop.create_future())
        await self._after_previous(user, mine, key)
        data = encode(body)
        entry = _Queued(user, token, kind, data, fixes, mine, loop.create_future() if want_codes else None)
        mine.queue = key
        self._queues.setdefault(key, deque()).append(entry)
        if key not in self._draining:
            self._draining.add(key)
            self._track(self._drain(key))
        return entry

    async def _drain(self, key: tuple[int, str]) -> None:
        """Publish partition ``key``'s queue, one intake message at a time, as many fixes per message as have
        queued up meanwhile."""
        queue = self._queues[key]
        try:
            while queue:
                batch = [queue.popleft()]
                fixes, size = batch[0].fixes, batch[0].wire_size
                while (
                    queue and fixes + queue[0].fixes <= BATCH_MAX_FIXES and size + queue[0].wire_size < BATCH_MAX_BYTES
                ):
                    entry = queue.popleft()
                    batch.append(entry)
                    fixes, size = fixes + entry.fixes, size + entry.wire_size
                await self._send_batch(key, batch)
        finally:
            self._draining.discard(key)
            if queue:  # cancelled at shutdown: what is left was never published (no PUBACK, refused)
                for entry in queue:
                    self._settle_entry(entry, False, key[1])
                queue.clear()

    async def _send_batch(self, key: tuple[int, str], batch: list[_Queued]) -> None:
        partition, transport = key
        if len(batch) == 1:
            kind, subject, payload = batch[0].kind, in_subject(partition, batch[0].kind, batch[0].token), batch[0].data
        else:
            kind, subject = "batch", in_subject(partition, "batch", batch[0].token)
            payload = (
                b'{"batch":['
                + b",".join(
                    b'{"user":%s,"kind":"%s","body":%s}' % (json.dumps(e.token).encode(), e.kind.encode(), e.data)
                    for e in batch
                )
                + b"]}"
            )
        reply, fut = self._reply_future() if transport == "http" else (None, None)
        ok = False
        try:
            ok = await self._publish(subject, kind, payload, transport, reply, kinds=[e.kind for e in batch])
        finally:
            if not ok and reply is not None:
                self._replies.pop(reply, None)
            for entry in batch:
                self._settle_entry(entry, ok, transport)
        if ok and reply is not None and fut is not None:
            self._track(self._split_outcome(reply, fut, kind, batch))

    def _settle_entry(self, entry: _Queued, ok: bool, transport: str) -> None:
        self._tail_done(entry.user, entry.tail, ok)
        if not ok:
            self._count_refused(transport, entry.kind, ReasonCode.OVERLOADED, entry.fixes)
            if entry.codes is not None and not entry.codes.done():
                entry.codes.set_result([ReasonCode.OVERLOADED] * entry.fixes)

    async def _split_outcome(self, reply: str, fut: asyncio.Future[bytes], kind: str, batch: list[_Queued]) -> None:
        """The router's per-fix outcome of one intake message, handed to each fix message it carried."""
        outcome = await self._await_reply(reply, fut, kind)
        codes = outcome.get("codes") if outcome is not None else None
        if not isinstance(codes, list) or len(codes) != sum(e.fixes for e in batch):
            # In the stream (it will be decided), but its outcome is unknown here: 503, and a repeat of
            # the same fix is harmless (refused out_of_order once the first is applied).
            codes = [ReasonCode.OVERLOADED.value] * sum(e.fixes for e in batch)
        at = 0
        for entry in batch:
            if entry.codes is not None and not entry.codes.done():
                entry.codes.set_result([_reason(code) for code in codes[at : at + entry.fixes]])
            at += entry.fixes

    def _reply_future(self) -> tuple[str, asyncio.Future[bytes]]:
        subject = f"{self._reply_prefix}.{next(self._counter)}"
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._replies[subject] = fut
        return subject, fut

    async def _await_reply(self, subject: str, fut: asyncio.Future[bytes], kind: str) -> dict[str, Any] | None:
        try:
            async with asyncio.timeout(self.reply_timeout_s):
                data = await fut
        except TimeoutError:
            self.gw.reply_timeouts.labels(kind=kind).inc()
            return None
        finally:
            self._replies.pop(subject, None)
        try:
            obj = json.loads(data)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    # -- fixes ---------------------------------------------------------------------------------
    def enqueue_fixes(
        self, transport: str, items: list[tuple[str, Any]], *, batch: bool = False, source: str = "update"
    ) -> asyncio.Task[FixResult]:
        """Publish fixes as received. MQTT: the task ends once every fix is PubAcked (all codes None:
        durable, the router decides later) or is cancelled when one could not be (no PUBACK then).
        HTTP: it ends with the router's per-fix outcome; ``overloaded`` for what could not be published
        or whose outcome did not come back in time."""
        if transport == "mqtt":
            return self._track(self._mqtt_fixes(items, batch))
        return self._track(self._http_fixes(items, batch))

    def decide_fix(
        self, transport: str, user: str, fix: Any, waiter: asyncio.Future[ReasonCode | None] | None = None
    ) -> Awaitable[ReasonCode | None]:
        """:meth:`enqueue_fixes` of one fix, its code once decided (``None`` = accepted; the HTTP
        single-fix route); with ``waiter``, that future is resolved and returned (as
        :meth:`Pipeline.decide_fix`)."""
        decided = asyncio.ensure_future(self._decide_fix(transport, user, fix))
        if waiter is None:
            return decided
        decided.add_done_callback(partial(_resolve, waiter))
        return waiter

    async def _decide_fix(self, transport: str, user: str, fix: Any) -> ReasonCode | None:
        return (await self.enqueue_fixes(transport, [(user, fix)])).codes[0]

    def _messages(self, items: list[tuple[str, Any]], batch: bool) -> list[tuple[str, str, Any, list[int]]]:
        """``(user, kind, body, item positions)`` per intake message: a batch becomes one ``updates``
        message per user (partitions are per user), a single fix one ``update``."""
        if not batch:
            return [(user, "update", _fix_object(raw), [i]) for i, (user, raw) in enumerate(items)]
        per_user: dict[str, list[int]] = {}
        for i, (user, _) in enumerate(items):
            per_user.setdefault(user, []).append(i)
        return [
            (user, "updates", {"updates": [_fix_object(items[i][1]) for i in where]}, where)
            for user, where in per_user.items()
        ]

    def _count_refused(self, transport: str, kind: str, code: ReasonCode, fixes: int) -> None:
        self.metrics.updates_rejected.labels(transport=transport, reason=code.value).inc(fixes)
        self.metrics.messages_dropped.labels(transport=transport, topic=kind, reason=code.value).inc()

    async def _mqtt_fixes(self, items: list[tuple[str, Any]], batch: bool) -> FixResult:
        if self._closing:
            raise asyncio.CancelledError  # not stored: no PUBACK, the app sends it again to the next gateway
        entries = await asyncio.gather(
            *(
                self._enqueue_fixes(u, k, b, len(w), "mqtt", want_codes=False)
                for u, k, b, w in self._messages(items, batch)
            )
        )
        sent = await asyncio.gather(*(entry.tail.done for entry in entries))
        if not all(sent):
            raise asyncio.CancelledError  # never acknowledged without a PubAck
        return FixResult([None] * len(items))

    async def _http_fixes(self, items: list[tuple[str, Any]], batch: bool) -> FixResult:
        codes: list[ReasonCode | None] = [None] * len(items)
        if self._closing:
            return FixResult([ReasonCode.SHUTDOWN] * len(items))
        messages = self._messages(items, batch)
        outcomes = await asyncio.gather(*(self._http_message(u, k, b, where) for u, k, b, where in messages))
        for (_, _, _, where), got in zip(messages, outcomes, strict=True):
            for i, code in zip(where, got, strict=True):
                codes[i] = code
        return FixResult(codes)

    async def _http_message(self, user: str, kind: str, body: Any, where: list[int]) -> list[ReasonCode | None]:
        entry = await self._enqueue_fixes(user, kind, body, len(where), "http", want_codes=True)
        assert entry.codes is not None
        return await entry.codes

    # -- profiles ------------------------------------------------------------------------------
    def get_profile(self, user: str) -> tuple[PrivacyProfile, str, float | None]:
        """The profile this gateway last saw for ``user`` (:meth:`load_profile` reads the bucket)."""
        return self._profiles.get(user, (self.default_profile, "default", None))

    async def load_profile(self, user: str) -> tuple[PrivacyProfile, str, float | None]:
        """The stored profile from KV ``kcloak_profiles`` (key: the user's subject token); the default
        when none is stored. Value: ``{"profile": {...}, "updated_t": t}`` (or the profile object)."""
        from nats.errors import Error as NatsError
        from nats.js.errors import KeyNotFoundError

        try:
            kv = await self.js.key_value(PROFILES_BUCKET)
            entry = await kv.get(subject_token(user))
        except KeyNotFoundError:
            self._profiles.pop(user, None)
            return self.default_profile, "default", None
        except (NatsError, TimeoutError) as exc:
            raise StoreError(f"the profile bucket cannot be read ({type(exc).__name__})") from None
        value = entry.value
        if not value:  # deleted
            self._profiles.pop(user, None)
            return self.default_profile, "default", None
        obj = json.loads(value)
        data = obj.get("profile", obj) if isinstance(obj, dict) else {}
        updated = obj.get("updated_t") if isinstance(obj, dict) else None
        got = (
            PrivacyProfile.from_mapping(data, self.default_profile),
            "stored",
            float(updated) if isinstance(updated, int | float) else None,
        )
        self._profiles[user] = got
        return got

    def profile_rate_ok(self, user: str) -> bool:
        return self.admission.profile_rate_ok(user)

    async def set_profile(self, user: str, data: dict[str, Any] | None) -> PrivacyProfile:
        """Send the change to the user's router and return its outcome; raises :class:`ProfileError`
        (refused ``invalid``) or :class:`StoreError` (not published, not decided in time, or refused
        for another reason: the doors answer ``overloaded``)."""
        if self._closing:
            raise StoreError("the gateway is shutting down")
        if data is not None:  # the router validates too; checking here gives the field at once
            PrivacyProfile.from_mapping(data, self.default_profile)
        reply, fut = self._reply_future()
        if not await self.publish(user, "profile", {"profile": data}, transport="gateway", reply=reply):
            self._replies.pop(reply, None)
            raise StoreError("the cluster intake did not take the profile in time")
        outcome = await self._await_reply(reply, fut, "profile")
        if outcome is None:
            raise StoreError("the profile's outcome did not arrive in time")
        if outcome.get("status") != "ok":
            reason = outcome.get("reason")
            if reason == ReasonCode.INVALID.value:
                fld = outcome.get("field")
                raise ProfileError(ReasonCode.INVALID, fld if isinstance(fld, str) else None, "profile: refused")
            raise StoreError("the profile was not stored")
        stored = outcome.get("profile")
        profile = PrivacyProfile.from_mapping(stored if isinstance(stored, dict) else data, self.default_profile)
        updated = outcome.get("updated_t")
        if data is None:
            self._profiles.pop(user, None)
        else:
            self._profiles[user] = (profile, "stored", float(updated) if isinstance(updated, int | float) else None)
        return profile

    # -- queries -------------------------------------------------------------------------------
    def admit(self, user: str, obj: dict[str, Any]) -> str:
        """The query id and this gateway's dedup window (:meth:`is_answered` asks the answers stream)."""
        return self.admission.admit(user, obj)

    async def is_answered(self, user: str, query_id: str) -> bool:
        """Whether the answers stream already holds an answer to this query (a ``duplicate``)."""
        return await self._stored_answer(user, query_id) is not None

    async def _stored_answer(self, user: str, query_id: str) -> dict[str, Any] | None:
        from nats.errors import Error as NatsError

        try:
            data = await read_answer(self.nc, subject_token(user), subject_token(query_id))
        except (NatsError, TimeoutError) as exc:
            log_event(log, "gateway_answer_lookup_failed", logging.WARNING, error=type(exc).__name__)
            return None
        try:
            obj = decode_any(data or b"")
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    async def query(self, transport: str, user: str, query_id: str, obj: dict[str, Any]) -> QueryOutcome:
        return await asyncio.shield(self.start_query(transport, user, query_id, obj))

    def start_query(self, transport: str, user: str, query_id: str, obj: dict[str, Any]) -> asyncio.Task[QueryOutcome]:
        return self._track(self._run_query(transport, user, query_id, obj))

    def answer_wait_s(self, profile: PrivacyProfile | None = None) -> float:
        """The contract's bound on waiting for an answer (``max_delay_s + upstream.deadline_s + 1 s``)."""
        stored = profile if profile is not None else self.default_profile
        return stored.max_delay_s + self.config.upstream.deadline_s + 1.0

    async def _run_query(self, transport: str, user: str, query_id: str, obj: dict[str, Any]) -> QueryOutcome:
        kind = obj.get("kind")
        kind_label = kind if kind in ("range", "knn") else "unknown"
        try:
            parse_query(obj)  # the schema at the door, as one process checks it (contract §2 order)
        except InvalidInput as exc:
            return self._finish(
                transport, kind_label, Answer.refused(query_id, ReasonCode.INVALID, str(exc), time.time())
            )
        if self._closing:
            return self._finish(
                transport,
                kind_label,
                Answer.refused(query_id, ReasonCode.SHUTDOWN, "the broker is shutting down", time.time()),
            )
        # The answer comes on this gateway's reply inbox (Kcloak-Reply): whoever stores it sends the stored one.
        reply, got = self._reply_future()
        try:
            wait_s = self.answer_wait_s(self.get_profile(user)[0])
            if not await self.publish(user, "query", obj, transport=transport, reply=reply):
                answer: Answer | StoredAnswer = Answer.refused(
                    query_id, ReasonCode.OVERLOADED, "the cluster intake is unavailable; retry later", time.time()
                )
                return self._finish(transport, kind_label, answer)
            try:
                async with asyncio.timeout(max(wait_s - 0.5, 0.5)):
                    data = await got
                body = decode_any(data)
            except (TimeoutError, ValueError):
                body = await self._stored_answer(user, query_id)  # stored, but its reply was missed
            if isinstance(body, dict):
                return self._finish(transport, kind_label, StoredAnswer(body))
            self.gw.reply_timeouts.labels(kind="query").inc()
            answer = Answer.refused(query_id, ReasonCode.OVERLOADED, "no answer in time", time.time())
            return self._finish(transport, kind_label, answer)
        finally:
            self._replies.pop(reply, None)

    def _finish(self, transport: str, kind_label: str, answer: Answer | StoredAnswer) -> QueryOutcome:
        self.metrics.queries.labels(
            transport=transport, kind=kind_label, status=answer.status, reason=answer.reason_label
        ).inc()
        return QueryOutcome(cast(Answer, answer), kind_label, answer.status, answer.reason_label)

    # -- sessions (not in a cluster yet) -------------------------------------------------------
    def session_object(self, user: str, session_id: str) -> dict[str, Any] | None:
        return None

    def stop_session(self, user: str, session_id: str) -> bool:
        return False


class ClusterGateway(Service):
    """``kcloak serve --cluster``: NATS connection, layout, the doors, and (unless ``worker`` is False)
    one :class:`~kcloak.broker.cluster.worker.Worker`, as one async context manager like
    :class:`~kcloak.broker.service.Broker` (the same :class:`~kcloak.broker.service.Service`)."""

    STOPPED_EVENT = "gateway_stopped"
    pipeline: ClusterPipeline | None

    def __init__(
        self,
        *,
        config: Config,
        tokens: TokenStore | None,
        servers: list[str],
        layout: Layout,
        cells: CellMap,
        name: str,
        worker: bool = True,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        dask_scheduler: str | None = None,
    ) -> None:
        super().__init__(config=config, tokens=tokens)
        self.servers = servers
        self.layout = layout
        self.cells = cells
        self.name = name
        self.with_worker = worker
        self.dask_scheduler = dask_scheduler
        self.connect_timeout_s = connect_timeout_s
        self.worker: Any = None
        self.nc: Any = None

    def where(self) -> str:
        shown = ", ".join(safe_endpoint(url) for url in self.servers[:3])
        more = len(self.servers) - 3
        return shown + (f" (and {more} more)" if more > 0 else "")

    async def _connect(self) -> Any:
        nats = require_nats()

        async def quiet(exc: Exception) -> None:  # nats-py logs whole tracebacks by default
            log_event(log, "nats_error", logging.WARNING, error=type(exc).__name__)

        async def disconnected() -> None:
            self.state["nats"] = "disconnected"

        async def reconnected() -> None:
            self.state["nats"] = "connected"

        try:
            async with asyncio.timeout(self.connect_timeout_s):
                nc = await nats.connect(
                    servers=self.servers,
                    name=self.name,
                    connect_timeout=2,
                    reconnect_time_wait=0.5,
                    max_reconnect_attempts=-1,
                    error_cb=quiet,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            reason = f"cannot reach NATS at {self.where()} within {self.connect_timeout_s:g} s"
            raise StartupError(f"cluster: {reason} ({type(exc).__name__})") from None
        self.state["nats"] = "connected"
        self.state["stores"] = [_NatsHealth(self.state)]
        return nc

    async def _start(self) -> None:
        from kcloak.broker.cluster.topology import JetStreamApiError

        cfg = self.config
        self.nc = await self._connect()
        self._stack.push_async_callback(self._close_nats)
        try:
            await ensure_layout(self.nc, self.layout)
        except (JetStreamApiError, TimeoutError, Exception) as exc:
            raise StartupError(
                f"cluster: cannot create the JetStream layout ({str(exc)[:200] or type(exc).__name__})"
            ) from None
        self.pipeline = ClusterPipeline(
            nc=self.nc, config=cfg, metrics=self.metrics, layout=self.layout, name=self.name
        )
        await self.pipeline.start()
        if self.with_worker:
            await self._start_worker()
        if cfg.mqtt.mode == "embedded":
            await self._start_mqtt()
        if cfg.http.listen != "none":
            await self._start_http()
        self._stack.push_async_callback(self._cancel_tasks)
        log_event(
            log,
            "gateway_started",
            name=self.name,
            nats=self.where(),
            partitions=self.layout.partitions,
            cells=self.layout.cells,
            replicas=self.layout.replicas,
            worker=self.worker is not None,
            auth="tokens" if self.tokens else "open",
        )

    async def _start_worker(self) -> None:
        from kcloak.broker.cluster.moves import timer_params
        from kcloak.broker.cluster.worker import Worker

        worker = Worker(
            servers=self.servers,
            layout=self.layout,
            cells=self.cells,
            config=self.config,
            metrics=self.metrics,
            name=self.name,
            timer=timer_params(self.config),
            dask_scheduler=self.dask_scheduler,
        )
        try:
            await worker.start()
        except Exception as exc:
            raise StartupError(f"cluster: the worker could not start ({type(exc).__name__})") from None
        self.worker = worker
        self._stack.push_async_callback(worker.stop)

    async def _start_mqtt(self) -> None:
        from kcloak.broker.mqtt import MqttDoor

        assert self.pipeline is not None
        door = MqttDoor(
            pipeline=cast(Pipeline, self.pipeline),
            config=self.config,
            tokens_mode=self.tokens is not None,
            state=self.state,
        )
        await self._listen_mqtt(door)
        self._tasks.append(asyncio.create_task(door.run(), name="mqtt"))
        await door.wait_connected(10.0)

    async def _start_http(self) -> None:
        from kcloak.broker.http_server import build_app

        assert self.pipeline is not None
        await self._listen_http(build_app(cast(Pipeline, self.pipeline), self.config, self.tokens, self.state))

    async def _close_nats(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 5.0)
            with contextlib.suppress(Exception):
                await self.nc.close()


def _resolve(waiter: asyncio.Future[ReasonCode | None], decided: asyncio.Future[ReasonCode | None]) -> None:
    """Settle ``waiter`` as ``decided`` ended (unless it is settled already)."""
    if waiter.done():
        return
    if decided.cancelled():
        waiter.cancel()
    elif (exc := decided.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(decided.result())


__all__ = [
    "ClusterGateway",
    "ClusterPipeline",
    "Duplicate",
    "QueryRejected",
    "StoredAnswer",
    "default_worker_name",
    "safe_endpoint",
]
