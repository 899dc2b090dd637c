"""An attacker sends a PUBLISH whose topic length runs past the end of its own frame, into the
packet behind it (raw bytes, the way no MQTT library would).

Expected: the embedded MQTT server treats the frame as malformed and closes only that connection,
without reading anything from beyond the frame (neither the lying packet nor the fix behind it is
accepted or acknowledged); a bystander on another connection keeps being served.
"""

from __future__ import annotations

import json
import socket
import struct
import time

from tests.conformance.conftest import Servers, metric


def _packet(first: int, body: bytes) -> bytes:
    n, length = len(body), bytearray()
    while True:
        byte, n = n % 128, n // 128
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    return bytes([first]) + bytes(length) + body


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("!H", len(raw)) + raw


def _connect(port: int, client_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(_packet(0x10, _s("MQTT") + bytes([4, 0x02]) + struct.pack("!H", 60) + _s(client_id)))
    assert sock.recv(4) == b"\x20\x02\x00\x00"
    return sock


def _fix(user: str, pid: int) -> bytes:
    body = json.dumps({"t": time.time(), "lat": 39.9, "lon": 116.4}).encode()
    return _packet(0x32, _s(f"kcloak/v1/update/{user}") + struct.pack("!H", pid) + body)


def _read_until_closed(sock: socket.socket) -> bytes:
    got = b""
    while True:
        chunk = sock.recv(65536)  # raises TimeoutError if the server kept the connection open
        if not chunk:
            return got
        got += chunk


def test_topic_length_past_the_frame_end_closes_only_that_connection(servers: Servers) -> None:
    served = servers.serve()
    assert served.mqtt_port is not None
    attacker = _connect(served.mqtt_port, "attacker")
    bystander = _connect(served.mqtt_port, "bystander")
    try:
        topic = b"kcloak/v1/update/mallory"
        # Topic length 200, but the frame holds 24 topic bytes and a packet id: the rest would be
        # read from the honest-looking fix that follows in the same write.
        lying = _packet(0x32, struct.pack("!H", 200) + topic + b"\x00\x01")
        attacker.sendall(lying + _fix("mallory", 2))
        assert _read_until_closed(attacker) == b""  # closed, and nothing acknowledged

        bystander.sendall(_fix("alice", 7))
        assert bystander.recv(4) == b"\x40\x02\x00\x07"  # still served
    finally:
        attacker.close()
        bystander.close()
    text = served.metrics_once("kcloak_updates_accepted_total", 1, transport="mqtt")
    assert metric(text, "kcloak_updates_accepted_total", transport="mqtt") == 1
    assert metric(text, "kcloak_mqtt_disconnects_total", reason="malformed") == 1
