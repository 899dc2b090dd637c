"""Hilbert Cloak (CONCEPTS §4.4): curve, personalized buckets, reciprocity, super-buckets, batch."""

from __future__ import annotations

import itertools
from collections import defaultdict
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import get_cloaker
from kcloak.cloaking.cloakers.base import BatchResult, Refusal, Region
from kcloak.cloaking.cloakers.hilbert import (
    HilbertCloak,
    bbox_areas_m2,
    bboxes_around_keys,
    cover_counts,
    group_extents,
    hilbert_index,
    hilbert_indices,
    hilbert_sort,
    partition_buckets,
    super_bucket_levels,
    tie_keys,
)
from kcloak.cloaking.grid import GRID_BITS, GRID_OFFSET
from kcloak.cloaking.index import IndexView, hash_user
from kcloak.core.geometry import BBox, bbox_around_keys, coordinate_keys
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

WIDE = 2.5e9  # largest max_area_m2: refusals then come from the buckets only


def _points(ids: Any, *args: Any, **kw: Any) -> IndexView:
    """A view whose users' stored max_area_m2 is WIDE and min_area_m2 0 unless given (buckets are then
    never refused for the one nor grown for the other: these tests are about the buckets)."""
    ids = list(ids)
    kw.setdefault("max_area_m2", [WIDE] * len(ids))
    kw.setdefault("min_area_m2", [0.0] * len(ids))
    return IndexView.from_points(ids, *args, **kw)


# -- the curve -------------------------------------------------------------------------------

ORDER2_TABLE = {  # §4.4, n = 4, row y = 3 on top
    3: [5, 6, 9, 10],
    2: [4, 7, 8, 11],
    1: [3, 2, 13, 12],
    0: [0, 1, 14, 15],
}


def test_hilbert_order2() -> None:
    for y, row in ORDER2_TABLE.items():
        for x, expected in enumerate(row):
            assert hilbert_index(4, x, y) == expected
    xs, ys = np.meshgrid(np.arange(4), np.arange(4))
    got = hilbert_indices(xs.ravel(), ys.ravel(), order=2).reshape(4, 4)
    assert got.tolist() == [ORDER2_TABLE[y] for y in range(4)]


@pytest.mark.parametrize("order", [1, 3, 5])
def test_consecutive_indices_are_neighbours(order: int) -> None:
    n = 1 << order
    xs, ys = (a.ravel() for a in np.meshgrid(np.arange(n), np.arange(n)))
    h = hilbert_indices(xs, ys, order=order)
    assert sorted(h.tolist()) == list(range(n * n))
    path = np.argsort(h)
    steps = np.abs(np.diff(xs[path])) + np.abs(np.diff(ys[path]))
    assert (steps == 1).all()


@given(st.lists(st.tuples(st.integers(0, 2**29 - 1), st.integers(0, 2**29 - 1)), min_size=1, max_size=40))
def test_vectorized_index_matches_scalar(cells: list[tuple[int, int]]) -> None:
    xs = np.array([c[0] for c in cells])
    ys = np.array([c[1] for c in cells])
    assert hilbert_indices(xs, ys).tolist() == [hilbert_index(2**29, x, y) for x, y in cells]
    for order in (7, 20):
        shift = 29 - order
        got = hilbert_indices(xs >> shift, ys >> shift, order=order).tolist()
        assert got == [hilbert_index(1 << order, x >> shift, y >> shift) for x, y in cells]


def test_vectorized_index_across_chunks() -> None:
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 2**29, 70_000), rng.integers(0, 2**29, 70_000)
    h = hilbert_indices(x, y)
    for i in [0, 1, 32_767, 32_768, 32_769, 65_535, 65_536, 69_999, *rng.integers(0, 70_000, 50).tolist()]:
        assert h[i] == hilbert_index(2**29, int(x[i]), int(y[i]))


def test_sort_breaks_ties_by_salted_hash_not_row_order() -> None:
    hv = np.array([5, 3, 5, 5, 1, 3], np.int64)
    tie = np.array([9, 2, 1, 7, 0, 1], np.uint64)
    order = hilbert_sort(hv, tie)
    assert order.tolist() == [4, 5, 1, 2, 3, 0]


