"""Interval cloaking (CONCEPTS §4.2): worked examples, the fast level search against the literal
descent, exact ``k_achieved`` on cell edges, batch against scalar, refusals."""

from __future__ import annotations

import bisect
import math
from typing import Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import Cloaker, Refusal, Region, get_cloaker
from kcloak.cloaking.cloakers.interval import (
    IntervalCloak,
    QuadtreeCounts,
    Root,
    cell_area_m2,
    cell_bbox,
    deepest_level,
    grid_coord,
    group_id,
    reciprocal_partition,
    run_end,
    run_start,
)
from kcloak.cloaking.grid import GRID_BITS, cell_udeg, grid_coords
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox, bbox_area_m2, coordinate_key
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

# -- the planar test frame of §4.0: [0, 400)² metres onto one grid cell at the equator ----------
#
# The level-16 cell with lower-left corner (0°, 0°) is 8192 µdeg wide, so 1 m of the frame is
# 20.48 µdeg and the frame's 200 m and 100 m quadrants are exactly the level-17 and level-18 cells.

PLANAR_ROOT: Root = (16, 1 << 15, 1 << 15)
UDEG_PER_M = 8192 / 400


def planar_view(points: dict[str, tuple[float, float]]) -> IndexView:
    """A view whose users sit at planar frame positions ``(x, y)`` in metres."""
    ids = list(points)
    lon = [points[u][0] * UDEG_PER_M / 1e6 for u in ids]
    lat = [points[u][1] * UDEG_PER_M / 1e6 for u in ids]
    return IndexView.from_points(ids, lat, lon)


def planar_box(x0: float, y0: float, x1: float, y1: float) -> BBox:
    """Published bbox of the frame rectangle ``[x0, x1) × [y0, y1)`` (metres; edges on cells)."""
    lon0, lat0, lon1, lat1 = (round(v * UDEG_PER_M) for v in (x0, y0, x1, y1))
    return BBox(lon0 - 1, lat0 - 1, lon1, lat1)


GG_USERS = {
    "u1": (50.0, 50.0),
    "u2": (150.0, 60.0),
    "u3": (120.0, 160.0),
    "u4": (260.0, 40.0),
    "u5": (350.0, 350.0),
    "u6": (330.0, 380.0),
    "u7": (60.0, 250.0),
}


def test_planar_frame_lines_up_with_cells() -> None:
    view = planar_view(GG_USERS)
    assert planar_box(0, 0, 400, 400) == view.cell_rect_bbox(*PLANAR_ROOT, PLANAR_ROOT[1], PLANAR_ROOT[2])
    assert planar_box(0, 0, 100, 100) == view.cell_rect_bbox(18, 1 << 17, 1 << 17, 1 << 17, 1 << 17)


@pytest.mark.parametrize(
    ("k", "expected", "k_achieved"),
    [
        (2, (0, 0, 200, 200), 3),
        (3, (0, 0, 200, 200), 3),
        (4, (0, 0, 400, 400), 7),
        (8, ReasonCode.K_UNREACHABLE, 0),
    ],
)
def test_gg_interval(k: int, expected: tuple[int, int, int, int] | ReasonCode, k_achieved: int) -> None:
    """§4.2 worked example: querier u1, root [0,400)², depth_max 2."""
    view = planar_view(GG_USERS)
    result = IntervalCloak(root=PLANAR_ROOT, depth_max=2).cloak(
        view, view.row_of["u1"], PrivacyProfile(k=k, min_area_m2=0.0)
    )
    if isinstance(expected, ReasonCode):
        assert isinstance(result, Refusal)
        assert result.reason == expected
        return
    assert isinstance(result, Region)
    assert result.bbox == planar_box(*expected)
    assert result.k_achieved == k_achieved == view.count_in(result.bbox)
    assert result.algorithm == "interval"


