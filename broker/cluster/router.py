"""The router of one intake partition (docs/cluster.md "Workers"): pinned consumer ``in-<p>``.

It owns each of its users' state across cells: the latest fix time (``out_of_order``, ``too_old``),
the current cell, the rate limits, the stored profile (validated here, kept in KV ``kcloak_profiles``)
and the checks a query can be refused on before any cell is involved. It never cloaks.

A fix in cell ``c`` of a user who is in cell ``o ≠ c``: the router publishes a ``leave`` on
``kcloak.cell.<o>.<p>.<token>`` and waits until cell ``o``'s owner has applied it (consumer ``cell-<o>``'s
ack floor at or past the leave's stream sequence; a dead owner's successor applies it on rebuild, as it
is the subject's latest message) and only then publishes the fix on ``kcloak.cell.<c>.<p>.<token>``:
the user is never in two live indexes, and counted nowhere in between (safe).

Every accepted fix is also stored in ``KCLOAK_MOVES`` (``kcloak.moves.<p>``, the movement history windows
are published from, :mod:`kcloak.broker.cluster.moves`; one message per flush of a micro-batch's events), in
the same PubAck batch as its cell event; a rejected fix never is.

Events (JSON on ``KCLOAK_CELLS``): ``{"e": "fix", "t", "lat", "lon", "in", "i"?, "k"?}`` and
``{"e": "leave", "t", "in", "i"?}``, where ``in`` is the intake stream sequence of the user's latest applied
fix, ``i`` its position among the fixes of that intake message (absent: 0; an intake ``batch`` carries
several users' fixes) and ``k`` his stored profile. On pin acquisition the router rebuilds from the last
event of every subject of ``kcloak.cell.*.<p>.>``; a fix at or below a user's ``(in, i)`` was applied
already (redelivered after a failover), so it is acknowledged as accepted without a second event, and
never refused ``out_of_order``; the other fixes of the same redelivered message are applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kcloak.broker.cluster.answers import store_answer
from kcloak.broker.cluster.codec import decode, decode_batch, encode, encode_any
from kcloak.broker.cluster.moves import moves_body
from kcloak.broker.cluster.pinned import Delivered, PinnedMember, PubAcks, read_last_per_subject
from kcloak.broker.cluster.routed import QueryDispatch
from kcloak.broker.cluster.topology import (
    CELLS_STREAM,
    IN_STREAM,
    MOVES_STREAM,
    PROFILES_BUCKET,
    Layout,
    api_request,
    cell_subject,
    in_filter,
    moves_subject,
    owner_applied_subject,
    partition_cells_filter,
    partition_of,
    split_subject,
    status_out_subject,
    subject_token,
)
from kcloak.broker.cluster.workermetrics import worker_metrics
from kcloak.broker.config import Config
from kcloak.broker.metrics import Metrics
from kcloak.broker.modes import build_cloaker
from kcloak.broker.ratelimit import TokenBuckets
from kcloak.cloaking.cells import CellMap
from kcloak.cloaking.cloakers import REFUSAL_MESSAGES, CloakMode
from kcloak.core.logs import log_event
from kcloak.core.profile import PrivacyProfile, ProfileError, ReasonCode
from kcloak.wire.answers import Answer
from kcloak.wire.payloads import (
    Fix,
    InvalidInput,
    decode_fix,
    parse_fix,
    parse_json_object,
    parse_query,
    valid_user_id,
)

log = logging.getLogger("kcloak.cluster")

TRANSPORT_HEADER = "Kcloak-Transport"
REPLY_HEADER = "Kcloak-Reply"
MSG_ID = "Nats-Msg-Id"
LEAVE_WAIT_POLL_S = 0.05
FIX_KINDS = ("update", "updates", "batch")
"""Intake kinds that carry fixes: one fix, one message's batch, and a gateway's ``batch`` of messages."""
OWNER_REPLY_WAIT_S = 0.05


@dataclass(slots=True)
class UserState:
    """What the router knows of one user: latest fix (time, position), its event's stream sequence in
    ``KCLOAK_CELLS``, the intake sequence it came from, and the cell he is in (None: in none)."""

    t: float = -1.0
    lat: float = 0.0
    lon: float = 0.0
    cell: int | None = None
    fix_seq: int = 0
    in_seq: int = 0
    in_item: int = 0

    @property
    def intake(self) -> tuple[int, int]:
        """Where the latest applied fix came from: (intake sequence, position in that message)."""
        return (self.in_seq, self.in_item)

    def event_base(self) -> dict[str, Any]:
        """The fields every event of this user carries: time and intake position."""
        body: dict[str, Any] = {"t": self.t, "in": self.in_seq}
        if self.in_item:
            body["i"] = self.in_item
        return body


def _finite_position(lat: Any, lon: Any) -> bool:
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (lat, lon))
    return ok and -90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0


def _message_fixes(part: Any) -> list[tuple[str, Any] | ReasonCode]:
    """The fixes of one app message ``{"user": token, "kind": "update" | "updates", "body": {...}}``: an
    ``updates`` item naming another ``user`` is that user's (the router refuses it if he is not its own)."""
    if not isinstance(part, dict) or not isinstance(part.get("user"), str) or not isinstance(part.get("body"), dict):
        return [ReasonCode.INVALID]
    token, body = part["user"], part["body"]
    if part.get("kind") == "update":
        return [(token, body)]
    updates = body.get("updates")
    if part.get("kind") != "updates" or not isinstance(updates, list):
        return [ReasonCode.INVALID]
    items: list[tuple[str, Any] | ReasonCode] = []
    for item in updates:
        user = item.get("user") if isinstance(item, dict) else None
        if isinstance(user, str) and valid_user_id(user):
            items.append((subject_token(user), {k: v for k, v in item.items() if k != "user"}))
        else:
            items.append((token, item))
    return items


