"""``kcloak lbs`` over real HTTP on 127.0.0.1 (contract §4 error body, §5, §9, §10)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from kcloak.broker.lbs import LbsEngine, LonLatBox
from kcloak.broker.lbs_server import REGION_FIELDS, SEARCH_FIELDS, LbsServer
from kcloak.broker.upstream import SearchRequest as UpstreamRequest
from kcloak.broker.upstream import UpstreamClient
from kcloak.core.logs import JsonFormatter
from kcloak.core.places import Poi, PoiSet

ROOT = Path(__file__).resolve().parents[2]
PSEUDONYM = "3f9a0c5e1b7d42a8a9e6c0d4f1b2a3c4"
BBOX = [116.391204, 39.903381, 116.402877, 39.913012]


def make_pois() -> PoiSet:
    rng = np.random.default_rng(5)
    cats = ("cafe", "restaurant", "bank")
    return PoiSet(
        tuple(
            Poi(
                f"n{9000 - i:05d}",  # ids not in file order, to see the sort
                round(39.9 + float(rng.uniform(-0.03, 0.03)), 6),
                round(116.4 + float(rng.uniform(-0.03, 0.03)), 6),
                cats[i % 3],
                f"place {i}",
            )
            for i in range(90)
        ),
        0,
    )


POIS = make_pois()


def body(**over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"pseudonym": PSEUDONYM, "kind": "knn", "region": {"bbox": BBOX}, "n": 3}
    out.update(over)
    return {k: v for k, v in out.items() if v is not None}


@pytest.fixture
async def lbs() -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    async with LbsServer(POIS, host="127.0.0.1", port=0) as server, aiohttp.ClientSession() as session:
        yield server.url, session


async def post(session: aiohttp.ClientSession, url: str, data: Any, **kw: Any) -> tuple[int, Any]:
    raw = json.dumps(data) if isinstance(data, dict | list) else data  # bytes, str or a chunk stream
    headers = kw.pop("headers", {"Content-Type": "application/json"})
    async with session.post(url + "/v1/search", data=raw, headers=headers, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


# --- happy paths -----------------------------------------------------------------------------


async def test_knn_and_range_return_the_engine_candidates_sorted(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    engine = LbsEngine(POIS)
    box = LonLatBox.of(BBOX)
    status, doc = await post(session, url, body())
    assert status == 200
    ids = [c["poi_id"] for c in doc["candidates"]]
    assert ids == sorted(ids) and len(ids) >= 3
    assert ids == [POIS.pois[i].poi_id for i in engine.knn_candidates(box, 3)]
    first = doc["candidates"][0]
    poi = next(p for p in POIS.pois if p.poi_id == first["poi_id"])
    assert first == {"poi_id": poi.poi_id, "lat": poi.lat, "lon": poi.lon, "category": poi.category, "name": poi.name}

    status, doc = await post(session, url, body(kind="range", n=None, radius_m=800, category="cafe"))
    assert status == 200
    ids = [c["poi_id"] for c in doc["candidates"]]
    assert ids == [POIS.pois[i].poi_id for i in engine.range_candidates(box, 800, "cafe")]
    assert {c["category"] for c in doc["candidates"]} <= {"cafe"} and ids


async def test_temporal_region_fewer_than_n_and_unknown_category(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    region = {"bbox": BBOX, "t_start": 1714550400, "t_end": 1714550460}
    status, doc = await post(session, url, body(region=region, n=100, category="bank"))
    assert status == 200 and len(doc["candidates"]) == 30  # every bank: fewer than n match
    status, doc = await post(session, url, body(category="no such category"))
    assert (status, doc) == (200, {"candidates": []})


async def test_body_of_exactly_64_kib_is_accepted(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    raw = json.dumps(body())
    raw = raw + " " * (65536 - len(raw))
    assert len(raw.encode()) == 65536
    status, _ = await post(session, url, raw)
    assert status == 200


async def test_other_routes(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    async with session.get(url + "/healthz") as resp:
        doc = await resp.json()
        assert resp.status == 200 and doc["status"] == "ok" and doc["pois"] == 90 and "version" in doc
    async with session.get(url + "/v1/categories") as resp:
        assert await resp.json() == {
            "categories": [
                {"category": "bank", "count": 30},
                {"category": "cafe", "count": 30},
                {"category": "restaurant", "count": 30},
            ]
        }
    async with session.get(url + "/v1/openapi.json") as resp:
        api = await resp.json()
    assert api["openapi"] == "3.1.0"
    assert set(api["paths"]) == {"/v1/search", "/v1/categories", "/v1/openapi.json", "/healthz", "/metrics"}
    schemas = api["components"]["schemas"]
    assert set(schemas["SearchRequest"]["properties"]) == SEARCH_FIELDS
    assert set(schemas["Region"]["properties"]) == REGION_FIELDS
    assert schemas["SearchRequest"]["additionalProperties"] is False


# --- errors ----------------------------------------------------------------------------------

MARK = 7.654321  # a value that must never be echoed
INVALID_BODIES: list[tuple[str, Any, str | None]] = [
    ("unknown top-level field", body(user_id="alice"), "user_id"),
    ("unknown region field", body(region={"bbox": BBOX, "lat": MARK}), "region.lat"),
    ("no pseudonym", body(pseudonym=None), "pseudonym"),
    ("bad pseudonym", body(pseudonym="ABC"), "pseudonym"),
    ("unknown kind", body(kind="nearest"), "kind"),
    ("no kind", body(kind=None), "kind"),
    ("no region", body(region=None), "region"),
    ("region not an object", body(region=[1, 2]), "region"),
    ("bbox of three", body(region={"bbox": BBOX[:3]}), "region.bbox"),
    ("bbox with a string", body(region={"bbox": [*BBOX[:3], "39.9"]}), "region.bbox"),
    ("bbox with a boolean", body(region={"bbox": [*BBOX[:3], True]}), "region.bbox"),
    ("latitude out of range", body(region={"bbox": [116.0, 39.0, 117.0, 90.5]}), "region.bbox"),
    ("longitude out of range", body(region={"bbox": [-180.5, 39.0, 117.0, 40.0]}), "region.bbox"),
    ("min above max", body(region={"bbox": [117.0, 39.0, 116.0, 40.0]}), "region.bbox"),
    ("huge integer", body(region={"bbox": [*BBOX[:3], 10**400]}), "region.bbox"),
    ("t_start alone", body(region={"bbox": BBOX, "t_start": 1}), "region.t_start"),
    ("t_end before t_start", body(region={"bbox": BBOX, "t_start": 5, "t_end": 4}), "region.t_start"),
    ("n float", body(n=5.0), "n"),
    ("n string", body(n="5"), "n"),
    ("n boolean", body(n=True), "n"),
    ("n zero", body(n=0), "n"),
    ("n 101", body(n=101), "n"),
    ("knn without n", body(n=None), "n"),
    ("knn with radius", body(radius_m=100), "radius_m"),
    ("range with n", body(kind="range", radius_m=100), "n"),
    ("range without radius", body(kind="range", n=None), "radius_m"),
    ("radius zero", body(kind="range", n=None, radius_m=0), "radius_m"),
    ("radius too large", body(kind="range", n=None, radius_m=50000.5), "radius_m"),
    ("radius boolean", body(kind="range", n=None, radius_m=True), "radius_m"),
    ("empty category", body(category=""), "category"),
    ("long category", body(category="x" * 65), "category"),
    ("control character in category", body(category="caf\u0007e"), "category"),
    ("category null", {**body(), "category": None}, "category"),
    ("category number", body(category=MARK), "category"),
    ("top level array", [body()], None),
]


@pytest.mark.parametrize(("case", "doc", "field"), INVALID_BODIES, ids=[c for c, _, _ in INVALID_BODIES])
async def test_invalid_requests_are_400_without_echo(
    lbs: tuple[str, aiohttp.ClientSession], case: str, doc: Any, field: str | None
) -> None:
    url, session = lbs
    status, err = await post(session, url, doc)
    assert status == 400, case
    assert err["error"]["code"] == "invalid" and isinstance(err["error"]["message"], str)
    assert err["error"].get("field") == field
    text = json.dumps(err)
    assert str(MARK) not in text and "alice" not in text and "39.9" not in text


@pytest.mark.parametrize(
    "raw",
    [
        '{"pseudonym": "3f9a0c5e1b7d42a8a9e6c0d4f1b2a3c4", "kind": "knn", "n": NaN}',
        '{"kind": "knn", "n": Infinity}',
        '{"kind": "knn", "n": -Infinity}',
        '{"kind": "knn",',
        "[" * 20 + "]" * 20,
        '{"a":' * 17 + "1" + "}" * 17,
        "\ufeff" + json.dumps(body()),
        b'{"kind": "\xff"}',
    ],
    ids=["nan", "infinity", "minus-infinity", "truncated", "array-depth", "object-depth-17", "bom", "not-utf8"],
)
async def test_malformed_json_is_400(lbs: tuple[str, aiohttp.ClientSession], raw: str | bytes) -> None:
    url, session = lbs
    data = raw.encode("utf-8") if isinstance(raw, str) else raw
    status, err = await post(session, url, data)
    assert status == 400 and err["error"]["code"] == "invalid"


async def test_depth_16_is_accepted_up_to_the_schema(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    deep: Any = 1
    for _ in range(15):
        deep = {"x": deep}  # with the top-level object: 16 levels
    status, err = await post(session, url, {**body(), "extra": deep})
    assert status == 400 and err["error"]["field"] == "extra"  # past the JSON rules, stopped by strictness


async def test_too_large_bodies_are_413(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    raw = json.dumps(body()) + " " * 65536
    status, err = await post(session, url, raw)
    assert status == 413 and err == {"error": {"code": "too_large", "message": err["error"]["message"]}}

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: aiohttp's own limit
        yield json.dumps(body()).encode()
        for _ in range(70):
            yield b" " * 1024

    status, err = await post(session, url, chunks())
    assert status == 413 and err["error"]["code"] == "too_large"


@pytest.mark.parametrize(
    "headers",
    [{"Content-Type": "text/plain"}, {}, {"Content-Type": "application/json; charset=latin-1"}],
    ids=["text-plain", "missing", "latin-1"],
)
async def test_non_json_media_type_is_415(lbs: tuple[str, aiohttp.ClientSession], headers: dict[str, str]) -> None:
    url, session = lbs
    status, err = await post(session, url, json.dumps(body()).encode(), headers=headers)
    assert status == 415 and err["error"]["code"] == "unsupported_media_type"


async def test_json_with_utf8_charset_parameter_is_accepted(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    status, _ = await post(
        session, url, json.dumps(body()), headers={"Content-Type": "application/json; charset=UTF-8"}
    )
    assert status == 200


async def test_aiohttp_404_and_405_get_the_error_body(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    async with session.get(url + "/v1/nothing") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    async with session.get(url + "/v1/search") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
    async with session.post(url + "/healthz") as resp:
        assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_engine_failure_is_500_and_logged_without_payload(
    lbs: tuple[str, aiohttp.ClientSession], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    url, session = lbs

    def boom(self: LbsEngine, box: LonLatBox, n: int, category: str | None = None) -> Any:
        raise RuntimeError("engine broke")

    monkeypatch.setattr(LbsEngine, "knn_candidates", boom)
    with caplog.at_level(logging.DEBUG):
        status, err = await post(session, url, body(category="cafe"))
    assert status == 500 and err == {"error": {"code": "internal", "message": "internal error"}}
    lines = [JsonFormatter().format(r) for r in caplog.records]
    assert any('"event":"internal_error"' in line and '"error":"RuntimeError"' in line for line in lines)
    assert not any(PSEUDONYM in line or "cafe" in line or "116.39" in line for line in lines)


# --- metrics and log privacy ----------------------------------------------------------------


async def test_metrics_count_requests_candidates_and_errors(lbs: tuple[str, aiohttp.ClientSession]) -> None:
    url, session = lbs
    status, doc = await post(session, url, body())
    assert status == 200
    await post(session, url, body(kind="range", n=None, radius_m=300))
    await post(session, url, body(n=0))
    await post(session, url, b"not json")
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    assert 'kcloak_lbs_requests_total{kind="knn",status="200"} 1.0' in text
    assert 'kcloak_lbs_requests_total{kind="range",status="200"} 1.0' in text
    assert 'kcloak_lbs_requests_total{kind="knn",status="400"} 1.0' in text
    assert 'kcloak_lbs_requests_total{kind="unknown",status="400"} 1.0' in text
    assert f'kcloak_lbs_candidates_sum{{kind="knn"}} {float(len(doc["candidates"]))}' in text
    assert 'kcloak_lbs_seconds_count{kind="knn"} 2.0' in text
    assert "kcloak_upstream" not in text and "python_gc" not in text  # its own registry


async def test_logs_hold_no_coordinates_ids_or_categories(
    lbs: tuple[str, aiohttp.ClientSession], caplog: pytest.LogCaptureFixture
) -> None:
    url, session = lbs
    with caplog.at_level(logging.DEBUG):
        status, doc = await post(session, url, body(category="restaurant"))
        await post(session, url, body(n=0))
        async with session.get(url + "/v1/missing"):
            pass
    assert status == 200 and doc["candidates"]
    lines = [JsonFormatter().format(r) for r in caplog.records]
    assert any('"route":"/v1/search"' in line for line in lines)
    secrets = [PSEUDONYM, "restaurant", "116.39", "39.90", *(c["poi_id"] for c in doc["candidates"])]
    for line in lines:
        assert not any(s in line for s in secrets), line


# --- the CLI as a process --------------------------------------------------------------------


def kcloak(*args: str) -> list[str]:
    return [sys.executable, "-I", "-m", "kcloak", *args]


async def _startup_url(proc: asyncio.subprocess.Process) -> str:
    assert proc.stderr is not None
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
        assert line, "kcloak lbs exited before serving"
        m = re.search(r"serving \d+ POIs .* on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return m.group(1)


def _write_pois(path: Path) -> None:
    rows = ["poi_id,lat,lon,category,name"] + [f"{p.poi_id},{p.lat},{p.lon},{p.category},{p.name}" for p in POIS.pois]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
async def test_cli_serves_and_stops_gracefully(tmp_path: Path, sig: signal.Signals) -> None:
    pois = tmp_path / "pois.csv"
    _write_pois(pois)
    proc = await asyncio.create_subprocess_exec(
        *kcloak("lbs", "--pois", str(pois), "--http", "127.0.0.1:0"),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        url = await _startup_url(proc)
        async with aiohttp.ClientSession() as session:
            status, doc = await post(session, url, body(kind="range", n=None, radius_m=500))
            async with session.get(url + "/healthz") as resp:
                health = await resp.json()
        assert status == 200 and doc["candidates"] and health["pois"] == 90
        proc.send_signal(sig)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    assert "kcloak lbs: stopped" in err.decode()


def _run_cli(*args: str) -> tuple[int, str]:
    import subprocess

    r = subprocess.run(kcloak("lbs", *args), capture_output=True, text=True, timeout=60, cwd=ROOT)
    return r.returncode, r.stderr


def test_cli_bad_input_exits_2(tmp_path: Path) -> None:
    code, err = _run_cli("--pois", str(tmp_path / "missing.csv"), "--http", "127.0.0.1:0")
    assert code == 2 and "POI file" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("this,is,not\na,poi,file\n")
    code, err = _run_cli("--pois", str(bad), "--http", "127.0.0.1:0")
    assert code == 2 and "POI file" in err
    empty = tmp_path / "empty.csv"
    empty.write_text("poi_id,lat,lon,category,name\nx,999,0,cafe,\n")
    code, err = _run_cli("--pois", str(empty), "--http", "127.0.0.1:0")
    assert code == 2 and "no usable POIs" in err
    code, _ = _run_cli("--http", "localhost")
    assert code == 2


def test_cli_port_in_use_exits_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = _run_cli("--http", f"127.0.0.1:{port}")
    assert code == 1 and "address already in use" in err


async def test_the_broker_upstream_client_accepts_the_answers() -> None:
    """The broker's own client (allow-listed request, strict response check) against ``kcloak lbs``."""
    engine = LbsEngine(POIS)
    async with LbsServer(POIS, port=0) as server, UpstreamClient(url=server.url) as client:
        got = await client.search(UpstreamRequest(kind="knn", bbox=BBOX, n=4, category="cafe", t_start=1, t_end=2))
        ranged = await client.search(UpstreamRequest(kind="range", bbox=BBOX, radius_m=700.0))
    box = LonLatBox.of(BBOX)
    assert [c.poi_id for c in got] == [POIS.pois[i].poi_id for i in engine.knn_candidates(box, 4, "cafe")]
    assert [c.poi_id for c in ranged] == [POIS.pois[i].poi_id for i in engine.range_candidates(box, 700.0)]
