"""End-to-end privacy of the broker: what reaches the provider, and what the app gets back.

A spy upstream records every forwarded request. The test knows every true position, so it
checks from the outside (exact decimal arithmetic, no broker code) that each forwarded region
holds at least k present users including the querier, that no user id, exact coordinate pair
or reused pseudonym ever reaches the provider, and that each answer equals the answer computed
on the exact position over the full POI set.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from aiohttp import ClientSession

from kcloak.broker.service import Broker
from tests.broker.conftest import SpyUpstream, broker_config

R = 6_371_008.8


def haversine(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    a = math.sin((p2 - p1) / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(math.radians(lon2 - lon1) / 2) ** 2
    return 2 * R * math.asin(math.sqrt(a))


def users_strictly_inside(bbox: list[float], positions: dict[str, tuple[float, float]]) -> set[str]:
    lo_lon, lo_lat, hi_lon, hi_lat = (Decimal(repr(v)) for v in bbox)
    return {
        u for u, (lat, lon) in positions.items() if lo_lon < Decimal(lon) < hi_lon and lo_lat < Decimal(lat) < hi_lat
    }


def exact_answer(query: dict[str, Any], lat: float, lon: float, pois: list[dict[str, Any]]) -> list[str]:
    cat = query.get("category")
    scored = sorted(
        (round(haversine(lat, lon, p["lat"], p["lon"]), 3), p["poi_id"])
        for p in pois
        if cat is None or p["category"] == cat
    )
    if query["kind"] == "range":
        return [pid for d, pid in scored if d <= query["radius_m"]][:1000]
    return [pid for _, pid in scored[: query["n"]]]


def population(n: int, seed: int) -> dict[str, tuple[float, float]]:
    rnd = random.Random(seed)
    return {
        f"user-{i:04d}": (round(39.9 + rnd.gauss(0, 0.01), 7), round(116.4 + rnd.gauss(0, 0.012), 7)) for i in range(n)
    }


def random_query(rnd: random.Random, i: int) -> dict[str, Any]:
    q: dict[str, Any] = {"query_id": f"q-{i}"}
    if rnd.random() < 0.5:
        q.update(kind="range", radius_m=rnd.choice([300, 800, 2000]))
    else:
        q.update(kind="knn", n=rnd.choice([1, 3, 5]))
    if rnd.random() < 0.6:
        q["category"] = rnd.choice(["cafe", "restaurant", "bank"])
    if rnd.random() < 0.3:
        q["profile"] = {"k": rnd.choice([5, 8])}
    return q


def check_forwarded(
    spy: SpyUpstream,
    sent: list[tuple[str, dict[str, Any], dict[str, Any]]],
    positions: dict[str, tuple[float, float]],
) -> None:
    ok = [(u, q, a) for u, q, a in sent if a["status"] == "ok"]
    assert len(spy.requests) == len(ok) > 0
    pseudonyms = [r["pseudonym"] for r in spy.requests]
    assert len(set(pseudonyms)) == len(pseudonyms)
    pairs = {(lat, lon) for lat, lon in positions.values()}
    for req, headers, (user, query, answer) in zip(spy.requests, spy.headers, ok, strict=True):
        assert re.fullmatch(r"[0-9a-f]{32}", req["pseudonym"])
        allowed = {"pseudonym", "kind", "region", "radius_m" if query["kind"] == "range" else "n"}
        if "category" in query:
            allowed.add("category")
        assert set(req) == allowed
        assert set(req["region"]) == {"bbox"}
        text = json.dumps(req)
        assert not any(u in text for u in positions)
        b = req["region"]["bbox"]
        corners = {(b[1], b[0]), (b[1], b[2]), (b[3], b[0]), (b[3], b[2])}
        assert not corners & pairs
        assert "Cookie" not in headers and headers["User-Agent"].startswith("kcloak/")
        bbox = req["region"]["bbox"]
        assert answer["region"]["bbox"] == bbox
        inside = users_strictly_inside(bbox, positions)
        k = query.get("profile", {}).get("k", 5)
        assert user in inside
        assert len(inside) >= k
        assert answer["k_achieved"] == len(inside)
        lat, lon = positions[user]
        assert [r["poi_id"] for r in answer["results"]] == exact_answer(query, lat, lon, spy.pois)


@pytest.mark.parametrize("algorithm", ["hilbert", "nn"])
async def test_http_end_to_end_privacy(tmp_path: Path, spy: SpyUpstream, algorithm: str) -> None:
    positions = population(400, seed=3)
    rnd = random.Random(11)
    cfg = broker_config(tmp_path, spy.url, **{"cloaking.algorithm": algorithm})
    sent: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        now = time.time()
        updates = [{"user": u, "t": now, "lat": lat, "lon": lon} for u, (lat, lon) in positions.items()]
        r = await http.post(f"{base}/v1/locations", json={"updates": updates})
        assert (await r.json()) == {"accepted": 400, "rejected": []}
        for i in range(40):
            user = rnd.choice(list(positions))
            query = random_query(rnd, i)
            r = await http.post(f"{base}/v1/users/{user}/query", json=query)
            assert r.status == 200
            sent.append((user, query, await r.json()))
    check_forwarded(spy, sent, positions)


async def test_mqtt_end_to_end_privacy(tmp_path: Path, spy: SpyUpstream, mqtt_port: int) -> None:
    positions = population(300, seed=5)
    rnd = random.Random(12)
    cfg = broker_config(tmp_path, spy.url, **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}"})
    sent: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    async with Broker(config=cfg), aiomqtt.Client("127.0.0.1", mqtt_port) as client:
        await client.subscribe("kcloak/v1/answer/+", qos=1)
        now = time.time()
        for u, (lat, lon) in positions.items():
            await client.publish(f"kcloak/v1/update/{u}", json.dumps({"t": now, "lat": lat, "lon": lon}), qos=1)
        await _settle(cfg.storage.data_dir, len(positions))
        messages = client.messages
        for i in range(20):
            user = rnd.choice(list(positions))
            query = random_query(rnd, i)
            await client.publish(f"kcloak/v1/query/{user}", json.dumps(query), qos=1)
            message = await anext(aiter(messages))
            assert message.topic.value == f"kcloak/v1/answer/{user}"
            assert isinstance(message.payload, bytes)
            sent.append((user, query, json.loads(message.payload)))
    check_forwarded(spy, sent, positions)


async def _settle(data_dir: str, n: int) -> None:
    """Wait until ``n`` fixes are durably stored (QoS 1 publishes are acknowledged before that)."""
    import asyncio
    import sqlite3

    for _ in range(100):
        conn = sqlite3.connect(Path(data_dir) / "movement.sqlite3")
        count = conn.execute("SELECT COUNT(*) FROM fixes").fetchone()[0]
        conn.close()
        if count >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("fixes were not stored in time")


async def test_clique_holds_until_a_clique_forms_or_expires(tmp_path: Path, spy: SpyUpstream) -> None:
    """CliqueCloak in the broker: k nearby askers are released together with one shared region;
    a lone asker is refused ``expired`` after its max_delay_s."""
    import asyncio

    cfg = broker_config(tmp_path, spy.url, **{"cloaking.algorithm": "clique"})
    positions = {f"c{i}": (39.9 + i * 0.0003, 116.4 + i * 0.0002) for i in range(5)}
    positions["far"] = (39.0, 117.5)
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        now = time.time()
        ups = [{"user": u, "t": now, "lat": la, "lon": lo} for u, (la, lo) in positions.items()]
        await http.post(f"{base}/v1/locations", json={"updates": ups})

        async def ask(user: str, i: int, delay: float) -> dict[str, Any]:
            q = {"query_id": f"q{i}", "kind": "knn", "n": 1, "profile": {"max_delay_s": delay}}
            r = await http.post(f"{base}/v1/users/{user}/query", json=q)
            out: dict[str, Any] = await r.json()
            return out

        answers = await asyncio.gather(*(ask(f"c{i}", i, 5.0) for i in range(5)), ask("far", 9, 0.5))
    *group, lone = answers
    assert [a["status"] for a in group] == ["ok"] * 5, group
    assert len({tuple(a["region"]["bbox"]) for a in group}) == 1
    assert all(a["k_achieved"] >= 5 for a in group)
    assert lone["status"] == "refused" and lone["reason"] == "expired"
    assert len(spy.requests) == 5


async def test_temporal_holds_until_k_users_visited_the_cell(tmp_path: Path, spy: SpyUpstream) -> None:
    """Temporal cloaking in the broker: the query waits until k distinct users had a fix in its
    cell, is forwarded with an integer [t_start, t_end] around the querier's fix, or expires."""
    import asyncio

    cfg = broker_config(tmp_path, spy.url, **{"cloaking.algorithm": "temporal", "profile.k": 3})
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        t0 = time.time()
        await http.post(f"{base}/v1/users/q/location", json={"t": t0, "lat": 39.9, "lon": 116.4})

        async def visitors() -> None:
            await asyncio.sleep(0.6)
            for i, user in enumerate(("v1", "v2")):
                fix = {"t": time.time(), "lat": 39.9 + 1e-4 * (i + 1), "lon": 116.4}
                await http.post(f"{base}/v1/users/{user}/location", json=fix)

        query = {"query_id": "t1", "kind": "range", "radius_m": 500, "profile": {"max_delay_s": 10}}
        r, _ = await asyncio.gather(http.post(f"{base}/v1/users/q/query", json=query), visitors())
        answer = await r.json()
        lone = {"query_id": "t2", "kind": "knn", "n": 1, "profile": {"max_delay_s": 1.0}}
        await http.post(f"{base}/v1/users/far/location", json={"t": time.time(), "lat": 10.0, "lon": 10.0})
        r2 = await http.post(f"{base}/v1/users/far/query", json=lone)
        expired = await r2.json()
    assert answer["status"] == "ok", answer
    region = answer["region"]
    assert set(region) == {"bbox", "t_start", "t_end"}
    assert region["t_start"] <= t0 <= region["t_end"] and answer["k_achieved"] >= 3
    assert isinstance(region["t_start"], int) and isinstance(region["t_end"], int)
    assert region["t_start"] >= t0 - 300
    assert spy.requests[-1]["region"] == region
    assert expired["status"] == "refused" and expired["reason"] == "expired"


