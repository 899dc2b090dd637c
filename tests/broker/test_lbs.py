"""The reference LBS candidate sets (CONCEPTS §1.7, §5.3, §9.3): worked example, inclusiveness, minimality."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.broker.lbs import (
    LbsEngine,
    LonLatBox,
    _dist_to_pieces,
)
from kcloak.core.geometry import EARTH_RADIUS_M, haversine_m_array
from kcloak.core.places import Poi, PoiSet, load_pois

M_PER_DEG = EARTH_RADIUS_M * math.pi / 180

# --- helpers ---------------------------------------------------------------------------------


def poi_set(lat: np.ndarray, lon: np.ndarray, cats: list[str] | None = None) -> PoiSet:
    cats = cats or ["x"] * len(lat)
    return PoiSet(
        tuple(Poi(f"p{i:05d}", float(lat[i]), float(lon[i]), cats[i], f"name {i}") for i in range(len(lat))), 0
    )


def exact_answer(pois: PoiSet, lat: float, lon: float, kind: str, param: float, category: str | None) -> set[int]:
    """Brute force over all POIs with the contract's haversine (range within r; knn n nearest, ties)."""
    idx = np.array([i for i, p in enumerate(pois.pois) if category is None or p.category == category], np.int64)
    if len(idx) == 0:
        return set()
    d = haversine_m_array(lat, lon, pois.lat[idx], pois.lon[idx])
    if kind == "range":
        return set(idx[d <= param].tolist())
    n = int(param)
    if len(idx) <= n:
        return set(idx.tolist())
    return set(idx[d <= np.sort(d)[n - 1]].tolist())


def candidates(engine: LbsEngine, box: LonLatBox, kind: str, param: float, category: str | None) -> set[int]:
    rows = (
        engine.range_candidates(box, param, category)
        if kind == "range"
        else engine.knn_candidates(box, int(param), category)
    )
    return set(rows.tolist())


def s93_points(box: LonLatBox, rng: np.random.Generator) -> Iterator[tuple[float, float]]:
    """§9.3 sample: the 4 corners, 16 points per edge, 100 uniform interior points."""
    lo_lat, hi_lat, lo_lon, hi_lon = box.min_lat, box.max_lat, box.min_lon, box.max_lon
    yield from ((lo_lat, lo_lon), (lo_lat, hi_lon), (hi_lat, lo_lon), (hi_lat, hi_lon))
    for t in np.linspace(0, 1, 16):
        la, lo = lo_lat + t * (hi_lat - lo_lat), lo_lon + t * (hi_lon - lo_lon)
        yield from ((lo_lat, lo), (hi_lat, lo), (la, lo_lon), (la, hi_lon))
    for _ in range(100):
        yield float(rng.uniform(lo_lat, hi_lat)), float(rng.uniform(lo_lon, hi_lon))


def box_around(lat: float, lon: float, w_m: float, h_m: float, *, micro: bool = True) -> LonLatBox:
    dlat = h_m / M_PER_DEG / 2
    dlon = min(w_m / (M_PER_DEG * max(math.cos(math.radians(lat)), 1e-6)) / 2, 179.0)
    vals = [max(lon - dlon, -180.0), max(lat - dlat, -90.0), min(lon + dlon, 180.0), min(lat + dlat, 90.0)]
    return LonLatBox.of([round(v, 6) for v in vals] if micro else vals)


# --- worked example casper_nn (§5.3) -----------------------------------------------------------

CASPER_POIS = {"a": (-3.0, 5.0), "b": (14.0, 5.0), "c": (5.0, 20.0), "d": (5.0, -8.0), "e": (30.0, 30.0)}


def test_casper_nn_on_the_sphere() -> None:
    """The example scaled to 100 m per unit at the equator: the engine finds the sets of CONCEPTS §5.3."""
    unit = 100.0 / M_PER_DEG
    names = list(CASPER_POIS)
    pois = poi_set(
        np.array([CASPER_POIS[k][1] * unit for k in names]), np.array([CASPER_POIS[k][0] * unit for k in names])
    )
    engine = LbsEngine(pois)
    box = LonLatBox(0.0, 0.0, 10 * unit, 10 * unit)
    assert {names[i] for i in engine.knn_candidates(box, 1)} == {"a", "b", "d"}
    assert {names[i] for i in engine.knn_candidates(box, 2)} == {"a", "b", "c", "d"}


