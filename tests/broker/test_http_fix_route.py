"""``POST /v1/users/{user}/location`` answers alike whichever way the request names the route.

The broker may serve a plainly written single-fix path without its router; a path that names the
same route and user in another spelling (a percent-encoded user id, a query string) or a request
with ``Expect: 100-continue`` is routed as every other request. Each case is sent both ways
over real HTTP to a real broker, with and without tokens, and the statuses, bodies, metrics and
stored fixes must be the same.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession
from yarl import URL

from kcloak.broker.auth import TokenStore
from kcloak.broker.service import Broker
from kcloak.wire.tokens import parse_tokens
from tests.broker.conftest import SpyUpstream, broker_config

JSON = {"Content-Type": "application/json"}
COUNTED = ("kcloak_http_requests_total", "kcloak_updates_", "kcloak_http_request_duration_seconds_count")
SPELLINGS = {
    "plain": "/v1/users/{user}/location",
    "percent-encoded user": "/v1/users/%{hex}{rest}/location",
    "query string": "/v1/users/{user}/location?src=test",
}


def _path(spelling: str, user: str) -> str:
    return SPELLINGS[spelling].format(user=user, hex=f"{ord(user[0]):02X}", rest=user[1:])


def _body(t: float, lat: float = 39.9) -> bytes:
    return f'{{"t": {t!r}, "lat": {lat!r}, "lon": 116.4}}'.encode()


async def _post(
    http: ClientSession, base: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    async with http.post(URL(base + path, encoded=True), data=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def _counts(http: ClientSession, base: str, headers: dict[str, str]) -> dict[str, float]:
    async with http.get(f"{base}/metrics", headers=headers) as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(COUNTED):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


@pytest.fixture(params=["open", "tokens"])
async def broker(request: pytest.FixtureRequest, tmp_path: Path, spy: SpyUpstream) -> AsyncIterator[Broker]:
    tokens = TokenStore.from_lines(parse_tokens("u1:tok1\nu2:tok2\n")) if request.param == "tokens" else None
    async with Broker(config=broker_config(tmp_path, spy.url), tokens=tokens) as b:
        yield b


async def _exchange(
    http: ClientSession, base: str, spelling: str, tokens: bool, t0: float
) -> tuple[list[tuple[int, dict[str, Any]]], dict[str, float]]:
    """The same sequence of single-fix requests for user ``u1`` in one spelling: answers and metric changes."""
    auth = {"Authorization": "Bearer tok1"} if tokens else {}
    other = {"Authorization": "Bearer tok2"} if tokens else {}
    before = await _counts(http, base, auth)
    path = _path(spelling, "u1")
    answers = [
        await _post(http, base, path, _body(t0), {**JSON, **auth}),  # accepted
        await _post(http, base, path, _body(t0 - 1), {**JSON, **auth}),  # out of order
        await _post(http, base, path, _body(t0 + 1, lat=91.0), {**JSON, **auth}),  # invalid lat
        await _post(http, base, path, b"{not json", {**JSON, **auth}),
        await _post(http, base, path, _body(t0 + 2), {"Content-Type": "text/plain", **auth}),
        await _post(http, base, path, _body(t0 + 3), {**JSON, "Expect": "100-continue", **auth}),  # accepted
        await _post(http, base, path, _body(t0 + 4), {**JSON, **other}),  # 403 with tokens, accepted open
        await _post(http, base, path, _body(t0 + 5), JSON),  # 401 with tokens, accepted open
        await _post(http, base, path, _body(t0 + 6), {**JSON, "Authorization": "Bearer nope"}),
    ]
    return answers, _delta(before, await _counts(http, base, auth))


async def test_every_spelling_of_the_fix_route_answers_and_counts_alike(broker: Broker) -> None:
    base = f"http://127.0.0.1:{broker.http_port}"
    tokens = broker.tokens is not None
    async with ClientSession() as http:
        results = {}
        for i, spelling in enumerate(SPELLINGS):
            # Each spelling starts from the same state: fixes of u1 later than any sent before.
            results[spelling] = await _exchange(http, base, spelling, tokens, time.time() - 60 + 10 * i)
        answers, metrics = results["plain"]
        statuses = [status for status, _ in answers]
        if tokens:
            assert statuses == [200, 200, 400, 400, 415, 200, 403, 401, 401]
            assert answers[6][1]["error"]["code"] == "forbidden" and answers[7][1]["error"]["code"] == "unauthorized"
        else:
            assert statuses == [200, 200, 400, 400, 415, 200, 200, 200, 200]
        assert answers[0][1] == {"accepted": 1, "rejected": []}
        assert answers[1][1] == {"accepted": 0, "rejected": [{"index": 0, "code": "out_of_order"}]}
        assert (answers[2][1]["error"]["code"], answers[2][1]["error"]["field"]) == ("invalid", "lat")
        assert answers[3][1]["error"]["code"] == "invalid"
        assert answers[4][1]["error"]["code"] == "unsupported_media_type"
        route = 'route="/v1/users/{user}/location"'
        assert sum(v for k, v in metrics.items() if k.startswith("kcloak_http_requests_total") and route in k) == 9
        assert sum(v for k, v in metrics.items() if "duration_seconds_count" in k and route in k) == 9
        assert not any("u1" in k or "unmatched" in k for k in metrics)
        for spelling in SPELLINGS:
            assert results[spelling] == results["plain"], spelling
