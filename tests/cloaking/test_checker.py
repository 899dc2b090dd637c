"""The independent region checker (CONCEPTS §9.0, §9.1): every check passes and fails on hand-made cases."""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kcloak.cloaking.checks.regions as regions_module
from kcloak.cloaking.checks import (
    Places,
    Property,
    Published,
    Snapshot,
    Violation,
    apply_override,
    area_m2,
    check_clique_stream,
    check_refusal,
    check_region,
    join_override,
    min_box_area_m2,
    strictly_inside,
    tight_box,
    users_inside,
)
from kcloak.cloaking.checks.regions import inside_mask
from kcloak.cloaking.cloakers.base import CloakResult, Region, refuse
from kcloak.cloaking.cloakers.clique import CliqueRelease, CliqueRequest
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox, bbox_area_m2, bbox_around_keys, coordinate_keys
from kcloak.core.profile import PrivacyProfile, ReasonCode

NOW = 1_000.0
P3 = PrivacyProfile(k=3, min_area_m2=0.0)

# q, a, b inside BOX; c outside; s inside but stale.
IDS = ["q", "a", "b", "c", "s"]
LAT = [39.9001, 39.9002, 39.9004, 39.9010, 39.9002]
LON = [116.3001, 116.3003, 116.3002, 116.3010, 116.3002]
T = [NOW, NOW - 10, NOW - 60, NOW - 30, NOW - 61]
BOX = ("116.3", "39.9", "116.3005", "39.9005")
BOX_AREA = bbox_area_m2(116.3, 39.9, 116.3005, 39.9005)


def snap(
    ids: Sequence[str] = IDS, lat: Sequence[float] = LAT, lon: Sequence[float] = LON, t: Sequence[float] = T
) -> Snapshot:
    return Snapshot.from_arrays(list(ids), lat, lon, t, now=NOW, stale_after_s=60.0)


def props(violations: list[Violation]) -> set[Property]:
    return {v.property for v in violations}


def published(
    bbox: Sequence[float | str] = BOX, k: int = 3, area: float = BOX_AREA, l_ach: int | None = None
) -> Published:
    b = tuple(bbox)
    return Published((b[0], b[1], b[2], b[3]), k, area, l_ach)


def check(pub: Published, querier: str = "q", s: Snapshot | None = None, **kw: Any) -> list[Violation]:
    kw.setdefault("effective", P3)
    return check_region(s if s is not None else snap(), querier, pub, **kw)


# -- 1 querier inside / order / digits ---------------------------------------------------------


def test_passing_region_has_no_violation() -> None:
    s = snap()
    assert s.n_present == 4  # "s" is 61 s old with stale_after_s = 60
    box = (Decimal(BOX[0]), Decimal(BOX[1]), Decimal(BOX[2]), Decimal(BOX[3]))
    assert users_inside(s, box) == ["q", "a", "b"]
    assert check(published()) == []


def test_querier_on_the_edge_is_not_inside() -> None:
    s = snap(lat=[39.9, *LAT[1:]])  # querier exactly on min_lat = 39.9
    out = check(published(k=2), s=s)
    assert Property.QUERIER_INSIDE in props(out)
    assert Property.K in props(out)  # only a, b counted


def test_other_user_on_the_edge_is_not_counted() -> None:
    # 39.90625 is exact in binary, so "a" sits exactly on max_lat.
    box = ("116.3", "39.9", "116.3005", "39.90625")
    pub = published(bbox=box, k=3, area=area_m2(116.3, 39.9, 116.3005, 39.90625))
    s = snap(lat=[39.9001, 39.90625, 39.9004, 39.9010, 39.9002])
    out = check(pub, s=s, effective=PrivacyProfile(k=2, min_area_m2=0.0))
    assert [(v.property, v.expected, v.observed) for v in out] == [(Property.K_ACHIEVED, "2", "3")]
    # The float nearest to 116.3005 lies below the decimal 116.3005, but a client that sent
    # 116.3005 reads the edge 116.3005 as its own position (same float, same text): on the edge.
    assert Decimal(float("116.3005")) < Decimal("116.3005")
    s = snap(lon=[116.3001, 116.3005, 116.3002, 116.3010, 116.3002])
    out = check(published(k=3), s=s)
    assert [(v.property, v.expected, v.observed) for v in out] == [
        (Property.K, ">= 3 present users strictly inside", "2"),
        (Property.K_ACHIEVED, "2", "3"),
    ]
    s = snap(lon=[116.3001, math.nextafter(116.3005, -math.inf), 116.3002, 116.3010, 116.3002])
    assert check(published(k=3), s=s) == []  # one ulp further in is inside both ways


