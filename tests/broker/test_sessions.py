"""Continuous sessions through a real broker (contract §6; CONCEPTS §6.5).

The guarantee is checked from the outside: the spy upstream records every forwarded region, and
the independent checker of :mod:`kcloak.cloaking.checks` judges each one against the true positions the
test sent — every present member of the group fixed at the start is strictly inside and at least
k members are present, so the intersection of the session's user sets never drops below k. The
same movements without a session let that intersection shrink below k (query tracking).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiomqtt
import numpy as np
from aiohttp import ClientSession

from kcloak.broker.service import Broker
from kcloak.cloaking.checks import Snapshot, strictly_inside, users_inside
from tests.broker.conftest import SpyUpstream, broker_config

STALE_S = 2.0
K = 5
SESSION_ID = re.compile(r"^[0-9a-f]{32}$")


class Crowd:
    """Users moving in a ~2 km box in Beijing; remembers the true latest fix of each one."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.users = [f"c{i:03d}" for i in range(n)]
        self.fixes: dict[str, tuple[float, float, float]] = {}

    def spot(self) -> tuple[float, float]:
        return 39.9 + float(self.rng.uniform(-0.01, 0.01)), 116.4 + float(self.rng.uniform(-0.01, 0.01))

    async def move(self, http: ClientSession, base: str, users: list[str] | None = None) -> None:
        """Every user in ``users`` (default: all) jumps somewhere new and reports it."""
        items = []
        for u in self.users if users is None else users:
            lat, lon = self.spot()
            t = time.time()
            self.fixes[u] = (lat, lon, t)
            items.append({"user": u, "t": t, "lat": lat, "lon": lon})
        r = await http.post(f"{base}/v1/locations", json={"updates": items})
        assert r.status == 200 and (await r.json())["accepted"] == len(items), await r.text()

    def fix(self, user: str, lat: float = 39.9, lon: float = 116.4) -> dict[str, float]:
        t = time.time()
        self.fixes[user] = (lat, lon, t)
        return {"lat": lat, "lon": lon, "t": t}

    def snapshot(self, now: float) -> Snapshot:
        ids = list(self.fixes)
        return Snapshot.from_arrays(
            ids,
            [self.fixes[u][0] for u in ids],
            [self.fixes[u][1] for u in ids],
            [self.fixes[u][2] for u in ids],
            now=now,
            stale_after_s=STALE_S,
        )


def box_of(request: dict[str, Any]) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    b = request["region"]["bbox"]
    return Decimal(repr(b[0])), Decimal(repr(b[1])), Decimal(repr(b[2])), Decimal(repr(b[3]))


def assert_nothing_links(spy: SpyUpstream, secrets_: list[str]) -> None:
    """The upstream sees fresh pseudonyms and the contract's fields only, never a session or user id."""
    pseudonyms = [r["pseudonym"] for r in spy.requests]
    assert len(set(pseudonyms)) == len(pseudonyms)
    for r in spy.requests:
        assert set(r) <= {"pseudonym", "kind", "region", "n", "radius_m", "category"}
        raw = json.dumps(r)
        assert not any(s in raw for s in secrets_)


def cfg(tmp_path: Path, spy: SpyUpstream, **values: Any) -> Any:
    base = {"cloaking.stale_after_s": STALE_S, "profile.k": K, "profile.max_area_m2": 2.5e9}
    base.update(values)
    return broker_config(tmp_path, spy.url, **base)


async def metrics_text(http: ClientSession, base: str) -> str:
    return await (await http.get(f"{base}/metrics")).text()


def metric(text: str, prefix: str, *needles: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and all(n in line for n in needles)
    )


