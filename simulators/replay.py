"""``kcloak replay``: send recorded trajectories to the broker as live traffic (contract §9; issue 5).

Input is read with the project's one reader set (:mod:`kcloak.core.readers`: contract CSV, GeoLife
``.plt`` files or folders, GPX, AIS), which skips and counts bad rows, never fatally. Each source
trajectory becomes one user: ``{prefix}000001``… in order of first appearance, or the tokens
file's users in order. Times are shifted to now: the earliest fix is sent at start + 1 s, every
other at ``(t − t_min) / speed`` later, and each fix is stamped with that send time, so every
user's fixes keep their order and stay strictly increasing. Optional linear resampling every
``interpolate_s`` seconds of source time; optional Poisson queries by users whose trajectory is
under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.core.readers import FORMATS, FixTable, ReaderError, read_fixes
from kcloak.simulators.client import ClientInputError, load_client_tokens, open_client, percentiles_ms
from kcloak.simulators.traffic import QUERY_KINDS, SimulationInputError, random_query
from kcloak.simulators.transport import BrokerUrl
from kcloak.wire.payloads import valid_user_id

TICK_S = 0.02
"""Fixes due within one tick are sent together (one batch message in open mode)."""

START_DELAY_S = 1.0
"""The earliest fix is sent this long after the start (contract §9)."""

SAMPLE = "ais_nyharbor.csv.gz"
"""The bundled replay sample (``kcloak replay --sample``): one hour of 295 vessels in New York harbour
(AIS, public domain / BSD; see ``simulators/data/ATTRIBUTION.md``)."""


def sample_path() -> Path:
    """Where the bundled replay sample is installed."""
    from importlib import resources

    return Path(str(resources.files("kcloak.simulators.data").joinpath(SAMPLE)))


class ReplayInputError(SimulationInputError):
    """Unreadable input, bad flag values, or more sources than tokens (exit 2)."""


USER_ID_RULE = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""Contract §1 user ids (the ``--user-prefix`` ids must be valid ones)."""


def source_user(prefix: str, i: int) -> str:
    """The open-mode user id of the ``i``-th source (0-based): ``{prefix}000001``…"""
    return f"{prefix}{i + 1:06d}"


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One ``kcloak replay`` run (contract §9 flags and defaults)."""

    input: Path
    format: str | None = None
    speed: float = 1.0
    interpolate_s: float | None = None
    queries_per_min: float = 0.0
    user_prefix: str = "r"
    limit: int | None = None
    broker: str = "mqtt://127.0.0.1:1883"
    tokens: Path | None = None
    query_kind: str = "mix"
    seed: int | None = None
    max_duration_s: float | None = None
    """Send only the fixes due within this many seconds of the start (the rest of the input is dropped)."""

    def __post_init__(self) -> None:
        if self.max_duration_s is not None and not (math.isfinite(self.max_duration_s) and self.max_duration_s > 0):
            raise ReplayInputError("--max-duration: must be finite and > 0")
        if self.format is not None and self.format not in FORMATS:
            raise ReplayInputError(f"--format: must be one of {', '.join(FORMATS)}")
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ReplayInputError("--speed: must be finite and > 0")
        if self.interpolate_s is not None and not (math.isfinite(self.interpolate_s) and self.interpolate_s > 0):
            raise ReplayInputError("--interpolate: must be finite and > 0")
        if not (math.isfinite(self.queries_per_min) and self.queries_per_min >= 0):
            raise ReplayInputError("--queries-per-min: must be finite and >= 0")
        if self.limit is not None and self.limit < 1:
            raise ReplayInputError("--limit: must be >= 1")
        if not valid_user_id(source_user(self.user_prefix, 0)):
            raise ReplayInputError(f"--user-prefix: user ids like P000001 must match {USER_ID_RULE}")
        if self.query_kind not in QUERY_KINDS:
            raise ReplayInputError(f"--query-kind: must be one of {', '.join(QUERY_KINDS)}")
        try:
            BrokerUrl.parse(self.broker)
        except ValueError as exc:
            raise ReplayInputError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """``kcloak replay --json`` (contract §9) plus query counts."""

    users: int
    sent: int
    accepted: int | None
    refused: dict[str, int]
    bad_rows: int
    duration_s: float
    queries: int = 0
    answers_ok: int = 0
    answers_refused: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    latency_ms: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The contract keys, then the extensions ``queries``, ``answers``, ``errors``, ``latency_ms``."""
        return {
            "users": self.users,
            "sent": self.sent,
            "accepted": self.accepted,
            "refused": dict(sorted(self.refused.items())),
            "bad_rows": self.bad_rows,
            "duration_s": round(self.duration_s, 3),
            "queries": self.queries,
            "answers": {
                "ok": self.answers_ok,
                "refused": self.answers_refused,
                "reasons": dict(sorted(self.reasons.items())),
            },
            "errors": dict(sorted(self.errors.items())),
            "latency_ms": self.latency_ms,
        }