# --- geometric primitive ---------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    lat0=st.floats(-89.0, 89.0),
    lon0=st.floats(-179.0, 179.0),
    span=st.floats(1e-5, 2.0),
    meridian=st.booleans(),
    dlat=st.floats(-3.0, 3.0),
    dlon=st.floats(-3.0, 3.0),
)
def test_distance_to_arc_matches_dense_sampling(
    lat0: float, lon0: float, span: float, meridian: bool, dlat: float, dlon: float
) -> None:
    """Exact point-to-arc distance: never above a dense sample's minimum, never below it by more than the spacing."""
    lat = float(np.clip(lat0 + dlat, -90, 90))
    lon = float((lon0 + dlon + 180) % 360 - 180)
    if meridian:
        a, b = math.radians(lat0), math.radians(min(lat0 + span, 90.0))
        t = np.linspace(a, b, 20001)
        slat, slon = np.degrees(t), np.full(len(t), lon0)
        kind, fixed = 0, math.radians(lon0)
        step = EARTH_RADIUS_M * (b - a) / 20000
    else:
        a, b = math.radians(lon0), math.radians(min(lon0 + span, 180.0))
        t = np.linspace(a, b, 20001)
        slat, slon = np.full(len(t), lat0), np.degrees(t)
        kind, fixed = 1, math.radians(lat0)
        step = EARTH_RADIUS_M * math.cos(fixed) * (b - a) / 20000
    d = _dist_to_pieces(
        np.array([math.radians(lat)]),
        np.array([math.radians(lon)]),
        np.array([kind]),
        np.array([fixed]),
        np.array([a]),
        np.array([b]),
    )[0]
    brute = float(haversine_m_array(lat, lon, slat, slon).min())
    assert d <= brute + 1e-6 + 1e-9 * brute
    assert d >= brute - step / 2 - 1e-6 - 1e-9 * brute


# --- inclusiveness (Hypothesis) --------------------------------------------------------------


