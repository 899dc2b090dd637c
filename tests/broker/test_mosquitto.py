"""Against a real mosquitto: the generated configuration enforces the ACL, and the broker serves
through it (shared subscriptions included)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from kcloak.broker.auth import TokenStore
from kcloak.broker.mosquitto import mosquitto_hash
from kcloak.broker.service import Broker
from kcloak.cli.main import main as cli_main
from kcloak.wire.mqtt_client import Incoming, MqttClient
from kcloak.wire.net import free_port
from tests.broker.conftest import SpyUpstream, broker_config

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def test_hash_format() -> None:
    h = mosquitto_hash("secret", salt=b"0123456789ab")
    parts = h.split("$")
    assert parts[1] == "7" and parts[2] == "101" and len(parts) == 5


@dataclass
class Mosquitto:
    """A real mosquitto on the configuration ``kcloak mosquitto-config`` wrote into ``out``."""

    port: int
    out: Path
    tokens: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = start_mosquitto(self.out, self.port)

    def stop(self) -> None:
        """An orderly stop (SIGTERM), which saves mosquitto's state when persistence is on."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture
def mosquitto_server(tmp_path: Path) -> Iterator[Mosquitto]:
    if not Path(MOSQUITTO).exists():
        pytest.fail("mosquitto is not installed (.ci/run installs it with apt-get)")
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:tokA\nbob:tokB\nreader:tokR\ncarol:sha256:" + "0" * 64 + "\n")
    port = free_port()
    out = tmp_path / "mq"
    code = cli_main(
        [
            "mosquitto-config",
            "--tokens",
            str(tokens),
            "-o",
            str(out),
            "--listen",
            f"127.0.0.1:{port}",
            "--published-readers",
            "reader",
        ]
    )
    assert code == 0
    if os.getuid() == 0:  # mosquitto drops root to its own user, which cannot read our private files
        with (out / "mosquitto.conf").open("a") as fh:
            fh.write("user root\n")
    m = Mosquitto(port, out, tokens)
    m.start()
    yield m
    m.stop()


@pytest.fixture
def mosquitto(mosquitto_server: Mosquitto) -> tuple[int, Path, Path]:
    return mosquitto_server.port, mosquitto_server.out, mosquitto_server.tokens


