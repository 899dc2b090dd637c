"""The Python API (``kcloak.anonymize``, ``kcloak.release``, ``kcloak.audit``) gives what the commands give.

Each equivalence test runs the command as a subprocess on a CSV and the API on the DataFrame pandas reads
from the same file (``pd.read_csv``, as a data scientist would), then compares what a client reads: the
command's output CSV (csv module, floats) and its JSON report against the API's frame and report. The CSV
holds rows each reader check must skip; their number is counted here from how the file was written.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kcloak
from kcloak.core.readers import ReaderError
from kcloak.streams.kdelta import KDeltaError
from kcloak.streams.publish import NotPublished

pd = pytest.importorskip("pandas", reason="the Python API needs pandas (extra dataframes; a dev dependency)")

T0 = 1_700_000_000
HUBS = ((39.90, 116.40), (39.95, 116.30), (39.85, 116.45))
BAD_ROWS = (
    "v0,{t},abc,116.4",  # non-numeric lat
    "v1,{t},,116.4",  # empty lat
    "v2,{t},39.9,nan",  # NaN lon
    "v3,{t},91.5,116.4",  # lat out of range
    "v4,{t},39.9,-181",  # lon out of range
    "v5,,39.9,116.4",  # empty t
    "v6,inf,39.9,116.4",  # non-finite t
    ",{t},39.9,116.4",  # no trajectory id
    "v0,{t0},39.0,116.0",  # a repeated (traj_id, t): the first occurrence is kept
)


def write_fixes(path: Path, n: int, *, points: int = 20, bad: bool = True, seed: int = 3) -> int:
    """``n`` trajectories around three hubs, one fix a minute; returns how many bad rows were written."""
    rng = np.random.default_rng(seed)
    lines = ["traj_id,t,lat,lon"]
    for i in range(n):
        la, lo = HUBS[i % 3]
        la += rng.normal(0, 0.002)
        lo += rng.normal(0, 0.002)
        for j in range(points):
            lines.append(f"v{i},{T0 + 60 * j},{la + 0.0005 * j:.6f},{lo + 0.0004 * j:.6f}")
    planted = [r.format(t=T0 + 30, t0=T0) for r in BAD_ROWS] if bad else []
    for k, row in enumerate(planted):  # spread among the good rows
        lines.insert(5 + 37 * k, row)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(planted)


def kcloak_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-m", "kcloak", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def csv_fixes(path: Path) -> list[tuple[str, float, float, float]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return [(r["traj_id"], float(r["t"]), float(r["lat"]), float(r["lon"])) for r in csv.DictReader(fh)]


def frame_fixes(frame: Any, cols: tuple[str, str, str, str] = ("traj_id", "t", "lat", "lon")) -> list[Any]:
    i, t, la, lo = cols
    ts = frame[t]
    if pd.api.types.is_datetime64_any_dtype(ts.dtype):
        epoch = pd.Timestamp(0, tz="UTC") if ts.dt.tz is not None else pd.Timestamp(0)
        ts = (ts - epoch) / pd.Timedelta(seconds=1)
    columns = (frame[i].astype(str), ts.astype(float), frame[la].astype(float), frame[lo].astype(float))
    return list(zip(*columns, strict=True))


def as_client(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(report))
    return out


@pytest.mark.parametrize("method", ["nwa", "w4m", "microagg"])
def test_anonymize_publishes_what_the_command_writes(tmp_path: Path, method: str) -> None:
    src = tmp_path / "fixes.csv"
    n_bad = write_fixes(src, 30)
    run = kcloak_cli(
        "anonymize", "fixes.csv", "-o", "out.csv", "--k", "3", "--delta", "1000", "--method", method,
        "--seed", "7", "--report", "rep.json", "--mapping", "map.csv", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    cli_rows = csv_fixes(tmp_path / "out.csv")
    cli_report = json.loads((tmp_path / "rep.json").read_text())

    # numpy scalars, as they come out of a DataFrame, are numbers like any other
    result = kcloak.anonymize(pd.read_csv(src), k=np.int64(3), delta=np.float64(1000), method=method, seed=np.int64(7))

    assert isinstance(result, kcloak.Anonymized)
    assert list(result.published.columns) == ["traj_id", "t", "lat", "lon"]
    assert frame_fixes(result.published) == cli_rows  # the same fixes, ids and row order
    assert cli_report["n_bad_rows"] == n_bad == result.n_bad_rows
    api_report = as_client(result.report)
    assert set(cli_report) - set(api_report) == {"kcloak_version", "input", "output", "format"}
    assert {k: v for k, v in api_report.items() if k != "runtime_s"} == {
        k: cli_report[k] for k in api_report if k != "runtime_s"
    }
    with open(tmp_path / "map.csv", newline="", encoding="utf-8") as fh:
        assert {r["published_id"]: r["traj_id"] for r in csv.DictReader(fh)} == result.mapping
    assert len(result.trash) == cli_report["n_trash"]
    assert set(result.trash) <= {f"v{i}" for i in range(30)} and not set(result.trash) & set(result.mapping.values())


def test_release_releases_what_the_command_writes(tmp_path: Path) -> None:
    src = tmp_path / "fixes.csv"
    n_bad = write_fixes(src, 30)
    run = kcloak_cli(
        "release", "trips", "fixes.csv", "-o", "out.csv", "--k", "4", "--seed", "1", "--report", "rep.json",
        "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "out.csv", newline="", encoding="utf-8") as fh:
        cli_rows = list(csv.DictReader(fh))
    cli_report = json.loads((tmp_path / "rep.json").read_text())

    released = kcloak.release(pd.read_csv(src), "trips", k=4, seed=1)

    assert list(released.table.columns) == list(cli_rows[0])
    assert released.table.to_dict("records") == cli_rows
    assert cli_report["n_bad_rows"] == n_bad == released.n_bad_rows
    assert int(cli_report["k_achieved"]) >= 4
    api_report = as_client(released.report)
    skip = {"runtime_s", "input", "output"}
    assert {k: v for k, v in api_report.items() if k not in skip} == {
        k: v for k, v in cli_report.items() if k not in skip
    }
    assert released.sensitive is None


def test_audit_rows_are_the_command_json_rows(tmp_path: Path) -> None:
    src = tmp_path / "fixes.csv"
    write_fixes(src, 30, bad=False)
    original = pd.read_csv(src)
    result = kcloak.anonymize(original, k=3, delta=1000, method="w4m", seed=7)
    result.published.to_csv(tmp_path / "pub.csv", index=False)
    pd.DataFrame(sorted(result.mapping.items()), columns=["published_id", "traj_id"]).to_csv(
        tmp_path / "map.csv", index=False
    )
    run = kcloak_cli(
        "audit", "trajectories", "pub.csv", "--original", "fixes.csv", "--k", "3", "--delta", "1000",
        "--mapping", "map.csv", "--methods", "nwa", "--seed", "5", "--json", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    cli = json.loads(run.stdout)

    frame = kcloak.audit(result, original, methods=["nwa"], seed=5)  # k, delta and mapping from the result

    assert tuple(frame.columns) == kcloak.api.AUDIT_COLUMNS
    assert frame.attrs["kdelta"]["ok"] is True
    assert {k: frame.attrs["kdelta"][k] for k in cli["kdelta"]} == cli["kdelta"]
    assert {r["target"] for r in cli["results"]} == {"raw", "published", "nwa"}
    rows = frame.to_dict("records")
    assert len(rows) == len(cli["results"]) == 9
    for mine, theirs in zip(rows, cli["results"], strict=True):
        assert (mine["target"], mine["m"], mine["trials"]) == (theirs["target"], theirs["m"], theirs["trials"])
        assert mine["baseline"] == theirs["baseline"] == pytest.approx(1 / 3)
        rate = theirs["reidentification_rate"]
        assert math.isnan(mine["reidentification_rate"]) if rate is None else mine["reidentification_rate"] == rate


# -- the same refusals and reasons ----------------------------------------------------------------------
@pytest.fixture
def cli_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The command line in this process (the same ``main`` as ``kcloak``): its exit code and stderr."""
    from kcloak.cli.main import main

    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        try:
            code = main([*args, "--no-progress"])
        except SystemExit as exc:
            code = int(exc.code or 0)
        return code, capsys.readouterr().err

    return run


