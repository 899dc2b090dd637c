"""What only ``UpstreamProcesses`` does (the policy itself runs on it in test_upstream.py): children
that die, hang or are told to stop, the split of the connections, and the broker's own children.

Providers are the scripted raw HTTP/1.1 servers of test_upstream.py and the real ``kcloak lbs``
engine; children are real processes, killed and stopped with real signals.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.broker.config import Config, ConfigError
from kcloak.broker.lbs_server import LbsServer
from kcloak.broker.upstream import Candidate, SearchRequest, Upstream, UpstreamClient, UpstreamError
from kcloak.broker.upstream_processes import DEADLINE_GRACE_S, UpstreamProcesses, shares
from kcloak.core.places import load_pois
from kcloak.wire.net import free_port
from tests.broker import test_upstream
from tests.broker.test_upstream import (
    Request,
    Responder,
    ServerFactory,
    echo,
    new_metrics,
    ok_json,
    outcomes,
    range_request,
    retries,
)
from tests.procs import descendants, running

serve = test_upstream.serve
"""The scripted providers' fixture."""


async def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not running(pid):
            return True
        await asyncio.sleep(0.05)
    return False


def slow(seconds: float) -> Responder:
    async def respond(request: Request, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(seconds)
        writer.write(ok_json({"candidates": []}))
        return True

    return respond


async def test_a_killed_child_fails_its_requests_at_once_and_is_started_again(serve: ServerFactory) -> None:
    """kill -9 of the child with 20 requests at the provider: each fails with UpstreamError well
    before its deadline (each query would be answered upstream_error, once), and the next request
    is served by a new child."""
    server = await serve(slow(30.0))
    async with UpstreamProcesses(url=server.url, deadline_s=20.0, timeout_s=20.0, concurrency=32) as up:
        (pid,) = up.pids
        pending = [asyncio.ensure_future(up.search(range_request())) for _ in range(20)]
        while len(server.requests) < 20:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        outcomes_ = await asyncio.gather(*pending, return_exceptions=True)
        assert time.monotonic() - started < 3.0
        assert all(isinstance(o, UpstreamError) for o in outcomes_), outcomes_
        assert up.healthy is False and up.waiting == 0
        server.responder = echo
        got = await asyncio.wait_for(up.search(range_request()), 10.0)
        assert [c.poi_id for c in got] == ["echo"]
        assert up.restarts == 1 and up.pids and up.pids != [pid]
        assert up.healthy is True


async def test_a_hung_child_fails_its_requests_after_the_deadline(serve: ServerFactory) -> None:
    """SIGSTOP: the child neither answers nor exits; the broker's side gives up after deadline_s +
    the grace, not later."""
    server = await serve(echo)
    async with UpstreamProcesses(url=server.url, deadline_s=0.5, timeout_s=0.5) as up:
        assert await up.search(range_request())  # the child is up
        (pid,) = up.pids
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(UpstreamError, match="deadline"):
                await up.search(range_request())
            took = time.monotonic() - started
            assert 0.5 + DEADLINE_GRACE_S - 0.05 <= took < 0.5 + DEADLINE_GRACE_S + 1.0
        finally:
            os.kill(pid, signal.SIGCONT)


async def test_closing_ends_the_children_at_once(serve: ServerFactory) -> None:
    """Leaving the context with 10 requests at a provider that never answers: the 10 fail at once
    (as the in-process client's closing pool fails its searches; the broker drains its queries
    before), and the child is gone, well within the deadline it would otherwise wait for."""
    server = await serve(slow(3600.0))
    started = time.monotonic()
    up = UpstreamProcesses(url=server.url, deadline_s=30.0, timeout_s=30.0)
    async with up:
        (pid,) = up.pids
        pending = [asyncio.ensure_future(up.search(range_request())) for _ in range(10)]
        while len(server.requests) < 10:
            await asyncio.sleep(0.01)
    got = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(o, UpstreamError) for o in got), got
    assert await _gone(pid, 1.0)
    assert time.monotonic() - started < 10.0


async def test_the_connections_are_split_over_the_children(serve: ServerFactory) -> None:
    """concurrency 5 over 2 children: never more than 5 requests at the provider together, both
    children used, and the requests beyond them counted as waiting."""
    assert shares(5, 2) == [3, 2] and shares(64, 1) == [64] and sum(shares(7, 3)) == 7
    server = await serve(slow(0.3))
    async with UpstreamProcesses(url=server.url, processes=2, concurrency=5, deadline_s=10.0) as up:
        assert len(up.pids) == 2
        pending = [asyncio.ensure_future(up.search(range_request())) for _ in range(12)]
        await asyncio.sleep(0)
        assert up.waiting == 12 - 5
        assert all(o == [] for o in await asyncio.gather(*pending))
        assert up.waiting == 0
    assert server.max_in_flight == 5
    assert server.max_open == 5