Scenario = tuple[PoiSet, LonLatBox, str, float, str | None, list[tuple[float, float]], dict[str, Any]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    where = draw(st.sampled_from(["beijing", "equator", "south", "high", "polar", "antimeridian"]))
    if where == "beijing":
        lat, lon = draw(st.floats(39.6, 40.3)), draw(st.floats(116.0, 116.8))
    elif where == "equator":
        lat, lon = draw(st.floats(-1.0, 1.0)), draw(st.floats(-179.0, 179.0))
    elif where == "south":
        lat, lon = draw(st.floats(-60.0, -30.0)), draw(st.floats(-179.0, 179.0))
    elif where == "high":
        lat, lon = draw(st.floats(60.0, 80.0)), draw(st.floats(-179.0, 179.0))
    elif where == "polar":
        lat, lon = draw(st.floats(86.0, 89.99)), draw(st.floats(-179.0, 179.0))
    else:
        lat, lon = draw(st.floats(-60.0, 60.0)), draw(st.sampled_from([-179.999, 179.999]))
    # Sizes from a point (0 m) through typical cloaked regions to very large ones.
    size = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(1.0, 100.0), st.floats(100.0, 5_000.0), st.floats(5e3, 3e5))
    w, h = draw(size), draw(size)
    box = box_around(lat, lon, w, h, micro=draw(st.booleans()))
    # POIs: a cloud around the region (spread from a tenth to ten times its size), duplicates for
    # exact ties, POIs on corners and edges, a few anywhere on Earth; category "c" is sparse.
    spread = max(w, h, 50.0) * draw(st.floats(0.1, 10.0))
    m = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    plat = lat + rng.normal(0, spread / M_PER_DEG, m)
    plon = lon + rng.normal(0, spread / (M_PER_DEG * max(math.cos(math.radians(lat)), 1e-3)), m)
    if draw(st.booleans()):
        plat = np.concatenate([plat, [box.min_lat, box.max_lat, (box.min_lat + box.max_lat) / 2]])
        plon = np.concatenate([plon, [box.min_lon, box.max_lon, box.min_lon]])
    if draw(st.booleans()):
        plat = np.concatenate([plat, rng.uniform(-90, 90, 3)])
        plon = np.concatenate([plon, rng.uniform(-180, 180, 3)])
    if len(plat) and draw(st.booleans()):
        k = draw(st.integers(1, len(plat)))
        plat, plon = np.concatenate([plat, plat[:k]]), np.concatenate([plon, plon[:k]])
    plat = np.clip(plat, -90, 90)
    plon = (plon + 180) % 360 - 180
    cats = [str(c) for c in rng.choice(["a", "b"], len(plat))]
    for i in rng.choice(len(plat), min(len(plat), draw(st.integers(0, 3))), replace=False):
        cats[int(i)] = "c"
    pois = poi_set(plat, plon, cats)
    kind = draw(st.sampled_from(["range", "knn"]))
    param = float(draw(st.integers(1, 12))) if kind == "knn" else draw(st.floats(1.0, 50_000.0))
    category = draw(st.sampled_from([None, "a", "c"]))
    fracs = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))
    uv = draw(st.lists(st.tuples(fracs, fracs), min_size=1, max_size=12))
    # The corners, a 9 x 9 grid (its border runs along the edges) and the drawn points.
    grid = [(float(u), float(v)) for u in np.linspace(0, 1, 9) for v in np.linspace(0, 1, 9)]
    points = [
        (box.min_lat + v * (box.max_lat - box.min_lat), box.min_lon + u * (box.max_lon - box.min_lon))
        for u, v in grid + uv
    ]
    # Either backend; default tuning, or coarse tuning and tiny budgets (soundness must not depend on them).
    tunings: list[dict[str, Any]] = [
        {},
        {"max_samples": 1, "initial_segments": 1, "filter_splits": 2},
        {"max_samples": 24, "refine_ratio": 0.5},
        {"initial_segments": 64, "refine_ratio": 1e-4, "max_samples": 4096},
    ]
    tuning = draw(st.sampled_from(tunings))
    return pois, box, kind, param, category, points, {"rtree_min_pois": draw(st.sampled_from([1, 1 << 30])), **tuning}


def exact_union(
    pois: PoiSet, points: list[tuple[float, float]], kind: str, param: float, category: str | None
) -> set[int]:
    """Union of the brute-force exact answers (contract §5 with the contract's haversine) at many points."""
    idx = np.array([i for i, p in enumerate(pois.pois) if category is None or p.category == category], np.int64)
    if len(idx) == 0:
        return set()
    lat = np.array([p[0] for p in points])[:, None]
    lon = np.array([p[1] for p in points])[:, None]
    d = haversine_m_array(lat, lon, pois.lat[idx][None, :], pois.lon[idx][None, :])
    if kind == "range":
        return set(idx[(d <= param).any(axis=0)].tolist())
    n = int(param)
    if len(idx) <= n:
        return set(idx.tolist())
    nth = np.partition(d, n - 1, axis=1)[:, n - 1]
    return set(idx[(d <= nth[:, None]).any(axis=0)].tolist())


