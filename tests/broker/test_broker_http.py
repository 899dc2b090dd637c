"""The HTTP door: statuses and error bodies of contract §4, input robustness, auth, restart."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientSession

from kcloak.broker.auth import TokenStore
from kcloak.broker.service import Broker
from kcloak.wire.tokens import parse_tokens
from tests.broker.conftest import SpyUpstream, broker_config


def _fix(t: float | None = None, lat: float = 39.9, lon: float = 116.4) -> dict[str, Any]:
    return {"t": time.time() if t is None else t, "lat": lat, "lon": lon}


async def _metric(http: ClientSession, base: str, prefix: str) -> dict[str, float]:
    text = await (await http.get(f"{base}/metrics")).text()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_statuses_and_error_bodies(http_broker: Broker) -> None:
    base = f"http://127.0.0.1:{http_broker.http_port}"
    async with ClientSession() as http:
        r = await http.post(f"{base}/v1/users/alice/location", json=_fix())
        assert r.status == 200 and await r.json() == {"accepted": 1, "rejected": []}
        r = await http.post(f"{base}/v1/users/alice/location", json=_fix(t=time.time() - 3600))
        assert await r.json() == {"accepted": 0, "rejected": [{"index": 0, "code": "too_old"}]}
        cases: list[tuple[str, str, Any, int, str]] = [
            ("POST", "/v1/users/alice/location", {"t": 1, "lat": 91, "lon": 0}, 400, "invalid"),
            ("POST", "/v1/users/alice/location", _fix(t=time.time() + 60), 400, "invalid"),
            ("POST", "/v1/users/bad%20id/location", _fix(), 400, "invalid"),
            ("GET", "/v1/nowhere", None, 404, "not_found"),
            ("DELETE", "/v1/users/alice/location", None, 405, "method_not_allowed"),
            ("POST", "/v1/users/alice/query", {"query_id": "q1", "kind": "knn"}, 400, "invalid"),
        ]
        for method, path, body, status, code in cases:
            r = await http.request(method, base + path, json=body)
            assert r.status == status, (path, await r.text())
            assert (await r.json())["error"]["code"] == code
        r = await http.post(f"{base}/v1/users/alice/location", data="{}", headers={"Content-Type": "text/plain"})
        assert r.status == 415 and (await r.json())["error"]["code"] == "unsupported_media_type"
        r = await http.post(
            f"{base}/v1/users/alice/location",
            data=b'{"t": NaN, "lat": 1, "lon": 1}',
            headers={"Content-Type": "application/json"},
        )
        assert r.status == 400
        big = json.dumps({"t": 1, "lat": 1, "lon": 1, "pad": "x" * 70_000})
        r = await http.post(f"{base}/v1/users/alice/location", data=big, headers={"Content-Type": "application/json"})
        assert r.status == 413 and (await r.json())["error"]["code"] == "too_large"
        r = await http.post(f"{base}/v1/locations", json={"updates": [_fix()] * 10_001})
        assert r.status == 413, await r.text()
        r = await http.post(f"{base}/v1/users/alice/query", json={"query_id": "q2", "kind": "knn", "n": 1})
        body = await r.json()
        assert r.status == 200 and body["status"] == "refused" and body["reason"] == "k_unreachable"
        r = await http.post(f"{base}/v1/users/alice/query", json={"query_id": "q2", "kind": "knn", "n": 1})
        assert r.status == 409 and (await r.json())["error"]["query_id"] == "q2"
        r = await http.post(f"{base}/v1/users/nobody/query", json={"query_id": "q3", "kind": "knn", "n": 1})
        assert (await r.json())["reason"] == "stale_position"
        r = await http.get(f"{base}/v1/info")
        info = await r.json()
        assert info["auth"] == "open" and info["algorithm"] == "hilbert" and info["mqtt"] == "none"
        r = await http.get(f"{base}/v1/openapi.json")
        assert "/v1/users/{user}/query" in (await r.json())["paths"]
        counts = await _metric(http, base, "kcloak_http_requests_total")
        assert any('route="/v1/users/{user}/location"' in k for k in counts)
        assert not any("alice" in k for k in counts)


async def test_batch_items_are_each_counted_once(http_broker: Broker) -> None:
    base = f"http://127.0.0.1:{http_broker.http_port}"
    now = time.time()
    items: list[Any] = [
        {"user": "a", "t": now, "lat": 1, "lon": 1},
        {"user": "a", "t": now - 1, "lat": 1, "lon": 1},  # out of order
        {"user": "b", "t": now, "lat": 100, "lon": 1},  # invalid
        {"t": now, "lat": 1, "lon": 1},  # open mode needs user
        "nonsense",
        {"user": "c", "t": now - 1000, "lat": 1, "lon": 1},  # too old
    ]
    async with ClientSession() as http:
        r = await http.post(f"{base}/v1/locations", json={"updates": items})
        body = await r.json()
        assert body["accepted"] == 1
        assert [(x["index"], x["code"]) for x in body["rejected"]] == [
            (1, "out_of_order"),
            (2, "invalid"),
            (3, "invalid"),
            (4, "invalid"),
            (5, "too_old"),
        ]
        acc = await _metric(http, base, "kcloak_updates_accepted_total")
        rej = await _metric(http, base, "kcloak_updates_rejected_total")
        assert sum(acc.values()) == 1 and sum(rej.values()) == 5


async def test_flood_from_one_user_does_not_affect_others(http_broker: Broker) -> None:
    base = f"http://127.0.0.1:{http_broker.http_port}"
    async with ClientSession() as http:
        t0 = time.time() - 50
        codes = []
        for i in range(260):
            r = await http.post(f"{base}/v1/users/flooder/location", json=_fix(t=t0 + i * 0.01))
            codes.append(r.status)
        assert codes.count(429) > 0 and codes[:200].count(200) == 200
        r = await http.post(f"{base}/v1/users/calm/location", json=_fix())
        assert r.status == 200 and (await r.json())["accepted"] == 1


async def test_profiles_put_get_delete_and_survive_restart(tmp_path: Path, spy: SpyUpstream) -> None:
    cfg = broker_config(tmp_path, spy.url)
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        r = await http.get(f"{base}/v1/users/alice/profile")
        assert (await r.json())["source"] == "default"
        r = await http.put(f"{base}/v1/users/alice/profile", json={"k": 12, "max_area_m2": 2e6})
        body = await r.json()
        assert body["profile"]["k"] == 12 and body["profile"]["l"] == 1 and body["source"] == "stored"
        r = await http.put(f"{base}/v1/users/alice/profile", json={"k": 0})
        assert r.status == 400 and (await r.json())["error"]["field"] == "k"
        r = await http.put(f"{base}/v1/users/bob/profile", json={"k": 3})
        r = await http.delete(f"{base}/v1/users/bob/profile")
        assert r.status == 204
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        body = await (await http.get(f"{base}/v1/users/alice/profile")).json()
        assert body["profile"]["k"] == 12 and body["source"] == "stored" and body["updated_t"] > 0
        body = await (await http.get(f"{base}/v1/users/bob/profile")).json()
        assert body["source"] == "default"
        # the stored profile is enforced: an override below it is refused
        await http.post(f"{base}/v1/users/alice/location", json=_fix())
        r = await http.post(
            f"{base}/v1/users/alice/query", json={"query_id": "q", "kind": "knn", "n": 1, "profile": {"k": 5}}
        )
        assert (await r.json())["reason"] == "looser_than_profile"


async def test_shutdown_answers_every_pending_query(tmp_path: Path, spy: SpyUpstream) -> None:
    """Queries still waiting when the broker stops get exactly one answer each."""
    cfg = broker_config(tmp_path, spy.url, **{"server.shutdown_grace_s": 0.2, "upstream.timeout_s": 5.0})
    spy.fail_next = 0
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        now = time.time()
        ups = [{"user": f"u{i}", "t": now, "lat": 39.9 + i * 1e-4, "lon": 116.4} for i in range(20)]
        await http.post(f"{base}/v1/locations", json={"updates": ups})
        slow = asyncio.Event()

        async def stall(*_: Any) -> Any:
            await slow.wait()

        assert b.pipeline is not None
        b.pipeline.upstream.search = stall  # type: ignore[method-assign,assignment]
        tasks = [
            asyncio.create_task(
                http.post(f"{base}/v1/users/u{i}/query", json={"query_id": f"q{i}", "kind": "knn", "n": 1})
            )
            for i in range(5)
        ]
        await asyncio.sleep(0.3)
        await b.shutdown()
        answers = [await (await t).json() for t in tasks]
    assert [a["error"]["code"] for a in answers] == ["shutdown"] * 5
    assert sorted(a["error"]["query_id"] for a in answers) == [f"q{i}" for i in range(5)]


async def test_tokens_401_403_and_batch_forbidden(tmp_path: Path, spy: SpyUpstream) -> None:
    tokens = TokenStore.from_lines(parse_tokens("alice:tokA\nbob:tokB\n"))
    async with Broker(config=broker_config(tmp_path, spy.url), tokens=tokens) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        r = await http.post(f"{base}/v1/users/alice/location", json=_fix())
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        auth = {"Authorization": "Bearer tokA"}
        r = await http.post(f"{base}/v1/users/alice/location", json=_fix(), headers=auth)
        assert r.status == 200
        r = await http.post(f"{base}/v1/users/bob/location", json=_fix(), headers=auth)
        assert r.status == 403 and (await r.json())["error"]["code"] == "forbidden"
        r = await http.post(f"{base}/v1/locations", json={"updates": [dict(_fix(), user="bob")]}, headers=auth)
        assert r.status == 403
        r = await http.post(f"{base}/v1/locations", json={"updates": [_fix(t=time.time() + 1)]}, headers=auth)
        assert (await r.json())["accepted"] == 1
        assert (await http.get(f"{base}/v1/info")).status == 200
        assert (await http.get(f"{base}/healthz")).status == 200