async def test_session_regions_keep_the_group_while_naive_queries_are_tracked(tmp_path: Path, spy: SpyUpstream) -> None:
    crowd = Crowd(60, seed=11)
    async with Broker(config=cfg(tmp_path, spy)) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        await crowd.move(http, base)
        r = await http.post(
            f"{base}/v1/users/c000/sessions",
            json={"query_id": "s0", "kind": "knn", "n": 3, "profile": {"min_area_m2": 1e6}, **crowd.fix("c000")},
        )
        start = await r.json()
        assert r.status == 200 and start["status"] == "ok", start
        sid = start["session"]["session_id"]
        assert SESSION_ID.match(sid) and start["session"]["state"] == "active"
        assert start["session"]["expires_t"] > time.time()
        snap = crowd.snapshot(time.time())
        box = box_of(spy.requests[-1])
        group = set(users_inside(snap, box))
        assert "c000" in group and len(group) >= K and start["k_achieved"] == len(group)
        session_meet = set(group)
        initial = len(group)
        naive_meet = set(group)
        for step in range(1, 7):
            # At step 3 four members of G and a few others stay silent: they go stale, G shrinks for good.
            others = [u for u in crowd.users if u not in group][:5]
            silent = sorted(group - {"c000"})[:4] + others if step == 3 else []
            if silent:
                await asyncio.sleep(STALE_S + 0.5)
            await crowd.move(http, base, [u for u in crowd.users[1:] if u not in silent])
            body = {"query_id": f"s{step}", **crowd.fix("c000")}
            r = await http.post(f"{base}/v1/users/c000/sessions/{sid}/refresh", json=body)
            answer = await r.json()
            now = time.time()
            if answer["status"] != "ok":  # the group shrank below k: the session ended
                assert answer["reason"] == "k_unreachable" and answer["session"]["state"] == "ended"
                break
            assert set(answer["session"]) == {"session_id", "state", "expires_t"}
            assert answer["session"]["session_id"] == sid and answer["session"]["state"] == "active"
            assert len(answer["results"]) == 3
            snap = crowd.snapshot(now)
            box = box_of(spy.requests[-1])
            assert answer["region"]["bbox"] == spy.requests[-1]["region"]["bbox"]
            group = {u for u in group if u in snap.present_row}
            assert len(group) >= K
            for u in group:  # the observable guarantee, with the true positions
                lat, lon, _ = crowd.fixes[u]
                assert strictly_inside(lat, lon, box), u
            inside = set(users_inside(snap, box))
            assert answer["k_achieved"] == len(inside)
            session_meet &= inside
            assert len(session_meet) >= K
            # The same request without a session, cloaked afresh, as an attacker would link it.
            r = await http.post(f"{base}/v1/users/c000/query", json={"query_id": f"n{step}", "kind": "knn", "n": 3})
            plain = await r.json()
            assert plain["status"] == "ok", plain
            naive_meet &= set(users_inside(crowd.snapshot(time.time()), box_of(spy.requests[-1])))
        else:
            assert len(session_meet) >= K
        assert step == 6 and len(group) == initial - 4
        assert "c000" in naive_meet and len(naive_meet) < K
        assert_nothing_links(spy, [sid, "c000", "s1", "n1"])
        text = await metrics_text(http, base)
    assert metric(text, "kcloak_queries_total", 'kind="knn"', 'status="ok"') >= 2 * (step - 1)


