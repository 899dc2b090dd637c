"""Nearest-neighbour k-cloak, the non-reciprocal baseline (CONCEPTS §4.1, §1.5)."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers import get_cloaker
from kcloak.cloaking.cloakers.base import BatchResult, Refusal, Region
from kcloak.cloaking.cloakers.nn import NearestNeighbourCloak, nn_mbr_area_m2
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox, bbox_around_keys, haversine_m, haversine_m_array
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

WIDE = 2.5e9
SCALE = 2.0**-10
"""Degrees per planar unit of the §1.5 example (≈ 109 m); a power of two, so that equal planar
gaps on the equator are bit-identical longitude differences and the table's ties are exact."""


def _published(view: IndexView, members: list[str]) -> BBox:
    rows = [view.row_of[u] for u in members]
    lon_k, lat_k = view.lon_key[rows], view.lat_key[rows]
    return bbox_around_keys(int(lon_k.min()), int(lat_k.min()), int(lon_k.max()), int(lat_k.max()))


def _strict_count(view: IndexView, bbox: BBox) -> int:
    """Users strictly inside as a client counts: float64 edges and positions, and their decimal texts."""
    e = bbox.to_geojson()
    d = [Decimal(repr(v)) for v in e]
    return sum(
        1
        for la, lo in zip(view.lat.tolist(), view.lon.tolist(), strict=True)
        if e[0] < lo < e[2] and e[1] < la < e[3] and d[0] < Decimal(repr(lo)) < d[2] and d[1] < Decimal(repr(la)) < d[3]
    )


def _line(ids: list[str]) -> IndexView:
    """Users at planar x = 0, 1, 2, 10 on the equator."""
    return IndexView.from_points(ids, [0.0] * 4, [x * SCALE for x in (0, 1, 2, 10)])


def test_recip_nn_line() -> None:
    view = _line(["u1", "u2", "u3", "u4"])
    assert haversine_m(0, 1 * SCALE, 0, 0) == haversine_m(0, 1 * SCALE, 0, 2 * SCALE)  # an exact tie
    cloaker = NearestNeighbourCloak()
    profile = PrivacyProfile(k=2, max_area_m2=WIDE, min_area_m2=0.0)
    regions: dict[str, Region] = {}
    for u in view.user_ids:
        res = cloaker.cloak(view, view.row_of[u], profile)
        assert isinstance(res, Region)
        regions[u] = res
    table = {  # user → (group, planar x-extent); every region is [x0, x1] × [0, 0]
        "u1": (["u1", "u2"], (0, 1)),
        "u2": (["u1", "u2"], (0, 1)),  # tie between u1 and u3: the smaller user id wins
        "u3": (["u2", "u3"], (1, 2)),
        "u4": (["u3", "u4"], (2, 10)),
    }
    produced_by: dict[BBox, list[str]] = defaultdict(list)
    for u, (group, (x0, x1)) in table.items():
        region = regions[u]
        assert sorted(view.user_ids[r] for r in region.anon_set) == group
        assert region.bbox == _published(view, group)
        assert region.k_achieved == 2 == _strict_count(view, region.bbox)
        assert abs(region.bbox.min_lon_udeg - x0 * SCALE * 1e6) <= 1
        assert abs(region.bbox.max_lon_udeg - x1 * SCALE * 1e6) <= 1
        assert (region.bbox.min_lat_udeg, region.bbox.max_lat_udeg) == (-1, 1)
        produced_by[region.bbox].append(u)
    # §1.5: C(R) = users whose own request yields R.
    assert produced_by[regions["u4"].bbox] == ["u4"]  # [2,10] × [0,0] holds u3 and u4, only u4 produces it
    assert produced_by[regions["u3"].bbox] == ["u3"]
    assert produced_by[regions["u1"].bbox] == ["u1", "u2"]
    violations = sum(1 for cands in produced_by.values() if len(cands) < 2)
    assert violations == 2  # k-violation rate 2/3 over the distinct regions (§6.3)
    batch = cloaker.cloak_batch(view, np.arange(4), ProfileArrays.uniform(profile, 4))
    for i, u in enumerate(view.user_ids):
        assert batch[i].bbox == regions[u].bbox  # type: ignore[union-attr]


