"""``kcloak release`` end to end through ``kcloak.cli.main.main``: outputs, report, exit codes (contract §8, §9)."""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcloak.broker.stores import open_db
from kcloak.cli.main import main
from kcloak.core.schemas import FORWARDED, QUERYLOG_FILE

R = 6_371_008.8
REPORT_FIELDS = {
    "kcloak_version", "table", "algorithm", "input", "output", "k", "l", "l_kind", "c", "t", "m",
    "max_suppression", "quasi_identifiers", "sensitive", "n_in", "n_out", "suppressed_rows", "classes",
    "k_achieved", "l_achieved", "t_achieved", "metrics", "runtime_s", "seed",
}  # fmt: skip


def _offset(lat: float, lon: float, north_m: float, east_m: float) -> tuple[float, float]:
    return lat + math.degrees(north_m / R), lon + math.degrees(east_m / (R * math.cos(math.radians(lat))))


def _trajectories(path: Path, n: int, seed: int = 5) -> None:
    """``n`` people: a 25-minute stay near one of four hubs, then a 2 km drive or a 600 m walk."""
    rng = np.random.default_rng(seed)
    hubs = [(39.90, 116.40), (39.95, 116.30), (39.85, 116.45), (39.99, 116.33)]
    lines = ["traj_id,t,lat,lon"]
    for i in range(n):
        la, lo = _offset(*hubs[i % 4], float(rng.uniform(-300, 300)), float(rng.uniform(-300, 300)))
        t = 1_700_000_000 + int(rng.integers(0, 3600))
        for _ in range(26):
            p = _offset(la, lo, float(rng.uniform(-15, 15)), float(rng.uniform(-15, 15)))
            lines.append(f"p{i},{t},{p[0]:.6f},{p[1]:.6f}")
            t += 60
        speed = 10.0 if i % 3 else 1.2
        for j in range(1, 21):
            p = _offset(la, lo, speed * 50 * j, 0.0)
            lines.append(f"p{i},{t + 50 * (j - 1)},{p[0]:.6f},{p[1]:.6f}")
    path.write_text("\n".join(lines) + "\n")


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def _classes(rows: list[dict[str, str]], qi: list[str]) -> Counter[tuple[str, ...]]:
    return Counter(tuple(r[c] for c in qi) for r in rows)


def _run(*argv: str) -> int:
    return main(["release", *argv, "--no-progress"])


@pytest.fixture(scope="module")
def traj_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("release") / "people.csv"
    _trajectories(p, 48)
    return p


def _check_ids(rows: list[dict[str, str]]) -> None:
    ids = [r["row_id"] for r in rows]
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids) and len(set(ids)) == len(ids)


def test_trips_release(traj_csv: Path, tmp_path: Path) -> None:
    out, rep = tmp_path / "trips.csv", tmp_path / "trips.json"
    assert (
        _run("trips", str(traj_csv), "-o", str(out), "--k", "4", "--l", "2", "--seed", "3", "--report", str(rep)) == 0
    )
    cols, rows = _read(out)
    assert cols == ["row_id", "origin_lat", "origin_lon", "dest_lat", "dest_lon", "start_t", "duration_s", "mode"]
    _check_ids(rows)
    report = json.loads(rep.read_text())
    assert set(report) >= REPORT_FIELDS
    assert report["table"] == "trips" and report["algorithm"] == "mondrian" and report["sensitive"] == "mode"
    assert report["quasi_identifiers"] == ["origin", "destination", "start_t", "duration_s"]
    assert report["n_in"] == 48 and report["n_out"] == len(rows) == 48 - report["suppressed_rows"]
    assert report["m"] is None and report["seed"] == 3
    qi = ["origin_lat", "origin_lon", "dest_lat", "dest_lon", "start_t", "duration_s"]
    classes = _classes(rows, qi)
    assert min(classes.values()) == report["k_achieved"] >= 4 and len(classes) == report["classes"]
    for key in classes:
        assert len({r["mode"] for r in rows if tuple(r[c] for c in qi) == key}) >= 2
    assert set(report["metrics"]) == {"ncp", "discernibility", "prec", "whd", "modification_rate"}


