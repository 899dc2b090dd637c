"""PrivacyGrid's top-down search skips runs of empty strips and unchanged start radii (CONCEPTS §4.6).

The regions must be exactly those of the plain greedy that drops one row or column per step and
shrinks the start box one radius at a time: :class:`OneStripAtATime` keeps that greedy as the
reference, and both cloak the scenarios of the property tests (tests/cloaking/test_properties.py)
with places, in every mode and both shrink criteria. Near the poles a cell is centimetres wide and
the start box spans the world, so there the reference takes seconds per query: those populations
run under the ``slow`` marker, the rest in the default run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers.base import CloakResult, Region
from kcloak.cloaking.cloakers.privacygrid import I64, PrivacyGridCloak, Rect, _Track, _UserGrid
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import EARTH_RADIUS_M
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile
from tests.cloaking.test_properties import GENERATORS, _places_layer, _random_places, _view, scenarios

PARAMS: list[dict[str, Any]] = [
    {"mode": "top_down", "fallback": False},
    {"mode": "top_down", "fallback": False, "shrink_criterion": "fewest_users_per_cell"},
    {"mode": "hybrid"},
]


class OneStripAtATime(PrivacyGridCloak):
    """The top-down search as first written: one radius, then one strip, per step."""

    def _start_box(self, g: _UserGrid, qx: int, qy: int, lat: float, amax: float) -> Rect | None:
        h_m = EARTH_RADIUS_M * math.radians(self._cell_udeg / 1e6)
        w_m = max(h_m * math.cos(math.radians(lat)), 1e-9)
        side = math.sqrt(amax)
        rx = max(0, int((side / w_m - 1) // 2))
        ry = max(0, int((side / h_m - 1) // 2))
        bx0, by0, bx1, by1 = g.bounds
        while True:
            rect = (max(qx - rx, bx0), max(qy - ry, by0), min(qx + rx, bx1), min(qy + ry, by1))
            if self._area(*rect) <= amax:
                return rect
            if rx == 0 and ry == 0:
                return None
            if ry == 0 or (rx > 0 and rx * w_m >= ry * h_m):
                rx -= 1
            else:
                ry -= 1

    def _top_down(self, g: _UserGrid, qx: int, qy: int, lat: float, prof: PrivacyProfile, track: _Track) -> Rect | None:
        k, l_min, amin = prof.k, prof.l, prof.min_area_m2
        need_l = l_min > 1
        start = self._start_box(g, qx, qy, lat, prof.max_area_m2)
        if start is None:
            return None
        x0, y0, x1, y1 = start
        count, area, pg = g.count, self._area, self._pg
        users = count(x0, y0, x1, y1)
        if users < k:
            return None
        track.k_fit = True
        cats: I64 | None = pg.rect(x0, y0, x1, y1) if need_l else None
        ncat = int(np.count_nonzero(cats)) if cats is not None else 0
        if need_l and ncat < l_min:
            return None
        track.kl_fit = True
        per_cell = self.shrink_per_cell
        while True:
            best = -1
            b_du = b_den = b_side = b_ncat = 0
            b_strip: I64 | None = None
            for d in range(4):
                if d == 0:
                    if y1 <= qy:
                        continue
                    nb = (x0, y0, x1, y1 - 1)
                    sx0, sy0, sx1, sy1 = x0, y1, x1, y1
                elif d == 1:
                    if x1 <= qx:
                        continue
                    nb = (x0, y0, x1 - 1, y1)
                    sx0, sy0, sx1, sy1 = x1, y0, x1, y1
                elif d == 2:
                    if y0 >= qy:
                        continue
                    nb = (x0, y0 + 1, x1, y1)
                    sx0, sy0, sx1, sy1 = x0, y0, x1, y0
                else:
                    if x0 >= qx:
                        continue
                    nb = (x0 + 1, y0, x1, y1)
                    sx0, sy0, sx1, sy1 = x0, y0, x0, y1
                du = count(sx0, sy0, sx1, sy1)
                if users - du < k:
                    continue
                strip: I64 | None = None
                new_ncat = ncat
                if need_l:
                    assert cats is not None
                    strip = pg.strip(pg.rows, sy0, sx0, sx1) if d % 2 == 0 else pg.strip(pg.cols, sx0, sy0, sy1)
                    if strip is not None:
                        new_ncat = ncat - int(np.count_nonzero((strip > 0) & (cats == strip)))
                        if new_ncat < l_min:
                            continue
                if amin > 0 and area(*nb) < amin:
                    continue
                den = (sx1 - sx0 + 1) * (sy1 - sy0 + 1) if per_cell else 1
                side = max(nb[2] - nb[0], nb[3] - nb[1])
                if best < 0:
                    better = True
                else:
                    lhs, rhs = du * b_den, b_du * den
                    better = lhs < rhs or (lhs == rhs and side < b_side)
                if better:
                    best, b_du, b_den, b_side, b_strip, b_ncat = d, du, den, side, strip, new_ncat
            if best < 0:
                return x0, y0, x1, y1
            if best == 0:
                y1 -= 1
            elif best == 1:
                x1 -= 1
            elif best == 2:
                y0 += 1
            else:
                x0 += 1
            users -= b_du
            if b_strip is not None and cats is not None:
                cats = cats - b_strip
                ncat = b_ncat


def _outcome(res: CloakResult) -> tuple[Any, ...]:
    if isinstance(res, Region):
        return (res.bbox, res.k_achieved, res.area_m2, res.l_achieved)
    return ("refused", str(res.reason))


def _same_as_the_reference(case: Any, m: int, places_seed: int) -> None:
    pop, stored, requests, seed = case
    layer = _places_layer(_random_places(np.random.default_rng(places_seed), pop, m))
    ids = [f"u{i}" for i in range(len(pop.lat))]
    for params in PARAMS:
        fast, plain = PrivacyGridCloak(places=layer, **params), OneStripAtATime(places=layer, **params)
        fast_view, plain_view = _view(ids, pop, stored, seed), _view(ids, pop, stored, seed)
        for q, override in requests:
            eff = stored[q].tightened(override)
            got, want = _outcome(fast.cloak(fast_view, q, eff)), _outcome(plain.cloak(plain_view, q, eff))
            assert got == want, f"{pop.kind}, {params}, {ids[q]}, {eff}"


CELL_DEG = 2048e-6  # a level-18 cell


@st.composite
def sparse_boxes(draw: st.DrawFn) -> tuple[IndexView, list[tuple[int, PrivacyProfile]], PlacesLayer]:
    """A few users and places on a small patch of cells inside a much larger start box: long runs
    of empty strips on every side, ties between the sides, and A_min, k or l ending the runs."""
    lat0 = draw(st.sampled_from([0.0, 39.9, 60.0, 84.0]))
    lon0 = draw(st.sampled_from([0.0, 116.4, -179.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n, w, h = draw(st.integers(1, 25)), draw(st.integers(1, 30)), draw(st.integers(1, 30))
    lat = lat0 + rng.integers(0, h, n) * CELL_DEG + rng.uniform(0.1, 0.9, n) * CELL_DEG
    lon = lon0 + rng.integers(0, w, n) * CELL_DEG + rng.uniform(0.1, 0.9, n) * CELL_DEG
    m = draw(st.integers(0, 30))
    places = PlacesLayer(
        lat=lat0 + rng.uniform(-5, h + 5, m) * CELL_DEG,
        lon=lon0 + rng.uniform(-5, w + 5, m) * CELL_DEG,
        category_code=rng.integers(0, 4, m),
        category_names=("a", "b", "c", "d"),
    )
    cell_m2 = (228.0 * CELL_DEG / 2048e-6) ** 2 * max(math.cos(math.radians(lat0)), 0.05)
    max_area = draw(st.integers(3, 150)) ** 2 * cell_m2
    requests = []
    for q in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4, unique=True)):
        min_area = max_area * draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2, 0.5]))
        k, l_min = draw(st.integers(1, n)), draw(st.integers(1, 4))
        requests.append((q, PrivacyProfile(k=k, l=l_min, min_area_m2=min_area, max_area_m2=max_area)))
    view = IndexView.from_points([f"u{i}" for i in range(n)], lat, lon)
    return view, requests, places


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=sparse_boxes())
def test_top_down_equals_the_one_strip_greedy_around_sparse_users(case: Any) -> None:
    view, requests, places = case
    for params in PARAMS[:2]:
        fast, plain = PrivacyGridCloak(places=places, **params), OneStripAtATime(places=places, **params)
        for q, profile in requests:
            got, want = _outcome(fast.cloak(view, q, profile)), _outcome(plain.cloak(view, q, profile))
            assert got == want, f"{params}, u{q}, {profile}"


SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
AWAY_FROM_THE_POLES = [kind for kind in sorted(GENERATORS) if kind != "world_edges"]


@SETTINGS
@given(case=scenarios(l_max=4, kinds=AWAY_FROM_THE_POLES), m=st.integers(0, 60), places_seed=st.integers(0, 2**31))
def test_top_down_equals_the_one_strip_greedy(case: Any, m: int, places_seed: int) -> None:
    _same_as_the_reference(case, m, places_seed)


@pytest.mark.slow
@SETTINGS
@given(case=scenarios(l_max=4, kinds=["world_edges"]), m=st.integers(0, 60), places_seed=st.integers(0, 2**31))
def test_top_down_equals_the_one_strip_greedy_at_the_world_edges(case: Any, m: int, places_seed: int) -> None:
    _same_as_the_reference(case, m, places_seed)
