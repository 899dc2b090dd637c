"""Open-loop load: the offered rate holds, and a slow broker shows up in latency (no coordinated omission)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from kcloak.simulators.load import LoadConfig, LoadInputError, run_load
from tests.broker.conftest import SpyUpstream, spy  # noqa: F401
from tests.simulators.test_traffic import count, fixes_counted, real_broker, settled

UPSTREAM_DELAY_S = 0.3


@pytest.fixture
async def slow_upstream() -> AsyncIterator[str]:
    """An upstream that takes ``UPSTREAM_DELAY_S`` to answer each search (no candidates)."""

    async def search(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(UPSTREAM_DELAY_S)
        return web.json_response({"candidates": []})

    app = web.Application()
    app.router.add_post("/v1/search", search)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def test_bad_flags_are_usage_errors() -> None:
    for bad in ({"rate": 0.0}, {"query_fraction": 1.5}, {"users": 0}, {"broker": "ftp://x"}, {"model": "x"}):
        with pytest.raises(LoadInputError):
            LoadConfig(**bad)


async def test_open_loop_rate_and_accounting_over_mqtt(tmp_path: Path, spy: SpyUpstream) -> None:  # noqa: F811
    async with real_broker(tmp_path, spy.url, "embedded") as (b, url):
        cfg = LoadConfig(rate=300.0, duration_s=2.0, users=300, query_fraction=0.2, broker=url, seed=4)
        s = await run_load(cfg)
        text = await settled(b, "mqtt", cfg.users + s.sent_updates)
    assert s.sent_updates + s.sent_queries == 600
    assert 0.1 < s.sent_queries / 600 < 0.3
    assert s.achieved_rate == pytest.approx(300.0, rel=0.1)
    # The preload (one fix per user) plus every single fix of the run, each counted once.
    assert fixes_counted(text, "mqtt") == cfg.users + s.sent_updates
    assert count(text, "kcloak_messages_total", 'topic="update"') == s.sent_updates
    assert count(text, "kcloak_queries_total") == s.sent_queries == s.answers_ok + s.answers_refused
    assert s.latency_ms["p50"] is not None and s.latency_ms["p50"] <= s.latency_ms["max"]  # type: ignore[operator]
    out = s.to_json()
    assert set(out) >= {"target_rate", "achieved_rate", "duration_s", "sent_updates", "sent_queries"}
    assert set(out["latency_ms"]) == {"p50", "p90", "p99", "max"}


async def test_slow_broker_shows_up_in_latency_measured_from_intended_send_time(
    tmp_path: Path, slow_upstream: str
) -> None:
    """Queries at 20/s through 2 HTTP connections to a broker that needs 0.3 s each: capacity 6.7/s.

    A closed-loop client would send at that capacity and report about 0.3 s. Open loop keeps
    offering 20/s, and latency counted from each query's intended send time grows with the
    backlog: the last of 20 queries waits for 9 answers ahead of it on its connection.
    """
    wide = {"profile.k": 2, "profile.max_area_m2": 2.5e9}
    async with real_broker(tmp_path, slow_upstream, "http", **wide) as (b, url):
        cfg = LoadConfig(
            rate=20.0, duration_s=1.0, users=50, query_fraction=1.0, query_kind="knn",
            broker=url, seed=1, query_connections=2,
        )  # fmt: skip
        s = await run_load(cfg)
        text = b.metrics.render().decode()
    assert s.sent_queries == 20 and s.sent_updates == 0
    assert s.achieved_rate == pytest.approx(20.0, rel=0.15)  # the sender was not slowed down
    assert s.answers_ok == 20 and count(text, "kcloak_queries_total", 'status="ok"') == 20
    assert s.max_send_lag_ms < 200
    lat = s.latency_ms
    assert lat["p50"] is not None and lat["max"] is not None
    assert lat["max"] > 5 * UPSTREAM_DELAY_S * 1000  # ≈ 10 × 0.3 s − 0.95 s ≈ 2 s
    assert lat["p50"] > 2 * UPSTREAM_DELAY_S * 1000
