"""The cloaking core on its own: exact keys, bbox publication, the metric frame, profiles, the index."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cloaking.index import PositionIndex
from kcloak.core.geometry import (
    EARTH_RADIUS_M,
    Aeqd,
    BBox,
    bbox_area_m2,
    bbox_around_keys,
    coordinate_keys,
    expand_to_area,
    haversine_m,
    haversine_m_array,
)
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ProfileError, ReasonCode

coords = st.one_of(
    st.floats(-180, 180, allow_nan=False),
    st.integers(-180_000_000, 180_000_000).map(lambda m: m / 1e6),
    st.integers(-18_000_000, 18_000_000).map(lambda m: m / 1e5),
    st.integers(-1_800_000, 1_800_000).map(lambda m: m / 1e4),
    # one ulp either side of a micro-degree's float, and 17-digit texts next to it
    st.integers(-180_000_000, 180_000_000).map(lambda m: math.nextafter(m / 1e6, math.inf)),
    st.integers(-180_000_000, 180_000_000).map(lambda m: math.nextafter(m / 1e6, -math.inf)),
    st.tuples(st.integers(-179_999_999, 179_999_999), st.integers(-99, 99)).map(
        lambda t: float(f"{t[0] / 1e6:.6f}{abs(t[1]):02d}0000000")
    ),
)


def _cmp(a: float | Decimal, b: float | Decimal) -> int:
    return int(a > b) - int(a < b)


@settings(max_examples=400)
@given(st.lists(coords, min_size=1, max_size=20))
def test_keys_compare_like_the_client_reads_edges_and_positions(values: list[float]) -> None:
    """A micro-degree edge ``m`` (key ``2m``) compares with a coordinate's key exactly as a client
    compares the edge's JSON text with the coordinate's: as float64 and as exact decimals of the text.

    The old keys used the coordinate's exact binary value: ``39.92653`` (binary value just below)
    got key ``2·39926529 + 1``, so the edge ``39.92653`` counted as strictly above it.
    """
    keys = coordinate_keys(np.array(values))
    for v, k in zip(values, keys.tolist(), strict=True):
        text = Decimal(repr(v))
        base = math.floor(Fraction(v) * 10**6)
        for m in range(base - 2, base + 3):
            edge = m / 1e6
            edge_text = Decimal(repr(edge))
            assert edge_text == Decimal(m).scaleb(-6)  # the published text is the micro-degree itself
            assert _cmp(2 * m, k) == _cmp(edge, v) == _cmp(edge_text, text), (v, m)
            # strictly beyond as float implies strictly beyond the exact binary value too
            if edge > v:
                assert Fraction(edge_text) > Fraction(v)
            if edge < v:
                assert Fraction(edge_text) < Fraction(v)


def test_key_of_a_five_decimal_coordinate_is_on_its_micro_degree() -> None:
    """T-Drive's 39.92653 is below 39926530 µdeg in binary (116.30395 just above), yet each *is* that
    micro-degree to a client: the issue's bbox had its corner on such a querier."""
    assert Fraction(39.92653) < Fraction(3992653, 10**5) and Fraction(116.30395) > Fraction(11630395, 10**5)
    assert coordinate_keys(np.array([116.30395, 39.92653, 39.908692, 116.397477])).tolist() == [
        2 * 116_303_950,
        2 * 39_926_530,
        2 * 39_908_692,
        2 * 116_397_477,
    ]


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(coords.filter(lambda v: abs(v) < 89.9), coords.filter(lambda v: abs(v) < 179.9)),
        min_size=1,
        max_size=10,
    )
)
def test_bbox_around_keys_contains_every_point_strictly(points: list[tuple[float, float]]) -> None:
    lat = np.array([p[0] for p in points])
    lon = np.array([p[1] for p in points])
    lk, ak = coordinate_keys(lon), coordinate_keys(lat)
    box = bbox_around_keys(int(lk.min()), int(ak.min()), int(lk.max()), int(ak.max()))
    edges = json.loads(json.dumps(box.to_geojson()))
    lo_lon, lo_lat, hi_lon, hi_lat = (Decimal(repr(v)) for v in edges)
    for la, lo in points:
        assert lo_lon < Decimal(repr(lo)) < hi_lon and lo_lat < Decimal(repr(la)) < hi_lat
        assert lo_lon < Decimal(lo) < hi_lon and lo_lat < Decimal(la) < hi_lat
        assert edges[0] < lo < edges[2] and edges[1] < la < edges[3]
    assert all(len(repr(v).split(".")[-1]) <= 6 for v in box.to_geojson())
    assert box.contains_keys(lk, ak).all()