# -- the personalized partition ----------------------------------------------------------------


def _reference_partition(ks: list[int]) -> list[int]:
    """§4.4 pseudocode verbatim, returning bucket bounds ([0] when nobody is placed)."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    for i in range(len(ks)):
        cur.append(i)
        if len(cur) >= max(ks[w] for w in cur):
            buckets.append(cur)
            cur = []
    while cur:
        if not buckets:
            return [0]
        cur = buckets.pop() + cur
        if len(cur) >= max(ks[w] for w in cur):
            buckets.append(cur)
            cur = []
    return [0] + [b[-1] + 1 for b in buckets]


@given(st.lists(st.sampled_from([1, 2, 3, 4, 5, 8, 13]), min_size=0, max_size=80))
def test_partition_matches_pseudocode(ks: list[int]) -> None:
    assert partition_buckets(ks).tolist() == _reference_partition(ks)


def test_partition_uniform_k_gives_kalnis_buckets() -> None:
    bounds = partition_buckets([4] * 11)
    assert bounds.tolist() == [0, 4, 11]  # buckets of k, the last one absorbs the rest (≤ 2k − 1)
    assert partition_buckets([4] * 3).tolist() == [0]


# §4.4 worked example: users of §4.2 on the n = 4 grid of 100 m cells.
EXAMPLE_XY = {
    "u1": (50, 50),
    "u2": (150, 60),
    "u3": (120, 160),
    "u4": (260, 40),
    "u5": (350, 350),
    "u6": (330, 380),
    "u7": (60, 250),
}
EXAMPLE_SETTINGS = [  # (stored k per user, expected buckets, expected MBRs in metres)
    (
        {},
        [["u1", "u2"], ["u3", "u7"], ["u5", "u6", "u4"]],
        [(50, 150, 50, 60), (60, 120, 160, 250), (260, 350, 40, 380)],
    ),
    (
        {"*": 3},
        [["u1", "u2", "u3"], ["u7", "u5", "u6", "u4"]],
        [(50, 150, 50, 160), (60, 350, 40, 380)],
    ),
    (
        {"u2": 3},
        [["u1", "u2", "u3"], ["u7", "u5"], ["u6", "u4"]],
        [(50, 150, 50, 160), (60, 350, 250, 350), (260, 330, 40, 380)],
    ),
]


def _example_k(spec: dict[str, int], user: str) -> int:
    return spec.get(user, spec.get("*", 2))


@pytest.mark.parametrize(("spec", "buckets", "mbrs"), EXAMPLE_SETTINGS)
def test_hilbert_buckets(spec: dict[str, int], buckets: list[list[str]], mbrs: list[tuple[int, ...]]) -> None:
    users = list(EXAMPLE_XY)
    hv = {u: hilbert_index(4, EXAMPLE_XY[u][0] // 100, EXAMPLE_XY[u][1] // 100) for u in users}
    assert [hv[u] for u in ["u1", "u2", "u3", "u7", "u5", "u6", "u4"]] == [0, 1, 2, 4, 10, 10, 14]
    ordered = sorted(users, key=lambda u: (hv[u], u))  # ties by user id, for the test only
    bounds = partition_buckets([_example_k(spec, u) for u in ordered])
    got = [ordered[a:b] for a, b in itertools.pairwise(bounds.tolist())]
    assert got == buckets
    x0, x1 = group_extents(np.array([EXAMPLE_XY[u][0] for u in ordered]), bounds)
    y0, y1 = group_extents(np.array([EXAMPLE_XY[u][1] for u in ordered]), bounds)
    assert list(zip(x0.tolist(), x1.tolist(), y0.tolist(), y1.tolist(), strict=True)) == mbrs


def _canonical_block(order: int, lon: float, lat: float) -> tuple[int, int]:
    """Lower-left micro-degrees of an aligned 4 × 4 block of order-``order`` cells near (lat, lon)
    whose curve visits its cells exactly as the n = 4 table (a quarter of all blocks do)."""
    shift = GRID_BITS - order
    cx = ((int(lon * 1e6) + GRID_OFFSET) >> shift) & ~3
    cy = ((int(lat * 1e6) + GRID_OFFSET) >> shift) & ~3
    want = np.array([ORDER2_TABLE[y][x] for y in range(4) for x in range(4)])
    ii, jj = np.arange(16) % 4, np.arange(16) // 4
    for dx in range(0, 64, 4):
        for dy in range(0, 64, 4):
            h = hilbert_indices(cx + dx + ii, cy + dy + jj, order=order)
            if (h - h.min() == want).all():
                return ((cx + dx) << shift) - GRID_OFFSET, ((cy + dy) << shift) - GRID_OFFSET
    raise AssertionError("no canonical block found")


@pytest.mark.parametrize(("spec", "buckets", "mbrs"), EXAMPLE_SETTINGS)
def test_hilbert_buckets_end_to_end(
    spec: dict[str, int], buckets: list[list[str]], mbrs: list[tuple[int, ...]]
) -> None:
    """The worked example through the cloaker: order 19 (1024 µdeg cells), 100 m ↦ 1020 µdeg."""
    lon0, lat0 = _canonical_block(19, 116.4, 39.9)
    users = list(EXAMPLE_XY)
    lon_udeg = {u: lon0 + EXAMPLE_XY[u][0] * 102 // 10 for u in users}
    lat_udeg = {u: lat0 + EXAMPLE_XY[u][1] * 102 // 10 for u in users}
    salt = np.array([hash_user(u) for u in users], np.uint64)
    # u5 and u6 share a cell: pick an epoch seed whose salted order puts u5 first, as the table does.
    seed = next(s for s in range(256) if tie_keys(salt, s)[4] < tie_keys(salt, s)[5])
    view = _points(
        users,
        [lat_udeg[u] / 1e6 for u in users],
        [lon_udeg[u] / 1e6 for u in users],
        k=[_example_k(spec, u) for u in users],
        seed=seed,
    )
    cloaker = HilbertCloak(order=19)
    for members, (x0, x1, y0, y1) in zip(buckets, mbrs, strict=True):
        rows = [view.row_of[u] for u in members]
        keys_lon, keys_lat = view.lon_key[rows], view.lat_key[rows]
        expected = bbox_around_keys(int(keys_lon.min()), int(keys_lat.min()), int(keys_lon.max()), int(keys_lat.max()))
        for u in members:
            region = cloaker.cloak(
                view, view.row_of[u], PrivacyProfile(k=_example_k(spec, u), max_area_m2=WIDE, min_area_m2=0.0)
            )
            assert isinstance(region, Region)
            assert region.bbox == expected
            assert sorted(view.user_ids[r] for r in region.anon_set) == sorted(members)
            assert region.k_achieved == _strict_count(view, region.bbox)
        # The published box is the metric MBR, one micro-degree (or less) outside on each side.
        assert abs(expected.min_lon_udeg - (lon0 + x0 * 10.2)) <= 2
        assert abs(expected.max_lon_udeg - (lon0 + x1 * 10.2)) <= 2
        assert abs(expected.min_lat_udeg - (lat0 + y0 * 10.2)) <= 2
        assert abs(expected.max_lat_udeg - (lat0 + y1 * 10.2)) <= 2


# -- helpers for brute-force checks --------------------------------------------------------------


def _strict_count(view: IndexView, bbox: BBox) -> int:
    """Users strictly inside ``bbox`` as a client counts (§2.2), by brute force: float64 edges and
    positions, and the exact decimals of their texts."""
    q = Decimal("1e-6")
    lo_lon, hi_lon = bbox.min_lon_udeg * q, bbox.max_lon_udeg * q
    lo_lat, hi_lat = bbox.min_lat_udeg * q, bbox.max_lat_udeg * q
    f = bbox.to_geojson()
    return sum(
        1
        for la, lo in zip(view.lat.tolist(), view.lon.tolist(), strict=True)
        if lo_lon < Decimal(repr(lo)) < hi_lon
        and lo_lat < Decimal(repr(la)) < hi_lat
        and f[0] < lo < f[2]
        and f[1] < la < f[3]
    )


def _stored(view: IndexView, row: int, **override: float) -> PrivacyProfile:
    stored = PrivacyProfile(k=int(view.k[row]), min_area_m2=float(view.min_area_m2[row]), max_area_m2=WIDE)
    return stored.tightened(override)


def _clustered(seed: int, n: int, ks: list[int], min_areas: list[float], *, spread: float = 0.002) -> IndexView:
    """A clustered population near Beijing, with co-located users (Hilbert ties) on purpose."""
    rng = np.random.default_rng(seed)
    centres = rng.normal([39.9, 116.4], 0.01, size=(3, 2))
    c = rng.integers(0, 3, n)
    lat = np.round(centres[c, 0] + rng.normal(0, spread, n), 5)
    lon = np.round(centres[c, 1] + rng.normal(0, spread, n), 5)
    return _points(
        [f"p{i:04d}" for i in range(n)],
        lat,
        lon,
        k=rng.choice(ks, n),
        min_area_m2=rng.choice(min_areas, n),
        seed=seed,
    )


def _assert_reciprocal(view: IndexView, cloaker: HilbertCloak) -> dict[BBox, list[int]]:
    """§1.5/§6.3 by brute force with stored profiles; returns region → candidate set C(R).

    Checks every answer (exact count, area, querier in its set), reciprocity (ii) (each member of
    an anonymizing set gets the very same set and region) and |C(R)| ≥ max stored k over C(R).
    """
    results = {row: cloaker.cloak(view, row, _stored(view, row)) for row in range(len(view))}
    produced: dict[BBox, list[int]] = defaultdict(list)
    for row, res in results.items():
        if not isinstance(res, Region):
            continue
        produced[res.bbox].append(row)
        members = res.anon_set.tolist()
        assert row in members
        assert res.k_achieved == _strict_count(view, res.bbox) >= max(int(view.k[r]) for r in members)
        assert res.area_m2 == res.bbox.area_m2 >= max(float(view.min_area_m2[r]) for r in members)
        for v in members:
            other = results[v]
            assert isinstance(other, Region)
            assert other.bbox == res.bbox and sorted(other.anon_set.tolist()) == sorted(members)
    for bbox, cands in produced.items():
        assert len(cands) >= max(int(view.k[r]) for r in cands), bbox
    return produced


# -- reciprocity, determinism ------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_reciprocity_brute_force(seed: int) -> None:
    view = _clustered(seed, 300, [1, 2, 3, 5, 8, 12], [0.0, 0.0, 5e4, 2e5])
    cloaker = HilbertCloak()
    produced = _assert_reciprocal(view, cloaker)
    state = cloaker.state(view)
    assert sum(len(c) for c in produced.values()) == len(view)  # everyone served: n ≥ every stored k
    assert (state.bbox != state.mbr).any()  # some buckets were grown to their stored A_min
    for b in range(state.n_buckets):
        members = state.bucket_members(b).tolist()
        regions = {cloaker.cloak(view, r, _stored(view, r)).bbox for r in members}  # type: ignore[union-attr]
        assert len(regions) == 1  # same bbox for every member
        (bbox,) = regions
        assert set(members) <= set(produced[bbox])
        assert len(members) >= max(int(view.k[r]) for r in members)
        assert _strict_count(view, bbox) >= max(int(view.k[r]) for r in members)
        assert bbox.area_m2 >= max(float(view.min_area_m2[r]) for r in members)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 2**32),
    st.integers(1, 70),
    st.lists(st.integers(1, 9), min_size=1, max_size=4),
)
def test_reciprocity_property(seed: int, n: int, ks: list[int]) -> None:
    view = _clustered(seed, n, ks, [0.0, 1e4], spread=0.0005)
    cloaker = HilbertCloak()
    served = 0
    produced: dict[BBox, list[int]] = defaultdict(list)
    for row in range(n):
        res = cloaker.cloak(view, row, _stored(view, row))
        if isinstance(res, Region):
            served += 1
            produced[res.bbox].append(row)
            assert res.k_achieved == _strict_count(view, res.bbox) >= int(view.k[row])
        else:  # nobody placed: k_unreachable only where fewer than the querier's k are present
            assert res.reason == (ReasonCode.K_UNREACHABLE if view.k[row] > n else ReasonCode.AREA_EXCEEDED)
    for cands in produced.values():
        assert len(cands) >= max(int(view.k[r]) for r in cands)
    # Nobody is placed exactly when the whole population is smaller than its largest stored k.
    assert served == (n if n >= int(view.k.max()) else 0)


def test_determinism_and_ties_independent_of_row_order() -> None:
    view = _clustered(7, 200, [2, 3, 5], [0.0], spread=0.00002)  # many co-located users
    perm = np.random.default_rng(0).permutation(len(view))
    shuffled = _points([view.user_ids[i] for i in perm], view.lat[perm], view.lon[perm], k=view.k[perm], seed=view.seed)
    hv = hilbert_indices(view.gx, view.gy)
    assert len(np.unique(hv)) < len(view)  # the test does exercise ties
    cloaker = HilbertCloak()
    first = {u: cloaker.cloak(view, r, _stored(view, r)) for u, r in view.row_of.items()}
    again = _points(view.user_ids, view.lat, view.lon, k=view.k, seed=view.seed)
    for u, r in again.row_of.items():
        res = HilbertCloak().cloak(again, r, _stored(again, r))
        assert isinstance(res, Region) and res.bbox == first[u].bbox  # type: ignore[union-attr]
    for u, r in shuffled.row_of.items():
        res = cloaker.cloak(shuffled, r, _stored(shuffled, r))
        assert isinstance(res, Region) and res.bbox == first[u].bbox  # type: ignore[union-attr]
    # A new epoch seed reorders ties, but the buckets stay valid.
    reseeded = _points(view.user_ids, view.lat, view.lon, k=view.k, seed=view.seed + 1)
    _assert_reciprocal(reseeded, cloaker)


# -- super-buckets -------------------------------------------------------------------------------


def test_super_bucket_levels() -> None:
    assert super_bucket_levels([3, 3, 3, 3], 6).tolist() == [1, 1, 1, 1]
    assert super_bucket_levels([3, 3, 3, 3], 3).tolist() == [-1, -1, -1, -1]
    assert super_bucket_levels([3, 3, 3, 3], 12).tolist() == [2, 2, 2, 2]
    assert super_bucket_levels([3, 3, 3, 3], 13).tolist() == [-2, -2, -2, -2]
    # A large bucket keeps its own region with the override, so it cannot vouch for a small one:
    # §4.4's "smallest j" would give bucket 0 the pair {0, 1} with only 3 candidates for k = 6.
    assert super_bucket_levels([3, 30], 6).tolist() == [-2, -1]
    assert super_bucket_levels([3, 30, 3, 3], 6).tolist() == [2, -1, 2, 2]
    assert super_bucket_levels([2, 2, 2, 2, 5, 5, 5, 5], 4).tolist() == [1, 1, 1, 1, -1, -1, -1, -1]
    # One sparse block keeps its parent whole (the price of alignment): bucket 4 pulls in 0–3.
    assert super_bucket_levels([3, 3, 4, 2, 3], 6).tolist() == [3, 3, 3, 3, 3]
    assert super_bucket_levels([5, 2, 2, 5, 5, 5, 1], 4).tolist() == [-1, 3, 3, -1, -1, -1, 3]


@pytest.mark.parametrize(("seed", "k_override"), [(0, 9), (1, 14), (2, 25), (3, 40)])
def test_super_buckets_for_stricter_overrides(seed: int, k_override: int) -> None:
    """Everyone who may send the same override k and gets region R is a candidate: |C(R)| ≥ k."""
    view = _clustered(seed, 400, [2, 3, 5, 8], [0.0, 3e4])
    cloaker = HilbertCloak()
    state = cloaker.state(view)
    results: dict[int, Region] = {}
    for row in range(len(view)):
        if int(view.k[row]) > k_override:
            continue  # this override would be looser than the stored profile
        res = cloaker.cloak(view, row, _stored(view, row, k=k_override))
        if isinstance(res, Refusal):
            assert res.reason == ReasonCode.AREA_EXCEEDED
            continue
        results[row] = res
        assert res.k_achieved == _strict_count(view, res.bbox) >= k_override
        b = state.bucket_of[row]
        if state.size[b] >= k_override:
            assert res.anon_set.tolist() == state.bucket_members(b).tolist()
        else:  # an aligned super-bucket [m·2^j, (m+1)·2^j) of buckets
            buckets = sorted({state.bucket_of[r] for r in res.anon_set.tolist()})
            j = max(1, (buckets[-1] - buckets[0]).bit_length())
            while buckets[0] >> j != buckets[-1] >> j:
                j += 1
            assert b >> j == buckets[0] >> j
    assert results, "the override must be served for some users"
    spans = [len({state.bucket_of[r] for r in res.anon_set.tolist()}) for res in results.values()]
    assert max(spans) > 1, "some answers must come from super-buckets"
    by_region: dict[BBox, list[int]] = defaultdict(list)
    for row, res in results.items():
        by_region[res.bbox].append(row)
    for row, res in results.items():
        cands = by_region[res.bbox]
        assert row in cands and len(cands) >= k_override
        assert sorted(res.anon_set.tolist()) == sorted(cands)


def test_override_min_area_grows_the_bucket_region() -> None:
    view = _clustered(5, 200, [4], [0.0])
    cloaker = HilbertCloak()
    row = 17
    base = cloaker.cloak(view, row, _stored(view, row))
    grown = cloaker.cloak(view, row, _stored(view, row, min_area_m2=5e6))
    assert isinstance(base, Region) and isinstance(grown, Region)
    assert grown.area_m2 == grown.bbox.area_m2 >= 5e6 > base.area_m2
    assert grown.bbox.min_lon_udeg <= base.bbox.min_lon_udeg and grown.bbox.max_lon_udeg >= base.bbox.max_lon_udeg
    assert grown.bbox.min_lat_udeg <= base.bbox.min_lat_udeg and grown.bbox.max_lat_udeg >= base.bbox.max_lat_udeg
    assert grown.k_achieved == _strict_count(view, grown.bbox)
    assert grown.anon_set.tolist() == base.anon_set.tolist()


# -- refusals ------------------------------------------------------------------------------------


def test_refusals() -> None:
    view = _clustered(3, 50, [3], [0.0])
    cloaker = HilbertCloak()

    def reason(profile: PrivacyProfile, row: int = 0) -> ReasonCode | None:
        res = cloaker.cloak(view, row, profile)
        return res.reason if isinstance(res, Refusal) else None

    assert reason(PrivacyProfile(k=3, l=2, max_area_m2=WIDE, min_area_m2=0.0)) == ReasonCode.UNSUPPORTED
    assert reason(PrivacyProfile(k=51, max_area_m2=WIDE, min_area_m2=0.0)) == ReasonCode.K_UNREACHABLE
    assert reason(PrivacyProfile(k=3, max_area_m2=1.0, min_area_m2=0.0)) == ReasonCode.AREA_EXCEEDED
    assert reason(PrivacyProfile(k=3, max_area_m2=WIDE, min_area_m2=0.0)) is None
    assert reason(PrivacyProfile(k=50, max_area_m2=WIDE, min_area_m2=0.0)) is None  # the super-bucket of everyone
    # The whole population is smaller than someone's stored k: nobody can be placed. Users are
    # present in number for k = 2, so the code is area_exceeded (contract §2), for k = 4 k_unreachable.
    few = _points(["a", "b", "c"], [39.9, 39.91, 39.92], [116.4, 116.4, 116.4], k=[2, 2, 4])
    res = cloaker.cloak(few, 0, PrivacyProfile(k=2, max_area_m2=WIDE, min_area_m2=0.0))
    assert isinstance(res, Refusal) and res.reason == ReasonCode.AREA_EXCEEDED
    res = cloaker.cloak(few, 2, PrivacyProfile(k=4, max_area_m2=WIDE, min_area_m2=0.0))
    assert isinstance(res, Refusal) and res.reason == ReasonCode.K_UNREACHABLE
    batch = cloaker.cloak_batch(
        few,
        np.array([0, 2]),
        ProfileArrays.from_profiles([PrivacyProfile(k=2, min_area_m2=0.0), PrivacyProfile(k=4, min_area_m2=0.0)]),
    )
    assert [batch[i].reason for i in range(2)] == [ReasonCode.AREA_EXCEEDED, ReasonCode.K_UNREACHABLE]  # type: ignore[union-attr]
    # No aligned super-bucket gathers k users that could send this override.
    lopsided = _points(
        [f"s{i}" for i in range(33)],
        39.9 + np.arange(33) * 1e-4,
        np.full(33, 116.4),
        k=[3] * 3 + [30] * 30,
    )
    state = cloaker.state(lopsided)
    assert state.size == [3, 30] or state.size == [30, 3]
    small = next(r for r in range(33) if state.size[state.bucket_of[r]] == 3)
    res = cloaker.cloak(lopsided, small, PrivacyProfile(k=6, max_area_m2=WIDE, min_area_m2=0.0))
    assert isinstance(res, Refusal) and res.reason == ReasonCode.AREA_EXCEEDED


def test_registry_and_protocol() -> None:
    cloaker = get_cloaker("hilbert", order=20)
    assert isinstance(cloaker, HilbertCloak) and cloaker.order == 20
    assert HilbertCloak.reciprocal and not HilbertCloak.supports_l
    with pytest.raises(ValueError, match="order"):
        HilbertCloak(order=30)


# -- batch ---------------------------------------------------------------------------------------


def _same(batch: BatchResult, i: int, single: Region | Refusal) -> None:
    got = batch[i]
    if isinstance(single, Refusal):
        assert isinstance(got, Refusal) and got.reason == single.reason, i
    else:
        assert isinstance(got, Region), (i, got)
        assert (got.bbox, got.k_achieved, got.area_m2) == (single.bbox, single.k_achieved, single.area_m2), i


def test_batch_equals_single() -> None:
    view = _clustered(11, 500, [2, 3, 5, 8], [0.0, 0.0, 2e4, 5e5])
    rng = np.random.default_rng(3)
    rows = rng.integers(0, len(view), 400)
    profiles = []
    for i, r in enumerate(rows.tolist()):
        stored = _stored(view, r)
        match i % 8:
            case 0 | 1 | 2:
                profiles.append(stored)
            case 3:
                profiles.append(stored.tightened({"k": stored.k + int(rng.integers(1, 30))}))
            case 4:
                profiles.append(stored.tightened({"min_area_m2": max(stored.min_area_m2, 1e6)}))
            case 5:
                profiles.append(
                    stored.tightened({"max_area_m2": max(stored.min_area_m2, float(rng.choice([1e3, 1e5, 1e7])))})
                )
            case 6:
                profiles.append(stored.tightened({"l": 2}))
            case _:
                profiles.append(stored.tightened({"k": 1000}))
    fresh = _points(view.user_ids, view.lat, view.lon, k=view.k, min_area_m2=view.min_area_m2)
    batch = HilbertCloak().cloak_batch(fresh, rows, ProfileArrays.from_profiles(profiles))
    single = HilbertCloak()
    statuses = set()
    for i, r in enumerate(rows.tolist()):
        res = single.cloak(view, r, profiles[i])
        _same(batch, i, res)
        statuses.add(res.reason if isinstance(res, Refusal) else "ok")
        if isinstance(res, Region) and profiles[i].k <= single.state(view).size[single.state(view).bucket_of[r]]:
            assert batch.group[i] == single.state(view).bucket_of[r]
    assert {"ok", ReasonCode.UNSUPPORTED, ReasonCode.K_UNREACHABLE, ReasonCode.AREA_EXCEEDED} <= statuses
    empty = HilbertCloak().cloak_batch(view, np.zeros(0, np.int64), ProfileArrays.from_profiles([]))
    assert len(empty) == 0


def test_groups_in_batch_identify_buckets() -> None:
    view = _clustered(12, 300, [4], [0.0])
    rows = np.arange(len(view))
    out = HilbertCloak().cloak_batch(
        view, rows, ProfileArrays.uniform(PrivacyProfile(k=4, max_area_m2=WIDE, min_area_m2=0.0), len(rows))
    )
    assert out.ok.all()
    for g in np.unique(out.group):
        members = out.bbox[out.group == g]
        assert (members == members[0]).all()  # one bbox per group
        assert (out.group == g).sum() >= 4


# -- vectorized geometry helpers ------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(st.integers(-180_000_000, 179_000_000), st.integers(-90_000_000, 89_000_000), st.integers(1, 10**6)),
        min_size=1,
        max_size=30,
    )
)
def test_areas_bit_identical_to_bbox(boxes: list[tuple[int, int, int]]) -> None:
    arr = np.array([[x, y, min(x + w, 180_000_000), min(y + w, 90_000_000)] for x, y, w in boxes], np.int64)
    got = bbox_areas_m2(arr).tolist()
    assert got == [BBox(*map(int, b)).area_m2 for b in arr]


@given(st.lists(st.floats(-180, 180), min_size=2, max_size=30), st.lists(st.floats(-90, 90), min_size=2, max_size=30))
def test_bboxes_around_keys_matches_core(lons: list[float], lats: list[float]) -> None:
    m = min(len(lons), len(lats))
    lon_k, lat_k = coordinate_keys(lons[:m]), coordinate_keys(lats[:m])
    got = bboxes_around_keys(lon_k.min(keepdims=True), lat_k.min(keepdims=True), lon_k.max(keepdims=True),
                             lat_k.max(keepdims=True))[0]  # fmt: skip
    want = bbox_around_keys(int(lon_k.min()), int(lat_k.min()), int(lon_k.max()), int(lat_k.max()))
    assert BBox(*map(int, got)) == want


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32),
    st.sampled_from([29, 24, 12]),
    st.sampled_from([(39.9, 116.4), (-89.9995, -179.9995), (89.9995, 179.9995), (0.0, 0.0)]),
)
def test_cover_counts_are_exact(seed: int, order: int, centre: tuple[float, float]) -> None:
    """Counts from the curve order equal the STR-tree's, users on box edges and world edges included."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    # Users on whole and half micro-degrees (even and odd keys), some exactly on the world edge.
    lat_u = np.clip(np.round(centre[0] * 1e6) + rng.integers(-800, 800, n) / rng.choice([1, 2], n), -9e7, 9e7)
    lon_u = np.clip(np.round(centre[1] * 1e6) + rng.integers(-800, 800, n) / rng.choice([1, 2], n), -1.8e8, 1.8e8)
    view = _points([f"c{i}" for i in range(n)], lat_u / 1e6, lon_u / 1e6)
    state = HilbertCloak(order=order).state(view)
    lo_lon = np.floor(lon_u[rng.integers(0, n, 200)]).astype(np.int64) - rng.integers(0, 3, 200)
    lo_lat = np.floor(lat_u[rng.integers(0, n, 200)]).astype(np.int64) - rng.integers(0, 3, 200)
    w, h = rng.integers(1, 600, 200), rng.integers(1, 600, 200)
    boxes = np.stack(
        [
            np.clip(lo_lon, -180_000_000, 179_999_999),
            np.clip(lo_lat, -90_000_000, 89_999_999),
            np.minimum(np.clip(lo_lon, -180_000_000, 179_999_999) + w, 180_000_000),
            np.minimum(np.clip(lo_lat, -90_000_000, 89_999_999) + h, 90_000_000),
        ],
        axis=1,
    )
    expected = view.count_in_many(boxes)
    assert state.count(boxes).tolist() == expected.tolist()
    got = cover_counts(state.hv_sorted, state.lon_key_sorted, state.lat_key_sorted, boxes, order=order, budget=40)
    assert ((got == expected) | (got == -1)).all()
    assert (got[expected > 40] == -1).all()


def test_common_path_needs_no_spatial_index() -> None:
    """Stored profiles without A_min: buckets are counted from the curve order, no STR-tree is built."""
    view = _clustered(13, 2000, [3, 5, 8], [0.0])
    rows = np.arange(len(view))
    profiles = ProfileArrays.from_profiles([_stored(view, r) for r in rows.tolist()])
    out = HilbertCloak().cloak_batch(view, rows, profiles)
    assert out.ok.all()
    assert "strtree" not in view.__dict__
    assert out.k_achieved.tolist() == view.count_in_many(out.bbox).tolist()
