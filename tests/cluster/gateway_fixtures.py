"""A real ``kcloak serve --cluster … --gateway-only`` in front of the ``nats_cluster`` fixture, and the
helpers the gateway tests share: the intake stream's leader and contents, and playing the worker
(reading a query from ``KCLOAK_IN``, storing its answer in ``KCLOAK_ANSWERS``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from kcloak.broker.cluster.topology import (
    ANSWERS_STREAM,
    IN_STREAM,
    answer_msg_id,
    answer_subject,
    in_subject,
    partition_of,
    subject_token,
)
from kcloak.wire.net import free_ports
from tests.cluster.conftest import NatsCluster, die_with_parent

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    http_port: int
    mqtt_port: int
    log_path: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=5) as resp:
            return str(resp.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


def start_gateway(
    cluster: NatsCluster, tmp_path: Path, *args: str, timeout_s: float = 40.0, gateway_only: bool = True
) -> Gateway:
    """``kcloak serve --cluster`` on free ports; ``gateway_only=False`` runs its worker too (a whole node)."""
    http_port, mqtt_port = free_ports(2)
    log_path = tmp_path / f"gateway-{http_port}.log"
    cmd = [
        sys.executable,
        "-I",
        "-m",
        "kcloak",
        "serve",
        "--cluster",
        ",".join(cluster.urls),
        "--replicas",
        "3",
        "--partitions",
        str(PARTITIONS),
        *(["--gateway-only"] if gateway_only else []),
        "--worker-name",
        f"gw{http_port}",
        "--http",
        f"127.0.0.1:{http_port}",
        "--mqtt-listen",
        f"127.0.0.1:{mqtt_port}",
        "--data-dir",
        str(tmp_path / f"data-{http_port}"),
        *args,
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent
        )
    gateway = Gateway(proc, http_port, mqtt_port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kcloak serve --cluster exited with {proc.returncode}: {gateway.logs()[-2000:]}")
        try:
            with urllib.request.urlopen(gateway.url("/healthz"), timeout=1) as resp:
                if resp.status == 200:
                    return gateway
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.1)
    gateway.stop()
    raise TimeoutError(f"the gateway did not start within {timeout_s} s: {gateway.logs()[-2000:]}")


@pytest.fixture
def gateway(nats_cluster: NatsCluster, tmp_path: Path) -> Iterator[Gateway]:
    gw = start_gateway(nats_cluster, tmp_path)
    try:
        yield gw
    finally:
        gw.stop()


async def stream_leader(js: JetStreamContext, stream: str = IN_STREAM, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = await js.stream_info(stream)
        except (nats.errors.Error, TimeoutError):
            info = None
        if info is not None and info.cluster is not None and info.cluster.leader:
            return str(info.cluster.leader)
        await asyncio.sleep(0.1)
    raise TimeoutError(f"stream {stream} has no leader within {timeout_s} s")


async def intake_messages(cluster: NatsCluster) -> list[tuple[str, dict[str, str], bytes]]:
    """Every message ``KCLOAK_IN`` holds (subject, headers, body), read by sequence without consuming."""
    await asyncio.to_thread(cluster.wait_meta_leader)
    nc = await nats.connect(servers=cluster.urls)
    try:
        js = nc.jetstream(timeout=5.0)
        await stream_leader(js)
        info = await js.stream_info(IN_STREAM)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                msg = await js.get_msg(IN_STREAM, seq=seq)
                out.append((str(msg.subject), dict(msg.headers or {}), msg.data or b""))
        return out
    finally:
        await nc.close()


async def play_worker_for_query(
    nc: NATS,
    user: str,
    query_id: str,
    answer: dict[str, Any],
    timeout_s: float = 20.0,
    *,
    reply: bool = True,
) -> dict[str, str]:
    """Wait until the query of ``user`` is in ``KCLOAK_IN``, then store ``answer`` as its one answer
    (message id ``<token>/<qkey>``) and, with ``reply``, send it to the query's ``Kcloak-Reply`` inbox, as a cell
    owner does; returns the query message's headers."""
    js = nc.jetstream(timeout=5.0)
    token = subject_token(user)
    subject = in_subject(partition_of(token, PARTITIONS), "query", token)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msg = await js.get_msg(IN_STREAM, subject=subject)
        except nats.js.errors.NotFoundError:
            msg = None
        if msg is not None and json.loads(msg.data or b"{}").get("query_id") == query_id:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the query never reached KCLOAK_IN")
        await asyncio.sleep(0.05)
    qkey = subject_token(query_id)
    await js.publish(
        answer_subject(token, qkey),
        json.dumps(answer).encode(),
        stream=ANSWERS_STREAM,
        headers={"Nats-Msg-Id": answer_msg_id(token, qkey)},
    )
    headers = dict(msg.headers or {})
    if reply and headers.get("Kcloak-Reply"):
        await nc.publish(headers["Kcloak-Reply"], json.dumps(answer).encode())
    return headers
