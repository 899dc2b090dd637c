"""Casper (CONCEPTS §4.3): the worked example, the fast algorithm against the literal bottom-up
pseudocode, batch against scalar, the adaptive pyramid against basic, and its update cost."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import Cloaker, Refusal, Region, get_cloaker
from kcloak.cloaking.cloakers.casper import AdaptivePyramid, CasperCloak, leaf_levels
from kcloak.cloaking.cloakers.interval import KIND_CELL, KIND_HPAIR, KIND_VPAIR, Root, cell_area_m2, cell_bbox, group_id
from kcloak.cloaking.grid import GRID_BITS, GRID_OFFSET, cell_udeg
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import bbox_area_m2, coordinate_key
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode
from tests.cloaking.test_interval import (
    GG_USERS,
    PLANAR_ROOT,
    PROFILES,
    clustered_views,
    planar_box,
    planar_view,
)

Rect = tuple[int, int, int, int, int]

# -- the worked example ------------------------------------------------------------------------

LEVEL2_AREA = cell_area_m2(18, 1 << 17, 1 << 17)  # the querier's 100 m cell of the planar frame


@pytest.mark.parametrize(
    ("k", "a_min", "expected", "k_achieved"),
    [
        (2, 0.0, (0, 0, 200, 100), 2),  # own cell 1 user; horizontal pair (u1, u2) = 2, vertical = 1
        (3, 0.0, (0, 0, 200, 200), 3),  # pairs 2 and 1; the parent holds u1, u2, u3
        (4, 0.0, (0, 0, 400, 200), 4),  # parent 3; its pairs 4 and 4: tie → horizontal
        (5, 0.0, (0, 0, 400, 400), 7),  # both pairs 4 < 5; the root holds 7
        (8, 0.0, ReasonCode.K_UNREACHABLE, 0),
        (2, 3 * LEVEL2_AREA, (0, 0, 200, 200), 3),  # the pair's area 2× < A_min; the level-1 cell 4×
    ],
)
def test_casper_basic(k: int, a_min: float, expected: tuple[int, int, int, int] | ReasonCode, k_achieved: int) -> None:
    """§4.3 worked example (same users as §4.2, H = 2, querier u1), basic and adaptive."""
    view = planar_view(GG_USERS)
    profile = PrivacyProfile(k=k, min_area_m2=a_min)
    for variant in ("basic", "adaptive"):
        result = CasperCloak(variant=variant, root=PLANAR_ROOT, depth_max=2).cloak(view, view.row_of["u1"], profile)
        if isinstance(expected, ReasonCode):
            assert isinstance(result, Refusal)
            assert result.reason == expected
            continue
        assert isinstance(result, Region)
        assert result.bbox == planar_box(*expected)
        assert result.k_achieved == k_achieved == view.count_in(result.bbox)
        assert result.area_m2 >= a_min
        assert result.algorithm == "casper"


def test_casper_tie_vertical() -> None:
    """With ``tie="vertical"`` the k = 4 row takes the vertical pair of the parent (+u7)."""
    view = planar_view(GG_USERS)
    result = CasperCloak(tie="vertical", root=PLANAR_ROOT, depth_max=2).cloak(
        view, view.row_of["u1"], PrivacyProfile(k=4)
    )
    assert isinstance(result, Region)
    assert result.bbox == planar_box(0, 0, 200, 400)
    assert sorted(view.user_ids[r] for r in result.anon_set.tolist()) == ["u1", "u2", "u3", "u7"]


def test_casper_refusals_and_registry() -> None:
    view = planar_view(GG_USERS)
    row = view.row_of["u1"]
    result = CasperCloak().cloak(view, row, PrivacyProfile(k=2, l=2))
    assert isinstance(result, Refusal)
    assert result.reason == ReasonCode.UNSUPPORTED
    too_small = planar_box(0, 0, 200, 100).area_m2 * 0.999
    result = CasperCloak(root=PLANAR_ROOT, depth_max=2).cloak(view, row, PrivacyProfile(k=2, max_area_m2=too_small))
    assert isinstance(result, Refusal)
    assert result.reason == ReasonCode.AREA_EXCEEDED
    # The root is below A_min: nothing in the pyramid qualifies (the pseudocode refuses at the root).
    root_area = cell_area_m2(*PLANAR_ROOT)
    result = CasperCloak(root=PLANAR_ROOT).cloak(view, row, PrivacyProfile(k=2, min_area_m2=2 * root_area))
    assert isinstance(result, Refusal)
    assert result.reason == ReasonCode.AREA_EXCEEDED
    cloak = get_cloaker("casper", variant="adaptive", tie="vertical")
    assert isinstance(cloak, CasperCloak)
    assert isinstance(cloak, Cloaker)
    assert (cloak.name, cloak.reciprocal, cloak.supports_l, cloak.variant, cloak.tie) == (
        "casper",
        False,
        False,
        "adaptive",
        "vertical",
    )
    with pytest.raises(ValueError, match="variant"):
        CasperCloak(variant="complete")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tie"):
        CasperCloak(tie="diagonal")  # type: ignore[arg-type]


# -- the literal pseudocode ----------------------------------------------------------------------


def rect_area(level: int, cx0: int, cy0: int, cx1: int, cy1: int) -> float:
    """Contract area of a cell rectangle clipped to the world (independent of the module)."""
    lon0, lat0, _, _ = cell_udeg(level, cx0, cy0)
    _, _, lon1, lat1 = cell_udeg(level, cx1, cy1)
    lon0, lon1 = max(lon0, -180_000_000), min(lon1, 180_000_000)
    lat0, lat1 = max(lat0, -90_000_000), min(lat1, 90_000_000)
    if lon1 <= lon0 or lat1 <= lat0:
        return 0.0
    return bbox_area_m2(lon0 / 1e6, lat0 / 1e6, lon1 / 1e6, lat1 / 1e6)


def literal_casper(
    view: IndexView, row: int, k: int, a_min: float, root: Root, deepest: int, tie_h: bool
) -> Rect | ReasonCode:
    """``casper_basic`` exactly as in §4.3, climbing one level at a time with ``view.count_cell``.

    The pair's area is its box's (the planar ``2·area(cid)``); the root has no sibling pairs; a
    refusal at the root is ``k_unreachable`` only when fewer than k users are present (§3.3).
    """
    gx, gy = int(view.gx[row]), int(view.gy[row])
    level = deepest
    cx, cy = gx >> (GRID_BITS - level), gy >> (GRID_BITS - level)
    while True:
        n = view.count_cell(level, cx, cy)
        if n >= k and rect_area(level, cx, cy, cx, cy) >= a_min:
            return (level, cx, cy, cx, cy)
        if level > root[0]:
            n_h = n + view.count_cell(level, cx ^ 1, cy)
            n_v = n + view.count_cell(level, cx, cy ^ 1)
            h_rect = (level, min(cx, cx ^ 1), cy, max(cx, cx ^ 1), cy)
            v_rect = (level, cx, min(cy, cy ^ 1), cx, max(cy, cy ^ 1))
            ok_h = n_h >= k and rect_area(*h_rect) >= a_min
            ok_v = n_v >= k and rect_area(*v_rect) >= a_min
            if ok_h or ok_v:
                if ok_h and (not ok_v or n_h < n_v or (n_h == n_v and tie_h)):
                    return h_rect
                return v_rect
        if level == root[0]:
            return ReasonCode.K_UNREACHABLE if len(view) < k else ReasonCode.AREA_EXCEEDED
        level, cx, cy = level - 1, cx >> 1, cy >> 1


def check_against_literal(
    view: IndexView, result: object, expected: Rect | ReasonCode, profile: PrivacyProfile
) -> None:
    if isinstance(expected, ReasonCode):
        assert isinstance(result, Refusal)
        assert result.reason == expected
        return
    bbox = view.cell_rect_bbox(*expected)
    if bbox.area_m2 > profile.max_area_m2:
        assert isinstance(result, Refusal)
        assert result.reason == ReasonCode.AREA_EXCEEDED
    elif view.count_in(bbox) < profile.k:  # only where the world edge makes strictness impossible
        assert isinstance(result, Refusal)
    else:
        assert isinstance(result, Region)
        assert result.bbox == bbox == cell_bbox(*expected)
        assert result.area_m2 == bbox.area_m2
        assert result.k_achieved == view.count_in(bbox) >= profile.k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    view=clustered_views(),
    profile=PROFILES,
    depth=st.sampled_from([None, 2, 27]),
    tie=st.sampled_from(["horizontal", "vertical"]),
)
def test_fast_basic_equals_literal_pseudocode(
    view: IndexView, profile: PrivacyProfile, depth: int | None, tie: str
) -> None:
    deepest = 29 if depth is None else depth
    cloak = CasperCloak(tie=tie, depth_max=depth)  # type: ignore[arg-type]
    for row in range(len(view)):
        expected = literal_casper(view, row, profile.k, profile.min_area_m2, (0, 0, 0), deepest, tie == "horizontal")
        check_against_literal(view, cloak.cloak(view, row, profile), expected, profile)


@settings(max_examples=60, deadline=None)
@given(view=clustered_views(), profile=PROFILES, tie=st.sampled_from(["horizontal", "vertical"]))
def test_fast_basic_equals_literal_under_a_small_root(view: IndexView, profile: PrivacyProfile, tie: str) -> None:
    """A root cell deep in the grid (users outside it are refused) with a short pyramid."""
    gx, gy = int(view.gx[0]), int(view.gy[0])
    root: Root = (24, gx >> 5, gy >> 5)
    cloak = CasperCloak(tie=tie, root=root, depth_max=4)  # type: ignore[arg-type]
    for row in range(len(view)):
        result = cloak.cloak(view, row, profile)
        if (int(view.gx[row]) >> 5, int(view.gy[row]) >> 5) != root[1:]:
            assert isinstance(result, Refusal)
            continue
        if view.count_cell(*root) < profile.k:
            assert isinstance(result, Refusal)
            assert result.reason == (ReasonCode.K_UNREACHABLE if len(view) < profile.k else ReasonCode.AREA_EXCEEDED)
            continue
        expected = literal_casper(view, row, profile.k, profile.min_area_m2, root, 28, tie == "horizontal")
        check_against_literal(view, result, expected, profile)


@settings(max_examples=100, deadline=None)
@given(view=clustered_views(), data=st.data())
def test_batch_equals_scalar(view: IndexView, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, 12))
    rows = np.array(data.draw(st.lists(st.integers(0, len(view) - 1), min_size=m, max_size=m)), np.int64)
    profiles = data.draw(st.lists(PROFILES, min_size=m, max_size=m))
    cloak = CasperCloak(
        variant=data.draw(st.sampled_from(["basic", "adaptive"])),
        tie=data.draw(st.sampled_from(["horizontal", "vertical"])),
        depth_max=data.draw(st.sampled_from([None, 5])),
    )
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
        assert int(batch.group[i]) & 3 in (KIND_CELL, KIND_HPAIR, KIND_VPAIR)


def test_batch_groups_name_cells_and_pairs() -> None:
    view = planar_view(GG_USERS)
    cloak = CasperCloak(root=PLANAR_ROOT, depth_max=2)
    rows = np.array([view.row_of["u1"]] * 3)
    profiles = ProfileArrays.from_profiles([PrivacyProfile(k=2), PrivacyProfile(k=3), PrivacyProfile(k=4)])
    batch = cloak.cloak_batch(view, rows, profiles)
    c18, c17 = 1 << 17, 1 << 16
    assert batch.group.tolist() == [
        group_id(18, c18, c18, KIND_HPAIR),
        group_id(17, c17, c17, KIND_CELL),
        group_id(17, c17, c17, KIND_HPAIR),
    ]


# -- adaptive ------------------------------------------------------------------------------------

ADAPTIVE_ROOT: Root = (20, 1 << 19, 1 << 19)  # [0, 512)² µdeg at (0°, 0°)
ADAPTIVE_DEPTH = 6  # cells down to 8 µdeg (≈ 0.9 m)
ADAPTIVE_A_MINS = (0.0, 0.0, 0.5, 3.0, 12.0, 60.0, 400.0)


def _pos(x: int, y: int, half: bool) -> tuple[float, float]:
    """(lat, lon) of µdeg offsets inside the adaptive root; ``half`` puts the point between micro-degrees."""
    d = 0.5 if half else 0.0
    return (y + d) / 1e6, (x + d) / 1e6


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "move", "move", "move", "remove", "profile"]),
        st.integers(0, 9),
        st.integers(0, 511),
        st.integers(0, 511),
        st.booleans(),
        st.integers(1, 5),
        st.sampled_from(ADAPTIVE_A_MINS),
    ),
    min_size=1,
    max_size=40,
)


def _view_of(users: dict[str, tuple[float, float, int, float]]) -> IndexView:
    ids = sorted(users)
    return IndexView.from_points(
        ids,
        [users[u][0] for u in ids],
        [users[u][1] for u in ids],
        k=[users[u][2] for u in ids],
        min_area_m2=[users[u][3] for u in ids],
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, local=st.booleans())
def test_casper_adaptive_equals_basic(ops: list[tuple[str, int, int, int, bool, int, float]], local: bool) -> None:
    """Random add / move / remove / profile sequences: the incremental pyramid keeps the invariant,
    is canonical, and cloaking from each user's leaf returns basic's region (§4.3)."""
    pyramid = AdaptivePyramid(root=ADAPTIVE_ROOT, depth_max=ADAPTIVE_DEPTH)
    users: dict[str, tuple[float, float, int, float]] = {}
    anchor: dict[str, tuple[int, int]] = {}
    for op, uid, x, y, half, k, a_min in ops:
        u = f"u{uid}"
        if local and u in anchor:  # small moves, mostly within a leaf or to a neighbour
            x = max(0, min(511, anchor[u][0] + x % 9 - 4))
            y = max(0, min(511, anchor[u][1] + y % 9 - 4))
        lat, lon = _pos(x, y, half)
        if u not in users:
            pyramid.add(u, lat, lon, k=k, min_area_m2=a_min)
            users[u], anchor[u] = (lat, lon, k, a_min), (x, y)
        elif op == "remove":
            pyramid.remove(u)
            del users[u], anchor[u]
        elif op == "profile":
            pyramid.set_profile(u, k=k, min_area_m2=a_min)
            users[u] = (users[u][0], users[u][1], k, a_min)
        else:
            pyramid.move(u, lat, lon)
            users[u], anchor[u] = (lat, lon, users[u][2], users[u][3]), (x, y)
        assert pyramid.check() == []
    assert len(pyramid) == len(users)
    # Canonical: the same users added in another order give the same pyramid.
    fresh = AdaptivePyramid(root=ADAPTIVE_ROOT, depth_max=ADAPTIVE_DEPTH)
    for u in sorted(users, reverse=True):
        lat, lon, k, a_min = users[u]
        fresh.add(u, lat, lon, k=k, min_area_m2=a_min)
    assert set(fresh.leaves()) == set(pyramid.leaves())
    if not users:
        return
    view = _view_of(users)
    basic = CasperCloak(root=ADAPTIVE_ROOT, depth_max=ADAPTIVE_DEPTH)
    adaptive = CasperCloak(variant="adaptive", root=ADAPTIVE_ROOT, depth_max=ADAPTIVE_DEPTH)
    leaves = leaf_levels(view, ADAPTIVE_ROOT, ADAPTIVE_ROOT[0] + ADAPTIVE_DEPTH, True)
    for u, (_, _, k, a_min) in users.items():
        row = view.row_of[u]
        assert int(leaves[row]) == pyramid.leaf_of(u)[0]
        profile = PrivacyProfile(k=k, min_area_m2=a_min, max_area_m2=2.5e9)
        expected = basic.cloak(view, row, profile)
        rect = pyramid.cloak(u)
        if isinstance(rect, ReasonCode):
            assert isinstance(expected, Refusal)
            assert expected.reason == rect
        else:
            assert isinstance(expected, Region)
            assert expected.bbox == cell_bbox(*rect)
        got = adaptive.cloak(view, row, profile)
        assert type(got) is type(expected)
        if isinstance(got, Region) and isinstance(expected, Region):
            assert (got.bbox, got.k_achieved) == (expected.bbox, expected.k_achieved)
        # A stricter request is still served correctly from the leaf.
        stricter = PrivacyProfile(k=k + 1, min_area_m2=a_min, max_area_m2=2.5e9)
        rect = pyramid.cloak(u, k=k + 1)
        expected = basic.cloak(view, row, stricter)
        if isinstance(rect, ReasonCode):
            assert isinstance(expected, Refusal)
        else:
            assert isinstance(expected, Region)
            assert expected.bbox == cell_bbox(*rect)


def test_adaptive_pyramid_refuses_looser_requests_and_bad_positions() -> None:
    pyramid = AdaptivePyramid(root=ADAPTIVE_ROOT, depth_max=ADAPTIVE_DEPTH)
    pyramid.add("a", *_pos(10, 10, False), k=3)
    with pytest.raises(ValueError, match="stricter"):
        pyramid.cloak("a", k=2)
    with pytest.raises(ValueError, match="outside"):
        pyramid.add("b", 1.0, 1.0, k=2)
    with pytest.raises(KeyError):
        pyramid.add("a", *_pos(10, 10, False), k=3)
    assert pyramid.cloak("a") == ReasonCode.K_UNREACHABLE
    assert pyramid.n_nodes == 1 and list(pyramid.leaves()) == [ADAPTIVE_ROOT]


def test_adaptive_served_from_lowest_cell_when_request_is_looser() -> None:
    """A view whose stored k exceeds the request's (no only-stricter rule in play) still matches basic."""
    view = IndexView.from_points(
        [f"u{i}" for i in range(6)],
        [0.000001, 0.000002, 0.000003, 0.0001, 0.0002, 0.0003],
        [0.000001, 0.000002, 0.000003, 0.0001, 0.0002, 0.0003],
        k=[6] * 6,
    )
    profile = PrivacyProfile(k=2)
    for row in range(6):
        one = CasperCloak().cloak(view, row, profile)
        two = CasperCloak(variant="adaptive").cloak(view, row, profile)
        assert isinstance(one, Region) and isinstance(two, Region)
        assert one.bbox == two.bbox


