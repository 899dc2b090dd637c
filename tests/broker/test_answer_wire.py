"""What clients see of an answer, byte for byte: members, their order and the JSON text of both doors.

Answers are one typed value (:class:`kcloak.wire.answers.Answer`) turned into JSON in one place;
these tests pin the member order clients have always received (contract §3 "Answer", §6) on the
raw HTTP body, and the compact JSON of the MQTT door.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiomqtt
from aiohttp import ClientSession

from kcloak.broker.service import Broker
from kcloak.core.profile import ReasonCode
from kcloak.wire.answers import Answer, AnsweredRegion, PoiResult, SessionBrief
from tests.broker.conftest import SpyUpstream, broker_config

OK_KEYS = ["query_id", "status", "algorithm", "k_achieved", "area_m2", "region"]
RESULT_KEYS = ["poi_id", "lat", "lon", "category", "name", "distance_m"]
REFUSED_KEYS = ["query_id", "status", "reason", "message", "t"]
STALE_S = 3.0


def _pairs(raw: bytes) -> list[tuple[str, Any]]:
    """The top-level members of a JSON object in the order they were sent."""
    out: list[tuple[str, Any]] = json.loads(raw, object_pairs_hook=lambda pairs: pairs)
    return out


def keys(raw: bytes) -> list[str]:
    return [k for k, _ in _pairs(raw)]


def member(raw: bytes, name: str) -> Any:
    return dict(_pairs(raw))[name]


def assert_default_json(raw: bytes) -> None:
    """The HTTP body is ``json.dumps`` with its default separators, as aiohttp writes it."""
    obj = json.loads(raw)
    assert raw.decode() == json.dumps(obj)


async def test_http_answers_keep_their_member_order(tmp_path: Path, spy: SpyUpstream) -> None:
    values = {"profile.k": 3, "profile.max_area_m2": 2.5e9, "cloaking.stale_after_s": STALE_S}
    cfg = broker_config(tmp_path, spy.url, **values)
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        now = time.time()
        ups = [{"user": f"w{i}", "t": now, "lat": 39.9 + i * 1e-3, "lon": 116.4 + i * 1e-3} for i in range(12)]
        assert (await http.post(f"{base}/v1/locations", json={"updates": ups})).status == 200
        alice = f"{base}/v1/users/w1"

        async def post(path: str, body: dict[str, Any], who: str = alice) -> bytes:
            r = await http.post(f"{who}{path}", json=body)
            assert r.status == 200, await r.text()
            raw = await r.read()
            assert_default_json(raw)
            return raw

        knn = await post("/query", {"query_id": "k1", "kind": "knn", "n": 3})
        assert keys(knn) == [*OK_KEYS, "results", "t"]
        assert [k for k, _ in member(knn, "region")] == ["bbox"]
        results = member(knn, "results")
        assert len(results) == 3 and all([k for k, _ in r] == RESULT_KEYS for r in results)

        rng = await post("/query", {"query_id": "r1", "kind": "range", "radius_m": 2000})
        assert keys(rng) == [*OK_KEYS, "results", "truncated", "t"]

        stale = await post("/query", {"query_id": "s1", "kind": "knn", "n": 1}, f"{base}/v1/users/w99")
        assert keys(stale) == REFUSED_KEYS and member(stale, "reason") == "stale_position"

        start = await post("/sessions", {"query_id": "c1", "kind": "knn", "n": 2})
        assert keys(start) == [*OK_KEYS, "results", "t", "session"]
        session = member(start, "session")
        assert [k for k, _ in session] == ["session_id", "state", "expires_t"]
        sid = dict(session)["session_id"]

        refresh = await post(f"/sessions/{sid}/refresh", {"query_id": "c2"})
        assert keys(refresh) == [*OK_KEYS, "results", "t", "session"]

        await asyncio.sleep(STALE_S + 0.2)  # the querier's fix is no longer present: refused, session kept
        stale_refresh = await post(f"/sessions/{sid}/refresh", {"query_id": "c3"})
        assert keys(stale_refresh) == [*REFUSED_KEYS, "session"]
        assert member(stale_refresh, "reason") == "stale_position"

        stop = await post("/query", {"query_id": "c4", "session_id": sid, "stop": True})
        assert keys(stop) == ["query_id", "status", "session", "t"]
        assert [k for k, _ in member(stop, "session")] == ["session_id", "state"]


async def test_mqtt_answer_is_the_same_object_in_compact_json(tmp_path: Path, spy: SpyUpstream, mqtt_port: int) -> None:
    cfg = broker_config(
        tmp_path,
        spy.url,
        **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}", "profile.k": 3},
    )
    async with Broker(config=cfg) as b, ClientSession() as http:
        base = f"http://127.0.0.1:{b.http_port}"
        now = time.time()
        ups = [{"user": f"m{i}", "t": now, "lat": 39.9 + i * 1e-3, "lon": 116.4 + i * 1e-3} for i in range(8)]
        assert (await http.post(f"{base}/v1/locations", json={"updates": ups})).status == 200
        async with aiomqtt.Client("127.0.0.1", mqtt_port, identifier="wire-m1") as c:
            await c.subscribe("kcloak/v1/answer/m1", qos=1)
            body = {"query_id": "q1", "kind": "knn", "n": 2}
            await c.publish("kcloak/v1/query/m1", json.dumps(body), qos=1)
            async with asyncio.timeout(10):
                async for msg in c.messages:
                    raw = bytes(msg.payload)
                    break
    obj = json.loads(raw)
    assert raw.decode() == json.dumps(obj, separators=(",", ":"))
    assert keys(raw) == [*OK_KEYS, "results", "t"]


def test_the_optional_members_take_their_place() -> None:
    """``l_achieved`` (E.l > 1) after the region, a temporal region's interval inside it."""
    answer = Answer(
        query_id="q",
        status="ok",
        t=1714550412.31,
        algorithm="privacygrid",
        k_achieved=12,
        area_m2=812345.2,
        region=AnsweredRegion((116.391204, 39.903381, 116.402877, 39.913012), 1714550100, 1714550160),
        l_achieved=3,
        results=(PoiResult("n1", 39.90912, 116.39803, "restaurant", "Quanjude", 72.4),),
        truncated=False,
    )
    text = json.dumps(answer.to_json())
    assert text == (
        '{"query_id": "q", "status": "ok", "algorithm": "privacygrid", "k_achieved": 12, "area_m2": 812345.2, '
        '"region": {"bbox": [116.391204, 39.903381, 116.402877, 39.913012], "t_start": 1714550100, '
        '"t_end": 1714550160}, "l_achieved": 3, "results": [{"poi_id": "n1", "lat": 39.90912, "lon": 116.39803, '
        '"category": "restaurant", "name": "Quanjude", "distance_m": 72.4}], "truncated": false, '
        '"t": 1714550412.31}'
    )
    refused = Answer.refused("q", ReasonCode.AREA_EXCEEDED, "no region", 1.5).with_session(SessionBrief("s", "ended"))
    assert json.dumps(refused.to_json(), separators=(",", ":")) == (
        '{"query_id":"q","status":"refused","reason":"area_exceeded","message":"no region","t":1.5,'
        '"session":{"session_id":"s","state":"ended"}}'
    )