@dataclass(frozen=True, slots=True, eq=False)
class ReplayPlan:
    """Fixes in send order: user index, offset from the start (s), position; plus the user ids."""

    users: list[str]
    user: npt.NDArray[np.int64]
    offset_s: npt.NDArray[np.float64]
    lat: npt.NDArray[np.float64]
    lon: npt.NDArray[np.float64]
    bad_rows: int
    source_span_s: float = 0.0
    """Recorded time from the input's first to its last usable fix."""
    dropped: int = 0
    """Fixes of the input left out by ``limit`` or ``max_duration_s``."""

    def __len__(self) -> int:
        return len(self.offset_s)

    @property
    def eta_s(self) -> float:
        """Seconds from the start until the last fix is due (the replay's length, without the final drain)."""
        return float(self.offset_s[-1]) if len(self.offset_s) else 0.0


def resample(
    t: npt.NDArray[np.float64], values: list[npt.NDArray[np.float64]], every_s: float
) -> tuple[npt.NDArray[np.float64], list[npt.NDArray[np.float64]]]:
    """Linear resampling of one trajectory at ``t[0], t[0] + every_s, …`` up to its last fix (kept)."""
    if len(t) < 2:
        return t, values
    grid = np.arange(t[0], t[-1], every_s)
    if grid[-1] < t[-1]:
        grid = np.append(grid, t[-1])
    return grid, [np.interp(grid, t, v) for v in values]


def plan_replay(table: FixTable, cfg: ReplayConfig, tokens: list[tuple[str, str]] | None) -> ReplayPlan:
    """Map sources to users, resample if asked, shift times (contract §9) and order fixes by send time.

    With ``limit`` only the sources among the ``limit`` earliest fixes become users (numbered in
    order of first appearance in the input), so ``users`` and the tokens needed count only them.
    """
    if len(table) == 0:
        raise ReplayInputError(f"input: no usable fixes ({table.bad_rows} bad rows)")
    ids, first = np.unique(table.traj_id, return_index=True)
    order_of_first = np.argsort(first, kind="stable")
    rank = np.empty(len(ids), dtype=np.int64)
    rank[order_of_first] = np.arange(len(ids))
    src = rank[np.searchsorted(ids, table.traj_id)]
    t, lat, lon = table.t, table.lat, table.lon
    if cfg.interpolate_s is not None:
        parts_u, parts_t, parts_lat, parts_lon = [], [], [], []
        order = np.lexsort((t, src))
        src_s, t_s, lat_s, lon_s = src[order], t[order], lat[order], lon[order]
        bounds = np.flatnonzero(np.diff(src_s)) + 1
        for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(src_s)], strict=True):
            g, (la, lo) = resample(t_s[a:b], [lat_s[a:b], lon_s[a:b]], cfg.interpolate_s)
            parts_u.append(np.full(len(g), src_s[a]))
            parts_t.append(g)
            parts_lat.append(la)
            parts_lon.append(lo)
        src, t, lat, lon = (np.concatenate(x) for x in (parts_u, parts_t, parts_lat, parts_lon))
    order = np.lexsort((src, t))
    offset = START_DELAY_S + (t[order] - t.min()) / cfg.speed
    plan_src, plan_lat, plan_lon = src[order].astype(np.int64), lat[order], lon[order]
    total = len(offset)
    keep = len(offset) if cfg.limit is None else min(cfg.limit, len(offset))
    if cfg.max_duration_s is not None:
        keep = min(keep, int(np.searchsorted(offset, cfg.max_duration_s, side="right")))
        if keep == 0:
            raise ReplayInputError(f"--max-duration: no fix is due within {cfg.max_duration_s:g} s")
    offset, plan_src, plan_lat, plan_lon = offset[:keep], plan_src[:keep], plan_lat[:keep], plan_lon[:keep]
    # Sources that send at least one fix, renumbered 0.. in order of first appearance.
    present, plan_user = np.unique(plan_src, return_inverse=True)
    n_users = len(present)
    if tokens is not None:
        if n_users > len(tokens):
            raise ReplayInputError(
                f"--tokens: the input has {n_users} sources but the tokens file only {len(tokens)} usable users"
            )
        users = [u for u, _ in tokens[:n_users]]
    else:
        users = [source_user(cfg.user_prefix, i) for i in range(n_users)]
        if not valid_user_id(users[-1]):
            raise ReplayInputError(f"--user-prefix: user ids like P000001 must match {USER_ID_RULE}")
    span = float(t.max() - t.min())
    return ReplayPlan(
        users, plan_user.astype(np.int64), offset, plan_lat, plan_lon, table.bad_rows, span, total - len(offset)
    )


