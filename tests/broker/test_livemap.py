"""The live map's routes, read as a browser or a client reads them: the page and its policy, what a
frame shows (regions that hold the forwarded ones, density cells with small ones hidden) and
what it never shows, and who may read it."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse, ClientSession

from kcloak.broker.auth import TokenStore
from kcloak.broker.config import ConfigError
from kcloak.broker.service import Broker
from kcloak.wire.tokens import parse_tokens
from tests.broker.conftest import SpyUpstream, broker_config

CENTRE = (39.9087, 116.3975)


async def _frame(resp: ClientResponse) -> tuple[dict[str, Any], str]:
    """The next ``frame`` event of an SSE response: its JSON and its raw text."""
    event = None
    async with asyncio.timeout(10):
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "frame":
                data = line[5:].strip()
                return json.loads(data), data
    raise AssertionError("the stream ended without a frame")


@pytest.fixture
async def open_broker(tmp_path: Path, spy: SpyUpstream) -> AsyncIterator[tuple[Broker, str]]:
    async with Broker(config=broker_config(tmp_path, spy.url)) as broker:
        yield broker, f"http://127.0.0.1:{broker.http_port}"


async def test_the_page_loads_nothing_from_elsewhere(open_broker: tuple[Broker, str]) -> None:
    _, base = open_broker
    async with ClientSession() as http:
        page = await http.get(f"{base}/map")
        assert page.status == 200 and page.content_type == "text/html"
        policy = page.headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
        html = await page.text()
        assets = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert sorted(assets) == ["/map/map.css", "/map/map.js"]
        for asset, kind in (("/map/map.js", "text/javascript"), ("/map/map.css", "text/css")):
            r = await http.get(base + asset)
            assert r.status == 200 and r.content_type == kind
            text = await r.text()
            assert not re.search(r"(?:https?:)?//[a-z0-9]", text, re.I), asset  # no URL of another host
        # the page's only data routes are this broker's
        script = await (await http.get(f"{base}/map/map.js")).text()
        assert set(re.findall(r'fetch\("([^"]+)"', script)) == {"/v1/map/streets", "/v1/map/stream"}


async def test_a_frame_widens_regions_to_grid_lines_and_hides_small_cells(open_broker: tuple[Broker, str]) -> None:
    _, base = open_broker
    now = time.time()
    # 12 users within ~150 m of the centre, 3 users ~5 km away (one cell of their own).
    crowd = {f"crowd{i:02d}": (CENTRE[0] + 0.0001 * i, CENTRE[1] + 0.00013 * (i % 4)) for i in range(12)}
    few = {f"few{i}": (CENTRE[0] + 0.045 + 0.0001 * i, CENTRE[1] + 0.0002 * i) for i in range(3)}
    async with ClientSession() as http:
        for user, (lat, lon) in (crowd | few).items():
            r = await http.post(f"{base}/v1/users/{user}/location", json={"t": now, "lat": lat, "lon": lon})
            assert r.status == 200, await r.text()
        r = await http.post(f"{base}/v1/users/crowd03/query", json={"query_id": "q1", "kind": "knn", "n": 1})
        answer = await r.json()
        assert answer["status"] == "ok", answer
        async with http.get(f"{base}/v1/map/stream") as stream:
            assert stream.status == 200 and stream.content_type == "text/event-stream"
            frame, raw = await _frame(stream)

    density = frame["density"]
    d = density["cell_deg"]
    assert density["min_k"] == 10  # map.min_k; above the default profile's k = 5
    # Only the crowd's cell is shown, with its count; the 3 others are only counted.
    assert len(density["cells"]) == 1
    x, y, n = density["cells"][0]
    assert n == 12
    assert all(x * d <= lon < (x + 1) * d and y * d <= lat < (y + 1) * d for lat, lon in crowd.values())
    assert (density["hidden_cells"], density["hidden_users"]) == (1, 3)

    # The forwarded region is inside the one shown, whose edges are grid lines (integers).
    regions = frame["regions"]
    g = regions["grid_deg"]
    assert len(regions["rows"]) == 1
    x0, y0, x1, y1, k, age = regions["rows"][0]
    assert all(isinstance(v, int) for v in (x0, y0, x1, y1))
    lon0, lat0, lon1, lat1 = answer["region"]["bbox"]
    assert x0 * g <= lon0 + 1e-9 and lon1 - 1e-9 <= x1 * g and y0 * g <= lat0 + 1e-9 and lat1 - 1e-9 <= y1 * g
    assert (x1 - x0) * g < (lon1 - lon0) + 2 * g + 1e-9  # widened by at most one grid step a side
    assert k == answer["k_achieved"] and 0 <= age < 10

    c = frame["counters"]
    assert c["updates"] == 15 and c["queries"] == 1 and c["ok"] == 1 and c["success_rate"] == 1.0
    assert c["users_present"] == 15 and c["p99_ms"] is not None and c["p99_ms"] > 0

    # No user id and no coordinate the clients sent or the provider was sent.
    assert not [u for u in crowd | few if u in raw]
    numbers = {round(float(v), 6) for v in re.findall(r"-?\d+\.\d+|-?\d+", raw)}
    sent = {round(v, 6) for pos in (crowd | few).values() for v in pos} | {
        round(v, 6) for v in answer["region"]["bbox"]
    }
    assert not numbers & sent


async def test_refusals_are_counted_by_reason(open_broker: tuple[Broker, str]) -> None:
    _, base = open_broker
    async with ClientSession() as http:
        r = await http.post(f"{base}/v1/users/alone/location", json={"t": time.time(), "lat": 39.9, "lon": 116.4})
        assert r.status == 200
        r = await http.post(f"{base}/v1/users/alone/query", json={"query_id": "q1", "kind": "knn", "n": 1})
        refusal = await r.json()
        assert refusal["status"] == "refused"
        async with http.get(f"{base}/v1/map/stream") as stream:
            frame, _ = await _frame(stream)
    c = frame["counters"]
    assert c["refusals"] == {refusal["reason"]: 1} and c["ok"] == 0 and c["success_rate"] == 0.0
    assert frame["regions"]["rows"] == [] and frame["density"]["cells"] == []


async def test_map_data_needs_a_map_viewers_token(tmp_path: Path, spy: SpyUpstream) -> None:
    tokens = TokenStore.from_lines(parse_tokens("alice:tok-alice-1\nbob:tok-bob-1\n"))
    cfg = broker_config(tmp_path, spy.url, **{"auth.map_viewers": ["alice"]})
    async with Broker(config=cfg, tokens=tokens) as broker, ClientSession() as http:
        base = f"http://127.0.0.1:{broker.http_port}"
        assert (await http.get(f"{base}/map")).status == 200  # the page holds no data
        for route in ("/v1/map/stream", "/v1/map/streets"):
            nobody = await http.get(base + route)
            assert nobody.status == 401 and (await nobody.json())["error"]["code"] == "unauthorized"
            bob = await http.get(base + route, headers={"Authorization": "Bearer tok-bob-1"})
            assert bob.status == 403 and (await bob.json())["error"]["code"] == "forbidden"
        async with http.get(f"{base}/v1/map/stream", headers={"Authorization": "Bearer tok-alice-1"}) as stream:
            assert stream.status == 200
            frame, _ = await _frame(stream)
            assert set(frame) == {"t", "regions", "density", "counters", "windows"}
        streets = await http.get(f"{base}/v1/map/streets", headers={"Authorization": "Bearer tok-alice-1"})
        assert await streets.json() == {"lines": [], "bbox": None}


async def test_at_most_eight_feeds(open_broker: tuple[Broker, str]) -> None:
    _, base = open_broker
    async with ClientSession() as http:
        feeds = [await http.get(f"{base}/v1/map/stream") for _ in range(8)]
        try:
            assert all(f.status == 200 for f in feeds)
            extra = await http.get(f"{base}/v1/map/stream")
            assert extra.status == 503 and (await extra.json())["error"]["code"] == "overloaded"
        finally:
            for f in feeds:
                f.close()


def _streets_file(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "streets.geojson"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


async def test_streets_come_from_a_geojson_file(tmp_path: Path, spy: SpyUpstream) -> None:
    lines = [[[116.39, 39.90], [116.4012345678, 39.9012345678]], [[116.38, 39.91], [116.385, 39.915], [116.39, 39.92]]]
    doc = {
        "type": "FeatureCollection",
        "features": [
            {"type": "Feature", "geometry": {"type": "MultiLineString", "coordinates": lines[:1]}, "properties": {}},
            {"type": "Feature", "geometry": {"type": "LineString", "coordinates": lines[1]}, "properties": {}},
            {"type": "Feature", "geometry": {"type": "Point", "coordinates": [116.0, 39.0]}, "properties": {}},
        ],
    }
    path = tmp_path / "streets.geojson"  # written after the start, as kcloak demo does
    cfg = broker_config(tmp_path, spy.url, **{"map.streets": str(path)})
    async with Broker(config=cfg) as broker, ClientSession() as http:
        url = f"http://127.0.0.1:{broker.http_port}/v1/map/streets"
        assert await (await http.get(url)).json() == {"lines": [], "bbox": None}
        _streets_file(tmp_path, doc)
        body = await (await http.get(url)).json()
    assert body["bbox"] == [116.38, 39.9, 116.40123, 39.92]
    assert body["lines"] == [[116.39, 39.9, 116.40123, 39.90123], [116.38, 39.91, 116.385, 39.915, 116.39, 39.92]]


@pytest.mark.parametrize("content", ["not json", json.dumps({"type": "Point", "coordinates": [1, 2]})])
async def test_a_bad_streets_file_stops_the_start(tmp_path: Path, spy: SpyUpstream, content: str) -> None:
    path = tmp_path / "streets.geojson"
    path.write_text(content, encoding="utf-8")
    cfg = broker_config(tmp_path, spy.url, **{"map.streets": str(path)})
    with pytest.raises(ConfigError, match=r"map\.streets"):
        async with Broker(config=cfg):
            pass


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [("map.min_k", 1, "map.min_k"), ("map.cell_deg", 5.0, "map.cell_deg"), ("map.region_age_s", 0.0, "map.region")],
)
def test_bad_map_settings_are_refused(tmp_path: Path, key: str, value: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        broker_config(tmp_path, "http://127.0.0.1:9", **{key: value})


def test_widening_never_cuts_a_region() -> None:
    from kcloak.broker.livemap import REGION_GRID_DEG, outward

    for lo, hi in ((116.3975, 116.4012), (-0.0005, 0.0005), (39.999999, 40.0), (12.345, 12.345)):
        i0, i1 = outward(lo, hi)
        assert i0 * REGION_GRID_DEG <= lo and hi <= i1 * REGION_GRID_DEG
        assert math.isclose((i1 - i0) * REGION_GRID_DEG, hi - lo, abs_tol=2 * REGION_GRID_DEG + 1e-12)


async def test_an_open_feed_does_not_hold_the_shutdown(tmp_path: Path, spy: SpyUpstream) -> None:
    async with ClientSession() as http:
        broker = Broker(config=broker_config(tmp_path, spy.url))
        await broker.__aenter__()
        stream = await http.get(f"http://127.0.0.1:{broker.http_port}/v1/map/stream")
        await _frame(stream)
        t0 = time.monotonic()
        await broker.__aexit__(None, None, None)
        assert time.monotonic() - t0 < 4.0  # the feed ends with the broker (shutdown_grace_s is 5 s)
        async with asyncio.timeout(5):
            await stream.content.read()  # the feed ended: the response reaches its end
        assert stream.content.at_eof()
        stream.close()


async def test_density_counts_every_cell_right_on_both_sides_of_zero(open_broker: tuple[Broker, str]) -> None:
    """400 users over cells west of Greenwich and south of the equator (Santiago) and across 0°:
    the frame's cells are the counts computed here in whole micro-degrees, cells under 10 hidden."""
    _, base = open_broker
    rng = random.Random(5)
    users: dict[str, tuple[int, int]] = {}  # micro-degrees, never on a cell edge
    for i in range(400):
        if i < 300:
            lat, lon = rng.randrange(-33_480_000, -33_420_000), rng.randrange(-70_690_000, -70_630_000)
        else:
            lat, lon = rng.randrange(-15_000, 15_000), rng.randrange(-15_000, 15_000)
        users[f"u{i:03d}"] = (lat + (lat % 10_000 == 0), lon + (lon % 10_000 == 0))
    now = time.time()
    updates = [{"user": u, "t": now, "lat": lat / 1e6, "lon": lon / 1e6} for u, (lat, lon) in users.items()]
    async with ClientSession() as http:
        r = await http.post(f"{base}/v1/locations", json={"updates": updates})
        assert (await r.json())["accepted"] == 400
        async with http.get(f"{base}/v1/map/stream") as stream:
            frame, _ = await _frame(stream)
    counts = Counter((lon // 10_000, lat // 10_000) for lat, lon in users.values())  # 0.01° cells
    density = frame["density"]
    assert density["cell_deg"] == 0.01
    assert {(x, y): n for x, y, n in density["cells"]} == {c: n for c, n in counts.items() if n >= 10}
    hidden = {c: n for c, n in counts.items() if n < 10}
    assert (density["hidden_cells"], density["hidden_users"]) == (len(hidden), sum(hidden.values()))
    assert hidden  # the check above covered some hidden cells too


@pytest.mark.slow
async def test_the_latest_five_windows_newest_first(tmp_path: Path, spy: SpyUpstream) -> None:
    """With 1 s windows (each published, empty or not, once a fix has arrived), a frame lists the five
    newest windows of GET /v1/published/windows, newest first, and counts all of them."""
    cfg = broker_config(tmp_path, spy.url, **{"publish.window_s": 1, "cloaking.max_update_age_s": 1.0})
    async with Broker(config=cfg) as broker, ClientSession() as http:
        base = f"http://127.0.0.1:{broker.http_port}"
        r = await http.post(f"{base}/v1/users/u1/location", json={"t": time.time(), "lat": 39.9, "lon": 116.4})
        assert r.status == 200
        async with http.get(f"{base}/v1/map/stream") as stream:
            async with asyncio.timeout(30):
                while sum((frame := (await _frame(stream))[0])["windows"]["by_outcome"].values()) < 8:
                    pass
        listing: list[dict[str, Any]] = []
        since: int | None = 0
        while since is not None:
            page = await (await http.get(f"{base}/v1/published/windows", params={"since": since})).json()
            listing += page["windows"]
            since = page["next_since"]
    recent = frame["windows"]["recent"]
    newest = recent[0]["t_start"]
    expected = sorted((w for w in listing if w["t_start"] <= newest), key=lambda w: -w["t_start"])[:5]
    assert [w["window_id"] for w in recent] == [w["window_id"] for w in expected]
    assert all(set(w) == {"window_id", "t_start", "t_end", "k", "n_in", "n_out", "status"} for w in recent)


def test_answer_latencies_older_than_the_shown_span_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no viewer, the map keeps a minute of answer latencies, not its 100,000-entry maximum."""
    import types

    from kcloak.broker import livemap
    from kcloak.broker.config import Config
    from kcloak.broker.metrics import Metrics

    now = [1000.0]
    monkeypatch.setattr(livemap, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    lm = livemap.LiveMap(config=Config(), metrics=Metrics(version="test", algorithm="test"), positions=None)  # type: ignore[arg-type]
    for _ in range(600):  # 10 minutes at 100 answers a second, no viewer
        for _ in range(100):
            lm.answered(0.05)
        now[0] += 1.0
    assert 6_000 <= len(lm._latencies) <= 6_200  # the last LATENCY_WINDOW_S (60 s) of them