async def test_lifecycle_limits_and_errors_over_http(tmp_path: Path, spy: SpyUpstream) -> None:
    crowd = Crowd(30, seed=5)
    async with Broker(config=cfg(tmp_path, spy, **{"sessions.per_user": 2})) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        await crowd.move(http, base)
        alice = f"{base}/v1/users/c001"

        async def start(qid: str, **extra: Any) -> tuple[int, Any]:
            r = await http.post(f"{alice}/sessions", json={"query_id": qid, "kind": "range", "radius_m": 800, **extra})
            return r.status, await r.json()

        status, s1 = await start("a1", category="cafe")
        assert status == 200 and s1["status"] == "ok"
        sid = s1["session"]["session_id"]
        status, s2 = await start("a2")
        assert status == 200 and s2["status"] == "ok"
        status, err = await start("a3")
        assert status == 429 and err["error"]["code"] == "rate_limited" and err["error"]["query_id"] == "a3"
        # The session object.
        r = await http.get(f"{alice}/sessions/{sid}")
        obj = await r.json()
        assert r.status == 200
        assert obj["session_id"] == sid and obj["state"] == "active" and obj["kind"] == "range"
        assert obj["radius_m"] == 800 and obj["category"] == "cafe" and obj["refreshes"] == 0
        assert obj["last_refresh_t"] is None and obj["expires_t"] > obj["started_t"]
        # Refresh through the query route: equal parameters may be repeated, others are invalid.
        q = f"{alice}/query"
        r = await http.post(q, json={"query_id": "a4", "session_id": sid, "kind": "range", "radius_m": 800})
        ok = await r.json()
        assert ok["status"] == "ok" and ok["session"]["state"] == "active"
        assert all(p["category"] == "cafe" for p in ok["results"])
        assert spy.requests[-1]["category"] == "cafe" and spy.requests[-1]["radius_m"] == 800
        bads: list[dict[str, Any]] = [{"kind": "knn", "n": 2}, {"radius_m": 900}, {"category": "bank"}, {"profile": {}}]
        for i, bad in enumerate(bads):
            r = await http.post(q, json={"query_id": f"bad{i}", "session_id": sid, **bad})
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid", bad
        r = await http.post(f"{alice}/sessions/{sid}/refresh", json={"query_id": "a5", "profile": {"k": 9}})
        assert r.status == 400
        obj = await (await http.get(f"{alice}/sessions/{sid}")).json()
        assert obj["refreshes"] == 1 and obj["last_refresh_t"] is not None
        # Another user's session is unknown to bob; unknown ids everywhere.
        bob = f"{base}/v1/users/c002"
        r = await http.post(f"{bob}/sessions/{sid}/refresh", json={"query_id": "b1"})
        assert r.status == 200 and (await r.json())["reason"] == "unknown_session"
        for method in ("GET", "DELETE"):
            r = await http.request(method, f"{bob}/sessions/{sid}")
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_session"
        r = await http.post(f"{alice}/sessions/{'0' * 32}/refresh", json={"query_id": "a6"})
        assert (await r.json())["reason"] == "unknown_session"
        # Stop by query: ok, no results, nothing sent upstream; then the id is unknown.
        sent = len(spy.requests)
        r = await http.post(q, json={"query_id": "a7", "session_id": sid, "stop": True})
        stopped = await r.json()
        assert stopped["status"] == "ok" and stopped["session"] == {"session_id": sid, "state": "stopped"}
        assert "results" not in stopped and len(spy.requests) == sent
        r = await http.post(f"{alice}/sessions/{sid}/refresh", json={"query_id": "a8"})
        assert (await r.json())["reason"] == "unknown_session"
        # A slot is free again; stop by DELETE.
        status, s3 = await start("a9")
        assert status == 200
        r = await http.delete(f"{alice}/sessions/{s3['session']['session_id']}")
        assert r.status == 204
        r = await http.delete(f"{alice}/sessions/{s3['session']['session_id']}")
        assert r.status == 404
        # A stale querier is refused and keeps its session; a group gone stale ends it.
        sid2 = s2["session"]["session_id"]
        await asyncio.sleep(STALE_S + 0.5)
        r = await http.post(f"{alice}/sessions/{sid2}/refresh", json={"query_id": "a10"})
        stale = await r.json()
        assert stale["reason"] == "stale_position" and stale["session"]["state"] == "active"
        r = await http.post(f"{alice}/sessions/{sid2}/refresh", json={"query_id": "a11", **crowd.fix("c001")})
        ended = await r.json()
        assert ended["reason"] == "k_unreachable" and ended["session"] == {"session_id": sid2, "state": "ended"}
        r = await http.get(f"{alice}/sessions/{sid2}")
        assert r.status == 404
        # Stopping a session answers with kind "stop"; l > 1 cannot be shared.
        status, s4 = await start("a12", profile={"l": 2})
        assert s4["status"] == "refused" and s4["reason"] == "unsupported" and "session" not in s4
        text = await metrics_text(http, base)
        doc = await (await http.get(f"{base}/v1/openapi.json")).json()
    get_session = doc["paths"]["/v1/users/{user}/sessions/{session_id}"]["get"]
    assert "refreshes" in get_session["responses"]["200"]["content"]["application/json"]["schema"]["properties"]
    assert metric(text, "kcloak_queries_total", 'kind="stop"', 'status="ok"') == 1
    assert metric(text, "kcloak_sessions_closed_total", 'state="stopped"') == 2
    assert metric(text, "kcloak_sessions_closed_total", 'state="ended"') == 1
    assert metric(text, "kcloak_sessions_active ") == 0
    assert metric(text, "kcloak_queries_total", 'reason="unknown_session"') == 3
    assert sid not in text and "c001" not in text


