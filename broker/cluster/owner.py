"""The owner of one cell (docs/cluster.md "Workers"): pinned consumer ``cell-<c>`` and the routed queries.

It holds the position index of the cell's users only — rebuilt on pin acquisition from the last event of
every ``kcloak.cell.<c>.>`` subject, then kept current by the events delivered on ``cell-<c>`` (a fix
updates a user, a leave removes him) — and serves the cell's queries with the single-node parts: the
snapshot cloaking mode (:class:`~kcloak.broker.modes.SnapshotCloaking`, micro-batched), and the
:class:`~kcloak.broker.forwarding.Forwarder` (upstream under a fresh pseudonym, exact filtering). A
region computed from the cell's own users holds ≥ k of them, so ≥ k of the global population.

The owner takes routed queries (core NATS ``kcloak.cellq.<c>``, queue group ``kcloak``, from the routers:
:mod:`kcloak.broker.cluster.routed`) only while it is pinned on ``cell-<c>``. Each answer is published once to
``KCLOAK_ANSWERS`` with message id ``<token>/<qkey>`` (a recomputation after a failover is dropped by the
duplicate window), and the region forwarded for a query is recorded first in KV ``kcloak_regions``
(create-only): a retried query forwards that same region again, never a second, different one.

**Lease.** An owner whose pull on ``cell-<c>`` is answered 423, or that has had no answer for the
consumer's ``priority_timeout``, drops its index at once and stops answering (it stops pulling queries).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from kcloak.broker.cluster.answers import read_answer, send_stored, store_answer
from kcloak.broker.cluster.codec import decode, decode_any, encode_any
from kcloak.broker.cluster.pinned import Delivered, DuplicateSeq, PinnedMember, PubAcks, read_last_per_subject
from kcloak.broker.cluster.routed import NOT_OWNER, QUEUE_GROUP, STORED, Heartbeat
from kcloak.broker.cluster.topology import (
    CELLS_STREAM,
    REGIONS_BUCKET,
    Layout,
    api_request,
    cell_filter,
    cellq_subject,
    owner_applied_subject,
    split_subject,
    subject_token,
)
from kcloak.broker.cluster.workermetrics import worker_metrics
from kcloak.broker.config import Config
from kcloak.broker.forwarding import Background, Forwarder, Timing
from kcloak.broker.metrics import Metrics
from kcloak.broker.modes import SnapshotCloaking, Views, build_cloaker
from kcloak.broker.positions import Positions
from kcloak.broker.stores import QueryLog
from kcloak.broker.upstream import UpstreamClient
from kcloak.cloaking.cloakers import REFUSAL_MESSAGES, Refusal, Region
from kcloak.cloaking.index import PositionIndex
from kcloak.core.geometry import BBox
from kcloak.core.logs import log_event
from kcloak.core.profile import PrivacyProfile, ReasonCode
from kcloak.wire.answers import Answer
from kcloak.wire.payloads import InvalidInput, parse_query

log = logging.getLogger("kcloak.cluster")

APPLIED_WAIT_S = 5.0


def region_key(token: str, qkey: str) -> str:
    """The KV key of a query's forwarded region (KV keys cannot hold every query id character)."""
    return hashlib.sha256(f"{token}/{qkey}".encode()).hexdigest()


def region_json(region: Region) -> bytes:
    b = region.bbox
    return json.dumps(
        {
            "bbox": [b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg],
            "k": region.k_achieved,
            "area": region.area_m2,
            "l": region.l_achieved,
            "epoch": region.epoch,
        }
    ).encode()


def region_from_json(raw: bytes, algorithm: str) -> Region:
    d = json.loads(raw)
    return Region(
        bbox=BBox(*(int(v) for v in d["bbox"])),
        k_achieved=int(d["k"]),
        area_m2=float(d["area"]),
        algorithm=algorithm,
        epoch=int(d.get("epoch", 0)),
        l_achieved=d.get("l"),
    )


