"""The simulator traffic engine behind ``kcloak simulate`` (contract §9; issue 5).

Every simulated user moves with a mobility model (:mod:`kcloak.simulators.mobility`,
:mod:`kcloak.simulators.streets`), sends a location fix every ``dt_s`` seconds, and sends LBS queries as
a Poisson process of ``query_rate_per_min`` per user (the superposition of the users' processes
is one Poisson process of rate ``users × rate``, each event landing on a uniformly chosen user;
within a step the event times are uniform, which is exactly a Poisson process conditioned on its
count). Before traffic starts, each user's stored profile is set from a weighted mix
(``--profile-mix``; default 50 % k=5, 30 % k=10, 20 % k=20) through the profile topic or route
(or another door, ``profile_broker``: 3000 HTTP requests take a fraction of the time 3000 MQTT
round trips through the embedded MQTT broker do), while the users are placed on the model.

The engine talks to the broker only through the contract, via :mod:`kcloak.simulators.client`: in open
mode one gateway connection sends each step's fixes as batch messages (``kcloak/v1/updates/…``,
``POST /v1/locations``), with tokens each user sends its own fix on its own topic or route.
Query latency is measured from the query's **intended** send time (its Poisson event time).

Steps are paced on the wall clock: step ``i`` is due at ``t0 + i·dt_s``. A run that falls a whole
step or more behind (an overloaded machine) does not queue the late steps: it skips to the step
now due, moving the users by the time that passed, and counts the steps it skipped
(:attr:`SimulationSummary.skipped_steps`), so a run never outlasts ``duration_s`` and the fixes
it sends always carry the current time.

The street model drives on the bundled Beijing network, an ``--osm`` file, or a ready
:class:`~kcloak.simulators.streets.StreetGraph` (``graph``); ``bbox`` crops either network to a box
(its largest strongly connected part), so a caller never needs to write and re-parse an OSM crop.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import InputError
from kcloak.core.names import SimulatedQueryKind, values
from kcloak.core.places import load_pois
from kcloak.core.profile import PrivacyProfile, ProfileError
from kcloak.simulators.bench import MODELS
from kcloak.simulators.bench import build_model as build_bundled_model
from kcloak.simulators.client import (
    ClientInputError,
    HttpKcloakClient,
    MqttKcloakClient,
    load_client_tokens,
    open_client,
    percentiles_ms,
)
from kcloak.simulators.errors import SimulatorError
from kcloak.simulators.mobility import HotspotModel, MobilityModel, RandomWaypoint
from kcloak.simulators.streets import StreetGraph, StreetMovement, load_street_graph
from kcloak.simulators.transport import BrokerUrl

QUERY_KINDS = values(SimulatedQueryKind)
"""``--query-kind`` values: range queries, k-nearest-neighbour queries, or an even mix."""

RANGE_RADIUS_M = (200.0, 2000.0)
"""Radius of simulated range queries, drawn uniformly (metres)."""

KNN_N = (1, 10)
"""Result count of simulated knn queries, drawn uniformly (inclusive)."""

DRAIN_S = 5.0
"""How long a finished run waits for outstanding answers (``stop`` waits :data:`STOP_DRAIN_S`)."""

STOP_DRAIN_S = 2.0


class SimulationInputError(SimulatorError, InputError, ValueError):
    """Bad simulation input: flags, profile mix, tokens file, OSM file (exit 2)."""


@dataclass(frozen=True, slots=True)
class ProfileShare:
    """One entry of a profile mix: a share ``weight`` of users stores ``profile`` (a contract §2 subset)."""

    weight: float
    profile: Mapping[str, int | float]

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise SimulationInputError("profile mix: weight must be a number")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise SimulationInputError("profile mix: weight must be finite and > 0")
        try:
            PrivacyProfile.from_mapping(self.profile)
        except ProfileError as exc:
            raise SimulationInputError(f"profile mix: {exc}") from None
        object.__setattr__(self, "profile", MappingProxyType(dict(self.profile)))

    def to_request(self) -> dict[str, int | float]:
        """The body of the profile message / PUT (omitted fields take the server defaults)."""
        return dict(self.profile)


DEFAULT_MIX: tuple[ProfileShare, ...] = (
    ProfileShare(0.5, {"k": 5}),
    ProfileShare(0.3, {"k": 10}),
    ProfileShare(0.2, {"k": 20}),
)
"""The issue's default mix: 50 % k=5, 30 % k=10, 20 % k=20 (other fields: server defaults)."""


