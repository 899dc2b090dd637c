"""A user publishes a retained fix and a retained query on his own topics: nobody who connects
afterwards may receive them.

Attack/defect: the embedded broker (amqtt) stored retained input and replayed it on connect to
every subscription with no ACL check, so another user with her own token, a published-windows
reader, or an anonymous client on ``foo/bar`` / ``#`` in open mode received alice's exact position
and query. Contract §3: retained input is dropped (counter ``retained``).
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tests.conformance.conftest import Served, Servers, metric

FIX = {"t": 0.0, "lat": 39.912345, "lon": 116.412345}
MARKERS = (b"39.912345", b"secret-query-7")


class Client:
    """A paho client whose every received message, SUBACK and PUBACK lands in a queue."""

    def __init__(self, port: int, client_id: str, user: str | None = None, token: str | None = None) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.messages: list[paho.MQTTMessage] = []
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311)
        if user is not None:
            self.c.username_pw_set(user, token)
        self.c.on_connect = lambda _c, _u, _f, rc, _p: self.events.put(("connect", rc.value))
        self.c.on_subscribe = lambda _c, _u, _m, rcs, _p: self.events.put(("suback", [r.value for r in rcs]))
        self.c.on_publish = lambda _c, _u, mid, _rc, _p: self.events.put(("puback", mid))
        self.c.on_message = lambda _c, _u, m: self.messages.append(m)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        assert self.wait("connect") == 0

    def wait(self, kind: str, timeout: float = 10.0) -> Any:
        while True:
            got, value = self.events.get(timeout=timeout)
            if got == kind:
                return value

    def publish_retained(self, topic: str, payload: bytes) -> None:
        info = self.c.publish(topic, payload, qos=1, retain=True)
        assert self.wait("puback") == info.mid  # the broker took it

    def subscribe(self, *filters: str) -> list[int]:
        self.c.subscribe([(f, 1) for f in filters])
        codes: list[int] = self.wait("suback")
        return codes

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _leak(messages: list[paho.MQTTMessage]) -> list[str]:
    return [m.topic for m in messages if any(mark in m.payload for mark in MARKERS)]


def _alice_publishes_retained(port: int, token: str | None) -> None:
    alice = Client(port, "alice-phone", "alice" if token else None, token)
    fix = dict(FIX, t=time.time())
    alice.publish_retained("kcloak/v1/update/alice", json.dumps(fix).encode())
    query = {"query_id": "secret-query-7", "kind": "knn", "n": 3}
    alice.publish_retained("kcloak/v1/query/alice", json.dumps(query).encode())
    if token is None:
        alice.publish_retained("foo/bar", b'{"copy": "39.912345"}')
    alice.close()


def _retained_drops(served: Served) -> float:
    return metric(served.metrics(), "kcloak_messages_dropped_total", reason="retained")


def test_with_tokens_neither_another_user_nor_a_published_reader_receives_it(servers: Servers, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:tok-alice\nbob:tok-bob\ncarol:tok-carol\n")
    config = tmp_path / "kcloak.toml"
    config.write_text('[auth]\npublished_readers = ["carol"]\n')
    served = servers.serve("--tokens", str(tokens), "--config", str(config))
    assert served.mqtt_port is not None
    _alice_publishes_retained(served.mqtt_port, "tok-alice")
    bob = Client(served.mqtt_port, "bob-phone", "bob", "tok-bob")
    carol = Client(served.mqtt_port, "carol-reader", "carol", "tok-carol")
    try:
        bob_codes = bob.subscribe(
            "kcloak/v1/answer/bob", "kcloak/v1/status/bob", "kcloak/v1/broker/status", "kcloak/v1/update/alice", "#"
        )
        carol_codes = carol.subscribe("kcloak/v1/published/#", "kcloak/v1/broker/status")
        time.sleep(1.0)
    finally:
        bob.close()
        carol.close()
    assert bob_codes[:3] == [1, 1, 1] and carol_codes == [1, 1]
    assert _leak(bob.messages) == [] and _leak(carol.messages) == []
    assert [m.topic for m in bob.messages] == ["kcloak/v1/broker/status"]  # kcloak's own status only
    assert _retained_drops(served) >= 2


def test_in_open_mode_an_anonymous_subscriber_receives_nothing(servers: Servers) -> None:
    served = servers.serve()
    assert served.mqtt_port is not None
    _alice_publishes_retained(served.mqtt_port, None)
    received: list[paho.MQTTMessage] = []
    clients = []
    for i, filters in enumerate((["foo/bar"], ["#"], ["kcloak/v1/answer/+", "kcloak/v1/status/+"])):
        c = Client(served.mqtt_port, f"anon-{i}")
        c.subscribe(*filters)
        clients.append(c)
    time.sleep(1.0)
    for c in clients:
        c.close()
        received += c.messages
    assert _leak(received) == [], "retained input replayed to another client"
    assert _retained_drops(served) >= 2