def test_five_decimal_querier_on_the_issue_corner_is_not_inside() -> None:
    """Issue 13: bbox [116.30395, 39.92562, 116.30438, 39.92653] for a querier at (39.92653, 116.30395).

    The old checker compared the edges with the coordinates' exact binary values (39.92653 is
    just below its decimal, 116.30395 just above) and passed it; the corner IS the querier.
    """
    box = ("116.30395", "39.92562", "116.30438", "39.92653")
    s = snap(ids=["q"], lat=[39.92653], lon=[116.30395], t=[NOW])
    one = PrivacyProfile(k=1, min_area_m2=0.0)
    pub = published(bbox=box, k=1, area=area_m2(116.30395, 39.92562, 116.30438, 39.92653))
    assert props(check(pub, s=s, effective=one)) == {Property.QUERIER_INSIDE, Property.K, Property.K_ACHIEVED}
    edges = (Decimal("116.30395"), Decimal("39.92562"), Decimal("116.30438"), Decimal("39.92653"))
    assert not strictly_inside(39.92653, 116.30395, edges)
    assert strictly_inside(39.926529, 116.303951, edges)


def test_seventeen_digit_coordinates_next_to_an_edge() -> None:
    """A coordinate sent with 17 significant digits: inside only if the 6-decimal edge is strictly
    beyond it both as float64 and as exact decimals of the two texts."""
    edges = (Decimal("116.3"), Decimal("39.9"), Decimal("116.300001"), Decimal("39.9005"))
    above_edge = float("116.30000100000001")  # a float of its own, one ulp above the edge's float
    assert above_edge > 116.300001 and repr(above_edge) == "116.30000100000001"
    assert not strictly_inside(39.9001, above_edge, edges)
    below_edge = math.nextafter(116.300001, -math.inf)
    assert repr(below_edge) == "116.30000099999998"
    assert strictly_inside(39.9001, below_edge, edges)
    assert not strictly_inside(39.9001, float("116.3000010000000001"), edges)  # parses to the edge's float


def test_floats_next_to_an_edge_are_decided_exactly() -> None:
    edge = Decimal("116.300001")
    f = float(edge)
    assert Decimal(f) < edge  # the nearest float lies just below the decimal edge
    just_in, on, just_out = math.nextafter(f, -math.inf), f, math.nextafter(f, math.inf)
    assert Decimal(just_out) > edge
    box = (Decimal("116.3"), Decimal("39.9"), edge, Decimal("39.9005"))
    assert strictly_inside(39.9001, just_in, box)
    assert not strictly_inside(39.9001, on, box)  # its text is the edge's: on it, whatever its binary value
    assert not strictly_inside(39.9001, just_out, box)
    pub = published(
        bbox=("116.3", "39.9", "116.300001", "39.9005"), k=1, area=area_m2(116.3, 39.9, 116.300001, 39.9005)
    )
    one = PrivacyProfile(k=1, min_area_m2=0.0)
    assert check(pub, s=snap(ids=["q"], lat=[39.9001], lon=[just_in], t=[NOW]), effective=one) == []
    for lon in (on, just_out):
        out = check(pub, s=snap(ids=["q"], lat=[39.9001], lon=[lon], t=[NOW]), effective=one)
        assert props(out) == {Property.QUERIER_INSIDE, Property.K, Property.K_ACHIEVED}


def test_lower_edge_float_just_below_is_outside() -> None:
    edge = Decimal("39.9005")  # its nearest float lies just above the decimal
    f = float(edge)
    assert Decimal(f) > edge
    box_low = (Decimal("116.3"), edge, Decimal("116.4"), Decimal("39.91"))
    assert not strictly_inside(f, 116.35, box_low)  # the edge's own float: on the edge to a client
    assert strictly_inside(math.nextafter(f, math.inf), 116.35, box_low)
    assert not strictly_inside(math.nextafter(f, -math.inf), 116.35, box_low)


def test_inside_mask_matches_strictly_inside_near_edges() -> None:
    """The vectorized path decides every point near an edge like the scalar one (4-6 decimal grids)."""
    rng = np.random.default_rng(5)
    box = (Decimal("116.30395"), Decimal("39.92562"), Decimal("116.30438"), Decimal("39.92653"))
    grid = np.concatenate([np.arange(-3, 4) * 1e-6, np.arange(-3, 4) * 1e-5, np.arange(-2, 3) * 1e-4])
    lon = np.round(np.concatenate([116.30395 + grid, 116.30438 + grid, rng.uniform(116.3039, 116.3045, 50)]), 6)
    lat = np.round(rng.choice(np.concatenate([39.92562 + grid, 39.92653 + grid, [39.926]]), len(lon)), 6)
    lon = np.concatenate([lon, np.nextafter(lon, np.inf), np.nextafter(lon, -np.inf)])
    lat = np.concatenate([lat, lat, lat])
    mask = inside_mask(lat, lon, box)
    expected = [strictly_inside(float(a), float(o), box) for a, o in zip(lat, lon, strict=True)]
    assert mask.tolist() == expected
    assert 0 < sum(expected) < len(expected)
    for a, o, ok in zip(lat.tolist(), lon.tolist(), expected, strict=True):
        as_float = 116.30395 < o < 116.30438 and 39.92562 < a < 39.92653
        as_text = box[0] < Decimal(repr(o)) < box[2] and box[1] < Decimal(repr(a)) < box[3]
        assert ok == (as_float and as_text)


