"""Bucket chains that restart at segments of the Hilbert curve (docs/views.md, "Segments"): every
region still holds at least k users, and it is reciprocal: every user the region's anonymizing set
names gets that very region, and the users who get a region are at least as many as the largest k
among them.

The checks read answers as a client does (boxes in micro-degrees, users counted on the coordinates
sent, as float64) and share no code with the cloaker: counts are float comparisons against the
box's edges, candidate sets are the users whose own request returns the box.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers.base import Refusal, Region
from kcloak.cloaking.cloakers.hilbert import HilbertCloak, _bucket_ends, partition_buckets
from kcloak.cloaking.cloakers.hilbert_segments import partition_segments
from kcloak.cloaking.index import IndexView
from kcloak.core.profile import PrivacyProfile

SEGMENTED = [0]  # examples whose view was cut into several segments

# Curve cells of 2^10 micro-degrees: points on their edges (grid coordinate = µdeg + 2^28).
EDGE = 1 << 10
LON_EDGE = ((116_400_000 + (1 << 28)) // EDGE) * EDGE - (1 << 28)
LAT_EDGE = ((39_900_000 + (1 << 28)) // EDGE) * EDGE - (1 << 28)


@st.composite
def populations(draw: Any) -> list[tuple[float, float, int, float]]:
    """Users as (lat, lon, stored k, stored A_min): coordinates as decimal strings of 4–6 places
    parsed to float64 (duplicates are likely), some exactly on or next to curve-cell edges."""
    decimals = draw(st.sampled_from([4, 5, 6]))
    step = 10**-decimals
    out = []
    for _ in range(draw(st.integers(20, 160))):
        if draw(st.integers(0, 4)) == 0:  # on a cell edge, or one micro-degree off it
            lon_u = LON_EDGE + draw(st.integers(0, 3)) * EDGE + draw(st.integers(-1, 1))
            lat_u = LAT_EDGE + draw(st.integers(0, 3)) * EDGE + draw(st.integers(-1, 1))
            lat, lon = float(f"{lat_u / 1e6:.6f}"), float(f"{lon_u / 1e6:.6f}")
        else:
            i, j = draw(st.integers(0, 25)), draw(st.integers(0, 25))
            lat, lon = float(f"{39.9 + i * step:.{decimals}f}"), float(f"{116.4 + j * step:.{decimals}f}")
        out.append((lat, lon, draw(st.sampled_from([1, 2, 3, 5, 8])), draw(st.sampled_from([0.0, 0.0, 20_000.0]))))
    return out


def strictly_inside(lat: list[float], lon: list[float], r: Region) -> int:
    b = r.bbox
    lo_x, hi_x = b.min_lon_udeg / 1e6, b.max_lon_udeg / 1e6
    lo_y, hi_y = b.min_lat_udeg / 1e6, b.max_lat_udeg / 1e6
    return sum(lo_x < x < hi_x and lo_y < y < hi_y for x, y in zip(lon, lat, strict=True))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(populations(), st.sampled_from([1, 2]), st.integers(0, 2**31))
def test_segmented_regions_hold_k_and_are_reciprocal(
    users: list[tuple[float, float, int, float]], factor: int, seed: int
) -> None:
    n = len(users)
    lat = [u[0] for u in users]
    lon = [u[1] for u in users]
    profiles = [PrivacyProfile(k=u[2], min_area_m2=u[3], max_area_m2=2.5e9) for u in users]
    view = IndexView(
        user_ids=[f"u{i}" for i in range(n)],
        lat=np.array(lat),
        lon=np.array(lon),
        t=np.zeros(n),
        k=np.array([p.k for p in profiles], np.int64),
        min_area_m2=np.array([p.min_area_m2 for p in profiles]),
        max_area_m2=np.full(n, 2.5e9),
        salt=np.arange(n, dtype=np.uint64) * np.uint64(2654435761),
        now=0.0,
        epoch=1,
        seed=seed,
    )
    cloaker = HilbertCloak(segment_factor=factor)
    if len(cloaker.state(view).buckets.seg_lo) > 1:
        SEGMENTED[0] += 1
    for override in (0, 4, 9):  # the stored profiles, then everyone asking for the same k (super-buckets)
        asked = [PrivacyProfile(k=override or p.k, min_area_m2=p.min_area_m2, max_area_m2=2.5e9) for p in profiles]
        answers = [cloaker.cloak(view, r, asked[r]) for r in range(n)]
        who_gets: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
        for r, res in enumerate(answers):
            if override == 0:  # n ≥ every stored k here, so everyone is placed and served
                assert isinstance(res, Region), res
            if isinstance(res, Refusal):
                continue
            assert res.k_achieved == strictly_inside(lat, lon, res) >= asked[r].k
            assert res.area_m2 >= asked[r].min_area_m2
            b = res.bbox
            who_gets[(b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg)].append(r)
        for res in answers:
            if isinstance(res, Region):
                b = res.bbox
                cands = who_gets[(b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg)]
                # Reciprocity: everyone named gets this region, and those who do are ≥ their largest k.
                assert set(res.anon_set.tolist()) <= set(cands)
                assert len(cands) >= max(asked[c].k for c in cands)


def test_some_views_had_several_segments() -> None:
    """Runs after the property above: the examples did cut views into several segments."""
    if SEGMENTED[0] == 0:  # run alone
        n = 200
        lat = 39.9 + (np.arange(n) % 20) * 1e-4
        lon = 116.4 + (np.arange(n) // 20) * 1e-4
        view = IndexView.from_points([f"u{i}" for i in range(n)], lat, lon, k=np.full(n, 3, np.int64))
        SEGMENTED[0] = int(len(HilbertCloak(segment_factor=1).state(view).buckets.seg_lo) > 1)
    assert SEGMENTED[0] > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([1, 2, 3, 5, 8, 13]), min_size=1, max_size=40), min_size=1, max_size=8))
def test_segments_are_cut_as_each_would_be_alone(parts: list[list[int]]) -> None:
    """partition_segments over several segments at once equals the one-chain rule run on each
    segment alone (segments are padded to hold their largest k, as the cut rule ensures)."""
    segs = [p + [1] * max(0, max(p) - len(p)) for p in parts]
    k = np.array([v for p in segs for v in p], np.int64)
    seg_start = np.cumsum([0] + [len(p) for p in segs[:-1]]).astype(np.int64)
    want: list[int] = []
    for off, p in zip(seg_start.tolist(), segs, strict=True):
        want += [off + b for b in partition_buckets(np.array(p, np.int64)).tolist()[:-1]]
    got = partition_segments(k, seg_start, _bucket_ends(k, int(k.max())))
    assert got.tolist() == want
