"""Connections to kcloak's MQTT port that never complete a CONNECT, or go silent after one.

Defect: the embedded broker never closed idle connections, so anyone on loopback could hold
sockets (and memory) forever. Now a CONNECT must be complete within 10 s of accepting the
connection (``[mqtt] connect_timeout_s``, 10 s by default; 2 s here to keep the test short), and a
connected client that is silent for 1.5 × its keep-alive is closed.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

from tests.conformance.conftest import Servers, metric

CONNECT_BOUND_S = 2.0


def _connect_packet(client_id: str, keepalive_s: int) -> bytes:
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02" + struct.pack("!H", keepalive_s) + struct.pack("!H", len(cid)) + cid
    return bytes([0x10, len(body)]) + body


def _seconds_until_closed(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes ``sock`` (reading and discarding whatever it sends)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return float("inf")
    except ConnectionError:
        pass
    return time.monotonic() - t0


def test_connections_without_a_complete_connect_are_closed(servers: Servers, tmp_path: Path) -> None:
    config = tmp_path / "kcloak.toml"
    config.write_text(f"[mqtt]\nconnect_timeout_s = {CONNECT_BOUND_S}\n")
    served = servers.serve("--config", str(config))
    port = served.mqtt_port
    assert port is not None
    silent = socket.create_connection(("127.0.0.1", port))
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(_connect_packet("half", 60)[:7])
    results: dict[str, float] = {}
    threads = [
        threading.Thread(target=lambda s=s, n=n: results.__setitem__(n, _seconds_until_closed(s, CONNECT_BOUND_S + 5)))
        for n, s in (("silent", silent), ("half", half))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    silent.close()
    half.close()
    assert results["silent"] <= CONNECT_BOUND_S + 1.5, results
    assert results["half"] <= CONNECT_BOUND_S + 1.5, results
    assert metric(served.metrics(), "kcloak_mqtt_connects_refused_total", reason="timeout") == 2


def test_a_silent_client_is_closed_after_one_and_a_half_keepalives(servers: Servers) -> None:
    served = servers.serve()
    port = served.mqtt_port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_connect_packet("quiet", 1))
        assert sock.recv(4) == b"\x20\x02\x00\x00"
        closed_after = _seconds_until_closed(sock, 5.0)
    assert 1.0 <= closed_after <= 2.5, closed_after
    assert metric(served.metrics(), "kcloak_mqtt_disconnects_total", reason="keepalive") == 1
