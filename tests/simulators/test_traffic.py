"""The traffic engine against a real broker: every fix and query sent is counted by the broker (§10)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcloak.broker.bench import mosquitto
from kcloak.broker.service import Broker
from kcloak.simulators.client import batch_payloads, percentiles_ms
from kcloak.simulators.streets import StreetGraph, load_street_graph
from kcloak.simulators.traffic import (
    DEFAULT_MIX,
    NullObserver,
    ProfileShare,
    SimulationConfig,
    SimulationInputError,
    build_model,
    load_profile_mix,
    parse_profile_mix,
    run_simulation,
    street_graph,
)
from kcloak.simulators.transport import BrokerUrl, TransportError
from kcloak.wire.net import free_port
from tests.broker.conftest import SpyUpstream, broker_config, spy  # noqa: F401

WIDE = (ProfileShare(0.5, {"k": 2, "max_area_m2": 2.5e9}), ProfileShare(0.5, {"k": 3, "max_area_m2": 2.5e9}))


def count(text: str, prefix: str, *needles: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and all(n in line for n in needles)
    )


def fixes_counted(text: str, transport: str) -> float:
    """Accounting rule §10: accepted + rejected + fixes of dropped messages (none dropped here)."""
    t = f'transport="{transport}"'
    return count(text, "kcloak_updates_accepted_total", t) + count(text, "kcloak_updates_rejected_total", t)


async def settled(b: Broker, transport: str, sent: int) -> str:
    """The broker's metrics once it has counted ``sent`` fixes (or after 10 s)."""
    text = ""
    for _ in range(200):
        text = b.metrics.render().decode()
        if fixes_counted(text, transport) >= sent:
            break
        await asyncio.sleep(0.05)
    return text


@contextmanager
def tokens_file(tmp_path: Path, users: list[str]) -> Iterator[Path]:
    p = tmp_path / "tokens"
    p.write_text("".join(f"{u}:tok-{u}\n" for u in users))
    yield p