def test_bad_input_gets_the_command_reason(tmp_path: Path, cli_error: Any) -> None:
    src = tmp_path / "fixes.csv"
    write_fixes(src, 6, bad=False)
    frame = pd.read_csv(src)
    frame.drop(columns=["lat"]).to_csv(tmp_path / "nolat.csv", index=False)

    code, err = cli_error("anonymize", "nolat.csv", "-o", "out.csv", "--k", "3", "--delta", "500")
    with pytest.raises(ReaderError, match=r"\(missing: lat\)") as missing:
        kcloak.anonymize(frame.drop(columns=["lat"]), k=3, delta=500)
    assert code == 2 and "(missing: lat)" in err and isinstance(missing.value, kcloak.core.errors.InputError)

    for flag, value, kwargs in (
        ("--k", "1", {"k": 1, "delta": 500.0}),
        ("--trash-max", "1.5", {"k": 3, "delta": 500.0, "trash_max": 1.5}),
        ("--method", "magic", {"k": 3, "delta": 500.0, "method": "magic"}),
    ):
        args = {"--k": "3", "--delta": "500", flag: value}
        code, err = cli_error("anonymize", "fixes.csv", "-o", "out.csv", *sum(args.items(), ()))
        with pytest.raises(KDeltaError) as bad:
            kcloak.anonymize(frame, **kwargs)
        assert code == 2 and str(bad.value) in err and str(bad.value).startswith(f"{flag}:")

    code, err = cli_error("anonymize", "fixes.csv", "-o", "out.csv", "--k", "7", "--delta", "500")
    with pytest.raises(NotPublished) as refused:
        kcloak.anonymize(frame, k=7, delta=500)
    assert code == 1 and "only 6 trajectories for k=7" in err and "only 6 trajectories for k=7" in str(refused.value)
    assert refused.value.report["n_in"] == 6 and refused.value.report["n_out"] == 0