def load_plan(cfg: ReplayConfig) -> tuple[ReplayPlan, list[tuple[str, str]] | None]:
    """Read the input and tokens; any unusable input raises :class:`ReplayInputError`."""
    try:
        tokens = load_client_tokens(cfg.tokens) if cfg.tokens is not None else None
    except ClientInputError as exc:
        raise ReplayInputError(str(exc)) from None
    try:
        table = read_fixes(cfg.input, cfg.format)
    except ReaderError as exc:
        raise ReplayInputError(str(exc)) from None
    return plan_replay(table, cfg, tokens), tokens


async def run_replay(
    cfg: ReplayConfig,
    *,
    plan: ReplayPlan | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> ReplaySummary:
    """Replay ``cfg.input`` in real time (scaled by ``speed``); see the module docstring. Setting ``stop`` ends
    the replay early: outstanding answers are awaited as at the end, and the summary counts what was sent.

    Raises :class:`ReplayInputError` (exit 2) and :class:`~kcloak.simulators.transport.TransportError` (exit 1).
    """
    tokens: list[tuple[str, str]] | None
    if plan is None:
        loaded, tokens = await asyncio.to_thread(load_plan, cfg)
        plan = loaded
    else:
        try:
            tokens = load_client_tokens(cfg.tokens) if cfg.tokens is not None else None
        except ClientInputError as exc:
            raise ReplayInputError(str(exc)) from None
    user_tokens = {u: tok for u, tok in (tokens or [])[: len(plan.users)]} if tokens is not None else None
    rng = np.random.default_rng(cfg.seed)
    users = plan.users
    n = len(plan)
    # Each user is "under way" from its first to its last fix: it may query in that span.
    first_off = np.full(len(users), np.inf)
    last_off = np.full(len(users), -np.inf)
    np.minimum.at(first_off, plan.user, plan.offset_s)
    np.maximum.at(last_off, plan.user, plan.offset_s)
    q_rate = cfg.queries_per_min / 60.0
    user_l, off_l, lat_l, lon_l = plan.user.tolist(), plan.offset_s.tolist(), plan.lat.tolist(), plan.lon.tolist()
    async with open_client(cfg.broker, tokens=user_tokens) as client:
        start = time.time()
        i = 0
        last_tick = start
        while i < n and not (stop is not None and stop.is_set()):
            now = time.time()
            due = now - start
            j = i
            while j < n and off_l[j] <= due:
                j += 1
            if j > i:
                items = [(users[user_l[k]], start + off_l[k], lat_l[k], lon_l[k]) for k in range(i, j)]
                await client.send_fixes(items)
                client.check_alive()
                i = j
                if on_progress is not None:
                    on_progress(i, n)
            if q_rate > 0:
                span = now - last_tick
                active = np.flatnonzero((first_off < due) & (last_off >= due))
                count = int(rng.poisson(q_rate * len(active) * span)) if active.size else 0
                for u in rng.choice(active, size=count).tolist() if count else []:
                    intended = last_tick + float(rng.uniform(0.0, span))
                    query = random_query(rng, cfg.query_kind, client.next_query_id())
                    await client.send_query(users[u], query, intended=intended)
            last_tick = now
            if i < n:
                wait = min(max(start + off_l[i] - time.time(), 0.0), TICK_S if q_rate > 0 else 1.0)
                if stop is None:
                    await asyncio.sleep(wait)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
        await client.drain(10.0)
        st = client.stats
        errors = dict(st.errors)
        return ReplaySummary(
            users=len(users),
            sent=st.sent,
            accepted=st.accepted,
            refused=dict(Counter(st.refused)),
            bad_rows=plan.bad_rows,
            duration_s=time.time() - start,
            queries=st.queries,
            answers_ok=st.answers_ok,
            answers_refused=st.answers_refused,
            reasons=dict(st.reasons),
            errors=errors,
            latency_ms=percentiles_ms(st.latencies_s),
        )


__all__ = [
    "SAMPLE",
    "ReplayConfig",
    "ReplayInputError",
    "ReplayPlan",
    "ReplaySummary",
    "load_plan",
    "plan_replay",
    "run_replay",
    "sample_path",
]
