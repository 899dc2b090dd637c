"""Contract §8/§9 conformance of ``kcloak release`` and ``kcloak bench release``: exit codes for empty
input, unwritable outputs and combinations that do not apply, all-or-nothing writes, one-line messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcloak.broker.stores import open_db
from kcloak.cli import release as release_cli
from kcloak.cli.main import main
from kcloak.core.schemas import QUERYLOG_FILE
from kcloak.streams.release import ReleaseOutcome
from kcloak.streams.tables import SOURCE_FORMATS, TableKind
from tests.streams.test_release_cli import _trajectories


def _run(*argv: str) -> int:
    try:
        return main(["release", *argv, "--no-progress"])
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture(scope="module")
def traj_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conf") / "traj.csv"
    _trajectories(path, 40)
    return path


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kcloak: error: ")
    return lines[0]


def test_parser_constants_match_their_owners() -> None:
    """The table names and source formats stay spelled out in the parser (kcloak.streams.tables owns them);
    the algorithm names are kcloak.core.names' enums (tests/simulators/test_cli_conformance.py)."""
    assert tuple(k.value for k in TableKind) == release_cli.TABLES
    assert release_cli.SOURCE_FORMATS == SOURCE_FORMATS


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("header.csv", "traj_id,t,lat,lon\n"),
        ("bad_rows.csv", "traj_id,t,lat,lon\na,x,39.9,116.4\nb,1,91,116.4\n"),
        ("trips_table.csv", "trip_id,traj_id,origin_lat,origin_lon,dest_lat,dest_lon,start_t,duration_s,mode\n"),
    ],
)
def test_empty_input_exits_2(tmp_path: Path, name: str, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / name
    src.write_text(text)
    out = tmp_path / "out.csv"
    assert _run("trips", str(src), "-o", str(out), "--k", "2") == 2
    assert "no usable input rows" in _one_error_line(capsys) and not out.exists()


def test_input_without_stay_points_has_nothing_to_release(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "moving.csv"
    src.write_text("traj_id,t,lat,lon\n" + "".join(f"a,{i * 10},{39.9 + i * 0.01},116.4\n" for i in range(20)))
    out = tmp_path / "out.csv"
    assert _run("places", str(src), "-o", str(out), "--k", "2") == 1
    assert "nothing to release" in _one_error_line(capsys) and not out.exists()


def test_querylog_without_forwarded_queries_has_nothing_to_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    open_db(data / QUERYLOG_FILE.filename, QUERYLOG_FILE).close()
    out = tmp_path / "q.csv"
    assert _run("querylog", str(data), "-o", str(out), "--k", "2") == 1
    assert "no forwarded query" in _one_error_line(capsys) and not out.exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["-o", "{tmp}/missing/out.csv"], "-o: folder"),
        (["-o", "{tmp}"], "-o: "),
        (["-o", "{tmp}/out.csv", "--report", "{tmp}/missing/r.json"], "--report: folder"),
        (["-o", "{tmp}/out.csv", "--report", "{tmp}/out.csv"], "--report: must differ"),
        (["-o", "{tmp}/out.csv", "--l", "0"], "--l: must be"),
        (["-o", "{tmp}/out.csv", "--l", "2", "--l-kind", "recursive"], "--l-kind recursive: needs --c"),
        (["-o", "{tmp}/out.csv", "--l", "2", "--l-kind", "recursive", "--c", "-1"], "--c: must be"),
        (["-o", "{tmp}/out.csv", "--algorithm", "anatomy"], "--algorithm anatomy: needs --l"),
    ],
)
def test_bad_outputs_and_values_exit_2_before_any_work(
    traj_csv: Path, tmp_path: Path, extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(tmp=tmp_path) for a in extra]
    assert _run("trips", str(traj_csv), "--k", "3", *args) == 2
    assert needle in _one_error_line(capsys)
    assert not (tmp_path / "out.csv").exists()


def test_writes_are_all_or_nothing(tmp_path: Path) -> None:
    """A report that cannot be written leaves neither OUT nor temporary files behind."""
    outcome = ReleaseOutcome(("row_id", "places"), [{"row_id": "0123456789abcdef", "places": "wx4g0b7"}], {"k": 2})
    out = tmp_path / "out.csv"
    with pytest.raises(OSError):
        release_cli.write_release(out, outcome, tmp_path / "gone" / "r.json")
    assert list(tmp_path.iterdir()) == []
    release_cli.write_release(out, outcome, tmp_path / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv", "r.json"]
    assert out.read_text() == "row_id,places\n0123456789abcdef,wx4g0b7\n"


def test_summary_is_one_unwrapped_line(traj_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / ("a-rather-long-folder-name-" * 3)
    deep.mkdir()
    out, rep = deep / "trips-released.csv", deep / "trips-report.json"
    assert _run("trips", str(traj_csv), "-o", str(out), "--k", "3", "--report", str(rep), "--seed", "1") == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("released ") and lines[0].endswith(" s")
    report = json.loads(rep.read_text())
    assert report["output"] == str(out) and report["n_out"] > 0


def test_unsatisfiable_is_one_line(traj_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.csv"
    assert _run("trips", str(traj_csv), "-o", str(out), "--k", "1000", "--max-suppression", "0") == 1
    assert "not released" in _one_error_line(capsys) and not out.exists()


def test_bench_release_empty_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "header.csv"
    src.write_text("traj_id,t,lat,lon\n")
    assert main(["bench", "release", "--data", str(src), "--mondrian-rows", "0", "--json", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no usable fixes" in captured.err


def test_acd_vs_aa_ignores_empty_places_tables() -> None:
    """Zero-row places releases (a trace without stay points) make no ACD-vs-AA comparison."""
    from kcloak.cli.bench_release import BenchRow, acd_vs_aa

    rows = [BenchRow("places", algo, 5, 0, 1e-5, 0.0, None, 0, cpu_s=0.0) for algo in ("acd", "aa")]
    assert acd_vs_aa(rows) == {"ncp_ratio": None, "time_ratio": None, "holds": None, "ks": []}
    rows += [BenchRow("places", "acd", 10, 50, 0.2, 0.1, None, 0, cpu_s=0.2)]
    rows += [BenchRow("places", "aa", 10, 50, 0.1, 0.4, None, 0, cpu_s=0.1)]
    got = acd_vs_aa(rows)
    assert got["ks"] == [10] and got["ncp_ratio"] == 0.25 and got["time_ratio"] == 2.0 and got["holds"] is False
