"""The MQTT door (contract §3), over one of two transports.

``embedded`` (the default): kcloak's own MQTT 3.1.1 server runs in this process
(:class:`~kcloak.broker.mqtt_server.MqttServer`); it hands every input message to :meth:`MqttDoor.dispatch`
and acknowledges it only once dispatch says it is durable, and answers and status messages go out
through :meth:`MqttServer.publish`. No child process, no client connection, nothing that outlives
``kill -9``. External (``mqtt://…``): intake connections subscribe to the four ingest filters (QoS 1;
``$share/kcloak/…`` when there are several); one more connection publishes answers and status
messages, with the retained ``down`` status as its last will. Both are kcloak's one MQTT 3.1.1
client, :class:`kcloak.wire.mqtt_client.MqttClient` (docs/mqtt.md, "One client"), reconnecting
with a backoff that restarts at its shortest wait after each successful connection. Each message is parsed and
handed to the same :class:`~kcloak.broker.pipeline.Pipeline` as HTTP. Malformed input is dropped and
counted, never fatal, never visible to other users.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from kcloak import __version__
from kcloak.broker.auth import TokenStore
from kcloak.broker.config import Config
from kcloak.broker.mqtt_server import INPUT_KINDS, MqttServer, input_topic
from kcloak.broker.pipeline import Duplicate, Pipeline, QueryOutcome, QueryRejected
from kcloak.broker.stores import StoreError
from kcloak.core.logs import log_event
from kcloak.core.profile import ProfileError
from kcloak.wire.mqtt_client import Backoff, Incoming, MqttClient, MqttError
from kcloak.wire.payloads import MalformedJson, decode_fix, parse_json_object, valid_query_id, valid_user_id

log = logging.getLogger("kcloak.mqtt")

TOPICS = INPUT_KINDS
TOPIC_CACHE = 65_536
"""Input topics whose reading :meth:`MqttDoor._topic` remembers (cleared when full): an app
publishes on the same few topics, over and over."""
ROOT = "kcloak/v1/"
STATUS_TOPIC = ROOT + "broker/status"

_ENCODER = msgspec.json.Encoder()


def encode_message(payload: dict[str, Any]) -> bytes:
    """An answer or status message as published: ``json.dumps(payload, separators=(",", ":"))``,
    written by msgspec (a tenth of the CPU). Text beyond ASCII goes the ``json.dumps`` way, for its
    ``\\u`` escapes; floats are the same numbers, in the same text from 1e-4 to 1e16 (outside, in
    msgspec's notation: ``1e16``, ``0.00001``)."""
    out = _ENCODER.encode(payload)
    return out if out.isascii() else json.dumps(payload, separators=(",", ":")).encode()


class MqttDoor:
    """Intake and publishing over MQTT; :meth:`run` runs until cancelled.

    Keyword arguments: ``pipeline``, ``config``, ``tokens_mode``, ``state`` (the broker's health
    state), and for an external broker ``host``, ``port``, ``username``, ``password`` (its client
    connections reconnect with backoff). For the embedded mode, :meth:`embedded_server` builds the
    in-process server that feeds this door instead.
    """

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        config: Config,
        tokens_mode: bool,
        state: dict[str, Any],
        host: str = "",
        port: int = 0,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.tokens_mode = tokens_mode
        self.state = state
        self.metrics = pipeline.metrics
        self._server: MqttServer | None = None
        self._publisher: MqttClient | None = None
        self._publish_ready = asyncio.Event()
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending_fixes: list[tuple[str, Any]] = []
        self._topics: dict[str, tuple[str, str, bool] | None] = {}
        self._received = dict.fromkeys(INPUT_KINDS, 0)  # counted into the metric once per loop turn
        self._received_flush: asyncio.Handle | None = None
        self._pending_done: asyncio.Future[Any] | None = None
        self._held: asyncio.Future[Any] | None = None  # never done: messages received while closing
        self.connections = config.mqtt.ingest_connections
        self._batch_bytes, self._body_bytes = config.limits.batch_bytes, config.limits.body_bytes
        self._ingest_queue = config.queues.ingest

    def embedded_server(self, *, host: str, port: int, tokens: TokenStore | None) -> MqttServer:
        """The in-process MQTT server whose input is this door's :meth:`dispatch` (enter it before
        :meth:`run`): the contract's ACL, PUBACK once durable, packets over the updates limit
        (``limits.batch_bytes`` + 64 KiB) skipped, offline sessions kept ``sessions.max_s``."""
        cfg = self.config
        self._server = MqttServer(
            host=host,
            port=port,
            tokens=tokens,
            published_readers=frozenset(cfg.auth.published_readers),
            dispatch=self._dispatch,  # the server catches and logs what it raises, as dispatch would
            dropped=self.dropped,
            max_packet_bytes=cfg.limits.batch_bytes + 64 * 1024,
            session_expiry_s=cfg.sessions.max_s,
            connect_timeout_s=cfg.mqtt.connect_timeout_s,
            metrics=self.metrics,
        )
        return self._server

    async def wait_connected(self, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            await self._publish_ready.wait()

    async def run(self) -> None:
        if self._server is not None:
            await self._run_embedded(self._server)
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._publisher_loop())
            for i in range(self.connections):
                tg.create_task(self._intake_loop(i))

    async def _run_embedded(self, server: MqttServer) -> None:
        """Retained status ``up`` now, ``down`` on a graceful stop (on ``kill -9`` the listening
        socket dies with the process, which every client sees)."""
        server.publish(STATUS_TOPIC, self._status("up"), retain=True)
        self._publish_ready.set()
        self.state["mqtt"] = "connected"
        self.metrics.mqtt_connected.set(1)
        try:
            await asyncio.Event().wait()
        finally:
            self._publish_ready.clear()
            self.metrics.mqtt_connected.set(0)
            if server.listening:
                server.publish(STATUS_TOPIC, self._status("down"), retain=True)

    async def _publisher_loop(self) -> None:
        backoff = Backoff()
        down = json.dumps({"state": "down", "t": None}).encode()
        while True:
            try:
                async with MqttClient(
                    host=self.host,
                    port=self.port,
                    username=self.username,
                    password=self.password,
                    client_prefix="kcloak-pub",
                    will=(STATUS_TOPIC, down),
                    window=65000,
                ) as pub:
                    self._publisher = pub
                    await pub.publish(STATUS_TOPIC, self._status("up"), qos=1, retain=True)
                    self._publish_ready.set()
                    self.state["mqtt"] = "connected"
                    self.state.pop("mqtt_down_since", None)
                    self.metrics.mqtt_connected.set(1)
                    backoff.reset()
                    try:
                        await pub.wait_closed()
                    except asyncio.CancelledError:
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(
                                pub.publish(STATUS_TOPIC, self._status("down"), qos=1, retain=True), 2
                            )
                        raise
            except MqttError:
                self._publish_ready.clear()
                self._publisher = None
                self.state["mqtt"] = "disconnected"
                self.state.setdefault("mqtt_down_since", time.monotonic())
                self.metrics.mqtt_connected.set(0)
                log_event(log, "mqtt_disconnected", logging.WARNING, connection="publish")
                await backoff.wait()

    def _status(self, state: str) -> bytes:
        cfg = self.config
        return json.dumps(
            {
                "state": state,
                "version": __version__,
                "algorithm": cfg.cloaking.algorithm,
                "auth": "tokens" if self.tokens_mode else "open",
                "t": time.time(),
            }
        ).encode()

    async def _intake_loop(self, i: int) -> None:
        backoff = Backoff()
        share = self.connections > 1
        filters = [f"$share/kcloak/{ROOT}{t}/+" if share else f"{ROOT}{t}/+" for t in TOPICS]
        persistent = self.config.mqtt.mode.startswith("mqtt://")
        while True:
            try:
                async with MqttClient(
                    host=self.host,
                    port=self.port,
                    username=self.username,
                    password=self.password,
                    client_id=intake_client_id(self.config, i) if persistent else None,
                    client_prefix="kcloak-in",
                    on_messages=self._dispatch_batch,
                    on_too_large=lambda topic: self.dropped(topic, "too_large"),
                    max_packet=self.config.limits.batch_bytes + 64 * 1024,
                ) as conn:
                    await conn.subscribe(filters)
                    backoff.reset()  # an outage after hours of service starts again at the shortest wait
                    await conn.wait_closed()
            except MqttError:
                log_event(log, "mqtt_disconnected", logging.WARNING, connection="intake")
                await backoff.wait()

    async def publish(self, topic: str, payload: dict[str, Any]) -> None:
        if self._server is not None:
            self._server.publish(topic, encode_message(payload))
            return
        try:
            if not self._publish_ready.is_set():
                await self.wait_connected(5.0)
        except TimeoutError:
            log_event(log, "mqtt_publish_dropped", logging.WARNING, reason="disconnected")
            return
        publisher = self._publisher
        if publisher is None:
            log_event(log, "mqtt_publish_dropped", logging.WARNING, reason="disconnected")
            return
        try:
            await publisher.publish(topic, encode_message(payload), qos=1)
        except MqttError:
            log_event(log, "mqtt_publish_failed", logging.WARNING)

    async def publish_confirmed(self, topic: str, payload: bytes, *, timeout_s: float = 10.0) -> None:
        """Publish at QoS 1 and return once the MQTT broker acknowledged it (published windows).

        Raises :class:`MqttError` when not connected or when no PUBACK came within ``timeout_s``.
        The embedded server takes it at once (queued for offline persistent sessions).
        """
        if self._server is not None:
            if not self._server.listening:
                raise MqttError("embedded MQTT server stopped")
            self._server.publish(topic, payload)
            return
        try:
            await self.wait_connected(timeout_s)
        except TimeoutError:
            raise MqttError("not connected") from None
        publisher = self._publisher
        if publisher is None:
            raise MqttError("not connected")
        try:
            async with asyncio.timeout(timeout_s):
                await publisher.publish(topic, payload, qos=1)
        except TimeoutError:
            raise MqttError("no PUBACK in time") from None

    # -- dispatch ------------------------------------------------------------------------------
    def _drop(self, topic: str, reason: str) -> None:
        self.metrics.messages_dropped.labels(transport="mqtt", topic=topic, reason=reason).inc()

    def _dispatch_batch(self, messages: list[Incoming]) -> list[asyncio.Future[Any] | None]:
        """One completion per message (the intake acknowledges each once it is done). Once the
        pipeline is closing, messages are left unacknowledged instead of refused ``shutdown``:
        with a persistent session the MQTT broker hands them to the next run."""
        if self.pipeline.closing:
            if self._held is None:
                self._held = asyncio.get_running_loop().create_future()
            return [self._held] * len(messages)
        return [self.dispatch(m.topic, m.payload, m.retain) for m in messages]

    def dispatch(self, topic: str, payload: bytes, retain: bool) -> asyncio.Future[Any] | None:
        """Hand one received message to the pipeline, in arrival order.

        Returns None when the message may be acknowledged at once (dropped and counted, or a query,
        which is admitted here and answered later), or a future that is done once the message is
        durable: a fix committed to the movement store (or rejected), a batch decided, a profile
        stored. An MQTT door acknowledges a message only then, so a PUBACK promises that the fix
        survives ``kill -9``. Never raises: one bad message never ends a connection.
        """
        try:
            return self._dispatch(topic, payload, retain)
        except Exception as exc:
            log_event(log, "mqtt_dispatch_failed", logging.ERROR, error=type(exc).__name__)
            return None

    def dropped(self, topic: str, reason: str) -> None:
        """Count a message on ``topic`` that the transport dropped before it could be read whole
        (``too_large``, ``retained``)."""
        parsed = input_topic(topic)
        if parsed is not None:
            self.metrics.messages.labels(transport="mqtt", topic=parsed[0]).inc()
            self._drop(parsed[0], reason)

    def _topic(self, topic: str) -> tuple[str, str, bool] | None:
        """``(kind, user, whether the user id is valid)`` of an input topic, None for any other."""
        try:
            return self._topics[topic]
        except KeyError:
            pass
        parsed = input_topic(topic)
        known = None if parsed is None else (parsed[0], parsed[1], valid_user_id(parsed[1]))
        if len(self._topics) >= TOPIC_CACHE:
            self._topics.clear()
        self._topics[topic] = known
        return known

    def _dispatch(self, topic: str, payload: bytes, retain: bool) -> asyncio.Future[Any] | None:
        try:  # a known topic: one lookup, no call
            parsed = self._topics[topic]
        except KeyError:
            parsed = self._topic(topic)
        if parsed is None:
            return None
        kind, user, user_ok = parsed
        self._received[kind] += 1
        if self._received_flush is None:
            self._received_flush = asyncio.get_running_loop().call_soon(self._count_received)
        if retain:
            self._drop(kind, "retained")
            return None
        if not user_ok:
            self._drop(kind, "invalid")
            return None
        if len(payload) > (self._batch_bytes if kind == "updates" else self._body_bytes):
            self._drop(kind, "too_large")
            return None
        if self._inflight >= self._ingest_queue:
            self._drop(kind, "overloaded")
            return None
        if kind == "update":
            # A well-formed fix is decoded and checked in one pass; anything else takes the full
            # path, which names the reason (malformed JSON is dropped here, a bad fix rejected later).
            fix: Any = decode_fix(payload)
            if fix is None:
                try:
                    fix = parse_json_object(payload)
                except MalformedJson:
                    self._drop(kind, "malformed_json")
                    return None
            # Single fixes are gathered over one loop iteration and stored in one write (they keep
            # their arrival order, so per-user ordering rules apply as if handled one by one).
            self._pending_fixes.append((user, fix))
            done = self._pending_done
            if done is None:
                loop = asyncio.get_running_loop()
                done = self._pending_done = loop.create_future()
                loop.call_soon(self._flush_fixes)
            return done
        try:
            obj = parse_json_object(payload)
        except MalformedJson:  # whatever made it unparseable (parse_json_object raises nothing else)
            self._drop(kind, "malformed_json")
            return None
        if kind == "query":
            self._on_query(user, obj)
            return None
        handler = self._on_updates if kind == "updates" else self._on_profile
        self._inflight += 1
        task = asyncio.create_task(handler(user, obj))
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _count_received(self) -> None:
        """``kcloak_messages_total`` for the messages of this loop turn (one increment per topic kind)."""
        self._received_flush = None
        for kind, n in self._received.items():
            if n:
                self.metrics.messages.labels(transport="mqtt", topic=kind).inc(n)
                self._received[kind] = 0

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._inflight -= 1
        if not task.cancelled() and task.exception() is not None:
            log_event(log, "mqtt_handler_failed", logging.ERROR, error=type(task.exception()).__name__)

    def _flush_fixes(self) -> None:
        items, self._pending_fixes = self._pending_fixes, []
        done, self._pending_done = self._pending_done, None
        assert done is not None
        self._inflight += 1
        task = self.pipeline.enqueue_fixes("mqtt", items)

        def decided(t: asyncio.Task[Any]) -> None:
            self._inflight -= 1
            if done.done():
                return
            if t.cancelled():  # never stored: the transports must not acknowledge these fixes
                done.cancel()
                return
            if t.exception() is not None:
                log_event(log, "mqtt_handler_failed", logging.ERROR, error=type(t.exception()).__name__)
            done.set_result(None)

        task.add_done_callback(decided)

    async def _on_updates(self, user: str, obj: dict[str, Any]) -> None:
        updates = obj.get("updates")
        if set(obj) != {"updates"} or not isinstance(updates, list):
            self._drop("updates", "invalid")
            return
        if len(updates) > self.config.limits.batch_items:
            self._drop("updates", "too_large")
            return
        if self.tokens_mode and any(_item_user(item, user) != user for item in updates):
            self._drop("updates", "forbidden")
            return
        items: list[tuple[str, Any]] = []
        for item in updates:
            if isinstance(item, dict) and "user" in item:
                items.append((_item_user(item, user), {k: v for k, v in item.items() if k != "user"}))
            else:
                items.append((user, item))
        await self.pipeline.enqueue_fixes("mqtt", items, batch=True)

    async def _on_profile(self, user: str, obj: dict[str, Any]) -> None:
        request_id = obj.get("request_id")
        status: dict[str, Any] = {"kind": "profile"}
        # A request id is echoed only when it is one (contract §1: the query id pattern).
        bad_request_id = "request_id" in obj and not valid_query_id(request_id)
        if not bad_request_id and request_id is not None:
            status["request_id"] = request_id
        unknown = set(obj) - {"request_id", "profile"}
        reason: str | None = None
        if unknown or "profile" not in obj or bad_request_id:
            reason = "invalid"
        elif not self.pipeline.profile_rate_ok(user):
            reason = "rate_limited"
        else:
            try:
                profile = await self.pipeline.set_profile(user, obj["profile"])
                status.update(status="ok", profile=profile.to_dict())
            except ProfileError:
                reason = "invalid"
            except StoreError:  # the store cannot write (disk full): refused as HTTP does, 503 there
                reason = "overloaded"
        if reason is not None:
            status.update(status="refused", reason=reason)
        self.metrics.profile_sets.labels(transport="mqtt", status=status["status"], reason=reason or "none").inc()
        status["t"] = time.time()
        await self.publish(f"{ROOT}status/{user}", status)

    def _on_query(self, user: str, obj: dict[str, Any]) -> None:
        """Admit a query (its id and duplicates) at once, then run it to its one answer."""
        try:
            qid = self.pipeline.admit(user, obj)
        except QueryRejected:
            self._drop("query", "invalid")
            return
        except Duplicate:
            self._drop("query", "duplicate")
            return
        self._inflight += 1
        if self._server is not None and type(self.pipeline) is Pipeline:
            # One process, embedded server: no other gateway can have answered, and publishing
            # does not wait, so the query's own task publishes its answer when it ends.
            # Its checks run at once (eager) unless a fix, batch or profile came in this loop turn:
            # those are handed on in the next turn, and a query must not overtake them.
            received = self._received
            eager = not (received["update"] or received["updates"] or received["profile"])
            started = self.pipeline.start_query("mqtt", user, qid, obj, eager=eager)
            started.add_done_callback(partial(self._publish_answer, user))
            return
        task = asyncio.create_task(self._answer(user, qid, obj))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _publish_answer(self, user: str, task: asyncio.Task[QueryOutcome]) -> None:
        """Publish the answer of a query started by :meth:`_on_query` (none if it was cancelled
        before it began, as :meth:`_answer` publishes none then)."""
        self._inflight -= 1
        if task.cancelled():
            return
        if task.exception() is not None:  # never: a query answers every failure
            log_event(log, "mqtt_handler_failed", logging.ERROR, error=type(task.exception()).__name__)
            return
        assert self._server is not None
        self._server.publish(f"{ROOT}answer/{user}", encode_message(task.result().answer.to_json()))

    async def _answer(self, user: str, qid: str, obj: dict[str, Any]) -> None:
        if await self.pipeline.is_answered(user, qid):  # answered through another gateway (cluster)
            self._drop("query", "duplicate")
            return
        outcome = await self.pipeline.query("mqtt", user, qid, obj)
        await self.publish(f"{ROOT}answer/{user}", outcome.answer.to_json())


def _item_user(item: Any, sender: str) -> str:
    """The user a batch item is for: its ``user`` field when that is a string, else the topic's user."""
    who = item.get("user", sender) if isinstance(item, dict) else sender
    return who if isinstance(who, str) else sender


def intake_client_id(config: Config, i: int) -> str:
    """The MQTT client id of intake connection ``i``: stable across restarts of one deployment, so
    its persistent session (and what the MQTT broker holds for it) is found again. Derived from the
    absolute data directory, which one ``kcloak serve`` at a time owns (it is locked)."""
    where = str(Path(config.storage.data_dir).resolve())
    return f"kcloak-{hashlib.sha256(where.encode()).hexdigest()[:12]}-in{i}"


def external_target(config: Config) -> tuple[str, int, str | None]:
    """Host, port and username of an ``mqtt://[USER@]HOST[:PORT]`` mode."""
    rest = config.mqtt.mode[len("mqtt://") :]
    user = config.mqtt.username or None
    if "@" in rest:
        user, rest = rest.split("@", 1)
    host, _, port = rest.partition(":")
    if host.startswith("[") and "]" in rest:
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    return host, int(port) if port else 1883, user