def test_seven_fractional_digits() -> None:
    out = check(published(bbox=(116.3, 39.9, 116.3005001, 39.9005), area=area_m2(116.3, 39.9, 116.3005001, 39.9005)))
    assert props(out) == {Property.FRACTION_DIGITS}
    out = check(published(bbox=("116.3", "39.9000000", "116.3005", "39.9005")))
    assert props(out) == {Property.FRACTION_DIGITS}
    assert check(published(bbox=(116.3, 39.9, 116.3005, 39.9005))) == []  # repr of floats: <= 6 digits


def test_swapped_order_is_diagnosed() -> None:
    out = check(published(bbox=("39.9", "116.3", "39.9005", "116.3005")))
    assert {Property.QUERIER_INSIDE, Property.GEOJSON_ORDER, Property.GEOMETRY} <= props(out)


def test_world_edge_exception() -> None:
    s = snap(ids=["q", "p", "n"], lat=[10.0, 90.0, -90.0], lon=[180.0, 20.0, -180.0], t=[NOW] * 3)
    one = PrivacyProfile(k=1, max_area_m2=2.5e9, min_area_m2=0.0)
    east = ("179.9", "9.9", "180", "10.1")
    assert check(published(bbox=east, k=1, area=area_m2(179.9, 9.9, 180, 10.1)), s=s, effective=one) == []
    pole = ("19.9", "89.9", "20.1", "90")
    out = check(published(bbox=pole, k=1, area=area_m2(19.9, 89.9, 20.1, 90)), querier="p", s=s, effective=one)
    assert out == []
    corner = ("-180", "-90", "-179.9", "-89.9")
    out = check(published(bbox=corner, k=1, area=area_m2(-180, -90, -179.9, -89.9)), querier="n", s=s, effective=one)
    assert out == []
    # Away from the world edge an edge through the user is not inside.
    s2 = snap(ids=["q"], lat=[10.0], lon=[179.0], t=[NOW])
    out = check(published(bbox=("178.9", "9.9", "179", "10.1"), k=0, area=area_m2(178.9, 9.9, 179, 10.1)), s=s2)
    assert Property.QUERIER_INSIDE in props(out)


# -- 2 k ---------------------------------------------------------------------------------------


def test_undercounted_and_overclaimed_k_achieved() -> None:
    out = check(published(k=2))
    assert [(v.property, v.expected, v.observed) for v in out] == [(Property.K_ACHIEVED, "3", "2")]
    out = check(published(k=4))  # the stale user must not be counted
    assert [(v.property, v.expected, v.observed) for v in out] == [(Property.K_ACHIEVED, "3", "4")]


def test_fewer_than_k() -> None:
    out = check(
        published(), effective=PrivacyProfile(k=4, min_area_m2=0.0), stored={"q": PrivacyProfile(k=4, min_area_m2=0.0)}
    )
    assert props(out) == {Property.K}


def test_duplicate_fixes_count_once_and_latest_wins() -> None:
    ids = [*IDS, "a", "c"]
    lat = [*LAT, 39.9100, 39.9003]
    lon = [*LON, 116.3100, 116.3004]
    t = [*T, NOW - 100, NOW - 1]  # a's older fix is outside; c's newer fix moves c inside
    s = snap(ids=ids, lat=lat, lon=lon, t=t)
    assert s.n_present == 4
    assert check(published(k=4)) != []
    assert check(published(k=4), s=s) == []


def test_absent_querier() -> None:
    out = check(published(), querier="s")  # stale
    assert Property.QUERIER_PRESENT in props(out)
    out = check(published(), querier="nobody")
    assert Property.QUERIER_PRESENT in props(out)


# -- 3 area ------------------------------------------------------------------------------------


def test_area_claim_and_bounds() -> None:
    out = check(published(area=BOX_AREA * (1 + 1e-6)))
    assert [v.property for v in out] == [Property.AREA_M2]
    assert check(published(area=BOX_AREA * (1 + 1e-12))) == []  # within the relative 1e-9
    out = check(published(), effective=PrivacyProfile(k=3, min_area_m2=BOX_AREA * 1.01))
    assert [v.property for v in out] == [Property.AREA_BOUNDS]
    out = check(published(), effective=PrivacyProfile(k=3, max_area_m2=BOX_AREA * 0.99, min_area_m2=0.0))
    assert [v.property for v in out] == [Property.AREA_BOUNDS]
    out = check(published(area=float("nan")))
    assert [v.property for v in out] == [Property.AREA_M2]


