"""``kcloak serve`` is started on an MQTT port that another program already listens on.

Defect: with the amqtt child, serve hung forever. Contract §9: a port in use is a startup failure,
exit 1, with a clear message (and nothing left running).
"""

from __future__ import annotations

import socket
import subprocess
import time

from tests.conformance.conftest import Servers


def test_busy_mqtt_port_exits_1_within_seconds(servers: Servers) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        served = servers.serve(mqtt_port=port, wait=False)
        try:
            code = served.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            served.kill9()
            raise AssertionError("kcloak serve kept running on a busy MQTT port") from None
        elapsed = time.monotonic() - t0
    assert code == 1
    assert elapsed < 5.0, elapsed
    logs = served.logs()
    assert f"MQTT: cannot listen on 127.0.0.1:{port}" in logs, logs
