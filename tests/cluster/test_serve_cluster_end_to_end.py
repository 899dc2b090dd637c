"""End to end through whole cluster nodes: two ``kcloak serve --cluster`` processes (gateway and worker each)
on the 3-node NATS cluster, two cells, a real ``kcloak lbs``; apps speak MQTT (paho) and HTTP to either node
exactly as to a single ``kcloak serve``. A user's fixes sent through one node serve his query through the
other; each query id gets exactly one answer; each ``ok`` region holds at least k of the users the test
itself placed (its own count, float64 from the JSON, nothing of kcloak's)."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from kcloak.cloaking.cells import CellMap
from tests.cluster.conftest import NatsCluster
from tests.cluster.gateway_fixtures import Gateway, start_gateway
from tests.cluster.worker_fixtures import lbs_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.cluster

USERS = 80
K = 5  # the shipped default profile's k
LAT0, LON0 = 39.9087, 116.3975
CONTRACT_REASONS = {"k_unreachable", "area_exceeded", "stale_position"}


def placed(seed: int) -> dict[str, tuple[float, float]]:
    """Users on a 5-decimal grid in two clumps (so both cells of a balanced map hold some), with duplicates."""
    rng = random.Random(seed)
    out: dict[str, tuple[float, float]] = {}
    for i in range(USERS):
        lat0, lon0 = (LAT0, LON0) if i % 2 else (LAT0 + 0.02, LON0 + 0.03)
        out[f"app{i}.m"] = (round(lat0 + rng.uniform(-0.004, 0.004), 5), round(lon0 + rng.uniform(-0.004, 0.004), 5))
    out["app1.m"] = out["app3.m"]  # two users on one spot
    return out


def inside_or_on(bbox: list[float], positions: dict[str, tuple[float, float]]) -> int:
    min_lon, min_lat, max_lon, max_lat = (float(v) for v in bbox)
    return sum(1 for lat, lon in positions.values() if min_lat <= lat <= max_lat and min_lon <= lon <= max_lon)


class MqttApp:
    """One paho connection per user (as phones do), subscribed to its answer topic before it queries."""

    def __init__(self, gateway: Gateway, user: str) -> None:
        self.user = user
        self.answers: list[dict[str, Any]] = []
        self.subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"phone-{user}", protocol=paho.MQTTv311)
        self.client.on_message = lambda _c, _u, msg: self.answers.append(json.loads(msg.payload))
        self.client.on_subscribe = lambda *_a: self.subscribed.set()
        self.client.connect("127.0.0.1", gateway.mqtt_port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe(f"kcloak/v1/answer/{user}", qos=1)
        assert self.subscribed.wait(10)

    def send(self, kind: str, body: dict[str, Any]) -> None:
        info = self.client.publish(f"kcloak/v1/{kind}/{self.user}", json.dumps(body), qos=1)
        info.wait_for_publish(timeout=30)
        assert info.is_published(), "the gateway did not PUBACK"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def http(gateway: Gateway, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        gateway.url(path), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def counter_total(metrics: str, name: str) -> float:
    """Every sample of ``name`` in a Prometheus text page, summed (read as a scraper reads it)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_nodes_answer_each_query_once_with_k_users_of_the_tests_own_count(
    nats_cluster: NatsCluster,
    tmp_path: Path,
    lbs_url: str,  # noqa: F811
) -> None:
    positions = placed(7)
    lat = np.array([p[0] for p in positions.values()])
    lon = np.array([p[1] for p in positions.values()])
    cells_file = tmp_path / "cells.json"
    cells_file.write_text(CellMap.balanced(lat, lon, cells=2).to_json())
    common = ("--cells", str(cells_file), "--upstream", lbs_url)  # the shipped default profile: k = 5
    nodes = [start_gateway(nats_cluster, tmp_path, *common, gateway_only=False) for _ in range(2)]
    apps: list[MqttApp] = []
    try:
        users = list(positions)
        t = time.time()
        apps = [MqttApp(nodes[i % 2], user) for i, user in enumerate(users)]
        for app in apps:  # every fix PUBACKed by the node the app is connected to
            la, lo = positions[app.user]
            app.send("update", {"t": t, "lat": la, "lon": lo})
        time.sleep(2.0)  # the fixes reach the owners (a query carrying no position uses the latest one)

        queriers = apps[:16]
        for app in queriers:
            app.send("query", {"query_id": f"q-{app.user}", "kind": "knn", "n": 3})
        # over HTTP, through the OTHER node than the one that took the user's fixes
        http_results = [
            http(
                nodes[(i + 1) % 2], f"/v1/users/{users[i]}/query", {"query_id": f"h-{users[i]}", "kind": "knn", "n": 2}
            )
            for i in range(16, 24)
        ]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(not app.answers for app in queriers):
            time.sleep(0.1)
        time.sleep(1.5)  # long enough for a second answer to show up, if one were sent

        answers = [a for app in queriers for a in app.answers] + [body for _status, body in http_results]
        assert [s for s, _ in http_results] == [200] * len(http_results)
        for app in queriers:
            assert [a["query_id"] for a in app.answers] == [f"q-{app.user}"], "exactly one answer per query id"
        ok = [a for a in answers if a["status"] == "ok"]
        assert len(ok) >= len(answers) // 2, [a.get("reason") for a in answers]
        for a in answers:
            if a["status"] != "ok":
                assert a["reason"] in CONTRACT_REASONS
                continue
            bbox = a["region"]["bbox"]
            assert inside_or_on(bbox, positions) >= K  # the test's own count of the users it placed
            assert a["k_achieved"] >= K
        # each query counted once in kcloak_queries_total (by the node whose door answered it), and once among the
        # queries the workers decided, under the workers' own name
        texts = [get_text(node.url("/metrics")) for node in nodes]
        assert sum(counter_total(t, "kcloak_queries_total") for t in texts) == len(answers)
        assert sum(counter_total(t, "kcloak_cluster_worker_queries_total") for t in texts) == len(answers)
        # the same query id again over HTTP, through either node: the contract's duplicate
        status, body = http(
            nodes[0], f"/v1/users/{users[16]}/query", {"query_id": f"h-{users[16]}", "kind": "knn", "n": 2}
        )
        assert status == 409 and body["error"]["code"] == "duplicate"
    finally:
        for app in apps:
            app.close()
        for node in nodes:
            node.stop()