@asynccontextmanager
async def real_broker(tmp_path: Path, spy_url: str, mqtt: str, **values: Any) -> AsyncIterator[tuple[Broker, str]]:
    """A real broker; yields it and the client URL for ``mqtt`` = embedded | mosquitto | http."""
    if mqtt == "mosquitto":
        with mosquitto(tmp_path) as (port, _):
            cfg = broker_config(tmp_path, spy_url, **{"mqtt.mode": f"mqtt://127.0.0.1:{port}"}, **values)
            async with Broker(config=cfg) as b:
                yield b, f"mqtt://127.0.0.1:{port}"
        return
    port = free_port()
    cfg = broker_config(tmp_path, spy_url, **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{port}"}, **values)
    async with Broker(config=cfg) as b:
        yield b, (f"mqtt://127.0.0.1:{port}" if mqtt == "embedded" else f"http://127.0.0.1:{b.http_port}")


# -- pure parts --------------------------------------------------------------------------------
def test_profile_mix_parsing_and_validation(tmp_path: Path) -> None:
    mix = parse_profile_mix([{"weight": 3, "profile": {"k": 7}}, {"weight": 1, "profile": {}}])
    assert [s.weight for s in mix] == [3, 1] and mix[0].to_request() == {"k": 7}
    assert [s.profile["k"] for s in DEFAULT_MIX] == [5, 10, 20]
    assert [s.weight for s in DEFAULT_MIX] == [0.5, 0.3, 0.2]
    for bad in ([], [{"weight": 0, "profile": {}}], [{"weight": 1, "profile": {"k": 0}}], [{"weight": 1}], {"a": 1}):
        with pytest.raises(SimulationInputError):
            parse_profile_mix(bad)
    with pytest.raises(SimulationInputError):
        parse_profile_mix([{"weight": 1, "profile": {"k": 5.0}}])  # integer fields are integers (§0)
    f = tmp_path / "mix.json"
    f.write_text('[{"weight": NaN, "profile": {}}]')
    with pytest.raises(SimulationInputError):
        load_profile_mix(f)
    f.write_text(json.dumps([{"weight": 1, "profile": {"k": 10, "max_area_m2": 1e6}}]))
    assert load_profile_mix(f)[0].profile == {"k": 10, "max_area_m2": 1e6}


def test_config_and_url_validation() -> None:
    assert BrokerUrl.parse("mqtt://localhost") == BrokerUrl("mqtt", "localhost", 1883)
    assert BrokerUrl.parse("http://127.0.0.1") == BrokerUrl("http", "127.0.0.1", 8470)
    for url in ("tcp://x:1", "mqtt://", "mqtt://a:b@h:1", "http://h:99999", "http://h:1/path"):
        with pytest.raises(ValueError):
            BrokerUrl.parse(url)
    for bad in ({"users": 0}, {"dt_s": 0.0}, {"model": "teleport"}, {"query_kind": "all"}, {"duration_s": -1.0}):
        with pytest.raises(SimulationInputError):
            SimulationConfig(**bad)


def test_batch_payloads_split_and_name_every_user() -> None:
    items = [(f"u{i}", 1714550400.0 + i, 39.9, 116.4) for i in range(12_001)]
    bodies = batch_payloads(items)
    assert [n for n, _ in bodies] == [5000, 5000, 2001]
    parsed = [json.loads(b)["updates"] for _, b in bodies]
    assert sum(len(p) for p in parsed) == 12_001 and all(len(b) < 1 << 20 for _, b in bodies)
    assert parsed[2][-1] == {"user": "u12000", "t": 1714562400.0, "lat": 39.9, "lon": 116.4}


def test_percentiles_nearest_rank() -> None:
    p = percentiles_ms([i / 1000 for i in range(1, 101)])
    assert p == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert percentiles_ms([])["p50"] is None


async def test_unreachable_broker_raises_transport_error() -> None:
    port = free_port()
    for url in (f"mqtt://127.0.0.1:{port}", f"http://127.0.0.1:{port}"):
        with pytest.raises(TransportError):
            await run_simulation(SimulationConfig(users=5, model="waypoint", duration_s=1, broker=url, seed=1))


# -- against a real broker ---------------------------------------------------------------------
@pytest.mark.parametrize(("door", "model"), [("embedded", "waypoint"), ("http", "street"), ("mosquitto", "hotspot")])
async def test_every_fix_and_query_is_counted_by_the_broker(
    tmp_path: Path,
    spy: SpyUpstream,  # noqa: F811
    door: str,
    model: str,
) -> None:
    class Seen(NullObserver):
        def __init__(self) -> None:
            self.updates = self.queries = self.answers = self.steps = 0

        def on_updates(self, n: int) -> None:
            self.updates += n

        def on_query(self) -> None:
            self.queries += 1

        def on_answer(self, answer: dict[str, Any], latency_s: float) -> None:
            assert latency_s >= 0 and answer["status"] in ("ok", "refused")
            self.answers += 1

        def on_positions(self, lat: Any, lon: Any) -> None:
            assert len(lat) == len(lon) == 60
            self.steps += 1

    seen = Seen()
    async with real_broker(tmp_path, spy.url, door) as (b, url):
        cfg = SimulationConfig(
            users=60, model=model, dt_s=0.5, duration_s=2.0, query_rate_per_min=60.0, profile_mix=WIDE,
            broker=url, seed=3,
        )  # fmt: skip
        s = await run_simulation(cfg, observer=seen)
        transport = "http" if door == "http" else "mqtt"
        text = await settled(b, transport, s.sent)
    assert s.transport == transport and s.steps == 4 and seen.steps == 4
    assert s.sent == seen.updates == 60 * 4
    assert fixes_counted(text, transport) == s.sent
    assert count(text, "kcloak_updates_accepted_total", f'transport="{transport}"') == s.sent
    assert count(text, "kcloak_messages_dropped_total") == 0
    if transport == "http":
        assert s.accepted == s.sent and s.refused == {}
    else:
        assert s.accepted is None
    assert s.profiles_ok == 60 and count(text, "kcloak_profile_sets_total", 'status="ok"') == 60
    assert s.queries == seen.queries > 0 and s.unanswered == 0
    assert s.answers_ok + s.answers_refused == s.queries == seen.answers
    assert count(text, "kcloak_queries_total", f'transport="{transport}"') == s.queries
    assert s.answers_ok > 0  # k ≤ 3 over a 2.5e9 m² cap: most queries succeed
    out = s.to_json()
    assert set(out) >= {"users", "sent", "accepted", "refused", "duration_s", "queries", "answers"}
    assert out["answers"]["ok"] == s.answers_ok and out["answers"]["refused"] == s.answers_refused


@pytest.mark.parametrize("door", ["embedded", "http"])
async def test_with_tokens_each_user_acts_for_itself(tmp_path: Path, spy: SpyUpstream, door: str) -> None:  # noqa: F811
    users = [f"alice{i}" for i in range(4)]
    with tokens_file(tmp_path, users) as tokens:
        async with real_broker(tmp_path, spy.url, door, **{"auth.tokens": str(tokens)}) as (b, url):
            cfg = SimulationConfig(
                users=4, model="waypoint", dt_s=0.5, duration_s=1.5, query_rate_per_min=120.0, broker=url,
                tokens=tokens, seed=5,
            )  # fmt: skip
            s = await run_simulation(cfg)
            transport = "http" if door == "http" else "mqtt"
            text = await settled(b, transport, s.sent)
            with pytest.raises(SimulationInputError):  # more users than the tokens file has
                await run_simulation(SimulationConfig(users=5, model="waypoint", broker=url, tokens=tokens))
    assert s.sent == 4 * 3 and fixes_counted(text, transport) == s.sent
    assert count(text, "kcloak_updates_accepted_total") == s.sent
    assert count(text, "kcloak_messages_total", 'topic="updates"') == 0  # one fix per message with tokens
    assert s.profiles_ok == 4 and s.unanswered == 0
    assert count(text, "kcloak_queries_total") == s.queries == s.answers_ok + s.answers_refused


async def test_stop_ends_the_run_early(tmp_path: Path, spy: SpyUpstream) -> None:  # noqa: F811
    async with real_broker(tmp_path, spy.url, "embedded") as (b, url):
        stop = asyncio.Event()
        cfg = SimulationConfig(users=20, model="waypoint", dt_s=0.2, duration_s=60.0, broker=url, seed=1)
        asyncio.get_running_loop().call_later(1.5, stop.set)
        s = await asyncio.wait_for(run_simulation(cfg, stop=stop), 15)
        text = await settled(b, "mqtt", s.sent)
    assert s.duration_s < 5.0 and 0 < s.steps < 20
    assert fixes_counted(text, "mqtt") == s.sent == 20 * s.steps
    assert s.answers_ok + s.answers_refused + s.unanswered == s.queries


# -- schedule and street input -----------------------------------------------------------------
BOX = (116.38, 39.895, 116.40, 39.91)


@functools.cache
def _tiny_crop() -> StreetGraph:
    """The bundled network cropped to :data:`BOX` (loaded once per session)."""
    return street_graph(bbox=BOX)


def test_street_graph_and_bbox_input() -> None:
    graph, bbox = _tiny_crop(), BOX
    full = load_street_graph()
    assert 0 < graph.nodes < full.nodes
    assert bool(np.all((graph.lon > bbox[0]) & (graph.lon < bbox[2]) & (graph.lat > bbox[1]) & (graph.lat < bbox[3])))
    assert street_graph(graph=full, bbox=bbox).nodes == graph.nodes  # a given graph cropped the same way
    for model in (
        build_model("street", 50, graph=graph, seed=1),  # a ready graph
        build_model("street", 50, graph=full, bbox=bbox, seed=1),  # a graph cropped to a box
    ):
        for _ in range(3):
            model.step(5.0)
        lat, lon = model.positions()
        assert lat.size == 50
        assert bool(np.all((lon >= bbox[0]) & (lon <= bbox[2]) & (lat >= bbox[1]) & (lat <= bbox[3])))
    for bad in (
        {"model": "waypoint", "graph": graph},
        {"model": "street", "graph": graph, "osm": Path("x.osm")},
        {"model": "street", "bbox": (116.4, 39.9, 116.3, 39.95)},
        {"model": "street", "bbox": (116.3, 39.9, float("nan"), 39.95)},
        {"model": "street", "profile_broker": "ftp://x"},
    ):
        with pytest.raises(SimulationInputError):
            SimulationConfig(**bad)
    with pytest.raises(SimulationInputError):  # no street inside the box
        build_model("street", 5, bbox=(10.0, 10.0, 10.001, 10.001), seed=1)


async def test_a_run_behind_schedule_skips_steps_instead_of_catching_up(
    tmp_path: Path,
    spy: SpyUpstream,  # noqa: F811
) -> None:
    """A stall of 0.7 s (3.5 steps of 0.2 s) is followed by the step now due, not by a burst of late
    steps: every scheduled step is sent or counted as skipped, and the run ends on time. The users
    drive on a ready street graph, and set their profiles through the HTTP door."""
    graph, bbox = _tiny_crop(), BOX

    class Stalls(NullObserver):
        def __init__(self) -> None:
            self.calls: list[float] = []
            self.inside = True

        def on_positions(self, lat: Any, lon: Any) -> None:
            self.calls.append(time.monotonic())
            self.inside &= bool(np.all((lon >= bbox[0]) & (lon <= bbox[2]) & (lat >= bbox[1]) & (lat <= bbox[3])))
            if len(self.calls) == 3:
                time.sleep(0.7)  # the machine is busy elsewhere

    seen = Stalls()
    async with real_broker(tmp_path, spy.url, "embedded") as (b, url):
        cfg = SimulationConfig(
            users=20, model="street", graph=graph, dt_s=0.2, duration_s=2.0, query_rate_per_min=0.0,
            broker=url, profile_broker=f"http://127.0.0.1:{b.http_port}", seed=2,
        )  # fmt: skip
        t0 = time.monotonic()
        s = await run_simulation(cfg, observer=seen)
        elapsed = time.monotonic() - t0
        text = await settled(b, "mqtt", s.sent)
    assert s.skipped_steps >= 2 and s.steps + s.skipped_steps == 10
    assert s.steps == len(seen.calls) and s.sent == 20 * s.steps == fixes_counted(text, "mqtt")
    gaps = [b - a for a, b in itertools.pairwise(seen.calls)]
    assert min(gaps) > 0.04  # no burst of catch-up steps after the stall
    assert s.duration_s < 2.3 and elapsed < 15
    assert s.profiles_ok == 20 and count(text, "kcloak_profile_sets_total", 'transport="http"') == 20
    assert seen.inside
    assert s.to_json()["skipped_steps"] == s.skipped_steps