def parse_profile_mix(data: object) -> tuple[ProfileShare, ...]:
    """``[{"weight": w, "profile": {...}}, ...]`` (contract §9 ``--profile-mix``) as shares."""
    if not isinstance(data, list) or not data:
        raise SimulationInputError('profile mix: expected a non-empty list of {"weight", "profile"}')
    out: list[ProfileShare] = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or set(item) != {"weight", "profile"} or not isinstance(item["profile"], dict):
            raise SimulationInputError(f'profile mix: item {i}: expected {{"weight": w, "profile": {{...}}}}')
        out.append(ProfileShare(item["weight"], item["profile"]))
    return tuple(out)


def load_profile_mix(path: str | Path) -> tuple[ProfileShare, ...]:
    """Read a ``--profile-mix`` JSON file; unreadable or invalid → :class:`SimulationInputError`."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SimulationInputError(f"profile mix: cannot read {p.name} ({type(exc).__name__})") from None
    return parse_profile_mix(data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """One ``kcloak simulate`` run (contract §9 flags and defaults)."""

    users: int = 1000
    model: str = "street"
    osm: Path | None = None
    dt_s: float = 1.0
    query_rate_per_min: float = 1.0
    profile_mix: tuple[ProfileShare, ...] = DEFAULT_MIX
    duration_s: float = 60.0
    seed: int | None = None
    broker: str = "mqtt://127.0.0.1:1883"
    tokens: Path | None = None
    query_kind: str = "mix"
    graph: StreetGraph | None = field(default=None, compare=False, repr=False)
    """A ready street network for ``model="street"`` (instead of ``osm`` or the bundled sample)."""
    bbox: tuple[float, float, float, float] | None = None
    """``(min_lon, min_lat, max_lon, max_lat)``: users keep to this box (the street network is cropped to it)."""
    profile_broker: str | None = None
    """Set the stored profiles through this door (e.g. the broker's ``http://`` URL) instead of ``broker``."""

    def __post_init__(self) -> None:
        if self.users < 1:
            raise SimulationInputError("--users: must be >= 1")
        if self.model not in MODELS:
            raise SimulationInputError(f"--model: must be one of {', '.join(MODELS)}")
        if not (math.isfinite(self.dt_s) and self.dt_s > 0):
            raise SimulationInputError("--dt: must be finite and > 0")
        if not (math.isfinite(self.query_rate_per_min) and self.query_rate_per_min >= 0):
            raise SimulationInputError("--query-rate: must be finite and >= 0")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise SimulationInputError("--duration: must be finite and > 0")
        if not self.profile_mix:
            raise SimulationInputError("--profile-mix: needs at least one entry")
        if self.query_kind not in QUERY_KINDS:
            raise SimulationInputError(f"--query-kind: must be one of {', '.join(QUERY_KINDS)}")
        try:
            BrokerUrl.parse(self.broker)
            if self.profile_broker is not None:
                BrokerUrl.parse(self.profile_broker)
        except ValueError as exc:
            raise SimulationInputError(str(exc)) from None
        if self.graph is not None and self.model != "street":
            raise SimulationInputError("a street graph needs model 'street'")
        if self.graph is not None and self.osm is not None:
            raise SimulationInputError("give either an OSM file or a street graph, not both")
        if self.graph is not None and self.graph.nodes == 0:
            raise SimulationInputError("the street graph has no node")
        if self.bbox is not None:
            lo_lon, lo_lat, hi_lon, hi_lat = self.bbox
            if not all(math.isfinite(v) for v in self.bbox) or not (lo_lon < hi_lon and lo_lat < hi_lat):
                raise SimulationInputError("bbox: must be finite (min_lon, min_lat, max_lon, max_lat) with min < max")


class SimulationObserver(Protocol):
    """Hooks a caller (``kcloak demo``) may implement; all optional, all called on the event loop."""

    def on_updates(self, n: int) -> None:
        """``n`` fixes were sent."""

    def on_query(self) -> None:
        """One query was sent."""

    def on_query_sent(self, query_id: str) -> None:
        """A query with this ``query_id`` is about to be sent (before its answer can arrive)."""

    def on_answer(self, answer: dict[str, Any], latency_s: float) -> None:
        """An answer (contract JSON) arrived ``latency_s`` after the query's intended send time."""

    def on_positions(self, lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64]) -> None:
        """Every user's position at this step (degrees; one row per user)."""


