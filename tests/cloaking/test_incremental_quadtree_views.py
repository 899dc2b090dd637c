"""Incremental views for the quadtree cloakers (docs/views.md "casper and interval"): counts patched
from the previous view's sorted columns must cloak every user exactly as a view built from nothing.

The same property as ``test_incremental_views.py`` (its scenarios, its own record of the users and
its reference view, with no curve and no carried state), run with ``casper`` and ``interval``, with
users strictly between micro-degrees too (the edge strips' counts are patched as well).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import Cloaker
from kcloak.cloaking.cloakers.casper import CasperCloak
from kcloak.cloaking.cloakers.interval import IntervalCloak, QuadtreeCounts
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.profile import PrivacyProfile
from tests.cloaking.test_incremental_views import SLOW_OK, T0, Scenario, outcome, run_steps, scenarios

CLOAKERS: dict[str, Callable[[], Cloaker]] = {
    "casper": CasperCloak,
    "casper-vertical": lambda: CasperCloak(tie="vertical"),
    "casper-adaptive": lambda: CasperCloak(variant="adaptive"),
    "interval": IntervalCloak,
    "interval-reciprocal": lambda: IntervalCloak(reciprocal_partition=True),
}
CARRIED = [0]  # views whose counts were patched during the property's examples


ANCHOR_UDEG = (39_911_424, 116_391_936)  # multiples of 2^16 µdeg near the scenarios' 39.9 N, 116.4 E


@st.composite
def scenarios_off_grid(draw: Any) -> Scenario:
    """The shared scenarios, or (half the time) the same on a grid of ``2^b`` micro-degrees from a
    point where cells of many levels have their lower edge, with some coordinates half a
    micro-degree below their grid value (sent with 7 decimals). Strictly between two micro-degrees,
    such a user lies in the edge strip of the cells whose lower edge is its grid value, where a
    published box counts it (§2.2), so the strips' counts are exercised."""
    decimals, first, steps = draw(scenarios())
    if not draw(st.booleans()):
        return decimals, first, steps
    spacing = 1 << draw(st.integers(0, 6))
    scale = 10 ** abs(decimals)

    def remap(x: float, axis: int) -> float:
        i = round((x - (39.9, 116.4)[axis]) * scale)
        udeg = ANCHOR_UDEG[axis] + i * spacing - draw(st.sampled_from([0.0, 0.5]))
        return float(f"{udeg / 1e6:.7f}")

    first = [(u, remap(lat, 0), remap(lon, 1), p) for u, lat, lon, p in first]
    steps = [
        [(op[0], op[1], remap(op[2], 0), remap(op[3], 1), *op[4:]) if op[0] in ("move", "arrive") else op for op in ops]
        for ops in steps
    ]
    return decimals, first, steps


def patched(cloaker: Any, view: IndexView) -> int:
    """1 when the view's counts were patched from the previous view's (read after the view was used)."""
    return int(cloaker.carried_over(view))


def with_patch_fraction(fraction: int) -> Iterator[None]:
    """``0``: patch whatever the change and never rebuild the strip hints; larger: sooner from scratch."""
    before = QuadtreeCounts.PATCH_FRACTION
    QuadtreeCounts.PATCH_FRACTION = fraction
    try:
        yield
    finally:
        QuadtreeCounts.PATCH_FRACTION = before


def check(scenario: Scenario, fraction: int) -> None:
    _, first, steps = scenario
    for make in CLOAKERS.values():
        for _ in with_patch_fraction(fraction):
            CARRIED[0] += run_steps(first, steps, make, patched)


@settings(max_examples=20, deadline=None, suppress_health_check=SLOW_OK)
@given(scenarios_off_grid(), st.sampled_from([0, 0, 1, 8]))
def test_incremental_quadtree_view_cloaks_as_a_view_built_from_nothing(scenario: Scenario, fraction: int) -> None:
    check(scenario, fraction)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=SLOW_OK)
@given(scenarios_off_grid(), st.sampled_from([0, 0, 1, 8]))
def test_incremental_quadtree_view_cloaks_as_a_view_built_from_nothing_many(scenario: Scenario, fraction: int) -> None:
    check(scenario, fraction)


def small_index() -> PositionIndex:
    index = PositionIndex(stale_after_s=60.0)
    for i in range(40):
        index.update(f"u{i}", 39.9 + i * 1e-4, 116.4 + (i % 7) * 1e-4, T0)
    return index


def test_counts_were_patched() -> None:
    """Runs after the property above (file order): over its examples, counts were patched."""
    total = CARRIED[0]
    if total == 0:  # run alone: make one patched view here
        index = small_index()
        live = CasperCloak()
        live.counts(index.snapshot(T0, epoch=1, seed=1))
        index.update("u3", 39.95, 116.45, T0 + 1)
        view = index.snapshot(T0 + 1, epoch=2, seed=2)
        live.counts(view)
        total = patched(live, view)
    assert total > 0


def test_a_view_that_does_not_directly_follow_is_built_from_scratch() -> None:
    """Counts are carried only to the view of the next snapshot: a snapshot in between (nobody cloaked
    on it) or a view from another index gets counts sorted from nothing, with the same answers."""
    index = small_index()
    live = IntervalCloak()
    live.counts(index.snapshot(T0, epoch=1, seed=1))
    index.update("u3", 39.95, 116.45, T0 + 1)
    index.snapshot(T0 + 1)
    index.update("u4", 39.96, 116.45, T0 + 1)
    view = index.snapshot(T0 + 1, epoch=3, seed=3)
    assert not live.counts(view).carried
    other = small_index()
    assert not live.counts(other.snapshot(T0, epoch=4, seed=4)).carried
    index.update("u5", 39.97, 116.45, T0 + 1)
    assert live.counts(index.snapshot(T0 + 1, epoch=5, seed=5)).carried is False  # its carry was the other index's


def test_a_cloaker_that_carries_counts_still_pickles() -> None:
    """A cloaker is configuration: pickled (or copied) after use, it leaves the carried counts behind
    and starts the next view from scratch, answering the same."""
    index = small_index()
    live = CasperCloak(tie="vertical")
    view = index.snapshot(T0, epoch=1, seed=1)
    live.counts(view)
    index.update("u3", 39.95, 116.45, T0 + 1)
    clone = pickle.loads(pickle.dumps(live))
    assert clone.tie == "vertical"
    nxt = index.snapshot(T0 + 1, epoch=2, seed=2)
    fresh = IndexView.from_points(nxt.user_ids, nxt.lat, nxt.lon, now=nxt.now)
    for row in range(len(nxt)):
        got = clone.cloak(nxt, row, PrivacyProfile(k=3))
        want = CasperCloak(tie="vertical").cloak(fresh, row, PrivacyProfile(k=3))
        assert outcome(got, nxt.user_ids) == outcome(want, fresh.user_ids)
    assert not clone.carried_over(nxt)
