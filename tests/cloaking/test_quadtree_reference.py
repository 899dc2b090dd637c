"""``interval`` and ``casper`` against the literal algorithms of CONCEPTS §4.2 / §4.3, single and batch.

The reference below is written from the pseudocode only: users on the micro-degree quadtree
(a level-29 cell is one micro-degree, the root square starts at −2^28 µdeg on both axes), cell
counts by brute force over the users, the descent (interval) and the climb from the lowest cell
with sibling pairs (casper) level by level, the published bbox of §2.2 (lower edges one
micro-degree below the cells', upper edges the cells' own), ``k_achieved`` as the users strictly
inside it (exact rational comparison) and the area by the contract formula. It shares no code with
the cloakers. Coordinates sit on 4-, 5- or 6-decimal grids, often on the lower edges of cells of
many levels, with duplicates; some are sent with 7 decimals half a micro-degree below a grid
value, inside the edge strip of the cells whose lower edge is that value, where a published box
counts them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers.base import Refusal, Region
from kcloak.cloaking.cloakers.casper import CasperCloak
from kcloak.cloaking.cloakers.interval import IntervalCloak
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

R_EARTH = 6_371_008.8  # contract §0
TOP = 29  # deepest level: one micro-degree
SHIFT = 1 << 28  # the root square's lower-left corner is (−2^28, −2^28) µdeg

Point = tuple[float, float]  # (lat, lon) as sent


# -- the reference ----------------------------------------------------------------------------


def exact(v: float) -> Fraction:
    """The coordinate a client sent: the decimal text of the float (its shortest repr)."""
    return Fraction(repr(v))


def grid_of(v: float) -> int:
    """Level-29 cell coordinate: the micro-degree holding the value (half-open)."""
    return math.floor(exact(v) * 1_000_000) + SHIFT


class Reference:
    def __init__(self, points: list[Point]) -> None:
        self.points = points
        self.cells = [(grid_of(lon), grid_of(lat)) for lat, lon in points]

    def members(self, level: int, x0: int, y0: int, x1: int, y1: int) -> list[int]:
        s = TOP - level
        return [i for i, (gx, gy) in enumerate(self.cells) if x0 <= gx >> s <= x1 and y0 <= gy >> s <= y1]

    def count(self, level: int, x0: int, y0: int, x1: int | None = None, y1: int | None = None) -> int:
        return len(self.members(level, x0, y0, x0 if x1 is None else x1, y0 if y1 is None else y1))

    @staticmethod
    def edges(level: int, x0: int, y0: int, x1: int, y1: int) -> tuple[int, int, int, int]:
        """Micro-degree edges ``(lon0, lat0, lon1, lat1)`` of a cell rectangle."""
        s = TOP - level
        return (x0 << s) - SHIFT, (y0 << s) - SHIFT, ((x1 + 1) << s) - SHIFT, ((y1 + 1) << s) - SHIFT

    @staticmethod
    def area(lon0: int, lat0: int, lon1: int, lat1: int) -> float:
        """Contract area of a micro-degree box clipped to the world."""
        lon0, lon1 = max(lon0, -180_000_000), min(lon1, 180_000_000)
        lat0, lat1 = max(lat0, -90_000_000), min(lat1, 90_000_000)
        if lon1 <= lon0 or lat1 <= lat0:
            return 0.0
        w, s, e, n = lon0 / 1e6, lat0 / 1e6, lon1 / 1e6, lat1 / 1e6  # degrees, as a client reads the bbox
        return R_EARTH * R_EARTH * math.radians(e - w) * abs(math.sin(math.radians(n)) - math.sin(math.radians(s)))

    def cell_area(self, level: int, x0: int, y0: int, x1: int | None = None, y1: int | None = None) -> float:
        return self.area(*self.edges(level, x0, y0, x0 if x1 is None else x1, y0 if y1 is None else y1))

    def published(self, level: int, x0: int, y0: int, x1: int, y1: int) -> dict[str, Any]:
        lon0, lat0, lon1, lat1 = self.edges(level, x0, y0, x1, y1)
        bbox = (lon0 - 1, lat0 - 1, lon1, lat1)  # the test's users are far from the world edge
        inside = sum(
            1
            for lat, lon in self.points
            if Fraction(bbox[0], 10**6) < exact(lon) < Fraction(bbox[2], 10**6)
            and Fraction(bbox[1], 10**6) < exact(lat) < Fraction(bbox[3], 10**6)
        )
        return {
            "bbox": bbox,
            "k_achieved": inside,
            "area": self.area(*bbox),
            "anon": sorted(self.members(level, x0, y0, x1, y1)),
        }

    def interval(self, u: int, k: int, a_min: float, depth_max: int) -> dict[str, Any] | ReasonCode:
        """§4.2: descend while the querier's child quadrant holds ≥ k users and has area ≥ A_min."""
        gx, gy = self.cells[u]
        level = 0
        if self.count(0, 0, 0) < k:
            return ReasonCode.K_UNREACHABLE
        while level < depth_max:
            s = TOP - (level + 1)
            child = (level + 1, gx >> s, gy >> s)
            if self.count(*child) < k or self.cell_area(*child) < a_min:
                break
            level += 1
        s = TOP - level
        return self.published(level, gx >> s, gy >> s, gx >> s, gy >> s)

    def casper(self, u: int, k: int, a_min: float, depth_max: int, tie_h: bool) -> dict[str, Any] | ReasonCode:
        """§4.3 casper_basic: climb from the lowest cell; a cell, else the better sibling pair."""
        gx, gy = self.cells[u]
        level = depth_max
        while True:
            s = TOP - level
            cx, cy = gx >> s, gy >> s
            n = self.count(level, cx, cy)
            if n >= k and self.cell_area(level, cx, cy) >= a_min:
                return self.published(level, cx, cy, cx, cy)
            if level == 0:
                return ReasonCode.K_UNREACHABLE if len(self.points) < k else ReasonCode.AREA_EXCEEDED
            h_pair = (level, cx & ~1, cy, cx | 1, cy)
            v_pair = (level, cx, cy & ~1, cx, cy | 1)
            n_h = n + self.count(level, cx ^ 1, cy)
            n_v = n + self.count(level, cx, cy ^ 1)
            ok_h = n_h >= k and self.cell_area(*h_pair) >= a_min
            ok_v = n_v >= k and self.cell_area(*v_pair) >= a_min
            if ok_h and (not ok_v or n_h < n_v or (n_h == n_v and tie_h)):  # closer to k; tie as configured
                return self.published(*h_pair)
            if ok_v:
                return self.published(*v_pair)
            level -= 1


