"""An MQTT 5 client connects to kcloak's embedded MQTT port.

Defect: with the amqtt child, ``mosquitto_pub -V mqttv5`` failed silently (exit 19, no message).
kcloak speaks MQTT 3.1.1 only (contract §3): any other protocol level gets a CONNACK refusal
(return code 0x01, unacceptable protocol version), which MQTT 5 clients report clearly.
"""

from __future__ import annotations

import queue
import shutil
import subprocess
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conformance.conftest import Servers, metric


def test_paho_mqtt5_gets_unsupported_protocol_version(servers: Servers) -> None:
    served = servers.serve()
    assert served.mqtt_port is not None
    events: queue.Queue[Any] = queue.Queue()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="v5-app", protocol=paho.MQTTv5)
    client.on_connect = lambda _c, _u, _f, rc, _p: events.put(rc)
    client.connect("127.0.0.1", served.mqtt_port)
    client.loop_start()
    try:
        rc = events.get(timeout=10)
    finally:
        client.loop_stop()
    assert rc.is_failure and str(rc) == "Unsupported protocol version"
    assert metric(served.metrics(), "kcloak_mqtt_connects_refused_total", reason="protocol_version") == 1


@pytest.mark.skipif(shutil.which("mosquitto_pub") is None, reason="needs mosquitto_pub (mosquitto-clients)")
def test_mosquitto_pub_mqtt5_prints_a_clear_error(servers: Servers) -> None:
    served = servers.serve()
    port = str(served.mqtt_port)
    v5 = subprocess.run(
        ["mosquitto_pub", "-V", "mqttv5", "-p", port, "-q", "1", "-t", "kcloak/v1/update/alice", "-m", "{}"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert v5.returncode not in (0, 19), v5  # 19: amqtt's silent failure
    assert "Unsupported Protocol Version" in v5.stderr, v5.stderr
    v311 = subprocess.run(  # the same client in 3.1.1 mode is served
        ["mosquitto_pub", "-V", "mqttv311", "-p", port, "-q", "1", "-t", "kcloak/v1/update/alice", "-m", "{}"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert v311.returncode == 0, v311.stderr
