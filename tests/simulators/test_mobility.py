"""Waypoint and hotspot mobility models: bbox, speed bounds (contract haversine), pauses, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.core.geometry import BBox, haversine_m_array
from kcloak.core.places import load_pois
from kcloak.simulators.bench import MODELS, measure_models
from kcloak.simulators.mobility import HotspotModel, MobilityModel, RandomWaypoint

BEIJING = (116.148, 39.788, 116.613, 40.096)


def _inside(lat: np.ndarray, lon: np.ndarray, bbox: tuple[float, float, float, float]) -> bool:
    return bool(np.all((lon >= bbox[0]) & (lon <= bbox[2]) & (lat >= bbox[1]) & (lat <= bbox[3])))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dt=st.sampled_from([0.1, 1.0, 7.5, 120.0]),
    lat0=st.floats(-60.0, 60.0),
    vmax=st.floats(1.0, 40.0),
)
def test_waypoint_stays_in_bbox_and_under_vmax(seed: int, dt: float, lat0: float, vmax: float) -> None:
    bbox = (10.0, lat0, 10.02, lat0 + 0.015)
    model = RandomWaypoint(300, bbox, speed_mps=(0.5, vmax), pause_s=(0.0, 5.0), seed=seed)
    lat, lon = model.positions()
    for _ in range(30):
        model.step(dt)
        lat2, lon2 = model.positions()
        assert _inside(lat2, lon2, bbox)
        moved = haversine_m_array(lat, lon, lat2, lon2)
        assert moved.max() <= vmax * dt * (1 + 1e-9)
        lat, lon = lat2, lon2


def test_waypoint_moves_at_its_speed_between_waypoints() -> None:
    # Fixed speed and no pauses: each step either covers exactly v·dt in the frame (haversine at most
    # 0.3 % shorter in this box) or ends a leg (shorter); at least 90 % are plain steps.
    model = RandomWaypoint(2000, BEIJING, speed_mps=(10.0, 10.0), pause_s=(0.0, 0.0), seed=3)
    lat, lon = model.positions()
    model.step(1.0)
    lat2, lon2 = model.positions()
    moved = haversine_m_array(lat, lon, lat2, lon2)
    assert moved.max() <= 10.0 * (1 + 1e-9)
    assert np.mean(moved >= 10.0 * (1 - 0.004)) > 0.9
    assert not model.paused.any()


def test_pauses_last_exactly_pause_s() -> None:
    # Pause 10 s, dt 1 s: arrivals fall mid-step, so each stop shows as exactly 9 motionless steps.
    model = RandomWaypoint(20, (116.3, 39.9, 116.305, 39.904), speed_mps=(7.0, 7.0), pause_s=(10.0, 10.0), seed=5)
    lat, lon = model.positions()
    still = []
    for _ in range(600):
        model.step(1.0)
        lat2, lon2 = model.positions()
        still.append((lat2 == lat) & (lon2 == lon))
        lat, lon = lat2, lon2
    runs: list[int] = []
    for track in np.array(still).T:
        count = 0
        for s in track:
            if s:
                count += 1
            elif count:
                runs.append(count)
                count = 0
    assert len(runs) > 50
    assert set(runs) == {9}


def test_endless_pause_stops_everyone() -> None:
    model = RandomWaypoint(200, (116.3, 39.9, 116.31, 39.91), speed_mps=(5.0, 10.0), pause_s=(1e12, 1e12), seed=1)
    for _ in range(5):
        model.step(100.0)
    assert model.paused.all()
    before = model.positions()
    model.step(1000.0)
    after = model.positions()
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])


def test_large_steps_match_many_small_steps() -> None:
    # The per-step time budget is exact: one 10 s step equals ten 1 s steps up to rounding.
    a = RandomWaypoint(500, BEIJING, pause_s=(0.0, 3.0), seed=11)
    b = RandomWaypoint(500, BEIJING, pause_s=(0.0, 3.0), seed=11)
    a.step(4.0)
    for _ in range(4):
        b.step(1.0)
    la, oa = a.positions()
    lb, ob = b.positions()
    # Random draws happen in a different order once legs end, so compare users still on their first leg.
    d = haversine_m_array(la, oa, lb, ob)
    assert np.median(d) < 1e-6


@pytest.mark.parametrize("cls", ["waypoint", "hotspot"])
def test_seeded_determinism(cls: str) -> None:
    def make(seed: int) -> MobilityModel:
        if cls == "waypoint":
            return RandomWaypoint(1000, BEIJING, seed=seed)
        return HotspotModel(1000, load_pois(None), seed=seed)

    runs = []
    for seed in (7, 7, 8):
        model = make(seed)
        for dt in (1.0, 0.5, 30.0, 2.0):
            model.step(dt)
        runs.append(np.concatenate(model.positions()))
    assert np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_hotspot_draws_users_towards_pois() -> None:
    pois = load_pois(None)
    near = []
    for share in (1.0, 0.0):
        model = HotspotModel(5000, pois, poi_share=share, spread_m=100.0, seed=2)
        assert isinstance(model, MobilityModel)
        lat, lon = model.positions()
        dist = haversine_m_array(lat[:, None], lon[:, None], pois.lat[None, :], pois.lon[None, :]).min(axis=1)
        near.append(float(np.mean(dist <= 450.0)))
    assert near[0] >= 0.99  # 2-D Gaussian: P(r > 4.5 σ) ≈ 4e-5
    assert near[1] < 0.2


def test_hotspot_stays_in_bbox_and_under_vmax() -> None:
    bbox = (116.25, 39.82, 116.52, 40.02)
    model = HotspotModel(2000, load_pois(None), bbox=bbox, speed_mps=(1.0, 20.0), pause_s=(0.0, 10.0), seed=4)
    lat, lon = model.positions()
    assert _inside(lat, lon, bbox)
    for dt in (1.0, 5.0, 60.0, 1.0):
        model.step(dt)
        lat2, lon2 = model.positions()
        assert _inside(lat2, lon2, bbox)
        assert haversine_m_array(lat, lon, lat2, lon2).max() <= 20.0 * dt * (1 + 1e-9)
        lat, lon = lat2, lon2


def test_bbox_object_and_validation() -> None:
    box = BBox(116_300_000, 39_900_000, 116_310_000, 39_910_000)
    model = RandomWaypoint(10, box, seed=0)
    lat, lon = model.positions()
    assert _inside(lat, lon, (116.3, 39.9, 116.31, 39.91))
    with pytest.raises(ValueError):
        RandomWaypoint(10, box, speed_mps=(0.0, 5.0))
    with pytest.raises(ValueError):
        RandomWaypoint(10, (1.0, 2.0, 1.0, 3.0))
    with pytest.raises(ValueError):
        model.step(-1.0)
    with pytest.raises(ValueError):
        HotspotModel(10, load_pois(None), poi_share=1.5)


def test_measure_models_rows() -> None:
    rows = measure_models(users=2000, duration_s=0.02, seed=1)
    assert [r["model"] for r in rows] == list(MODELS)
    for row in rows:
        assert row["users"] == 2000
        assert isinstance(row["user_steps_per_s"], float) and row["user_steps_per_s"] > 0
        assert isinstance(row["steps"], int) and row["steps"] >= 1
