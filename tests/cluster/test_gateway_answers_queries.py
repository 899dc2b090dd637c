"""Queries through the gateway: a protocol test of the gateway alone (docs/cluster.md "Gateway").

The test plays the worker: it reads the query the gateway published to ``KCLOAK_IN`` and stores the
query's one answer in ``KCLOAK_ANSWERS`` (message id ``<token>/<qkey>``), as a cell owner does. The app
gets exactly that answer over MQTT and over HTTP; the same query id through another gateway is a
``duplicate`` (HTTP 409, MQTT dropped and counted), found in the answers stream; a query nobody answers
is refused ``overloaded`` once the contract's wait has passed.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import nats
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.cluster.conftest import NatsCluster
from tests.cluster.gateway_fixtures import Gateway, gateway, play_worker_for_query, start_gateway

pytestmark = pytest.mark.cluster
__all__ = ["gateway"]


def http_json(method: str, url: str, body: object | None = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def an_answer(query_id: str) -> dict[str, Any]:
    return {
        "query_id": query_id,
        "status": "ok",
        "algorithm": "hilbert",
        "k_achieved": 7,
        "area_m2": 123456.0,
        "region": {"bbox": [39.9, 116.3, 40.0, 116.4]},
        "results": [],
        "t": 1795600000.5,
    }


class App:
    """One MQTT app on a gateway, subscribed to its answer topic before it queries."""

    def __init__(self, gw: Gateway, user: str, client_id: str) -> None:
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311)
        subscribed = queue.Queue[int]()
        self.client.on_message = lambda _c, _u, msg: self.answers.put(json.loads(msg.payload))
        self.client.on_subscribe = lambda *_a: subscribed.put(1)
        self.client.connect("127.0.0.1", gw.mqtt_port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe(f"kcloak/v1/answer/{user}", qos=1)
        subscribed.get(timeout=10)
        self.user = user

    def query(self, body: dict[str, Any]) -> None:
        info = self.client.publish(f"kcloak/v1/query/{self.user}", json.dumps(body), qos=1)
        info.wait_for_publish(timeout=10)
        assert info.is_published()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def dropped(gw: Gateway, reason: str) -> float:
    prefix = "kcloak_messages_dropped_total{"
    return sum(
        float(line.rpartition(" ")[2])
        for line in gw.metrics().splitlines()
        if line.startswith(prefix) and 'topic="query"' in line and f'reason="{reason}"' in line
    )


async def worker_answers(cluster: NatsCluster, user: str, query_id: str, *, reply: bool = True) -> dict[str, str]:
    nc = await nats.connect(servers=cluster.urls)
    try:
        return await play_worker_for_query(nc, user, query_id, an_answer(query_id), reply=reply)
    finally:
        await nc.close()


def test_http_query_gets_the_stored_answer_and_a_repeat_elsewhere_is_a_duplicate(
    nats_cluster: NatsCluster, gateway: Gateway, tmp_path: Path
) -> None:
    user, qid = "alice.b", "q-1.a"
    body = {"query_id": qid, "kind": "knn", "n": 3}

    async def scenario() -> tuple[tuple[int, Any], dict[str, str]]:
        request = asyncio.create_task(
            asyncio.to_thread(http_json, "POST", gateway.url(f"/v1/users/{user}/query"), body)
        )
        headers = await worker_answers(nats_cluster, user, qid)
        return await request, headers

    (status, got), headers = asyncio.run(scenario())
    assert status == 200 and got == an_answer(qid)
    assert headers["Kcloak-Transport"] == "http"
    assert http_json("POST", gateway.url(f"/v1/users/{user}/query"), body)[0] == 409  # this gateway's window
    other = start_gateway(nats_cluster, tmp_path)
    try:
        status, err = http_json("POST", other.url(f"/v1/users/{user}/query"), body)
        assert status == 409 and err["error"] == {
            "code": "duplicate",
            "message": "query_id: already used",
            "query_id": qid,
        }
    finally:
        other.stop()


def test_mqtt_query_gets_the_stored_answer_once_and_a_repeat_elsewhere_is_dropped(
    nats_cluster: NatsCluster, gateway: Gateway, tmp_path: Path
) -> None:
    user, qid = "bob", "q:7"
    app = App(gateway, user, "bob-1")
    try:
        app.query({"query_id": qid, "kind": "knn", "n": 1})
        headers = asyncio.run(worker_answers(nats_cluster, user, qid))
        assert headers["Kcloak-Transport"] == "mqtt"
        assert app.answers.get(timeout=20) == an_answer(qid)
    finally:
        app.close()
    other = start_gateway(nats_cluster, tmp_path)
    again = App(other, user, "bob-2")
    try:
        again.query({"query_id": qid, "kind": "knn", "n": 1})
        deadline = time.monotonic() + 10
        while dropped(other, "duplicate") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dropped(other, "duplicate") == 1
        with pytest.raises(queue.Empty):
            again.answers.get(timeout=1.0)  # nothing more for a query id already answered
    finally:
        again.close()
        other.stop()


def test_a_query_nobody_answers_is_refused_overloaded_after_the_contract_wait(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    config = tmp_path / "quick.toml"
    config.write_text("[profile]\nmax_delay_s = 0.0\n[upstream]\ndeadline_s = 1.0\n", encoding="utf-8")
    gw = start_gateway(nats_cluster, tmp_path, "--config", str(config))
    app = App(gw, "carol", "carol-1")
    try:
        started = time.monotonic()
        status, err = http_json("POST", gw.url("/v1/users/carol/query"), {"query_id": "q1", "kind": "knn", "n": 1})
        assert status == 503 and err["error"]["code"] == "overloaded" and err["error"]["query_id"] == "q1"
        assert time.monotonic() - started < 10
        app.query({"query_id": "q2", "kind": "knn", "n": 1})
        answer = app.answers.get(timeout=15)
        assert (answer["query_id"], answer["status"], answer["reason"]) == ("q2", "refused", "overloaded")
        with pytest.raises(queue.Empty):
            app.answers.get(timeout=1.0)
    finally:
        app.close()
        gw.stop()


async def play_router(
    cluster: NatsCluster, replies: dict[str, list[str | None]], timeout_s: float = 20.0, kind: str = "updates"
) -> None:
    """Answer the ``Kcloak-Reply`` of each user's latest ``kind`` message with that user's codes."""
    from kcloak.broker.cluster.topology import IN_STREAM, in_subject, partition_of, subject_token
    from tests.cluster.gateway_fixtures import PARTITIONS

    nc = await nats.connect(servers=cluster.urls)
    try:
        js = nc.jetstream(timeout=5.0)
        for user, codes in replies.items():
            token = subject_token(user)
            subject = in_subject(partition_of(token, PARTITIONS), kind, token)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    msg = await js.get_msg(IN_STREAM, subject=subject)
                    break
                except nats.js.errors.NotFoundError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
            body = json.loads(msg.data or b"{}")
            fixes = body["updates"] if kind == "updates" else [body]
            assert len(fixes) == len(codes) and all(set(f) == {"lat", "lon", "t"} for f in fixes)
            assert (msg.headers or {})["Kcloak-Transport"] == "http"
            await nc.publish((msg.headers or {})["Kcloak-Reply"], json.dumps({"codes": codes}).encode())
    finally:
        await nc.close()


def test_an_http_batch_of_two_users_gets_each_routers_outcome_in_item_order(
    nats_cluster: NatsCluster, gateway: Gateway
) -> None:
    t = time.time()
    updates = [
        {"user": "ann", "lat": 39.9, "lon": 116.4, "t": t},
        {"user": "ben.c", "lat": 39.9, "lon": 116.4, "t": t},
        {"user": "ann", "lat": 39.9, "lon": 116.4, "t": t + 1},
        {"user": "ann", "lat": 999, "lon": 116.4, "t": t + 2},  # invalid at the door: never published
        {"user": "ben.c", "lat": 39.9, "lon": 116.4, "t": t - 5},
    ]

    async def scenario() -> tuple[int, Any]:
        request = asyncio.create_task(
            asyncio.to_thread(http_json, "POST", gateway.url("/v1/locations"), {"updates": updates})
        )
        await play_router(nats_cluster, {"ann": [None, "out_of_order"], "ben.c": [None, "too_old"]})
        return await request

    status, body = asyncio.run(scenario())
    assert status == 200
    assert body == {
        "accepted": 2,
        "rejected": [
            {"index": 2, "code": "out_of_order"},
            {"index": 3, "code": "invalid"},
            {"index": 4, "code": "too_old"},
        ],
    }


def test_single_http_fixes_get_the_routers_outcome(nats_cluster: NatsCluster, gateway: Gateway) -> None:
    """``POST /v1/users/{user}/location`` on a gateway (the HTTP door's fast path): each fix is
    published to its partition and answered with the router's code for it."""
    t = time.time()

    async def scenario() -> list[tuple[int, Any]]:
        requests = [
            asyncio.create_task(asyncio.to_thread(http_json, "POST", gateway.url(f"/v1/users/{user}/location"), fix))
            for user, fix in (
                ("ann", {"lat": 39.9, "lon": 116.4, "t": t}),
                ("ben.c", {"lat": 39.9, "lon": 116.4, "t": t}),
            )
        ]
        await play_router(nats_cluster, {"ann": [None], "ben.c": ["out_of_order"]}, kind="update")
        return [await r for r in requests]

    (ann_status, ann), (ben_status, ben) = asyncio.run(scenario())
    assert (ann_status, ann) == (200, {"accepted": 1, "rejected": []})
    assert (ben_status, ben) == (200, {"accepted": 0, "rejected": [{"index": 0, "code": "out_of_order"}]})


def test_a_stored_answer_whose_reply_was_missed_is_read_from_the_stream_after_the_contract_wait(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    """The worker stores the answer but its core-NATS reply never comes (say the gateway's connection blinked):
    the gateway still returns exactly that stored answer, read from ``KCLOAK_ANSWERS`` once its wait is over."""
    config = tmp_path / "quick.toml"
    config.write_text("[profile]\nmax_delay_s = 0.0\n[upstream]\ndeadline_s = 1.0\n", encoding="utf-8")
    gw = start_gateway(nats_cluster, tmp_path, "--config", str(config))
    user, qid = "dave", "q-missed"

    async def scenario() -> tuple[tuple[int, Any], dict[str, str]]:
        body = {"query_id": qid, "kind": "knn", "n": 1}
        request = asyncio.create_task(asyncio.to_thread(http_json, "POST", gw.url(f"/v1/users/{user}/query"), body))
        headers = await worker_answers(nats_cluster, user, qid, reply=False)
        return await request, headers

    try:
        (status, answer), headers = asyncio.run(scenario())
        assert headers["Kcloak-Reply"]  # the query named the inbox the answer should have come to
        assert (status, answer) == (200, an_answer(qid))
    finally:
        gw.stop()