def test_recip_quadtree() -> None:
    """§4.2 non-reciprocity: regions and candidate sets C(R) = {v : region(v) == R}."""
    users = {"u1": (50.0, 50.0), "u8": (60.0, 70.0), "u2": (150.0, 60.0), "u3": (320.0, 320.0)}
    view = planar_view(users)
    cloak = IntervalCloak(root=PLANAR_ROOT, depth_max=2)
    regions: dict[str, BBox] = {}
    for u in users:
        result = cloak.cloak(view, view.row_of[u], PrivacyProfile(k=2, min_area_m2=0.0))
        assert isinstance(result, Region)
        regions[u] = result.bbox
    small, quadrant, root = planar_box(0, 0, 100, 100), planar_box(0, 0, 200, 200), planar_box(0, 0, 400, 400)
    assert regions == {"u1": small, "u8": small, "u2": quadrant, "u3": root}

    def candidates(region: BBox) -> set[str]:
        return {v for v in users if regions[v] == region}

    assert candidates(small) == {"u1", "u8"}
    assert view.count_in(quadrant) == 3
    assert candidates(quadrant) == {"u2"}  # three users inside, yet only u2 produces it
    assert view.count_in(root) == 4
    assert candidates(root) == {"u3"}


def test_min_area_stop_rule_and_max_area() -> None:
    view = planar_view(GG_USERS)
    cloak = IntervalCloak(root=PLANAR_ROOT, depth_max=2)
    row = view.row_of["u1"]
    level1 = cell_area_m2(17, 1 << 16, 1 << 16)
    # A_min above the level-1 quadrant's area stops the descent at the root.
    result = cloak.cloak(view, row, PrivacyProfile(k=2, min_area_m2=level1 * 1.01))
    assert isinstance(result, Region)
    assert result.bbox == planar_box(0, 0, 400, 400)
    assert result.area_m2 >= level1 * 1.01
    # A_min equal to the quadrant's own area lets it stand (inclusive bound).
    result = cloak.cloak(view, row, PrivacyProfile(k=2, min_area_m2=level1))
    assert isinstance(result, Region)
    assert result.bbox == planar_box(0, 0, 200, 200)
    # max_area_m2 is judged on the final published bbox, which is slightly larger than the cell.
    published = planar_box(0, 0, 200, 200).area_m2
    assert published > level1
    ok = cloak.cloak(view, row, PrivacyProfile(k=2, max_area_m2=published, min_area_m2=0.0))
    assert isinstance(ok, Region)
    assert ok.area_m2 == published
    refused = cloak.cloak(view, row, PrivacyProfile(k=2, max_area_m2=(published + level1) / 2, min_area_m2=0.0))
    assert isinstance(refused, Refusal)
    assert refused.reason == ReasonCode.AREA_EXCEEDED


def test_refusals() -> None:
    view = planar_view(GG_USERS)
    row = view.row_of["u1"]
    assert IntervalCloak().cloak(view, row, PrivacyProfile(k=2, l=2, min_area_m2=0.0)) == Refusal(
        ReasonCode.UNSUPPORTED, "l > 1 is not supported by this algorithm (no place diversity)"
    )
    result = IntervalCloak().cloak(view, row, PrivacyProfile(k=8, min_area_m2=0.0))
    assert isinstance(result, Refusal)
    assert result.reason == ReasonCode.K_UNREACHABLE
    # Enough users exist, but the custom root holds fewer than k: area_exceeded, not k_unreachable.
    outside = IndexView.from_points(
        [*GG_USERS, "far1", "far2"],
        [p[1] * UDEG_PER_M / 1e6 for p in GG_USERS.values()] + [10.0, 10.0],
        [p[0] * UDEG_PER_M / 1e6 for p in GG_USERS.values()] + [10.0, 10.0],
    )
    result = IntervalCloak(root=PLANAR_ROOT).cloak(outside, outside.row_of["u1"], PrivacyProfile(k=8, min_area_m2=0.0))
    assert isinstance(result, Refusal)
    assert result.reason == ReasonCode.AREA_EXCEEDED
    # A querier outside the root cell is refused too.
    result = IntervalCloak(root=PLANAR_ROOT).cloak(
        outside, outside.row_of["far1"], PrivacyProfile(k=2, min_area_m2=0.0)
    )
    assert isinstance(result, Refusal)
    assert result.reason == ReasonCode.AREA_EXCEEDED