def test_tie_is_broken_by_user_id() -> None:
    """Same line, but u1 renamed so that u3 has the smaller id: u2 now pairs with u3."""
    view = _line(["x1", "u2", "u3", "u4"])
    cloaker = NearestNeighbourCloak()
    region = cloaker.cloak(view, view.row_of["u2"], PrivacyProfile(k=2, max_area_m2=WIDE, min_area_m2=0.0))
    assert isinstance(region, Region)
    assert sorted(view.user_ids[r] for r in region.anon_set) == ["u2", "u3"]
    batch = cloaker.cloak_batch(
        view, np.array([1]), ProfileArrays.uniform(PrivacyProfile(k=2, max_area_m2=WIDE, min_area_m2=0.0), 1)
    )
    assert batch[0].bbox == region.bbox  # type: ignore[union-attr]


def _clustered(seed: int, n: int, *, decimals: int = 4) -> IndexView:
    """Clustered users near Beijing on a coarse lattice: many co-located users and exact ties."""
    rng = np.random.default_rng(seed)
    centres = rng.normal([39.9, 116.4], 0.02, size=(4, 2))
    c = rng.integers(0, 4, n)
    lat = np.round(centres[c, 0] + rng.normal(0, 0.003, n), decimals)
    lon = np.round(centres[c, 1] + rng.normal(0, 0.003, n), decimals)
    return IndexView.from_points([f"n{i:05d}" for i in rng.permutation(n)], lat, lon, seed=seed)


def _brute_group(view: IndexView, row: int, k: int) -> list[int]:
    others = np.array([r for r in range(len(view)) if r != row], np.int64)
    d = haversine_m_array(view.lat[row], view.lon[row], view.lat[others], view.lon[others])
    d_um = np.rint(d * 1e6).astype(np.int64).tolist()
    ranked = sorted(range(len(others)), key=lambda i: (d_um[i], view.user_ids[int(others[i])]))
    return sorted([row, *others[ranked[: k - 1]].tolist()])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 80), st.sampled_from([1, 2, 3, 5, 8]))
def test_group_is_k_nearest_by_brute_force(seed: int, n: int, k: int) -> None:
    view = _clustered(seed, n, decimals=3)
    k = min(k, n)
    cloaker = NearestNeighbourCloak()
    profile = PrivacyProfile(k=k, max_area_m2=WIDE, min_area_m2=0.0)
    rows = np.arange(n)
    batch = cloaker.cloak_batch(view, rows, ProfileArrays.uniform(profile, n))
    for row in range(n):
        region = cloaker.cloak(view, row, profile)
        assert isinstance(region, Region)
        group = _brute_group(view, row, k)
        assert sorted(region.anon_set.tolist()) == group
        assert region.bbox == _published(view, [view.user_ids[r] for r in group])
        assert region.k_achieved == _strict_count(view, region.bbox) >= k
        assert batch[row].bbox == region.bbox  # type: ignore[union-attr]


def test_area_floor_grows_about_the_group_centre() -> None:
    view = _clustered(1, 300)
    cloaker = NearestNeighbourCloak()
    for row in (0, 7, 123):
        plain = cloaker.cloak(view, row, PrivacyProfile(k=5, max_area_m2=WIDE, min_area_m2=0.0))
        grown = cloaker.cloak(view, row, PrivacyProfile(k=5, min_area_m2=2e6, max_area_m2=WIDE))
        assert isinstance(plain, Region) and isinstance(grown, Region)
        assert plain.area_m2 < 2e6 <= grown.area_m2 == grown.bbox.area_m2
        p, g = plain.bbox, grown.bbox
        assert g.min_lon_udeg <= p.min_lon_udeg and g.max_lon_udeg >= p.max_lon_udeg
        assert g.min_lat_udeg <= p.min_lat_udeg and g.max_lat_udeg >= p.max_lat_udeg
        assert abs((g.min_lon_udeg + g.max_lon_udeg) - (p.min_lon_udeg + p.max_lon_udeg)) <= 2
        assert abs((g.min_lat_udeg + g.max_lat_udeg) - (p.min_lat_udeg + p.max_lat_udeg)) <= 2
        assert grown.k_achieved == _strict_count(view, g) >= plain.k_achieved
        assert sorted(grown.anon_set.tolist()) == sorted(plain.anon_set.tolist())


