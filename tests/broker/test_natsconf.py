"""kcloak.broker.cluster.natsconf: the NATS node configs of docs/cluster.md "Engine" (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kcloak.broker.cluster.natsconf import NatsNode, node_config, write_cluster_configs
from kcloak.broker.config import ConfigError


def nodes(tmp_path: Path, count: int) -> list[NatsNode]:
    return [
        NatsNode(f"n{i + 1}", 4222 + i, 6222 + i, 1883 + i, 8222 + i, tmp_path / f"store {i + 1}") for i in range(count)
    ]


def test_each_node_routes_to_every_other_node_and_not_to_itself(tmp_path: Path) -> None:
    three = nodes(tmp_path, 3)
    text = node_config(three[0], three)
    assert 'server_name: "n1"' in text
    assert 'listen: "127.0.0.1:4222"' in text
    assert 'listen: "127.0.0.1:1883"' in text  # the MQTT listener
    assert f'store_dir: "{tmp_path / "store 1"}"' in text  # quoted: a path with a space stays whole
    assert '"nats-route://127.0.0.1:6223"' in text and '"nats-route://127.0.0.1:6224"' in text
    assert "nats-route://127.0.0.1:6222" not in text
    assert 'listen: "127.0.0.1:6222"' in text  # its own route listener


def test_a_single_node_has_no_cluster_block(tmp_path: Path) -> None:
    one = nodes(tmp_path, 1)
    text = node_config(one[0], one)
    assert "cluster {" not in text and "jetstream {" in text and "mqtt {" in text


def test_write_cluster_configs_writes_one_file_per_node_and_creates_the_stores(tmp_path: Path) -> None:
    three = nodes(tmp_path, 3)
    paths = write_cluster_configs(three, tmp_path / "conf")
    assert [p.name for p in paths] == ["n1.conf", "n2.conf", "n3.conf"]
    assert paths[1].read_text(encoding="utf-8") == node_config(three[1], three)
    assert all(node.store_dir.is_dir() for node in three)


def test_duplicate_node_names_are_refused(tmp_path: Path) -> None:
    twice = [nodes(tmp_path, 1)[0], nodes(tmp_path, 1)[0]]
    with pytest.raises(ConfigError, match="unique"):
        write_cluster_configs(twice, tmp_path / "conf")