def test_root_below_min_area_grows_to_it() -> None:
    """Only the root can be smaller than A_min (the descent stops above such cells); it grows (§2.5)."""
    view = planar_view(GG_USERS)
    root_area = cell_area_m2(*PLANAR_ROOT)
    result = IntervalCloak(root=PLANAR_ROOT).cloak(
        view, view.row_of["u1"], PrivacyProfile(k=2, min_area_m2=2 * root_area)
    )
    assert isinstance(result, Region)
    assert result.area_m2 >= 2 * root_area
    assert result.k_achieved == view.count_in(result.bbox) >= 2
    batch = IntervalCloak(root=PLANAR_ROOT).cloak_batch(
        view, np.array([view.row_of["u1"]]), ProfileArrays.uniform(PrivacyProfile(k=2, min_area_m2=2 * root_area), 1)
    )
    got = batch[0]
    assert isinstance(got, Region)
    assert (got.bbox, got.k_achieved, got.area_m2) == (result.bbox, result.k_achieved, result.area_m2)


def test_registry_and_protocol() -> None:
    cloak = get_cloaker("interval", depth_max=12)
    assert isinstance(cloak, IntervalCloak)
    assert isinstance(cloak, Cloaker)
    assert (cloak.name, cloak.reciprocal, cloak.supports_l) == ("interval", False, False)
    with pytest.raises(ValueError, match="root"):
        IntervalCloak(root=(30, 0, 0))
    with pytest.raises(ValueError, match="root"):
        IntervalCloak(root=(2, 4, 0))
    with pytest.raises(ValueError, match="depth_max"):
        IntervalCloak(depth_max=-1)


# -- property tests: users on cell edges, one micro-degree below them, and in between ------------

ANCHORS = ((0, 0), (1_000_000, 1_000_000), (-180_000_000, -90_000_000), (180_000_000, 90_000_000))
"""µdeg anchors that are exact floats: 0° is a cell edge at every level, 1° at levels ≥ 23, ±180/±90 the world edge."""


def coordinate(udeg: int, nudge: str, bound: int) -> float:
    """A float at (or one ulp beside, or half a micro-degree above) ``udeg``, clamped to the world."""
    udeg = max(-bound, min(bound, udeg))
    v = udeg / 1e6
    if nudge == "up":
        v = math.nextafter(v, math.inf)
    elif nudge == "down":
        v = math.nextafter(v, -math.inf)
    elif nudge == "half":
        v = (udeg + 0.5) / 1e6
    return max(-bound / 1e6, min(bound / 1e6, v))


@st.composite
def clustered_views(draw: st.DrawFn, max_users: int = 24) -> IndexView:
    n = draw(st.integers(1, max_users))
    ax, ay = draw(st.sampled_from(ANCHORS))
    spread = draw(st.sampled_from([1, 3, 40, 3000]))
    nudge = st.sampled_from(["near", "up", "down", "half"])
    offsets = st.tuples(st.integers(-spread, spread), nudge, st.integers(-spread, spread), nudge)
    pts = draw(st.lists(offsets, min_size=n, max_size=n))
    lon = [coordinate(ax + ox, nx, 180_000_000) for ox, nx, _, _ in pts]
    lat = [coordinate(ay + oy, ny, 90_000_000) for _, _, oy, ny in pts]
    ks = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    return IndexView.from_points([f"u{i}" for i in range(n)], lat, lon, k=ks)


def literal_area(level: int, cx: int, cy: int) -> float:
    """Contract area of a cell clipped to the world, written independently of the module."""
    lon0, lat0, lon1, lat1 = cell_udeg(level, cx, cy)
    lon0, lon1 = max(lon0, -180_000_000), min(lon1, 180_000_000)
    lat0, lat1 = max(lat0, -90_000_000), min(lat1, 90_000_000)
    if lon1 <= lon0 or lat1 <= lat0:
        return 0.0
    return bbox_area_m2(lon0 / 1e6, lat0 / 1e6, lon1 / 1e6, lat1 / 1e6)


def literal_descent(view: IndexView, row: int, k: int, a_min: float, root: Root, depth_max: int) -> int | None:
    """The §4.2 pseudocode, one level at a time with ``view.count_cell``: the final level, or None."""
    level, cx, cy = root
    if view.count_cell(level, cx, cy) < k:
        return None
    gx, gy = int(view.gx[row]), int(view.gy[row])
    for _ in range(depth_max):
        child = level + 1
        s = GRID_BITS - child
        if view.count_cell(child, gx >> s, gy >> s) < k or literal_area(child, gx >> s, gy >> s) < a_min:
            break
        level = child
    return level


