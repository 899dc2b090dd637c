"""Table builders (contract §8): stays, trips, places, querylog from files and a real data directory."""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.broker.stores import open_db
from kcloak.core import geohash
from kcloak.core.places import load_pois, parse_pois
from kcloak.core.readers import FixTable, read_fixes
from kcloak.core.schemas import FIXES, FORWARDED, MOVEMENT_FILE, QUERYLOG_FILE
from kcloak.streams.tables import (
    BuildOptions,
    NotApplicableSource,
    TableError,
    TableKind,
    build_from_fixes,
    build_table,
    detect_stays,
    read_table_csv,
)

RESEARCH = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "research"
R = 6_371_008.8


def _hav(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    a = math.sin((p2 - p1) / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(math.radians(lon2 - lon1) / 2) ** 2
    return 2 * R * math.asin(math.sqrt(a))


def _offset(lat: float, lon: float, north_m: float, east_m: float) -> tuple[float, float]:
    return lat + math.degrees(north_m / R), lon + math.degrees(east_m / (R * math.cos(math.radians(lat))))


def _journey(traj: str, t0: float = 1_700_000_000.0) -> list[tuple[str, float, float, float]]:
    """Stay at A (30 min), drive 3 km north at 10 m/s, stay at B (25 min), walk east at 1.5 m/s (10 min)."""
    rows: list[tuple[str, float, float, float]] = []
    rng = np.random.default_rng(len(traj))
    a = (39.9000, 116.4000)
    t = t0
    for _ in range(31):  # 30 min every 60 s, jitter ≤ 30 m
        la, lo = _offset(*a, float(rng.uniform(-20, 20)), float(rng.uniform(-20, 20)))
        rows.append((traj, t, la, lo))
        t += 60
    for j in range(1, 31):  # 300 s at 10 m/s, every 10 s
        rows.append((traj, t - 50 + 10 * j, *_offset(*a, 100.0 * j, 0.0)))
    t = rows[-1][1] + 10
    b = _offset(*a, 3100.0, 0.0)
    for _ in range(26):
        la, lo = _offset(*b, float(rng.uniform(-20, 20)), float(rng.uniform(-20, 20)))
        rows.append((traj, t, la, lo))
        t += 60
    for j in range(1, 21):  # 600 s at 1.5 m/s, every 30 s
        rows.append((traj, t - 60 + 30 * j, *_offset(*b, 0.0, 45.0 * j)))
    return rows


def _fixes(rows: list[tuple[str, float, float, float]], bad: int = 0) -> FixTable:
    return FixTable(
        np.array([r[0] for r in rows], dtype=np.str_),
        np.array([r[1] for r in rows]),
        np.array([r[2] for r in rows]),
        np.array([r[3] for r in rows]),
        bad,
    )


def _pois_near_a() -> str:
    la, lo = _offset(39.9, 116.4, 50.0, 0.0)
    fa, fo = _offset(39.9, 116.4, 400.0, 0.0)
    return f"poi_id,lat,lon,category,name\np1,{la:.6f},{lo:.6f},cafe,Near\np2,{fa:.6f},{fo:.6f},bank,Far\n"


def test_staypoints_of_a_known_journey() -> None:
    fx = _fixes(_journey("u1") + _journey("u2", 1_700_100_000.0))
    tab = build_from_fixes(fx, TableKind.STAYPOINTS, BuildOptions(), parse_pois(_pois_near_a()))
    assert len(tab) == 4 and tab.n_trajectories == 2
    rows = sorted(tab.rows, key=lambda r: (r["traj_id"], int(r["arrival_t"])))
    a, b = rows[0], rows[1]
    assert int(a["arrival_t"]) == 1_700_000_000 and int(a["duration_s"]) >= 1800
    assert 1500 <= int(b["duration_s"]) <= 1800  # 25 min, plus fixes of the approach and walk within 200 m
    assert _hav(float(a["lat"]), float(a["lon"]), 39.9, 116.4) < 30
    assert a["category"] == "cafe" and b["category"] == "unknown"  # nearest POI within 100 m, else unknown
    assert set(tab.rows[0]) == {"staypoint_id", "traj_id", "lat", "lon", "arrival_t", "duration_s", "category"}


def test_trips_and_modes() -> None:
    fx = _fixes(_journey("u1"))
    tab = build_from_fixes(fx, TableKind.TRIPS, BuildOptions())
    rows = sorted(tab.rows, key=lambda r: int(r["start_t"]))
    assert [r["mode"] for r in rows] == ["vehicle", "walk"]  # the trajectory starts in stay A: no first trip
    drive = rows[0]
    assert _hav(float(drive["origin_lat"]), float(drive["origin_lon"]), 39.9, 116.4) < 200
    la, lo = _offset(39.9, 116.4, 3100.0, 0.0)
    assert _hav(float(drive["dest_lat"]), float(drive["dest_lon"]), la, lo) < 200
    assert 240 <= int(drive["duration_s"]) <= 420  # 300 s of driving, ends within 200 m of the stays
    # without stays the whole trajectory is one trip
    flat = build_from_fixes(fx, TableKind.TRIPS, BuildOptions(stay_min_s=10_000))
    assert len(flat) == 1 and flat.rows[0]["duration_s"] == str(int(fx.t[-1] - fx.t[0]))


def test_places_bags() -> None:
    fx = _fixes(_journey("u1") + _journey("u2", 1_700_100_000.0))
    tab = build_from_fixes(fx, TableKind.PLACES, BuildOptions(place_precision=6))
    assert len(tab) == 2
    for row in tab.rows:
        cells = row["places"].split(" ")
        assert len(cells) == 2 and cells == sorted(cells) and all(len(c) == 6 for c in cells)
    stays = build_from_fixes(fx, TableKind.STAYPOINTS, BuildOptions(), load_pois(None))
    u1 = [r for r in stays.rows if r["traj_id"] == "u1"]
    expect = sorted(geohash.encode([float(r["lat"]) for r in u1], [float(r["lon"]) for r in u1], 6))
    assert next(r for r in tab.rows if r["traj_id"] == "u1")["places"] == " ".join(expect)


def _reference_stays(
    t: list[float], lat: list[float], lon: list[float], radius: float, min_s: float
) -> list[tuple[int, int]]:
    """Li et al.'s sequential scan, written plainly (one trajectory)."""
    out, i, n = [], 0, len(t)
    while i < n:
        j = i + 1
        while j < n and _hav(lat[i], lon[i], lat[j], lon[j]) <= radius:
            j += 1
        if t[j - 1] - t[i] >= min_s:
            out.append((i, j - 1))
            i = j
        else:
            i += 1
    return out


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(1, 400), st.floats(-150, 150), st.floats(-150, 150)), min_size=1, max_size=120
    ),
    radius=st.sampled_from([50.0, 200.0]),
    min_s=st.sampled_from([300.0, 1200.0]),
)
def test_vectorized_stays_equal_the_sequential_scan(
    steps: list[tuple[int, float, float]], radius: float, min_s: float
) -> None:
    t, lat, lon = [0.0], [39.9], [116.4]
    for dt, dn, de in steps:
        la, lo = _offset(lat[-1], lon[-1], dn, de)
        t.append(t[-1] + dt)
        lat.append(la)
        lon.append(lo)
    fx = _fixes([("x", a, b, c) for a, b, c in zip(t, lat, lon, strict=True)])
    got = detect_stays(fx, radius_m=radius, min_s=min_s)
    assert list(zip(got.first.tolist(), got.last.tolist(), strict=True)) == _reference_stays(t, lat, lon, radius, min_s)


