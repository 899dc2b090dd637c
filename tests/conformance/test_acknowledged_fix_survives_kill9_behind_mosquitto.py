"""A fix whose PUBACK the app received survives ``kill -9`` of kcloak behind mosquitto.

Attack/defect: over an external broker the app's PUBACK comes from mosquitto. kcloak's intake used
a clean session and acknowledged each message on receipt, and the generated mosquitto.conf kept
mosquitto's defaults (no persistence, 20 in flight, at most 1000 queued): ``kill -9`` under a QoS 1
stream lost every fix mosquitto had handed over but kcloak had not committed, and everything
published while kcloak was down. Contract §1: an accepted update survives ``kill -9``.

Here a real mosquitto runs the configuration ``kcloak mosquitto-config`` writes; paho clients (one
per user, QoS 1) stream fixes; kcloak is SIGKILLed mid-stream and restarted on the same data
directory; every fix whose PUBACK a client received must end up in ``movement.sqlite3``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conformance.conftest import ROOT, Servers, free_port, kcloak, metric

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")

USERS = [f"walker{i:02d}" for i in range(24)]
TICK_S = 0.02  # one fix per user per tick: 24 users → 1,200 fixes/s
STREAM_S = 3.0
KILL_AT_S = 1.5


@contextlib.contextmanager
def mosquitto_behind_kcloak(tmp_path: Path, users: list[str]) -> Iterator[tuple[int, Path, Path]]:
    """mosquitto with the generated configuration; yields (port, config dir, tokens file)."""
    assert MOSQUITTO is not None
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{u}:tok-{u}\n" for u in users))
    port, out = free_port(), tmp_path / "mosquitto"
    gen = subprocess.run(
        kcloak("mosquitto-config", "--tokens", str(tokens), "-o", str(out), "--listen", f"127.0.0.1:{port}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert gen.returncode == 0, gen.stderr
    if os.getuid() == 0:  # mosquitto would drop root for a user who cannot read the private files
        with (out / "mosquitto.conf").open("a") as fh:
            fh.write("user root\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(out / "mosquitto.conf")], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "mosquitto did not start"
            time.sleep(0.05)
        yield port, out, tokens
    finally:
        proc.terminate()
        proc.wait(10)


def kcloak_args(port: int, out: Path, tokens: Path) -> list[str]:
    return [
        "--mqtt",  # the harness passed --mqtt none; the last flag wins
        f"mqtt://_kcloak@127.0.0.1:{port}",
        "--mqtt-password-file",
        str(out / "service.secret"),
        "--tokens",
        str(tokens),
    ]


def connect(port: int, user: str) -> paho.Client:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"app-{user}", protocol=paho.MQTTv311)
    client.username_pw_set(user, f"tok-{user}")
    connected = threading.Event()
    client.on_connect = lambda _c, _u, _f, rc, _p: connected.set() if not rc.is_failure else None
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(10), f"{user} could not connect to mosquitto"
    return client


def stored_fixes(data_dir: Path) -> set[tuple[str, float]]:
    db = sqlite3.connect(f"file:{data_dir / 'movement.sqlite3'}?mode=ro", uri=True)
    try:
        return {(u, t) for u, t in db.execute("SELECT user_id, t FROM fixes")}
    finally:
        db.close()


def test_every_acknowledged_fix_is_stored_after_kill9_and_restart(servers: Servers, tmp_path: Path) -> None:
    with mosquitto_behind_kcloak(tmp_path, USERS) as (port, out, tokens):
        served = servers.serve(*kcloak_args(port, out, tokens), mqtt=False)
        clients = {u: connect(port, u) for u in USERS}
        sent: list[tuple[str, float, paho.MQTTMessageInfo]] = []
        try:
            start = time.time()
            last = dict.fromkeys(USERS, 0.0)
            killed = False
            tick = 0
            while time.time() - start < STREAM_S:
                for i, user in enumerate(USERS):
                    t = max(round(time.time(), 6), round(last[user] + 1e-3, 6))
                    last[user] = t
                    fix = {"t": t, "lat": 39.9 + i * 1e-4, "lon": 116.4 + tick * 1e-6}
                    info = clients[user].publish(f"kcloak/v1/update/{user}", json.dumps(fix), qos=1)
                    sent.append((user, t, info))
                if not killed and time.time() - start >= KILL_AT_S:
                    served.kill9()  # mid-stream: mosquitto keeps acknowledging the apps
                    killed = True
                tick += 1
                time.sleep(max(0.0, start + tick * TICK_S - time.time()))
            deadline = time.monotonic() + 10  # let the last PUBACKs from mosquitto come in
            while time.monotonic() < deadline and not all(info.is_published() for _, _, info in sent):
                time.sleep(0.05)
        finally:
            for client in clients.values():
                client.disconnect()  # first, so that each network thread ends at once
            for client in clients.values():
                client.loop_stop()
        acknowledged = {(u, t) for u, t, info in sent if info.is_published()}
        assert killed and len(acknowledged) >= 0.9 * len(sent), (len(acknowledged), len(sent))

        restarted = servers.serve(*kcloak_args(port, out, tokens), mqtt=False, data_dir=served.data_dir)
        deadline = time.monotonic() + 30
        found: set[tuple[str, float]] = set()
        while time.monotonic() < deadline:  # the backlog mosquitto kept drains into the store
            found = stored_fixes(restarted.data_dir) & acknowledged
            if found == acknowledged:
                break
            time.sleep(0.2)
        lost = acknowledged - found
        print(f"acknowledged {len(acknowledged)}, found {len(found)}, lost {len(lost)}")
        assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged fixes lost"
        # Redelivered fixes that were already stored are refused out_of_order, never stored twice.
        text = restarted.metrics()
        assert metric(text, "kcloak_updates_rejected_total", reason="rate_limited") == 0
        assert metric(text, "kcloak_updates_rejected_total", reason="overloaded") == 0
