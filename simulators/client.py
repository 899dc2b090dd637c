"""A kcloak client for many users at once, over MQTT (§3) or HTTP (§4): what simulate, replay and load share.

:func:`open_client` connects the right door for a ``--broker`` URL. Open mode (no tokens): one
gateway connection carries every user's fixes, in batches when allowed (``kcloak/v1/updates/…``
or ``POST /v1/locations``, items naming their user), and reads every answer. With tokens, each
user acts for itself only: one MQTT connection per user (username = user id, password = token,
subscribed to its own answer and status topics), or its bearer token on every HTTP request, and
fixes go one per message on the user's own topic or route.

Every query is tracked by ``query_id`` from its **intended** send time to its answer, so latency
includes any time the query waited inside the client (no coordinated omission). Counters live in
:class:`ClientStats`; fixes are counted as sent when written to the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcloak.core.errors import InputError
from kcloak.simulators.errors import SimulatorError
from kcloak.simulators.transport import BrokerUrl, HttpClient, HttpResponse, MqttClient, MqttMessage, TransportError
from kcloak.wire.tokens import TokensFileError, read_tokens_file

ROOT = "kcloak/v1/"
GATEWAY_USER = "kcloak-gateway"
"""Topic user of open-mode batch messages whose items all name their own user (contract §3)."""

MAX_BATCH_ITEMS = 5000
"""Fixes per batch message: half the contract's 10,000, so a batch stays far below 1 MiB."""

AnswerHook = Callable[[dict[str, Any], float], None]
"""Called with each answer (contract JSON) and its latency from the intended send time, in seconds."""


class ClientInputError(SimulatorError, InputError, ValueError):
    """Unusable client input such as a tokens file without plaintext tokens (exit 2)."""


def load_client_tokens(path: str | Path) -> list[tuple[str, str]]:
    """``(user, token)`` pairs in file order: each user's first plaintext token (contract §9 tokens file).

    Hashed (``sha256:``) lines cannot be used by a client and are skipped; a file with no
    plaintext token, or a malformed one, raises :class:`ClientInputError`.
    """
    try:
        lines = read_tokens_file(path)
    except TokensFileError as exc:
        raise ClientInputError(str(exc)) from None
    seen: dict[str, str] = {}
    for line in lines:
        if line.plaintext is not None and line.user not in seen:
            seen[line.user] = line.plaintext
    if not seen:
        raise ClientInputError("tokens file: no plaintext user:token line a client could use")
    return list(seen.items())


@dataclass(slots=True)
class ClientStats:
    """What one client sent and got back (mutable tallies; snapshot them at the end)."""

    sent: int = 0
    accepted: int | None = None
    refused: Counter[str] = field(default_factory=Counter)
    queries: int = 0
    answers_ok: int = 0
    answers_refused: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    fix_latencies_s: list[float] = field(default_factory=list)
    profiles_ok: int = 0
    profiles_refused: Counter[str] = field(default_factory=Counter)


def _error_code(resp: HttpResponse) -> str:
    try:
        obj = json.loads(resp.body)
        code = obj["error"]["code"]
        if isinstance(code, str) and code.isidentifier():
            return code
    except (ValueError, KeyError, TypeError):
        pass
    return f"http_{resp.status}"


def _fix_json(t: float, lat: float, lon: float) -> str:
    return f'{{"t":{t:.6f},"lat":{lat:.6f},"lon":{lon:.6f}}}'


def batch_payloads(items: Sequence[tuple[str, float, float, float]]) -> list[tuple[int, bytes]]:
    """``{"updates": [...]}`` bodies of at most :data:`MAX_BATCH_ITEMS` fixes, each item naming its user."""
    out: list[tuple[int, bytes]] = []
    for start in range(0, len(items), MAX_BATCH_ITEMS):
        chunk = items[start : start + MAX_BATCH_ITEMS]
        body = ",".join(f'{{"user":"{u}","t":{t:.6f},"lat":{la:.6f},"lon":{lo:.6f}}}' for u, t, la, lo in chunk)
        out.append((len(chunk), f'{{"updates":[{body}]}}'.encode()))
    return out