def test_bad_rows_are_counted(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    lines = ["traj_id,t,lat,lon"] + [f"{r[0]},{r[1]},{r[2]:.7f},{r[3]:.7f}" for r in _journey("u1")]
    lines += ["u1,abc,39.9,116.4", "u2,1700000000,95,116.4", "u3,1700000000,,116.4"]
    src.write_text("\n".join(lines) + "\n")
    tab = build_table(src, TableKind.TRIPS)
    assert tab.n_bad_rows == 3 and len(tab) == 2
    with pytest.raises(NotApplicableSource):
        build_table(src, TableKind.QUERYLOG)
    with pytest.raises(TableError):
        build_table(tmp_path / "missing.csv", TableKind.TRIPS)


def test_table_csv_input(tmp_path: Path) -> None:
    src = tmp_path / "stays.csv"
    src.write_text(
        "extra,staypoint_id,traj_id,lat,lon,arrival_t,duration_s,category\n"
        "x,s1,a,39.9,116.4,1700000000,1300,cafe\n"
        "x,s2,a,39.91,116.41,1700000100.0,1400,bank\n"
        "x,s3,b,91,116.4,1700000000,1300,cafe\n"
        "x,s4,b,39.9,116.4,1700000000,-5,cafe\n"
        "x,s5,b,39.9,116.4,1700000000,1300,{bad}\n"
    )
    tab = build_table(src, TableKind.STAYPOINTS)
    assert len(tab) == 2 and tab.n_bad_rows == 3 and tab.rows[1]["arrival_t"] == "1700000100"
    places = tmp_path / "places.csv"
    places.write_text("traj_id,places\na,wx4g0b7 wx4g0b1\nb,wx4g0b7 nothere!\n")
    ptab = read_table_csv(places, TableKind.PLACES)
    assert ptab.rows == [{"traj_id": "a", "places": "wx4g0b1 wx4g0b7"}] and ptab.n_bad_rows == 1


def _data_dir(path: Path) -> Path:
    path.mkdir()
    mv = open_db(path / MOVEMENT_FILE.filename, MOVEMENT_FILE)
    rows = _journey("alice") + _journey("bob", 1_700_000_500.0)
    mv.executemany(FIXES.insert_sql(), rows)
    mv.execute(FIXES.insert_sql(), ("carol", 1700000000, 123.0, 116.4))  # bad: latitude out of range
    mv.close()
    ql = open_db(path / QUERYLOG_FILE.filename, QUERYLOG_FILE)
    ql.executemany(
        FORWARDED.insert_sql(),
        [
            (
                1700000000.4,
                "range",
                500.0,
                None,
                "cafe",
                116.39,
                39.89,
                116.41,
                39.91,
                None,
                None,
                3.9e6,
                5,
                "hilbert",
                "ok",
            ),
            (
                1700000001.6,
                "knn",
                None,
                3,
                None,
                116.39,
                39.89,
                116.41,
                39.91,
                None,
                None,
                3.9e6,
                6,
                "hilbert",
                "upstream_error",
            ),
            (float("nan"), "knn", None, 3, None, 116.39, 39.89, 116.41, 39.91, None, None, 3.9e6, 6, "hilbert", "ok"),
        ],
    )
    ql.close()
    return path


def test_data_directory(tmp_path: Path) -> None:
    d = _data_dir(tmp_path / "data")
    stays = build_table(d, TableKind.STAYPOINTS)
    assert stays.n_bad_rows == 1 and stays.n_trajectories == 2 and len(stays) == 4
    assert {r["traj_id"] for r in stays.rows} == {"alice", "bob"}
    ql = build_table(d, TableKind.QUERYLOG)
    assert ql.n_bad_rows == 1 and len(ql) == 2
    first, second = sorted(ql.rows, key=lambda r: r["t"])
    assert first == {
        "t": "1700000000",
        "lat": "39.9",
        "lon": "116.4",
        "area_m2": "3900000",
        "kind": "range",
        "radius_m": "500",
        "n": "",
        "category": "cafe",
    }
    assert (
        second["t"] == "1700000002" and second["radius_m"] == "" and second["n"] == "3" and second["category"] == "any"
    )


def test_data_directory_read_only_while_written(tmp_path: Path) -> None:
    """A broker holding the database open in WAL mode does not stop a release from reading it."""
    d = _data_dir(tmp_path / "data")
    writer = sqlite3.connect(d / "movement.sqlite3", isolation_level=None)
    writer.execute("BEGIN")
    writer.execute(FIXES.insert_sql(), ("dave", 1700000000, 39.9, 116.4))
    try:
        tab = build_table(d, TableKind.TRIPS)
        assert tab.n_trajectories == 2  # the uncommitted fix is not visible
    finally:
        writer.execute("ROLLBACK")
        writer.close()


@pytest.mark.skipif(not (RESEARCH / "geolife_sample").is_dir(), reason="GeoLife research sample absent")
def test_geolife_sample_in_place() -> None:
    fx = read_fixes(RESEARCH / "geolife_sample")
    started = time.perf_counter()
    opts = BuildOptions()
    stays = build_from_fixes(fx, TableKind.STAYPOINTS, opts, load_pois(None))
    trips = build_from_fixes(fx, TableKind.TRIPS, opts)
    places = build_from_fixes(fx, TableKind.PLACES, opts)
    assert time.perf_counter() - started < 30
    assert len(stays) > 10 and len(trips) > len(places) > 0
    assert all(int(r["duration_s"]) >= 1200 for r in stays.rows)
    assert {r["mode"] for r in trips.rows} <= {"walk", "bike", "vehicle"}
    assert sum(len(r["places"].split(" ")) for r in places.rows) == len(stays)
    # each stay's fixes lie within the radius of its first fix
    sfx = fx.sorted()
    got = detect_stays(sfx, radius_m=200.0, min_s=1200.0)
    for f, last in zip(got.first.tolist()[:20], got.last.tolist()[:20], strict=True):
        assert all(_hav(sfx.lat[f], sfx.lon[f], sfx.lat[j], sfx.lon[j]) <= 200.0 for j in range(f, last + 1))


def test_geohash_encoder() -> None:
    assert geohash.encode([57.64911], [10.40744], 11) == ["u4pruydqqvj"]  # the classic reference point
    assert geohash.encode([39.9087], [116.3975], 7) == ["wx4g09n"]
    min_lon, min_lat, max_lon, max_lat = geohash.cell_bounds("wx4g09n")
    assert min_lon <= 116.3975 < max_lon and min_lat <= 39.9087 < max_lat
    assert geohash.string_of(geohash.code_of("wx4g09n"), 7) == "wx4g09n"
    rng = np.random.default_rng(0)
    lat, lon = rng.uniform(-90, 90, 500), rng.uniform(-180, 180, 500)
    cells = geohash.encode(lat, lon, 6)
    codes = geohash.encode_codes(lat, lon, 6)
    assert sorted(cells) == [cells[i] for i in np.argsort(codes, kind="stable")]  # string order = code order
    for c, la, lo in zip(cells[:50], lat[:50], lon[:50], strict=True):
        b = geohash.cell_bounds(c)
        assert b[0] <= lo <= b[2] and b[1] <= la <= b[3]
    with pytest.raises(geohash.GeohashError):
        geohash.code_of("wx4a")  # 'a' is not in the alphabet
