"""Mobility-model throughput for ``kcloak bench simulate`` (contract §9; CONCEPTS §9.9 ``user_steps_per_s``).

Each model is built once (timed as ``setup_s``: for ``street`` this includes parsing the bundled
OSM file and the route trees), then stepped with all its users for ``duration_s`` of wall time;
``user_steps_per_s`` = users × steps / stepping time. ``positions()`` is not part of a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from kcloak.core.names import MobilityModelName, values
from kcloak.core.places import load_pois
from kcloak.simulators.mobility import HotspotModel, MobilityModel, RandomWaypoint
from kcloak.simulators.streets import StreetMovement, load_street_graph

MODELS = values(MobilityModelName)
"""Contract names of the mobility models, in the order of the benchmark rows."""

BEIJING_BBOX = (116.148, 39.788, 116.613, 40.096)
"""Extent of the bundled street network (GeoJSON order), also used for the waypoint model."""


def build_model(name: str, users: int, *, seed: int = 0) -> MobilityModel:
    """The model behind ``--model NAME`` with its defaults on the bundled Beijing data."""
    match name:
        case "waypoint":
            return RandomWaypoint(users, BEIJING_BBOX, seed=seed)
        case "street":
            return StreetMovement(users, load_street_graph(), seed=seed)
        case "hotspot":
            return HotspotModel(users, load_pois(None), seed=seed)
    raise ValueError(f"model: unknown {name!r} (expected one of {', '.join(MODELS)})")


def measure_model(
    factory: Callable[[], MobilityModel], *, duration_s: float, dt_s: float = 1.0
) -> tuple[float, int, float]:
    """``(setup_s, steps, stepping_s)`` of one model: at least one step, then steps until ``duration_s`` has passed."""
    t0 = time.perf_counter()
    model = factory()
    setup_s = time.perf_counter() - t0
    steps = 0
    t0 = time.perf_counter()
    while True:
        model.step(dt_s)
        steps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= duration_s:
            return setup_s, steps, elapsed


def measure_models(users: int = 100_000, duration_s: float = 10.0, seed: int = 0) -> list[dict[str, object]]:
    """Contract rows ``{"model", "users", "user_steps_per_s"}`` (+ ``setup_s``, ``steps``) for each model.

    Every model is stepped for ``duration_s`` of wall time (so a run takes about three times that
    plus setup), with ``dt_s`` = 1 s, the ``simulate`` default.
    """
    if users < 1:
        raise ValueError("users: must be >= 1")
    if not duration_s > 0:
        raise ValueError("duration_s: must be > 0")
    rows: list[dict[str, object]] = []
    for name in MODELS:
        setup_s, steps, elapsed = measure_model(partial(build_model, name, users, seed=seed), duration_s=duration_s)
        rows.append(
            {
                "model": name,
                "users": users,
                "user_steps_per_s": users * steps / elapsed,
                "setup_s": setup_s,
                "steps": steps,
            }
        )
    return rows


def encode_rate(users: int, duration_s: float, *, model: str = "waypoint", seed: int = 0) -> float:
    """Fixes per second the simulator can step and encode as batch messages with no network at all.

    This is the simulator's own ceiling: the transport rows' ``updates_per_s`` is below it only
    when the broker (or the socket) is the limit.
    """
    from kcloak.simulators.client import batch_payloads

    mob = build_model(model, users, seed=seed)
    names = [f"s{i:06d}" for i in range(users)]
    sent = 0
    t0 = time.perf_counter()
    while True:
        mob.step(1.0)
        lat, lon = mob.positions()
        now = time.time()
        items = list(zip(names, [now] * users, lat.tolist(), lon.tolist(), strict=True))
        sent += sum(n for n, _ in batch_payloads(items))
        elapsed = time.perf_counter() - t0
        if elapsed >= duration_s:
            return sent / elapsed