class NullObserver:
    """A :class:`SimulationObserver` whose hooks do nothing: subclass it and override what you need."""

    def on_updates(self, n: int) -> None:
        return None

    def on_query(self) -> None:
        return None

    def on_query_sent(self, query_id: str) -> None:
        return None

    def on_answer(self, answer: dict[str, Any], latency_s: float) -> None:
        return None

    def on_positions(self, lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64]) -> None:
        return None


@dataclass(frozen=True, slots=True)
class SimulationSummary:
    """The outcome of a run; :meth:`to_json` is the ``kcloak simulate --json`` object (contract §9)."""

    users: int
    sent: int
    queries: int
    answers_ok: int
    answers_refused: int
    refusals: dict[str, int]
    duration_s: float
    transport: str = "mqtt"
    accepted: int | None = None
    refused: dict[str, int] = field(default_factory=dict)
    unanswered: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    profiles_ok: int = 0
    profiles_refused: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    latency_ms: dict[str, float | None] = field(default_factory=dict)
    skipped_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        """``users, sent, accepted (null over MQTT), refused {code: n}, duration_s, queries, answers {ok, refused}``.

        Extensions: ``answers.unanswered`` and ``answers.reasons`` (refusal codes), ``profiles``,
        ``errors``, ``latency_ms``, ``transport``, ``steps`` (sent) and ``skipped_steps``.
        """
        return {
            "users": self.users,
            "sent": self.sent,
            "accepted": self.accepted,
            "refused": dict(sorted(self.refused.items())),
            "duration_s": round(self.duration_s, 3),
            "queries": self.queries,
            "answers": {
                "ok": self.answers_ok,
                "refused": self.answers_refused,
                "unanswered": self.unanswered,
                "reasons": dict(sorted(self.refusals.items())),
            },
            "profiles": {"ok": self.profiles_ok, "refused": dict(sorted(self.profiles_refused.items()))},
            "errors": dict(sorted(self.errors.items())),
            "latency_ms": self.latency_ms,
            "transport": self.transport,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }


def crop_streets(graph: StreetGraph, bbox: tuple[float, float, float, float]) -> StreetGraph:
    """The largest strongly connected part of the streets inside ``bbox`` (min_lon, min_lat, max_lon, max_lat)."""
    lo_lon, lo_lat, hi_lon, hi_lat = bbox
    keep = (graph.lon > lo_lon) & (graph.lon < hi_lon) & (graph.lat > lo_lat) & (graph.lat < hi_lat)
    return graph.subgraph(keep).largest_component()


def street_graph(
    *, osm: Path | None = None, graph: StreetGraph | None = None, bbox: tuple[float, float, float, float] | None = None
) -> StreetGraph:
    """The street network of a run: ``graph``, else ``osm``, else the bundled sample; cropped to ``bbox`` if given."""
    if graph is None:
        try:
            graph = load_street_graph(osm)
        except (OSError, ValueError) as exc:
            name = Path(osm).name if osm is not None else "the bundled street network"
            raise SimulationInputError(f"--osm: cannot use {name} ({exc})") from None
    if bbox is not None:
        graph = crop_streets(graph, bbox)
        if graph.edges == 0:
            raise SimulationInputError("bbox: no street inside the box")
    return graph


