"""``cloak_batch`` of the quadtree cloakers equals ``cloak`` request by request, on long streams.

The batch paths put the requests in code order and compute each published rectangle once per run
of requests it answers, so this property feeds them what that depends on: streams longer than the
population with the same querier many times (equal and tightened profiles), requests in random
order, and populations on 4-, 5- and 6-decimal grids, with co-located users and users on and one
micro-degree off quadtree cell edges (the generators of ``test_properties``). Each answer is read
as a client reads it (refusal reason, or bbox, k_achieved and area), the batch on a fresh view so
that nothing the single calls memoized can leak into it. Requests the batch names by the same
group must have been given the same box.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers.base import STATUS_OK
from kcloak.core.profile import PrivacyProfile, ProfileArrays
from tests.cloaking.test_properties import (
    GENERATORS,
    PROPERTY_SETTINGS,
    Population,
    _view,
    compare_batch,
    make_cloaker,
    overrides,
    stored_profiles,
)

CONFIGS = [
    ("interval", {}),
    ("interval", {"depth_max": 14}),
    ("interval", {"reciprocal_partition": True}),
    ("casper", {}),
    ("casper", {"tie": "vertical"}),
    ("casper", {"variant": "adaptive"}),
    ("casper", {"depth_max": 16}),
]

GRID_KINDS = ("decimal_grid", "grid_udeg", "grid_exact", "clustered", "one_point")


@st.composite
def streams(draw: st.DrawFn) -> tuple[Population, list[PrivacyProfile], list[tuple[int, dict[str, Any] | None]], int]:
    kind = draw(st.sampled_from(GRID_KINDS))
    n = draw(st.integers(1, 150))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lat, lon = GENERATORS[kind](rng, n)
    pop = Population(kind, np.asarray(lat, np.float64), np.asarray(lon, np.float64))
    stored = draw(stored_profiles(n))
    # Queriers drawn with replacement from a few of the users, so each one asks several times.
    pool = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=min(n, 12), unique=True))
    queriers = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3 * n + 10))
    requests = [(q, draw(st.one_of(st.none(), overrides(stored[q])))) for q in queriers]
    return pop, stored, requests, draw(st.integers(0, 2**31))


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=[f"{n}-{p}" for n, p in CONFIGS])
@settings(PROPERTY_SETTINGS, max_examples=30)
@given(case=streams())
def test_batch_equals_single_on_long_streams(name: str, params: dict[str, Any], case: Any) -> None:
    _check_stream(name, params, case, None)


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=[f"{n}-{p}" for n, p in CONFIGS])
@settings(PROPERTY_SETTINGS, max_examples=15)
@given(case=streams(), size=st.integers(1, 9))
def test_batch_in_small_slices_equals_single(name: str, params: dict[str, Any], case: Any, size: int) -> None:
    """The batch works through the requests in slices of code order (4,096 by default, more than
    these streams hold); slices of 1 to 9 requests put slice edges inside runs of equal answers."""
    _check_stream(name, params, case, size)


def _check_stream(name: str, params: dict[str, Any], case: Any, batch_slice: int | None) -> None:
    pop, stored, requests, seed = case
    ids = [f"u{i}" for i in range(len(pop.lat))]
    effective = [stored[q].tightened(ov) for q, ov in requests]
    cloaker = make_cloaker(name, **params)
    view = _view(ids, pop, stored, seed)
    singles = [cloaker.cloak(view, q, eff) for (q, _), eff in zip(requests, effective, strict=True)]
    rows = np.asarray([q for q, _ in requests], dtype=np.int64)
    batcher = make_cloaker(name, **params)
    if batch_slice is not None:
        batcher.batch_slice = batch_slice
    batch = batcher.cloak_batch(_view(ids, pop, stored, seed), rows, ProfileArrays.from_profiles(effective))
    failures = compare_batch(batch, singles, [ids[q] for q, _ in requests])
    assert not failures, "\n".join(map(str, failures[:10]))
    box_of_group: dict[int, tuple[int, ...]] = {}
    for i in np.flatnonzero(batch.status == STATUS_OK):
        g = int(batch.group[i])
        if g >= 0:
            box = tuple(int(v) for v in batch.bbox[i])
            assert box_of_group.setdefault(g, box) == box, f"group {g}: two boxes"