def test_refusals() -> None:
    view = _clustered(2, 40)
    cloaker = NearestNeighbourCloak()

    def reason(profile: PrivacyProfile) -> ReasonCode | None:
        res = cloaker.cloak(view, 3, profile)
        return res.reason if isinstance(res, Refusal) else None

    assert reason(PrivacyProfile(k=5, l=2, min_area_m2=0.0)) == ReasonCode.UNSUPPORTED
    assert reason(PrivacyProfile(k=41, min_area_m2=0.0)) == ReasonCode.K_UNREACHABLE
    assert reason(PrivacyProfile(k=40, max_area_m2=1.0, min_area_m2=0.0)) == ReasonCode.AREA_EXCEEDED
    assert reason(PrivacyProfile(k=5, min_area_m2=1e6, max_area_m2=1.01e6)) is None
    assert reason(PrivacyProfile(k=40, max_area_m2=WIDE, min_area_m2=0.0)) is None
    assert get_cloaker("nn").name == "nn" and not NearestNeighbourCloak.reciprocal


def _same(batch: BatchResult, i: int, single: Region | Refusal) -> None:
    got = batch[i]
    if isinstance(single, Refusal):
        assert isinstance(got, Refusal) and got.reason == single.reason, i
    else:
        assert isinstance(got, Region), (i, got)
        assert (got.bbox, got.k_achieved, got.area_m2) == (single.bbox, single.k_achieved, single.area_m2), i


def test_batch_equals_single() -> None:
    view = _clustered(4, 600)
    rng = np.random.default_rng(9)
    rows = rng.integers(0, len(view), 500)
    kinds = [
        PrivacyProfile(k=1, min_area_m2=0.0),
        PrivacyProfile(k=2, min_area_m2=0.0),
        PrivacyProfile(k=5, min_area_m2=0.0),
        PrivacyProfile(k=10, min_area_m2=3e5),
        PrivacyProfile(k=20, max_area_m2=WIDE, min_area_m2=0.0),
        PrivacyProfile(k=5, max_area_m2=10.0, min_area_m2=0.0),
        PrivacyProfile(k=5, l=3, min_area_m2=0.0),
        PrivacyProfile(k=601, min_area_m2=0.0),
    ]
    profiles = [kinds[i % len(kinds)] for i in range(len(rows))]
    batch = NearestNeighbourCloak().cloak_batch(view, rows, ProfileArrays.from_profiles(profiles))
    fresh = IndexView.from_points(view.user_ids, view.lat, view.lon, seed=view.seed)
    statuses = set()
    for i, r in enumerate(rows.tolist()):
        res = NearestNeighbourCloak().cloak(fresh, r, profiles[i])
        _same(batch, i, res)
        statuses.add(res.reason if isinstance(res, Refusal) else "ok")
    assert statuses == {"ok", ReasonCode.AREA_EXCEEDED, ReasonCode.UNSUPPORTED, ReasonCode.K_UNREACHABLE}
    assert (batch.group == -1).all()


@pytest.mark.parametrize("k", [1, 4, 12])
def test_nn_mbr_area(k: int) -> None:
    view = _clustered(6, 200)
    rows = np.arange(0, 200, 7)
    areas = nn_mbr_area_m2(view, rows, k)
    cloaker = NearestNeighbourCloak()
    for r, a in zip(rows.tolist(), areas.tolist(), strict=True):
        region = cloaker.cloak(view, r, PrivacyProfile(k=k, max_area_m2=WIDE, min_area_m2=0.0))
        assert isinstance(region, Region) and region.area_m2 == a
    assert np.isnan(nn_mbr_area_m2(view, rows, 201)).all()


def test_world_edge_group_counts_users_on_the_edge() -> None:
    """Users exactly on the antimeridian cannot be strictly inside any bbox; the contract (§0)
    waives strictness at the world edge, so they count, in batch as in single calls."""
    view = IndexView.from_points(["a", "b"], [45.0, 45.00001], [180.0, 180.0])
    cloaker = NearestNeighbourCloak()
    profile = PrivacyProfile(k=2, min_area_m2=0.0)
    batch = cloaker.cloak_batch(view, np.array([0, 1]), ProfileArrays.uniform(profile, 2))
    for i in range(2):
        single = cloaker.cloak(view, i, profile)
        assert isinstance(single, Region) and single.k_achieved == 2
        assert single.bbox.max_lon_udeg == 180_000_000
        _same(batch, i, single)