@dataclass(frozen=True, slots=True)
class _LatLon:
    lat: npt.NDArray[np.float64]
    lon: npt.NDArray[np.float64]


def build_model(
    name: str,
    users: int,
    *,
    osm: Path | None = None,
    seed: int | None = None,
    graph: StreetGraph | None = None,
    bbox: tuple[float, float, float, float] | None = None,
) -> MobilityModel:
    """The model behind ``--model``: ``street`` drives on ``graph``, ``--osm`` or the bundled Beijing sample,
    cropped to ``bbox`` when given; ``waypoint`` and ``hotspot`` keep to ``bbox`` (hotspots: the POIs inside)."""
    s = seed if seed is not None else secrets.randbits(32)
    if name == "street" and (osm is not None or graph is not None or bbox is not None):
        return StreetMovement(users, street_graph(osm=osm, graph=graph, bbox=bbox), seed=s)
    if name == "waypoint" and bbox is not None:
        return RandomWaypoint(users, bbox, seed=s)
    if name == "hotspot" and bbox is not None:
        pois = load_pois(None)
        lat, lon = pois.lat, pois.lon
        inside = (lon > bbox[0]) & (lon < bbox[2]) & (lat > bbox[1]) & (lat < bbox[3])
        if not inside.any():
            raise SimulationInputError("bbox: no point of interest inside the box for the hotspot model")
        return HotspotModel(users, _LatLon(lat[inside], lon[inside]), bbox=bbox, seed=s)
    try:
        return build_bundled_model(name, users, seed=s)
    except ValueError as exc:
        raise SimulationInputError(str(exc)) from None


def simulated_users(n: int, tokens: Sequence[tuple[str, str]] | None, prefix: str = "s") -> list[str]:
    """User ids: the tokens file's first ``n`` users, else ``{prefix}000000``…"""
    if tokens is None:
        return [f"{prefix}{i:06d}" for i in range(n)]
    if len(tokens) < n:
        raise SimulationInputError(f"--users: {n} users but the tokens file has only {len(tokens)} usable users")
    return [u for u, _ in tokens[:n]]


def random_query(rng: np.random.Generator, kind: str, qid: str) -> dict[str, Any]:
    """A contract §3 query of ``kind`` (``range``, ``knn`` or ``mix``) with the given ``query_id``."""
    if kind == "mix":
        kind = "range" if rng.random() < 0.5 else "knn"
    if kind == "range":
        return {"query_id": qid, "kind": "range", "radius_m": round(float(rng.uniform(*RANGE_RADIUS_M)), 1)}
    return {"query_id": qid, "kind": "knn", "n": int(rng.integers(KNN_N[0], KNN_N[1] + 1))}


def _hook(observer: object | None, name: str) -> Any:
    return getattr(observer, name, None) if observer is not None else None


async def _sleep_until(wall_t: float, stop: asyncio.Event | None, clock: Callable[[], float] = time.time) -> bool:
    """Sleep until ``clock()`` reaches ``wall_t``; True if ``stop`` was set first."""
    delay = wall_t - clock()
    if stop is None:
        if delay > 0:
            await asyncio.sleep(delay)
        return False
    if stop.is_set():
        return True
    if delay > 0:
        try:
            async with asyncio.timeout(delay):
                await stop.wait()
        except TimeoutError:
            return False
        return True
    return False


@dataclass(frozen=True, slots=True)
class DriveOutcome:
    """What :func:`_drive` did: steps sent, steps skipped (behind schedule) and seconds run."""

    steps: int
    skipped_steps: int
    elapsed_s: float


