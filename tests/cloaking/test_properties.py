"""Property tests of every cloaker against the independent checker (CONCEPTS §4.0, §9.1, §9.4).

Random populations (uniform in a city-sized box, clustered, all on one point, on 4-, 5- and
6-decimal grids as apps send them (T-Drive has 5) with several users on shared grid lines and at
one point, on and one micro-degree off coarse grid-cell boundaries (quadtree/pyramid cell edges at
every level, as the floats of those micro-degrees), one user, near ±180°/±85° and the poles),
personalized stored profiles and tightened overrides; every region must pass
:func:`kcloak.cloaking.checks.check_region`, every refusal :func:`kcloak.cloaking.checks.check_refusal`,
and ``cloak_batch`` must equal ``cloak`` element-wise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.checks import (
    Places,
    Published,
    Snapshot,
    Violation,
    check_clique_stream,
    check_refusal,
    check_region,
)
from kcloak.cloaking.cloakers import get_cloaker
from kcloak.cloaking.cloakers.base import STATUS_OK, Refusal, Region
from kcloak.cloaking.grid import GRID_OFFSET
from kcloak.cloaking.index import IndexView
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile, ProfileArrays

F64 = npt.NDArray[np.float64]

SNAPSHOT_ALGORITHMS = ("nn", "interval", "casper", "hilbert", "privacygrid")
_BASE_CODES = frozenset({"k_unreachable", "area_exceeded", "unsupported"})
ALLOWED_CODES: dict[str, frozenset[str]] = {name: _BASE_CODES for name in SNAPSHOT_ALGORITHMS}
ALLOWED_CODES["privacygrid"] = _BASE_CODES | {"l_unreachable"}
CATEGORIES = ("cafe", "bank", "school", "hospital", "park", "shop")
NOW = 1_000_000.0

PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def make_cloaker(name: str, **params: Any) -> Any:
    """The registered cloaker, or a skip while its module has not landed."""
    try:
        return get_cloaker(name, **params)
    except ModuleNotFoundError as exc:
        pytest.skip(f"{name}: module not written yet ({exc.name})")


# -- populations -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Population:
    kind: str
    lat: F64
    lon: F64


def _clip(lat: F64, lon: F64) -> tuple[F64, F64]:
    return np.clip(lat, -90.0, 90.0), np.clip(lon, -180.0, 180.0)


def _city_centre(rng: np.random.Generator) -> tuple[float, float]:
    return float(rng.uniform(-60, 60)), float(rng.uniform(-170, 170))


def _uniform(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    lat0, lon0 = _city_centre(rng)
    half = rng.choice([0.002, 0.02, 0.1])  # 0.4 km … 20 km boxes
    return lat0 + rng.uniform(-half, half, n), lon0 + rng.uniform(-half, half, n)


def _clustered(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    lat0, lon0 = _city_centre(rng)
    centres = rng.uniform(-0.05, 0.05, (int(rng.integers(1, 4)), 2))
    which = rng.integers(0, len(centres), n)
    spread = rng.choice([1e-5, 3e-4, 2e-3])
    return lat0 + centres[which, 0] + rng.normal(0, spread, n), lon0 + centres[which, 1] + rng.normal(0, spread, n)


def _one_point(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    lat0, lon0 = _city_centre(rng)
    return np.full(n, lat0), np.full(n, lon0)


def _grid_exact(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    """Exact binary multiples of 2^s/64 degrees: on cell boundaries of width 2^s µdeg (0 for every s)."""
    s = int(rng.integers(0, 11))
    step = 2.0**s / 64
    anchor_lat = step * round(float(rng.uniform(-60, 60)) / step) if rng.random() < 0.7 else 0.0
    anchor_lon = step * round(float(rng.uniform(-170, 170)) / step) if rng.random() < 0.7 else 0.0
    lat = anchor_lat + rng.integers(-3, 4, n) / 64
    lon = anchor_lon + rng.integers(-3, 4, n) / 64
    return _perturb(rng, lat, lon)


def _grid_udeg(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    """Micro-degrees ``m · 2^s − 2^28`` (grid.py's cell edges at level 29 − s, so also every coarser
    level's) written as the floats a client sends for them, and ±1 µdeg; some users share a point."""
    s = int(rng.integers(4, 21))
    out = []
    for lo, hi in ((-60, 60), (-170, 170)):
        m0 = (int(rng.uniform(lo, hi) * 1e6) + GRID_OFFSET) >> s
        udeg = (m0 + rng.integers(-2, 3, n)) * (1 << s) - GRID_OFFSET + rng.integers(-1, 2, n)
        out.append(udeg / 1e6)
    return _duplicate(rng, out[0], out[1])


def _decimal_grid(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    """Coordinates on a 4-, 5- or 6-decimal grid, as apps and traces send them (T-Drive: 5).

    Each is the float of its decimal text (integer / 10^d, correctly rounded), so it lies exactly
    on a whole micro-degree as a client reads it. A small span puts many users on shared grid
    lines; some users copy another's point.
    """
    d = int(rng.choice([4, 5, 6]))
    scale = 10**d
    lat0, lon0 = (39.9, 116.4) if rng.random() < 0.3 else _city_centre(rng)
    span = int(rng.choice([2, 20, 300]))
    ilat = round(lat0 * scale) + rng.integers(-span, span + 1, n)
    ilon = round(lon0 * scale) + rng.integers(-span, span + 1, n)
    return _duplicate(rng, ilat / scale, ilon / scale)


def _duplicate(rng: np.random.Generator, lat: F64, lon: F64) -> tuple[F64, F64]:
    """Put about a quarter of the users on another user's point (co-located users)."""
    n = len(lat)
    lat, lon = np.array(lat, dtype=np.float64), np.array(lon, dtype=np.float64)
    dup = rng.random(n) < 0.25
    src = rng.integers(0, n, n)
    lat[dup] = lat[src[dup]]
    lon[dup] = lon[src[dup]]
    return lat, lon


def _perturb(rng: np.random.Generator, lat: F64, lon: F64) -> tuple[F64, F64]:
    """Leave most points exact; move some one micro-degree or one ulp off."""
    for a in (lat, lon):
        choice = rng.integers(0, 5, len(a))
        a[choice == 1] += 1e-6
        a[choice == 2] -= 1e-6
        a[choice == 3] = np.nextafter(a[choice == 3], np.inf)
    return lat, lon


def _world_edges(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    """Near and exactly on ±180°, ±85° and the poles (contract §0's world-edge exception)."""
    lat0 = float(rng.choice([85.0, -85.0, 90.0, -90.0, 89.9999, 0.0]))
    lon0 = float(rng.choice([180.0, -180.0, 179.99, -179.99, 0.0]))
    spread = rng.choice([1e-5, 1e-3, 0.05])
    lat = lat0 + rng.uniform(-spread, spread, n)
    lon = lon0 + rng.uniform(-spread, spread, n)
    lat[rng.random(n) < 0.3] = lat0
    lon[rng.random(n) < 0.3] = lon0
    return _clip(lat, lon)


GENERATORS = {
    "uniform": _uniform,
    "clustered": _clustered,
    "one_point": _one_point,
    "grid_exact": _grid_exact,
    "grid_udeg": _grid_udeg,
    "decimal_grid": _decimal_grid,
    "world_edges": _world_edges,
}


@st.composite
def populations(draw: st.DrawFn, max_n: int = 30, kinds: Sequence[str] | None = None) -> Population:
    kind = draw(st.sampled_from(sorted(GENERATORS) if kinds is None else list(kinds)))
    n = draw(st.one_of(st.just(1), st.integers(2, max_n)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lat, lon = GENERATORS[kind](rng, n)
    lat, lon = _clip(np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64))
    return Population(kind, lat, lon)


@st.composite
def stored_profiles(draw: st.DrawFn, n: int, *, l_max: int = 1) -> list[PrivacyProfile]:
    """Personalized stored profiles; one ``max_area_m2`` for everyone (see test_heterogeneous_max_area)."""
    max_area = draw(st.sampled_from([4.0e6, 2.5e9, 5.0e4]))
    out = []
    for _ in range(n):
        k = draw(st.integers(1, 6))
        min_area = draw(st.sampled_from([0.0, 0.0, 1.0e3, 2.0e4]))
        out.append(PrivacyProfile(k=k, l=draw(st.integers(1, l_max)), min_area_m2=min_area, max_area_m2=max_area))
    return out


@st.composite
def overrides(draw: st.DrawFn, stored: PrivacyProfile, *, l_max: int = 1) -> dict[str, Any] | None:
    """A tightened per-query override (§3.2), or none."""
    if draw(st.booleans()):
        return None
    out: dict[str, Any] = {}
    if draw(st.booleans()):
        out["k"] = stored.k + draw(st.integers(0, 8))
    if l_max > 1 and draw(st.booleans()):
        out["l"] = max(stored.l, draw(st.integers(1, l_max)))
    if draw(st.booleans()):
        grown = stored.min_area_m2 + draw(st.sampled_from([0.0, 5.0e3, 1.0e5]))
        out["min_area_m2"] = min(grown, stored.max_area_m2)
    if draw(st.booleans()):
        out["max_area_m2"] = max(
            out.get("min_area_m2", stored.min_area_m2), stored.max_area_m2 * draw(st.sampled_from([1.0, 0.5, 0.01]))
        )
    return out


# -- one scenario -------------------------------------------------------------------------------


def _view(ids: Sequence[str], pop: Population, stored: Sequence[PrivacyProfile], seed: int) -> IndexView:
    return IndexView.from_points(
        ids,
        pop.lat,
        pop.lon,
        k=[p.k for p in stored],
        min_area_m2=[p.min_area_m2 for p in stored],
        max_area_m2=[p.max_area_m2 for p in stored],
        now=NOW,
        seed=seed,
    )


def check_snapshot_cloaker(
    name: str,
    pop: Population,
    stored: Sequence[PrivacyProfile],
    requests: Sequence[tuple[int, Mapping[str, Any] | None]],
    *,
    seed: int = 7,
    places: Places | None = None,
    params: Mapping[str, Any] | None = None,
) -> list[Violation | str]:
    """Cloak every request, check each outcome independently, compare the batch path; returns all failures."""
    ids = [f"u{i}" for i in range(len(pop.lat))]
    view = _view(ids, pop, stored, seed)
    replay = _view(ids, pop, stored, seed)
    snap = Snapshot.from_arrays(ids, pop.lat, pop.lon, now=NOW)
    cloaker = make_cloaker(name, **(params or {}))
    stored_map = dict(zip(ids, stored, strict=True))
    failures: list[Violation | str] = []
    effective = [stored[q].tightened(ov) for q, ov in requests]
    results = []
    for (q, ov), eff in zip(requests, effective, strict=True):
        res = cloaker.cloak(view, q, eff)
        results.append(res)
        if isinstance(res, Region):
            failures += check_region(
                snap,
                ids[q],
                Published.of(res),
                effective=eff,
                stored=stored_map,
                override=ov,
                places=places,
                cloaker=cloaker,
                view=view,
                replay_view=replay,
            )
        elif isinstance(res, Refusal):
            failures += check_refusal(
                snap,
                ids[q],
                str(res.reason),
                effective=eff,
                allowed=ALLOWED_CODES[name],
                supports_l=bool(cloaker.supports_l) and places is not None and len(places.lat) > 0,
            ).violations
        else:
            failures.append(f"{ids[q]}: cloak returned {type(res).__name__}")
    rows = np.asarray([q for q, _ in requests], dtype=np.int64)
    batch = cloaker.cloak_batch(_view(ids, pop, stored, seed), rows, ProfileArrays.from_profiles(effective))
    failures += compare_batch(batch, results, [ids[q] for q, _ in requests])
    return failures


def compare_batch(batch: Any, results: Sequence[Any], who: Sequence[str]) -> list[Violation | str]:
    """``cloak_batch`` equals ``cloak`` element-wise: same outcome, bbox, k_achieved, area."""
    out: list[Violation | str] = []
    if len(batch) != len(results):
        return [f"batch: {len(batch)} results for {len(results)} requests"]
    for i, res in enumerate(results):
        b = batch[i]
        if isinstance(res, Refusal):
            if not isinstance(b, Refusal) or b.reason != res.reason:
                out.append(f"{who[i]}: batch {b!r} != cloak {res!r}")
            continue
        if int(batch.status[i]) != STATUS_OK or not isinstance(b, Region):
            out.append(f"{who[i]}: batch refused {b!r}, cloak answered {res.bbox}")
            continue
        if (
            b.bbox != res.bbox
            or b.k_achieved != res.k_achieved
            or not math.isclose(b.area_m2, res.area_m2, rel_tol=1e-12)
        ):
            out.append(
                f"{who[i]}: batch {b.bbox}/{b.k_achieved}/{b.area_m2} "
                f"!= cloak {res.bbox}/{res.k_achieved}/{res.area_m2}"
            )
    return out


@st.composite
def scenarios(
    draw: st.DrawFn, *, l_max: int = 1, max_n: int = 30, kinds: Sequence[str] | None = None
) -> tuple[Population, list[PrivacyProfile], list[tuple[int, dict[str, Any] | None]], int]:
    pop = draw(populations(max_n=max_n, kinds=kinds))
    n = len(pop.lat)
    stored = draw(stored_profiles(n, l_max=l_max))
    queriers = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=min(n, 8), unique=True))
    requests = [(q, draw(overrides(stored[q], l_max=l_max))) for q in queriers]
    return pop, stored, requests, draw(st.integers(0, 2**31))


def _report(failures: Sequence[Violation | str]) -> str:
    return "\n".join(str(f) for f in failures[:20])


@pytest.mark.parametrize(
    "name, params",
    [("nn", {}), ("interval", {}), ("casper", {}), ("casper", {"variant": "adaptive"}), ("hilbert", {})],
)
@PROPERTY_SETTINGS
@given(case=scenarios())
def test_snapshot_cloaker_passes_the_checker(name: str, params: dict[str, Any], case: Any) -> None:
    pop, stored, requests, seed = case
    failures = check_snapshot_cloaker(name, pop, stored, requests, seed=seed, params=params)
    assert failures == [], f"{name} on {pop.kind}:\n{_report(failures)}"


def _random_places(rng: np.random.Generator, pop: Population, m: int) -> Places:
    """Places around the population (clipped, so some sit exactly on the world edge)."""
    lat0, lat1 = float(pop.lat.min()), float(pop.lat.max())
    lon0, lon1 = float(pop.lon.min()), float(pop.lon.max())
    pad = 0.01
    lat = np.clip(rng.uniform(lat0 - pad, lat1 + pad, m), -90.0, 90.0)
    lon = np.clip(rng.uniform(lon0 - pad, lon1 + pad, m), -180.0, 180.0)
    cats = [CATEGORIES[int(i)] for i in rng.integers(0, len(CATEGORIES), m)]
    return Places.from_arrays(lat, lon, cats)


def _places_layer(places: Places) -> PlacesLayer:
    names = tuple(sorted({str(c) for c in places.category}))
    code = {c: i for i, c in enumerate(names)}
    return PlacesLayer(
        lat=places.lat,
        lon=places.lon,
        category_code=np.asarray([code[str(c)] for c in places.category], dtype=np.int64),
        category_names=names,
    )


@PROPERTY_SETTINGS
@given(case=scenarios(l_max=4), m=st.integers(0, 60), places_seed=st.integers(0, 2**31))
def test_privacygrid_with_places_passes_the_checker(case: Any, m: int, places_seed: int) -> None:
    pop, stored, requests, seed = case
    places = _random_places(np.random.default_rng(places_seed), pop, m)
    failures = check_snapshot_cloaker(
        "privacygrid", pop, stored, requests, seed=seed, places=places, params={"places": _places_layer(places)}
    )
    assert failures == [], f"privacygrid on {pop.kind}:\n{_report(failures)}"


@pytest.mark.parametrize("name", SNAPSHOT_ALGORITHMS)
def test_k_larger_than_the_population_is_k_unreachable(name: str) -> None:
    pop = Population("uniform", np.array([40.0, 40.001, 40.002]), np.array([-74.0, -74.001, -74.002]))
    stored = [PrivacyProfile(k=2, min_area_m2=0.0)] * 3
    cloaker = make_cloaker(name)
    view = _view(["a", "b", "c"], pop, stored, 1)
    for k in (4, 10, 1000):
        res = cloaker.cloak(view, 0, PrivacyProfile(k=k, min_area_m2=0.0))
        assert isinstance(res, Refusal) and res.reason == "k_unreachable"


@pytest.mark.parametrize("name", ["nn", "interval", "casper", "hilbert"])
def test_l_above_one_is_unsupported(name: str) -> None:
    pop = Population("uniform", np.array([40.0, 40.001, 40.002]), np.array([-74.0, -74.001, -74.002]))
    stored = [PrivacyProfile(k=2, min_area_m2=0.0)] * 3
    view = _view(["a", "b", "c"], pop, stored, 1)
    res = make_cloaker(name).cloak(view, 0, PrivacyProfile(k=2, l=2, min_area_m2=0.0))
    assert isinstance(res, Refusal) and res.reason == "unsupported"


def test_population_generators_hit_their_edge_cases() -> None:
    """The generators really produce exact cell-boundary, world-edge and coincident coordinates."""
    rng = np.random.default_rng(3)
    lat, lon = _grid_exact(rng, 400)
    assert np.any((lon * 64 == np.round(lon * 64)) & (lat * 64 == np.round(lat * 64)))
    assert np.any(np.abs(lon * 1e6 - np.round(lon * 1e6)) > 0)  # and some off the boundaries
    seen: set[str] = set()
    for seed in range(30):
        lat, lon = _world_edges(np.random.default_rng(seed), 50)
        seen |= {"lon180"} if np.any(np.abs(lon) == 180.0) else set()
        seen |= {"pole"} if np.any(np.abs(lat) == 90.0) else set()
        seen |= {"lat85"} if np.any(np.abs(lat) == 85.0) else set()
    assert seen == {"lon180", "pole", "lat85"}
    lat, lon = _one_point(rng, 5)
    assert len(set(zip(lat.tolist(), lon.tolist(), strict=True))) == 1
    lat, lon = _grid_udeg(rng, 50)
    assert np.all(np.abs(lat) <= 90) and np.all(np.abs(lon) <= 180)
    assert np.all(np.rint(lon * 1e6) / 1e6 == lon)  # the floats of whole micro-degrees
    decimals: set[int] = set()
    for seed in range(30):
        lat, lon = _decimal_grid(np.random.default_rng(seed), 40)
        for d in (4, 5, 6):
            if np.all(np.rint(lat * 10**d) / 10**d == lat) and np.all(np.rint(lon * 10**d) / 10**d == lon):
                decimals.add(d)
                break
        points = list(zip(lat.tolist(), lon.tolist(), strict=True))
        assert len(set(points)) < len(points)  # co-located users
        assert len(set(lon.tolist())) < len(points)  # users on a shared grid line
    assert decimals == {4, 5, 6}


# -- regression tests for deviations the property tests found (fixed since) ------------------------


@pytest.mark.parametrize("name", SNAPSHOT_ALGORITHMS)
@pytest.mark.parametrize("lat, lon", [(45.0, 180.0), (-90.0, -179.5), (90.0, -180.0)])
def test_world_edge_user_is_counted(name: str, lat: float, lon: float) -> None:
    """A lone user exactly on the world edge with k = 1 gets a region: contract §0 waives strictness there.

    Found by these property tests: the core once counted strictly on every side, so such users were
    never counted and every cloaker refused (``k_unreachable``, "internal check").
    """
    pop = Population("world_edges", np.array([lat]), np.array([lon]))
    stored = [PrivacyProfile(k=1, max_area_m2=2.5e9, min_area_m2=0.0)]
    failures = check_snapshot_cloaker(name, pop, stored, [(0, None)])
    res = make_cloaker(name).cloak(_view(["u0"], pop, stored, 7), 0, stored[0])
    assert isinstance(res, Region), res
    assert res.k_achieved == 1
    assert failures == []


def test_nn_batch_equals_cloak_on_the_world_edge() -> None:
    """Found here: nn's batch path (no final k guard) published k_achieved = 0 where cloak refused."""
    pop = Population("world_edges", np.array([45.0, 45.00001]), np.array([180.0, 180.0]))
    stored = [PrivacyProfile(k=2, min_area_m2=0.0)] * 2
    assert check_snapshot_cloaker("nn", pop, stored, [(0, None), (1, None)]) == []
    view = _view(["u0", "u1"], pop, stored, 7)
    batch = make_cloaker("nn").cloak_batch(view, np.array([0, 1]), ProfileArrays.from_profiles(stored))
    assert [getattr(batch[i], "k_achieved", None) for i in range(2)] == [2, 2]


def test_hilbert_unplaceable_population_refusal_code() -> None:
    """Found here: with the population smaller than its largest stored k, hilbert refused k_unreachable
    although n_present >= E.k; contract §2 reserves that code for fewer than E.k present users."""
    pop = Population("uniform", np.array([40.0, 40.001, 40.002, 40.003]), np.array([-74.0, -74.001, -74.002, -74.0]))
    stored = [
        PrivacyProfile(k=5, min_area_m2=0.0),
        PrivacyProfile(k=1, min_area_m2=0.0),
        PrivacyProfile(k=1, min_area_m2=0.0),
        PrivacyProfile(k=1, min_area_m2=0.0),
    ]
    res = make_cloaker("hilbert").cloak(_view(["u0", "u1", "u2", "u3"], pop, stored, 7), 1, stored[1])
    assert isinstance(res, Refusal)
    assert res.reason == "area_exceeded", res
    assert check_snapshot_cloaker("hilbert", pop, stored, [(1, None), (0, None)]) == []


# -- personalized stored max_area_m2: buckets too large for a member are refused whole ---------------


def test_hilbert_reciprocal_with_heterogeneous_stored_max_area() -> None:
    rng = np.random.default_rng(0)
    n = 10
    pop = Population("uniform", 40 + rng.uniform(0, 0.01, n), -74 + rng.uniform(0, 0.01, n))
    stored = [PrivacyProfile(k=2, min_area_m2=0.0)] * n
    ids = [f"u{i}" for i in range(n)]
    view = _view(ids, pop, stored, 7)
    first = make_cloaker("hilbert").cloak(view, 0, stored[0])
    assert isinstance(first, Region)
    mate = next(int(r) for r in first.anon_set if r != 0)
    stored = list(stored)
    stored[mate] = PrivacyProfile(k=2, max_area_m2=first.area_m2 / 2, min_area_m2=0.0)
    failures = check_snapshot_cloaker("hilbert", pop, stored, [(0, None)])
    assert failures == []


# -- CliqueCloak through run_stream (§9.4) --------------------------------------------------------


def _clique_cloaker(**params: Any) -> Any:
    return make_cloaker("clique", **params)


@st.composite
def clique_streams(draw: st.DrawFn) -> list[Any]:
    """Requests of up to 25 users (one or two each) over a minute, personalized k and tolerances."""
    from kcloak.cloaking.cloakers.clique import CliqueRequest

    pop = draw(populations(max_n=25))
    out = []
    for i, (lat, lon) in enumerate(zip(pop.lat.tolist(), pop.lon.tolist(), strict=True)):
        for j in range(draw(st.integers(1, 2))):
            max_area = draw(st.sampled_from([1.0e4, 1.0e6, 4.0e6, 2.5e9]))
            min_area = min(draw(st.sampled_from([0.0, 0.0, 1.0e3, 5.0e4])), max_area)
            out.append(
                CliqueRequest(
                    request_id=f"r{i}.{j}",
                    user=f"u{i}",
                    lat=lat,
                    lon=lon,
                    t=draw(st.floats(0.0, 60.0)),
                    k=draw(st.integers(1, 5)),
                    min_area_m2=min_area,
                    max_area_m2=max_area,
                    max_delay_s=draw(st.sampled_from([0.0, 5.0, 30.0])),
                )
            )
    return out


def run_and_check_clique(requests: Sequence[Any], seed: int = 1) -> tuple[list[Violation], Any, Any]:
    releases, expired = _clique_cloaker(seed=seed).run_stream([(r.t, r) for r in requests])
    return check_clique_stream(requests, releases, expired), releases, expired


@PROPERTY_SETTINGS
@given(requests=clique_streams(), seed=st.integers(0, 2**32))
def test_clique_stream_passes_the_checker(requests: list[Any], seed: int) -> None:
    violations, releases, expired = run_and_check_clique(requests, seed)
    assert violations == [], "\n".join(str(v) for v in violations[:20])
    again = _clique_cloaker(seed=seed).run_stream([(r.t, r) for r in requests])
    assert again == (releases, expired)  # deterministic given the stream and the seed


def test_clique_3_worked_example() -> None:
    """§4.5 test clique_3 in metres on the equator (1 m ≈ 8.98e-6°), every box 20 m wide."""
    from kcloak.cloaking.cloakers.clique import CliqueRequest

    deg = 1 / 111_195.08
    spec = [("ma", 0.0, 0.0, 3), ("mb", 4.0, 0.0, 2), ("mc", 2.0, 3.0, 3)]
    reqs = [CliqueRequest(n, n, y * deg, x * deg, float(i), k, 0.0, 400.0, 30.0) for i, (n, x, y, k) in enumerate(spec)]
    cloaker = _clique_cloaker(seed=1)
    assert cloaker.submit(reqs[0], 0.0) == []
    assert cloaker.submit(reqs[1], 1.0) == []
    (release,) = cloaker.submit(reqs[2], 2.0)
    assert {m.request_id for m in release.members} == {"ma", "mb", "mc"}
    assert check_clique_stream(reqs, [release], []) == []


def test_clique_counts_distinct_senders() -> None:
    """Found here: two pending requests of one user formed a k = 2 clique (2 identical regions, 1 sender)."""
    from kcloak.cloaking.cloakers.clique import CliqueRequest

    a = CliqueRequest("a", "u0", 40.0, -74.0, 0.0, 2, 0.0, 4.0e6, 30.0)
    b = CliqueRequest("b", "u0", 40.0, -74.0, 1.0, 2, 0.0, 4.0e6, 30.0)
    c = CliqueRequest("c", "u1", 40.0001, -74.0, 2.0, 2, 0.0, 4.0e6, 30.0)
    releases, expired = _clique_cloaker(seed=1).run_stream([(0.0, a), (1.0, b), (2.0, c)])
    assert check_clique_stream([a, b, c], releases, expired) == []
    assert [{m.user for m in r.members} for r in releases] == [{"u0", "u1"}]
    assert len(expired) == 1 and expired[0][1].user == "u0"


# -- users on micro-degrees: no published edge is a user's coordinate (issue 13) ---------------------


def _client_edges(region: Region) -> list[float]:
    """The bbox as a client parses the forwarded JSON."""
    edges: list[float] = json.loads(json.dumps(region.bbox.to_geojson()))
    return edges


def _assert_no_corner_is_a_user(region: Region, pop: Population) -> None:
    """No corner of the published bbox is any user's position, as a client reads both (for
    populations the region holds entirely: a grid cell's corner may be the position of a user
    of the next cell, who is not counted in it, contract §0)."""
    b = _client_edges(region)
    corners = {(lo, la) for lo in (b[0], b[2]) for la in (b[1], b[3])}
    for la, lo in zip(pop.lat.tolist(), pop.lon.tolist(), strict=True):
        assert (lo, la) not in corners, (b, la, lo)


def _assert_no_edge_is_a_coordinate(region: Region, pop: Population) -> None:
    """For populations the region must hold entirely: no edge equals any user's coordinate."""
    b = _client_edges(region)
    for la, lo in zip(pop.lat.tolist(), pop.lon.tolist(), strict=True):
        assert lo not in (b[0], b[2]) and la not in (b[1], b[3]), (b, la, lo)


CONTRACT_FIX = (39.908692, 116.397477)
"""The contract's example fix: a 6-decimal position that the old keys put on a published corner."""


@pytest.mark.parametrize("name", SNAPSHOT_ALGORITHMS)
def test_contract_example_fix_alone_at_k1_is_strictly_inside(name: str) -> None:
    pop = Population("decimal_grid", np.array([CONTRACT_FIX[0]]), np.array([CONTRACT_FIX[1]]))
    stored = [PrivacyProfile(k=1, min_area_m2=0.0)]
    assert check_snapshot_cloaker(name, pop, stored, [(0, None)]) == []
    res = make_cloaker(name).cloak(_view(["u0"], pop, stored, 7), 0, stored[0])
    assert isinstance(res, Region) and res.k_achieved == 1
    _assert_no_edge_is_a_coordinate(res, pop)


@pytest.mark.parametrize("name", SNAPSHOT_ALGORITHMS)
def test_two_users_at_k2_neither_is_a_corner(name: str) -> None:
    """The contract's second example: two users at k = 2 got a bbox whose south-west corner was one
    user's position to every digit sent."""
    pop = Population("decimal_grid", np.array([CONTRACT_FIX[0], 39.90912]), np.array([CONTRACT_FIX[1], 116.39811]))
    stored = [PrivacyProfile(k=2, min_area_m2=0.0)] * 2
    assert check_snapshot_cloaker(name, pop, stored, [(0, None), (1, None)]) == []
    view = _view(["u0", "u1"], pop, stored, 7)
    for row in (0, 1):
        res = make_cloaker(name).cloak(view, row, stored[row])
        assert isinstance(res, Region) and res.k_achieved == 2
        _assert_no_edge_is_a_coordinate(res, pop)


def test_clique_contract_examples_are_strictly_inside() -> None:
    from kcloak.cloaking.cloakers.clique import CliqueRequest

    reqs = [
        CliqueRequest("a", "u0", CONTRACT_FIX[0], CONTRACT_FIX[1], 0.0, 2, 0.0, 4.0e6, 30.0),
        CliqueRequest("b", "u1", 39.90912, 116.39811, 1.0, 2, 0.0, 4.0e6, 30.0),
        CliqueRequest("c", "u2", CONTRACT_FIX[0], CONTRACT_FIX[1], 2.0, 1, 0.0, 4.0e6, 30.0),
    ]
    violations, releases, expired = run_and_check_clique(reqs)
    assert violations == [] and expired == [] and len(releases) == 2
    pop = Population("decimal_grid", np.array([r.lat for r in reqs]), np.array([r.lon for r in reqs]))
    for rel in releases:
        _assert_no_corner_is_a_user(rel, pop)


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 30),
    k=st.integers(1, 5),
    max_area=st.sampled_from([1.0e4, 4.0e6, 2.5e9]),
    min_area=st.sampled_from([0.0, 1.0e4, 1.0e6]),
    kind=st.sampled_from(["decimal_grid", "grid_udeg", "one_point", "grid_exact"]),
)
def test_temporal_cells_pass_the_checker(
    seed: int, n: int, k: int, max_area: float, min_area: float, kind: str
) -> None:
    """Temporal cloaking's published quadtree cell around users on micro-degrees and cell edges."""
    from kcloak.cloaking.temporal import ArrayFixHistory, temporal_cloak

    rng = np.random.default_rng(seed)
    lat, lon = GENERATORS[kind](rng, n)
    lat, lon = _clip(np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64))
    ids = [f"u{i}" for i in range(n)]
    history = ArrayFixHistory(ids, [NOW] * n, lat, lon)
    snap = Snapshot.from_arrays(ids, lat, lon, now=NOW)
    profile = PrivacyProfile(k=k, min_area_m2=min(min_area, max_area), max_area_m2=max_area)
    for q in range(min(n, 6)):
        res = temporal_cloak(history, float(lat[q]), float(lon[q]), NOW, profile)
        if isinstance(res, Region):
            assert check_region(snap, ids[q], Published.of(res), effective=profile) == []
        elif res is not None:
            assert isinstance(res, Refusal) and res.reason == "area_exceeded"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 6))