async def test_attempts_and_retries_reach_the_brokers_metrics(serve: ServerFactory) -> None:
    calls = 0

    async def flaky(request: Request, writer: asyncio.StreamWriter) -> bool:
        nonlocal calls
        calls += 1
        writer.write(ok_json({"candidates": []}) if calls > 2 else b"HTTP/1.1 503 No\r\nContent-Length: 0\r\n\r\n")
        return True

    server = await serve(flaky)
    metrics = new_metrics()
    async with UpstreamProcesses(url=server.url, metrics=metrics, retries=2, deadline_s=5.0) as up:
        assert await up.search(range_request()) == []
    assert outcomes(metrics) == {"http_error": 2, "ok": 1}
    assert retries(metrics) == 2
    assert len({r.pseudonym for r in server.requests}) == 3


coordinate = st.integers(-(10**6), 10**6).map(lambda i: 116.4 + i / 10**6)
latitude = st.integers(-(10**6), 10**6).map(lambda i: 39.9 + i / 10**6)


@st.composite
def requests(draw: st.DrawFn) -> SearchRequest:
    decimals = draw(st.sampled_from([4, 5, 6]))
    lon = sorted(round(draw(coordinate), decimals) for _ in range(2))
    lat = sorted(round(draw(latitude), decimals) for _ in range(2))
    category = draw(st.sampled_from([None, "restaurant", "cafe", "bank"]))
    if draw(st.booleans()):
        return SearchRequest("knn", [lon[0], lat[0], lon[1], lat[1]], n=draw(st.integers(1, 12)), category=category)
    radius = draw(st.sampled_from([0.0, 1.0, 250.5, 1000.0, 3000]))  # 0: refused by the provider (400), on both
    return SearchRequest("range", [lon[0], lat[0], lon[1], lat[1]], radius_m=radius, category=category)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(requests(), min_size=1, max_size=60))
def test_the_candidates_are_those_of_the_in_process_client_exactly(batch: list[SearchRequest]) -> None:
    """Against the real ``kcloak lbs`` engine on the bundled POIs, requests on 4–6-decimal grids:
    the children's candidates equal the in-process client's, field by field and bit by bit."""

    async def both() -> None:
        async with (
            LbsServer(POIS, port=0) as lbs,
            UpstreamClient(url=lbs.url) as here,
            UpstreamProcesses(url=lbs.url, processes=2) as there,
        ):
            for request in batch:
                a, b = await outcome(here, request), await outcome(there, request)
                assert a == b
                if isinstance(a, list) and isinstance(b, list):
                    assert [(x.lat.hex(), x.lon.hex()) for x in a] == [(y.lat.hex(), y.lon.hex()) for y in b]

    asyncio.run(both())


POIS = load_pois(None)


async def outcome(upstream: Upstream, request: SearchRequest) -> list[Candidate] | str:
    """The candidates, or the failure's message."""
    try:
        return await upstream.search(request)
    except UpstreamError as exc:
        return f"UpstreamError: {exc}"


def test_processes_beyond_the_connections_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"upstream\.processes"):
        Config().merged({"upstream": {"processes": 9, "concurrency": 8}})
    assert Config().merged({"upstream": {"processes": 0}}).upstream.processes == 0
    assert Config().upstream.processes == 1
    with pytest.raises(ValueError, match="processes"):
        UpstreamProcesses(url="http://127.0.0.1:1", processes=0)


def test_a_killed_broker_leaves_no_upstream_process(tmp_path: Path) -> None:
    """kill -9 of ``kcloak serve``: its upstream child sees its input end and exits by itself."""
    http = free_port()
    serve_ = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kcloak",
            "serve",
            "--mqtt",
            "none",
            "--http",
            f"127.0.0.1:{http}",
            "--data-dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        children: list[int] = []
        end = time.monotonic() + 30
        while not children and time.monotonic() < end:
            time.sleep(0.1)
            children = sorted(descendants(serve_.pid))
        assert children, "kcloak serve started no upstream process"
        serve_.kill()
        serve_.wait()
        assert asyncio.run(_gone(children[0], 10.0))
    finally:
        if serve_.poll() is None:
            serve_.kill()