@pytest.mark.parametrize("algorithm", ["hilbert", "casper"])
async def test_concurrent_queries_are_micro_batched_and_stay_private(
    tmp_path: Path, spy: SpyUpstream, algorithm: str
) -> None:
    """Many queries at once go through the vectorized batch path; every answer keeps its guarantees."""
    import asyncio

    positions = population(600, seed=8)
    cfg = broker_config(tmp_path, spy.url, **{"cloaking.algorithm": algorithm})
    users = list(positions)[:120]
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        now = time.time()
        ups = [{"user": u, "t": now, "lat": la, "lon": lo} for u, (la, lo) in positions.items()]
        await http.post(f"{base}/v1/locations", json={"updates": ups})
        assert b.pipeline is not None
        cloaker = b.pipeline.cloaker
        assert cloaker is not None
        batches: list[int] = []
        plain_batch = cloaker.cloak_batch

        def counting_batch(view: Any, rows: Any, profiles: Any) -> Any:
            batches.append(len(rows))
            return plain_batch(view, rows, profiles)

        setattr(cloaker, "cloak_batch", counting_batch)  # noqa: B010 - spy on the real method

        async def ask(user: str) -> dict[str, Any]:
            r = await http.post(f"{base}/v1/users/{user}/query", json={"query_id": "c", "kind": "knn", "n": 2})
            out: dict[str, Any] = await r.json()
            return out

        answers = await asyncio.gather(*(ask(u) for u in users))
        text = b.metrics.render().decode()
    ok = [(u, a) for u, a in zip(users, answers, strict=True) if a["status"] == "ok"]
    assert len(ok) > 100
    assert sorted(tuple(r["region"]["bbox"]) for r in spy.requests) == sorted(tuple(a["region"]["bbox"]) for _, a in ok)
    for user, answer in ok:
        inside = users_strictly_inside(answer["region"]["bbox"], positions)
        assert user in inside and len(inside) >= 5 and answer["k_achieved"] == len(inside)
        lat, lon = positions[user]
        assert [r["poi_id"] for r in answer["results"]] == exact_answer({"kind": "knn", "n": 2}, lat, lon, spy.pois)
    assert "kcloak_cloak_seconds_count" in text
    assert batches and max(batches) >= 16  # the vectorized path served part of the load