def test_same_seed_same_release(traj_csv: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    assert _run("staypoints", str(traj_csv), "-o", str(a), "--k", "3", "--seed", "9") == 0
    assert _run("staypoints", str(traj_csv), "-o", str(b), "--k", "3", "--seed", "9") == 0
    assert a.read_bytes() == b.read_bytes()


def test_pycanon_checks_released_tables(traj_csv: Path, tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas", reason="pandas is a test-only dependency")
    anonymity = pytest.importorskip("pycanon.anonymity", reason="pycanon is the outside checker")
    cases: list[tuple[str, list[str], str]] = [
        ("trips", ["origin_lat", "origin_lon", "dest_lat", "dest_lon", "start_t", "duration_s"], "mode"),
        ("staypoints", ["lat", "lon", "arrival_t", "duration_s"], "category"),
    ]
    for table, qi, sens in cases:
        for algorithm in ("mondrian", "mdav"):
            out = tmp_path / f"{table}-{algorithm}.csv"
            rep = tmp_path / f"{table}-{algorithm}.json"
            args = [table, str(traj_csv), "-o", str(out), "--k", "5", "--algorithm", algorithm, "--report", str(rep)]
            assert _run(*args) == 0
            df = pd.read_csv(out, dtype=str, keep_default_na=False)
            report = json.loads(rep.read_text())
            assert anonymity.k_anonymity(df, qi) == report["k_achieved"] >= 5
            assert anonymity.l_diversity(df, qi, [sens]) >= 1


def test_staypoints_with_pois_and_anatomy(traj_csv: Path, tmp_path: Path) -> None:
    pois = tmp_path / "pois.csv"
    hubs = [(39.90, 116.40), (39.95, 116.30), (39.85, 116.45), (39.99, 116.33)]
    lines = ["poi_id,lat,lon,category,name"]
    for h, hub in enumerate(hubs):  # a 100 m grid of POIs, categories alternating: every stay gets one
        for i, j in itertools.product(range(-4, 5), repeat=2):
            la, lo = _offset(*hub, 100.0 * i, 100.0 * j)
            lines.append(f"h{h}_{i}_{j},{la:.6f},{lo:.6f},{'abc'[(i + 2 * j) % 3]},")
    pois.write_text("\n".join(lines) + "\n")
    out = tmp_path / "stays.csv"
    args = ["staypoints", str(traj_csv), "-o", str(out), "--k", "2", "--l", "2", "--algorithm", "anatomy"]
    assert _run(*args, "--pois", str(pois), "--stay-radius-m", "150") == 0
    cols, rows = _read(out)
    assert cols == ["row_id", "lat", "lon", "arrival_t", "duration_s", "group_id"]
    scols, srows = _read(tmp_path / "stays.sensitive.csv")
    assert scols == ["group_id", "category", "count"]
    assert sum(int(r["count"]) for r in srows) == len(rows)
    groups = Counter(r["group_id"] for r in rows)
    for g in groups:
        assert len({r["category"] for r in srows if r["group_id"] == g}) >= 2


def _km_ok(bags: list[list[str]], k: int, m: int) -> bool:
    counters = [Counter(b) for b in bags]
    for bag in bags:
        for i in range(1, m + 1):
            for sb in set(itertools.combinations(sorted(bag), i)):
                need = Counter(sb)
                if sum(1 for c in counters if all(c[x] >= n for x, n in need.items())) < k:
                    return False
    return True


@pytest.mark.parametrize("algorithm", ["acd", "aa"])
def test_places_release(traj_csv: Path, tmp_path: Path, algorithm: str) -> None:
    out, rep = tmp_path / "places.csv", tmp_path / "places.json"
    args = ["places", str(traj_csv), "-o", str(out), "--k", "5", "--m", "1", "--algorithm", algorithm]
    assert _run(*args, "--max-suppression", "0.1", "--report", str(rep)) == 0
    cols, rows = _read(out)
    assert cols == ["row_id", "places"]
    _check_ids(rows)
    report = json.loads(rep.read_text())
    assert report["algorithm"] == algorithm and report["m"] == 1 and report["sensitive"] is None
    assert report["quasi_identifiers"] == ["places"] and report["l"] is None and report["t_achieved"] is None
    assert report["n_in"] == 48 and report["n_out"] + report["suppressed_rows"] == 48
    assert report["suppressed_rows"] <= math.floor(0.1 * 48)
    bags = [r["places"].split(" ") for r in rows]
    assert _km_ok(bags, 5, 1) and report["k_achieved"] >= 5
    assert 0 <= report["metrics"]["ncp"] <= 1 and report["metrics"]["discernibility"] is None
    form = re.compile(r"[0-9b-hjkmnp-z]{7}|[0-9b-hjkmnp-z]{0,6}\*|\*|\[[0-9b-hjkmnp-z]{7},[0-9b-hjkmnp-z]{7}[)\]]")
    assert all(form.fullmatch(item) for bag in bags for item in bag)


def test_querylog_from_data_dir(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    conn = open_db(d / QUERYLOG_FILE.filename, QUERYLOG_FILE)
    rng = np.random.default_rng(1)
    rows = []
    for i in range(40):
        x, y = 116.3 + rng.random() * 0.1, 39.85 + rng.random() * 0.1
        cat = ["cafe", "bank", None][i % 3]
        rows.append((1_700_000_000 + 37 * i, "range", 300.0, None, cat, x, y, x + 0.01, y + 0.01, None, None,
                     8.5e5, 5, "hilbert", "ok"))  # fmt: skip
    conn.executemany(FORWARDED.insert_sql(), rows)
    conn.close()
    out, rep = tmp_path / "ql.csv", tmp_path / "ql.json"
    assert _run("querylog", str(d), "-o", str(out), "--k", "5", "--report", str(rep)) == 0
    cols, released = _read(out)
    assert cols == ["row_id", "t", "lat", "lon", "area_m2", "kind", "radius_m", "n", "category"]
    assert {r["category"] for r in released} <= {"cafe", "bank", "any"} and all(r["n"] == "" for r in released)
    assert min(_classes(released, ["t", "lat", "lon"]).values()) >= 5
    report = json.loads(rep.read_text())
    assert report["quasi_identifiers"] == ["t", "lat", "lon"] and report["sensitive"] == "category"


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["places", "{csv}", "--k", "3", "--algorithm", "mondrian"],  # tabular algorithm on places
        ["trips", "{csv}", "--k", "3", "--algorithm", "acd"],  # places algorithm on trips
        ["places", "{csv}", "--k", "3", "--l", "2"],  # no sensitive column
        ["trips", "{csv}", "--k", "3", "--m", "2"],  # m is for places
        ["trips", "{csv}", "--k", "3", "--c", "2"],  # c without recursive
        ["trips", "{csv}", "--k", "3", "--t", "1.5"],
        ["trips", "{csv}", "--k", "3", "--algorithm", "anatomy"],  # anatomy needs l
        ["querylog", "{csv}", "--k", "3"],  # a query log is not built from trajectories
        ["trips", "{missing}", "--k", "3"],
        ["trips", "{csv}", "--k", "0"],
        ["staypoints", "{csv}", "--k", "3", "--pois", "{missing}"],
        ["trips", "{csv}", "--k", "3", "--stay-radius-m", "-1"],
        ["places", "{csv}", "--k", "3", "--place-precision", "13"],
    ],
)
def test_usage_errors_exit_2(
    traj_csv: Path, tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.csv"
    args = [a.format(csv=traj_csv, missing=tmp_path / "nope.csv") for a in argv]
    assert _run(args[0], args[1], "-o", str(out), *args[2:]) == 2
    assert "error" in _err(capsys) and not out.exists()


def test_unknown_flag_exits_2(traj_csv: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        _run("trips", str(traj_csv), "-o", str(tmp_path / "o.csv"), "--k", "3", "--bogus")
    assert exc.value.code == 2


def test_unsatisfiable_exits_1(traj_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.csv"
    assert _run("trips", str(traj_csv), "-o", str(out), "--k", "100", "--max-suppression", "0") == 1
    assert "not released" in _err(capsys) and not out.exists()
    assert _run("places", str(traj_csv), "-o", str(out), "--k", "100", "--max-suppression", "0") == 1
    assert not out.exists()


def test_table_csv_roundtrip(tmp_path: Path) -> None:
    """A CSV that already holds the built columns is released as is (identifiers dropped)."""
    src = tmp_path / "trips_in.csv"
    rng = np.random.default_rng(4)
    lines = ["trip_id,traj_id,origin_lat,origin_lon,dest_lat,dest_lon,start_t,duration_s,mode"]
    for i in range(30):
        lines.append(
            f"t{i},u{i},{39.9 + rng.random() / 50:.5f},{116.4 + rng.random() / 50:.5f},"
            f"{39.95 + rng.random() / 50:.5f},{116.3 + rng.random() / 50:.5f},{1_700_000_000 + i * 60},"
            f"{600 + i},{['walk', 'bike'][i % 2]}"
        )
    lines.append("bad,u,x,116,39,116,1,1,walk")
    src.write_text("\n".join(lines) + "\n")
    out, rep = tmp_path / "o.csv.gz", tmp_path / "r.json"
    assert _run("trips", str(src), "-o", str(out), "--k", "3", "--report", str(rep)) == 0
    with gzip.open(out, "rt") as fh:
        text = fh.read()
    assert "u1," not in text and "t1," not in text and text.startswith("row_id,origin_lat")
    report: dict[str, Any] = json.loads(rep.read_text())
    assert report["n_in"] == 30 and report["n_bad_rows"] == 1


def test_bench_release_json(traj_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "release", "--data", str(traj_csv), "--k", "3,5", "--mondrian-rows", "3000", "--json"]
    assert main([*argv, "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == "release"
    rows = report["results"]
    fields = {"table", "algorithm", "k", "rows", "runtime_s", "ncp", "discernibility", "suppressed_rows"}
    assert all(fields <= set(r) for r in rows)
    assert {(r["table"], r["algorithm"]) for r in rows} == {
        ("trips", "mondrian"),
        ("staypoints", "mondrian"),
        ("places", "acd"),
        ("places", "aa"),
        ("synthetic-trips", "mondrian"),
    }
    cmp = report["acd_vs_aa"]
    assert set(cmp) >= {"ncp_ratio", "time_ratio", "holds"} and cmp["ks"] == [3, 5]
    places = {(r["algorithm"], r["k"]): r for r in rows if r["table"] == "places"}
    expect = sum(places[("acd", k)]["ncp"] / places[("aa", k)]["ncp"] for k in (3, 5)) / 2
    assert cmp["ncp_ratio"] == pytest.approx(expect, abs=1e-4)
    assert cmp["holds"] == (cmp["ncp_ratio"] <= 0.5 and cmp["time_ratio"] <= 1.4)


def test_bench_release_bad_flags(traj_csv: Path, tmp_path: Path) -> None:
    assert main(["bench", "release", "--data", str(traj_csv), "--tables", "querylog", "--json"]) == 2
    assert main(["bench", "release", "--data", str(traj_csv), "--k", "x", "--json"]) == 2
    assert main(["bench", "release", "--data", str(tmp_path / "none.csv"), "--json"]) == 2
