"""Apps stream QoS 1 fixes (or single-fix HTTP POSTs); kcloak is killed with ``kill -9`` mid-stream:
every fix whose PUBACK (or ``200 {"accepted": 1}``) an app received must be in the movement store
after a restart.

Defect: the amqtt child acknowledged a publish as soon as it had read it, before kcloak had even
received it, so ``kill -9`` under a 2,000/s stream lost hundreds to tens of thousands of
acknowledged fixes. Contract §1/§9: a fix is accepted when it is in the movement store's WAL, and
"0 accepted updates lost". The store is read with sqlite3 as an outsider.
"""

from __future__ import annotations

import http.client
import json
import sqlite3
import threading
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tests.conformance.conftest import Served, Servers

CLIENTS = 4
USERS_PER_CLIENT = 25
RATE_PER_CLIENT = 150.0  # fixes/s; each user sends 6/s, well under the per-user rate limit (20/s)
KILL_AFTER_S = 2.0


class Stream(threading.Thread):
    """One app connection publishing fixes of its users at QoS 1, remembering what was PUBACKed."""

    def __init__(self, port: int, n: int) -> None:
        super().__init__(daemon=True)
        self.users = [f"s{n}u{i:02d}" for i in range(USERS_PER_CLIENT)]
        self.sent: dict[int, tuple[str, float]] = {}
        self.acked_mids: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"stream-{n}", protocol=paho.MQTTv311)
        self.client.max_inflight_messages_set(200)
        self.client.on_publish = self._on_publish
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_publish(self, _c: paho.Client, _u: object, mid: int, _rc: object, _p: object) -> None:
        # paho calls this holding its outgoing-message lock, which publish() takes too: never wait
        # here for a lock held around publish() (that deadlocked the stream and hung the test).
        with self.lock:
            self.acked_mids.add(mid)

    def run(self) -> None:
        last: dict[str, float] = {}
        start = time.monotonic()
        i = 0
        while not self.stop.is_set():
            delay = start + i / RATE_PER_CLIENT - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            user = self.users[i % len(self.users)]
            t = round(max(time.time(), last.get(user, 0.0) + 0.001), 3)
            last[user] = t
            payload = json.dumps({"t": t, "lat": 39.9 + (i % 100) * 1e-4, "lon": 116.4})
            info = self.client.publish(f"kcloak/v1/update/{user}", payload, qos=1)
            if info.rc != paho.MQTT_ERR_SUCCESS:
                break
            with self.lock:
                self.sent[info.mid] = (user, t)
            i += 1

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=5)
        self.client.loop_stop()

    @property
    def acked(self) -> set[tuple[str, float]]:
        """The fixes whose PUBACK arrived (a PUBACK can come before publish() returns its mid)."""
        with self.lock:
            return {self.sent[mid] for mid in self.acked_mids if mid in self.sent}


def test_every_acknowledged_fix_is_in_the_movement_store_after_kill9(servers: Servers) -> None:
    served = servers.serve()
    assert served.mqtt_port is not None
    streams = [Stream(served.mqtt_port, n) for n in range(CLIENTS)]
    for s in streams:
        s.start()
    time.sleep(KILL_AFTER_S)
    served.kill9()
    for s in streams:
        s.finish()
    acked = set().union(*(s.acked for s in streams))
    sent = sum(len(s.sent) for s in streams)

    stored = _stored_after_restart(servers, served)
    lost = acked - stored
    print(f"sent {sent}, acknowledged {len(acked)}, stored {len(stored)}, acknowledged but lost {len(lost)}")
    assert len(acked) > 200, "the stream did not get going before the kill"
    assert len(lost) == 0, f"{len(lost)} of {len(acked)} acknowledged fixes were lost"


def _stored_after_restart(servers: Servers, served: Served) -> set[tuple[str, float]]:
    restarted = servers.serve(data_dir=served.data_dir)  # recovers the store; then read it as an outsider
    with sqlite3.connect(f"file:{restarted.data_dir / 'movement.sqlite3'}?mode=ro", uri=True) as db:
        return {(u, round(t, 3)) for u, t in db.execute("SELECT user_id, t FROM fixes")}


class HttpStream(threading.Thread):
    """One app's keep-alive connection POSTing single fixes of its users back to back, remembering
    each fix answered ``200 {"accepted": 1, ...}``."""

    def __init__(self, port: int, n: int) -> None:
        super().__init__(daemon=True)
        self.users = [f"h{n}u{i:02d}" for i in range(USERS_PER_CLIENT)]
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.acked: set[tuple[str, float]] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        last: dict[str, float] = {}
        i = 0
        while not self.stop.is_set():
            user = self.users[i % len(self.users)]
            t = round(max(time.time(), last.get(user, 0.0) + 0.001), 3)
            last[user] = t
            body = json.dumps({"t": t, "lat": 39.9 + (i % 100) * 1e-4, "lon": 116.4})
            try:
                self.conn.request("POST", f"/v1/users/{user}/location", body, {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                answer = json.loads(resp.read())
            except (OSError, http.client.HTTPException, ValueError):
                return  # the broker is gone
            if resp.status == 200 and answer.get("accepted") == 1:
                self.acked.add((user, t))
            time.sleep(0.0025)  # each user well under the per-user update rate
            i += 1


def test_every_fix_answered_accepted_over_http_is_in_the_movement_store_after_kill9(servers: Servers) -> None:
    """Many connections at once, so that the broker answers several fixes per commit: the moment
    the broker dies falls between requests answered and requests waiting for their commit."""
    served = servers.serve(mqtt=False)
    streams = [HttpStream(served.http_port, n) for n in range(2 * CLIENTS)]
    for s in streams:
        s.start()
    time.sleep(KILL_AFTER_S)
    served.kill9()
    for s in streams:
        s.stop.set()
        s.join(timeout=15)
    acked = set().union(*(s.acked for s in streams))
    lost = acked - _stored_after_restart(servers, served)
    print(f"answered accepted {len(acked)}, accepted but lost {len(lost)}")
    assert len(acked) > 200, "the stream did not get going before the kill"
    assert len(lost) == 0, f"{len(lost)} of {len(acked)} fixes answered accepted were lost"
