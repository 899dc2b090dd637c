"""``kcloak serve`` as a process: configuration exits, graceful stop, and logs that leak nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kcloak.broker.bench import wait_healthy
from kcloak.wire.net import free_port
from tests.broker.conftest import SpyUpstream

ROOT = Path(__file__).resolve().parents[2]


def kcloak(*args: str) -> list[str]:
    return [sys.executable, "-I", "-m", "kcloak", *args]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kcloak(*args), capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_print_config_and_bad_input_exit_codes(tmp_path: Path) -> None:
    r = run("serve", "--print-config", "--algorithm", "casper")
    assert r.returncode == 0 and 'algorithm = "casper"' in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nnope = 1\n")
    r = run("serve", "--config", str(bad))
    assert r.returncode == 2 and "server.nope" in r.stderr
    r = run("serve", "--http", "0.0.0.0:8470", "--mqtt", "none", "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and "tokens" in r.stderr
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:ok\nthis line is wrong\n")
    r = run("serve", "--tokens", str(tokens), "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and "line 2" in r.stderr and "wrong" not in r.stderr
    r = run("serve", "--algorithm", "magic")
    assert r.returncode == 2


def test_port_in_use_exits_1(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("serve", "--http", f"127.0.0.1:{port}", "--mqtt", "none", "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 1


def _post(port: int, path: str, body: object) -> dict[str, object]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        out: dict[str, object] = json.loads(resp.read())
        return out


async def test_workload_logs_leak_no_ids_or_coordinates(tmp_path: Path, spy: SpyUpstream) -> None:
    """A real ``kcloak serve`` (embedded MQTT, HTTP): known ids and positions never reach its logs."""
    import asyncio

    http_port, mqtt_port = free_port(), free_port()
    data = tmp_path / "data"
    proc = subprocess.Popen(
        kcloak(
            "serve",
            "--http",
            f"127.0.0.1:{http_port}",
            "--mqtt-listen",
            f"127.0.0.1:{mqtt_port}",
            "--upstream",
            spy.url,
            "--data-dir",
            str(data),
            "--log-level",
            "debug",
        ),
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    secrets_seen: list[str] = []
    try:
        await asyncio.to_thread(wait_healthy, http_port)
        now = time.time()
        users = [f"secretuser{i:03d}" for i in range(30)]
        updates = []
        for i, u in enumerate(users):
            lat, lon = round(39.91 + i * 0.000731, 6), round(116.38 + i * 0.000917, 6)
            updates.append({"user": u, "t": now, "lat": lat, "lon": lon})
            secrets_seen += [u, repr(lat), repr(lon)]
        await asyncio.to_thread(_post, http_port, "/v1/locations", {"updates": updates})
        for i in range(5):
            qid = f"secretquery{i}"
            secrets_seen.append(qid)
            await asyncio.to_thread(
                _post, http_port, f"/v1/users/{users[i]}/query", {"query_id": qid, "kind": "knn", "n": 2}
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, None, 30)
    assert proc.returncode == 0
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    events = {line["event"] for line in lines}
    assert {"broker_started", "shutdown_started", "broker_stopped"} <= events
    for needle in secrets_seen:
        assert needle not in err, needle
    assert len(spy.requests) >= 1


def test_settle_gc_freezes_what_exists_and_raises_the_young_threshold() -> None:
    import gc

    from kcloak.cli.serve import GC_THRESHOLD, settle_gc

    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_freeze_count() > 1000  # at least the code and objects of this process
        assert gc.get_threshold() == GC_THRESHOLD
        cycle: list[object] = []
        cycle.append(cycle)
        ref = len(gc.get_objects())
        del cycle
        gc.collect()  # cycles made after the freeze are still collected
        assert len(gc.get_objects()) < ref
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
