"""A phone publishes a fix and then a query on one MQTT connection: the query must see the fix.

Attack/defect: the query overtook the fix inside the broker and was refused ``stale_position``.
Driven with a real paho client (QoS 1, no wait between the two publishes) and with
``mosquitto_pub`` runs back to back.
"""

from __future__ import annotations

import json
import queue
import subprocess
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tests.conformance.conftest import Servers, http_json

CENTRE = (39.9087, 116.3975)


def _crowd(base: str, n: int = 12) -> None:
    """Present users around the centre, so that k = 5 can be met."""
    now = time.time()
    updates = [
        {
            "user": f"crowd{i:02d}",
            "t": now,
            "lat": round(CENTRE[0] + (i % 4) * 0.0007, 6),
            "lon": round(CENTRE[1] + (i // 4) * 0.0009, 6),
        }
        for i in range(n)
    ]
    status, _, body = http_json("POST", base + "/v1/locations", {"updates": updates})
    assert status == 200 and body["accepted"] == n, body


def test_fix_then_query_on_one_paho_connection(servers: Servers) -> None:
    served = servers.serve(upstream=servers.lbs())
    _crowd(served.url(""))
    answers: queue.Queue[dict[str, object]] = queue.Queue()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="phone-1", protocol=paho.MQTTv311)
    client.on_message = lambda _c, _u, msg: answers.put(json.loads(msg.payload))
    assert served.mqtt_port is not None
    client.connect("127.0.0.1", served.mqtt_port)
    client.loop_start()
    try:
        users = [f"phone{i:02d}" for i in range(12)]
        subs = [client.subscribe(f"kcloak/v1/answer/{u}", qos=1) for u in users]
        assert all(rc == paho.MQTT_ERR_SUCCESS for rc, _ in subs)
        time.sleep(0.5)
        for i, user in enumerate(users):
            fix = {"t": time.time(), "lat": CENTRE[0] + 0.0003, "lon": CENTRE[1] + 0.0004 + i * 1e-5}
            client.publish(f"kcloak/v1/update/{user}", json.dumps(fix), qos=1)
            query = {"query_id": f"q{i}", "kind": "knn", "n": 3}
            client.publish(f"kcloak/v1/query/{user}", json.dumps(query), qos=1)
        got = [answers.get(timeout=20) for _ in users]
    finally:
        client.loop_stop()
        client.disconnect()
    reasons = [a.get("reason", a["status"]) for a in got]
    assert "stale_position" not in reasons, reasons
    assert reasons.count("ok") == len(users), reasons


def test_batch_then_query_on_one_paho_connection(servers: Servers) -> None:
    """The same with the fix in a batch message (``kcloak/v1/updates/{user}``), and queries alone in
    between: a query must not overtake a batch read in the same loop turn either."""
    served = servers.serve(upstream=servers.lbs())
    _crowd(served.url(""))
    answers: queue.Queue[dict[str, object]] = queue.Queue()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="phone-2", protocol=paho.MQTTv311)
    client.on_message = lambda _c, _u, msg: answers.put(json.loads(msg.payload))
    assert served.mqtt_port is not None
    client.connect("127.0.0.1", served.mqtt_port)
    client.loop_start()
    try:
        users = [f"batch{i:02d}" for i in range(12)]
        subs = [client.subscribe(f"kcloak/v1/answer/{u}", qos=1) for u in users]
        assert all(rc == paho.MQTT_ERR_SUCCESS for rc, _ in subs)
        time.sleep(0.5)
        for i, user in enumerate(users):
            fix = {"t": time.time(), "lat": CENTRE[0] + 0.0003, "lon": CENTRE[1] + 0.0004 + i * 1e-5}
            client.publish(f"kcloak/v1/updates/{user}", json.dumps({"updates": [fix]}), qos=1)
            query = {"query_id": f"b{i}", "kind": "knn", "n": 3}
            client.publish(f"kcloak/v1/query/{user}", json.dumps(query), qos=1)
        got = [answers.get(timeout=20) for _ in users]
    finally:
        client.loop_stop()
        client.disconnect()
    reasons = [a.get("reason", a["status"]) for a in got]
    assert reasons.count("ok") == len(users), reasons


def test_fix_then_query_with_mosquitto_pub_back_to_back(servers: Servers) -> None:
    served = servers.serve(upstream=servers.lbs())
    _crowd(served.url(""))
    assert served.mqtt_port is not None
    port = str(served.mqtt_port)
    user = "phone-mp"
    sub = subprocess.Popen(
        ["mosquitto_sub", "-p", port, "-t", f"kcloak/v1/answer/{user}", "-q", "1", "-C", "5", "-W", "30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    for i in range(5):
        fix = {"t": time.time(), "lat": CENTRE[0] + 0.0002, "lon": CENTRE[1] + 0.0001 * (i + 1)}
        subprocess.run(
            ["mosquitto_pub", "-p", port, "-q", "1", "-t", f"kcloak/v1/update/{user}", "-m", json.dumps(fix)],
            check=True,
            timeout=10,
        )
        query = {"query_id": f"mp{i}", "kind": "knn", "n": 2}
        subprocess.run(
            ["mosquitto_pub", "-p", port, "-q", "1", "-t", f"kcloak/v1/query/{user}", "-m", json.dumps(query)],
            check=True,
            timeout=10,
        )
    out, _ = sub.communicate(timeout=40)
    got = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [a.get("reason", a["status"]) for a in got] == ["ok"] * 5
