"""``kcloak bench lbs`` (contract §9 ``--json`` shape): timings, candidate-set sizes, zero violations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcloak.broker.lbs_bench import LbsBenchConfig, search_stream
from kcloak.cli.main import main
from kcloak.core.geometry import bbox_area_m2
from kcloak.core.places import load_pois


def test_bench_lbs_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lbs", "--requests", "40", "--seed", "3", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bench"] == "lbs"
    rows = doc["results"]
    assert [(r["kind"], r["category"]) for r in rows] == [
        ("knn", "any"),
        ("knn", "one"),
        ("range", "any"),
        ("range", "one"),
    ]
    for r in rows:
        assert r["requests"] == 20 and r["pois"] == 499 and r["violations"] == 0
        assert 0 < r["us_p50"] <= r["us_p99"] and 0 <= r["cpu_us_p50"] <= r["cpu_us_p99"]
        assert r["candidates_mean"] >= r["exact_mean"]
        assert r["candidates_over_exact"] is None or r["candidates_over_exact"] >= 1.0
    knn_any = rows[0]
    assert knn_any["exact_mean"] >= 1.0  # kNN without a category always has an answer


def test_bench_lbs_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lbs", "--requests", "6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "bench lbs" in out and "violations" in out and "knn" in out and "range" in out


def test_stream_is_seeded_and_within_the_area_cap() -> None:
    pois = load_pois(None)
    config = LbsBenchConfig(requests=200, max_area_m2=1e6, n_max=4, seed=9)
    cases = search_stream(pois, config)
    assert cases == search_stream(pois, config)
    assert cases != search_stream(pois, LbsBenchConfig(requests=200, max_area_m2=1e6, n_max=4, seed=10))
    for c in cases:
        b = c.box
        assert bbox_area_m2(b.min_lon, b.min_lat, b.max_lon, b.max_lat) <= 1e6 * 1.01  # micro-degree rounding
        assert 1 <= c.n <= 4 and 100.0 <= c.radius_m <= 2000.0
    assert {c.category is None for c in cases} == {True, False}


@pytest.mark.parametrize(
    "flags",
    [["--requests", "0"], ["--max-area-m2", "nan"], ["--max-area-m2", "10"], ["--n-max", "0"], ["--seed", "-1"]],
)
def test_bench_lbs_bad_flags_exit_2(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lbs", "--no-progress", *flags]) == 2
    assert "kcloak: error:" in capsys.readouterr().err


def test_bench_lbs_bad_poi_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.csv"
    assert main(["bench", "lbs", "--pois", str(missing), "--requests", "2", "--no-progress"]) == 2
    empty = tmp_path / "empty.csv"
    empty.write_text("poi_id,lat,lon,category,name\n", encoding="utf-8")
    assert main(["bench", "lbs", "--pois", str(empty), "--requests", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err.count("kcloak: error:") == 2