def _decoded_fixes(kind: str, token: str, data: bytes) -> list[tuple[str, Fix]] | None:
    """The fixes of an intake message whose every fix msgspec decodes and checks in one pass (a single
    ``update``, or a gateway ``batch`` of ``update`` messages): ``(user token, Fix)`` in order. None for
    anything else (an ``updates`` message, a fix msgspec refuses, an unreadable envelope): the full path
    (:func:`~kcloak.wire.payloads.parse_json_object`, :func:`_message_fixes`, ``parse_fix``) then decides, with
    the same outcome for every message this accepts."""
    if kind == "update":
        fix = decode_fix(data)
        return None if fix is None else [(token, fix)]
    if kind != "batch":
        return None
    envelope = decode_batch(data)
    if envelope is None:
        return None
    out: list[tuple[str, Fix]] = []
    for part in envelope.batch:
        fix = decode_fix(part.body) if part.kind == "update" else None
        if fix is None:
            return None
        out.append((part.user, fix))
    return out


def cluster_refusal(config: Config) -> str | None:
    """Why the configured algorithm cannot serve in a cluster (None: it can: a snapshot cloaker)."""
    cloaker = build_cloaker(config.cloaking.algorithm, cloaking=config.cloaking)
    if cloaker.cloak_mode is not CloakMode.SNAPSHOT:
        return f"{config.cloaking.algorithm} holds queries; a cluster serves snapshot algorithms only"
    return None