# -- the users --------------------------------------------------------------------------------

CENTRES_UDEG = [(39_321_600, 116_326_400), (-34_406_400, 150_732_800), (0, 0)]
"""(lat, lon) multiples of 25 · 2^16 µdeg: on every decimal grid and on the lower edges of cells of
every level ≥ 13 (the last one of every level ≥ 1, where the users straddle 0° on both axes)."""


@st.composite
def users(draw: Any) -> list[Point]:
    decimals = draw(st.sampled_from([4, 5, 6]))
    unit = 10 ** (6 - decimals)  # µdeg per grid step
    lat0, lon0 = draw(st.sampled_from(CENTRES_UDEG))
    n = draw(st.integers(1, 40))
    out: list[Point] = []
    for _ in range(n):
        if out and draw(st.integers(0, 5)) == 0:
            out.append(draw(st.sampled_from(out)))  # a duplicate position
            continue
        if out and draw(st.integers(0, 3)) == 0:  # a neighbour in the same row or column, 2^j grid steps away
            lat, lon = draw(st.sampled_from(out))
            step = draw(st.sampled_from([-1, 1])) * unit * (1 << draw(st.integers(0, 12))) / 1e6
            out.append((lat, float(f"{lon + step:.7f}")) if draw(st.booleans()) else (float(f"{lat + step:.7f}"), lon))
            continue
        coords = []
        for c in (lat0, lon0):
            if draw(st.booleans()):  # on the lower edge of cells of level ≤ 29 − s (and the decimal grid)
                s = draw(st.integers(2, 14))
                step = (unit * (1 << s)) // math.gcd(unit, 1 << s)
                udeg = c + draw(st.integers(-6, 6)) * step
            else:
                udeg = c + draw(st.integers(-(1 << 15), 1 << 15)) // unit * unit
            coords.append(udeg)
        if draw(st.integers(0, 4)) == 0:  # half a micro-degree below: in the edge strip of those cells
            out.append((float(f"{(coords[0] - 0.5) / 1e6:.7f}"), float(f"{(coords[1] - 0.5) / 1e6:.7f}")))
        else:
            out.append((coords[0] / 1e6, coords[1] / 1e6))
    return out