def _grid(lat: float, lon: float) -> tuple[int, int]:
    return (coordinate_key(lon) >> 1) + GRID_OFFSET, (coordinate_key(lat) >> 1) + GRID_OFFSET


def test_adaptive_update_cost() -> None:
    """Moves touch only the counters below the common ancestor of the old and new *leaves*; the
    complete pyramid (H = 29) touches every level below the common ancestor of the lowest cells."""
    rng = np.random.default_rng(7)
    n = 1500
    centres = np.array([[39.90, 116.40], [39.95, 116.30], [39.98, 116.45]])
    which = rng.integers(0, len(centres), n)
    lat = centres[which, 0] + rng.normal(0, 0.004, n)
    lon = centres[which, 1] + rng.normal(0, 0.004, n)
    pyramid = AdaptivePyramid()
    for i in range(n):
        pyramid.add(f"u{i}", float(lat[i]), float(lon[i]), k=10)
    before = pyramid.counter_updates
    complete = 0
    moves = 6000
    for _ in range(moves):
        i = int(rng.integers(0, n))
        nlat = float(lat[i] + rng.normal(0, 5e-5))  # a step of a few metres
        nlon = float(lon[i] + rng.normal(0, 5e-5))
        (ox, oy), (nx, ny) = _grid(float(lat[i]), float(lon[i])), _grid(nlat, nlon)
        differ = max((ox ^ nx).bit_length(), (oy ^ ny).bit_length())
        complete += 2 * differ  # levels 30 − differ … 29 on both paths
        pyramid.move(f"u{i}", nlat, nlon)
        lat[i], lon[i] = nlat, nlon
    adaptive = pyramid.counter_updates - before
    assert adaptive < 0.4 * complete
    assert adaptive / moves < 12  # vs ≈ 2·(29 − LCA level) per move on the complete pyramid
    leaf_depths = [cell[0] for cell in pyramid.leaves()]
    assert max(leaf_depths) < 29
    # The pyramid still equals the one built from scratch for the final positions.
    view = IndexView.from_points([f"u{i}" for i in range(n)], lat, lon, k=np.full(n, 10))
    leaves = leaf_levels(view, (0, 0, 0), 29, True)
    assert all(int(leaves[view.row_of[f"u{i}"]]) == pyramid.leaf_of(f"u{i}")[0] for i in range(n))


def test_leaf_levels_cached_and_outside_root() -> None:
    view = planar_view({**GG_USERS, "far": (5000.0, 5000.0)})
    levels = leaf_levels(view, PLANAR_ROOT, 18, True)
    assert leaf_levels(view, PLANAR_ROOT, 18, True) is levels
    assert int(levels[view.row_of["far"]]) == -1
    assert all(16 <= int(levels[view.row_of[u]]) <= 18 for u in GG_USERS)