async def test_answers_through_the_real_lbs_equal_the_exact_answer(tmp_path: Path) -> None:
    """Broker + ``kcloak lbs`` on the bundled Beijing POIs: the inclusive candidate set filtered at
    the exact position gives exactly the answer computed over all POIs."""
    from kcloak.broker.lbs_server import LbsServer
    from kcloak.core.places import load_pois

    poiset = load_pois(None)
    pois = [
        {"poi_id": p.poi_id, "lat": p.lat, "lon": p.lon, "category": p.category, "name": p.name} for p in poiset.pois
    ]
    rnd = random.Random(21)
    positions = {
        f"z{i:03d}": (round(40.003 + rnd.gauss(0, 0.004), 7), round(116.351 + rnd.gauss(0, 0.005), 7))
        for i in range(300)
    }
    async with LbsServer(poiset, port=0) as lbs:
        cfg = broker_config(tmp_path, lbs.url)
        async with Broker(config=cfg) as b, ClientSession() as http:
            base = f"http://127.0.0.1:{b.http_port}"
            now = time.time()
            ups = [{"user": u, "t": now, "lat": la, "lon": lo} for u, (la, lo) in positions.items()]
            await http.post(f"{base}/v1/locations", json={"updates": ups})
            checked = 0
            for i in range(40):
                user = rnd.choice(list(positions))
                query = random_query(rnd, i)
                query.pop("profile", None)
                if rnd.random() < 0.5:
                    query["category"] = rnd.choice(["restaurant", "cafe", "fast_food", "bank"])
                r = await http.post(f"{base}/v1/users/{user}/query", json=query)
                answer = await r.json()
                if answer["status"] != "ok":
                    continue
                lat, lon = positions[user]
                assert [x["poi_id"] for x in answer["results"]] == exact_answer(query, lat, lon, pois)
                checked += 1
    assert checked >= 30