def test_area_formula_matches_an_independent_integral() -> None:
    # Spherical band area: R² · Δλ · (sin φ2 − sin φ1); check by midpoint integration of R² cos φ dφ dλ.
    r = regions_module.EARTH_RADIUS_M
    phi = np.linspace(math.radians(10), math.radians(11), 200_001)
    mid = (phi[:-1] + phi[1:]) / 2
    integral = r * r * math.radians(2) * float(np.sum(np.cos(mid) * np.diff(phi)))
    assert area_m2(5, 10, 7, 11) == pytest.approx(integral, rel=1e-9)
    assert area_m2(5, 10, 7, 11) == pytest.approx(bbox_area_m2(5, 10, 7, 11), rel=1e-12)


# -- 4 places ----------------------------------------------------------------------------------

PLACES = Places.from_arrays(
    lat=[39.9001, 39.9002, 39.9003, 39.9004, 39.9005, 39.9020],
    lon=[116.3001, 116.3001, 116.3002, 116.3003, 116.3002, 116.3002],
    category=["cafe", "cafe", "bank", "school", "hospital", "park"],  # hospital on max_lat, park outside
)


def test_place_categories() -> None:
    assert check(published(l_ach=3), places=PLACES, effective=PrivacyProfile(k=3, l=3, min_area_m2=0.0)) == []
    out = check(published(l_ach=3), places=PLACES, effective=PrivacyProfile(k=3, l=4, min_area_m2=0.0))
    assert props(out) == {Property.L}
    out = check(published(l_ach=4), places=PLACES, effective=PrivacyProfile(k=3, l=3, min_area_m2=0.0))
    assert [(v.property, v.expected, v.observed) for v in out] == [(Property.L_ACHIEVED, "3", "4")]
    out = check(published(l_ach=None), places=PLACES, effective=PrivacyProfile(k=3, l=2, min_area_m2=0.0))
    assert props(out) == {Property.L_ACHIEVED}
    out = check(published(), effective=PrivacyProfile(k=3, l=2, min_area_m2=0.0))
    assert props(out) == {Property.L}  # cannot verify l without a places layer


# -- 5 geometry --------------------------------------------------------------------------------


def test_antimeridian_and_world_bounds() -> None:
    s = snap(ids=["q"], lat=[0.5], lon=[179.95], t=[NOW])
    out = check(
        published(bbox=(179.9, 0.0, -179.9, 1.0), k=1, area=1.0), s=s, effective=PrivacyProfile(k=1, min_area_m2=0.0)
    )
    assert Property.GEOMETRY in props(out)
    assert any("antimeridian" in v.expected for v in out)
    out = check(published(bbox=(116.3, 39.9005, 116.3005, 39.9)))
    assert Property.GEOMETRY in props(out)
    out = check(published(bbox=(116.3, 39.9, 180.5, 39.9005), area=area_m2(116.3, 39.9, 180.5, 39.9005)))
    assert Property.GEOMETRY in props(out)
    out = check(published(bbox=(116.3, 39.9, float("inf"), 39.9005)))
    assert props(out) == {Property.GEOMETRY}


# -- effective profile -------------------------------------------------------------------------


def test_effective_profile_recomputed_from_stored_and_override() -> None:
    stored = {"q": PrivacyProfile(k=2, min_area_m2=0.0)}
    assert check(published(), stored=stored, override={"k": 3}, effective=P3) == []
    out = check(published(), stored=stored, override={"k": 3}, effective=PrivacyProfile(k=2, min_area_m2=0.0))
    assert props(out) == {Property.EFFECTIVE_PROFILE}
    out = check(published(), stored={"q": PrivacyProfile(k=4, min_area_m2=0.0)}, override={"k": 3}, effective=P3)
    assert Property.EFFECTIVE_PROFILE in props(out)  # looser override: must have been refused
    assert apply_override(PrivacyProfile(k=4, min_area_m2=0.0), {"k": 3}) is None
    assert apply_override(PrivacyProfile(max_area_m2=1e6), {"max_area_m2": 2e6}) is None
    assert apply_override(PrivacyProfile(min_area_m2=0.0), {"min_area_m2": 5e6}) is None  # E.min > E.max: invalid
    assert apply_override(PrivacyProfile(k=2, min_area_m2=0.0), {"k": 7}) == PrivacyProfile(k=7, min_area_m2=0.0)


def test_join_override_keeps_each_members_stricter_values() -> None:
    assert join_override(PrivacyProfile(k=4, min_area_m2=0.0), {"k": 3}) == PrivacyProfile(k=4, min_area_m2=0.0)
    assert join_override(PrivacyProfile(k=2, min_area_m2=0.0), {"k": 3}) == PrivacyProfile(k=3, min_area_m2=0.0)
    assert join_override(PrivacyProfile(min_area_m2=1e3), {"min_area_m2": 0.0, "max_area_m2": 1e6}) == PrivacyProfile(
        min_area_m2=1e3, max_area_m2=1e6
    )
    assert join_override(PrivacyProfile(min_area_m2=2e6), {"max_area_m2": 1e6}) is None  # member cannot send it
    assert join_override(PrivacyProfile(min_area_m2=0.0), {"unknown": 1}) is None


