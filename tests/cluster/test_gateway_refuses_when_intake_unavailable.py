"""When the intake stream cannot take a message within the retry budget, the gateway refuses it
``overloaded`` and never acknowledges it; ``kcloak serve --cluster`` without a reachable NATS exits
with one sentence (no traceback, no credentials)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nats
import pytest

from kcloak.broker.cluster.gateway import ClusterPipeline
from kcloak.broker.cluster.topology import Layout, ensure_layout
from kcloak.broker.config import Config
from kcloak.broker.metrics import Metrics
from kcloak.core.profile import ReasonCode
from kcloak.wire.net import free_ports
from kcloak.wire.payloads import Fix
from tests.cluster.conftest import NatsCluster
from tests.cluster.gateway_fixtures import Gateway, gateway

pytestmark = pytest.mark.cluster
__all__ = ["gateway"]

ROOT = Path(__file__).resolve().parents[2]


def test_a_fix_the_stream_cannot_take_is_refused_overloaded_and_never_acknowledged(
    nats_cluster: NatsCluster,
) -> None:
    async def scenario() -> None:
        async def quiet(exc: Exception) -> None:
            pass

        nc = await nats.connect(
            servers=nats_cluster.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet
        )
        layout = Layout(partitions=2, replicas=3)
        await ensure_layout(nc, layout)
        metrics = Metrics(version="test", algorithm="hilbert")
        pipeline = ClusterPipeline(
            nc=nc, config=Config(), metrics=metrics, layout=layout, name="gw", publish_timeout_s=0.5, retry_budget_s=2.0
        )
        await pipeline.start()
        fix = Fix(t=time.time(), lat=39.9, lon=116.4)
        ok = await pipeline.enqueue_fixes("mqtt", [("alice", {"lat": 39.9, "lon": 116.4, "t": fix.t})])
        assert ok.codes == [None]  # PubAcked
        for node in nats_cluster.nodes:
            nats_cluster.kill9(node.name)
        started = time.monotonic()
        res = await pipeline.enqueue_fixes("http", [("alice", fix), ("bob", fix)], batch=True)
        assert res.codes == [ReasonCode.OVERLOADED, ReasonCode.OVERLOADED]  # HTTP: 503
        mqtt = pipeline.enqueue_fixes("mqtt", [("alice", {"lat": 39.9, "lon": 116.4, "t": fix.t + 1})])
        await asyncio.wait([mqtt])
        assert mqtt.cancelled()  # the MQTT door closes the connection without a PUBACK
        assert time.monotonic() - started < 10  # bounded
        text = metrics.render().decode()
        assert 'kcloak_gateway_publish_failed_total{kind="updates"} 2.0' in text
        assert 'kcloak_gateway_publish_failed_total{kind="update"} 1.0' in text
        assert 'kcloak_updates_rejected_total{reason="overloaded",transport="http"} 2.0' in text
        assert 'kcloak_messages_dropped_total{reason="overloaded",topic="update",transport="mqtt"} 1.0' in text
        with contextlib.suppress(Exception):  # every node is dead
            await nc.close()

    asyncio.run(scenario())


def test_serve_cluster_without_nats_exits_with_one_sentence() -> None:
    nats_port, http_port, mqtt_port = free_ports(3)
    secret_url = f"nats://operator:s3cret-pw@127.0.0.1:{nats_port}"
    listen = [
        "--http",
        f"127.0.0.1:{http_port}",
        "--mqtt-listen",
        f"127.0.0.1:{mqtt_port}",
        "--data-dir",
        "/nonexistent",
    ]
    proc = subprocess.run(
        [sys.executable, "-I", "-m", "kcloak", "serve", "--cluster", secret_url, "--gateway-only", *listen],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 1
    assert f"kcloak serve: cluster: cannot reach NATS at 127.0.0.1:{nats_port} within 10 s" in proc.stderr
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "s3cret" not in out and "operator" not in out


def test_healthz_is_degraded_while_nats_is_unreachable(nats_cluster: NatsCluster, gateway: Gateway) -> None:
    status, body = health(gateway)
    assert status == 200 and body["stores"] == {"nats": "ok"}
    for node in nats_cluster.nodes:
        nats_cluster.kill9(node.name)
    deadline = time.monotonic() + 15
    while health(gateway)[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    status, body = health(gateway)
    assert status == 503 and body["status"] == "degraded" and body["stores"] == {"nats": "failing"}


def health(gw: Gateway) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(gw.url("/healthz"), timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
