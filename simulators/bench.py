"""Mobility-model throughput for ``kcloak bench simulate`` (contract §9; CONCEPTS §9.9 ``user_steps_per_s``).

Each model is built once (timed as ``setup_s``: for ``street`` this includes parsing the bundled
OSM file and the route trees), then stepped with all its users for ``duration_s`` of wall time;
``user_steps_per_s`` = users × steps / stepping time. ``positions()`` is not part of a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from kcloak.core.places import load_pois
from kcloak.simulators.mobility import HotspotModel, MobilityModel, RandomWaypoint
from kcloak.simulators.streets import StreetMovement, load_street_graph

MODELS = ("waypoint", "street", "hotspot")
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


TRANSPORTS = ("mqtt", "http")
"""Transport rows of ``kcloak bench simulate``, in order."""


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


def measure_transports(
    users: int = 100_000, duration_s: float = 10.0, seed: int = 0, *, log: Callable[[str], None] | None = None
) -> list[dict[str, object]]:
    """Contract rows ``{"transport", "updates_per_s", "broker_accepted_per_s"}`` for MQTT and HTTP.

    A real ``kcloak serve`` runs in a child process (MQTT through a spawned mosquitto when on PATH,
    else the embedded broker; an instant upstream), as ``kcloak bench broker`` starts it. One
    simulator process (this one) sends waypoint fixes in open-mode batches as fast as the broker
    takes them for ``duration_s``; ``updates_per_s`` is what it sent, ``broker_accepted_per_s``
    the growth of the broker's ``kcloak_updates_accepted_total`` over the same window. Extra
    field ``simulator_only_updates_per_s``: :func:`encode_rate` (the simulator with no network).
    """
    import asyncio
    import contextlib
    import tempfile
    import urllib.request
    from pathlib import Path

    from kcloak.broker.bench import instant_upstream, mosquitto, serve_process, wait_healthy
    from kcloak.broker.mqtt import free_port
    from kcloak.simulators.traffic import saturate

    say = log or (lambda _msg: None)

    def scrape(http_port: int) -> dict[str, float]:
        # A saturated broker may take a while to serve /metrics: allow 60 s.
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=60) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def accepted(http_port: int, transport: str) -> float:
        metrics = scrape(http_port)
        return sum(
            v
            for k, v in metrics.items()
            if k.startswith("kcloak_updates_accepted_total") and f'transport="{transport}"' in k
        )

    def settle(http_port: int, timeout_s: float = 60.0) -> None:
        # Let the broker work off any backlog before the next phase (its counters stop moving).
        deadline, last = time.monotonic() + timeout_s, -1.0
        while time.monotonic() < deadline:
            m = scrape(http_port)
            now = sum(v for k, v in m.items() if k.startswith(("kcloak_updates_", "kcloak_messages_dropped")))
            if now == last:
                return
            last = now
            time.sleep(0.5)

    say("simulator only (no network)")
    ceiling = encode_rate(users, min(duration_s, 5.0), seed=seed)
    rows: list[dict[str, object]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kcloak-bench-sim-") as tmp,
        instant_upstream() as upstream,
        contextlib.ExitStack() as stack,
    ):
        try:
            mqtt_port, label = stack.enter_context(mosquitto(Path(tmp)))
            mqtt_args = ["--mqtt", f"mqtt://127.0.0.1:{mqtt_port}", "--mqtt-ingest-connections", "2"]
        except FileNotFoundError:
            mqtt_port, label = free_port(), "embedded"
            mqtt_args = ["--mqtt", "embedded", "--mqtt-listen", f"127.0.0.1:{mqtt_port}"]
        http_port = free_port()
        args = ["--http", f"127.0.0.1:{http_port}", "--upstream", upstream, "--data-dir", str(Path(tmp) / "data")]
        stack.enter_context(serve_process(args + mqtt_args))
        wait_healthy(http_port)
        for transport in TRANSPORTS:
            say(f"{transport} updates")
            url = f"mqtt://127.0.0.1:{mqtt_port}" if transport == "mqtt" else f"http://127.0.0.1:{http_port}"
            before, t0 = accepted(http_port, transport), time.monotonic()
            sent, elapsed = asyncio.run(saturate(url, users=users, duration_s=duration_s, seed=seed))
            after, t1 = accepted(http_port, transport), time.monotonic()
            settle(http_port)
            rows.append(
                {
                    "transport": transport,
                    "updates_per_s": round(sent / elapsed, 1),
                    "broker_accepted_per_s": round((after - before) / (t1 - t0), 1),
                    "simulator_only_updates_per_s": round(ceiling, 1),
                    "mqtt": label,
                    "users": users,
                }
            )
    return rows