A_MINS = st.sampled_from([0.0, 0.0, 0.005, 0.05, 1.0, 20.0, 500.0, 5e4])
PROFILES = st.builds(
    lambda k, a, big: PrivacyProfile(k=k, min_area_m2=a, max_area_m2=2.5e9 if big else max(a, 1e3)),
    st.integers(1, 8),
    A_MINS,
    st.booleans(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=clustered_views(), profile=PROFILES, depth=st.sampled_from([None, 3, 27]))
def test_fast_level_search_equals_literal_descent(view: IndexView, profile: PrivacyProfile, depth: int | None) -> None:
    depth_max = 29 if depth is None else depth
    cloak = IntervalCloak(depth_max=depth)
    qt = QuadtreeCounts.of(view)
    for row in range(len(view)):
        level = literal_descent(view, row, profile.k, profile.min_area_m2, (0, 0, 0), depth_max)
        result = cloak.cloak(view, row, profile)
        if level is None:
            assert isinstance(result, Refusal)
            assert result.reason == ReasonCode.K_UNREACHABLE
            continue
        gx, gy = qt.grid(row)
        code, p = qt.locate(gx, gy)
        fast = deepest_level(qt, p, code, gx, gy, profile.k, profile.min_area_m2, 0, depth_max)
        assert fast == level
        s = GRID_BITS - level
        gx, gy = int(view.gx[row]), int(view.gy[row])
        bbox = view.cell_rect_bbox(level, gx >> s, gy >> s, gx >> s, gy >> s)
        assert cell_bbox(level, gx >> s, gy >> s, gx >> s, gy >> s) == bbox
        if bbox.area_m2 > profile.max_area_m2:
            assert isinstance(result, Refusal)
            assert result.reason == ReasonCode.AREA_EXCEEDED
            continue
        if view.count_in(bbox) < profile.k:  # only where the world edge makes strictness impossible
            assert isinstance(result, Refusal)
            continue
        assert isinstance(result, Region)
        assert result.bbox == bbox
        assert result.area_m2 == bbox.area_m2
        assert result.k_achieved == view.count_in(bbox) >= profile.k
        assert sorted(result.anon_set.tolist()) == [
            r for r in range(len(view)) if (int(view.gx[r]) >> s, int(view.gy[r]) >> s) == (gx >> s, gy >> s)
        ]


@settings(max_examples=150, deadline=None)
@given(view=clustered_views(), data=st.data())
def test_cell_counts_and_edge_extras_are_exact(view: IndexView, data: st.DataObject) -> None:
    """Cell count + edge strips == ``count_in`` of the published bbox, for cells and pairs near the users."""
    qt = QuadtreeCounts.of(view)
    row = data.draw(st.integers(0, len(view) - 1))
    level = data.draw(st.integers(1, 29))
    s = GRID_BITS - level
    cx, cy = int(view.gx[row]) >> s, int(view.gy[row]) >> s
    dx, dy = data.draw(st.integers(-1, 1)), data.draw(st.integers(-1, 1))
    wide, tall = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    cx0 = max(0, min((1 << level) - 1 - wide, cx + dx))
    cy0 = max(0, min((1 << level) - 1 - tall, cy + dy))
    cx1, cy1 = cx0 + wide, cy0 + tall
    lon0, lat0, _, _ = cell_udeg(level, cx0, cy0)
    _, _, lon1, lat1 = cell_udeg(level, cx1, cy1)
    assume(lon0 < 180_000_000 and lat0 < 90_000_000)  # a rectangle off the world holds nobody
    bbox = view.cell_rect_bbox(level, cx0, cy0, cx1, cy1)
    assert cell_bbox(level, cx0, cy0, cx1, cy1) == bbox
    in_cells = sum(qt.count(level, x, y) for x in range(cx0, cx1 + 1) for y in range(cy0, cy1 + 1))
    assert in_cells == sum(view.count_cell(level, x, y) for x in range(cx0, cx1 + 1) for y in range(cy0, cy1 + 1))
    at_world_edge = lon0 - 1 <= -180_000_000 or lat0 - 1 <= -90_000_000 or lon1 >= 180_000_000 or lat1 >= 90_000_000
    if not at_world_edge:
        extra = qt.edge_extra(lon0, lat0, lon1, lat1)
        assert extra == view.edge_extras(bbox, lon0, lat0)
        assert in_cells + extra == view.count_in(bbox)
        rect = np.array([[lon0, lat0, lon1, lat1]], np.int64)
        assert int(qt.edge_extras(rect)[0]) == extra


def test_edge_users_exactly() -> None:
    """Users on a cell's lower edge count, on its upper edge do not; between lower edges they are extras."""
    level = 25  # 16 µdeg cells; the cell [0, 16)² µdeg has its lower-left corner at (0°, 0°)
    c = 1 << (level - 1)
    pts = {
        "corner": (0.0, 0.0),  # on both lower edges: in the cell, strictly inside the bbox
        "upper": (16e-6 + 0.0, 5e-6),  # nearest float to the upper edge: whichever side it falls
        "below": (math.nextafter(-1e-6, math.inf), 5e-6),  # just above lon0 − 1 µdeg: an edge extra
        "at_pub_edge": (-1e-6, 5e-6),  # the float nearest −1 µdeg
        "left_cell": (-2e-6, 5e-6),
    }
    view = IndexView.from_points(list(pts), [p[1] for p in pts.values()], [p[0] for p in pts.values()])
    qt = QuadtreeCounts.of(view)
    bbox = view.cell_rect_bbox(level, c, c, c, c)
    lon0, lat0, lon1, lat1 = cell_udeg(level, c, c)
    strictly_inside = {
        u for u, (lon, lat) in pts.items() if bbox.contains_key(coordinate_key(lon), coordinate_key(lat))
    }
    assert "corner" in strictly_inside and "below" in strictly_inside and "left_cell" not in strictly_inside
    assert qt.count(level, c, c) + qt.edge_extra(lon0, lat0, lon1, lat1) == len(strictly_inside) == view.count_in(bbox)


@settings(max_examples=100, deadline=None)
@given(view=clustered_views(), data=st.data())
def test_batch_equals_scalar(view: IndexView, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, 12))
    rows = np.array(data.draw(st.lists(st.integers(0, len(view) - 1), min_size=m, max_size=m)), np.int64)
    profiles = data.draw(st.lists(PROFILES, min_size=m, max_size=m))
    profiles = [
        p if not data.draw(st.booleans()) or i else PrivacyProfile(k=2, l=3, min_area_m2=0.0)
        for i, p in enumerate(profiles)
    ]
    depth = data.draw(st.sampled_from([None, 4]))
    cloak = IntervalCloak(depth_max=depth)
    batch = cloak.cloak_batch(view, rows, ProfileArrays.from_profiles(profiles))
    for i, (row, profile) in enumerate(zip(rows.tolist(), profiles, strict=True)):
        one = cloak.cloak(view, row, profile)
        got = batch[i]
        if isinstance(one, Refusal):
            assert isinstance(got, Refusal)
            assert got.reason == one.reason
            continue
        assert isinstance(got, Region)
        assert (got.bbox, got.k_achieved) == (one.bbox, one.k_achieved)
        assert got.area_m2 == pytest.approx(one.area_m2, rel=1e-12)
        assert batch.group[i] > 0