PROFILES = st.lists(
    st.builds(
        lambda k, a, big: PrivacyProfile(k=k, min_area_m2=a, max_area_m2=2.5e9 if big else 3e5),
        st.integers(1, 9),
        st.sampled_from([0.0, 0.0, 0.0, 0.3, 70.0, 4e4]),
        st.booleans(),
    ),
    min_size=1,
    max_size=3,
)


def expected(ref: Reference, reference: dict[str, Any] | ReasonCode, profile: PrivacyProfile) -> Any:
    """What the cloaker must answer given the reference's region (None: not compared, see below)."""
    if isinstance(reference, ReasonCode):
        return reference
    if reference["area"] < profile.min_area_m2:
        return None  # a root below the area floor grows (§2.5): not this reference's business
    if reference["area"] > profile.max_area_m2:
        return ReasonCode.AREA_EXCEEDED
    return reference


def check(got: Region | Refusal, want: Any) -> None:
    if want is None:
        return
    if isinstance(want, ReasonCode):
        assert isinstance(got, Refusal), (got, want)
        assert got.reason == want
        return
    assert isinstance(got, Region), (got, want)
    b = got.bbox
    assert (b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg) == want["bbox"]
    assert got.k_achieved == want["k_achieved"]
    assert math.isclose(got.area_m2, want["area"], rel_tol=1e-9)
    assert sorted(got.anon_set.tolist()) == want["anon"]


def check_batch(batch: Any, i: int, want: Any) -> None:
    if want is None:
        return
    got = batch[i]
    if isinstance(want, ReasonCode):
        assert isinstance(got, Refusal) and got.reason == want, (got, want)
        return
    assert isinstance(got, Region), (got, want)
    b = got.bbox
    assert (b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg) == want["bbox"]
    assert got.k_achieved == want["k_achieved"]