class Router:
    """Partition ``partition``'s router; :attr:`member` is its pinned pull member (run by the worker)."""

    def __init__(
        self,
        *,
        nc: Any,
        layout: Layout,
        cells: CellMap,
        config: Config,
        metrics: Metrics,
        partition: int,
        start_delay_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        owner_seen: dict[int, float] | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.layout = layout
        self.cells = cells
        self.config = config
        self.metrics = metrics
        self.worker_metrics = worker_metrics(metrics)
        self.partition = partition
        self.clock = clock
        self.default_profile = config.profile.to_profile()
        self.algorithm = config.cloaking.algorithm
        self.supports_l = bool(build_cloaker(self.algorithm, cloaking=config.cloaking).supports_l)
        self.mode_refusal = cluster_refusal(config)
        self.users: dict[str, UserState] = {}
        self._cell_cache: dict[tuple[float, float], int] = {}
        # when each cell's owner last answered (monotonic); the worker shares one map among its routers
        self._owner_seen: dict[int, float] = {} if owner_seen is None else owner_seen
        self._touched: dict[int, float] = {}  # when a held query last republished a fix event to pin an owner
        self._profiles: dict[str, PrivacyProfile | None] = {}
        self._profiles_complete = False
        self._kv: Any = None
        self._acks = PubAcks(nc)
        self._moves: list[tuple[str, float, float, float]] = []
        limits = config.limits
        self._update_buckets = TokenBuckets(limits.update_rate, limits.update_burst)
        self._query_buckets = TokenBuckets(limits.query_rate, limits.query_burst)
        self._profile_buckets = TokenBuckets(limits.profile_rate, limits.profile_burst)
        self.counters = {"fixes": 0, "rejected": 0, "moves": 0, "queries": 0, "redelivered": 0, "rebuilds": 0}
        self.queries = QueryDispatch(nc, keep_trying=lambda: self.member.pinned)
        self.member = PinnedMember(
            nc,
            IN_STREAM,
            f"in-{partition}",
            handler=self.handle,
            on_pinned=self.rebuild,
            on_unpinned=self.drop,
            lease_s=layout.lease_s,
            expires_s=layout.pull_expires_s,
            start_delay_s=start_delay_s,
            catch_up=True,
            filter_subject=in_filter(partition),
            hold_redelivery=lambda msg: self.queries.redelivered(msg.seq, msg.reply),
        )

    # -- pin -----------------------------------------------------------------------------------
    async def rebuild(self) -> None:
        """Each user's state from the last event of every subject of this partition (on pin acquisition)."""
        self.users = {}
        self._profiles, self._profiles_complete = {}, False
        self._update_buckets = TokenBuckets(self.config.limits.update_rate, self.config.limits.update_burst)
        self.counters["rebuilds"] += 1
        self._profiles = await self._read_profiles()
        self._profiles_complete = True
        events = await read_last_per_subject(self.nc, CELLS_STREAM, partition_cells_filter(self.partition))
        for ev in events:
            try:
                cell_s, _, token = split_subject(ev.subject, "kcloak.cell", 3)
                body = decode(ev.data)
            except ValueError:
                continue
            st = self.users.setdefault(token, UserState())
            st.t = max(st.t, float(body["t"]))
            if body.get("e") == "fix" and ev.seq > st.fix_seq:
                st.cell, st.lat, st.lon, st.fix_seq = int(cell_s), float(body["lat"]), float(body["lon"]), ev.seq
            st.in_seq, st.in_item = max(st.intake, (int(body.get("in", 0)), int(body.get("i", 0))))
        for st in self.users.values():
            if st.cell is None:
                st.fix_seq = 0
        log_event(log, "router_rebuilt", logging.INFO, partition=self.partition, users=len(self.users))

    async def _read_profiles(self) -> dict[str, PrivacyProfile | None]:
        """The stored profile of every user of this partition, in one read of the bucket (the last value of each
        key). This router writes its users' profiles itself while pinned, so the map stays complete: a user
        without an entry has the default profile, with no KV read per new user."""
        prefix = f"$KV.{PROFILES_BUCKET}."
        out: dict[str, PrivacyProfile | None] = {}
        for ev in await read_last_per_subject(self.nc, f"KV_{PROFILES_BUCKET}", prefix + ">"):
            token = ev.subject[len(prefix) :]
            if not self.owns(token):
                continue
            try:
                out[token] = PrivacyProfile.from_mapping(json.loads(ev.data), self.default_profile) if ev.data else None
            except (ValueError, ProfileError):
                out[token] = None
        return out

    async def drop(self) -> None:
        await self.queries.drop()
        self.users = {}
        self._profiles = {}
        self._profiles_complete = False

    # -- messages ------------------------------------------------------------------------------
    async def handle(self, batch: list[Delivered]) -> None:
        """One micro-batch of intake messages, in stream order. The fix events of consecutive fix messages are
        published together (PubAcks awaited once); a message is answered and acknowledged only after its
        effects are stored, and a profile or query waits for the fixes before it."""
        pending: list[Any] = []
        decided: list[tuple[Delivered, dict[str, Any] | None]] = []
        parsed = self._parse_fixes(batch)
        for msg in batch:
            try:
                _, kind, token = split_subject(msg.subject, "kcloak.in", 3)
            except ValueError:
                decided.append((msg, None))
                continue
            transport = msg.headers.get(TRANSPORT_HEADER, "mqtt")
            transport = transport if transport in ("mqtt", "http") else "mqtt"
            if kind in FIX_KINDS:
                codes = await self._fixes(msg, parsed.get(msg.seq, []), transport, pending)
                decided.append((msg, {"kind": "fixes", "codes": [c.value if c else None for c in codes]}))
                continue
            if kind == "query" and msg.seq in self.queries.held:
                self.queries.redelivered(msg.seq, msg.reply)  # in flight here: acknowledged once answered
                continue
            await self._settle(pending, decided)
            if kind == "profile":
                await self._profile(msg, token, transport)
            elif kind == "query" and await self._query(msg, token, transport):
                continue  # held until its answer is stored
            await self.member.ack(msg)
        await self._settle(pending, decided)
        if self._acks.retries:
            self.counters["puback_retries"] = self._acks.retries

    def _parse_fixes(self, batch: list[Delivered]) -> dict[int, list[tuple[str, Any] | ReasonCode]]:
        """Per fix message of the batch (by stream sequence), its fixes as ``(user token, fix object)``, or a
        reason code where a message (or a message of a ``batch``) is unreadable: one outcome each, in order.
        Also the cell of every well-formed position, in one vectorized call (the Hilbert value of one position
        alone costs about as much as that of a thousand)."""
        out: dict[int, list[tuple[str, Any] | ReasonCode]] = {}
        lats: list[float] = []
        lons: list[float] = []
        for msg in batch:
            try:
                _, kind, token = split_subject(msg.subject, "kcloak.in", 3)
            except ValueError:
                continue
            if kind not in FIX_KINDS:
                continue
            fast = _decoded_fixes(kind, token, msg.data)
            if fast is not None:
                out[msg.seq] = list[tuple[str, Any] | ReasonCode](fast)
                for _, fix in fast:
                    lats.append(fix.lat)
                    lons.append(fix.lon)
                continue
            try:
                obj = parse_json_object(msg.data)
            except InvalidInput:
                out[msg.seq] = [ReasonCode.INVALID]
                continue
            if kind == "batch":
                parts = obj.get("batch")
                messages = parts if isinstance(parts, list) else [None]
            else:
                messages = [{"user": token, "kind": kind, "body": obj}]
            items = out[msg.seq] = []
            for part in messages:
                items += _message_fixes(part)
            for item in items:
                if not isinstance(item, ReasonCode) and isinstance(item[1], dict):
                    lat: Any = item[1].get("lat")
                    lon: Any = item[1].get("lon")
                    if _finite_position(lat, lon):
                        lats.append(float(lat))
                        lons.append(float(lon))
        self._cell_cache = {}
        if lats:
            cells = self.cells.cell_of(np.array(lats), np.array(lons))
            self._cell_cache = dict(zip(zip(lats, lons, strict=True), cells.tolist(), strict=True))
        return out

    def _cell(self, lat: float, lon: float) -> int:
        cell = self._cell_cache.get((lat, lon))
        if cell is None:
            cell = int(self.cells.cell_of(np.array([lat]), np.array([lon]))[0])
        return int(cell)

    async def _settle(self, pending: list[Any], decided: list[tuple[Delivered, dict[str, Any] | None]]) -> None:
        """Await the pending fix events, then reply to and acknowledge the messages they came from."""
        await self._flush(pending)
        for msg, body in decided:
            if body is not None:
                await self._reply(msg, body)
            await self.member.ack(msg)
        decided.clear()

    async def _flush(self, pending: list[Any]) -> None:
        """Await the PubAcks of the fix events sent so far (all together), then record their stream sequences."""
        if self._moves:
            data, self._moves = moves_body(self._moves), []
            subject, msg_id = (
                moves_subject(self.partition),
                f"mv/{self.partition}/{hashlib.blake2b(data, digest_size=12).hexdigest()}",
            )
            fut = await self._acks.send(subject, data, stream=MOVES_STREAM, msg_id=msg_id)
            pending.append((fut, subject, data, MOVES_STREAM, msg_id, None, None))
        if pending:
            sent, pending[:] = pending[:], []
            seqs = await self._acks.settle([item[:5] for item in sent], keep_trying=lambda: self.member.pinned)
            for (*_, st, cell), seq in zip(sent, seqs, strict=True):
                if st is not None and st.cell == cell:
                    st.fix_seq = max(st.fix_seq, seq)

    async def _reply(self, msg: Delivered, body: dict[str, Any]) -> None:
        reply = msg.headers.get(REPLY_HEADER)
        if reply:
            await self.nc.publish(reply, json.dumps(body, separators=(",", ":")).encode())

    # -- fixes ---------------------------------------------------------------------------------
    async def _fixes(
        self, msg: Delivered, items: list[tuple[str, Any] | ReasonCode], transport: str, pending: list[Any]
    ) -> list[ReasonCode | None]:
        codes: list[ReasonCode | None] = []
        for i, item in enumerate(items):
            if isinstance(item, ReasonCode):
                self._rejected(transport, item)
                codes.append(item)
            else:
                codes.append(await self._fix(item[0], item[1], msg.seq, i, transport, pending, "update"))
        return codes

    async def _fix(
        self, token: str, raw: Any, in_seq: int, item: int, transport: str, pending: list[Any], source: str
    ) -> ReasonCode | None:
        if not self.owns(token):
            self._rejected(transport, ReasonCode.INVALID)  # a batch item of another partition's user
            return ReasonCode.INVALID
        st = self.users.get(token)
        if st is not None and (in_seq, item) <= st.intake:
            self.counters["redelivered"] += 1
            return None  # applied before a failover: accepted then, accepted now
        code = self._check(token, raw, st)
        if isinstance(code, ReasonCode):
            self._rejected(transport, code)
            return code
        fix = code
        cell = self._cell(fix.lat, fix.lon)
        if st is None:
            st = self.users[token] = UserState()
        if st.cell is not None and st.cell != cell:
            await self._flush(pending)
            await self._leave(token, st)
            self.counters["moves"] += 1
        profile = await self._stored_profile(token)
        st.t, st.lat, st.lon, st.cell, st.in_seq, st.in_item = fix.t, fix.lat, fix.lon, cell, in_seq, item
        body = self._fix_event(st, profile)
        subject = cell_subject(cell, self.partition, token)
        data = encode(body)
        msg_id = f"in/{in_seq}/{item}"
        fut = await self._acks.send(subject, data, stream=CELLS_STREAM, msg_id=msg_id)
        pending.append((fut, subject, data, CELLS_STREAM, msg_id, st, cell))
        # The movement history (window publication): one message per flush, settled with the cell events,
        # before the intake ack.
        self._moves.append((token, fix.t, fix.lat, fix.lon))
        self.counters["fixes"] += 1
        self.metrics.updates_accepted.labels(transport=transport, source=source).inc()
        return None

    @staticmethod
    def _fix_event(st: UserState, profile: PrivacyProfile | None) -> dict[str, Any]:
        """The user's current fix as a cell event (with his stored profile, if any)."""
        body: dict[str, Any] = {"e": "fix", **st.event_base(), "lat": st.lat, "lon": st.lon}
        if profile is not None:
            body["k"] = profile.to_dict()
        return body

    async def _publish_fix(self, token: str, st: UserState, cell: int, body: dict[str, Any], msg_id: str) -> None:
        ack = await self._publish(cell_subject(cell, self.partition, token), encode(body), CELLS_STREAM, msg_id)
        if st.cell == cell:
            st.fix_seq = max(st.fix_seq, ack)

    async def _publish(self, subject: str, data: bytes, stream: str, msg_id: str) -> int:
        """Publish with message id ``msg_id`` and return the stored stream sequence (retried while pinned)."""
        return await self._acks.publish(
            subject, data, stream=stream, msg_id=msg_id, keep_trying=lambda: self.member.pinned
        )

    def _check(self, token: str, raw: Any, st: UserState | None) -> Fix | ReasonCode:
        if isinstance(raw, Fix):
            fix = raw  # decoded and checked by msgspec (_decoded_fixes)
        else:
            try:
                fix, _ = parse_fix(raw)
            except InvalidInput:
                return ReasonCode.INVALID
        now = self.clock()
        cfg = self.config.cloaking
        if fix.t > now + cfg.max_clock_skew_s:
            return ReasonCode.INVALID
        if fix.t < now - cfg.max_update_age_s:
            return ReasonCode.TOO_OLD
        if st is not None and fix.t <= st.t:
            return ReasonCode.OUT_OF_ORDER
        if not self._update_buckets.take(token):
            return ReasonCode.RATE_LIMITED
        return fix

    def _rejected(self, transport: str, code: ReasonCode) -> None:
        self.counters["rejected"] += 1
        self.counters[f"rejected_{code.value}"] = self.counters.get(f"rejected_{code.value}", 0) + 1
        self.metrics.updates_rejected.labels(transport=transport, reason=code.value).inc()

    async def _leave(self, token: str, st: UserState) -> None:
        """Leave the old cell and wait until its owner has applied the leave (module docstring)."""
        old = st.cell
        assert old is not None
        body = {"e": "leave", **st.event_base()}
        ack = await self._publish(
            cell_subject(old, self.partition, token),
            encode(body),
            CELLS_STREAM,
            f"leave/{st.in_seq}/{st.in_item}/{old}",
        )
        st.cell = None
        await self.wait_applied(old, ack)

    async def wait_applied(self, cell: int, seq: int) -> None:
        """Until cell ``cell``'s owner has applied stream sequence ``seq``: consumer ``cell-<c>``'s ack floor
        reached it, or every owner answering on :func:`owner_applied_subject` holds it (a successor rebuilt
        from it), or no owner answered for twice ``priority_timeout`` (then none holds a live index: an owner
        without successful pulls for ``priority_timeout`` drops its index)."""
        silent_since = time.monotonic()
        while self.member.pinned:  # else our successor rebuilds from the leave
            try:
                info = await api_request(self.nc, f"CONSUMER.INFO.{CELLS_STREAM}.cell-{cell}", None, timeout=2.0)
                if int(info["ack_floor"]["stream_seq"]) >= seq:
                    return
            except Exception:
                pass  # a leader election: ask again
            applied = await self._owners_applied(cell)
            if applied:
                silent_since = time.monotonic()
                if min(applied) >= seq:
                    return
            elif time.monotonic() - silent_since > 2 * self.layout.pinned_timeout_s:
                return
            await asyncio.sleep(LEAVE_WAIT_POLL_S)

    async def _owners_applied(self, cell: int) -> list[int]:
        """Every live owner's applied sequence for ``cell`` (a stale one may answer too until its lease ends)."""
        inbox = self.nc.new_inbox()
        got: list[int] = []

        async def collect(msg: Any) -> None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                got.append(int(json.loads(msg.data)["applied"]))

        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(owner_applied_subject(cell), b"", reply=inbox)
            await asyncio.sleep(OWNER_REPLY_WAIT_S)
        finally:
            await sub.unsubscribe()
        return got

    # -- profiles ------------------------------------------------------------------------------
    async def _kv_bucket(self) -> Any:
        if self._kv is None:
            self._kv = await self.js.key_value(PROFILES_BUCKET)
        return self._kv

    async def _stored_profile(self, token: str) -> PrivacyProfile | None:
        if token in self._profiles:
            return self._profiles[token]
        if self._profiles_complete:
            return None
        profile: PrivacyProfile | None = None
        try:
            entry = await (await self._kv_bucket()).get(token)
            if entry.value:
                profile = PrivacyProfile.from_mapping(json.loads(entry.value), self.default_profile)
        except Exception:
            profile = None  # no key (the default profile)
        self._profiles[token] = profile
        return profile

    async def _profile(self, msg: Delivered, token: str, transport: str) -> None:
        status: dict[str, Any] = {"kind": "profile"}
        reason: str | None = None
        try:
            obj = parse_json_object(msg.data)
        except InvalidInput:
            obj = {}
        if "request_id" in obj and isinstance(obj["request_id"], str):
            status["request_id"] = obj["request_id"]
        if "profile" not in obj or set(obj) - {"profile", "request_id"}:
            reason = "invalid"
        elif not self._profile_buckets.take(token):
            reason = "rate_limited"
        else:
            try:
                kv = await self._kv_bucket()
                data = obj["profile"]
                if data is None:
                    await kv.put(token, b"")
                    self._profiles[token] = None
                    profile = self.default_profile
                else:
                    profile = PrivacyProfile.from_mapping(data, self.default_profile)
                    await kv.put(token, json.dumps(profile.to_dict()).encode())
                    self._profiles[token] = profile
                status.update(status="ok", profile=profile.to_dict())
                await self._refresh_profile(token)
            except ProfileError:
                reason = "invalid"
        if reason is not None:
            status.update(status="refused", reason=reason)
        self.metrics.profile_sets.labels(transport=transport, status=status["status"], reason=reason or "none").inc()
        status["t"] = self.clock()
        if msg.headers.get(REPLY_HEADER):
            await self._reply(msg, status)
        else:
            await self.nc.publish(status_out_subject(token), json.dumps(status, separators=(",", ":")).encode())

    async def _refresh_profile(self, token: str) -> None:
        """Tell the user's cell owner his new stored k (the same fix again, with the new profile)."""
        st = self.users.get(token)
        if st is None or st.cell is None:
            return
        body = self._fix_event(st, self._profiles.get(token))
        await self._publish_fix(token, st, st.cell, body, f"profile/{time.time_ns()}")

    # -- queries -------------------------------------------------------------------------------
    async def _answer(self, token: str, qid: str, answer: Answer, transport: str, kind: str, reply: str | None) -> None:
        """Store a refusal decided here as the query's one answer (and send the stored one to ``reply``)."""
        self.worker_metrics.queries.labels(
            transport=transport, kind=kind, status=answer.status, reason=answer.reason_label
        ).inc()  # the gateway counts kcloak_queries_total for the answer it returns
        await store_answer(
            self._acks,
            self.nc,
            token,
            subject_token(qid),
            encode_any(answer.to_json()),
            reply=reply,
            keep_trying=lambda: self.member.pinned,
        )

    async def _query(self, msg: Delivered, token: str, transport: str) -> bool:
        """Decide or route one query; True when it was routed (its intake message is held until the answer is
        stored, :mod:`kcloak.broker.cluster.routed`), False when it is answered (a refusal stored) or unreadable."""
        self.counters["queries"] += 1
        now = self.clock()
        try:
            obj = parse_json_object(msg.data)
        except InvalidInput:
            return False  # the gateway parsed it: never here
        qid = obj.get("query_id")
        if not isinstance(qid, str):
            return False
        reply = msg.headers.get(REPLY_HEADER) or None  # the waiting gateway's inbox: where the answer goes
        try:
            q = parse_query(obj)
        except InvalidInput as exc:
            kind = obj.get("kind")
            label = kind if kind in ("range", "knn") else "unknown"
            refusal = Answer.refused(qid, ReasonCode.INVALID, str(exc), now)
            await self._answer(token, qid, refusal, transport, label, reply)
            return False
        label = q.metric_kind

        async def refuse(code: ReasonCode, message: str) -> bool:
            await self._answer(token, qid, Answer.refused(qid, code, message, self.clock()), transport, label, reply)
            return False

        if not self._query_buckets.take(token):
            return await refuse(ReasonCode.RATE_LIMITED, "query rate limit reached")
        if q.continuous or q.session_id is not None:
            return await refuse(ReasonCode.UNSUPPORTED, "continuous queries are not supported in a cluster yet")
        if self.mode_refusal is not None:
            return await refuse(ReasonCode.UNSUPPORTED, self.mode_refusal)
        stored = await self._stored_profile(token) or self.default_profile
        try:
            effective = stored.tightened(q.profile)
        except ProfileError as exc:
            return await refuse(exc.code, str(exc))
        if q.fix is not None:
            pending: list[Any] = []
            code = await self._fix(
                token, {"t": q.fix.t, "lat": q.fix.lat, "lon": q.fix.lon}, msg.seq, 0, transport, pending, "query"
            )
            await self._flush(pending)
            if code is ReasonCode.INVALID:
                return await refuse(code, "t: outside the accepted clock skew")
        st = self.users.get(token)
        if st is None or st.cell is None or st.t < now - self.config.cloaking.stale_after_s:
            return await refuse(ReasonCode.STALE_POSITION, REFUSAL_MESSAGES[ReasonCode.STALE_POSITION])
        if effective.l > 1 and not self.supports_l:
            return await refuse(ReasonCode.UNSUPPORTED, "l > 1 needs the privacygrid algorithm")
        routed = {
            "user": token,
            "query": obj,
            "profile": effective.to_dict(),
            "lat": st.lat,
            "lon": st.lon,
            "t": st.t,
            "fix_seq": st.fix_seq,
            "transport": transport,
            "received": now,
        }
        if reply is not None:
            routed["reply"] = reply
        if msg.redelivered:
            routed["again"] = True  # an earlier router may have had it answered: the owner looks first
        cell = st.cell

        async def owner_check() -> None:
            if await self._owner_answers(cell) or st.cell != cell:
                return
            if time.monotonic() - self._touched.get(cell, -math.inf) >= 1.0:  # one touch a second per cell
                self._touched[cell] = time.monotonic()
                await self._touch(token, st)

        async def give_up() -> None:
            await refuse(ReasonCode.OVERLOADED, "no owner of the querier's cell answered")

        self.queries.hold(msg.seq, msg.reply, cell, routed, owner_check=owner_check, give_up=give_up)
        return True

    async def _owner_answers(self, cell: int) -> bool:
        """Whether cell ``cell`` has a live owner (asked at most once a second per cell)."""
        now = time.monotonic()
        if now - self._owner_seen.get(cell, -math.inf) < 1.0:
            return True
        try:
            await self.nc.request(owner_applied_subject(cell), b"", timeout=0.25)
        except Exception:
            return False
        self._owner_seen[cell] = now
        return True

    async def _touch(self, token: str, st: UserState) -> None:
        """The querier's fix event again: a pin is learnt from a delivery, so a cell whose owner died while no
        event came gets one (its successor then rebuilds and pulls the cell's queries)."""
        assert st.cell is not None
        body = self._fix_event(st, self._profiles.get(token))
        self.counters["touches"] = self.counters.get("touches", 0) + 1
        await self._publish_fix(token, st, st.cell, body, f"touch/{time.time_ns()}")

    # -- status --------------------------------------------------------------------------------
    def owns(self, token: str) -> bool:
        return partition_of(token, self.layout.partitions) == self.partition


__all__ = ["REPLY_HEADER", "TRANSPORT_HEADER", "Router", "UserState", "cluster_refusal"]
