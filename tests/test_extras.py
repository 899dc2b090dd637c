"""The core install works without the extras, and a missing extra gives one line saying how to get it.

Each command runs in a child interpreter whose import system refuses the extras' modules (matplotlib and
Pillow of ``report``; nats-py and Dask of ``cluster``; pandas and the trajectory libraries a DataFrame
extra would bring) as if they were not installed, and records every attempt to import one. The core
paths (``serve`` with a query forwarded to ``lbs``, ``bench cloak``, ``anonymize``, ``release``, the
demo without pictures) must run and attempt none of them; a command asked for pictures must stop before
its work with the one-line hint and exit 1 (``kcloak.cli.main.EXIT_CODES``: a missing part of the
installation is not bad input).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conformance.conftest import free_port, http_json, wait_http

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("matplotlib", "PIL", "nats", "dask", "distributed", "pandas", "movingpandas", "skmob")
HINT = "kcloak: error: pictures need the report extra: pip install 'kcloak[report]'"

# argv: [record file, kcloak args...]. Refuses every BLOCKED module as a missing one would be refused,
# and writes the names it was asked for to the record file at exit.
CHILD = f"""
import atexit, json, sys
BLOCKED = {BLOCKED!r}
asked = []

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            asked.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
record = sys.argv[1]
atexit.register(lambda: open(record, "w").write(json.dumps(asked)))
from kcloak.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _argv(record: Path, *args: str) -> list[str]:
    return [sys.executable, "-I", "-c", CHILD, str(record), *args]


def _run(tmp_path: Path, *args: str, timeout: float = 120.0) -> tuple[int, str, str, list[str]]:
    record = tmp_path / f"asked-{args[0]}.json"
    proc = subprocess.run(_argv(record, *args), cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    asked: list[str] = json.loads(record.read_text()) if record.exists() else ["<no record>"]
    return proc.returncode, proc.stdout, proc.stderr, asked


class _Children:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, tmp_path: Path, record: Path, *args: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"{record.stem}.log").open("wb")
        proc = subprocess.Popen(_argv(record, *args), cwd=tmp_path, stdout=log, stderr=log, start_new_session=True)
        self.procs.append(proc)
        return proc


@pytest.fixture
def children() -> Iterator[_Children]:
    c = _Children()
    yield c
    for proc in c.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_serve_and_lbs_forward_a_query_without_the_extras(tmp_path: Path, children: _Children) -> None:
    lbs_port, http_port = free_port(), free_port()
    lbs_rec, serve_rec = tmp_path / "lbs.json", tmp_path / "serve.json"
    lbs = children.start(tmp_path, lbs_rec, "lbs", "--http", f"127.0.0.1:{lbs_port}")
    serve = children.start(
        tmp_path,
        serve_rec,
        "serve",
        "--http",
        f"127.0.0.1:{http_port}",
        "--mqtt-listen",
        f"127.0.0.1:{free_port()}",
        "--upstream",
        f"http://127.0.0.1:{lbs_port}",
        "--data-dir",
        str(tmp_path / "data"),
        "--publish-window-s",
        "0",
    )
    wait_http(f"http://127.0.0.1:{lbs_port}/healthz", proc=lbs)
    base = f"http://127.0.0.1:{http_port}"
    wait_http(f"{base}/healthz", proc=serve)
    now = time.time()
    updates = [
        {"user": f"u{i}", "t": now, "lat": 39.9087 + 0.0004 * (i % 5), "lon": 116.3975 + 0.0004 * (i // 5)}
        for i in range(20)
    ]
    status, _, body = http_json("POST", f"{base}/v1/locations", {"updates": updates})
    assert (status, body["accepted"]) == (200, 20), body
    status, _, answer = http_json(
        "POST", f"{base}/v1/users/u7/query", {"query_id": "q1", "kind": "knn", "n": 3, "category": "restaurant"}
    )
    assert status == 200 and answer["status"] == "ok", answer  # cloaked and forwarded to the LBS
    for proc in (serve, lbs):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert json.loads(serve_rec.read_text()) == []
    assert json.loads(lbs_rec.read_text()) == []


def test_cloak_anonymize_and_release_without_the_extras(tmp_path: Path) -> None:
    code, out, err, asked = _run(
        tmp_path,
        "bench",
        "cloak",
        "--users",
        "2000",
        "--requests",
        "100",
        "--k",
        "5",
        "--algorithms",
        "nn,hilbert",
        "--json",
        "--no-progress",
    )
    assert code == 0, err
    results = json.loads(out)
    assert results and asked == []
    ais = str(ROOT / "tests" / "data" / "ais_nyharbor.csv.gz")
    code, _, err, asked = _run(
        tmp_path, "anonymize", ais, "-o", "out.csv", "--k", "3", "--delta", "20000", "--method", "w4m", "--no-progress"
    )
    assert code == 0 and (tmp_path / "out.csv").stat().st_size > 0, err
    assert asked == []
    code, _, err, asked = _run(tmp_path, "release", "trips", ais, "-o", "trips.csv", "--k", "2", "--l", "1")
    assert code == 0 and (tmp_path / "trips.csv").stat().st_size > 0, err
    assert asked == []


@pytest.mark.parametrize(
    "args",
    [
        ("audit", "cloaking", "--users", "200", "--snapshots", "1", "--report", "audit"),
        ("bench", "anonymize", "--sizes", "100", "--plot", "tradeoff.png", "--no-progress"),
    ],
    ids=["audit-report", "bench-plot"],
)
def test_pictures_without_the_report_extra_give_one_line_and_exit_1(tmp_path: Path, args: tuple[str, ...]) -> None:
    code, out, err, asked = _run(tmp_path, *args)
    assert (code, out, err) == (1, "", HINT + "\n")
    assert asked == ["matplotlib"]  # one attempt, before any work: nothing else was written
    assert sorted(os.listdir(tmp_path)) == [f"asked-{args[0]}.json"]


def test_demo_without_the_report_extra_writes_its_summary_and_says_how_to_get_pictures(tmp_path: Path) -> None:
    code, out, err, asked = _run(
        tmp_path, "demo", "--users", "300", "--duration", "8", "--report", "rep", "--no-progress", timeout=180
    )
    assert code == 0, err
    assert "kcloak demo: note: summary.json only: pictures need the report extra: pip install 'kcloak[report]'" in err
    assert asked == ["matplotlib"]  # the availability probe, nothing imported
    assert sorted(os.listdir(tmp_path / "rep")) == ["summary.json"]
    assert "report: rep/ summary.json\n" in out
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["users"] == 300 and summary["updates"] > 0