def test_every_region_on_a_five_decimal_population_has_no_user_on_an_edge(seed: int, k: int) -> None:
    """T-Drive-like positions (5 decimals, several users per grid line and per point): the issue's
    replay found nn and hilbert regions with fewer than k users strictly inside and the querier on
    an edge, as any client parsing the JSON numbers sees it."""
    rng = np.random.default_rng(seed)
    n = 40
    lat = (3_992_500 + rng.integers(0, 150, n)) / 1e5
    lon = (11_630_300 + rng.integers(0, 150, n)) / 1e5
    lat, lon = _duplicate(rng, lat, lon)
    pop = Population("decimal_grid", lat, lon)
    stored = [PrivacyProfile(k=k, min_area_m2=0.0)] * n
    requests: list[tuple[int, Mapping[str, Any] | None]] = [(q, None) for q in range(0, n, 5)]
    for name in SNAPSHOT_ALGORITHMS:
        assert check_snapshot_cloaker(name, pop, stored, requests) == [], name
        view = _view([f"u{i}" for i in range(n)], pop, stored, 7)
        cloaker = make_cloaker(name)
        for q, _ in requests:
            res = cloaker.cloak(view, q, stored[q])
            assert isinstance(res, Region)
            b = _client_edges(res)
            inside = (lon > b[0]) & (lon < b[2]) & (lat > b[1]) & (lat < b[3])
            assert bool(inside[q]) and int(inside.sum()) == res.k_achieved >= k, name