def start_mosquitto(out: Path, port: int) -> subprocess.Popen[bytes]:
    """mosquitto on the configuration in ``out``, once it accepts connections on ``port``."""
    proc = subprocess.Popen([MOSQUITTO, "-c", str(out / "mosquitto.conf")], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    return proc


async def test_generated_acl_is_enforced(mosquitto: tuple[int, Path, Path]) -> None:
    port, out, _ = mosquitto
    with pytest.raises(aiomqtt.MqttError):
        async with aiomqtt.Client("127.0.0.1", port, username="alice", password="wrong"):
            pass
    with pytest.raises(aiomqtt.MqttError):
        async with aiomqtt.Client("127.0.0.1", port):
            pass
    secret = (out / "service.secret").read_text().strip()
    async with (
        aiomqtt.Client("127.0.0.1", port, username="_kcloak", password=secret) as service,
        aiomqtt.Client("127.0.0.1", port, username="alice", password="tokA") as alice,
        aiomqtt.Client("127.0.0.1", port, username="bob", password="tokB") as bob,
    ):
        await service.subscribe("kcloak/v1/#", qos=1)
        await bob.subscribe("kcloak/v1/answer/alice", qos=1)  # not allowed: never delivered
        await alice.publish("kcloak/v1/update/bob", b"{}", qos=1)  # not allowed: dropped
        await alice.publish("kcloak/v1/update/alice", b"{}", qos=1)
        await service.publish("kcloak/v1/answer/alice", b"secret answer", qos=1)
        got = []
        async with asyncio.timeout(2):
            async for m in service.messages:
                got.append(m.topic.value)
                if m.topic.value == "kcloak/v1/answer/alice":
                    break
        assert "kcloak/v1/update/alice" in got and "kcloak/v1/update/bob" not in got
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                async for _ in bob.messages:
                    break


async def test_broker_through_mosquitto_with_shared_subscriptions(
    tmp_path: Path, spy: SpyUpstream, mosquitto: tuple[int, Path, Path]
) -> None:
    port, out, tokens_file = mosquitto
    cfg = broker_config(
        tmp_path,
        spy.url,
        **{
            "mqtt.mode": f"mqtt://_kcloak@127.0.0.1:{port}",
            "mqtt.password_file": str(out / "service.secret"),
            "mqtt.ingest_connections": 2,
        },
    )
    tokens = TokenStore.from_file(tokens_file)
    async with (
        Broker(config=cfg, tokens=tokens) as b,
        aiomqtt.Client("127.0.0.1", port, username="alice", password="tokA") as alice,
    ):
        await alice.subscribe("kcloak/v1/answer/alice", qos=1)
        now = time.time()
        for i in range(40):
            await alice.publish(
                "kcloak/v1/update/alice", json.dumps({"t": now - 40 + i, "lat": 39.9, "lon": 116.4}), qos=1
            )
        # Two intake connections share the work, so fixes may be processed out of publication
        # order: every fix is counted exactly once, accepted or (reordered) out_of_order.
        total = 0.0
        for _ in range(100):
            text = b.metrics.render().decode()
            lines = [
                ln
                for ln in text.splitlines()
                if ln.startswith(("kcloak_updates_accepted_total", "kcloak_updates_rejected_total"))
            ]
            total = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
            if total >= 40:
                break
            await asyncio.sleep(0.05)
        assert total == 40
        await alice.publish("kcloak/v1/query/alice", json.dumps({"query_id": "q1", "kind": "knn", "n": 1}), qos=1)
        async with asyncio.timeout(5):
            async for m in alice.messages:
                assert isinstance(m.payload, bytes)
                answer = json.loads(m.payload)
                break
        assert answer["query_id"] == "q1" and answer["reason"] == "k_unreachable"


@contextlib.asynccontextmanager
async def _intake(
    port: int, out: Path, on_messages: Any, client_id: str = "kcloak-test-in0"
) -> AsyncIterator[MqttClient]:
    """An intake connection as kcloak makes it: persistent session, subscribed to the fixes."""
    secret = (out / "service.secret").read_text().strip()
    async with MqttClient(
        host="127.0.0.1",
        port=port,
        username="_kcloak",
        password=secret,
        on_messages=on_messages,
        client_id=client_id,
    ) as conn:
        await conn.subscribe(["kcloak/v1/update/+"])
        yield conn


async def _publish_as_alice(port: int, n: int) -> None:
    async with MqttClient(host="127.0.0.1", port=port, username="alice", password="tokA") as alice:
        await asyncio.gather(*(alice.publish("kcloak/v1/update/alice", str(i).encode()) for i in range(n)))


async def test_generated_config_keeps_a_large_backlog_across_a_mosquitto_restart(
    mosquitto_server: Mosquitto,
) -> None:
    """What mosquitto acknowledged to an app while kcloak was away is handed to kcloak later: more
    than mosquitto's default 1000 queued messages, and also after mosquitto restarted in between."""
    port, out = mosquitto_server.port, mosquitto_server.out
    async with _intake(port, out, lambda _: None):  # the persistent session subscribes
        pass
    await _publish_as_alice(port, 5000)  # acknowledged by mosquitto, queued for kcloak's session
    # mosquitto restarts (an orderly stop saves its state; see docs/mqtt-external.md for a crash)
    mosquitto_server.stop()
    mosquitto_server.start()
    got: list[bytes] = []
    async with _intake(port, out, lambda batch: got.extend(m.payload for m in batch)):
        async with asyncio.timeout(10):
            while len(got) < 5000:
                await asyncio.sleep(0.05)
    assert got == [str(i).encode() for i in range(5000)]


async def test_generated_config_lets_kcloak_hold_many_messages_unacknowledged(
    mosquitto: tuple[int, Path, Path],
) -> None:
    """kcloak acknowledges a fix once committed: mosquitto must keep sending meanwhile (its default
    of 20 unacknowledged messages in flight per client throttles intake to 20 per commit)."""
    port, out, _ = mosquitto
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    got: list[Incoming] = []

    def hold(batch: list[Incoming]) -> list[asyncio.Future[None]]:
        got.extend(batch)
        return [never] * len(batch)

    async with _intake(port, out, hold, client_id="kcloak-hold-in0"):
        await _publish_as_alice(port, 3000)
        await asyncio.sleep(0.5)
        assert 1000 <= len(got) < 3000  # the generated window (1000), not mosquitto's default (20)
