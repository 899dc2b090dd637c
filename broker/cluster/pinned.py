"""A pinned pull member of a consumer's priority group (docs/cluster.md "Workers"), on nats-py's raw API.

nats-py 2.16 knows nothing of priority groups, so a member speaks the JetStream pull protocol itself:
it publishes ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` with ``{"batch", "expires", "group", "id"}``
to an inbox of its own and reads what comes back there (no ``idle_heartbeat``: a pull's expiry, ``expires_s``,
is shorter than the lease, so its ``408`` already answers an idle pull in time, at a third less idle traffic):

- a message with header ``Nats-Pin-Id``: delivered to this member, which the server has pinned; the
  member remembers the id and sends it with every later pull. When it sees an id for the first time it
  awaits ``on_pinned`` **before** handing over the message (the router or owner rebuilds first);
- status ``423`` (the pin id is no longer the consumer's: another member is pinned now): the member
  clears the id, awaits ``on_unpinned`` and drops what it had buffered (it was delivered under the old
  pin and will be redelivered to the new holder);
- status ``100`` (idle heartbeat), ``408`` (the pull expired), ``404`` (no messages), ``409``
  (e.g. leadership change, consumer deleted): the pull is over, or alive; the member pulls again.

**Lease.** ``lease_s`` (half the consumer's ``priority_timeout``): a pinned member that has had no answer to
its pulls (no message, no expiry) for ``lease_s`` seconds gives up its pin at once
(``on_unpinned``). The server pins another member only after ``priority_timeout`` without a pull from the
holder, and a live holder pulls again as soon as a pull is answered, so the holder lets go about
``priority_timeout / 2`` before anyone else can be pinned.

**Backups.** A member that holds no pin only waits to be pinned: it pulls with a longer expiry
(``backup_expires_s``, by default the consumer's ``priority_timeout``) than a pinned one. Failover is as fast:
the server pins a *waiting* pull when the holder has not pulled for ``priority_timeout``, and a backup always
has one waiting; the idle pulls of the W − 1 backups of every consumer, which grow with the number of workers,
come several times less often.

**Catch-up.** A member that dies leaves the messages it had pulled and not acknowledged pending on the
consumer until ``ack_wait`` passes; the next pinned member would see later messages first. With
``catch_up=True`` (work-queue streams) a member that has just been pinned reads the messages still in
the stream above the consumer's ack floor directly (``STREAM.MSG.GET`` with ``next_by_subj``), hands
them over in stream order before anything delivered, and later acknowledges their redeliveries without
handing them over again. So a failover keeps each subject's order and loses nothing.

Delivery to the handler is in stream order, in micro-batches of what has arrived (never waiting for a
pull to fill). The handler acknowledges (:meth:`PinnedMember.ack`) what it has applied.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kcloak.broker.cluster.topology import PRIORITY_GROUP, JetStreamApiError, api_request
from kcloak.core.logs import log_event

log = logging.getLogger("kcloak.cluster")

PIN_HEADER = "Nats-Pin-Id"
NS = 1_000_000_000


@dataclass(slots=True)
class Delivered:
    """One message handed to the handler: stream sequence, subject, headers, body and its ack subject
    (None for a message read by catch-up, which is acknowledged when the server redelivers it)."""

    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes
    reply: str | None
    redelivered: bool = False


Handler = Callable[[list[Delivered]], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]


async def _noop() -> None:
    return None


def ack_seq(reply: str) -> tuple[int, int]:
    """``(stream sequence, delivery count)`` from a ``$JS.ACK…`` reply subject."""
    tokens = reply.split(".")
    if len(tokens) >= 12:  # v2: $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>...
        return int(tokens[7]), int(tokens[6])
    return int(tokens[5]), int(tokens[4])  # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>...


class PinnedMember:
    """One member of group ``kcloak`` of the pull consumer ``stream``/``consumer``.

    Keyword arguments: ``nc`` (a connected nats-py client), ``handler`` (awaited with each micro-batch, in
    stream order), ``on_pinned`` / ``on_unpinned`` (pin gained / lost), ``batch`` (most messages per pull and
    buffered), ``expires_s`` (a pull's lifetime while pinned), ``backup_expires_s`` (while not pinned; default
    ``2 × lease_s``, the consumer's ``priority_timeout``), ``lease_s`` (see the module), ``start_delay_s`` (the first
    pull waits this long: backups let the preferred member take the pin first), ``catch_up``, ``filter_subject``
    (needed with ``catch_up``), ``hold_redelivery`` (given the redelivery of a message the catch-up handed over:
    True when the handler took it to acknowledge later, e.g. a query held until its answer is stored; else it is
    acknowledged at once). :meth:`run` until :meth:`stop`.
    """

    def __init__(
        self,
        nc: Any,
        stream: str,
        consumer: str,
        *,
        handler: Handler,
        on_pinned: Hook = _noop,
        on_unpinned: Hook = _noop,
        batch: int = 256,
        expires_s: float = 1.0,
        lease_s: float = 5.0,
        start_delay_s: float = 0.0,
        catch_up: bool = False,
        filter_subject: str | None = None,
        hold_redelivery: Callable[[Delivered], bool] | None = None,
        backup_expires_s: float | None = None,
    ) -> None:
        if catch_up and filter_subject is None:
            raise ValueError("catch_up needs filter_subject")
        self.nc = nc
        self.stream = stream
        self.consumer = consumer
        self.handler = handler
        self.on_pinned = on_pinned
        self.on_unpinned = on_unpinned
        self.batch = batch
        self.expires_s = expires_s
        self.backup_expires_s = max(expires_s, 2 * lease_s if backup_expires_s is None else backup_expires_s)
        self.lease_s = lease_s
        self.start_delay_s = start_delay_s
        self.catch_up = catch_up
        self.filter_subject = filter_subject
        self.hold_redelivery = hold_redelivery
        self.pin_id: str | None = None
        self.pinned = False  # on_pinned has run for the current pin (and on_unpinned not since)
        self.counters = {"delivered": 0, "pins": 0, "unpins": 0, "status_423": 0, "catch_up": 0, "skipped": 0}
        self._inbox = nc.new_inbox()
        self._request = 0
        self._pull_done = asyncio.Event()
        self._remaining = 0
        self._last_ok = time.monotonic()
        self._has_pin = asyncio.Event()  # set when a pin id is learnt (wakes the lease watchdog)
        self._queue: asyncio.Queue[Delivered | str] = asyncio.Queue()
        self._buffered = 0
        self._room = asyncio.Event()  # set when the hand-over has taken messages out of the buffer
        self._caught_up: set[int] = set()
        self._fresh_from: dict[str, int] = {}  # pin id -> stream seq of its first first-time delivery
        self._unpin_tasks: set[asyncio.Future[None]] = set()
        self._stopping = False
        self._sub: Any = None

    # -- public --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Pull and hand over until :meth:`stop`; never raises on server or network trouble."""
        self._sub = await self.nc.subscribe(self._inbox + ".*", cb=self._on_msg)
        processor = asyncio.create_task(self._process())
        watchdog = asyncio.create_task(self._watch_lease())
        try:
            if self.start_delay_s > 0:
                await asyncio.sleep(self.start_delay_s)
            while not self._stopping:
                await self._pull_once()
        finally:
            for task in (processor, watchdog):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _watch_lease(self) -> None:
        """Give up the pin as soon as no answer to our pulls came for ``lease_s``: the watchdog sleeps until the
        lease would end (and again from the latest answer), or, holding no pin, until one is gained; no periodic
        tick, so an idle member (a backup above all) costs no timer wake-ups."""
        while True:
            if self.pin_id is None:
                self._has_pin.clear()
                await self._has_pin.wait()
                continue
            left = self._last_ok + self.lease_s - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
            else:
                self._lose_pin("lease")

    async def stop(self, *, unpin: bool = True) -> None:
        """Stop pulling; with ``unpin`` ask the server to release our pin so a backup takes over at once."""
        self._stopping = True
        self._pull_done.set()
        if unpin and self.pin_id is not None:
            with contextlib.suppress(Exception):
                await api_request(
                    self.nc,
                    f"CONSUMER.UNPIN.{self.stream}.{self.consumer}",
                    {"group": PRIORITY_GROUP},
                    timeout=2.0,
                )
        if self.pinned:
            self.pinned = False
            await self.on_unpinned()

    async def ack(self, msg: Delivered) -> None:
        """Acknowledge a delivered message (a catch-up message is acknowledged on its redelivery)."""
        if msg.reply is not None:
            await self.nc.publish(msg.reply, b"+ACK")

    async def ack_sync(self, msg: Delivered, timeout: float = 2.0) -> None:
        """Acknowledge and wait until the server has recorded it (the consumer's ack floor moves)."""
        if msg.reply is not None:
            await self.nc.request(msg.reply, b"+ACK", timeout=timeout)

    # -- pulling -------------------------------------------------------------------------------
    async def _pull_once(self) -> None:
        if self._buffered >= self.batch:
            # The hand-over is behind: wait (a little: the lease needs answered pulls) for room before pulling, so
            # the buffer stays near ``batch`` instead of growing by a pull each round trip until messages wait
            # past the consumer's ack_wait and come again (seen under load: about 1,500 redeliveries in 20,000).
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.expires_s / 2):
                    await self._room.wait()
        self._request += 1
        batch = max(1, self.batch - self._buffered)
        expires_s = self.expires_s if self.pin_id is not None else self.backup_expires_s
        body: dict[str, Any] = {
            "batch": batch,
            "expires": int(expires_s * NS),
            "group": PRIORITY_GROUP,
        }
        if self.pin_id is not None:
            body["id"] = self.pin_id
        self._remaining = batch
        self._pull_done.clear()
        try:
            await self.nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}",
                json.dumps(body).encode(),
                reply=f"{self._inbox}.{self._request}",
            )
        except Exception:
            await asyncio.sleep(0.2)  # reconnecting; the lease check runs meanwhile
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(expires_s + 1.0):
                await self._pull_done.wait()

    async def _on_msg(self, msg: Any) -> None:
        """nats-py's callback for everything arriving on our inbox (runs on the client's task)."""
        headers: dict[str, str] = msg.headers or {}
        status = headers.get("Status")
        current = msg.subject.rsplit(".", 1)[-1] == str(self._request)
        if status is not None and not msg.reply:
            if not current:
                return
            if status == "100":
                self._last_ok = time.monotonic()
                return
            if status == "423":
                self.counters["status_423"] += 1
                self._lose_pin("pin_id_mismatch")
            elif status in ("408", "404"):
                self._last_ok = time.monotonic()
            self._pull_done.set()
            return
        if not msg.reply:
            return
        seq, delivered = ack_seq(msg.reply)
        pin = headers.get(PIN_HEADER)
        if pin is not None and pin != self.pin_id:
            self.pin_id = pin
            self._has_pin.set()
            if delivered == 1:
                self._fresh_from = {pin: seq}
            self._queue.put_nowait(pin)  # marker: on_pinned before the messages that follow
            # Pull again at once, with the pin id and a pinned member's short expiry: the lease counts on answered
            # pulls, and this one may be a backup's long pull (what it still delivers comes to the inbox as well).
            self._pull_done.set()
        self._last_ok = time.monotonic()
        self._buffered += 1
        if delivered > 1:
            self.counters["redeliveries"] = self.counters.get("redeliveries", 0) + 1
        self._queue.put_nowait(Delivered(seq, msg.subject, dict(headers), msg.data, msg.reply, delivered > 1))
        self._remaining -= 1  # (a data message's subject is its stream subject, not our inbox)
        if self._remaining <= 0:
            self._pull_done.set()

    def _lose_pin(self, why: str) -> None:
        """Forget the pin at once: ``on_unpinned`` starts now (an owner drops its index without waiting for the
        hand-over in progress), and what is still buffered is dropped."""
        if self.pin_id is None and not self.pinned:
            return
        self.pin_id = None
        if self.pinned:
            self.pinned = False
            self.counters["unpins"] += 1
            task: asyncio.Future[None] = asyncio.ensure_future(self.on_unpinned())
            self._unpin_tasks.add(task)
            task.add_done_callback(self._unpin_tasks.discard)
        self._queue.put_nowait("")  # marker: the pin changed
        log_event(log, "pin_lost", logging.INFO, consumer=self.consumer, why=why)

    # -- handing over --------------------------------------------------------------------------
    async def _process(self) -> None:
        while True:
            item = await self._queue.get()
            items = [item]
            while not self._queue.empty() and len(items) < self.batch:
                items.append(self._queue.get_nowait())
            try:
                await self._process_items(items)
            except Exception:  # never let the hand-over task die: the member would hold its pin and do nothing
                log.exception("pinned_member_failed", extra={"kcloak_fields": {"consumer": self.consumer}})

    async def _process_items(self, items: list[Delivered | str]) -> None:
        batch: list[Delivered] = []
        for it in items:
            if isinstance(it, str):
                if batch:
                    await self._hand_over(batch)
                    batch = []
                await self._pin_changed(it)
                continue
            self._buffered -= 1
            if not self.pinned:
                continue  # delivered under a pin we lost: the new holder gets it again
            if it.seq in self._caught_up:
                self._caught_up.discard(it.seq)
                self.counters["skipped"] += 1
                if self.hold_redelivery is None or not self.hold_redelivery(it):
                    await self.ack(it)
                continue
            batch.append(it)
        if batch:
            await self._hand_over(batch)
        self._room.set()

    async def _hand_over(self, batch: list[Delivered]) -> None:
        self.counters["delivered"] += len(batch)
        try:
            await self.handler(batch)
        except Exception:
            log.exception("handler_failed", extra={"kcloak_fields": {"consumer": self.consumer}})
            self.counters["recoveries"] = self.counters.get("recoveries", 0) + 1
            await asyncio.sleep(0.5)
            await self._recover()

    async def _recover(self) -> None:
        """After a failed hand-over (its messages not acknowledged, the handler's state unknown): rebuild as on a
        new pin and, on a work-queue stream, hand over again everything above the ack floor, in order."""
        if self.pinned and self.pin_id is not None:
            await self._rebuild(self.pin_id)

    async def _pin_changed(self, pin: str) -> None:
        if self.pinned:
            self.pinned = False
            self.counters["unpins"] += 1
            await self.on_unpinned()
        if not pin or pin != self.pin_id:
            return
        self.pinned = True
        self.counters["pins"] += 1
        self._caught_up.clear()
        await self._rebuild(pin, self._fresh_from.pop(pin, None))

    async def _rebuild(self, pin: str, fresh_from: int | None = None) -> None:
        """``on_pinned`` (and the catch-up) until it succeeds or the pin is lost: a rebuild reads the streams, which
        fails while a NATS node is down and its streams elect leaders; nothing is handed over before it.
        ``fresh_from``: the stream sequence of the first message delivered under this pin for the first time (the
        catch-up stops below it: what a predecessor held was delivered before it)."""
        while True:
            try:
                await self.on_pinned()
                if self.catch_up:
                    await self._catch_up(fresh_from)
                return
            except Exception:
                self.counters["rebuild_failures"] = self.counters.get("rebuild_failures", 0) + 1
                log_event(log, "rebuild_failed", logging.WARNING, consumer=self.consumer)
            await asyncio.sleep(0.5)
            if self.pin_id != pin:
                return  # lost meanwhile: _lose_pin ran on_unpinned

    async def _catch_up(self, fresh_from: int | None = None) -> None:
        """Hand over the messages still in the stream above the consumer's ack floor, in stream order.

        With ``fresh_from`` (a new pin whose first message was a first delivery), only those below it: the consumer
        delivers new messages in stream order, so everything a predecessor was given (and may not have acknowledged)
        lies below the first message this member got for the first time, and what lies above comes to this member
        by the pull itself (a fresh start reads nothing)."""
        try:
            info = await api_request(self.nc, f"CONSUMER.INFO.{self.stream}.{self.consumer}", None)
            seq = int(info["ack_floor"]["stream_seq"]) + 1
            last = int(info["delivered"]["stream_seq"])
            if fresh_from is not None:
                last = min(last, fresh_from - 1)
            found: list[Delivered] = []
            while seq <= last:
                try:
                    got = await api_request(
                        self.nc,
                        f"STREAM.MSG.GET.{self.stream}",
                        {"seq": seq, "next_by_subj": self.filter_subject},
                    )
                except JetStreamApiError:
                    break  # nothing more at or after seq
                m = got["message"]
                mseq = int(m["seq"])
                if mseq > last:
                    break
                found.append(Delivered(mseq, m["subject"], _headers(m.get("hdrs")), _b64(m.get("data")), None, True))
                seq = mseq + 1
        except Exception:
            log_event(log, "catch_up_failed", logging.WARNING, consumer=self.consumer)
            raise
        if found:
            self._caught_up.update(d.seq for d in found)
            self.counters["catch_up"] += len(found)
            await self._hand_over(found)


