"""``kcloak demo``: end to end through ``kcloak.cli.main.main``, Ctrl-C, flags, and the street crop it drives on."""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from kcloak.cli._demo_run import crop_streets, demo_area, traffic_end
from kcloak.cli.main import main
from kcloak.simulators.streets import StreetGraph, parse_osm
from tests.simulators.test_report import CONTRACT_KEYS, EXTENSION_KEYS

FILES = ("summary.json", "map.png", "cloak_area.png", "achieved_k.png", "latency.png")
CHECKOUT = Path(__file__).resolve().parents[2]


def _check_report(report: Path, users: int) -> dict[str, Any]:
    for name in FILES:
        assert (report / name).is_file(), name
    for name in FILES[1:]:
        with Image.open(report / name) as img:
            img.verify()
    s: dict[str, Any] = json.loads((report / "summary.json").read_text())
    assert list(s) == CONTRACT_KEYS + EXTENSION_KEYS
    assert s["users"] == users and s["algorithm"] == "hilbert"
    # Every query sent is answered ok, refused, or was still unanswered when the run ended.
    assert s["queries"] == s["ok"] + s["refused"] + s["unanswered"]
    assert s["unanswered"] <= max(5, s["queries"] // 100)
    assert s["refused"] == sum(s["refusals"].values())
    # Every step sends one fix per user.
    assert s["updates"] > 0 and s["updates"] % users == 0
    assert s["updates_per_s"] == pytest.approx(s["updates"] / s["duration_s"], rel=0.02)
    if s["ok"] + s["refused"]:
        assert s["success_rate"] == pytest.approx(s["ok"] / (s["ok"] + s["refused"]), abs=1e-4)
    if s["ok"]:
        assert s["achieved_k_mean"] >= 5  # the smallest k of the profile mix
        assert 0 < s["cloak_area_m2_median"] <= 4e6  # the default max_area_m2
    assert s["latency_ms_p50"] is None or s["latency_ms_p50"] <= s["latency_ms_p99"]
    assert isinstance(s["published_windows"], int) and s["published_windows"] >= 0
    return s


def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report"
    t0 = time.monotonic()
    code = main(["demo", "--users", "200", "--duration", "10", "--report", str(report), "--no-progress"])
    elapsed = time.monotonic() - t0
    assert code == 0
    s = _check_report(report, 200)
    # Start-up counts inside --duration: users move until 2.5 s before its end, at least half of it.
    assert 4.5 <= s["duration_s"] <= 8.0
    assert s["updates"] >= 200 * 4
    assert s["queries"] > 0 and s["ok"] > 0  # 200 users in a 3.7 km square: k = 5..20 is reachable
    assert elapsed < 40
    out = capsys.readouterr()
    assert "kcloak demo summary" in out.out
    assert "[3/4]" in out.err
    assert re.search(r"live map: http://127\.0\.0\.1:\d+/map", out.err)


def test_ctrl_c_stops_early_and_still_writes_the_report(tmp_path: Path) -> None:
    report = tmp_path / "report"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-I",
        "-m",
        "kcloak",
        "demo",
        "--users",
        "200",
        "--duration",
        "120",
        "--report",
        str(report),
    ]
    proc = subprocess.Popen(cmd, cwd=CHECKOUT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            if "users are moving" in line or time.monotonic() > deadline:
                break
        time.sleep(2.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    s = _check_report(report, 200)
    assert 1.0 < s["duration_s"] < 30
    assert "stopped early" in out


def test_demo_runs_from_a_folder_whose_files_shadow_package_names(tmp_path: Path) -> None:
    """Files named like kcloak's packages in the current folder change nothing: the demo and its
    children (``-I -m kcloak``) put no current folder on ``sys.path`` (issue 14)."""
    here = tmp_path / "work"
    here.mkdir()
    for name in ("broker", "streams", "kcloak", "cloaking", "simulators"):
        (here / f"{name}.py").write_text(f"raise ImportError('the current folder\\'s {name}.py was imported')\n")
    report = tmp_path / "report"
    cmd = [sys.executable, "-I", "-m", "kcloak", "demo", "--users", "50", "--duration", "5"]
    proc = subprocess.run(
        [*cmd, "--report", str(report), "--no-progress"], cwd=here, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "was imported" not in proc.stderr
    # Each start-up step is shown as it happens, in order, each line with the seconds since the start.
    steps = [
        "kcloak demo: starting",
        "started the kcloak broker",
        "[1/4] kcloak broker",
        "[2/4] reference LBS",
        "[3/4] 50 users",
        "setting 50 privacy profiles",
        "users are moving",
        "[4/4] writing the report",
    ]
    lines = proc.stderr.splitlines()
    at = [next((i for i, line in enumerate(lines) if line.lstrip().startswith(step)), -1) for step in steps]
    assert -1 not in at and at == sorted(at), proc.stderr
    seconds = [float(re.findall(r"\(([\d.]+) s", lines[i])[0]) for i in at[:5]]
    assert seconds == sorted(seconds), proc.stderr
    assert "kcloak demo summary" in proc.stdout
    s = json.loads((report / "summary.json").read_text())
    assert s["users"] == 50 and s["updates"] > 0


@pytest.mark.parametrize(
    "flags",
    [["--users", "0"], ["--users", "x"], ["--duration", "0"], ["--duration", "nan"], ["--algorithm", "nope"]],
)
def test_bad_flags_exit_2(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *flags])
    assert exc.value.code == 2


def test_report_path_that_is_a_file_exits_2(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["demo", "--report", str(f), "--no-progress"]) == 2


def test_traffic_end_counts_the_start_up_inside_the_duration() -> None:
    assert traffic_end(100.0, 104.0, 60.0) == pytest.approx(157.5)  # 60 s after the start, less 2.5 s
    assert traffic_end(100.0, 110.0, 10.0) == pytest.approx(115.0)  # a slow start: still half of it


def test_demo_area_keeps_the_density() -> None:
    for users, want_side_km in ((200, math.sqrt(200 / 15)), (1000, math.sqrt(1000 / 15)), (10, 2.0), (50_000, 14.5)):
        lo_lon, lo_lat, hi_lon, hi_lat = demo_area(users)
        side_ns = math.radians(hi_lat - lo_lat) * 6371.0088
        side_ew = math.radians(hi_lon - lo_lon) * 6371.0088 * math.cos(math.radians((lo_lat + hi_lat) / 2))
        assert side_ns == pytest.approx(want_side_km, rel=1e-3)
        assert side_ew == pytest.approx(want_side_km, rel=1e-3)
        assert lo_lon < 116.397 < hi_lon and lo_lat < 39.905 < hi_lat  # Tiananmen inside


TINY = b"""<?xml version='1.0'?>
<osm version="0.6">
  <node id="1" lat="39.900" lon="116.390"/>
  <node id="2" lat="39.900" lon="116.400"/>
  <node id="3" lat="39.910" lon="116.400"/>
  <node id="4" lat="39.910" lon="116.390"/>
  <node id="5" lat="39.920" lon="116.395"/>
  <node id="6" lat="39.980" lon="116.500"/>
  <way id="10"><nd ref="1"/><nd ref="2"/><nd ref="3"/><tag k="highway" v="primary"/></way>
  <way id="11"><nd ref="3"/><nd ref="4"/><nd ref="1"/><tag k="highway" v="residential"/><tag k="oneway" v="yes"/></way>
  <way id="12"><nd ref="4"/><nd ref="5"/><nd ref="3"/><tag k="highway" v="service"/></way>
  <way id="13"><nd ref="5"/><nd ref="6"/><tag k="highway" v="primary"/></way>
</osm>
"""


def _edges(g: StreetGraph) -> set[tuple[int, int, str, float, float]]:
    """Directed edges by OSM node ids, with class, length and speed (independent of node order)."""
    return {
        (int(g.node_id[t]), int(g.node_id[h]), g.highway[c], round(float(length), 6), round(float(speed), 9))
        for t, h, c, length, speed in zip(g.tail, g.head, g.edge_class, g.length_m, g.speed_mps, strict=True)
    }


def test_crop_keeps_the_largest_component_inside_the_box() -> None:
    graph = parse_osm(io.BytesIO(TINY))
    crop = crop_streets(graph, (116.385, 39.895, 116.41, 39.925))
    assert sorted(crop.node_id.tolist()) == [1, 2, 3, 4, 5]  # node 6 is outside
    assert np.all((crop.lon > 116.385) & (crop.lat < 39.925))
    kept = {1, 2, 3, 4, 5}
    assert _edges(crop) == {e for e in _edges(graph) if e[0] in kept and e[1] in kept}


def test_open_hands_the_map_url_to_the_users_browser(tmp_path: Path) -> None:
    """``--open`` goes through Python's webbrowser, which honours $BROWSER: here a script that notes its argument."""
    seen = tmp_path / "opened"
    script = tmp_path / "browser.sh"
    script.write_text(f'#!/bin/sh\nprintf "%s" "$1" > "{seen}"\n', encoding="utf-8")
    script.chmod(0o755)
    code = (
        "import asyncio\n"
        "from kcloak.cli._demo_run import _open_browser\n"
        "asyncio.run(_open_browser('http://127.0.0.1:18999/map', print))\n"
    )
    # no display and an empty PATH: no other browser of this machine can be found (nor opened)
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["PATH"] = str(tmp_path)
    outputs = []
    for browser in (f"{script} %s", "/bin/false %s"):  # one that works; then none that works
        proc = subprocess.run(
            [sys.executable, "-I", "-c", code],
            env={**env, "BROWSER": browser},
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs.append(proc.stdout)
    assert seen.read_text(encoding="utf-8") == "http://127.0.0.1:18999/map"
    assert outputs[0] == ""  # opened: nothing to say
    assert "open http://127.0.0.1:18999/map yourself" in outputs[1]  # the demo says what to open
