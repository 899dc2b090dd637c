"""PrivacyGrid (CONCEPTS §4.6): k and l honoured, exact counts, refusal codes, modes, tie order."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import Cloaker, Refusal, Region, get_cloaker
from kcloak.cloaking.cloakers.privacygrid import DEFAULT_LEVEL, PrivacyGridCloak
from kcloak.cloaking.grid import cell_udeg
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox, bbox_area_m2
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

F64 = npt.NDArray[np.float64]
LEVEL = DEFAULT_LEVEL


def make_view(lat: npt.ArrayLike, lon: npt.ArrayLike) -> IndexView:
    lat_a = np.asarray(lat, dtype=np.float64)
    return IndexView.from_points([f"u{i}" for i in range(len(lat_a))], lat_a, lon)


def make_places(lat: npt.ArrayLike, lon: npt.ArrayLike, codes: npt.ArrayLike, n_categories: int) -> PlacesLayer:
    return PlacesLayer(
        lat=np.asarray(lat, dtype=np.float64),
        lon=np.asarray(lon, dtype=np.float64),
        category_code=np.asarray(codes, dtype=np.int64),
        category_names=tuple(f"c{i}" for i in range(n_categories)),
    )


NO_PLACES = make_places([], [], [], 0)


def _inside_1d(v: float, lo_udeg: int, hi_udeg: int, world: int) -> bool:
    """Strict (but at the world edge) as a client reads it: float64 and exact decimals of the texts."""
    u = 10**6
    ok = True
    for x, lo, hi in (
        (v, lo_udeg / u, hi_udeg / u),
        (Fraction(repr(v)), Fraction(lo_udeg, u), Fraction(hi_udeg, u)),
    ):
        ok = ok and (lo < x or x == lo == -world) and (x < hi or x == hi == world)
    return ok


def strictly_inside(bbox: BBox, lat: float, lon: float) -> bool:
    """Contract §0 containment by brute force: strict, but at the world edge."""
    lon_ok = _inside_1d(lon, bbox.min_lon_udeg, bbox.max_lon_udeg, 180)
    lat_ok = _inside_1d(lat, bbox.min_lat_udeg, bbox.max_lat_udeg, 90)
    return lon_ok and lat_ok


def brute_users(view: IndexView, bbox: BBox) -> int:
    return sum(strictly_inside(bbox, la, lo) for la, lo in zip(view.lat.tolist(), view.lon.tolist(), strict=True))


def brute_categories(places: PlacesLayer, bbox: BBox) -> int:
    return len(
        {
            c
            for la, lo, c in zip(places.lat.tolist(), places.lon.tolist(), places.category_code.tolist(), strict=True)
            if strictly_inside(bbox, la, lo)
        }
    )


def check_region(view: IndexView, row: int, prof: PrivacyProfile, places: PlacesLayer, region: Region) -> None:
    """The §9.1 checks 1–5 by brute force."""
    b = region.bbox
    assert strictly_inside(b, float(view.lat[row]), float(view.lon[row]))
    assert region.k_achieved == brute_users(view, b) >= prof.k
    area = bbox_area_m2(*b.to_geojson())
    assert region.area_m2 == area
    assert prof.min_area_m2 <= area <= prof.max_area_m2
    assert region.l_achieved == brute_categories(places, b)
    if prof.l > 1:
        assert region.l_achieved >= prof.l
    assert region.algorithm == "privacygrid"


def cell_centre(cx: int, cy: int, level: int = LEVEL) -> tuple[float, float]:
    lon0, lat0, lon1, lat1 = cell_udeg(level, cx, cy)
    return (lat0 + lat1) / 2e6, (lon0 + lon1) / 2e6


def test_protocol_and_registry() -> None:
    pg = get_cloaker("privacygrid", places=NO_PLACES)
    assert isinstance(pg, PrivacyGridCloak)
    assert isinstance(pg, Cloaker)
    assert (pg.name, pg.reciprocal, pg.supports_l) == ("privacygrid", False, True)


def test_default_places_are_the_bundled_layer_loaded_once() -> None:
    a, b = PrivacyGridCloak(), PrivacyGridCloak()
    assert a.places is b.places
    assert len(a.places) > 100


def test_default_cells_are_100_to_250_m() -> None:
    _, lat0, _, lat1 = cell_udeg(LEVEL, 1 << (LEVEL - 1), 1 << (LEVEL - 1))
    ns = bbox_area_m2(0, 0, 0.001, (lat1 - lat0) / 1e6) / bbox_area_m2(0, 0, 0.001, 0.001) * 111.195
    assert 200 < ns < 250
    ew_beijing = ns * np.cos(np.radians(39.9))
    assert 100 < ew_beijing < 250


def test_published_count_equals_count_in() -> None:
    """SAT count + edge extras == exact strict count in the published bbox, edges and µdeg lines included."""
    rng = np.random.default_rng(3)
    base_lat, base_lon = cell_centre(*_cell_at(39.9, 116.4))
    span = 6 * 2048 / 1e6
    lat = base_lat + rng.uniform(-span, span, 3000)
    lon = base_lon + rng.uniform(-span, span, 3000)
    # Users exactly on cell edges, one micro-degree off them and half a micro-degree off them.
    qx, qy = _cell_at(base_lat, base_lon)
    edges_lon = [cell_udeg(LEVEL, qx + d, qy)[0] for d in range(-5, 6)]
    edges_lat = [cell_udeg(LEVEL, qx, qy + d)[1] for d in range(-5, 6)]
    extra_lat, extra_lon = [], []
    for e in edges_lon:
        for off in (-1.0, -0.5, 0.0, 0.5, 1.0):
            extra_lon.append((e + off) / 1e6)
            extra_lat.append(float(rng.uniform(base_lat - span, base_lat + span)))
    for e in edges_lat:
        for off in (-1.0, -0.5, 0.0, 0.5, 1.0):
            extra_lat.append((e + off) / 1e6)
            extra_lon.append(float(rng.uniform(base_lon - span, base_lon + span)))
    for ex in edges_lon[::3]:
        for ey in edges_lat[::3]:
            extra_lat += [ey / 1e6, (ey - 1) / 1e6, (ey - 0.5) / 1e6]
            extra_lon += [ex / 1e6, (ex - 1) / 1e6, (ex - 0.5) / 1e6]
    view = make_view(np.r_[lat, extra_lat], np.r_[lon, extra_lon])
    pg = PrivacyGridCloak(places=NO_PLACES)
    for i in range(400):
        x0 = qx + int(rng.integers(-6, 6))
        y0 = qy + int(rng.integers(-6, 6))
        x1 = x0 + int(rng.integers(0, 6))
        y1 = y0 + int(rng.integers(0, 6))
        bbox = view.cell_rect_bbox(LEVEL, x0, y0, x1, y1)
        assert pg.published_count(view, (x0, y0, x1, y1)) == view.count_in(bbox)
        if i % 20 == 0:
            assert view.count_in(bbox) == brute_users(view, bbox)


def _cell_at(lat: float, lon: float) -> tuple[int, int]:
    view = make_view([lat], [lon])
    return PrivacyGridCloak(places=NO_PLACES).cell_of(view, 0)


def _population(rng: np.random.Generator, n: int) -> tuple[F64, F64]:
    centres = rng.normal([39.9, 116.4], [0.01, 0.01], (3, 2))
    c = rng.integers(0, 3, n)
    lat = centres[c, 0] + rng.normal(0, 0.004, n)
    lon = centres[c, 1] + rng.normal(0, 0.005, n)
    # Some users on whole micro-degrees, where exactness matters.
    on_grid = rng.random(n) < 0.2
    lat[on_grid] = np.round(lat[on_grid], 3)
    lon[on_grid] = np.round(lon[on_grid], 3)
    return lat, lon


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 300),
    n_places=st.integers(0, 80),
    n_cat=st.integers(1, 6),
    k=st.integers(1, 25),
    l_req=st.integers(1, 5),
    max_area=st.sampled_from([3e4, 2e5, 1e6, 4e6, 3e7]),
    min_frac=st.sampled_from([0.0, 0.0, 0.3, 0.9]),
    mode=st.sampled_from(["hybrid", "bottom_up", "top_down"]),
    fallback=st.booleans(),
)
def test_k_and_l_honoured_on_random_populations(
    seed: int,
    n: int,
    n_places: int,
    n_cat: int,
    k: int,
    l_req: int,
    max_area: float,
    min_frac: float,
    mode: str,
    fallback: bool,
) -> None:
    rng = np.random.default_rng(seed)
    lat, lon = _population(rng, n)
    plat = 39.9 + rng.normal(0, 0.015, n_places)
    plon = 116.4 + rng.normal(0, 0.02, n_places)
    places = make_places(plat, plon, rng.integers(0, n_cat, n_places), n_cat)
    view = make_view(lat, lon)
    pg = PrivacyGridCloak(places=places, mode=mode, fallback=fallback)  # type: ignore[arg-type]
    prof = PrivacyProfile(k=k, l=l_req, min_area_m2=min_frac * max_area, max_area_m2=max_area)
    for row in rng.integers(0, n, 5).tolist():
        res = pg.cloak(view, row, prof)
        if isinstance(res, Region):
            check_region(view, row, prof, places, res)
            again = pg.cloak(view, row, prof)  # deterministic
            assert isinstance(again, Region) and again.bbox == res.bbox
        else:
            if l_req > 1 and n_places == 0:
                assert res.reason == ReasonCode.UNSUPPORTED
            elif n < k:
                assert res.reason == ReasonCode.K_UNREACHABLE
            else:
                assert res.reason in (ReasonCode.AREA_EXCEEDED, ReasonCode.L_UNREACHABLE)
                if res.reason == ReasonCode.L_UNREACHABLE:
                    assert l_req > 1


def test_k_only_never_refused_when_the_whole_population_fits() -> None:
    """With fallback, a population inside one admissible box is never refused for k (§9.1 check 9)."""
    rng = np.random.default_rng(5)
    lat = 39.9 + rng.uniform(0, 0.003, 60)
    lon = 116.4 + rng.uniform(0, 0.003, 60)
    view = make_view(lat, lon)
    for mode in ("hybrid", "bottom_up", "top_down"):
        pg = PrivacyGridCloak(places=NO_PLACES, mode=mode)
        prof = PrivacyProfile(k=60, max_area_m2=4e6)
        for row in range(60):
            res = pg.cloak(view, row, prof)
            assert isinstance(res, Region), res
            check_region(view, row, prof, NO_PLACES, res)


def test_k_achieved_is_the_exact_count_in_the_published_bbox() -> None:
    rng = np.random.default_rng(11)
    lat, lon = _population(rng, 5000)
    view = make_view(lat, lon)
    pg = PrivacyGridCloak(places=NO_PLACES)
    for k in (1, 5, 30):
        prof = PrivacyProfile(k=k)
        for row in rng.integers(0, len(view), 100).tolist():
            res = pg.cloak(view, row, prof)
            assert isinstance(res, Region)
            assert res.k_achieved == view.count_in(res.bbox) >= k


def test_refusal_k_unreachable() -> None:
    view = make_view([39.9, 39.901, 39.902], [116.4, 116.4, 116.4])
    res = PrivacyGridCloak(places=NO_PLACES).cloak(view, 0, PrivacyProfile(k=4))
    assert isinstance(res, Refusal) and res.reason == ReasonCode.K_UNREACHABLE


def test_refusal_area_exceeded() -> None:
    # Ten users 5 km apart: k = 5 needs far more than 1 km².
    view = make_view(39.9 + 0.045 * np.arange(10), np.full(10, 116.4))
    prof = PrivacyProfile(k=5, max_area_m2=1e6)
    for mode in ("hybrid", "bottom_up", "top_down"):
        res = PrivacyGridCloak(places=NO_PLACES, mode=mode).cloak(view, 0, prof)
        assert isinstance(res, Refusal) and res.reason == ReasonCode.AREA_EXCEEDED
    # Also when l > 1: k is not reachable within the area, so the code stays area_exceeded.
    places = make_places([39.9, 39.9001], [116.4, 116.4001], [0, 1], 2)
    res = PrivacyGridCloak(places=places).cloak(view, 0, PrivacyProfile(k=5, l=2, max_area_m2=1e6))
    assert isinstance(res, Refusal) and res.reason == ReasonCode.AREA_EXCEEDED


def test_refusal_l_unreachable() -> None:
    rng = np.random.default_rng(2)
    view = make_view(39.9 + rng.uniform(0, 0.002, 50), 116.4 + rng.uniform(0, 0.002, 50))
    # Ten clinics are one category (§1.6); the other category is 30 km away.
    places = make_places(
        np.r_[39.9 + rng.uniform(0, 0.002, 10), 40.2],
        np.r_[116.4 + rng.uniform(0, 0.002, 10), 116.4],
        [0] * 10 + [1],
        2,
    )
    prof = PrivacyProfile(k=10, l=2, max_area_m2=4e6)
    for mode in ("hybrid", "bottom_up", "top_down"):
        res = PrivacyGridCloak(places=places, mode=mode).cloak(view, 0, prof)
        assert isinstance(res, Refusal) and res.reason == ReasonCode.L_UNREACHABLE
    # A larger max area reaches the second category.
    big = PrivacyProfile(k=10, l=2, max_area_m2=2.5e9)
    res = PrivacyGridCloak(places=places).cloak(view, 0, big)
    assert isinstance(res, Region)
    check_region(view, 0, big, places, res)


def test_refusal_unsupported_without_places() -> None:
    view = make_view([39.9] * 3, [116.4, 116.401, 116.402])
    res = PrivacyGridCloak(places=NO_PLACES).cloak(view, 0, PrivacyProfile(k=2, l=2))
    assert isinstance(res, Refusal) and res.reason == ReasonCode.UNSUPPORTED
    ok = PrivacyGridCloak(places=NO_PLACES).cloak(view, 0, PrivacyProfile(k=2, l=1))
    assert isinstance(ok, Region)


def test_l_diversity_with_the_bundled_beijing_places() -> None:
    pg = PrivacyGridCloak()
    places = pg.places
    rng = np.random.default_rng(9)
    lat = 39.99 + rng.normal(0, 0.01, 2000)
    lon = 116.33 + rng.normal(0, 0.01, 2000)
    view = make_view(lat, lon)
    prof = PrivacyProfile(k=10, l=3, max_area_m2=1e8)
    regions = 0
    for row in range(0, 2000, 50):
        res = pg.cloak(view, row, prof)
        if isinstance(res, Region):
            regions += 1
            check_region(view, row, prof, places, res)
    assert regions > 30


def test_bottom_up_and_top_down_both_valid_and_different() -> None:
    rng = np.random.default_rng(4)
    lat, lon = _population(rng, 400)
    places = make_places(39.9 + rng.normal(0, 0.01, 40), 116.4 + rng.normal(0, 0.01, 40), rng.integers(0, 5, 40), 5)
    view = make_view(lat, lon)
    bu = PrivacyGridCloak(places=places, mode="bottom_up", fallback=False)
    td = PrivacyGridCloak(places=places, mode="top_down", fallback=False)
    differ = 0
    for l_req in (1, 3):
        prof = PrivacyProfile(k=8, l=l_req, max_area_m2=2e7)
        for row in range(0, 400, 10):
            a, b = bu.cloak(view, row, prof), td.cloak(view, row, prof)
            for res in (a, b):
                assert isinstance(res, Region), res
                check_region(view, row, prof, places, res)
            assert isinstance(a, Region) and isinstance(b, Region)
            differ += a.bbox != b.bbox
    assert differ > 0


def test_hybrid_picks_bottom_up_when_dense_and_top_down_when_sparse() -> None:
    rng = np.random.default_rng(6)
    dense_lat = 39.9 + rng.uniform(0, 0.004, 200)
    dense_lon = 116.4 + rng.uniform(0, 0.004, 200)
    sparse_lat = 40.2 + rng.uniform(0, 0.05, 30)
    sparse_lon = 116.4 + rng.uniform(0, 0.05, 30)
    view = make_view(np.r_[dense_lat, sparse_lat], np.r_[dense_lon, sparse_lon])
    prof = PrivacyProfile(k=5, max_area_m2=5e7)
    hy = PrivacyGridCloak(places=NO_PLACES, mode="hybrid", fallback=False)
    bu = PrivacyGridCloak(places=NO_PLACES, mode="bottom_up", fallback=False)
    td = PrivacyGridCloak(places=NO_PLACES, mode="top_down", fallback=False)
    for row in (0, 50, 150):  # dense
        h, b = hy.cloak(view, row, prof), bu.cloak(view, row, prof)
        assert isinstance(h, Region) and isinstance(b, Region) and h.bbox == b.bbox
    for row in (200, 215, 229):  # sparse
        h, t = hy.cloak(view, row, prof), td.cloak(view, row, prof)
        assert isinstance(h, Region) and isinstance(t, Region) and h.bbox == t.bbox


@pytest.mark.parametrize(
    ("neighbours", "expected"),
    [
        (("N", "E", "S", "W"), "N"),
        (("E", "S", "W"), "E"),
        (("S", "W"), "S"),
        (("E", "W"), "E"),
        (("N", "S"), "N"),
        (("W",), "W"),
    ],
)
def test_bottom_up_ties_go_n_e_s_w(neighbours: tuple[str, ...], expected: str) -> None:
    """Equal gains: the growth order N, E, S, W decides (§4.6 [design])."""
    qx, qy = _cell_at(39.9, 116.4)
    step = {"N": (0, 1), "E": (1, 0), "S": (0, -1), "W": (-1, 0)}
    pts = [cell_centre(qx, qy)] + [cell_centre(qx + step[d][0], qy + step[d][1]) for d in neighbours]
    view = make_view([p[0] for p in pts], [p[1] for p in pts])
    res = PrivacyGridCloak(places=NO_PLACES, mode="bottom_up").cloak(view, 0, PrivacyProfile(k=2))
    assert isinstance(res, Region)
    dx, dy = step[expected]
    cells = (min(qx, qx + dx), min(qy, qy + dy), max(qx, qx + dx), max(qy, qy + dy))
    assert res.bbox == view.cell_rect_bbox(LEVEL, *cells)
    assert res.k_achieved == 2


def test_top_down_ties_go_n_e_s_w() -> None:
    """A lone querier on the equator, max area = a 5 × 5 box, A_min between 3 × 2 and 3 × 3 boxes.

    Every shrink removes nobody: the more square result wins, then N before E, so the box loses
    two rows on the north and two columns on the east and the querier ends in its NE corner.
    """
    lat, lon = cell_centre(*_cell_at(0.0005, 10.0005))
    view = make_view([lat], [lon])
    qx, qy = PrivacyGridCloak(places=NO_PLACES).cell_of(view, 0)

    def area(x0: int, y0: int, x1: int, y1: int) -> float:
        return view.cell_rect_bbox(LEVEL, qx + x0, qy + y0, qx + x1, qy + y1).area_m2

    a_max = area(-2, -2, 2, 2) * (1 + 1e-9)
    a_min = max(area(-2, -2, 0, -1), area(-2, -2, -1, 0)) * (1 + 1e-9)
    assert a_min < area(-2, -2, 0, 0)
    prof = PrivacyProfile(k=1, min_area_m2=a_min, max_area_m2=a_max)
    res = PrivacyGridCloak(places=NO_PLACES, mode="top_down", fallback=False).cloak(view, 0, prof)
    assert isinstance(res, Region)
    assert res.bbox == view.cell_rect_bbox(LEVEL, qx - 2, qy - 2, qx, qy)


def test_grow_and_shrink_criteria_are_parameters() -> None:
    rng = np.random.default_rng(8)
    lat, lon = _population(rng, 300)
    view = make_view(lat, lon)
    prof = PrivacyProfile(k=12, max_area_m2=2e7)
    for grow in ("density", "count"):
        for shrink in ("fewest_users", "fewest_users_per_cell"):
            pg = PrivacyGridCloak(places=NO_PLACES, grow_criterion=grow, shrink_criterion=shrink)
            for row in range(0, 300, 30):
                res = pg.cloak(view, row, prof)
                assert isinstance(res, Region)
                check_region(view, row, prof, NO_PLACES, res)
    with pytest.raises(ValueError, match="grow_criterion"):
        PrivacyGridCloak(places=NO_PLACES, grow_criterion="best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        PrivacyGridCloak(places=NO_PLACES, mode="sideways")  # type: ignore[arg-type]


def test_min_area_growth_recounts_exactly() -> None:
    rng = np.random.default_rng(12)
    lat, lon = _population(rng, 2000)
    view = make_view(lat, lon)
    pg = PrivacyGridCloak(places=NO_PLACES)
    prof = PrivacyProfile(k=5, min_area_m2=1.5e6, max_area_m2=4e6)
    for row in range(0, 2000, 100):
        res = pg.cloak(view, row, prof)
        assert isinstance(res, Region)
        check_region(view, row, prof, NO_PLACES, res)


def test_window_mode_matches_dense_mode() -> None:
    """Users on two continents: small windows instead of one table, same regions for local queries."""
    rng = np.random.default_rng(13)
    lat_b, lon_b = _population(rng, 500)
    lat = np.r_[lat_b, 48.85 + rng.normal(0, 0.005, 300)]
    lon = np.r_[lon_b, 2.35 + rng.normal(0, 0.005, 300)]
    view = make_view(lat, lon)
    dense = PrivacyGridCloak(places=NO_PLACES)
    windowed = PrivacyGridCloak(places=NO_PLACES, max_sat_cells=10_000)
    prof = PrivacyProfile(k=6)
    for row in range(0, 800, 25):
        a, b = dense.cloak(view, row, prof), windowed.cloak(view, row, prof)
        assert isinstance(a, Region) and isinstance(b, Region)
        assert a.bbox == b.bbox and a.k_achieved == b.k_achieved
        check_region(view, row, prof, NO_PLACES, b)
        x0, y0 = dense.cell_of(view, row)
        assert windowed.published_count(view, (x0 - 1, y0 - 1, x0 + 1, y0 + 1)) == view.count_in(
            view.cell_rect_bbox(LEVEL, x0 - 1, y0 - 1, x0 + 1, y0 + 1)
        )


def test_world_edges() -> None:
    """Near the antimeridian and the pole the published bbox is clipped and counted exactly."""
    rng = np.random.default_rng(14)
    lat = np.r_[rng.uniform(10, 10.01, 30), rng.uniform(89.995, 90.0, 30), [90.0]]
    lon = np.r_[rng.uniform(179.995, 180.0, 30), rng.uniform(-1, 1, 30), [0.0]]
    lon[0] = 180.0
    view = make_view(lat, lon)
    pg = PrivacyGridCloak(places=NO_PLACES)
    prof = PrivacyProfile(k=3, max_area_m2=2.5e9)
    for row in range(1, len(lat) - 1):
        res = pg.cloak(view, row, prof)
        assert isinstance(res, Region), res
        check_region(view, row, prof, NO_PLACES, res)


def test_cloak_batch_matches_cloak() -> None:
    rng = np.random.default_rng(15)
    lat, lon = _population(rng, 500)
    view = make_view(lat, lon)
    pg = PrivacyGridCloak(places=NO_PLACES)
    profiles = [PrivacyProfile(k=int(k), max_area_m2=1e6) for k in rng.integers(1, 200, 40)]
    rows = rng.integers(0, 500, 40).astype(np.int64)
    batch = pg.cloak_batch(view, rows, ProfileArrays.from_profiles(profiles))
    for i, (row, prof) in enumerate(zip(rows.tolist(), profiles, strict=True)):
        single = pg.cloak(view, row, prof)
        from_batch = batch[i]
        if isinstance(single, Region):
            assert isinstance(from_batch, Region)
            assert (from_batch.bbox, from_batch.k_achieved) == (single.bbox, single.k_achieved)
        else:
            assert isinstance(from_batch, Refusal) and from_batch.reason == single.reason
    assert 0 < int(batch.ok.sum()) < 40