class KcloakClient:
    """The door-independent part: pending queries keyed by ``query_id``, answer accounting, stats."""

    transport: str = ""

    def __init__(self, *, tokens: dict[str, str] | None, on_answer: AnswerHook | None) -> None:
        self.tokens = tokens
        self.on_answer = on_answer
        self.stats = ClientStats()
        self._pending: dict[str, float] = {}
        self._drained = asyncio.Event()
        self._drained.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = 0
        self._run = secrets.token_hex(4)

    def next_query_id(self) -> str:
        self._seq += 1
        return f"{self._run}-q{self._seq}"

    # -- to implement per door -----------------------------------------------------------------
    async def set_profiles(self, profiles: Sequence[tuple[str, dict[str, Any]]], *, timeout_s: float) -> None:
        raise NotImplementedError

    async def send_fixes(
        self, items: Sequence[tuple[str, float, float, float]], *, batch: bool = True, intended: float | None = None
    ) -> None:
        """Send fixes ``(user, t, lat, lon)``; batched in open mode when ``batch``, else one per message."""
        raise NotImplementedError

    async def send_query(self, user: str, query: dict[str, Any], *, intended: float) -> None:
        """Send one query (its ``query_id`` set); the answer is counted when it arrives."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------
    def _track(self, qid: str, intended: float) -> None:
        self._pending[qid] = intended
        self._drained.clear()
        self.stats.queries += 1

    def _answered(self, answer: dict[str, Any], now: float) -> None:
        qid = answer.get("query_id")
        intended = self._pending.pop(qid, None) if isinstance(qid, str) else None
        if intended is None:
            return  # not ours, or already counted
        if not self._pending:
            self._drained.set()
        latency = max(now - intended, 0.0)
        if answer.get("status") == "ok":
            self.stats.answers_ok += 1
        else:
            self.stats.answers_refused += 1
            self.stats.reasons[str(answer.get("reason", "unknown"))] += 1
        self.stats.latencies_s.append(latency)
        if self.on_answer is not None:
            self.on_answer(answer, latency)

    def _query_failed(self, qid: str, code: str) -> None:
        if self._pending.pop(qid, None) is not None:
            self.stats.errors[code] += 1
            if not self._pending:
                self._drained.set()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for outstanding work and answers; returns the queries left unanswered."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
                await self._flush_transport()
                await self._drained.wait()
        left = len(self._pending)
        if left:
            self.stats.errors["unanswered"] += left
            self._pending.clear()
            self._drained.set()
        return left

    async def _flush_transport(self) -> None:
        return None


# -- MQTT --------------------------------------------------------------------------------------
class MqttKcloakClient(KcloakClient):
    """Open mode: one gateway connection; tokens: one connection per user (contract §3 ACL)."""

    transport = "mqtt"

    def __init__(
        self, url: BrokerUrl, *, tokens: dict[str, str] | None, on_answer: AnswerHook | None, qos: int = 1
    ) -> None:
        super().__init__(tokens=tokens, on_answer=on_answer)
        self.url = url
        self.qos = qos
        self._gateway: MqttClient | None = None
        self._per_user: dict[str, MqttClient] = {}
        self._profile_waits: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> MqttKcloakClient:
        await self._stack.__aenter__()
        try:
            if self.tokens is None:
                self._gateway = await self._stack.enter_async_context(
                    MqttClient(host=self.url.host, port=self.url.port, on_messages=self._on_messages)
                )
                await self._gateway.subscribe([ROOT + "answer/+", ROOT + "status/+"])
            else:
                gate = asyncio.Semaphore(32)

                async def connect(user: str, token: str) -> tuple[str, MqttClient]:
                    async with gate:
                        c = MqttClient(
                            host=self.url.host,
                            port=self.url.port,
                            username=user,
                            password=token,
                            on_messages=self._on_messages,
                            window=64,
                        )
                        await self._stack.enter_async_context(c)
                        await c.subscribe([f"{ROOT}answer/{user}", f"{ROOT}status/{user}"])
                        return user, c

                pairs = await asyncio.gather(*(connect(u, t) for u, t in self.tokens.items()))
                self._per_user = dict(pairs)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._stack.aclose()

    def _conn(self, user: str) -> MqttClient:
        if self._gateway is not None:
            return self._gateway
        conn = self._per_user.get(user)
        if conn is None:
            raise ClientInputError("user: not in the tokens file")
        return conn

    def _on_messages(self, batch: list[MqttMessage]) -> None:
        now = time.time()
        for m in batch:
            kind = m.topic[len(ROOT) :].split("/", 1)[0]
            try:
                obj = json.loads(m.payload)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if kind == "answer":
                self._answered(obj, now)
            elif kind == "status" and obj.get("kind") == "profile":
                rid = obj.get("request_id")
                fut = self._profile_waits.pop(rid, None) if isinstance(rid, str) else None
                if fut is not None and not fut.done():
                    fut.set_result(obj)

    async def set_profiles(self, profiles: Sequence[tuple[str, dict[str, Any]]], *, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[dict[str, Any]]] = []
        for i, (user, profile) in enumerate(profiles):
            rid = f"{self._run}-p{i}"
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            self._profile_waits[rid] = fut
            futures.append(fut)
            body = json.dumps({"request_id": rid, "profile": profile}).encode()
            await self._conn(user).send(f"{ROOT}profile/{user}", body, qos=1)
        done, _ = await asyncio.wait(futures, timeout=timeout_s) if futures else (set(), set())
        for fut in futures:
            if fut in done and fut.exception() is None:
                status = fut.result()
                if status.get("status") == "ok":
                    self.stats.profiles_ok += 1
                else:
                    self.stats.profiles_refused[str(status.get("reason", "unknown"))] += 1
            else:
                fut.cancel()
                self.stats.profiles_refused["unanswered"] += 1
        self._profile_waits.clear()

    async def send_fixes(
        self, items: Sequence[tuple[str, float, float, float]], *, batch: bool = True, intended: float | None = None
    ) -> None:
        if self._gateway is not None and batch:
            for n, body in batch_payloads(items):
                await self._gateway.send(f"{ROOT}updates/{GATEWAY_USER}", body, qos=1)
                self.stats.sent += n
            return
        for user, t, lat, lon in items:
            await self._conn(user).send(f"{ROOT}update/{user}", _fix_json(t, lat, lon).encode(), qos=self.qos)
            self.stats.sent += 1

    async def send_query(self, user: str, query: dict[str, Any], *, intended: float) -> None:
        qid = query["query_id"]
        self._track(qid, intended)
        await self._conn(user).send(f"{ROOT}query/{user}", json.dumps(query).encode(), qos=1)

    async def _flush_transport(self) -> None:
        conns = [self._gateway] if self._gateway is not None else list(self._per_user.values())
        await asyncio.gather(*(c.flush() for c in conns if c is not None))

    def check_alive(self) -> None:
        """Raise :class:`TransportError` if a connection was lost."""
        conns = [self._gateway] if self._gateway is not None else list(self._per_user.values())
        for c in conns:
            if c is not None and c.closed.done():
                raise TransportError("MQTT connection lost")


# -- HTTP --------------------------------------------------------------------------------------
class HttpKcloakClient(KcloakClient):
    """Fixes and profiles through one connection pool, queries (which block until answered) through another."""

    transport = "http"

    def __init__(
        self,
        url: BrokerUrl,
        *,
        tokens: dict[str, str] | None,
        on_answer: AnswerHook | None,
        fix_connections: int = 16,
        query_connections: int = 256,
    ) -> None:
        super().__init__(tokens=tokens, on_answer=on_answer)
        self.url = url
        self.stats.accepted = 0
        self._fixes = HttpClient(host=url.host, port=url.port, connections=fix_connections)
        self._queries = HttpClient(host=url.host, port=url.port, connections=query_connections)
        self._fix_slots = asyncio.Semaphore(fix_connections * 4)
        # A user's fixes must reach the broker in order (contract §1: an older fix is out_of_order),
        # so each user is pinned to one of ``fix_connections`` lanes whose requests go one after the
        # other; the lanes run concurrently.
        self._lane_tail: list[asyncio.Task[None] | None] = [None] * fix_connections

    async def __aenter__(self) -> HttpKcloakClient:
        resp = await self._fixes.request("GET", "/healthz")
        if resp.status not in (200, 503):
            raise TransportError(f"not a kcloak broker (GET /healthz answered {resp.status})")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._fixes.__aexit__(None, None, None)
        await self._queries.__aexit__(None, None, None)

    def _token(self, user: str) -> str | None:
        if self.tokens is None:
            return None
        token = self.tokens.get(user)
        if token is None:
            raise ClientInputError("user: not in the tokens file")
        return token

    async def set_profiles(self, profiles: Sequence[tuple[str, dict[str, Any]]], *, timeout_s: float) -> None:
        gate = asyncio.Semaphore(32)

        async def one(user: str, profile: dict[str, Any]) -> None:
            async with gate:
                try:
                    resp = await self._fixes.request(
                        "PUT", f"/v1/users/{user}/profile", json.dumps(profile).encode(), token=self._token(user)
                    )
                except TransportError:
                    self.stats.profiles_refused["connection_error"] += 1
                    return
            if resp.status == 200:
                self.stats.profiles_ok += 1
            else:
                self.stats.profiles_refused[_error_code(resp)] += 1

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(one(u, p) for u, p in profiles))

    def _count_fix_response(self, resp: HttpResponse, n: int) -> None:
        assert self.stats.accepted is not None
        if resp.status == 200:
            try:
                obj = json.loads(resp.body)
                self.stats.accepted += int(obj["accepted"])
                for item in obj["rejected"]:
                    self.stats.refused[str(item["code"])] += 1
                return
            except (ValueError, KeyError, TypeError):
                self.stats.errors["malformed_response"] += n
                return
        self.stats.refused[_error_code(resp)] += n

    async def _post_fixes(self, path: str, body: bytes, n: int, token: str | None, intended: float | None) -> None:
        try:
            try:
                resp = await self._fixes.request("POST", path, body, token=token)
            except TransportError:
                self.stats.errors["connection_error"] += n
                return
            if intended is not None:
                self.stats.fix_latencies_s.append(max(time.time() - intended, 0.0))
            self._count_fix_response(resp, n)
        finally:
            self._fix_slots.release()

    def _lane(self, user: str) -> int:
        return zlib.crc32(user.encode()) % len(self._lane_tail)

    def _spawn_in_lane(self, lane: int, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``start()`` once the lane's previous request has finished (requests of a lane keep order)."""
        previous = self._lane_tail[lane]

        async def after_previous() -> None:
            if previous is not None and not previous.done():
                await asyncio.wait({previous})
            await start()

        task: asyncio.Task[None] = asyncio.create_task(after_previous())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._lane_tail[lane] = task

    async def send_fixes(
        self, items: Sequence[tuple[str, float, float, float]], *, batch: bool = True, intended: float | None = None
    ) -> None:
        if self.tokens is None and batch:
            by_lane: dict[int, list[tuple[str, float, float, float]]] = {}
            for item in items:
                by_lane.setdefault(self._lane(item[0]), []).append(item)
            for lane, lane_items in by_lane.items():
                for n, body in batch_payloads(lane_items):
                    await self._fix_slots.acquire()
                    self.stats.sent += n
                    self._spawn_in_lane(
                        lane, functools.partial(self._post_fixes, "/v1/locations", body, n, None, intended)
                    )
            return
        for user, t, lat, lon in items:
            token = self._token(user)
            await self._fix_slots.acquire()
            self.stats.sent += 1
            body = _fix_json(t, lat, lon).encode()
            post = functools.partial(self._post_fixes, f"/v1/users/{user}/location", body, 1, token, intended)
            self._spawn_in_lane(self._lane(user), post)

    async def _query(self, user: str, qid: str, body: bytes, token: str | None) -> None:
        try:
            resp = await self._queries.request("POST", f"/v1/users/{user}/query", body, token=token)
        except TransportError:
            self._query_failed(qid, "connection_error")
            return
        if resp.status == 200:
            try:
                answer = json.loads(resp.body)
            except ValueError:
                self._query_failed(qid, "malformed_response")
                return
            if isinstance(answer, dict):
                self._answered(answer, time.time())
                return
        self._query_failed(qid, _error_code(resp))

    async def send_query(self, user: str, query: dict[str, Any], *, intended: float) -> None:
        qid = query["query_id"]
        token = self._token(user)
        self._track(qid, intended)
        self._spawn(self._query(user, qid, json.dumps(query).encode(), token))

    def check_alive(self) -> None:
        return None