def test_group_ids_and_determinism() -> None:
    view = planar_view(GG_USERS)
    cloak = IntervalCloak(root=PLANAR_ROOT, depth_max=2)
    rows = np.arange(len(view))
    profiles = ProfileArrays.uniform(PrivacyProfile(k=2, min_area_m2=0.0), len(view))
    first = cloak.cloak_batch(view, rows, profiles)
    again = cloak.cloak_batch(planar_view(GG_USERS), rows, profiles)
    assert first.bbox.tolist() == again.bbox.tolist()
    assert first.group.tolist() == again.group.tolist()
    u1 = view.row_of["u1"]
    assert int(first.group[u1]) == group_id(17, 1 << 16, 1 << 16)
    # Same cell ⇔ same group.
    for i in rows.tolist():
        for j in rows.tolist():
            same_box = first.bbox[i].tolist() == first.bbox[j].tolist()
            assert same_box == (first.group[i] == first.group[j])


# -- the reciprocal quadtree variant (§4.2 [design]) -------------------------------------------------


def literal_partition(view: IndexView, node: Root, deepest: int) -> list[Root]:
    """``build_partition`` of §4.2, recursively, with brute-force membership."""
    level, cx, cy = node

    def members(cell: Root) -> list[int]:
        s = GRID_BITS - cell[0]
        return [r for r in range(len(view)) if (int(view.gx[r]) >> s, int(view.gy[r]) >> s) == cell[1:]]

    def can_stand_alone(cell: Root) -> bool:
        rows = members(cell)
        return len(rows) >= max(int(view.k[r]) for r in rows) and literal_area(*cell) >= max(
            float(view.min_area_m2[r]) for r in rows
        )

    if level >= deepest:
        return [node]
    kids = [(level + 1, 2 * cx + dx, 2 * cy + dy) for dy in (0, 1) for dx in (0, 1)]
    kids = [c for c in kids if members(c)]
    if all(can_stand_alone(c) for c in kids):
        return [leaf for c in kids for leaf in literal_partition(view, c, deepest)]
    return [node]