async def publish_durably(
    js: Any,
    subject: str,
    data: bytes,
    *,
    stream: str,
    msg_id: str,
    keep_trying: Callable[[], bool],
    limit_s: float = 30.0,
) -> Any:
    """``js.publish`` with the message id ``msg_id``, retried (the stream's duplicate window makes a retry
    store it once) while ``keep_trying()`` and for at most ``limit_s`` (a stream leader election takes a
    few seconds); returns the PubAck, or raises the last error."""
    deadline = time.monotonic() + limit_s
    pause = 0.1
    while True:
        try:
            return await js.publish(subject, data, stream=stream, headers={"Nats-Msg-Id": msg_id}, timeout=5.0)
        except Exception:
            if not keep_trying() or time.monotonic() + pause > deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)


class DuplicateSeq(int):
    """A stream sequence whose PubAck said ``duplicate``: a message with the same ``Nats-Msg-Id`` was stored
    before (this one was not)."""


def _stored_seq(seq: Any, duplicate: Any) -> int:
    return DuplicateSeq(seq) if duplicate else int(seq)


class PubAcks:
    """JetStream publishes whose PubAcks are collected on one inbox of our own, for a micro-batch's events.

    ``js.publish`` is a full request per message (a fresh future, a timer, ``wait_for``, a PubAck object);
    :meth:`send` publishes at once and returns a future of the stored stream sequence, and the caller awaits a
    batch's futures together (:meth:`settle`). A publish that failed or got no PubAck within ``timeout_s`` is
    retried with :func:`publish_durably` (same ``Nats-Msg-Id``: the stream stores it once)."""

    def __init__(self, nc: Any, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self._prefix = ""
        self._sub: Any = None
        self._next = 0
        self._waiting: dict[str, asyncio.Future[int]] = {}
        self.retries = 0

    async def _ensure(self) -> None:
        if self._sub is None:
            self._prefix = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(self._prefix + ".*", cb=self._on_ack)

    async def _on_ack(self, msg: Any) -> None:
        fut = self._waiting.pop(msg.subject[len(self._prefix) + 1 :], None)
        if fut is None or fut.done():
            return
        status = (msg.headers or {}).get("Status")
        if status is not None:
            fut.set_exception(JetStreamApiError(f"publish failed: status {status}"))  # 503: no stream (yet)
            return
        try:
            resp = json.loads(msg.data)
            error = resp.get("error")
            if error:
                fut.set_exception(JetStreamApiError(f"publish failed: {error.get('code')} {error.get('description')}"))
            else:
                fut.set_result(_stored_seq(resp["seq"], resp.get("duplicate")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            fut.set_exception(JetStreamApiError(f"publish failed: bad PubAck ({type(exc).__name__})"))

    async def send(
        self, subject: str, data: bytes, *, stream: str, msg_id: str, headers: dict[str, str] | None = None
    ) -> asyncio.Future[int]:
        """Publish now (with ``headers`` besides the message id and stream, e.g. an expected last sequence); the
        future is the stream sequence from the PubAck (or the error)."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        try:
            await self._ensure()
            self._next += 1
            token = str(self._next)
            self._waiting[token] = fut
            await self.nc.publish(
                subject,
                data,
                reply=f"{self._prefix}.{token}",
                headers={"Nats-Msg-Id": msg_id, "Nats-Expected-Stream": stream, **(headers or {})},
            )
        except Exception as exc:
            if not fut.done():
                fut.set_exception(exc)
        return fut

    async def publish(
        self, subject: str, data: bytes, *, stream: str, msg_id: str, keep_trying: Callable[[], bool]
    ) -> int:
        """One publish and its PubAck: the stream sequence (retried as :meth:`settle` does)."""
        fut = await self.send(subject, data, stream=stream, msg_id=msg_id)
        return (await self.settle([(fut, subject, data, stream, msg_id)], keep_trying=keep_trying))[0]

    async def settle(
        self,
        sent: list[tuple[asyncio.Future[int], str, bytes, str, str]],
        *,
        keep_trying: Callable[[], bool],
    ) -> list[int]:
        """The stream sequences of ``sent`` (``(future, subject, data, stream, msg_id)`` from :meth:`send`), in
        order; what failed or timed out is published again with :func:`publish_durably` (which raises when it
        gives up)."""
        futs = [item[0] for item in sent]
        if futs:
            await asyncio.wait(futs, timeout=self.timeout_s)
        seqs: list[int] = []
        for fut, subject, data, stream, msg_id in sent:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                seqs.append(fut.result())
                continue
            if not fut.done():
                fut.cancel()
            self.retries += 1
            js = self.nc.jetstream()
            ack = await publish_durably(js, subject, data, stream=stream, msg_id=msg_id, keep_trying=keep_trying)
            seqs.append(_stored_seq(ack.seq, ack.duplicate))
        for token in [t for t, f in self._waiting.items() if f.done()]:
            del self._waiting[token]
        return seqs


NATS_HEADER_PARSER: dict[str, Callable[[bytes], dict[str, str]]] = {}
"""nats-py's own parser (``"original"``) once :func:`install_fast_header_parsing` has replaced it."""


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py 2.16's ``Client._parse_header_lines``, the same result for every input, without its per-character
    generator (the worker's hottest nats-py function: every delivered message has a header block)."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if key and key.split() != [key]:  # whitespace inside the name (str.split splits on what isspace() is)
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def install_fast_header_parsing() -> bool:
    """Use :func:`parse_header_lines` in nats-py (process-wide; the same headers, less CPU). False when this
    nats-py has no ``_parse_header_lines`` (then nothing changes)."""
    from nats.aio.client import Client

    if not hasattr(Client, "_parse_header_lines"):
        return False
    NATS_HEADER_PARSER.setdefault("original", Client._parse_header_lines)
    Client._parse_header_lines = staticmethod(parse_header_lines)  # type: ignore[method-assign]
    return True


def _b64(value: str | None) -> bytes:
    return base64.b64decode(value) if value else b""


def _headers(value: str | None) -> dict[str, str]:
    """Headers of a ``STREAM.MSG.GET`` answer (base64 of ``NATS/1.0\\r\\nKey: value\\r\\n…``)."""
    out: dict[str, str] = {}
    if not value:
        return out
    for line in base64.b64decode(value).decode(errors="replace").split("\r\n")[1:]:
        key, sep, val = line.partition(":")
        if sep:
            out[key.strip()] = val.strip()
    return out


async def read_to_end(
    nc: Any,
    stream: str,
    filter_subject: str,
    *,
    last_per_subject: bool = False,
    start_time: float | None = None,
    timeout_s: float = 30.0,
    what: str = "stream read",
) -> AsyncIterator[Any]:
    """The messages of ``stream`` on ``filter_subject`` up to the stream's end when the read starts, in stream
    order, through an ephemeral consumer with no acks: every message, the last one of each subject
    (``last_per_subject``), or those stored at or after Unix time ``start_time``. Raises TimeoutError naming
    ``what`` when the read does not complete within ``timeout_s``."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    if last_per_subject:
        policy, start = DeliverPolicy.LAST_PER_SUBJECT, None
    elif start_time is not None:
        policy = DeliverPolicy.BY_START_TIME
        start = datetime.datetime.fromtimestamp(max(0.0, start_time), datetime.UTC)
    else:
        policy, start = DeliverPolicy.ALL, None
    config = ConsumerConfig(
        deliver_policy=policy,
        opt_start_time=start,
        ack_policy=AckPolicy.NONE,
        filter_subject=filter_subject,
        inactive_threshold=30.0,
        num_replicas=1,
        mem_storage=True,
    )
    sub = await nc.jetstream().pull_subscribe(filter_subject, stream=stream, config=config)
    try:
        info = await sub.consumer_info()
        pending = int(info.num_pending or 0)
        deadline = time.monotonic() + timeout_s
        while pending > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not complete")
            try:
                msgs = await sub.fetch(min(pending, 1000), timeout=2.0)
            except TimeoutError:
                continue
            for m in msgs:
                pending = int(m.metadata.num_pending)
                yield m
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def read_last_per_subject(
    nc: Any, stream: str, filter_subject: str, *, timeout_s: float = 30.0
) -> list[Delivered]:
    """The last message of every subject matching ``filter_subject``, in stream order: what a router or an
    owner rebuilds from."""
    return [
        Delivered(m.metadata.sequence.stream, m.subject, dict(m.headers or {}), m.data, None)
        async for m in read_to_end(
            nc, stream, filter_subject, last_per_subject=True, timeout_s=timeout_s, what="rebuild read"
        )
    ]


__all__ = [
    "PIN_HEADER",
    "Delivered",
    "PinnedMember",
    "PubAcks",
    "ack_seq",
    "install_fast_header_parsing",
    "parse_header_lines",
    "publish_durably",
    "read_last_per_subject",
    "read_to_end",
]
