"""Temporal cloaking, the pure part (CONCEPTS §5.1): cell choice, the aligned ``t_start`` rule and
every §9.2 property of the interval, checked by brute force with exact decimal containment."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import Refusal, Region
from kcloak.cloaking.cloakers.interval import cell_bbox
from kcloak.cloaking.grid import GRID_BITS, grid_coords
from kcloak.cloaking.temporal import (
    ArrayFixHistory,
    Fixes,
    FixHistory,
    TemporalCell,
    aligned_start,
    temporal_cell,
    temporal_cloak,
    temporal_window,
)
from kcloak.core.geometry import BBox, coordinate_key
from kcloak.core.profile import PrivacyProfile, ReasonCode

# -- (1) the cell choice -------------------------------------------------------------------------


def test_cell_choice_beijing() -> None:
    cell = temporal_cell(39.9, 116.4, max_area_m2=4e6)
    assert isinstance(cell, TemporalCell)
    assert cell.level == 15  # ≈ 1.8 km × 1.4 km; the level-14 cell is four times larger
    assert cell.area_m2 == cell.bbox.area_m2 <= 4e6
    assert cell_bbox(cell.level - 1, cell.cx >> 1, cell.cy >> 1, cell.cx >> 1, cell.cy >> 1).area_m2 > 4e6
    assert cell.bbox.contains_key(coordinate_key(116.4), coordinate_key(39.9))


@settings(max_examples=200, deadline=None)
@given(
    lat=st.floats(-90, 90),
    lon=st.floats(-180, 180),
    max_area=st.floats(1e-3, 2.5e9),
    min_frac=st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.9, 1.0]),
)
def test_cell_choice_properties(lat: float, lon: float, max_area: float, min_frac: float) -> None:
    """The region is the largest quadtree cell holding the querier whose bbox is within the bounds."""
    min_area = max_area * min_frac
    cell = temporal_cell(lat, lon, max_area_m2=max_area, min_area_m2=min_area)
    gx = int(grid_coords(np.array([coordinate_key(lon)]), "lon")[0])
    gy = int(grid_coords(np.array([coordinate_key(lat)]), "lat")[0])

    def published(level: int) -> BBox:
        s = GRID_BITS - level
        return cell_bbox(level, gx >> s, gy >> s, gx >> s, gy >> s)

    if isinstance(cell, Refusal):
        assert cell.reason == ReasonCode.AREA_EXCEEDED
        largest = next((h for h in range(30) if published(h).area_m2 <= max_area), None)
        assert largest is None or published(largest).area_m2 < min_area
        return
    s = GRID_BITS - cell.level
    assert (cell.cx, cell.cy) == (gx >> s, gy >> s)  # a quadtree cell containing the querier
    assert cell.bbox == published(cell.level)
    assert min_area <= cell.area_m2 == cell.bbox.area_m2 <= max_area
    assert cell.level == 0 or published(cell.level - 1).area_m2 > max_area  # the largest such cell
    assert cell.bbox.contains_key(coordinate_key(lon), coordinate_key(lat))  # strictly (but at the world edge)


def test_cell_choice_refusals() -> None:
    tiny = temporal_cell(39.9, 116.4, max_area_m2=1e-3)  # below a 1 µdeg cell
    assert isinstance(tiny, Refusal)
    assert tiny.reason == ReasonCode.AREA_EXCEEDED
    gap = temporal_cell(39.9, 116.4, max_area_m2=4e6, min_area_m2=3.9e6)  # the cell is 2.5e6 m²
    assert isinstance(gap, Refusal)
    assert gap.reason == ReasonCode.AREA_EXCEEDED
    outside = temporal_cell(39.9, 116.4, max_area_m2=4e6, root=(16, 1 << 15, 1 << 15))
    assert isinstance(outside, Refusal)


# -- (2) the aligned t_start rule ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t_fix", "lookback", "window", "expected"),
    [
        (1000.5, 300.0, 60.0, 960),  # the window's start
        (1000.5, 30.0, 60.0, 971),  # clipped to the look-back, rounded up into it
        (960.0, 300.0, 60.0, 960),  # on the grid
        (1019.999, 300.0, 60.0, 960),
        (1714550412.31, 300.0, 60.0, 1714550400),
        (1714551000.5, 300.0, 900.0, 1714550701),  # a 15-min grid reaches beyond the look-back
        (100.25, 0.0, 60.0, 100),  # no integer in [t_fix − 0, t_fix]: floor(t_fix)
    ],
)
def test_aligned_start(t_fix: float, lookback: float, window: float, expected: int) -> None:
    assert aligned_start(t_fix, lookback_s=lookback, window_s=window) == expected


@settings(max_examples=300, deadline=None)
@given(
    t1=st.floats(0, 2e9),
    dt=st.floats(0, 120),
    lookback=st.floats(1, 900),
    window=st.sampled_from([1.0, 15.0, 60.0, 300.0, 7.5]),
)
def test_aligned_start_properties(t1: float, dt: float, lookback: float, window: float) -> None:
    t_start = aligned_start(t1, lookback_s=lookback, window_s=window)
    assert isinstance(t_start, int)
    assert t1 - lookback <= t_start <= t1
    aligned = math.floor(t1 / window) * window
    if aligned >= t1 - lookback and aligned == int(aligned):
        assert t_start == aligned  # on the grid whenever the look-back allows it
    # Two fixes in the same window share t_start when the look-back covers the window.
    t2 = t1 + dt
    if lookback >= window and math.floor(t1 / window) == math.floor(t2 / window) and window == int(window):
        assert aligned_start(t2, lookback_s=lookback, window_s=window) == t_start


def test_aligned_start_validates() -> None:
    with pytest.raises(ValueError, match="window_s"):
        aligned_start(10.0, window_s=0.0)
    with pytest.raises(ValueError, match="lookback_s"):
        aligned_start(10.0, lookback_s=-1.0)


# -- (3) the interval: the §9.2 properties --------------------------------------------------------

CELL = cell_bbox(25, 1 << 24, 1 << 24, 1 << 24, 1 << 24)  # [0, 16)² µdeg at (0°, 0°), published [−1, 16]


def test_worked_interval() -> None:
    cell = temporal_cell(39.9, 116.4, max_area_m2=4e6)
    assert isinstance(cell, TemporalCell)
    history = ArrayFixHistory(["a", "b", "c", "a", "d"], [100, 130, 170, 200, 150], [39.9] * 5, [116.4] * 4 + [0.0])
    # t_fix 125.5: t_start = 120 (the 60 s window), so a's fix at 100 does not count; d is elsewhere.
    w2 = temporal_window(history, cell.bbox, 125.5, 2)
    assert (w2.t_start, w2.t_end, w2.k_achieved) == (120, 170, 2)
    w3 = temporal_window(history, cell.bbox, 125.5, 3)
    assert (w3.t_start, w3.t_end, w3.k_achieved) == (120, 200, 3)
    w4 = temporal_window(history, cell.bbox, 125.5, 4)
    assert (w4.t_start, w4.t_end, w4.k_achieved, w4.ready) == (120, None, 3, False)
    # The querier alone: t_end is never before its own fix.
    w1 = temporal_window(history, cell.bbox, 125.5, 1)
    assert (w1.t_end, w1.k_achieved) == (130, 1)
    # With only the fixes up to 150 known, k = 3 is not reached yet.
    assert temporal_window(history, cell.bbox, 125.5, 3, until=150).t_end is None


def strictly_inside(bbox: BBox, lat: float, lon: float) -> bool:
    """As a client reads it: the exact decimals of the texts, and float64."""
    q = Decimal("0.000001")
    e = bbox.to_geojson()
    return (
        bbox.min_lon_udeg * q < Decimal(repr(lon)) < bbox.max_lon_udeg * q
        and bbox.min_lat_udeg * q < Decimal(repr(lat)) < bbox.max_lat_udeg * q
        and e[0] < lon < e[2]
        and e[1] < lat < e[3]
    )


def visitors(fixes: list[tuple[str, float, float, float]], bbox: BBox, t_from: float, t_to: float) -> set[str]:
    """Brute force: distinct users with a fix strictly inside ``bbox`` during ``[t_from, t_to]``."""
    return {u for u, t, lat, lon in fixes if t_from <= t <= t_to and strictly_inside(bbox, lat, lon)}


def _coord(udeg: int, nudge: str) -> float:
    v = udeg / 1e6
    if nudge == "up":
        return math.nextafter(v, math.inf)
    if nudge == "down":
        return math.nextafter(v, -math.inf)
    if nudge == "half":
        return (udeg + 0.5) / 1e6
    return v


NUDGE = st.sampled_from(["near", "up", "down", "half"])
FIX = st.tuples(
    st.integers(0, 11),
    st.floats(-400, 400).map(lambda d: 1_000_000.0 + round(d, 2)),
    st.integers(-3, 19),
    NUDGE,
    st.integers(-3, 19),
    NUDGE,
)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.lists(FIX, max_size=60),
    t_fix=st.floats(-60, 60).map(lambda d: 1_000_000.0 + d),
    k=st.integers(1, 8),
    lookback=st.floats(1, 400),
    window=st.sampled_from([1.0, 10.0, 60.0, 300.0]),
    until_after=st.one_of(st.just(math.inf), st.floats(0, 400)),
)
def test_interval_properties(
    raw: list[tuple[int, float, int, str, int, str]],
    t_fix: float,
    k: int,
    lookback: float,
    window: float,
    until_after: float,
) -> None:
    """§9.2: t_start ≤ t_fix ≤ t_end, t_start ≥ t_fix − look-back, both integers; ≥ k distinct users
    had a fix inside during [t_start, t_end] and that number is k_achieved; t_end is the earliest."""
    fixes = [(f"u{u}", t, _coord(y, ny), _coord(x, nx)) for u, t, x, nx, y, ny in raw]
    until = t_fix + until_after
    history = ArrayFixHistory(
        [f[0] for f in fixes], [f[1] for f in fixes], [f[2] for f in fixes], [f[3] for f in fixes]
    )
    w = temporal_window(history, CELL, t_fix, k, lookback_s=lookback, window_s=window, until=until)
    assert isinstance(w.t_start, int)
    assert t_fix - lookback <= w.t_start <= t_fix
    known = [f for f in fixes if f[1] <= until]
    if w.t_end is None:
        seen = visitors(known, CELL, w.t_start, until)
        assert len(seen) < k
        assert w.k_achieved == len(seen)
        return
    assert isinstance(w.t_end, int)
    assert t_fix <= w.t_end
    seen = visitors(known, CELL, w.t_start, w.t_end)
    assert w.k_achieved == len(seen) >= k
    assert w.t_end == math.ceil(t_fix) or len(visitors(known, CELL, w.t_start, w.t_end - 1)) < k
    # The interval ends at the latest at the k-th visit (forwarding waits for the clock to get there).
    assert w.t_end - 1 < max(t_fix, max(f[1] for f in known))


class SupersetHistory:
    """A store that filters nothing (like an inclusive float filter, only more so)."""

    def __init__(self, fixes: Fixes) -> None:
        self.fixes = fixes
        self.calls: list[tuple[BBox, float, float]] = []

    def fixes_in(self, bbox: BBox, t_from: float, t_to: float) -> Fixes:
        self.calls.append((bbox, t_from, t_to))
        return self.fixes


@settings(max_examples=100, deadline=None)
@given(raw=st.lists(FIX, max_size=40), k=st.integers(1, 6), until_after=st.floats(0, 400))
def test_history_may_return_a_superset(
    raw: list[tuple[int, float, int, str, int, str]], k: int, until_after: float
) -> None:
    users = [f"u{u}" for u, *_ in raw]
    t = [r[1] for r in raw]
    lat = [_coord(r[4], r[5]) for r in raw]
    lon = [_coord(r[2], r[3]) for r in raw]
    exact = ArrayFixHistory(users, t, lat, lon)
    loose = SupersetHistory(Fixes.of(np.array(users, dtype=object), t, lat, lon))
    assert isinstance(exact, FixHistory) and isinstance(loose, FixHistory)
    until = 1_000_000.0 + until_after
    a = temporal_window(exact, CELL, 1_000_000.0, k, until=until)
    b = temporal_window(loose, CELL, 1_000_000.0, k, until=until)
    assert a == b
    assert loose.calls == [(CELL, a.t_start, until)]


def test_strictness_on_the_published_edges() -> None:
    """Fixes on a published edge never count; just inside they do (exact keys, no float slack)."""
    upper = 16e-6  # a float on or just above the published upper edge (16 µdeg)
    if coordinate_key(upper) < 32:
        upper = math.nextafter(upper, math.inf)
    lower = -1e-6  # a float on or just below the published lower edge (−1 µdeg)
    if coordinate_key(lower) > -2:
        lower = math.nextafter(lower, -math.inf)
    pts = {
        "on_upper": (5e-6, upper),
        "on_lower": (5e-6, lower),
        "origin": (0.0, 0.0),
        "just_inside": (5e-6, math.nextafter(lower, math.inf) if coordinate_key(lower) == -3 else -0.5e-6),
    }
    history = ArrayFixHistory(list(pts), [10.0] * 4, [p[0] for p in pts.values()], [p[1] for p in pts.values()])
    expected = {u for u, (la, lo) in pts.items() if strictly_inside(CELL, la, lo)}
    assert expected == {"origin", "just_inside"}
    assert temporal_window(history, CELL, 10.0, 1).k_achieved == len(expected)


# -- (4) together ----------------------------------------------------------------------------------


def test_temporal_cloak() -> None:
    history = ArrayFixHistory(["a", "b", "c"], [1000.0, 1010.0, 1030.0], [39.9, 39.9001, 39.9002], [116.4] * 3)
    profile = PrivacyProfile(k=3, max_area_m2=4e6, min_area_m2=0.0)
    region = temporal_cloak(history, 39.9, 116.4, 1000.0, profile)
    assert isinstance(region, Region)
    cell = temporal_cell(39.9, 116.4, max_area_m2=4e6)
    assert isinstance(cell, TemporalCell)
    assert (region.bbox, region.area_m2, region.algorithm) == (cell.bbox, cell.area_m2, "temporal")
    assert (region.t_start, region.t_end, region.k_achieved) == (960, 1030, 3)
    assert temporal_cloak(history, 39.9, 116.4, 1000.0, PrivacyProfile(k=4, min_area_m2=0.0)) is None  # held
    unsupported = temporal_cloak(history, 39.9, 116.4, 1000.0, PrivacyProfile(k=2, l=2, min_area_m2=0.0))
    assert isinstance(unsupported, Refusal) and unsupported.reason == ReasonCode.UNSUPPORTED
    small = temporal_cloak(history, 39.9, 116.4, 1000.0, PrivacyProfile(k=2, max_area_m2=1e-4, min_area_m2=0.0))
    assert isinstance(small, Refusal) and small.reason == ReasonCode.AREA_EXCEEDED
    with pytest.raises(ValueError, match="k"):
        temporal_window(history, cell.bbox, 1000.0, 0)


@pytest.mark.parametrize("max_area", [1.0e4, 4.0e6])
def test_querier_on_a_cell_edge_is_strictly_inside_its_cell(max_area: float) -> None:
    """A querier sent as the text of a cell's upper edge (a whole micro-degree) belongs to the cell
    above it, whose published lower edge is one micro-degree below: strictly inside as a client reads
    it. With the old keys, a float whose binary value is below that micro-degree stayed in the lower
    cell, whose published upper edge then equalled the querier's coordinate."""
    from fractions import Fraction

    below = 0
    for lat0, lon0 in [(39.9, 116.4), (39.91, 116.41), (-33.87, 151.21), (40.7, -74.0), (51.5, -0.12)]:
        cell = temporal_cell(lat0, lon0, max_area_m2=max_area)
        assert isinstance(cell, TemporalCell)
        b = cell.bbox
        for lat, lon in [
            (lat0, b.max_lon_udeg / 1e6),
            (b.max_lat_udeg / 1e6, lon0),
            (b.max_lat_udeg / 1e6, b.max_lon_udeg / 1e6),
        ]:
            below += Fraction(lon) < Fraction(b.max_lon_udeg, 10**6) or Fraction(lat) < Fraction(b.max_lat_udeg, 10**6)
            there = temporal_cell(lat, lon, max_area_m2=max_area)
            assert isinstance(there, TemporalCell)
            assert strictly_inside(there.bbox, lat, lon), (there.bbox, lat, lon)
            e = there.bbox.to_geojson()
            assert lon not in (e[0], e[2]) and lat not in (e[1], e[3])
    assert below > 0  # some of these floats lie below their decimal: the case the old keys got wrong
