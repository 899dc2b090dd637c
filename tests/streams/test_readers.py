"""The shared trajectory readers (contract §7 "Files"): contract CSV and AIS."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.core.readers import (
    READERS,
    FixTable,
    ReaderError,
    detect_format,
    parse_iso8601,
    read_ais,
    read_contract_csv,
    read_fixes,
)

REAL_AIS = Path(__file__).resolve().parents[1] / "data" / "ais_nyharbor.csv.gz"


def write(path: Path, text: str, *, newline: str = "\n") -> Path:
    data = text.replace("\n", newline).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


# -- contract CSV -----------------------------------------------------------------------------
def test_contract_csv_columns_in_any_order_extra_ignored(tmp_path: Path) -> None:
    f = write(tmp_path / "a.csv", "lon,speed,t,traj_id,lat\n116.5,3,100,a,39.9\n116.6,4,101.5,b,40.0\n")
    fx = read_contract_csv(f)
    assert fx.traj_id.tolist() == ["a", "b"]
    assert fx.t.tolist() == [100.0, 101.5]
    assert fx.lat.tolist() == [39.9, 40.0]
    assert fx.lon.tolist() == [116.5, 116.6]
    assert fx.bad_rows == 0


def test_contract_csv_gz_crlf_and_quoting(tmp_path: Path) -> None:
    text = 'traj_id,t,lat,lon\n"x,1",1,2.5,3.5\n"say ""hi""",2,-90,180\n'
    fx = read_fixes(write(tmp_path / "q.csv.gz", text, newline="\r\n"))
    assert fx.traj_id.tolist() == ["x,1", 'say "hi"']
    assert fx.lat.tolist() == [2.5, -90.0]
    assert fx.lon.tolist() == [3.5, 180.0]
    assert fx.bad_rows == 0


def test_bad_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    text = (
        "traj_id,t,lat,lon\n"
        "a,1,10,20\n"  # good
        "a,2,,20\n"  # missing lat
        "a,3,ten,20\n"  # unparsable
        "a,4,90.5,20\n"  # lat out of range
        "a,5,10,-180.01\n"  # lon out of range
        "a,nan,10,20\n"  # not finite
        "a,6,inf,20\n"  # not finite
        ",7,10,20\n"  # missing traj_id
        "a,8,10\n"  # short row
        "a,1.0,11,21\n"  # repeated (traj_id, t): same t as the first row
        "b,1,10,20\n"  # same t, other trajectory: good
        "\n"  # a blank line is not a row
        "a,9,10,20\n"  # good
    )
    fx = read_contract_csv(write(tmp_path / "bad.csv", text))
    assert fx.traj_id.tolist() == ["a", "b", "a"]
    assert fx.t.tolist() == [1.0, 1.0, 9.0]
    assert fx.lat.tolist() == [10.0, 10.0, 10.0]  # the repeat kept the first row's values
    assert fx.bad_rows == 9


def test_repeat_keeps_first_in_file_order_even_when_unsorted(tmp_path: Path) -> None:
    text = "traj_id,t,lat,lon\nz,5,1,1\na,3,2,2\nz,5,3,3\nz,4,4,4\n"
    fx = read_contract_csv(write(tmp_path / "u.csv", text))
    assert list(zip(fx.traj_id.tolist(), fx.t.tolist(), fx.lat.tolist(), strict=True)) == [
        ("z", 5.0, 1.0),
        ("a", 3.0, 2.0),
        ("z", 4.0, 4.0),
    ]
    assert fx.bad_rows == 1
    s = fx.sorted()
    assert s.traj_id.tolist() == ["a", "z", "z"]
    assert s.t.tolist() == [3.0, 4.0, 5.0]


def test_header_only_is_empty(tmp_path: Path) -> None:
    fx = read_contract_csv(write(tmp_path / "h.csv", "traj_id,t,lat,lon\n"))
    assert len(fx) == 0
    assert fx.bad_rows == 0
    assert fx.n_trajectories == 0


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("missing_col.csv", "traj_id,t,lat\na,1,2\n"),
        ("empty.csv", ""),
    ],
)
def test_unusable_header_is_an_error(tmp_path: Path, name: str, content: str) -> None:
    with pytest.raises(ReaderError):
        read_contract_csv(write(tmp_path / name, content))


def test_unreadable_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ReaderError):
        read_fixes(tmp_path / "nope.csv")
    broken = tmp_path / "broken.csv.gz"
    broken.write_bytes(b"this is not gzip at all")
    with pytest.raises(ReaderError):
        read_fixes(broken)


