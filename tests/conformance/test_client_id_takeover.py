"""Bob connects with alice's MQTT client id and clean session off, hoping to take over her session.

Attack/defect: the embedded broker (amqtt) keyed sessions by client id alone, so bob received
alice's session, her queued answers, and kicked her off. Now a client id in use by another user
(connected or a stored session) is refused with CONNACK 0x02 (identifier rejected); alice stays
connected, and her persistent session keeps the answers queued while she is offline.
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

IDENTIFIER_REJECTED = 2  # MQTT 3.1.1 CONNACK return code; paho reports it as 133 (v5 numbering)


class Phone:
    def __init__(self, port: int, client_id: str, user: str, token: str, *, clean: bool) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.c = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean, protocol=paho.MQTTv311
        )
        self.c.username_pw_set(user, token)
        self.c.on_connect = lambda _c, _u, flags, rc, _p: self.events.put(("connect", (rc, flags.session_present)))
        self.c.on_disconnect = lambda _c, _u, _f, rc, _p: self.events.put(("disconnect", rc))
        self.c.on_subscribe = lambda _c, _u, _m, rcs, _p: self.events.put(("suback", [r.value for r in rcs]))
        self.c.on_message = lambda _c, _u, m: self.events.put(("message", (m.topic, json.loads(m.payload))))
        self.c.on_publish = lambda _c, _u, mid, _rc, _p: self.events.put(("puback", mid))
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def wait(self, kind: str, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got, value = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if got == kind:
                return value

    def query(self, user: str, query_id: str) -> None:
        info = self.c.publish(
            f"kcloak/v1/query/{user}", json.dumps({"query_id": query_id, "kind": "knn", "n": 1}), qos=1
        )
        assert self.wait("puback") == info.mid

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_another_users_client_id_is_refused_and_alices_session_is_intact(servers: Servers, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:tok-alice\nbob:tok-bob\n")
    served = servers.serve("--tokens", str(tokens))
    port = served.mqtt_port
    assert port is not None

    alice = Phone(port, "alice-phone", "alice", "tok-alice", clean=False)
    rc, _ = alice.wait("connect")
    assert not rc.is_failure
    alice.c.subscribe("kcloak/v1/answer/alice", qos=1)
    assert alice.wait("suback") == [1]

    # 1. While alice is connected: bob is refused and alice is not kicked off.
    bob = Phone(port, "alice-phone", "bob", "tok-bob", clean=False)
    rc, _ = bob.wait("connect")
    bob.close()
    assert rc.is_failure and str(rc) == "Client identifier not valid", str(rc)
    alice.query("alice", "q-online")
    topic, answer = alice.wait("message")
    assert topic == "kcloak/v1/answer/alice" and answer["query_id"] == "q-online"
    assert alice.c.is_connected()

    # 2. While alice is offline, an answer is queued in her session; bob still cannot take it.
    alice.close()
    other = Phone(port, "alice-tablet", "alice", "tok-alice", clean=True)
    other.wait("connect")
    other.query("alice", "q-offline")
    other.close()
    time.sleep(0.5)  # the answer is produced while alice-phone is offline
    for clean in (False, True):
        bob = Phone(port, "alice-phone", "bob", "tok-bob", clean=clean)
        rc, _ = bob.wait("connect")
        bob.close()
        assert rc.is_failure and str(rc) == "Client identifier not valid", str(rc)
        got = [v for k, v in list(bob.events.queue) if k == "message"]
        assert got == []

    alice = Phone(port, "alice-phone", "alice", "tok-alice", clean=False)
    rc, session_present = alice.wait("connect")
    assert not rc.is_failure and session_present
    topic, answer = alice.wait("message")
    alice.close()
    assert topic == "kcloak/v1/answer/alice" and answer["query_id"] == "q-offline"
    assert metric(served.metrics(), "kcloak_mqtt_connects_refused_total", reason="identifier_rejected") == 3