async def test_expiry_and_restart_forget_sessions(tmp_path: Path, spy: SpyUpstream) -> None:
    crowd = Crowd(20, seed=8)
    config = cfg(tmp_path, spy, **{"sessions.idle_s": 1.5, "sessions.max_s": 30.0})
    async with Broker(config=config) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        await crowd.move(http, base)
        url = f"{base}/v1/users/c003/sessions"
        first = await (await http.post(url, json={"query_id": "e1", "kind": "knn", "n": 1})).json()
        kept = await (await http.post(url, json={"query_id": "e2", "kind": "knn", "n": 1})).json()
        gone, sid = first["session"]["session_id"], kept["session"]["session_id"]
        for i in range(6):  # refreshing keeps one session alive past idle_s; the other expires
            await asyncio.sleep(0.35)
            await crowd.move(http, base)
            r = await http.post(f"{url}/{sid}/refresh", json={"query_id": f"e3-{i}"})
            assert (await r.json())["status"] == "ok"
        assert (await http.get(f"{url}/{gone}")).status == 404
        assert (await http.get(f"{url}/{sid}")).status == 200
        text = await metrics_text(http, base)
        assert metric(text, "kcloak_sessions_closed_total", 'state="expired"') == 1
        assert metric(text, "kcloak_sessions_active ") == 1
    async with Broker(config=config) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        await crowd.move(http, base)
        r = await http.post(f"{base}/v1/users/c003/sessions/{sid}/refresh", json={"query_id": "e9"})
        answer = await r.json()
        assert answer["status"] == "refused" and answer["reason"] == "unknown_session"


async def test_temporal_refuses_continuous_queries(tmp_path: Path, spy: SpyUpstream) -> None:
    crowd = Crowd(10, seed=2)
    async with Broker(config=cfg(tmp_path, spy, **{"cloaking.algorithm": "temporal"})) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        await crowd.move(http, base)
        r = await http.post(f"{base}/v1/users/c000/sessions", json={"query_id": "t1", "kind": "knn", "n": 1})
        answer = await r.json()
    assert answer["status"] == "refused" and answer["reason"] == "unsupported" and "session" not in answer
    assert spy.requests == []


async def test_clique_holds_the_first_region_as_usual(tmp_path: Path, spy: SpyUpstream) -> None:
    crowd = Crowd(12, seed=9)
    config = cfg(tmp_path, spy, **{"cloaking.algorithm": "clique", "profile.k": 3, "profile.max_area_m2": 1e8})
    async with Broker(config=config) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        await crowd.move(http, base)

        async def start(user: str) -> Any:
            body = {"query_id": "c", "kind": "knn", "n": 1}
            return await (await http.post(f"{base}/v1/users/{user}/sessions", json=body)).json()

        answers = await asyncio.gather(*(start(u) for u in crowd.users[:3]))
        assert all(a["status"] == "ok" and a["session"]["state"] == "active" for a in answers), answers
        assert len({json.dumps(r["region"]) for r in spy.requests}) == 1  # the three share one box
        await crowd.move(http, base)
        sid = answers[0]["session"]["session_id"]
        r = await http.post(f"{base}/v1/users/{crowd.users[0]}/sessions/{sid}/refresh", json={"query_id": "r"})
        refresh = await r.json()
        assert refresh["status"] == "ok" and refresh["algorithm"] == "clique"
        box = box_of(spy.requests[-1])
        snap = crowd.snapshot(time.time())
        assert all(strictly_inside(crowd.fixes[u][0], crowd.fixes[u][1], box) for u in crowd.users[:3])
        assert len(users_inside(snap, box)) >= 3