# -- 6 reciprocity and 7 determinism through fake cloakers ---------------------------------------


def _mbr(view: IndexView, rows: Sequence[int]) -> BBox:
    r = np.asarray(rows, dtype=np.int64)
    lon_k, lat_k = coordinate_keys(view.lon[r]), coordinate_keys(view.lat[r])
    return bbox_around_keys(int(lon_k.min()), int(lat_k.min()), int(lon_k.max()), int(lat_k.max()))


def _region(view: IndexView, rows: Sequence[int], name: str) -> Region:
    b = _mbr(view, rows)
    return Region(bbox=b, k_achieved=view.count_in(b), area_m2=b.area_m2, algorithm=name)


class FixedGroups:
    """A correct reciprocal cloaker: a fixed partition, region = MBR of the querier's group."""

    name: ClassVar[str] = "fixed_groups"
    reciprocal: ClassVar[bool] = True
    supports_l: ClassVar[bool] = False

    def __init__(self, groups: Sequence[Sequence[str]]) -> None:
        self.groups = groups

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        user = view.user_ids[row]
        group = next(g for g in self.groups if user in g)
        if len(group) < profile.k:
            return refuse(ReasonCode.AREA_EXCEEDED)
        return _region(view, [view.row_of[u] for u in group], self.name)


class NearestNeighbours:
    """The §4.1 baseline (ties by user id), wrongly declared reciprocal."""

    name: ClassVar[str] = "fake_nn"
    reciprocal: ClassVar[bool] = True
    supports_l: ClassVar[bool] = False

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        d = np.hypot(view.lon - view.lon[row], view.lat - view.lat[row])
        order = sorted(range(len(view)), key=lambda i: (float(d[i]), view.user_ids[i]))
        return _region(view, order[: profile.k], self.name)


class Flaky:
    """Answers a different box on every call."""

    name: ClassVar[str] = "flaky"
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = False

    def __init__(self) -> None:
        self.calls = 0

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        self.calls += 1
        b = _mbr(view, list(range(len(view))))
        b = BBox(b.min_lon_udeg - self.calls, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg)
        return Region(bbox=b, k_achieved=view.count_in(b), area_m2=b.area_m2, algorithm=self.name)


# The line example of §1.5 (test recip_nn_line), scaled to 1e-3 degrees on the equator.
LINE_IDS = ["u1", "u2", "u3", "u4"]
LINE_LON = [0.0, 0.001, 0.002, 0.010]
LINE_LAT = [0.0, 0.0, 0.0, 0.0]
K2 = PrivacyProfile(k=2, min_area_m2=0.0)


def _line() -> tuple[Snapshot, IndexView]:
    s = Snapshot.from_arrays(LINE_IDS, LINE_LAT, LINE_LON, now=NOW)
    v = IndexView.from_points(LINE_IDS, LINE_LAT, LINE_LON, k=[2] * 4, now=NOW)
    return s, v


def _check_black_box(cloaker: FixedGroups | NearestNeighbours | Flaky, querier: str, **kw: Any) -> list[Violation]:
    s, v = _line()
    eff = kw.pop("effective", K2)
    assert isinstance(eff, PrivacyProfile)
    result = cloaker.cloak(v, v.row_of[querier], eff)
    assert isinstance(result, Region)
    return check_region(
        s,
        querier,
        Published.of(result),
        effective=eff,
        default_profile=K2,
        cloaker=cloaker,
        view=v,
        **kw,
    )


def test_reciprocal_partition_passes() -> None:
    groups = [["u1", "u2"], ["u3", "u4"]]
    for q in LINE_IDS:
        assert _check_black_box(FixedGroups(groups), q) == []


def test_nn_declared_reciprocal_fails_on_the_line_example() -> None:
    nn = NearestNeighbours()
    assert _check_black_box(nn, "u1") == []  # [0,1]: C = {u1, u2}
    assert _check_black_box(nn, "u2") == []
    out = _check_black_box(nn, "u4")  # [2,10] holds u3, u4 but only u4 produces it
    assert props(out) == {Property.RECIPROCITY}
    assert out[0].observed == "|C| = 1"
    out = _check_black_box(nn, "u3")  # [1,2] is produced only by u3
    assert props(out) == {Property.RECIPROCITY}


def test_member_refused_under_its_stored_k_leaves_the_candidate_set() -> None:
    groups = [["u1", "u2"], ["u3", "u4"]]
    s, v = _line()
    result = FixedGroups(groups).cloak(v, 0, K2)
    assert isinstance(result, Region)
    pub = Published.of(result)
    stored = {"u1": K2, "u2": K2, "u3": K2, "u4": K2}
    assert check_region(s, "u1", pub, effective=K2, stored=stored, cloaker=FixedGroups(groups), view=v) == []
    stored["u2"] = PrivacyProfile(k=3, min_area_m2=0.0)  # u2's own request is refused: C = {u1} < 2
    out = check_region(s, "u1", pub, effective=K2, stored=stored, cloaker=FixedGroups(groups), view=v)
    assert [(x.property, x.observed) for x in out] == [(Property.RECIPROCITY, "|C| = 1")]