class CellOwner:
    """Cell ``cell``'s owner; :attr:`member` (``cell-<c>``) is run by the worker, the query member only
    while pinned."""

    def __init__(
        self,
        *,
        nc: Any,
        layout: Layout,
        config: Config,
        metrics: Metrics,
        cell: int,
        upstream: UpstreamClient,
        querylog: QueryLog,
        start_delay_s: float = 0.0,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.layout = layout
        self.config = config
        self.metrics = metrics
        self.worker_metrics = worker_metrics(metrics)
        self.cell = cell
        self.algorithm = config.cloaking.algorithm
        self.default_profile = config.profile.to_profile()
        self.upstream = upstream
        self.querylog = querylog
        self.counters = {"events": 0, "queries": 0, "answers": 0, "reused_regions": 0, "rebuilds": 0, "drops": 0}
        self.applied_seq = 0
        self.ack_all = False  # the consumer's ack policy is ``all`` (read on each pin; else acknowledge each event)
        self._applied = asyncio.Condition()
        self._kv: Any = None
        self._acks = PubAcks(nc)
        self._live = False
        self._cloak_task: asyncio.Task[None] | None = None
        self._query_sub: Any = None
        self._answering: dict[tuple[str, str], asyncio.Task[bool]] = {}  # queries in progress here
        self._tasks: set[asyncio.Task[None]] = set()
        self._applied_sub: Any = None
        self._new_parts()
        self.member = PinnedMember(
            nc,
            CELLS_STREAM,
            f"cell-{cell}",
            handler=self.apply,
            on_pinned=self.rebuild,
            on_unpinned=self.drop,
            lease_s=layout.lease_s,
            expires_s=layout.pull_expires_s,
            start_delay_s=start_delay_s,
        )

    def _new_parts(self) -> None:
        cfg = self.config.cloaking
        self.index = PositionIndex(stale_after_s=cfg.stale_after_s, default_profile=self.default_profile)
        self.positions = Positions(index=self.index)
        self.views = Views(positions=self.positions, metrics=self.metrics)
        cloaker = build_cloaker(self.algorithm, cloaking=cfg)
        self.cloaking = SnapshotCloaking(
            cloaker, positions=self.positions, views=self.views, metrics=self.metrics, capacity=self.config.queues.cloak
        )
        self.background = Background()
        self.forwarder = Forwarder(
            algorithm=self.algorithm,
            queue_capacity=self.config.queues.upstream,
            metrics=self.metrics,
            upstream=self.upstream,
            querylog=self.querylog,
            background=self.background,
        )

    @property
    def live(self) -> bool:
        """True while this owner holds the cell's index and answers its queries."""
        return self._live

    def users(self) -> dict[str, float]:
        """Each user in this owner's live index (subject token) with the time of the fix it holds (empty when
        not live)."""
        if not self._live:
            return {}
        out: dict[str, float] = {}
        for token in self.index.user_ids():
            fix = self.index.fix(token)
            if fix is not None:
                out[token] = fix[2]
        return out

    # -- pin -----------------------------------------------------------------------------------
    async def rebuild(self) -> None:
        """The index from the last event of every subject of the cell; then start answering queries."""
        await self._stop_queries()
        self._new_parts()
        self.counters["rebuilds"] += 1
        info = await api_request(self.nc, f"CONSUMER.INFO.{CELLS_STREAM}.{self.member.consumer}", None)
        self.ack_all = info.get("config", {}).get("ack_policy") == "all"
        events = await read_last_per_subject(self.nc, CELLS_STREAM, cell_filter(self.cell))
        self.applied_seq = 0
        for ev in events:
            self._apply_one(ev)
        self._live = True
        self._cloak_task = asyncio.create_task(self.cloaking.run())
        self._query_sub = await self.nc.subscribe(cellq_subject(self.cell), queue=QUEUE_GROUP, cb=self._on_query)
        self._applied_sub = await self.nc.subscribe(owner_applied_subject(self.cell), cb=self._on_applied_request)
        log_event(log, "owner_rebuilt", logging.INFO, cell=self.cell, users=len(self.index))

    async def drop(self) -> None:
        """Lease lost: forget the index at once, answer nothing more."""
        self._live = False
        self.counters["drops"] += 1
        self.index = PositionIndex(stale_after_s=self.config.cloaking.stale_after_s)
        await self._stop_queries()

    async def _on_applied_request(self, msg: Any) -> None:
        if self._live and msg.reply:
            await self.nc.publish(msg.reply, json.dumps({"applied": self.applied_seq}).encode())

    async def _stop_queries(self) -> None:
        subs = (self._applied_sub, self._query_sub)
        self._applied_sub = self._query_sub = None
        for sub in subs:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        cloak, self._cloak_task = self._cloak_task, None
        tasks = [*self._tasks, *self._answering.values(), *([cloak] if cloak is not None else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def stop(self) -> None:
        self._live = False
        await self._stop_queries()
        await self.background.wait(2.0)

    # -- events --------------------------------------------------------------------------------
    def _apply_one(self, ev: Delivered) -> None:
        if ev.seq <= self.applied_seq:
            return  # older than what the rebuild (or an earlier event) gave this subject
        try:
            _, _, token = split_subject(ev.subject, "kcloak.cell", 3)
            body = decode(ev.data)
            if body.get("e") == "fix":
                self.index.update(token, float(body["lat"]), float(body["lon"]), float(body["t"]))
                k = body.get("k")
                self.index.set_profile(token, PrivacyProfile.from_mapping(k, self.default_profile) if k else None)
            else:
                self.index.remove(token)
                self.index.set_profile(token, None)
        except (ValueError, KeyError, TypeError):
            log_event(log, "bad_cell_event", logging.WARNING, cell=self.cell)
        self.applied_seq = ev.seq
        self.counters["events"] += 1

    async def apply(self, batch: list[Delivered]) -> None:
        if not self._live:
            return
        for ev in batch:
            self._apply_one(ev)
        self.positions.apply(())  # a new version: views taken from now on hold these events
        if self.ack_all:  # every event of the batch is applied (or was, below applied_seq): ack the highest
            acked = [ev for ev in batch if ev.reply is not None]
            if acked:
                await self.member.ack(max(acked, key=lambda ev: ev.seq))
        else:
            for ev in batch:
                await self.member.ack(ev)
        async with self._applied:
            self._applied.notify_all()

    async def _wait_applied(self, seq: int) -> bool:
        if self.applied_seq >= seq:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(APPLIED_WAIT_S):
                async with self._applied:
                    await self._applied.wait_for(lambda: self.applied_seq >= seq or not self._live)
        return self._live and self.applied_seq >= seq

    # -- queries -------------------------------------------------------------------------------
    async def _on_query(self, msg: Any) -> None:
        """A routed query (core NATS): answered on a task of its own (a subscription's callbacks run one by one)."""
        if not self._live:
            if msg.reply:
                await self.nc.publish(msg.reply, NOT_OWNER)
            return
        task = asyncio.create_task(self._answer_routed(msg.data, msg.reply or None))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer_routed(self, data: bytes, reply: str | None) -> None:
        """Answer one routed query and tell the router (``reply``) once the answer is stored."""
        try:
            routed = decode_any(data)
            token, qkey = str(routed["user"]), subject_token(str(routed["query"]["query_id"]))
        except (ValueError, KeyError, TypeError):
            log_event(log, "bad_routed_query", logging.WARNING, cell=self.cell)
            if reply is not None:
                await self.nc.publish(reply, STORED)  # nothing will ever be stored for it: stop holding it
            return
        async with Heartbeat(self.nc, reply):
            task = self._answering.get((token, qkey))
            if task is None:  # else the router sent it again while this owner works on it: one computation
                task = self._answering[(token, qkey)] = asyncio.create_task(self._answer_one(routed, token, qkey))
                task.add_done_callback(lambda _: self._answering.pop((token, qkey), None))
            try:
                stored = await asyncio.shield(task)
            except Exception:
                log_event(log, "routed_query_failed", logging.WARNING, cell=self.cell)
                stored = False  # e.g. the answers stream unreachable for 30 s: the router sends it again
        if reply is not None:
            await self.nc.publish(reply, STORED if stored else NOT_OWNER)

    async def _answer_one(self, routed: dict[str, Any], token: str, qkey: str) -> bool:
        """Cloak, forward and store the query's answer; True once it is stored (False: lease lost meanwhile)."""
        if not self._live:
            return False
        self.counters["queries"] += 1
        try:
            q = parse_query(routed["query"])
            profile = PrivacyProfile.from_mapping(routed["profile"], self.default_profile)
            transport = routed.get("transport", "mqtt")
            reply = routed.get("reply")
            reply = reply if isinstance(reply, str) and reply else None
        except (ValueError, KeyError, TypeError, InvalidInput):
            log_event(log, "bad_routed_query", logging.WARNING, cell=self.cell)
            return True  # nothing to store, ever: the router stops holding it
        if routed.get("again"):
            stored = await self._answered(token, qkey)
            if stored is not None:  # a first attempt stored its answer before its owner died
                if reply is not None:
                    await send_stored(self.nc, token, qkey, reply, stored)
                return True
        timing = Timing()
        started = time.monotonic()
        answer = await self._cloak_and_forward(token, qkey, q, profile, routed, timing)
        if not self._live:
            return False  # lease lost meanwhile: the successor answers
        self.worker_metrics.queries.labels(
            transport=transport, kind=q.metric_kind, status=answer.status, reason=answer.reason_label
        ).inc()  # the gateway counts kcloak_queries_total for the answer it returns
        added = time.monotonic() - started - timing.upstream
        self.metrics.added_latency.labels(transport=transport).observe(max(added, 0.0))
        await store_answer(
            self._acks,
            self.nc,
            token,
            qkey,
            encode_any(answer.to_json()),
            reply=reply,
            keep_trying=lambda: self._live,
        )
        self.counters["answers"] += 1
        return True

    async def _answered(self, token: str, qkey: str) -> bytes | None:
        """The query's stored answer, if there is one (None also when the stream cannot be read: recompute)."""
        try:
            return await read_answer(self.nc, token, qkey)
        except Exception:
            return None

    async def _cloak_and_forward(
        self, token: str, qkey: str, q: Any, profile: PrivacyProfile, routed: dict[str, Any], timing: Timing
    ) -> Answer:
        qid = q.query_id
        if not await self._wait_applied(int(routed.get("fix_seq", 0))) or token not in self.index:
            return Answer.refused(
                qid, ReasonCode.STALE_POSITION, REFUSAL_MESSAGES[ReasonCode.STALE_POSITION], time.time()
            )
        cloaked = await self.cloaking.cloak(token, profile, timing)
        if isinstance(cloaked, Refusal):
            return Answer.refused(qid, cloaked.reason, cloaked.message, time.time())
        region = await self._record_region(token, qkey, cloaked.region)
        lat, lon = float(routed["lat"]), float(routed["lon"])
        return await self.forwarder.forward(q, profile, region, lat, lon, timing)

    async def _record_region(self, token: str, qkey: str, region: Region) -> Region:
        """The region to forward: this one, unless a first attempt of the query recorded another."""
        key, data = region_key(token, qkey), region_json(region)
        # Create-only on the PubAck inbox (a fraction of nats-py's KV create): stored only while the key holds
        # no message; a duplicate PubAck means an earlier attempt's message is there.
        fut = await self._acks.send(
            f"$KV.{REGIONS_BUCKET}.{key}",
            data,
            stream=f"KV_{REGIONS_BUCKET}",
            msg_id=f"region/{key}",
            headers={"Nats-Expected-Last-Subject-Sequence": "0"},
        )
        with contextlib.suppress(Exception):
            if not isinstance(await asyncio.wait_for(fut, self._acks.timeout_s), DuplicateSeq):
                return region
        # Taken, or no PubAck: KV create decides (it fails when the key holds a region, ours or a first attempt's).
        if self._kv is None:
            self._kv = await self.js.key_value(REGIONS_BUCKET)
        try:
            await self._kv.create(key, data)
            return region
        except Exception:
            entry = await self._kv.get(key)
            self.counters["reused_regions"] += 1
            return region_from_json(entry.value, self.algorithm)


def querylog_path(config: Config, worker: str) -> Path:
    """Each worker's own query log (forwarded regions, no user id) under the data directory."""
    directory = Path(config.storage.data_dir) / "cluster"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"querylog-{worker}.sqlite3"


__all__ = ["CellOwner", "querylog_path", "region_from_json", "region_json", "region_key"]
