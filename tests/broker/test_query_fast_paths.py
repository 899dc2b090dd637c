"""The query path's fast paths give what the paths before them gave.

- pseudonyms drawn from a buffer of ``os.urandom`` bytes: 32 hex characters, never twice, not
  even across a fork (the child must not hand out what its parent still holds);
- answers and status messages written by msgspec (:func:`kcloak.broker.mqtt.encode_message`):
  the bytes ``json.dumps(…, separators=(",", ":"))`` wrote, for answers of every shape;
- the embedded MQTT door publishing from the query's own task: exactly one answer per admitted
  query, duplicates dropped, over a real MQTT client;
- query-log rows gathered per loop turn and committed late: every forwarded query has its row
  once the broker has stopped, or once the background writes are awaited in the same turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import random
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiomqtt
from aiohttp import ClientSession

from kcloak.broker.forwarding import Background, Forwarder, Timing
from kcloak.broker.metrics import Metrics
from kcloak.broker.mqtt import encode_message
from kcloak.broker.service import Broker
from kcloak.broker.stores import QueryLog
from kcloak.broker.upstream import UpstreamClient, new_pseudonym
from kcloak.cloaking.cloakers import Region
from kcloak.core.geometry import BBox
from kcloak.core.profile import PrivacyProfile, ReasonCode
from kcloak.wire.answers import Answer, AnsweredRegion, PoiResult, SessionBrief
from kcloak.wire.payloads import parse_query
from tests.broker.conftest import SpyUpstream, broker_config

PSEUDONYM_RE = re.compile(r"[0-9a-f]{32}")


def test_pseudonyms_are_128_bit_hex_and_never_repeat() -> None:
    drawn = [new_pseudonym() for _ in range(20_000)]  # many refills of the buffer
    assert all(PSEUDONYM_RE.fullmatch(p) for p in drawn)
    assert len(set(drawn)) == len(drawn)
    # 20,000 × 128 random bits: every hex digit about equally often (a stuck or reused byte would not be)
    counts = [sum(p.count(d) for p in drawn) for d in "0123456789abcdef"]
    assert max(counts) / min(counts) < 1.05


def _draw_in_child(out: Any) -> None:
    out.put([new_pseudonym() for _ in range(200)])


def test_a_forked_child_draws_other_pseudonyms_than_its_parent() -> None:
    new_pseudonym()  # the parent now holds a buffer of unused random bytes
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_draw_in_child, args=(out,))
    child.start()
    theirs = out.get(timeout=30)
    child.join(30)
    ours = [new_pseudonym() for _ in range(200)]
    assert not set(theirs) & set(ours)


def _answers(rnd: random.Random) -> list[Answer]:
    """Answers of every shape, with the numbers real answers carry."""
    names = ["Quanjude", "place 7", "Café de Flore", "北京烤鸭店", 'say "hi"\\ \t', ""]
    out: list[Answer] = []
    for i in range(300):
        results = tuple(
            PoiResult(
                f"n{j}",
                round(39.9 + rnd.uniform(-0.2, 0.2), 6),
                round(116.4 + rnd.uniform(-0.2, 0.2), rnd.randint(3, 7)),
                rnd.choice(["cafe", "restaurant", "bank"]),
                rnd.choice(names),
                round(rnd.uniform(0, 5000) ** rnd.choice([1, 0.5]), 3),
            )
            for j in range(rnd.randint(0, 5))
        )
        t = time.time() + rnd.uniform(-1e4, 1e4)
        bbox = tuple(sorted([116.4 + rnd.uniform(-0.1, 0.1) for _ in range(2)])) + tuple(
            sorted([39.9 + rnd.uniform(-0.1, 0.1) for _ in range(2)])
        )
        temporal = i % 3 == 0
        region = AnsweredRegion(
            (bbox[0], bbox[2], bbox[1], bbox[3]),
            1714550100 if temporal else None,
            1714550160 if temporal else None,
        )
        out.append(
            Answer(
                query_id=f"q-{i}",
                status="ok",
                t=t,
                algorithm=rnd.choice(["hilbert", "privacygrid", "casper"]),
                k_achieved=rnd.randint(1, 500),
                area_m2=rnd.uniform(1, 1e9),
                region=region,
                l_achieved=rnd.choice([None, 2, 3]),
                results=results,
                truncated=rnd.choice([None, False, True]),
                session=SessionBrief("s" * 32, "active", t + 60) if i % 7 == 0 else None,
            )
        )
        out.append(Answer.refused(f"r-{i}", rnd.choice(list(ReasonCode)), "a message: été", t))
        out.append(Answer.stopped(f"s-{i}", SessionBrief("s" * 32, "stopped"), t))
    return out


def test_published_answers_are_the_bytes_json_dumps_wrote() -> None:
    for answer in _answers(random.Random(3)):
        obj = answer.to_json()
        assert encode_message(obj) == json.dumps(obj, separators=(",", ":")).encode(), obj


def test_status_messages_are_the_bytes_json_dumps_wrote() -> None:
    for obj in (
        {"state": "up", "version": "1.2.3", "algorithm": "hilbert", "auth": "open", "t": time.time()},
        {"kind": "profile", "request_id": "r1", "status": "ok", "profile": {"k": 5, "l": 1, "min_area_m2": 0.0}},
        {"kind": "session", "session_id": "s" * 32, "state": "expired", "reason": "idle", "t": 1714550412.0},
        {"state": "down", "t": None},
    ):
        assert encode_message(obj) == json.dumps(obj, separators=(",", ":")).encode()


async def test_embedded_door_answers_each_admitted_query_once(tmp_path: Path, spy: SpyUpstream, mqtt_port: int) -> None:
    """Valid, invalid and duplicate queries over a real MQTT client: one answer per query id that
    was not a duplicate, the reason codes of the contract, and one query-log row per forwarded query."""
    cfg = broker_config(
        tmp_path,
        spy.url,
        **{"mqtt.mode": "embedded", "mqtt.listen": f"127.0.0.1:{mqtt_port}", "profile.k": 3},
    )
    users = [f"fp{i}" for i in range(6)]
    sent: dict[str, str] = {}  # query id → what its answer must be
    async with Broker(config=cfg) as b, ClientSession() as http:
        now = time.time()
        ups = [{"user": u, "t": now, "lat": 39.9 + i * 1e-3, "lon": 116.4 + i * 1e-3} for i, u in enumerate(users)]
        assert (await http.post(f"http://127.0.0.1:{b.http_port}/v1/locations", json={"updates": ups})).status == 200
        got: list[dict[str, Any]] = []
        async with aiomqtt.Client("127.0.0.1", mqtt_port, identifier="fast-path") as c:
            await c.subscribe([(f"kcloak/v1/answer/{u}", 1) for u in users])
            for i in range(60):
                user = users[i % len(users)]
                qid = f"q{i}"
                if i % 10 == 3:
                    body: dict[str, Any] = {"query_id": qid, "kind": "knn", "n": 0}
                    sent[qid] = "invalid"
                else:
                    body = {"query_id": qid, "kind": "knn", "n": 2}
                    sent[qid] = "ok"
                await c.publish(f"kcloak/v1/query/{user}", json.dumps(body), qos=1)
                if i % 10 == 5:  # the same query again: dropped, never a second answer
                    await c.publish(f"kcloak/v1/query/{user}", json.dumps(body), qos=1)
            async with asyncio.timeout(20):
                async for msg in c.messages:
                    got.append(json.loads(bytes(msg.payload)))
                    if len(got) == len(sent):
                        break
            with contextlib.suppress(TimeoutError):  # nothing more may come
                async with asyncio.timeout(1.0):
                    async for msg in c.messages:
                        got.append(json.loads(bytes(msg.payload)))
    ids = [a["query_id"] for a in got]
    assert sorted(ids) == sorted(sent), "exactly one answer per admitted query"
    for a in got:
        if sent[a["query_id"]] == "ok":
            assert a["status"] == "ok" and len(a["results"]) == 2, a
        else:
            assert (a["status"], a["reason"]) == ("refused", "invalid"), a
    forwarded = sum(1 for v in sent.values() if v == "ok")
    assert len(spy.requests) == forwarded
    with sqlite3.connect(tmp_path / "data" / "querylog.sqlite3") as conn:
        rows = conn.execute("SELECT kind, outcome FROM forwarded").fetchall()
    assert rows == [("knn", "ok")] * forwarded


async def test_rows_of_the_last_turn_are_written_when_the_background_is_awaited(
    tmp_path: Path, spy: SpyUpstream
) -> None:
    """A part that stops right after its last answer (``Background.wait`` in the same loop turn)
    still gets that query's row written: the rows gathered for the turn are handed over first."""
    metrics = Metrics(version="test", algorithm="hilbert")
    querylog = QueryLog(tmp_path / "querylog.sqlite3")
    background = Background()
    region = Region(BBox(116_390_000, 39_900_000, 116_410_000, 39_920_000), 7, 3.9e6, "hilbert")
    async with UpstreamClient(url=spy.url, metrics=metrics) as upstream:
        forwarder = Forwarder(
            algorithm="hilbert",
            queue_capacity=8,
            metrics=metrics,
            upstream=upstream,
            querylog=querylog,
            background=background,
        )
        q = parse_query({"query_id": "last-1", "kind": "knn", "n": 2})
        answer = await forwarder.forward(q, PrivacyProfile(k=5), region, 39.91, 116.40, Timing())
        await background.wait(5.0)  # no loop turn in between
    await asyncio.to_thread(querylog.close)
    assert answer.status == "ok" and len(spy.requests) == 1
    with sqlite3.connect(tmp_path / "querylog.sqlite3") as conn:
        rows = conn.execute("SELECT kind, outcome, min_lon, max_lat, k_achieved FROM forwarded").fetchall()
    assert rows == [("knn", "ok", 116.39, 39.92, 7)]
