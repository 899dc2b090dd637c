"""``kill -9`` of ``kcloak serve``: its MQTT port must die with it.

Defect: the embedded broker ran as a child process in a session of its own; after a ``kill -9``
of kcloak it kept accepting connections and acknowledging publishes for 16 s with nobody behind
it, so apps believed their fixes were taken. Now nothing of kcloak keeps running: the MQTT port
refuses connections within a second, and no process that kcloak started is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tests.conformance.conftest import Servers
from tests.procs import descendants, running


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_kill9_closes_the_mqtt_port_and_leaves_nothing_running(servers: Servers) -> None:
    served = servers.serve()
    port = served.mqtt_port
    assert port is not None
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="app", protocol=paho.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    info = client.publish("kcloak/v1/update/app", json.dumps({"t": time.time(), "lat": 39.9, "lon": 116.4}), qos=1)
    info.wait_for_publish(timeout=10)
    assert info.is_published()
    spawned = descendants(served.proc.pid)
    served.kill9()
    t0 = time.monotonic()
    while _accepts(port) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    gone_after = time.monotonic() - t0
    time.sleep(0.3)
    connected_after = client.is_connected()
    client.loop_stop()
    assert gone_after < 1.0, f"the MQTT port still accepted connections {gone_after:.1f} s after kill -9"
    assert not connected_after  # the app's own connection saw kcloak go
    # A child that ended is gone, even where it stays a zombie until the system's init reaps it
    # (this test's machines run without a reaping init); within a second, to let it see the end.
    alive = spawned
    deadline = time.monotonic() + 1.0
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in spawned if running(pid)}
        time.sleep(0.05)
    for pid in alive:  # do not leave them behind, whatever the verdict
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    assert alive == set(), "processes started by kcloak outlived it"