class SizeIgnoringGroups(FixedGroups):
    """Reciprocal grouping that forgets members' k: answers even when the group is too small."""

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        user = view.user_ids[row]
        group = next(g for g in self.groups if user in g)
        return _region(view, [view.row_of[u] for u in group], self.name)


def test_candidate_set_below_max_k_over_members_fails() -> None:
    s, v = _line()
    cloaker = SizeIgnoringGroups([["u1", "u2"], ["u3", "u4"]])
    result = cloaker.cloak(v, 0, K2)
    assert isinstance(result, Region)
    stored = {"u1": K2, "u2": PrivacyProfile(k=3, min_area_m2=0.0), "u3": K2, "u4": K2}
    out = check_region(s, "u1", Published.of(result), effective=K2, stored=stored, cloaker=cloaker, view=v)
    assert [(v_.property, v_.observed) for v_ in out] == [(Property.RECIPROCITY, "|C| = 2")]


def test_override_is_replayed_for_every_member() -> None:
    groups = [["u1", "u2", "u3"], ["u4"]]
    s = Snapshot.from_arrays(LINE_IDS, LINE_LAT, LINE_LON, now=NOW)
    v = IndexView.from_points(LINE_IDS, LINE_LAT, LINE_LON, now=NOW)
    cloaker = FixedGroups(groups)
    eff = PrivacyProfile(k=3, min_area_m2=0.0)
    result = cloaker.cloak(v, 0, eff)
    assert isinstance(result, Region)
    pub = Published.of(result)
    kw: dict[str, Any] = {"effective": eff, "override": {"k": 3}, "cloaker": cloaker, "view": v}
    assert check_region(s, "u1", pub, stored={u: K2 for u in LINE_IDS}, **kw) == []
    # u3 stores k = 4: with the override it asks for k = 4 and is refused, so C = {u1, u2} < 3.
    stored = {"u1": K2, "u2": K2, "u3": PrivacyProfile(k=4, min_area_m2=0.0), "u4": K2}
    out = check_region(s, "u1", pub, stored=stored, **kw)
    assert props(out) == {Property.RECIPROCITY}
    # u3 stores a larger min_area_m2 than the override's: its own value prevails and it stays in C.
    stored = {"u1": K2, "u2": K2, "u3": PrivacyProfile(k=2, min_area_m2=10.0), "u4": K2}
    kw["override"] = {"k": 3, "min_area_m2": 5.0}
    kw["effective"] = PrivacyProfile(k=3, min_area_m2=5.0)
    assert check_region(s, "u1", pub, stored=stored, **kw) == []


def test_non_deterministic_cloaker_fails() -> None:
    s, v = _line()
    flaky = Flaky()
    result = flaky.cloak(v, 0, K2)
    assert isinstance(result, Region)
    out = check_region(s, "u1", Published.of(result), effective=K2, default_profile=K2, cloaker=flaky, view=v)
    assert props(out) == {Property.DETERMINISM}
    replay = IndexView.from_points(LINE_IDS, LINE_LAT, LINE_LON, k=[2] * 4, now=NOW)
    nn = NearestNeighbours()
    result = nn.cloak(v, 3, K2)
    assert isinstance(result, Region)
    out = check_region(s, "u4", Published.of(result), effective=K2, cloaker=Flaky(), view=v, replay_view=replay)
    assert [v_.property for v_ in out] == [Property.DETERMINISM, Property.DETERMINISM]


class PlainNN(NearestNeighbours):
    reciprocal: ClassVar[bool] = False


def test_view_missing_the_querier_is_reported() -> None:
    s, full = _line()
    result = PlainNN().cloak(full, 3, K2)
    assert isinstance(result, Region)
    partial = IndexView.from_points(LINE_IDS[:3], LINE_LAT[:3], LINE_LON[:3], now=NOW)
    out = check_region(s, "u4", Published.of(result), effective=K2, cloaker=PlainNN(), view=partial)
    assert props(out) == {Property.VIEW}
    assert check_region(s, "u4", Published.of(result), effective=K2, cloaker=PlainNN(), view=full) == []


# -- refusal sanity ----------------------------------------------------------------------------

ALLOWED = {"k_unreachable", "area_exceeded", "unsupported"}


