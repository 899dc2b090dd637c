"""The demo report: summary.json of the contract's exact shape, values recomputed here, valid pictures."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from kcloak.simulators.report import Observations, SampledRegion, plot_map, summarize, write_report
from kcloak.simulators.streets import StreetGraph

# Contract §9, `demo` summary.json, in order (written out here, not imported).
CONTRACT_KEYS = [
    "users",
    "duration_s",
    "algorithm",
    "updates",
    "updates_per_s",
    "queries",
    "ok",
    "refused",
    "success_rate",
    "refusals",
    "cloak_area_m2_median",
    "achieved_k_mean",
    "latency_ms_p50",
    "latency_ms_p99",
    "published_windows",
]
EXTENSION_KEYS = ["unanswered", "skipped_steps"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ok_answer(k: int, area: float, bbox: list[float]) -> dict[str, Any]:
    return {
        "query_id": f"q{k}",
        "status": "ok",
        "algorithm": "hilbert",
        "k_achieved": k,
        "area_m2": area,
        "region": {"bbox": bbox},
        "results": [],
        "t": 1.0,
    }


def refused(reason: str) -> dict[str, Any]:
    return {"query_id": "r", "status": "refused", "reason": reason, "message": "m", "t": 1.0}


def linear_percentile(values: list[float], q: float) -> float:
    """Order statistics interpolated at rank q/100·(n−1) (independent of numpy)."""
    xs = sorted(values)
    pos = q / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def sample_observations(seed: int = 3, n_ok: int = 300) -> tuple[Observations, dict[str, Any]]:
    rnd = random.Random(seed)
    obs = Observations()
    truth: dict[str, Any] = {"areas": [], "ks": [], "lat_ms": [], "refusals": {}}
    for _ in range(n_ok):
        k = rnd.randint(5, 60)
        area = rnd.uniform(1e4, 4e6)
        lat_s = rnd.uniform(0.002, 0.2)
        lon0, lat0 = 116.3 + rnd.uniform(0, 0.2), 39.85 + rnd.uniform(0, 0.1)
        obs.record_answer(ok_answer(k, area, [lon0, lat0, lon0 + 0.01, lat0 + 0.01]), lat_s)
        truth["areas"].append(area)
        truth["ks"].append(k)
        truth["lat_ms"].append(lat_s * 1000)
    for reason, n in (("area_exceeded", 17), ("k_unreachable", 4)):
        for _ in range(n):
            lat_s = rnd.uniform(0.001, 0.01)
            obs.record_answer(refused(reason), lat_s)
            truth["lat_ms"].append(lat_s * 1000)
        truth["refusals"][reason] = n
    obs.queries = n_ok + 21 + 5  # five queries never answered
    obs.updates = 123_456
    lat = np.array([39.9 + rnd.uniform(-0.05, 0.05) for _ in range(500)])
    lon = np.array([116.4 + rnd.uniform(-0.05, 0.05) for _ in range(500)])
    obs.record_positions(lat, lon)
    return obs, truth


def test_summary_has_the_contract_shape_and_recomputed_values() -> None:
    obs, truth = sample_observations()
    s = summarize(obs, users=500, duration_s=60.0, algorithm="hilbert", published_windows=2)
    assert list(s) == CONTRACT_KEYS + EXTENSION_KEYS
    assert s["users"] == 500 and s["algorithm"] == "hilbert" and s["published_windows"] == 2
    assert s["updates"] == 123_456
    assert s["updates_per_s"] == pytest.approx(123_456 / 60, abs=0.05)
    assert s["queries"] == 326 and s["unanswered"] == 5
    assert s["ok"] == 300 and s["refused"] == 21
    assert s["refusals"] == {"area_exceeded": 17, "k_unreachable": 4}
    assert s["success_rate"] == pytest.approx(300 / 321, abs=5e-5)
    assert s["cloak_area_m2_median"] == pytest.approx(linear_percentile(truth["areas"], 50), abs=0.05)
    assert s["achieved_k_mean"] == pytest.approx(sum(truth["ks"]) / len(truth["ks"]), abs=0.005)
    assert s["latency_ms_p50"] == pytest.approx(linear_percentile(truth["lat_ms"], 50), abs=5e-4)
    assert s["latency_ms_p99"] == pytest.approx(linear_percentile(truth["lat_ms"], 99), abs=5e-4)
    assert isinstance(s["ok"], int) and isinstance(s["queries"], int)


def test_empty_run_has_nulls_not_nans() -> None:
    s = summarize(Observations(), users=10, duration_s=0.0, algorithm="nn", published_windows=0)
    assert list(s) == CONTRACT_KEYS + EXTENSION_KEYS
    assert s["success_rate"] is None and s["cloak_area_m2_median"] is None and s["latency_ms_p99"] is None
    assert s["updates_per_s"] == 0.0 and s["refusals"] == {}
    json.dumps(s, allow_nan=False)


def test_answers_with_odd_fields_are_counted_not_crashed() -> None:
    obs = Observations()
    obs.record_answer({"status": "refused"}, 0.01)
    obs.record_answer({"status": "ok", "k_achieved": True, "area_m2": float("nan"), "region": "x"}, float("inf"))
    assert obs.refusals == {"unknown": 1}
    assert obs.ok == 1 and obs.area_m2 == [] and obs.k_achieved == [] and len(obs.regions) == 0
    assert obs.latency_s == [0.01]


def _tiny_streets() -> StreetGraph:
    lat = np.array([39.90, 39.90, 39.92, 39.92])
    lon = np.array([116.38, 116.42, 116.42, 116.38])
    tail = np.array([0, 1, 1, 2, 2, 3, 3, 0])
    head = np.array([1, 0, 2, 1, 3, 2, 0, 3])
    order = np.lexsort((head, tail))
    return StreetGraph(
        node_id=np.arange(4, dtype=np.int64),
        lat=lat,
        lon=lon,
        tail=tail[order].astype(np.int64),
        head=head[order].astype(np.int64),
        length_m=np.full(8, 2000.0),
        speed_mps=np.full(8, 10.0),
        edge_class=np.zeros(8, dtype=np.int16),
        highway=("primary",),
        ways_read=4,
        ways_used=4,
    )


def test_write_report_writes_valid_pictures_and_strict_json(tmp_path: Path) -> None:
    obs, _ = sample_observations()
    s = summarize(obs, users=500, duration_s=60.0, algorithm="hilbert", published_windows=0)
    out = tmp_path / "nested" / "report"
    files = write_report(out, obs, s, streets=_tiny_streets(), max_area_m2=4e6, requested_k=(5, 10, 20))
    assert sorted(p.name for p in files) == sorted(
        ["summary.json", "map.png", "cloak_area.png", "achieved_k.png", "latency.png"]
    )

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-finite constant {name} in summary.json")

    assert json.loads((out / "summary.json").read_text(), parse_constant=no_constants) == s
    for name in ("map.png", "cloak_area.png", "achieved_k.png", "latency.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        with Image.open(out / name) as img:
            img.verify()
        with Image.open(out / name) as img:
            assert img.width >= 400 and img.height >= 300


def test_empty_report_still_writes_every_picture(tmp_path: Path) -> None:
    obs = Observations()
    s = summarize(obs, users=1, duration_s=1.0, algorithm="hilbert", published_windows=0)
    write_report(tmp_path, obs, s)
    for name in ("map.png", "cloak_area.png", "achieved_k.png", "latency.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_map_draws_the_regions(tmp_path: Path) -> None:
    """The same users and streets with and without cloaked regions give visibly different maps."""
    lat = np.array([39.905, 39.91, 39.915])
    lon = np.array([116.39, 116.40, 116.41])
    streets = _tiny_streets()
    regions = [SampledRegion(116.385, 39.902, 116.415, 39.918, 7), SampledRegion(116.395, 39.905, 116.405, 39.912, 20)]
    plot_map(tmp_path / "with.png", lat=lat, lon=lon, regions=regions, streets=streets, dpi=60)
    plot_map(tmp_path / "without.png", lat=lat, lon=lon, regions=[], streets=streets, dpi=60)
    with Image.open(tmp_path / "with.png") as a, Image.open(tmp_path / "without.png") as b:
        pa = np.asarray(a.convert("RGB"), dtype=np.int16)
        pb = np.asarray(b.convert("RGB").resize(a.size), dtype=np.int16)

    # Coloured (non-grey) pixels: regions are filled with a colour map, streets are grey, users blue dots.
    def coloured(p: np.ndarray) -> int:
        spread = p.max(axis=2) - p.min(axis=2)
        return int(np.count_nonzero(spread > 60))

    assert coloured(pa) > coloured(pb) + 500


answers = st.lists(
    st.one_of(
        st.tuples(st.just("ok"), st.integers(1, 500), st.floats(1.0, 2.5e9), st.floats(0.0, 5.0)),
        st.tuples(
            st.sampled_from(["area_exceeded", "k_unreachable", "upstream_error"]),
            st.just(0),
            st.just(0.0),
            st.floats(0.0, 5.0),
        ),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(answers, st.integers(0, 10), st.floats(0.5, 600.0))
def test_summary_invariants(items: list[tuple[str, int, float, float]], lost: int, duration: float) -> None:
    obs = Observations()
    for status, k, area, lat_s in items:
        if status == "ok":
            obs.record_answer(ok_answer(k, area, [116.3, 39.9, 116.31, 39.91]), lat_s)
        else:
            obs.record_answer(refused(status), lat_s)
    obs.queries = len(items) + lost
    s = summarize(obs, users=5, duration_s=duration, algorithm="casper", published_windows=0)
    assert list(s) == CONTRACT_KEYS + EXTENSION_KEYS
    assert s["ok"] + s["refused"] == len(items) == s["queries"] - lost
    assert s["unanswered"] == lost and s["skipped_steps"] == 0
    assert sum(s["refusals"].values()) == s["refused"]
    if items:
        assert 0.0 <= s["success_rate"] <= 1.0
        assert s["latency_ms_p50"] <= s["latency_ms_p99"] + 1e-9
        lat_ms = [x[3] * 1000 for x in items]
        assert min(lat_ms) - 1e-3 <= s["latency_ms_p50"] <= max(lat_ms) + 1e-3
    oks = [x for x in items if x[0] == "ok"]
    if oks:
        assert min(x[1] for x in oks) - 0.01 <= s["achieved_k_mean"] <= max(x[1] for x in oks) + 0.01
        assert min(x[2] for x in oks) - 0.1 <= s["cloak_area_m2_median"] <= max(x[2] for x in oks) + 0.1
    else:
        assert s["achieved_k_mean"] is None and s["cloak_area_m2_median"] is None
    json.dumps(s, allow_nan=False)


def _line_colours(path: Path) -> set[tuple[int, int, int]]:
    """Saturated colours drawn on a picture (quantized to 8 levels a channel, at least 60 pixels each)."""
    with Image.open(path) as img:
        rgb = np.asarray(img.convert("RGB")).astype(np.int32)
    flat = rgb.reshape(-1, 3)
    saturated = flat[(flat.max(axis=1) - flat.min(axis=1)) > 40] // 32
    colours, counts = np.unique(saturated, axis=0, return_counts=True)
    return {(int(c[0]), int(c[1]), int(c[2])) for c, n in zip(colours, counts, strict=True) if n >= 60}


def test_achieved_k_marks_each_requested_k_in_its_own_colour(tmp_path: Path) -> None:
    """The requested k = 5/10/20 lines are told apart: three requested k add three colours, not one."""
    from kcloak.simulators.report import plot_achieved_k

    ks = [5] * 30 + [9] * 40 + [14] * 30 + [22] * 20
    plot_achieved_k(tmp_path / "one.png", ks, requested_k=(5,))
    plot_achieved_k(tmp_path / "three.png", ks, requested_k=(5, 10, 20))
    assert len(_line_colours(tmp_path / "three.png")) >= len(_line_colours(tmp_path / "one.png")) + 2