def test_world_edge_counts_but_elsewhere_strict() -> None:
    edge = BBox(179_000_000, 89_000_000, 180_000_000, 90_000_000)
    keys = coordinate_keys(np.array([180.0, 90.0, 179.0, 89.0]))
    assert edge.contains_key(int(keys[0]), int(keys[1]))  # the corner of the world counts
    assert not edge.contains_key(int(keys[2]), int(keys[3]))  # an inner corner never does


def test_bbox_validation_and_area() -> None:
    with pytest.raises(ValueError):
        BBox(10, 0, 5, 1)
    with pytest.raises(ValueError):
        BBox(0, -91_000_000, 1, 0)
    b = BBox(116_000_000, 39_000_000, 116_010_000, 39_010_000)
    expected = EARTH_RADIUS_M**2 * math.radians(0.01) * (math.sin(math.radians(39.01)) - math.sin(math.radians(39.0)))
    assert b.area_m2 == pytest.approx(expected, rel=1e-12)
    assert bbox_area_m2(*b.to_geojson()) == b.area_m2


@pytest.mark.parametrize("a_min", [1.0, 1e4, 1e6, 2.5e9])
def test_expand_to_area_grows_about_the_box_and_keeps_it(a_min: float) -> None:
    small = BBox(116_400_000, 39_900_000, 116_400_010, 39_900_005)
    grown = expand_to_area(small, a_min)
    assert grown is not None and grown.area_m2 >= a_min
    assert grown.min_lon_udeg <= small.min_lon_udeg and grown.max_lat_udeg >= small.max_lat_udeg
    assert grown.area_m2 < 1.1 * a_min + small.area_m2 + 1.0
    near_pole = BBox(0, 89_999_000, 10, 90_000_000)
    moved = expand_to_area(near_pole, 1e8)
    assert moved is not None and moved.max_lat_udeg <= 90_000_000 and moved.area_m2 >= 1e8


@settings(max_examples=200)
@given(
    st.floats(-80, 80),
    st.floats(-179, 179),
    st.floats(0, 2 * math.pi),
    st.floats(1.0, 50_000.0),
    st.floats(0, 2 * math.pi),
    st.floats(1.0, 50_000.0),
)
def test_aeqd_distances_within_0_1_percent_within_50_km(
    lat0: float, lon0: float, b1: float, d1: float, b2: float, d2: float
) -> None:
    frame = Aeqd(lat0, lon0)
    x = np.array([d1 * math.sin(b1), d2 * math.sin(b2)])
    y = np.array([d1 * math.cos(b1), d2 * math.cos(b2)])
    lat, lon = frame.inverse(x, y)
    # radial distances are exact, and the round trip returns the same plane points
    assert haversine_m(lat0, lon0, float(lat[0]), float(lon[0])) == pytest.approx(d1, rel=1e-9, abs=1e-6)
    fx, fy = frame.forward(lat, lon)
    assert np.allclose(fx, x, atol=1e-5) and np.allclose(fy, y, atol=1e-5)
    true = haversine_m(float(lat[0]), float(lon[0]), float(lat[1]), float(lon[1]))
    plane = math.hypot(x[0] - x[1], y[0] - y[1])
    if true <= 50_000:
        assert plane == pytest.approx(true, rel=1e-3, abs=1e-6)


def test_haversine_vectorized_matches_scalar() -> None:
    lat = np.array([39.9, -33.9, 0.0])
    lon = np.array([116.4, 151.2, 179.9])
    arr = haversine_m_array(lat, lon, 40.0, 116.5)
    assert arr.tolist() == [haversine_m(a, b, 40.0, 116.5) for a, b in zip(lat, lon, strict=True)]


# -- profiles (§3) ---------------------------------------------------------------------------


def test_only_stricter_rule_worked_example() -> None:
    stored = PrivacyProfile(k=10)
    with pytest.raises(ProfileError) as err:
        stored.tightened({"k": 3})
    assert err.value.code is ReasonCode.LOOSER_THAN_PROFILE and err.value.field == "k"
    assert stored.tightened({"k": 10}) == stored
    e = stored.tightened({"k": 12, "max_area_m2": 1e6, "max_delay_s": 5})
    assert (e.k, e.max_area_m2, e.max_delay_s, e.l) == (12, 1e6, 5, 1)