CLOAKERS = st.sampled_from(
    [
        ("interval", None, True),
        ("interval", 21, True),
        ("casper", None, True),
        ("casper", None, False),
        ("casper", 23, True),
        ("casper-adaptive", None, True),
    ]
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(points=users(), profiles=PROFILES, which=CLOAKERS, data=st.data())
def test_single_and_batch_equal_the_literal_algorithms(
    points: list[Point], profiles: list[PrivacyProfile], which: tuple[str, int | None, bool], data: st.DataObject
) -> None:
    name, depth, tie_h = which
    depth_max = TOP if depth is None else depth
    ref = Reference(points)
    view = IndexView.from_points(
        [f"u{i}" for i in range(len(points))], [p[0] for p in points], [p[1] for p in points], now=0.0
    )
    if name == "interval":
        cloaker: IntervalCloak | CasperCloak = IntervalCloak(depth_max=depth)
    else:
        cloaker = CasperCloak(
            variant="adaptive" if name == "casper-adaptive" else "basic",
            tie="horizontal" if tie_h else "vertical",
            depth_max=depth,
        )
    rows = data.draw(st.lists(st.integers(0, len(points) - 1), min_size=1, max_size=12))
    chosen = [data.draw(st.sampled_from(profiles)) for _ in rows]
    wants = []
    for row, profile in zip(rows, chosen, strict=True):
        if name == "interval":
            reference = ref.interval(row, profile.k, profile.min_area_m2, depth_max)
        else:
            reference = ref.casper(row, profile.k, profile.min_area_m2, depth_max, tie_h)
        want = expected(ref, reference, profile)
        check(cloaker.cloak(view, row, profile), want)
        wants.append(want)
    # the batch path, on a fresh view (nothing memoized by the single calls) and on the same view
    for v in (IndexView.from_points(view.user_ids, view.lat, view.lon, now=0.0), view):
        batch = cloaker.cloak_batch(v, np.asarray(rows, np.int64), ProfileArrays.from_profiles(chosen))
        for i, want in enumerate(wants):
            check_batch(batch, i, want)


def test_edge_strip_users_on_a_patched_view_equal_the_literal_algorithms() -> None:
    """A view whose counts are patched from the previous one (users entering, leaving and moving
    between the edge strips of the usual cells) still counts every strip user (§2.2)."""
    base_lat, base_lon = 39_321_600, 116_326_400  # lower edges of cells of every level ≥ 13

    def strip_user(i: int, j: int) -> Point:  # half a µdeg below a multiple of 2^8 µdeg on both axes
        return float(f"{(base_lat + 256 * i - 0.5) / 1e6:.7f}"), float(f"{(base_lon + 256 * j - 0.5) / 1e6:.7f}")

    def filler(i: int, j: int, d: int) -> Point:  # inside the 256 µdeg cell above-right of a grid point
        return (base_lat + 256 * i + d) / 1e6, (base_lon + 256 * j + d + 4) / 1e6

    index = PositionIndex(stale_after_s=60.0)
    for u in range(108):  # per 256 µdeg cell: a user in the strips of the cells right of and above it, two inside
        i, j, what = u // 3 % 6, u // 18, u % 3
        index.update(f"u{u}", *(strip_user(i, j) if what == 0 else filler(i, j, 37 if what == 1 else 181)), 0.0)
    moves = [("u0", strip_user(2, 5)), ("u3", strip_user(4, 1)), ("u51", strip_user(1, 3)), ("u6", filler(2, 2, 99))]
    cloakers: list[IntervalCloak | CasperCloak] = [IntervalCloak(), CasperCloak(), CasperCloak(tie="vertical")]
    for t, cloaker in enumerate(cloakers):
        view = index.snapshot(10.0 * t, epoch=2 * t + 1, seed=1)
        for row in range(len(view)):
            cloaker.cloak(view, row, PrivacyProfile(k=3))
        for user, (lat, lon) in moves:  # into and out of strips; few, so the counts are patched
            index.update(user, lat, lon, 10.0 * t + 1)
        index.remove(f"u{20 + t}")
        index.update(f"new{t}", *strip_user(3, 6), 10.0 * t + 1)
        view = index.snapshot(10.0 * t + 1, epoch=2 * t + 2, seed=2)
        ref = Reference(list(zip(view.lat.tolist(), view.lon.tolist(), strict=True)))
        for k in (2, 3, 4, 7):
            profile = PrivacyProfile(k=k)
            for row in range(len(view)):
                if isinstance(cloaker, CasperCloak):
                    want = expected(ref, ref.casper(row, k, 0.0, TOP, cloaker.tie == "horizontal"), profile)
                else:
                    want = expected(ref, ref.interval(row, k, 0.0, TOP), profile)
                check(cloaker.cloak(view, row, profile), want)
        assert cloaker.carried_over(view)
        moves = [(user, strip_user(1 + t, 1)) for user, _ in moves]  # somewhere else for the next cloaker
