"""The hot paths' region constructors build the same objects as the dataclass constructors.

``trusted_bbox`` and ``new_region`` write the slots directly (no per-field ``object.__setattr__``,
no edge validation); every field, the equality and hash of the box, the repr and the immutability
must be those of ``BBox(...)`` and ``Region(...)``. Boxes are drawn on 4- to 6-decimal grids, on
quadtree cell edges (multiples of 2^j micro-degrees from the grid origin) and at the world edge.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers.base import Region, new_region, trusted_bbox
from kcloak.core.geometry import BBox

LON = 180_000_000
LAT = 90_000_000
ORIGIN = 1 << 28  # micro-degree offset of the level-29 grid


@st.composite
def edges(draw: st.DrawFn, world: int) -> int:
    how = draw(st.sampled_from(("decimals", "cell_edge", "world_edge", "any")))
    if how == "decimals":  # a 4-, 5- or 6-decimal coordinate
        step = draw(st.sampled_from((1, 10, 100)))  # 6, 5 or 4 decimals
        n: int = draw(st.integers(-world // step, world // step))
        return n * step
    if how == "cell_edge":  # a lower cell edge of some level, or one micro-degree below it
        j = draw(st.integers(0, 28))
        v = draw(st.integers(-((world + ORIGIN) >> j), (world - ORIGIN) >> j)) * (1 << j) - ORIGIN
        return max(-world, min(world, v - draw(st.integers(0, 1))))
    if how == "world_edge":
        edge: int = draw(st.sampled_from((-world, world)))
        return edge
    anywhere: int = draw(st.integers(-world, world))
    return anywhere


@st.composite
def boxes(draw: st.DrawFn) -> tuple[int, int, int, int]:
    lon = sorted((draw(edges(LON)), draw(edges(LON))))
    lat = sorted((draw(edges(LAT)), draw(edges(LAT))))
    return lon[0], lat[0], lon[1], lat[1]


@settings(max_examples=300, deadline=None)
@given(box=boxes())
def test_trusted_bbox_is_the_validated_box(box: tuple[int, int, int, int]) -> None:
    ref = BBox(*box)
    fast = trusted_bbox(*box)
    assert type(fast) is BBox
    assert fast == ref and hash(fast) == hash(ref) and repr(fast) == repr(ref)
    assert [getattr(fast, f.name) for f in dataclasses.fields(BBox)] == list(box)
    assert fast.area_m2 == ref.area_m2 and fast.key_bounds() == ref.key_bounds()
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.min_lon_udeg = 0  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(
    box=boxes(),
    k=st.integers(0, 10**6),
    area=st.floats(0, 1e14, allow_nan=False),
    algorithm=st.sampled_from(("interval", "casper")),
    epoch=st.integers(0, 2**40),
    members=st.lists(st.integers(0, 10**6), max_size=20),
)
def test_new_region_is_the_dataclass_region(
    box: tuple[int, int, int, int], k: int, area: float, algorithm: str, epoch: int, members: list[int]
) -> None:
    anon = np.asarray(members, np.int64)
    ref = Region(BBox(*box), k, area, algorithm, epoch, anon)
    fast = new_region(trusted_bbox(*box), k, area, algorithm, epoch, anon)
    assert type(fast) is Region
    for f in dataclasses.fields(Region):
        a, b = getattr(fast, f.name), getattr(ref, f.name)
        if f.name == "anon_set":
            assert a is anon and b is anon
        else:
            assert type(a) is type(b) and a == b, f.name
    assert repr(fast) == repr(ref)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.k_achieved = 0  # type: ignore[misc]