@st.composite
def views_with_stored_profiles(draw: st.DrawFn) -> IndexView:
    view = draw(clustered_views(max_users=16))
    n = len(view)
    a_min = draw(st.lists(st.sampled_from([0.0, 0.0, 0.0, 0.01, 1.0, 50.0]), min_size=n, max_size=n))
    return IndexView.from_points(view.user_ids, view.lat, view.lon, k=view.k, min_area_m2=a_min)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=views_with_stored_profiles(), depth=st.sampled_from([None, 2, 26]))
def test_reciprocal_partition_equals_build_partition(view: IndexView, depth: int | None) -> None:
    deepest = 29 if depth is None else depth
    leaf, stands = reciprocal_partition(view, (0, 0, 0), deepest)
    leaves = literal_partition(view, (0, 0, 0), deepest)
    for row in range(len(view)):
        mine = [
            c
            for c in leaves
            if (int(view.gx[row]) >> (GRID_BITS - c[0]), int(view.gy[row]) >> (GRID_BITS - c[0])) == c[1:]
        ]
        assert len(mine) == 1
        cell = mine[0]
        assert int(leaf[row]) == cell[0]
        s = GRID_BITS - cell[0]
        rows = [r for r in range(len(view)) if (int(view.gx[r]) >> s, int(view.gy[r]) >> s) == cell[1:]]
        alone = len(rows) >= max(int(view.k[r]) for r in rows) and literal_area(*cell) >= max(
            float(view.min_area_m2[r]) for r in rows
        )
        assert bool(stands[row]) == alone


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=views_with_stored_profiles(), override=st.integers(1, 8))
def test_reciprocal_partition_is_reciprocal(view: IndexView, override: int) -> None:
    """§9.1 check 6: every member of a region produces it, and the candidates are ≥ their largest k."""
    cloak = IntervalCloak(reciprocal_partition=True)
    assert cloak.partition_reciprocal and not IntervalCloak().partition_reciprocal

    def stored(r: int) -> PrivacyProfile:
        return PrivacyProfile(k=int(view.k[r]), min_area_m2=float(view.min_area_m2[r]), max_area_m2=2.5e9)

    regions = {r: cloak.cloak(view, r, stored(r)) for r in range(len(view))}
    for u, region in regions.items():
        if not isinstance(region, Region):
            continue
        candidates = {v for v in view.rows_in(region.bbox).tolist() if _same(regions[v], region)}
        assert u in candidates
        assert len(candidates) >= max(int(view.k[v]) for v in candidates)
        assert set(region.anon_set.tolist()) <= candidates
    # The same override for everyone (stricter than every stored k): the groups stay reciprocal.
    k_all = max(override, int(view.k.max()))
    same = {
        r: cloak.cloak(view, r, PrivacyProfile(k=k_all, max_area_m2=2.5e9, min_area_m2=0.0)) for r in range(len(view))
    }
    for u, region in same.items():
        if isinstance(region, Region):
            candidates = {v for v in view.rows_in(region.bbox).tolist() if _same(same[v], region)}
            assert u in candidates and len(candidates) >= k_all


def _same(a: object, b: Region) -> bool:
    return isinstance(a, Region) and a.bbox == b.bbox


