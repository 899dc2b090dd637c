"""An attacker with a valid token sends hostile payloads on his own topics; a bystander must not
notice.

Defect: a JSON integer with 5,000 digits, or a 1.2 MB payload, killed kcloak's intake connection
to the amqtt child, so other users' fixes and queries in flight were lost. Now each bad message is
dropped and counted (``malformed_json``/``invalid``, ``too_large``), the attacker's connection stays
up, and every fix and query of the bystander is handled.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tests.conformance.conftest import Servers, metric


class App:
    def __init__(self, port: int, user: str, token: str) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.kept: list[tuple[str, Any]] = []
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"{user}-app", protocol=paho.MQTTv311)
        self.c.username_pw_set(user, token)
        self.c.on_connect = lambda _c, _u, _f, rc, _p: self.events.put(("connect", rc.value))
        self.c.on_subscribe = lambda _c, _u, _m, rcs, _p: self.events.put(("suback", [r.value for r in rcs]))
        self.c.on_publish = lambda _c, _u, mid, _rc, _p: self.events.put(("puback", mid))
        self.c.on_message = lambda _c, _u, m: self.events.put(("message", json.loads(m.payload)))
        self.c.max_inflight_messages_set(100)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        assert self.wait("connect") == 0

    def wait(self, kind: str, timeout: float = 15.0) -> Any:
        """The next event of ``kind``; events of other kinds read meanwhile are kept for their own
        wait (an answer may come before the PUBACK of a later fix)."""
        for i, (got, value) in enumerate(self.kept):
            if got == kind:
                del self.kept[i]
                return value
        deadline = time.monotonic() + timeout
        while True:
            got, value = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if got == kind:
                return value
            self.kept.append((got, value))

    def publish_all(self, messages: list[tuple[str, bytes]]) -> None:
        """Publish at QoS 1 back to back; returns once every one was acknowledged."""
        mids = {self.c.publish(topic, payload, qos=1).mid for topic, payload in messages}
        while mids:
            mids.discard(self.wait("puback"))

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_huge_integer_and_oversize_payload_do_not_cost_a_bystander_anything(servers: Servers, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("mallory:tok-m\nalice:tok-a\n")
    served = servers.serve("--tokens", str(tokens))
    assert served.mqtt_port is not None
    mallory = App(served.mqtt_port, "mallory", "tok-m")
    alice = App(served.mqtt_port, "alice", "tok-a")
    alice.c.subscribe("kcloak/v1/answer/alice", qos=1)
    assert alice.wait("suback") == [1]
    try:
        huge_int = b'{"t": ' + b"7" * 5000 + b', "lat": 39.9, "lon": 116.4}'
        oversize = b'{"updates": [' + b" " * 1_200_000 + b"]}"
        mallory.publish_all([("kcloak/v1/update/mallory", huge_int), ("kcloak/v1/updates/mallory", oversize)])
        # Right behind the attack, the bystander's fixes and queries, interleaved.
        now = time.time()
        messages: list[tuple[str, bytes]] = []
        for i in range(20):
            fix = {"t": now + i * 0.01, "lat": 39.9 + i * 1e-4, "lon": 116.4}
            messages.append(("kcloak/v1/update/alice", json.dumps(fix).encode()))
            if i % 5 == 4:
                messages.append(
                    ("kcloak/v1/query/alice", json.dumps({"query_id": f"q{i}", "kind": "knn", "n": 1}).encode())
                )
        alice.publish_all(messages)
        answers = {alice.wait("message")["query_id"] for _ in range(4)}
        assert answers == {"q4", "q9", "q14", "q19"}
        # The attacker is still connected and served.
        assert mallory.c.is_connected()
        fix = {"t": time.time(), "lat": 39.91, "lon": 116.41}
        mallory.publish_all([("kcloak/v1/update/mallory", json.dumps(fix).encode())])
    finally:
        mallory.close()
        alice.close()
    text = served.metrics_once("kcloak_updates_accepted_total", 21)
    assert metric(text, "kcloak_updates_accepted_total") == 21  # alice's 20 and mallory's last one
    bad_json = metric(text, "kcloak_messages_dropped_total", reason="malformed_json") + metric(
        text, "kcloak_messages_dropped_total", reason="invalid"
    )
    assert bad_json >= 1 or metric(text, "kcloak_updates_rejected_total", reason="invalid") >= 1
    assert metric(text, "kcloak_messages_dropped_total", topic="updates", reason="too_large") == 1