async def test_mqtt_sessions_share_the_pipeline_and_report_expiry(
    tmp_path: Path, spy: SpyUpstream, mqtt_port: int
) -> None:
    crowd = Crowd(20, seed=4)
    config = cfg(
        tmp_path,
        spy,
        **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}", "sessions.idle_s": 2.0},
    )
    async with (
        Broker(config=config) as b,
        ClientSession() as http,
        aiomqtt.Client("127.0.0.1", mqtt_port) as c,
    ):
        base = f"http://127.0.0.1:{b.http_port}"
        await c.subscribe("kcloak/v1/answer/c005", qos=1)
        await c.subscribe("kcloak/v1/status/c005", qos=1)
        await crowd.move(http, base)

        async def ask(obj: dict[str, Any]) -> dict[str, Any]:
            await c.publish("kcloak/v1/query/c005", json.dumps(obj), qos=1)
            async with asyncio.timeout(5):
                async for m in c.messages:
                    assert isinstance(m.payload, bytes)
                    msg: dict[str, Any] = json.loads(m.payload)
                    if msg.get("query_id") == obj["query_id"]:
                        return msg

            raise AssertionError("no answer")

        start = await ask({"query_id": "m1", "kind": "knn", "n": 2, "continuous": True})
        assert start["status"] == "ok" and start["session"]["state"] == "active"
        sid = start["session"]["session_id"]
        refresh = await ask({"query_id": "m2", "session_id": sid, "kind": "knn", "n": 2, **crowd.fix("c005")})
        assert refresh["status"] == "ok" and len(refresh["results"]) == 2
        bad = await ask({"query_id": "m3", "session_id": sid, "kind": "knn", "n": 3})
        assert bad["reason"] == "invalid" and bad["session"]["state"] == "active"
        # Transport-independent: the MQTT session answers over HTTP too.
        r = await http.post(f"{base}/v1/users/c005/sessions/{sid}/refresh", json={"query_id": "m4"})
        assert (await r.json())["status"] == "ok"
        other = await ask({"query_id": "m5", "kind": "range", "radius_m": 500, "continuous": True})
        stop = await ask({"query_id": "m6", "session_id": other["session"]["session_id"], "stop": True})
        assert stop == {"query_id": "m6", "status": "ok", "session": stop["session"], "t": stop["t"]}
        assert stop["session"]["state"] == "stopped"
        # No refresh for idle_s: expired, and a status message says so.
        async with asyncio.timeout(5):
            async for m in c.messages:
                assert isinstance(m.payload, bytes)
                status = json.loads(m.payload)
                if status.get("kind") == "session":
                    break
        assert status["session_id"] == sid and status["state"] == "expired" and status["t"] > 0
        after = await ask({"query_id": "m7", "session_id": sid})
        assert after["reason"] == "unknown_session"
        text = b.metrics.render().decode()
    assert metric(text, "kcloak_queries_total", 'transport="mqtt"', 'kind="stop"') == 1
    assert metric(text, "kcloak_queries_total", 'transport="mqtt"', 'kind="knn"') == 3  # m1, m2, m3
    assert metric(text, "kcloak_queries_total", 'transport="mqtt"', 'kind="range"') == 1
    assert metric(text, "kcloak_queries_total", 'transport="mqtt"', 'kind="unknown"') == 1  # m7: no session left
    assert metric(text, "kcloak_queries_total", 'transport="http"', 'kind="knn"') == 1  # m4 counts as its session's
    assert metric(text, "kcloak_sessions_closed_total", 'state="expired"') == 1
    assert_nothing_links(spy, [sid, "c005"])