def test_reciprocal_quadtree_example() -> None:
    """§4.2's users with k = 2: [200,400)² holds u3 alone, so the root is not split and all share it."""
    users = {"u1": (50.0, 50.0), "u8": (60.0, 70.0), "u2": (150.0, 60.0), "u3": (320.0, 320.0)}
    view = planar_view(users)
    view = IndexView.from_points(view.user_ids, view.lat, view.lon, k=[2, 2, 2, 2])
    cloak = IntervalCloak(root=PLANAR_ROOT, depth_max=2, reciprocal_partition=True)
    for u in users:
        result = cloak.cloak(view, view.row_of[u], PrivacyProfile(k=2, min_area_m2=0.0))
        assert isinstance(result, Region)
        assert result.bbox == planar_box(0, 0, 400, 400)
        assert sorted(result.anon_set.tolist()) == [0, 1, 2, 3]
    # Without u3 the root splits: [0,200)² holds three users; its children u1+u8 (2) and u2 (1) do not
    # all stand alone, so the leaf is [0,200)² for all three.
    view3 = IndexView.from_points(view.user_ids[:3], view.lat[:3], view.lon[:3], k=[2, 2, 2])
    for u in ("u1", "u8", "u2"):
        result = cloak.cloak(view3, view3.row_of[u], PrivacyProfile(k=2, min_area_m2=0.0))
        assert isinstance(result, Region)
        assert result.bbox == planar_box(0, 0, 200, 200)
    # A request stricter than its leaf allows is refused, never coarsened (that would break reciprocity).
    refused = cloak.cloak(view3, view3.row_of["u1"], PrivacyProfile(k=3, max_area_m2=1.0, min_area_m2=0.0))
    assert isinstance(refused, Refusal) and refused.reason == ReasonCode.AREA_EXCEEDED
    served = cloak.cloak(view3, view3.row_of["u1"], PrivacyProfile(k=3, min_area_m2=0.0))
    assert isinstance(served, Region)  # the leaf [0,200)² does hold 3
    refused = cloak.cloak(view3, view3.row_of["u1"], PrivacyProfile(k=4, min_area_m2=0.0))
    assert isinstance(refused, Refusal) and refused.reason == ReasonCode.K_UNREACHABLE


@settings(max_examples=60, deadline=None)
@given(view=views_with_stored_profiles(), data=st.data())
def test_reciprocal_batch_equals_scalar(view: IndexView, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, 10))
    rows = np.array(data.draw(st.lists(st.integers(0, len(view) - 1), min_size=m, max_size=m)), np.int64)
    profiles = data.draw(st.lists(PROFILES, min_size=m, max_size=m))
    cloak = IntervalCloak(reciprocal_partition=True, depth_max=data.draw(st.sampled_from([None, 3])))
    batch = cloak.cloak_batch(view, rows, ProfileArrays.from_profiles(profiles))
    for i, (row, profile) in enumerate(zip(rows.tolist(), profiles, strict=True)):
        one, got = cloak.cloak(view, row, profile), batch[i]
        if isinstance(one, Refusal):
            assert isinstance(got, Refusal) and got.reason == one.reason
        else:
            assert isinstance(got, Region)
            assert (got.bbox, got.k_achieved) == (one.bbox, one.k_achieved)


@settings(max_examples=200, deadline=None)
@given(value=st.floats(-180, 180), axis=st.sampled_from(["lon", "lat"]))
def test_grid_coord_matches_the_core(value: float, axis: Literal["lon", "lat"]) -> None:
    v = max(-90.0, min(90.0, value)) if axis == "lat" else value
    key = coordinate_key(v)
    assert grid_coord(key, axis) == int(grid_coords(np.array([key], np.int64), axis)[0])
    for edge in (180.0, -180.0) if axis == "lon" else (90.0, -90.0):
        k = coordinate_key(edge)
        assert grid_coord(k, axis) == int(grid_coords(np.array([k], np.int64), axis)[0])


@settings(max_examples=200, deadline=None)
@given(
    codes=st.lists(st.integers(0, 300), min_size=1, max_size=400).map(sorted),
    data=st.data(),
)
def test_run_bounds_equal_bisect(codes: list[int], data: st.DataObject) -> None:
    p = data.draw(st.integers(0, len(codes) - 1))
    lo = data.draw(st.integers(0, codes[p]))
    hi = data.draw(st.integers(codes[p] + 1, 302))
    assert run_start(codes, lo, p) == bisect.bisect_left(codes, lo)
    assert run_end(codes, hi, p) == bisect.bisect_left(codes, hi)