async def _drive(
    cfg: SimulationConfig,
    client: MqttKcloakClient | HttpKcloakClient,
    users: list[str],
    model: MobilityModel,
    rng: np.random.Generator,
    observer: object | None,
    stop: asyncio.Event | None,
    *,
    paced: bool,
    clock: Callable[[], float] = time.time,
) -> DriveOutcome:
    """Step, send fixes and queries until ``duration_s`` has passed or ``stop`` is set.

    Paced: step ``i`` is due at ``t0 + i·dt_s``; when the loop is a whole step or more late it
    skips to the step now due (the model moves by the time that passed) instead of falling behind.
    """
    on_updates = _hook(observer, "on_updates")
    on_query = _hook(observer, "on_query")
    on_query_sent = _hook(observer, "on_query_sent")
    on_positions = _hook(observer, "on_positions")
    rate_per_s = cfg.users * cfg.query_rate_per_min / 60.0
    n = len(users)
    t0 = clock()
    end = t0 + cfg.duration_s
    n_steps = math.ceil(cfg.duration_s / cfg.dt_s - 1e-9)  # steps due before ``end``
    index = 0  # the schedule's step number (paced)
    sent = skipped = 0
    moved_to = 0  # schedule step the model's positions belong to
    while True:
        if paced and sent:
            due = min(int((clock() - t0) / cfg.dt_s), n_steps)
            if due > index:  # a whole step or more behind: skip to the step now due
                skipped += due - index
                index = due
        step_t = t0 + index * cfg.dt_s if paced else clock()
        if step_t >= end or (stop is not None and stop.is_set()):
            break
        if paced and await _sleep_until(step_t, stop, clock):
            break
        if sent:
            model.step(cfg.dt_s * (index - moved_to if paced else 1))
        moved_to = index
        lat, lon = model.positions()
        if on_positions is not None:
            on_positions(lat, lon)
        t_fix = clock()
        items = list(zip(users, [t_fix] * n, lat.tolist(), lon.tolist(), strict=True))
        await client.send_fixes(items)
        client.check_alive()
        if on_updates is not None:
            on_updates(n)
        sent += 1
        index += 1
        # Queries of this step (from the second step on, so every querier has sent a fix).
        if sent > 1 and rate_per_s > 0:
            count = int(rng.poisson(rate_per_s * cfg.dt_s))
            offsets = np.sort(rng.uniform(0.0, cfg.dt_s, count))
            who = rng.integers(0, n, count)
            for off, u in zip(offsets.tolist(), who.tolist(), strict=True):
                intended = step_t + off
                if intended >= end:
                    break
                if await _sleep_until(intended, stop, clock):
                    break
                query = random_query(rng, cfg.query_kind, client.next_query_id())
                if on_query_sent is not None:
                    on_query_sent(query["query_id"])
                await client.send_query(users[u], query, intended=intended)
                if on_query is not None:
                    on_query()
    return DriveOutcome(sent, skipped, clock() - t0)


async def run_simulation(
    cfg: SimulationConfig,
    *,
    observer: SimulationObserver | None = None,
    stop: asyncio.Event | None = None,
) -> SimulationSummary:
    """Run one simulation against the broker of ``cfg.broker`` (see the module docstring).

    Raises :class:`SimulationInputError` for bad input (exit 2) and
    :class:`~kcloak.simulators.transport.TransportError` when the broker is unreachable (exit 1).
    Setting ``stop`` ends the run early; outstanding answers are awaited briefly, then counted
    as unanswered.
    """
    try:
        tokens = load_client_tokens(cfg.tokens) if cfg.tokens is not None else None
    except ClientInputError as exc:
        raise SimulationInputError(str(exc)) from None
    users = simulated_users(cfg.users, tokens)
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(32)
    # The users are placed (a thread) while their profiles are set.
    placing = asyncio.create_task(
        asyncio.to_thread(build_model, cfg.model, cfg.users, osm=cfg.osm, seed=seed, graph=cfg.graph, bbox=cfg.bbox)
    )
    try:
        return await _run(cfg, users, tokens, placing, seed, observer, stop)
    finally:
        if not placing.done():
            await asyncio.wait([placing])
        if not placing.cancelled():
            placing.exception()  # retrieved: an error was raised above or is superseded by one


