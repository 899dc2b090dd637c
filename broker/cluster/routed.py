"""The routed query: a core-NATS request from a partition's router to a cell's owner (docs/cluster.md "Workers").

The router sends the routed query on ``kcloak.cellq.<c>`` (core NATS, queue group ``kcloak``: one live owner of
the cell takes it) with a reply subject of its own, and **holds the query's intake message** (no ack) until the
owner replies ``stored``: the query's one answer is in ``KCLOAK_ANSWERS``. Nothing of the query is stored
between the intake and the answer. Replies, JSON ``{"s": …}``:

- ``working`` — sent by the owner every :data:`HEARTBEAT_S` while it cloaks, forwards and stores;
- ``stored`` — the answer is stored (by this attempt or an earlier one): the router acknowledges the intake message;
- ``not_owner`` — the receiver holds no live index of the cell (its lease ended): the router sends again.

No subscribed owner (NATS answers the request ``503``, no responders), no reply for :data:`SILENCE_S` (owner dead,
a message lost) and ``not_owner`` make the router send the same query again (after a pause growing from
:data:`RESEND_PAUSE_S` to 1 s), marked ``"again": true`` so the owner looks for a stored answer first; another
owner may take the cell meanwhile. A second computation is safe: the answer's message id (``<token>/<qkey>``)
keeps the first answer, and the region record is create-only (a retry forwards the recorded region). If the
router dies, its intake message is redelivered to its successor (after its catch-up), which routes it the
same way. While it waits, the router sends in-progress acks (``+WPI``) so the intake message is not redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kcloak.broker.cluster.codec import encode_any
from kcloak.broker.cluster.topology import cellq_subject

HEARTBEAT_S = 1.0
"""How often an owner says ``working`` on a query it has not stored yet."""
SILENCE_S = 3.0
"""How long a router waits for any reply before it sends the routed query again."""
RESEND_PAUSE_S = 0.25
"""The first pause before a query is sent again after ``not_owner`` or no responders (then doubled, up to 1 s)."""
NO_RESPONDERS = b"503"
GIVE_UP_S = 30.0
"""After this long without a stored answer (a cell whose owner never comes back) the router stores a refusal."""
PROGRESS_S = 10.0
"""How often a held intake message gets an in-progress ack (well inside the consumer's ``ack_wait``)."""
QUEUE_GROUP = "kcloak"

STORED = b'{"s":"stored"}'
WORKING = b'{"s":"working"}'
NOT_OWNER = b'{"s":"not_owner"}'


@dataclass(slots=True)
class Held:
    """One query's intake message held until its answer is stored: its ack subject (None while only the catch-up
    copy is known: the server's redelivery brings it) and whether the answer is stored."""

    reply: str | None
    stored: bool = False
    task: asyncio.Task[None] | None = None
    progress_at: float = 0.0


@dataclass(slots=True)
class _Waiting:
    heard: asyncio.Event = field(default_factory=asyncio.Event)
    last: bytes = b""


class QueryDispatch:
    """A router's side: route queries to cell owners and hold their intake messages (module docstring).

    ``keep_trying()`` is False once the router lost its pin (its successor routes the query again). Per query,
    ``owner_check()`` runs before each resend (it makes sure the cell has a live owner: a router republishes the
    querier's fix event to pin one) and ``give_up()`` after :data:`GIVE_UP_S` of resends without a stored answer
    (the router stores a refusal as the query's one answer: the first stored answer stays the only one).
    """

    def __init__(
        self,
        nc: Any,
        *,
        keep_trying: Callable[[], bool],
        silence_s: float = SILENCE_S,
        give_up_s: float = GIVE_UP_S,
    ) -> None:
        self.nc = nc
        self.keep_trying = keep_trying
        self.silence_s = silence_s
        self.give_up_s = give_up_s
        self.held: dict[int, Held] = {}
        self.counters = {"routed": 0, "resent": 0}
        self._prefix = ""
        self._sub: Any = None
        self._next = 0
        self._waiting: dict[str, _Waiting] = {}

    async def _ensure(self) -> None:
        if self._sub is None:
            self._prefix = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(self._prefix + ".*", cb=self._on_reply)

    async def _on_reply(self, msg: Any) -> None:
        waiting = self._waiting.get(msg.subject[len(self._prefix) + 1 :])
        if waiting is not None:
            status = (msg.headers or {}).get("Status")
            waiting.last = NO_RESPONDERS if status == "503" else bytes(msg.data)
            waiting.heard.set()

    def hold(
        self,
        seq: int,
        ack_reply: str | None,
        cell: int,
        routed: dict[str, Any],
        *,
        owner_check: Callable[[], Awaitable[None]],
        give_up: Callable[[], Awaitable[None]],
    ) -> None:
        """Route ``routed`` to cell ``cell`` in the background, holding intake message ``seq`` until stored."""
        held = self.held.get(seq)
        if held is not None:  # redelivered while in flight: the task acknowledges the newest delivery
            held.reply = ack_reply or held.reply
            return
        held = self.held[seq] = Held(ack_reply)
        held.task = asyncio.create_task(self._route(seq, held, cell, routed, owner_check, give_up))

    def redelivered(self, seq: int, ack_reply: str | None) -> bool:
        """A redelivery of intake message ``seq`` (a catch-up copy was handed over before): True when it is held
        here (acknowledged once the answer is stored), False when the caller should acknowledge it now."""
        held = self.held.get(seq)
        if held is None or held.stored:
            self.held.pop(seq, None)
            return False
        held.reply = ack_reply or held.reply
        return True

    async def _route(
        self,
        seq: int,
        held: Held,
        cell: int,
        routed: dict[str, Any],
        owner_check: Callable[[], Awaitable[None]],
        give_up: Callable[[], Awaitable[None]],
    ) -> None:
        await self._ensure()
        self.counters["routed"] += 1
        started = time.monotonic()
        pause = RESEND_PAUSE_S
        held.progress_at = started + PROGRESS_S
        try:
            while self.keep_trying():
                if routed.get("again") and time.monotonic() - started > self.give_up_s:
                    self.counters["given_up"] = self.counters.get("given_up", 0) + 1
                    try:
                        await give_up()
                    except Exception:  # the answers stream unreachable: keep holding, try again
                        await asyncio.sleep(pause)
                        continue
                    await self._stored(seq, held)
                    return
                last = await self._send(cell, routed, held)
                if last == STORED:
                    await self._stored(seq, held)
                    return
                if last:  # no owner subscribed, or not a live one: give the cell time
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 1.0)
                if not self.keep_trying():
                    return
                routed["again"] = True
                self.counters["resent"] += 1
                await owner_check()
        finally:
            if not held.stored:
                self.held.pop(seq, None)  # lease lost: the successor routes it again

    async def _send(self, cell: int, routed: dict[str, Any], held: Held) -> bytes:
        """Send the routed query once and wait while the owner says ``working``: its final reply (``b""`` after
        :attr:`silence_s` without any). Sends the held intake message's in-progress acks meanwhile."""
        self._next += 1
        token = str(self._next)
        waiting = self._waiting[token] = _Waiting()
        try:
            with contextlib.suppress(Exception):  # reconnecting: silence, then again
                await self.nc.publish(cellq_subject(cell), encode_any(routed), reply=f"{self._prefix}.{token}")
            while self.keep_trying():
                if waiting.last not in (b"", WORKING):
                    return waiting.last  # a final reply (it may have come while we sent a progress ack)
                waiting.heard.clear()
                try:
                    async with asyncio.timeout(self.silence_s):
                        await waiting.heard.wait()
                except TimeoutError:
                    return b""
                finally:
                    await self._progress(held)
            return b""
        finally:
            self._waiting.pop(token, None)

    async def _progress(self, held: Held) -> None:
        """An in-progress ack for the held intake message every :data:`PROGRESS_S` (not redelivered meanwhile)."""
        if time.monotonic() >= held.progress_at and held.reply is not None:
            held.progress_at = time.monotonic() + PROGRESS_S
            with contextlib.suppress(Exception):
                await self.nc.publish(held.reply, b"+WPI")

    async def _stored(self, seq: int, held: Held) -> None:
        """The answer is stored: acknowledge the intake message (or, for a catch-up copy, its redelivery)."""
        held.stored = True
        if held.reply is not None:
            self.held.pop(seq, None)
            await self.nc.publish(held.reply, b"+ACK")

    async def drop(self) -> None:
        """Lease lost: stop every held query (not acknowledged: the successor routes it again)."""
        tasks = [h.task for h in self.held.values() if h.task is not None]
        self.held = {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class Heartbeat:
    """An owner's side: say ``working`` to ``reply`` every :data:`HEARTBEAT_S` until the block ends.

    A timer of the event loop, not a task: most queries end well within :data:`HEARTBEAT_S`, and then the block
    cost one timer set and cancelled (a task per query cost its creation, a sleep and a cancellation)."""

    def __init__(self, nc: Any, reply: str | None) -> None:
        self.nc = nc
        self.reply = reply
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def _beat(self) -> None:
        task = asyncio.ensure_future(self._say())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        self._timer = asyncio.get_running_loop().call_later(HEARTBEAT_S, self._beat)

    async def _say(self) -> None:
        assert self.reply is not None
        with contextlib.suppress(Exception):
            await self.nc.publish(self.reply, WORKING)

    async def __aenter__(self) -> Heartbeat:
        if self.reply:
            self._timer = asyncio.get_running_loop().call_later(HEARTBEAT_S, self._beat)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


__all__ = [
    "GIVE_UP_S",
    "HEARTBEAT_S",
    "NOT_OWNER",
    "QUEUE_GROUP",
    "SILENCE_S",
    "STORED",
    "WORKING",
    "Heartbeat",
    "Held",
    "QueryDispatch",
]