@contextlib.asynccontextmanager
async def open_client(
    broker: str | BrokerUrl,
    *,
    tokens: dict[str, str] | None = None,
    on_answer: AnswerHook | None = None,
    query_connections: int = 256,
) -> AsyncIterator[MqttKcloakClient | HttpKcloakClient]:
    """Connect to ``broker`` (``mqtt://`` or ``http://``); raises :class:`TransportError` when unreachable.

    ``query_connections`` bounds the HTTP connections used for queries (each blocks until answered).
    """
    url = broker if isinstance(broker, BrokerUrl) else BrokerUrl.parse(broker)
    client: MqttKcloakClient | HttpKcloakClient
    if url.scheme == "mqtt":
        client = MqttKcloakClient(url, tokens=tokens, on_answer=on_answer)
    else:
        client = HttpKcloakClient(url, tokens=tokens, on_answer=on_answer, query_connections=query_connections)
    async with client:
        yield client


def percentiles_ms(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """``{"p50", "p90", "p99", "max"}`` in milliseconds (nearest rank), ``None`` when empty."""
    if not latencies_s:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    xs = sorted(latencies_s)
    n = len(xs)

    def rank(q: float) -> float:
        return round(xs[min(n - 1, max(0, int(q * n + 0.999999) - 1))] * 1000.0, 3)

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": round(xs[-1] * 1000.0, 3)}