async def _run(
    cfg: SimulationConfig,
    users: list[str],
    tokens: list[tuple[str, str]] | None,
    placing: asyncio.Task[MobilityModel],
    seed: int,
    observer: SimulationObserver | None,
    stop: asyncio.Event | None,
) -> SimulationSummary:
    rng = np.random.default_rng(seed + 1)
    weights = np.array([s.weight for s in cfg.profile_mix], dtype=np.float64)
    pick = rng.choice(len(cfg.profile_mix), size=cfg.users, p=weights / weights.sum())
    requests = [s.to_request() for s in cfg.profile_mix]
    user_tokens = dict(tokens[: cfg.users]) if tokens is not None else None
    on_answer = _hook(observer, "on_answer")
    profiles = [(u, requests[int(i)]) for u, i in zip(users, pick.tolist(), strict=True)]
    timeout_s = 10.0 + cfg.users / 500.0
    async with open_client(cfg.broker, tokens=user_tokens, on_answer=on_answer) as client:
        if cfg.profile_broker is None:
            await client.set_profiles(profiles, timeout_s=timeout_s)
            pst = client.stats
        else:
            async with open_client(cfg.profile_broker, tokens=user_tokens) as door:
                await door.set_profiles(profiles, timeout_s=timeout_s)
                pst = door.stats
        model = await placing
        drove = await _drive(cfg, client, users, model, rng, observer, stop, paced=True)
        stopped = stop is not None and stop.is_set()
        unanswered = await client.drain(STOP_DRAIN_S if stopped else DRAIN_S)
        st = client.stats
        errors = dict(st.errors)
        errors.pop("unanswered", None)
        refusals = dict(st.reasons)
        return SimulationSummary(
            users=cfg.users,
            sent=st.sent,
            queries=st.queries,
            answers_ok=st.answers_ok,
            answers_refused=st.answers_refused,
            refusals=refusals,
            duration_s=drove.elapsed_s,
            transport=client.transport,
            accepted=st.accepted,
            refused=dict(st.refused),
            unanswered=unanswered,
            errors=errors,
            profiles_ok=pst.profiles_ok,
            profiles_refused=dict(pst.profiles_refused),
            steps=drove.steps,
            latency_ms=percentiles_ms(st.latencies_s),
            skipped_steps=drove.skipped_steps,
        )


async def saturate(
    broker: str, *, users: int, duration_s: float, model: str = "waypoint", seed: int = 0
) -> tuple[int, float]:
    """Send fixes as fast as the broker takes them (no pacing, no queries, no profiles): ``(fixes, seconds)``.

    Open mode only; used by ``kcloak bench simulate`` to show that one simulator process is not
    the bottleneck. Each step moves every user by 1 s of model time and stamps the fixes with the
    send time, so each user's fixes stay in increasing time order.
    """
    cfg = SimulationConfig(users=users, model=model, duration_s=duration_s, broker=broker, query_rate_per_min=0.0)
    mob = build_model(model, users, seed=seed)
    async with open_client(broker) as client:
        drove = await _drive(
            cfg, client, simulated_users(users, None), mob, np.random.default_rng(seed), None, None, paced=False
        )
        await client.drain(30.0)
        return client.stats.sent, drove.elapsed_s


__all__ = [
    "DEFAULT_MIX",
    "QUERY_KINDS",
    "NullObserver",
    "ProfileShare",
    "SimulationConfig",
    "SimulationInputError",
    "SimulationObserver",
    "SimulationSummary",
    "build_model",
    "crop_streets",
    "load_profile_mix",
    "parse_profile_mix",
    "run_simulation",
    "saturate",
    "street_graph",
]