def test_truncated_gzip_is_an_error(tmp_path: Path) -> None:
    rows = "".join(f"u{i},{i},1,1\n" for i in range(20000))
    data = gzip.compress(("traj_id,t,lat,lon\n" + rows).encode())
    f = tmp_path / "trunc.csv.gz"
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReaderError):
        read_fixes(f)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 5),
            st.one_of(st.floats(-90, 90), st.floats(90.001, 1e6), st.just(float("nan"))),
            st.floats(-180, 180),
        ),
        max_size=30,
    )
)
def test_good_rows_round_trip_and_the_rest_are_counted(
    tmp_path_factory: pytest.TempPathFactory, rows: list[tuple[str, int, float, float]]
) -> None:
    path = tmp_path_factory.mktemp("rt") / "r.csv"
    path.write_text("traj_id,t,lat,lon\n" + "".join(f"{a},{t},{la!r},{lo!r}\n" for a, t, la, lo in rows))
    fx = read_contract_csv(path)
    seen: set[tuple[str, int]] = set()
    expect = []
    for a, t, la, lo in rows:
        if np.isfinite(la) and abs(la) <= 90 and (a, t) not in seen:
            seen.add((a, t))
            expect.append((a, float(t), la, lo))
    got = list(zip(fx.traj_id.tolist(), fx.t.tolist(), fx.lat.tolist(), fx.lon.tolist(), strict=True))
    assert got == expect
    assert fx.bad_rows == len(rows) - len(expect)


# -- AIS --------------------------------------------------------------------------------------
def test_ais_time_parsing_and_case_insensitive_columns(tmp_path: Path) -> None:
    text = (
        "mmsi,BASEDATETIME,Lat,lon,SOG\n"
        "367000140,2020-06-30T00:00:00,40.64409,-74.07157,0.0\n"  # no offset: UTC
        "367000140,2020-06-30T00:00:10Z,40.6441,-74.0716,0.1\n"
        "366999618,2020-06-30T02:00:05+02:00,40.54291,-74.02433,19.0\n"  # = 00:00:05Z
        "366999618,2020-06-30 00:00:07,40.5,-74.0,1\n"  # space separator
        "366999618,30/06/2020 00:00:09,40.5,-74.0,1\n"  # not ISO 8601: bad row
        "366999618,2020-06-30T00:00:07,40.6,-74.1,1\n"  # repeated (MMSI, t): bad row
    )
    fx = read_ais(write(tmp_path / "ais.csv", text))
    base = datetime(2020, 6, 30, tzinfo=UTC).timestamp()
    assert fx.t.tolist() == [base, base + 10, base + 5, base + 7]
    assert fx.traj_id.tolist() == ["367000140", "367000140", "366999618", "366999618"]
    assert fx.lat.tolist()[0] == 40.64409
    assert fx.lon.tolist()[0] == -74.07157
    assert fx.bad_rows == 2


def test_ais_with_unix_time_column(tmp_path: Path) -> None:
    fx = read_ais(write(tmp_path / "ais_t.csv.gz", "LAT,LON,T,MMSI\n1,2,1000.5,9\n1,2,x,9\n"))
    assert fx.t.tolist() == [1000.5]
    assert fx.traj_id.tolist() == ["9"]
    assert fx.bad_rows == 1


def test_ais_without_time_column_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ReaderError):
        read_ais(write(tmp_path / "ais_bad.csv", "MMSI,LAT,LON\n1,2,3\n"))


def test_parse_iso8601_offsets() -> None:
    assert parse_iso8601("1970-01-01T00:00:00") == 0.0
    assert parse_iso8601("1970-01-01T01:00:00+01:00") == 0.0
    assert parse_iso8601("1970-01-01T00:00:01.5Z") == 1.5
    with pytest.raises(ValueError):
        parse_iso8601("yesterday")


def test_real_ais_sample() -> None:
    fx = read_fixes(REAL_AIS)
    # 8,689 rows, 295 vessels; two vessels repeat their last timestamp (00:59:59).
    assert len(fx) == 8687
    assert fx.bad_rows == 2
    assert fx.n_trajectories == 295
    assert fx.t.min() == datetime(2020, 6, 30, tzinfo=UTC).timestamp()


# -- format detection -------------------------------------------------------------------------
def test_detect_format(tmp_path: Path) -> None:
    assert detect_format(write(tmp_path / "c.csv", "traj_id,t,lat,lon\n")) == "csv"
    assert detect_format(write(tmp_path / "m.csv.gz", "MMSI,BaseDateTime,LAT,LON\n")) == "ais"
    assert detect_format(tmp_path / "x.gpx") == "gpx"
    assert detect_format(tmp_path / "x.plt") == "geolife"
    assert detect_format(tmp_path) == "geolife"
    assert set(READERS) >= {"csv", "ais"}


def test_read_fixes_dispatches_and_rejects_unsupported_formats(tmp_path: Path) -> None:
    ais = write(tmp_path / "m.csv", "MMSI,BaseDateTime,LAT,LON\n7,1970-01-01T00:01:00,1,2\n")
    fx = read_fixes(ais)
    assert isinstance(fx, FixTable)
    assert fx.t.tolist() == [60.0]
    with pytest.raises(ReaderError):
        read_fixes(ais, "csv")  # not a contract CSV header
    with pytest.raises(ReaderError, match="not supported"):
        read_fixes(ais, "w4m")  # a name that is no input format
