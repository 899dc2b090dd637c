"""``kcloak load``: open-loop load at a target message rate, latency without coordinated omission (contract §9).

Message ``i`` has the **intended** send time ``t0 + i / rate``, fixed before the run starts and
independent of how fast the broker answers. The sender sends every message whose intended time
has come (catching up in a burst if it fell behind) and never waits for an answer, so a slow or
stalled broker cannot slow the offered load down and hide its own slowness (Tene's "coordinated
omission"). Latency = answer time (MQTT answer message, or HTTP response) − intended send time;
over MQTT only queries have an answer from kcloak (a PUBACK comes from the MQTT broker), over
HTTP every message does. A share ``query_fraction`` of messages are queries, the rest single
fixes on the user's own topic or route; users move with a mobility model (waypoint by default)
and each is sent one fix before the run so that queries find it present (the ``setup`` phase,
before the timed run). The timed run stops at ``duration_s`` even when the sender fell behind (a
busy machine): messages still due then are counted as ``unsent``, not sent late; then the answers
still outstanding are awaited for at most ``drain_s``.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kcloak.simulators.bench import MODELS
from kcloak.simulators.client import ClientInputError, ClientStats, load_client_tokens, open_client, percentiles_ms
from kcloak.simulators.traffic import QUERY_KINDS, SimulationInputError, build_model, random_query, simulated_users
from kcloak.simulators.transport import BrokerUrl

SEND_SLICE = 256
"""Most messages sent between two yields to the event loop (answers keep being read)."""

DRAW_CHUNK = 65_536
"""Messages whose kind and user are drawn at once: memory stays flat whatever rate × duration is."""


END_GRACE_S = 0.25
"""The timed run ends this long after ``duration_s`` at the latest: a sender late by less still sends it all."""


class LoadInputError(SimulationInputError):
    """Bad ``kcloak load`` input (exit 2)."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One ``kcloak load`` run (contract §9 flags and defaults)."""

    rate: float = 1000.0
    duration_s: float = 30.0
    users: int = 10_000
    query_fraction: float = 0.1
    query_kind: str = "mix"
    model: str = "waypoint"
    broker: str = "mqtt://127.0.0.1:1883"
    tokens: Path | None = None
    seed: int | None = None
    query_connections: int = 256
    drain_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise LoadInputError("--rate: must be finite and > 0")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise LoadInputError("--duration: must be finite and > 0")
        if self.users < 1:
            raise LoadInputError("--users: must be >= 1")
        if not (0.0 <= self.query_fraction <= 1.0):
            raise LoadInputError("--query-fraction: must be within [0, 1]")
        if self.query_kind not in QUERY_KINDS:
            raise LoadInputError(f"--query-kind: must be one of {', '.join(QUERY_KINDS)}")
        if self.model not in MODELS:
            raise LoadInputError(f"--model: must be one of {', '.join(MODELS)}")
        if self.query_connections < 1:
            raise LoadInputError("--http-connections: must be >= 1")
        try:
            BrokerUrl.parse(self.broker)
        except ValueError as exc:
            raise LoadInputError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """``kcloak load --json`` (contract §9) plus the fix outcomes and per-kind latency."""

    target_rate: float
    achieved_rate: float
    duration_s: float
    sent_updates: int
    sent_queries: int
    answers_ok: int
    answers_refused: int
    errors: dict[str, int]
    latency_ms: dict[str, float | None]
    transport: str = "mqtt"
    updates_accepted: int | None = None
    query_latency_ms: dict[str, float | None] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    max_send_lag_ms: float = 0.0
    unsent: int = 0
    phases_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The contract keys, then the extensions ``transport``, ``updates_accepted``, ``query_latency_ms``,
        ``reasons`` (refusal codes of answers), ``max_send_lag_ms`` (worst sender lateness), ``unsent``
        (messages due before the end that the sender could not send in time) and ``phases_s`` (``setup``:
        placing the users and their first fixes; ``send``: the timed run, ``duration_s``; ``drain``:
        waiting for the last answers)."""
        return {
            "target_rate": self.target_rate,
            "achieved_rate": round(self.achieved_rate, 1),
            "duration_s": round(self.duration_s, 3),
            "sent_updates": self.sent_updates,
            "sent_queries": self.sent_queries,
            "answers_ok": self.answers_ok,
            "answers_refused": self.answers_refused,
            "errors": dict(sorted(self.errors.items())),
            "latency_ms": self.latency_ms,
            "transport": self.transport,
            "updates_accepted": self.updates_accepted,
            "query_latency_ms": self.query_latency_ms,
            "reasons": dict(sorted(self.reasons.items())),
            "max_send_lag_ms": round(self.max_send_lag_ms, 3),
            "unsent": self.unsent,
            "phases_s": {k: round(v, 3) for k, v in self.phases_s.items()},
        }


async def run_load(cfg: LoadConfig, *, on_progress: Callable[[int, int], None] | None = None) -> LoadSummary:
    """Offer ``rate`` messages/s for ``duration_s`` (see the module docstring).

    Raises :class:`LoadInputError` (exit 2) and :class:`~kcloak.simulators.transport.TransportError` (exit 1).
    """
    try:
        tokens = load_client_tokens(cfg.tokens) if cfg.tokens is not None else None
    except ClientInputError as exc:
        raise LoadInputError(str(exc)) from None
    t_setup = time.time()
    users = simulated_users(cfg.users, tokens, prefix="l")
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(32)
    model = await asyncio.to_thread(build_model, cfg.model, cfg.users, seed=seed)
    rng = np.random.default_rng(seed + 1)
    total = max(1, int(cfg.rate * cfg.duration_s))
    is_query: list[bool] = []
    query_user: list[int] = []
    drawn = 0  # message index of is_query[0]
    user_tokens = dict(tokens[: cfg.users]) if tokens is not None else None
    async with open_client(cfg.broker, tokens=user_tokens, query_connections=cfg.query_connections) as client:
        # Every user sends one fix first, so that queries find their querier present.
        lat, lon = model.positions()
        now = time.time()
        await client.send_fixes(list(zip(users, [now] * cfg.users, lat.tolist(), lon.tolist(), strict=True)))
        await client.drain(30.0)
        client.stats = ClientStats(accepted=0 if client.transport == "http" else None)
        lat_l, lon_l = lat.tolist(), lon.tolist()
        sent_updates = sent_queries = 0
        cursor = 0
        t0 = time.time()
        end = t0 + cfg.duration_s
        next_step = t0 + 1.0
        i = 0
        max_lag = 0.0
        while i < total:
            now = time.time()
            if now >= end + END_GRACE_S:  # on time: what the sender could not send by then is counted, not sent
                break
            if now >= next_step:
                model.step(now - next_step + 1.0)
                next_step = now + 1.0
                lat, lon = model.positions()
                lat_l, lon_l = lat.tolist(), lon.tolist()
            due = min(total, int((now - t0) * cfg.rate) + 1)
            stop = min(due, i + SEND_SLICE)
            while i < stop:
                if i - drawn >= len(is_query):
                    drawn = i
                    n = min(DRAW_CHUNK, total - i)
                    is_query = (rng.random(n) < cfg.query_fraction).tolist()
                    query_user = rng.integers(0, cfg.users, n).tolist()
                intended = t0 + i / cfg.rate
                max_lag = max(max_lag, time.time() - intended)
                if is_query[i - drawn]:
                    u = query_user[i - drawn]
                    query = random_query(rng, cfg.query_kind, client.next_query_id())
                    await client.send_query(users[u], query, intended=intended)
                    sent_queries += 1
                else:
                    u = cursor
                    cursor = (cursor + 1) % cfg.users
                    fix = (users[u], time.time(), lat_l[u], lon_l[u])
                    await client.send_fixes([fix], batch=False, intended=intended)
                    sent_updates += 1
                i += 1
            client.check_alive()
            if on_progress is not None:
                on_progress(i, total)
            if i < total:
                await asyncio.sleep(max(t0 + i / cfg.rate - time.time(), 0.0))
        send_s = max(time.time() - t0, total / cfg.rate)
        t_drain = time.time()
        await client.drain(cfg.drain_s)
        drain_s = time.time() - t_drain
        st = client.stats
        errors = Counter(st.errors)
        errors.update(st.refused)
        return LoadSummary(
            target_rate=cfg.rate,
            achieved_rate=(sent_updates + sent_queries) / send_s,
            duration_s=send_s,
            sent_updates=sent_updates,
            sent_queries=sent_queries,
            answers_ok=st.answers_ok,
            answers_refused=st.answers_refused,
            errors=dict(errors),
            latency_ms=percentiles_ms(st.latencies_s + st.fix_latencies_s),
            transport=client.transport,
            updates_accepted=st.accepted,
            query_latency_ms=percentiles_ms(st.latencies_s),
            reasons=dict(st.reasons),
            max_send_lag_ms=max_lag * 1000.0,
            unsent=total - i,
            phases_s={"setup": t0 - t_setup, "send": send_s, "drain": drain_s},
        )


__all__ = ["LoadConfig", "LoadInputError", "LoadSummary", "run_load"]
