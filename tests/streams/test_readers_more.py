"""GeoLife and GPX readers and the contract CSV writer (contract §7 "Files")."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from kcloak.core.readers import (
    READERS,
    FixTable,
    ReaderError,
    read_contract_csv,
    read_fixes,
    read_geolife,
    read_gpx,
    write_contract_csv,
)

DATA = Path(__file__).resolve().parents[1] / "data"
GEOLIFE_SAMPLE = Path("/work/shared/data/research/geolife_sample")

PLT_HEADER = (
    "Geolife trajectory\r\nWGS 84\r\nAltitude is in Feet\r\nReserved 3\r\n0,2,255,My Track,0,0,2,8421376\r\n0\r\n"
)


def plt(path: Path, rows: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((PLT_HEADER + "".join(r + "\r\n" for r in rows)).encode())
    return path


def unix(year: int, month: int, day: int, h: int = 0, m: int = 0, s: int = 0) -> float:
    return datetime(year, month, day, h, m, s, tzinfo=UTC).timestamp()


# -- GeoLife ----------------------------------------------------------------------------------
def test_geolife_single_file(tmp_path: Path) -> None:
    f = plt(
        tmp_path / "007" / "Trajectory" / "20081023025304.plt",
        [
            "39.984702,116.318417,0,492,39744.1201851852,2008-10-23,02:53:04",
            "39.984683,116.31845,0,492,39744.1202546296,2008-10-23,02:53:10",
            "39.984683,116.31845,0,492,39744.1202546296,2008-10-23,02:53:10",  # repeated instant
            "95.0,116.3,0,492,39744.12,2008-10-23,02:53:20",  # latitude out of range
            "39.98,116.31,0,492,39744.12,2008-10-23",  # too few fields
            "39.98,116.31,0,492,39744.12,2008-10-23,xx:53:20",  # bad time
        ],
    )
    fx = read_fixes(f)
    assert fx.traj_id.tolist() == ["007/20081023025304"] * 2
    assert fx.t.tolist() == [unix(2008, 10, 23, 2, 53, 4), unix(2008, 10, 23, 2, 53, 10)]
    assert fx.lat.tolist() == [39.984702, 39.984683]
    assert fx.lon.tolist() == [116.318417, 116.31845]
    assert fx.bad_rows == 4


def test_geolife_folder_with_and_without_data(tmp_path: Path) -> None:
    row = "40.0,116.0,0,0,0,2009-01-01,00:00:0{}"
    plt(tmp_path / "Data" / "001" / "Trajectory" / "a.plt", [row.format(0), row.format(1)])
    plt(tmp_path / "Data" / "002" / "Trajectory" / "b.plt", [row.format(2)])
    (tmp_path / "Data" / "002" / "labels.txt").write_text("ignored\n")
    fx = read_geolife(tmp_path)
    assert sorted(set(fx.traj_id.tolist())) == ["001/a", "002/b"]
    assert len(fx) == 3
    assert read_fixes(tmp_path / "Data").traj_id.tolist() == fx.traj_id.tolist()
    assert READERS["geolife"] is read_geolife
    with pytest.raises(ReaderError):
        read_geolife(tmp_path / "Data" / "001")  # a user folder is not a dataset folder


@pytest.mark.skipif(not GEOLIFE_SAMPLE.exists(), reason="research GeoLife sample not present")
def test_geolife_research_sample_in_place() -> None:
    fx = read_fixes(GEOLIFE_SAMPLE)
    assert fx.n_trajectories == 66
    assert len(fx) + fx.bad_rows == 47_425  # every data line of the 66 files is either kept or counted
    assert unix(2007, 4, 16, 12, 58) <= fx.t.min() < unix(2007, 4, 16, 12, 59)  # user 076, README table


# -- GPX --------------------------------------------------------------------------------------
def test_gpx_real_track() -> None:
    fx = read_fixes(DATA / "around-visnjan-with-car.gpx")
    assert set(fx.traj_id.tolist()) == {"around-visnjan-with-car:0"}
    assert len(fx) == 104
    assert fx.bad_rows == 0
    assert fx.t[0] == unix(2020, 12, 18, 6, 15, 50)
    assert fx.lat[0] == 45.2735188510
    assert fx.lon[0] == 13.7142099626


def test_gpx_10_tracks_untimed_points_waypoints_and_routes(tmp_path: Path) -> None:
    doc = """<?xml version="1.0"?>
<gpx version="1.0" xmlns="http://www.topografix.com/GPX/1/0">
 <wpt lat="1" lon="1"><time>2020-01-01T00:00:00Z</time></wpt>
 <rte><rtept lat="2" lon="2"><time>2020-01-01T00:00:00Z</time></rtept></rte>
 <trk><trkseg>
  <trkpt lat="10.5" lon="20.5"><time>2020-01-01T00:00:00Z</time></trkpt>
  <trkpt lat="10.6" lon="20.6"></trkpt>
 </trkseg><trkseg>
  <trkpt lat="10.7" lon="20.7"><time>2020-01-01T00:00:10+01:00</time></trkpt>
 </trkseg></trk>
 <trk><trkseg><trkpt lat="bad" lon="1"><time>2020-01-01T00:00:00Z</time></trkpt>
  <trkpt lat="1" lon="2"><time>not a time</time></trkpt>
  <trkpt lat="3" lon="4"><time>2020-01-01T00:00:00</time></trkpt></trkseg></trk>
</gpx>"""
    f = tmp_path / "walk.gpx"
    f.write_text(doc)
    fx = read_gpx(f)
    assert fx.traj_id.tolist() == ["walk:0", "walk:0", "walk:1"]
    assert fx.t.tolist() == [unix(2020, 1, 1), unix(2019, 12, 31, 23, 0, 10), unix(2020, 1, 1)]
    assert fx.lat.tolist() == [10.5, 10.7, 3.0]
    assert fx.bad_rows == 3  # untimed point, bad latitude, bad time


def test_gpx_unreadable(tmp_path: Path) -> None:
    f = tmp_path / "x.gpx"
    f.write_text("<gpx><trk>")
    with pytest.raises(ReaderError):
        read_gpx(f)
    f.write_text("<kml/>")
    with pytest.raises(ReaderError):
        read_gpx(f)


# -- writer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["out.csv", "out.csv.gz"])
def test_write_contract_csv_round_trip(tmp_path: Path, name: str) -> None:
    table = FixTable(
        np.array(["a,b", "c"], dtype=np.str_),
        np.array([1714550400.0, 1714550400.25]),
        np.array([0.1 + 0.2, -90.0]),
        np.array([116.39803, 180.0]),
    )
    f = tmp_path / name
    write_contract_csv(f, table)
    if name == "out.csv":
        lines = f.read_text().splitlines()
        assert lines == [
            "traj_id,t,lat,lon",
            '"a,b",1714550400,0.30000000000000004,116.39803',
            "c,1714550400.25,-90.0,180.0",
        ]
    back = read_contract_csv(f)
    assert back.traj_id.tolist() == table.traj_id.tolist()
    assert back.t.tolist() == table.t.tolist()
    assert back.lat.tolist() == table.lat.tolist()
    assert back.lon.tolist() == table.lon.tolist()