def test_refusal_codes() -> None:
    s = snap()  # 4 present
    ok = check_refusal(
        s, "q", "k_unreachable", effective=PrivacyProfile(k=5, min_area_m2=0.0), allowed=ALLOWED, supports_l=False
    )
    assert ok.violations == []
    bad = check_refusal(
        s, "q", "k_unreachable", effective=PrivacyProfile(k=4, min_area_m2=0.0), allowed=ALLOWED, supports_l=False
    )
    assert props(bad.violations) == {Property.REFUSAL_CODE}
    bad = check_refusal(
        s, "q", "area_exceeded", effective=PrivacyProfile(k=5, min_area_m2=0.0), allowed=ALLOWED, supports_l=False
    )
    assert props(bad.violations) == {Property.REFUSAL_CODE}
    ok = check_refusal(
        s, "q", "unsupported", effective=PrivacyProfile(k=2, l=2, min_area_m2=0.0), allowed=ALLOWED, supports_l=False
    )
    assert ok.violations == []
    bad = check_refusal(
        s, "q", "area_exceeded", effective=PrivacyProfile(k=2, l=2, min_area_m2=0.0), allowed=ALLOWED, supports_l=False
    )
    assert props(bad.violations) == {Property.REFUSAL_CODE}
    bad = check_refusal(
        s, "q", "unsupported", effective=PrivacyProfile(k=2, min_area_m2=0.0), allowed=ALLOWED, supports_l=False
    )
    assert props(bad.violations) == {Property.REFUSAL_CODE}
    bad = check_refusal(
        s, "q", "l_unreachable", effective=PrivacyProfile(k=2, min_area_m2=0.0), allowed=ALLOWED, supports_l=False
    )
    assert props(bad.violations) == {Property.REFUSAL_CODE}


def test_unnecessary_area_refusal_is_flagged() -> None:
    s = snap()
    small = bbox_area_m2(116.3001, 39.9001, 116.3003, 39.9002)  # q and a
    r = check_refusal(
        s,
        "q",
        "area_exceeded",
        effective=PrivacyProfile(k=2, max_area_m2=small * 1.5, min_area_m2=0.0),
        allowed=ALLOWED,
        supports_l=False,
    )
    assert r.violations == [] and r.unnecessary is True
    assert r.min_box_area_m2 == pytest.approx(small, rel=1e-12)
    r = check_refusal(
        s,
        "q",
        "area_exceeded",
        effective=PrivacyProfile(k=2, max_area_m2=small * 0.5, min_area_m2=0.0),
        allowed=ALLOWED,
        supports_l=False,
    )
    assert r.unnecessary is False


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=9, unique=True),
    st.integers(1, 5),
)
def test_min_box_area_equals_exhaustive_search(points: list[tuple[int, int]], k: int) -> None:
    lat = np.array([39.9 + p[1] * 1e-3 for p in points])
    lon = np.array([116.3 + p[0] * 1e-3 for p in points])
    best = math.inf
    n = len(points)
    for a in range(n):
        for b in range(n):
            for c in range(n):
                for d in range(n):
                    lo_lon, hi_lon, lo_lat, hi_lat = lon[a], lon[b], lat[c], lat[d]
                    if lo_lon > lon[0] or hi_lon < lon[0] or lo_lat > lat[0] or hi_lat < lat[0]:
                        continue
                    inside = (lon >= lo_lon) & (lon <= hi_lon) & (lat >= lo_lat) & (lat <= hi_lat)
                    if int(inside.sum()) >= k:
                        best = min(best, area_m2(lo_lon, lo_lat, hi_lon, hi_lat))
    got = min_box_area_m2(lat, lon, 0, k)
    assert got == best if math.isinf(best) or best == 0 else got == pytest.approx(best, rel=1e-9)


# -- exactness of the vectorized containment and independence of the module ----------------------


def _ulps(x: float, n: int) -> float:
    for _ in range(abs(n)):
        x = math.nextafter(x, math.inf if n > 0 else -math.inf)
    return x


BOXES = [
    (Decimal("-73.000001"), Decimal("40.5"), Decimal("-72.999999"), Decimal("40.500002")),
    (Decimal(-180), Decimal(-90), Decimal("-179.999999"), Decimal("-89.999999")),
    (Decimal("179.999999"), Decimal("89.999999"), Decimal(180), Decimal(90)),
]


def _near(data: st.DataObject, edge: Decimal) -> float:
    """A float a few ulps, about one edge band (1e-7°) or far from a decimal edge."""
    base = float(edge)
    how = data.draw(st.sampled_from(["ulps", "band", "far"]))
    if how == "ulps":
        return _ulps(base, data.draw(st.integers(-3, 3)))
    step = data.draw(st.sampled_from([-1.01e-7, -0.99e-7, 0.99e-7, 1.01e-7] if how == "band" else [-1e-3, 1e-3]))
    return base + step


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_inside_mask_equals_the_decimal_loop(data: st.DataObject) -> None:
    # Points a few ulps around the edges (world edges included), around the float/Decimal band, and far.
    box = data.draw(st.sampled_from(BOXES))
    n = data.draw(st.integers(1, 25))
    lon = np.array([_near(data, box[data.draw(st.sampled_from([0, 2]))]) for _ in range(n)])
    lat = np.array([_near(data, box[data.draw(st.sampled_from([1, 3]))]) for _ in range(n)])
    lon = np.clip(lon, -180, 180)
    lat = np.clip(lat, -90, 90)
    mask = inside_mask(lat, lon, box)
    expect = [strictly_inside(float(a), float(o), box) for a, o in zip(lat, lon, strict=True)]
    assert mask.tolist() == expect