def test_release_refusals_get_the_command_reason(tmp_path: Path, cli_error: Any) -> None:
    src = tmp_path / "fixes.csv"
    write_fixes(src, 6, bad=False)
    frame = pd.read_csv(src)
    code, err = cli_error("release", "trips", "fixes.csv", "-o", "out.csv", "--k", "3", "--m", "2")
    with pytest.raises(kcloak.core.errors.InputError) as bad:
        kcloak.release(frame, "trips", k=3, m=2)
    assert code == 2 and str(bad.value) == "--m: applies to places only" and str(bad.value) in err
    code, err = cli_error("release", "places", "fixes.csv", "-o", "out.csv", "--k", "3")
    from kcloak.streams.release import NothingToRelease

    with pytest.raises(NothingToRelease) as nothing:
        kcloak.release(frame, "places", k=3)
    assert code == 1 and "no places rows in the 6 trajectories" in err
    assert "no places rows in the 6 trajectories" in str(nothing.value)


# -- other frames: datetimes, scikit-mobility's column names, movingpandas ---------------------------------
def test_datetime_and_skmob_columns_come_back_as_they_went_in(tmp_path: Path) -> None:
    """A TrajDataFrame's columns (uid, datetime, lat, lng) with naive and zoned datetimes: the same release."""
    src = tmp_path / "fixes.csv"
    write_fixes(src, 18, bad=False)
    plain = pd.read_csv(src)
    base = kcloak.anonymize(plain, k=3, delta=1000, seed=2)
    cols = ("uid", "datetime", "lat", "lng")
    for tz in (None, "Asia/Shanghai"):
        when = pd.to_datetime(plain["t"], unit="s", utc=True)
        skmob = plain.assign(t=when.dt.tz_convert(tz) if tz else when.dt.tz_localize(None))
        skmob = skmob.rename(columns={"traj_id": "uid", "t": "datetime", "lon": "lng"})
        res = kcloak.anonymize(skmob, k=3, delta=1000, seed=2, traj_id_col="uid", t_col="datetime", lon_col="lng")
        assert list(res.published.columns) == list(cols)
        assert pd.api.types.is_datetime64_any_dtype(res.published["datetime"].dtype)
        assert str(res.published["datetime"].dt.tz) == str(tz)
        assert frame_fixes(res.published, cols) == frame_fixes(base.published)


def _movingpandas() -> Any:
    try:
        with warnings.catch_warnings():  # its optional smoothers
            warnings.simplefilter("ignore", UserWarning)
            import movingpandas
    except ImportError:
        if os.environ.get("CI"):
            raise  # CI installs the dataframes extra (scripts/bootstrap --tests): the test must run there
        pytest.skip("movingpandas is not installed: pip install 'kcloak[dataframes]' (scripts/bootstrap --tests)")
    return movingpandas