@pytest.mark.parametrize(
    ("override", "code"),
    [
        ({"k": 0}, ReasonCode.INVALID),
        ({"k": 5.0}, ReasonCode.INVALID),
        ({"k": True}, ReasonCode.INVALID),
        ({"l": 51}, ReasonCode.INVALID),
        ({"max_area_m2": 0}, ReasonCode.INVALID),
        ({"max_area_m2": float("inf")}, ReasonCode.INVALID),
        ({"max_delay_s": 601}, ReasonCode.INVALID),
        ({"colour": 1}, ReasonCode.INVALID),
        ({"min_area_m2": 5e6}, ReasonCode.INVALID),  # E.min > E.max
        ({"max_area_m2": 5e6}, ReasonCode.LOOSER_THAN_PROFILE),
        ({"max_delay_s": 31}, ReasonCode.LOOSER_THAN_PROFILE),
        ({"l": 1}, None),
    ],
)
def test_override_codes(override: dict[str, object], code: ReasonCode | None) -> None:
    stored = PrivacyProfile()
    if code is None:
        assert stored.tightened(override) == stored
        return
    with pytest.raises(ProfileError) as err:
        stored.tightened(override)
    assert err.value.code is code


def test_profile_from_mapping_uses_defaults_and_arrays() -> None:
    p = PrivacyProfile.from_mapping({"k": 7})
    assert p == PrivacyProfile(k=7)
    arr = ProfileArrays.from_profiles([p, PrivacyProfile()])
    assert arr.k.tolist() == [7, 5] and arr[0] == p


# -- the index (§2.3, §2.4) ------------------------------------------------------------------------


def test_index_update_remove_staleness_and_snapshot() -> None:
    idx = PositionIndex(stale_after_s=60, capacity=16)
    for i in range(40):  # grows past its capacity
        idx.update(f"u{i}", 39.9 + i * 1e-4, 116.4, 1000.0 + i)
    idx.update("u0", 40.0, 117.0, 1100.0)
    idx.remove("u1")
    idx.remove("nobody")
    idx.set_profile("u2", PrivacyProfile(k=9, min_area_m2=5.0, max_area_m2=1e6))
    assert len(idx) == 39 and "u1" not in idx and idx.fix("u0") == (40.0, 117.0, 1100.0)
    view = idx.snapshot(1080.0)  # present: t ≥ 1020
    assert sorted(view.user_ids) == sorted(["u0"] + [f"u{i}" for i in range(20, 40)])
    assert idx.is_present("u0", 1080.0) and not idx.is_present("u3", 1080.0)
    row = idx.snapshot(1010.0).row("u2")
    assert row is not None
    v2 = idx.snapshot(1010.0)
    assert (int(v2.k[row]), float(v2.min_area_m2[row]), float(v2.max_area_m2[row])) == (9, 5.0, 1e6)
    idx.update("u1", 1.0, 2.0, 1200.0)  # a removed user comes back in a recycled row
    assert idx.fix("u1") == (1.0, 2.0, 1200.0)
    with pytest.raises(ValueError):
        view.lat[0] = 0.0  # views are immutable


def test_batch_update_last_item_wins_and_matches_single() -> None:
    a, b = PositionIndex(), PositionIndex()
    users = ["x", "y", "x", "z"]
    lat, lon, t = [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [10.0, 11.0, 12.0, 13.0]
    a.update_batch(users, lat, lon, t)
    for u, la, lo, tt in zip(users, lat, lon, t, strict=True):
        b.update(u, la, lo, tt)
    for u in ("x", "y", "z"):
        assert a.fix(u) == b.fix(u)
    assert a.fix("x") == (3.0, 7.0, 12.0)


def test_default_min_area_is_ten_thousand_square_metres_and_overrides_only_raise_it() -> None:
    """The shipped default floor (an extension of the contract, whose table says 0): a region around
    co-located users would otherwise pinpoint them. Lowering it per query is looser_than_profile."""
    default = PrivacyProfile()
    assert default.min_area_m2 == 10_000.0
    assert PrivacyProfile.from_mapping({"k": 7}).min_area_m2 == 10_000.0
    with pytest.raises(ProfileError) as err:
        default.tightened({"min_area_m2": 9_999.0})
    assert err.value.code is ReasonCode.LOOSER_THAN_PROFILE
    assert default.tightened({"min_area_m2": 10_000.0}).min_area_m2 == 10_000.0
    assert PrivacyProfile(min_area_m2=0.0).tightened({"min_area_m2": 5.0}).min_area_m2 == 5.0  # a stored 0 is kept