def test_checker_imports_only_stdlib_decimal_numpy() -> None:
    tree = ast.parse(Path(regions_module.__file__).read_text(encoding="utf-8"))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None
            roots.add(node.module.split(".")[0])
    assert "kcloak" not in roots and "shapely" not in roots
    import sys

    assert roots - {"numpy"} <= set(sys.stdlib_module_names)


# -- §9.4 CliqueCloak streams --------------------------------------------------------------------


def _req(rid: str, user: str, lat: float, lon: float, **kw: float) -> CliqueRequest:
    args: dict[str, float] = {"t": 0.0, "k": 2, "min_area_m2": 0.0, "max_area_m2": 4.0e6, "max_delay_s": 30.0}
    args.update(kw)
    return CliqueRequest(
        rid, user, lat, lon, args["t"], int(args["k"]), args["min_area_m2"], args["max_area_m2"], args["max_delay_s"]
    )


def _release(
    members: Sequence[CliqueRequest], box: tuple[int, int, int, int], at: float = 1.0, area: float | None = None
) -> CliqueRelease:
    b = BBox(*box)
    return CliqueRelease(tuple(members), b, b.area_m2 if area is None else area, at)


A = _req("a", "u1", 40.0, -74.0)
B = _req("b", "u2", 40.0001, -74.0001)
TIGHT = (-74000101, 39999999, -73999999, 40000101)  # the §2.2 MBR of A and B


def test_clique_stream_passes() -> None:
    assert tight_box([A.lat, B.lat], [A.lon, B.lon]) == tuple(Decimal(v) / 1_000_000 for v in TIGHT)
    assert check_clique_stream([A, B], [_release([A, B], TIGHT)], []) == []
    late = _req("c", "u3", 41.0, -74.0, t=5.0)
    assert check_clique_stream([A, B, late], [_release([A, B], TIGHT)], [(35.0, late)]) == []


def test_clique_stream_failures() -> None:
    def props_of(
        reqs: list[CliqueRequest], rels: list[CliqueRelease], exp: list[tuple[float, CliqueRequest]]
    ) -> set[Property]:
        return props(check_clique_stream(reqs, rels, exp))

    three = _req("a", "u1", 40.0, -74.0, k=3)
    assert props_of([three, B], [_release([three, B], TIGHT)], []) == {Property.K}
    twin = _req("b", "u1", 40.0001, -74.0001)  # the same user twice is one sender
    assert props_of([A, twin], [_release([A, twin], TIGHT)], []) == {Property.K}
    wider = (TIGHT[0] - 1, TIGHT[1], TIGHT[2], TIGHT[3])
    assert props_of([A, B], [_release([A, B], wider)], []) == {Property.GEOMETRY}
    cut = (TIGHT[0], TIGHT[1], -74000000, TIGHT[3])  # A on the east edge
    assert Property.QUERIER_INSIDE in props_of([A, B], [_release([A, B], cut)], [])
    small = _req("a", "u1", 40.0, -74.0, max_area_m2=100.0)  # a 10 m square; B is ~14 m away
    assert Property.CONSTRAINT_BOX in props_of([small, B], [_release([small, B], TIGHT)], [])
    assert props_of([A, B], [_release([A, B], TIGHT, at=31.0)], []) == {Property.DEADLINE}
    assert props_of([A, B], [_release([A, B], TIGHT, area=1.0)], []) == {Property.AREA_M2}
    assert props_of([A, B], [_release([A, B], TIGHT)], [(30.0, A)]) == {Property.OUTCOME}
    assert props_of([A, B], [], [(29.0, A), (30.0, B)]) == {Property.DEADLINE}
    assert props_of([A, B], [], [(30.0, A)]) == {Property.OUTCOME}


def test_clique_stream_area_floor() -> None:
    grown_a = _req("a", "u1", 40.0, -74.0, min_area_m2=1.0e6)
    grown = (-74006600, 39995500, -73993500, 40004600)  # contains the MBR, area ≈ 1.1e6 m²
    assert BBox(*grown).area_m2 >= 1.0e6
    assert check_clique_stream([grown_a, B], [_release([grown_a, B], grown)], []) == []
    assert props(check_clique_stream([grown_a, B], [_release([grown_a, B], TIGHT)], [])) == {Property.AREA_BOUNDS}
    capped = _req("b", "u2", 40.0001, -74.0001, max_area_m2=1.0e5)
    out = check_clique_stream([grown_a, capped], [_release([grown_a, capped], grown)], [])
    assert Property.AREA_BOUNDS in props(out)
