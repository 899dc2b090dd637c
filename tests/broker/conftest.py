"""Fixtures: a spy upstream provider and a real broker on loopback."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kcloak.broker.config import Config
from kcloak.broker.service import Broker
from kcloak.wire.net import free_port


@dataclass
class SpyUpstream:
    """An upstream that records every request and answers with every matching POI (inclusive)."""

    pois: list[dict[str, Any]]
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    fail_next: int = 0
    url: str = ""

    async def search(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        self.headers.append(dict(request.headers))
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"error": {"code": "overloaded", "message": "busy"}}, status=503)
        body = self.requests[-1]
        cat = body.get("category")
        out = [p for p in self.pois if cat is None or p["category"] == cat]
        return web.json_response({"candidates": sorted(out, key=lambda p: p["poi_id"])})


def beijing_pois(n: int = 120, seed: int = 7) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    cats = ("cafe", "restaurant", "bank")
    return [
        {
            "poi_id": f"p{i:04d}",
            "lat": round(39.9 + rnd.uniform(-0.05, 0.05), 6),
            "lon": round(116.4 + rnd.uniform(-0.05, 0.05), 6),
            "category": cats[i % 3],
            "name": f"place {i}",
        }
        for i in range(n)
    ]


@pytest.fixture
async def spy() -> AsyncIterator[SpyUpstream]:
    s = SpyUpstream(beijing_pois())
    app = web.Application()
    app.router.add_post("/v1/search", s.search)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s.url = f"http://127.0.0.1:{port}"
    yield s
    await runner.cleanup()


def broker_config(tmp_path: Path, upstream: str, **values: Any) -> Config:
    base: dict[str, Any] = {
        "http.listen": "127.0.0.1:0",
        "mqtt.mode": "none",
        "upstream.url": upstream,
        "storage.data_dir": str(tmp_path / "data"),
        "upstream.timeout_s": 1.0,
        "upstream.deadline_s": 3.0,
    }
    base.update(values)
    return Config().with_values(base)


@pytest.fixture
async def http_broker(tmp_path: Path, spy: SpyUpstream) -> AsyncIterator[Broker]:
    async with Broker(config=broker_config(tmp_path, spy.url)) as b:
        yield b


@pytest.fixture
def mqtt_port() -> int:
    return free_port()