@pytest.mark.filterwarnings("ignore:The inplace keyword:Warning")  # movingpandas on pandas 3
def test_a_trajectory_collection_comes_back_as_one(tmp_path: Path) -> None:
    mpd = _movingpandas()
    src = tmp_path / "fixes.csv"
    write_fixes(src, 18, bad=False)
    plain = pd.read_csv(src)
    base = kcloak.anonymize(plain, k=3, delta=1000, seed=4)
    timed = plain.assign(t=pd.to_datetime(plain["t"], unit="s"))
    broken = pd.DataFrame(  # a point without latitude and one beyond ±180°: bad rows, as in a CSV
        {
            "traj_id": ["v0", "v1"],
            "t": pd.to_datetime([T0 + 30] * 2, unit="s"),
            "lat": [np.nan, 39.9],
            "lon": [116.4, 200],
        }
    )
    collection = mpd.TrajectoryCollection(
        pd.concat([timed, broken], ignore_index=True), traj_id_col="traj_id", t="t", x="lon", y="lat", crs="EPSG:4326"
    )

    def points(tc: Any) -> list[tuple[str, float, float, float]]:
        gdf = tc.to_point_gdf()
        secs = (pd.Series(gdf.index) - pd.Timestamp(0)) / pd.Timedelta(seconds=1)
        ids = gdf[tc.get_traj_id_col()].astype(str)
        return sorted(zip(ids, secs, gdf.geometry.y, gdf.geometry.x, strict=True))

    res = kcloak.anonymize(collection, k=3, delta=1000, seed=4)
    assert isinstance(res.published, mpd.TrajectoryCollection)
    assert res.n_bad_rows == 2
    assert len(res.published) == base.report["n_out"]
    assert points(res.published) == sorted(frame_fixes(base.published))

    # a collection in another CRS is brought to WGS84 first
    projected = mpd.TrajectoryCollection(timed, traj_id_col="traj_id", t="t", x="lon", y="lat", crs="EPSG:4326")
    projected = mpd.TrajectoryCollection(projected.to_point_gdf().to_crs(3857), traj_id_col="traj_id")
    moved = kcloak.anonymize(projected, k=3, delta=1000, seed=4)
    got, want = points(moved.published), points(res.published)
    assert [(i, t) for i, t, _, _ in got] == [(i, t) for i, t, _, _ in want]
    assert np.allclose([(la, lo) for _, _, la, lo in got], [(la, lo) for _, _, la, lo in want], atol=1e-9)

    frame = kcloak.audit(res, collection, seed=1)
    assert frame.attrs["kdelta"] == {**frame.attrs["kdelta"], "ok": True, "trajectories": base.report["n_out"]}


# -- import cost ----------------------------------------------------------------------------------------
def test_import_kcloak_loads_the_api_only_on_use() -> None:
    code = (
        "import sys, kcloak\n"
        "print(','.join(m for m in ('numpy', 'pandas', 'kcloak.api', 'kcloak.streams') if m in sys.modules))\n"
        "kcloak.anonymize\n"
        "print('kcloak.api' in sys.modules, sorted(set(kcloak.API) - set(dir(kcloak))))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["", "True []"]
    with pytest.raises(AttributeError, match="no attribute 'anonymise'"):
        kcloak.anonymise  # noqa: B018


def test_without_pandas_a_call_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['pandas'] = None  # as if pandas were not installed\n"
        "import kcloak\n"
        "try:\n"
        "    kcloak.anonymize(object(), k=3, delta=100.0)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "kcloak's Python API needs pandas: pip install 'kcloak[dataframes]'"


@pytest.mark.parametrize("source", ["synthetic", "trace"])
def test_audit_cloaking_rows_are_the_command_json_rows(tmp_path: Path, source: str) -> None:
    common = ["--snapshots", "3", "--queries", "40", "--k", "5", "--algorithms", "hilbert,casper", "--seed", "1"]
    if source == "synthetic":
        flags, data = ["--users", "300"], None
    else:
        write_fixes(tmp_path / "fixes.csv", 60)
        flags, data = ["--data", "fixes.csv"], pd.read_csv(tmp_path / "fixes.csv")
    run = kcloak_cli("audit", "cloaking", *flags, *common, "--json", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    cli = json.loads(run.stdout)["results"]

    frame = kcloak.audit_cloaking(
        data,
        users=300 if data is None else None,
        snapshots=3,
        queries=40,
        k=[5],
        algorithms=["hilbert", "casper"],
        seed=1,
    )

    assert tuple(frame.columns) == kcloak.api.CLOAKING_AUDIT_COLUMNS
    assert len(frame) == len(cli) == 14  # 2 algorithms × 7 attacks
    assert (frame["trials"] > 0).sum() >= 10 and frame["success_rate"].notna().sum() >= 10  # attacks really ran
    for mine, theirs in zip(frame.to_dict("records"), cli, strict=True):
        for key in ("algorithm", "k", "attack", "trials", "baseline"):
            assert mine[key] == theirs[key], key
        for key in ("success_rate", "tolerance"):
            assert math.isnan(mine[key]) if theirs[key] is None else mine[key] == theirs[key], key
        if theirs["success_rate"] is not None:
            assert mine["holds"] == (theirs["success_rate"] <= theirs["baseline"] + theirs["tolerance"])
    assert frame.attrs["seed"] == 1