def engine_for(pois: PoiSet, rtree: bool) -> LbsEngine:
    """The engine with its numpy scan (small layers) or its rtree search (large layers) forced."""
    return LbsEngine(pois, rtree_min_pois=1 if rtree else 1 << 30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_candidates_are_inclusive(scenario: Scenario) -> None:
    """For every sampled point of the region, the brute-force exact answer is inside the candidates."""
    pois, box, kind, param, category, points, engine_kw = scenario
    engine = LbsEngine(pois, **engine_kw)
    cand = candidates(engine, box, kind, param, category)
    assert exact_union(pois, points, kind, param, category) <= cand
    for lat, lon in points[81:]:  # the drawn points one by one, for a precise failure message
        assert exact_answer(pois, lat, lon, kind, param, category) <= cand, (kind, param, box, lat, lon)


def region_grid(box: LonLatBox, inner: int, per_edge: int) -> list[tuple[float, float]]:
    """An ``inner`` x ``inner`` grid over the region plus ``per_edge`` points along each edge."""
    lats = np.linspace(box.min_lat, box.max_lat, inner)
    lons = np.linspace(box.min_lon, box.max_lon, inner)
    pts = [(float(a), float(b)) for a in lats for b in lons]
    t = np.linspace(0, 1, per_edge)
    for la, lo in zip(
        box.min_lat + t * (box.max_lat - box.min_lat), box.min_lon + t * (box.max_lon - box.min_lon), strict=True
    ):
        pts += [(box.min_lat, float(lo)), (box.max_lat, float(lo)), (float(la), box.min_lon), (float(la), box.max_lon)]
    return pts


def beijing_regions(count: int, seed: int) -> Iterator[tuple[LonLatBox, int, str | None]]:
    """Typical cloaked regions over the bundled POIs: 0.01 to 4 km², aspect up to 3:1, n <= 10."""
    pois = load_pois(None)
    cats = [p.category for p in pois.pois]
    rng = np.random.default_rng(seed)
    for _ in range(count):
        j = int(rng.integers(len(cats)))
        lat, lon = float(pois.lat[j] + rng.normal(0, 0.01)), float(pois.lon[j] + rng.normal(0, 0.01))
        area, aspect = 10 ** rng.uniform(4, math.log10(4e6)), 10 ** rng.uniform(-0.5, 0.5)
        box = box_around(lat, lon, math.sqrt(area * aspect), math.sqrt(area / aspect))
        yield box, int(rng.integers(1, 11)), None if rng.random() < 0.5 else cats[int(rng.integers(len(cats)))]


def test_knn_covers_the_exact_union_over_a_dense_grid_of_beijing_regions() -> None:
    """Candidates ⊇ the union of the brute-force kNN over a dense grid of each region, and not much more."""
    pois = load_pois(None)
    engine = LbsEngine(pois)
    ratios = []
    for box, n, category in beijing_regions(24, seed=11):
        cand = candidates(engine, box, "knn", n, category)
        union = exact_union(pois, region_grid(box, 30, 300), "knn", n, category)
        assert union <= cand, (box, n, category, sorted(union - cand))
        ratios.append(len(union) / len(cand))
    assert float(np.mean(ratios)) >= 0.95


def test_backends_agree_on_beijing_regions() -> None:
    """The numpy scan and the rtree search give the same candidates (range and kNN)."""
    pois = load_pois(None)
    scan, tree = engine_for(pois, rtree=False), engine_for(pois, rtree=True)
    for box, n, category in beijing_regions(40, seed=12):
        assert scan.knn_candidates(box, n, category).tolist() == tree.knn_candidates(box, n, category).tolist()
        r = 100.0 * n
        assert scan.range_candidates(box, r, category).tolist() == tree.range_candidates(box, r, category).tolist()


def _window_pois(drop_m: float, x0_m: float = 123.4) -> PoiSet:
    """Planar layout at the equator (metres → degrees): ``a`` and ``b`` 500 m from the bottom-edge
    point ``x0``, and ``c`` straight below ``x0`` at ``500 - drop_m`` metres."""
    xy = [(x0_m - 400.0, -300.0), (x0_m + 400.0, -300.0), (x0_m, -500.0 + drop_m), (5000.0, 5000.0)]
    return poi_set(np.array([y / M_PER_DEG for _, y in xy]), np.array([x / M_PER_DEG for x, _ in xy]))


WINDOW_BOX = LonLatBox(-1000 / M_PER_DEG, 0.0, 1000 / M_PER_DEG, 500 / M_PER_DEG)


@pytest.mark.parametrize("rtree", [False, True])
def test_knn_keeps_a_poi_nearest_only_along_a_one_metre_stretch(rtree: bool) -> None:
    """``c`` wins the 1st place only within ~0.5 m of one point of a 2 km edge: still a candidate."""
    pois = _window_pois(drop_m=0.4)
    edge = [(0.0, (123.4 + dx) / M_PER_DEG) for dx in np.linspace(-0.4, 0.4, 9)]
    assert 2 in exact_union(pois, edge, "knn", 1, None)  # the layout does what it says
    assert 2 not in exact_union(pois, region_grid(WINDOW_BOX, 50, 101), "knn", 1, None)  # a 20 m grid misses it
    assert candidates(engine_for(pois, rtree), WINDOW_BOX, "knn", 1, None) == {0, 1, 2}


@pytest.mark.parametrize("rtree", [False, True])
def test_knn_drops_a_poi_that_misses_everywhere_by_six_percent(rtree: bool) -> None:
    """``c`` is 30 m (6 %) behind the nearest POI at its best point of the boundary: not a candidate."""
    pois = _window_pois(drop_m=-30.0)
    assert 2 not in exact_union(pois, region_grid(WINDOW_BOX, 50, 4000), "knn", 1, None)
    assert candidates(engine_for(pois, rtree), WINDOW_BOX, "knn", 1, None) == {0, 1}


def test_engine_rejects_bad_parameters() -> None:
    pois = _window_pois(0.0)
    for bad in ({"refine_ratio": 0.0}, {"max_samples": 0}, {"initial_segments": 0}, {"filter_splits": 1}):
        with pytest.raises(ValueError):
            LbsEngine(pois, **bad)
    with pytest.raises(ValueError):
        LbsEngine(pois).knn_candidates(WINDOW_BOX, 0)


def test_knn_with_fewer_matching_pois_than_n_returns_all_of_them() -> None:
    pois = poi_set(np.array([39.9, 40.0, 41.0, 10.0]), np.array([116.4, 116.5, 117.0, 10.0]), ["a", "a", "b", "a"])
    engine = LbsEngine(pois)
    box = box_around(39.95, 116.45, 1000, 1000)
    assert engine.knn_candidates(box, 3, "a").tolist() == [0, 1, 3]
    assert engine.knn_candidates(box, 5).tolist() == [0, 1, 2, 3]
    assert engine.knn_candidates(box, 1, "zzz").tolist() == []


def test_knn_includes_every_tie_at_the_nth_distance() -> None:
    """Three POIs at the same spot tie for the 1st neighbour of the whole region; all are candidates."""
    lat = np.array([39.95, 39.95, 39.95, 39.99, 39.90])
    lon = np.array([116.45, 116.45, 116.45, 116.50, 116.40])
    engine = LbsEngine(poi_set(lat, lon))
    box = box_around(39.95, 116.45, 200, 200)
    assert engine.knn_candidates(box, 1).tolist() == [0, 1, 2]
    assert engine.knn_candidates(box, 2).tolist() == [0, 1, 2]


def test_range_across_the_antimeridian_and_at_the_pole() -> None:
    pois = poi_set(np.array([10.0, 10.0, 89.9995, 0.0]), np.array([-179.9995, 179.0, 0.0, 0.0]))
    engine = LbsEngine(pois)
    east_edge = LonLatBox(179.999, 9.999, 180.0, 10.001)
    assert engine.range_candidates(east_edge, 200).tolist() == [0]  # ~55 m away, across ±180
    polar = LonLatBox(170.0, 89.999, 180.0, 90.0)  # touches the pole: every longitude is near
    assert engine.range_candidates(polar, 200).tolist() == [2]


def test_results_sorted_by_poi_id_and_filtered_by_category() -> None:
    pts = [
        Poi("z9", 39.9, 116.4, "cafe", ""),
        Poi("a1", 39.9001, 116.4, "bank", ""),
        Poi("m5", 39.9, 116.4001, "cafe", ""),
    ]
    engine = LbsEngine(PoiSet(tuple(pts), 0))
    box = box_around(39.9, 116.4, 100, 100)
    assert [pts[i].poi_id for i in engine.range_candidates(box, 500)] == ["a1", "m5", "z9"]
    assert [pts[i].poi_id for i in engine.knn_candidates(box, 1, "cafe")] == ["m5", "z9"]
    assert engine.categories() == [("bank", 1), ("cafe", 2)]


def test_lonlatbox_rejects_bad_boxes() -> None:
    for bad in ([1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [-181.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 91.0]):
        with pytest.raises(ValueError):
            LonLatBox.of(bad)
    with pytest.raises(ValueError):
        LonLatBox(0.0, 0.0, math.nan, 1.0)


# --- §9.3 protocol on the bundled Beijing POIs, with the minimality figures ----------------


def _dense_union(pois: PoiSet, box: LonLatBox, kind: str, param: float, per_edge: int = 200) -> set[int]:
    """Exact union over the region (§1.7), approximated by the POIs inside plus dense edge points.

    By the boundary reduction of ``kcloak.broker.lbs`` every answer at an interior point is inside the box
    or in the answer of a boundary point.
    """
    inside = (
        (pois.lat >= box.min_lat) & (pois.lat <= box.max_lat) & (pois.lon >= box.min_lon) & (pois.lon <= box.max_lon)
    )
    t = np.linspace(0, 1, per_edge)
    along_lat = box.min_lat + t * (box.max_lat - box.min_lat)
    along_lon = box.min_lon + t * (box.max_lon - box.min_lon)
    lats = np.concatenate([np.full(per_edge, box.min_lat), np.full(per_edge, box.max_lat), along_lat, along_lat])
    lons = np.concatenate([along_lon, along_lon, np.full(per_edge, box.min_lon), np.full(per_edge, box.max_lon)])
    edge = list(zip(lats.tolist(), lons.tolist(), strict=True))
    return set(np.flatnonzero(inside).tolist()) | exact_union(pois, edge, kind, param, None)


def minimality_figures(trials: int = 60, seed: int = 93) -> dict[str, dict[str, float]]:
    """§9.3 on the bundled POIs: zero violations, and the minimality ratios per kind."""
    pois = load_pois(None)
    engine = LbsEngine(pois)
    rng = np.random.default_rng(seed)
    figures: dict[str, dict[str, list[float]]] = {
        k: {"c_over_true": [], "sampled_union_over_c": [], "dense_union_over_c": []} for k in ("range", "knn")
    }
    for trial in range(trials):
        kind = "range" if trial % 2 == 0 else "knn"
        lat, lon = float(rng.uniform(39.8, 40.05)), float(rng.uniform(116.25, 116.55))
        box = box_around(lat, lon, float(10 ** rng.uniform(2.3, 3.7)), float(10 ** rng.uniform(2.3, 3.7)))
        param = float(rng.choice([1, 3, 5, 10])) if kind == "knn" else float(rng.choice([200, 500, 1000, 2000]))
        cand = candidates(engine, box, kind, param, None)
        true_lat, true_lon = float(rng.uniform(box.min_lat, box.max_lat)), float(rng.uniform(box.min_lon, box.max_lon))
        at_true = exact_answer(pois, true_lat, true_lon, kind, param, None)
        assert at_true <= cand
        union = exact_union(pois, list(s93_points(box, rng)), kind, param, None)
        assert union <= cand
        dense = _dense_union(pois, box, kind, param)
        assert dense <= cand
        if cand and at_true:
            figures[kind]["c_over_true"].append(len(cand) / len(at_true))
        if cand:
            figures[kind]["sampled_union_over_c"].append(len(union) / len(cand))
            figures[kind]["dense_union_over_c"].append(len(dense) / len(cand))
    return {k: {m: float(np.mean(v)) for m, v in ms.items()} for k, ms in figures.items()}


def test_s93_protocol_and_minimality_figures() -> None:
    """Zero inclusiveness violations; range is minimal; kNN within a modest factor of the exact union."""
    figures = minimality_figures()
    print("\nminimality (means):", figures)
    assert figures["range"]["dense_union_over_c"] >= 0.97
    assert figures["knn"]["dense_union_over_c"] >= 0.95