# -- co-located users under the shipped default profile (issue 13 item 4) ----------------------------


@pytest.mark.parametrize("name", SNAPSHOT_ALGORITHMS)
def test_default_profile_does_not_pinpoint_co_located_users(name: str) -> None:
    """Five users at one point got a 0.0095 m² region under the old default (min_area_m2 = 0): a box
    a few micro-degrees wide that tells where all five are. The default floor is 10,000 m² now."""
    default = PrivacyProfile()
    assert default.min_area_m2 == 10_000.0
    pop = Population("one_point", np.full(5, CONTRACT_FIX[0]), np.full(5, CONTRACT_FIX[1]))
    stored = [default] * 5
    assert check_snapshot_cloaker(name, pop, stored, [(q, None) for q in range(5)]) == []
    view = IndexView.from_points([f"u{i}" for i in range(5)], pop.lat, pop.lon, now=NOW, seed=7)
    res = make_cloaker(name).cloak(view, 0, default)
    assert isinstance(res, Region) and res.k_achieved == 5
    assert res.area_m2 >= 10_000.0 and res.bbox.area_m2 == res.area_m2


def test_default_profile_clique_and_temporal_do_not_pinpoint_co_located_users() -> None:
    from kcloak.cloaking.cloakers.clique import CliqueRequest
    from kcloak.cloaking.temporal import ArrayFixHistory, temporal_cloak

    d = PrivacyProfile()
    lat, lon = CONTRACT_FIX
    reqs = [
        CliqueRequest(f"r{i}", f"u{i}", lat, lon, float(i), d.k, d.min_area_m2, d.max_area_m2, d.max_delay_s)
        for i in range(5)
    ]
    violations, releases, expired = run_and_check_clique(reqs)
    assert violations == [] and expired == [] and len(releases) == 1
    assert releases[0].area_m2 >= 10_000.0
    history = ArrayFixHistory([f"u{i}" for i in range(5)], [NOW] * 5, [lat] * 5, [lon] * 5)
    region = temporal_cloak(history, lat, lon, NOW, d)
    assert isinstance(region, Region) and region.k_achieved == 5 and region.area_m2 >= 10_000.0
