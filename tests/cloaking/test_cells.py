"""Population-balanced Hilbert cells and per-cell Hilbert cloaking (issue 15, proofs 1 and 2 in miniature)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cells import FORMAT, CellMap, CellMapError
from kcloak.cloaking.checks.regions import Property, Published, Snapshot, check_region, users_inside
from kcloak.cloaking.cloakers.base import Refusal, Region
from kcloak.cloaking.cloakers.hilbert import HilbertCloak, hilbert_indices
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.profile import PrivacyProfile, ProfileArrays

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _hv(lat: Any, lon: Any, order: int = 29) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Hilbert values as HilbertCloak computes them, through a view (an independent path from cell_of)."""
    view = IndexView.from_points([f"u{i}" for i in range(len(lat))], lat, lon)
    shift = 29 - order
    return hilbert_indices(view.gx >> shift, view.gy >> shift, order)


# -- the cell map ---------------------------------------------------------------------------------


def test_balanced_cells_hold_equal_shares() -> None:
    rng = np.random.default_rng(1)
    # A lopsided city: most users in a dense centre, a few far out.
    lat = np.concatenate([39.9 + rng.normal(0, 0.01, 9000), 39.5 + rng.uniform(0, 1, 1000)])
    lon = np.concatenate([116.4 + rng.normal(0, 0.01, 9000), 116.0 + rng.uniform(0, 1, 1000)])
    for cells in (1, 2, 7, 64):
        cm = CellMap.balanced(lat, lon, cells=cells)
        assert cm.cells == cells and len(cm.boundaries) == cells - 1
        counts = np.bincount(cm.cell_of(lat, lon), minlength=cells)
        assert len(counts) == cells
        assert counts.min() >= len(lat) // cells and counts.max() <= -(-len(lat) // cells)


def test_cell_of_is_the_cloakers_curve_and_cut_points_go_up() -> None:
    lat = np.array([-90.0, 90.0, 0.0, 39.9, 39.900001, -33.8688, 51.5])
    lon = np.array([-180.0, 180.0, 0.0, 116.4, 116.400001, 151.2093, -0.1])
    for order in (29, 20, 5):
        hv = _hv(lat, lon, order)
        cm = CellMap(np.sort(hv), order=order)  # every user sits exactly on a cut point
        expected = np.searchsorted(np.sort(hv), hv, side="right")
        assert cm.cell_of(lat, lon).tolist() == expected.tolist()
        # A value equal to a cut point is in the upper cell; just below it, the lower one.
        u = np.unique(hv)
        assert CellMap(u, order=order).cell_of_values(u).tolist() == list(range(1, len(u) + 1))
        assert CellMap(u, order=order).cell_of_values(u - 1).tolist() == list(range(len(u)))


def test_duplicates_leave_empty_cells_never_fewer_cells() -> None:
    lat = [39.9] * 10 + [40.0]
    lon = [116.4] * 10 + [116.5]
    cm = CellMap.balanced(lat, lon, cells=4)
    assert cm.cells == 4
    counts = np.bincount(cm.cell_of(lat, lon), minlength=4)
    assert counts.sum() == 11 and (counts == 0).sum() >= 1


def test_json_round_trip_and_format() -> None:
    cm = CellMap.balanced([39.9, 40.0, 40.1, 39.8], [116.4, 116.5, 116.3, 116.2], cells=3, order=24)
    text = cm.to_json()
    doc = json.loads(text)
    assert doc == {"format": FORMAT, "order": 24, "cells": 3, "boundaries": cm.boundaries.tolist()}
    again = CellMap.from_json(text)
    assert again == cm and again.order == 24
    assert CellMap.from_json(text.encode()) == cm
    assert CellMap.from_json(CellMap([]).to_json()).cells == 1


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"format": "other", "order": 29, "cells": 1, "boundaries": []}',
        '{"format": "kcloak.cells/1", "order": 29, "cells": 3, "boundaries": [5]}',
        '{"format": "kcloak.cells/1", "order": 29, "cells": 3, "boundaries": [9, 5]}',
        '{"format": "kcloak.cells/1", "order": 29, "cells": 2, "boundaries": [1.5]}',
        '{"format": "kcloak.cells/1", "order": 29, "cells": 2, "boundaries": [-1]}',
        '{"format": "kcloak.cells/1", "order": 3, "cells": 2, "boundaries": [65]}',
        '{"format": "kcloak.cells/1", "order": 30, "cells": 1, "boundaries": []}',
        '{"format": "kcloak.cells/1", "order": "29", "cells": 1, "boundaries": []}',
        '{"format": "kcloak.cells/1", "order": 29, "cells": true, "boundaries": []}',
    ],
)
def test_from_json_refuses_bad_files(text: str) -> None:
    with pytest.raises(CellMapError):
        CellMap.from_json(text)


def test_bad_input_is_a_clear_error_that_echoes_nothing() -> None:
    with pytest.raises(CellMapError, match="cells: must be an integer >= 1"):
        CellMap.balanced([1.0], [2.0], cells=0)
    with pytest.raises(CellMapError, match="empty"):
        CellMap.balanced([], [], cells=2)
    with pytest.raises(CellMapError, match="NaN") as nan:
        CellMap.balanced([39.912345, float("nan")], [116.412345, 116.0], cells=2)
    assert "39.912345" not in str(nan.value)
    cm = CellMap([10])
    with pytest.raises(CellMapError, match="NaN"):
        cm.cell_of([float("nan")], [116.0])
    with pytest.raises(CellMapError, match="within"):
        cm.cell_of([91.0], [0.0])
    with pytest.raises(CellMapError, match="same length"):
        cm.cell_of([1.0, 2.0], [1.0])
    with pytest.raises(CellMapError, match="sorted"):
        CellMap([5, 3])
    with pytest.raises(CellMapError, match="order"):
        CellMap([], order=0)
    with pytest.raises(ValueError, match="order"):
        HilbertCloak(order=20, cells=CellMap([], order=29))
    with pytest.raises(ValueError, match="cell map"):
        HilbertCloak(cells=cm).state(IndexView.from_points(["a"], [1.0], [1.0]))


# -- per-cell Hilbert cloaking ----------------------------------------------------------------------


@st.composite
def snapshots(draw: st.DrawFn) -> dict[str, Any]:
    """A frozen snapshot on a 4–6-decimal grid (duplicates likely), stored profiles and a cell map.

    Cut points are drawn from the users' own Hilbert values (users exactly on cell edges) and at
    random between them; some requests carry a stricter k (super-buckets) or a larger A_min.
    """
    n = draw(st.integers(1, 60))
    decimals = draw(st.sampled_from([4, 5, 6]))
    q = 10.0**-decimals
    span = draw(st.integers(2, 40))
    ix = draw(st.lists(st.integers(0, span), min_size=n, max_size=n))
    iy = draw(st.lists(st.integers(0, span), min_size=n, max_size=n))
    lat = np.round(39.9 + np.array(iy) * q, decimals)
    lon = np.round(116.3 + np.array(ix) * q, decimals)
    k = np.array(draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)))
    min_area = np.array(draw(st.lists(st.sampled_from([0.0, 0.0, 50.0, 5e3]), min_size=n, max_size=n)))
    max_area = np.array(draw(st.lists(st.sampled_from([2.5e9, 2.5e9, 1e4]), min_size=n, max_size=n)))
    hv = _hv(lat, lon)
    picks = draw(st.lists(st.integers(0, n - 1), max_size=6))
    extra = draw(st.lists(st.integers(int(hv.min()) - 2, int(hv.max()) + 2), max_size=3))
    bounds = np.sort(np.concatenate([hv[picks], np.array(extra, np.int64)]).astype(np.int64))
    kk = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # extra k of each request
    bigger = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**32))
    return {
        "ids": [f"user.{i}" for i in range(n)],
        "lat": lat,
        "lon": lon,
        "k": k,
        "min_area": min_area,
        "max_area": max_area,
        "cells": CellMap(bounds),
        "extra_k": kk,
        "bigger": bigger,
        "seed": seed,
    }


def _global_view(s: dict[str, Any]) -> IndexView:
    return IndexView.from_points(
        s["ids"], s["lat"], s["lon"], k=s["k"], min_area_m2=s["min_area"], max_area_m2=s["max_area"], seed=s["seed"]
    )


def _requests(s: dict[str, Any]) -> list[PrivacyProfile]:
    out = []
    for i in range(len(s["ids"])):
        amin = float(s["min_area"][i]) * (4.0 if s["bigger"][i] else 1.0)
        amax = float(s["max_area"][i])
        out.append(PrivacyProfile(k=int(s["k"][i]) + s["extra_k"][i], min_area_m2=min(amin, amax), max_area_m2=amax))
    return out


def _outcome(res: Any, ids: Sequence[str]) -> tuple[Any, ...]:
    if isinstance(res, Refusal):
        return ("refused", res.reason)
    assert isinstance(res, Region)
    return (res.bbox, res.k_achieved, res.area_m2, sorted(ids[r] for r in res.anon_set.tolist()))


@SETTINGS
@given(s=snapshots(), shuffle=st.randoms(use_true_random=False))
def test_per_cell_indexes_equal_the_single_process_cloaker_with_the_cell_map(s: dict[str, Any], shuffle: Any) -> None:
    """Proof 2: one index per cell, each cloaking its own users, answers as the single process does."""
    cm: CellMap = s["cells"]
    ids: list[str] = s["ids"]
    view = _global_view(s)
    single = HilbertCloak(cells=cm)
    requests = _requests(s)
    expected = {ids[r]: _outcome(single.cloak(view, r, requests[r]), ids) for r in range(len(ids))}
    batch = single.cloak_batch(view, np.arange(len(ids)), ProfileArrays.from_profiles(requests))
    for r in range(len(ids)):
        got = batch[r]
        if isinstance(got, Refusal):
            assert expected[ids[r]] == ("refused", got.reason)
        else:
            assert expected[ids[r]][:3] == (got.bbox, got.k_achieved, got.area_m2)

    # Each worker's index holds only its cell's users, assigned from the raw positions by the public
    # map, fed in an arbitrary order (a worker sees its users in arrival order, not the view's).
    cell = cm.cell_of(s["lat"], s["lon"])
    assert np.array_equal(cell, single.celled_state(view).cell)
    plain = HilbertCloak()  # a worker runs today's cloaker on its own index
    for c in range(cm.cells):
        rows = [r for r in range(len(ids)) if cell[r] == c]
        shuffle.shuffle(rows)
        sub = IndexView.from_points(
            [ids[r] for r in rows],
            s["lat"][rows],
            s["lon"][rows],
            k=s["k"][rows],
            min_area_m2=s["min_area"][rows],
            max_area_m2=s["max_area"][rows],
            seed=s["seed"],
        )
        sub_ids = sub.user_ids
        for local, r in enumerate(rows):
            assert _outcome(plain.cloak(sub, local, requests[r]), sub_ids) == expected[ids[r]], ids[r]


def test_one_cell_is_todays_cloaker() -> None:
    rng = np.random.default_rng(3)
    n = 500
    lat, lon = 39.9 + rng.normal(0, 0.002, n), 116.4 + rng.normal(0, 0.002, n)
    k = rng.integers(1, 8, n)
    view = IndexView.from_points([f"u{i}" for i in range(n)], lat, lon, k=k, min_area_m2=np.zeros(n), seed=5)
    profiles = [PrivacyProfile(k=int(k[i]) + (i % 3), min_area_m2=0.0) for i in range(n)]
    for cm in (CellMap([]), CellMap([0]), CellMap([4**29])):
        a = HilbertCloak().cloak_batch(view, np.arange(n), ProfileArrays.from_profiles(profiles))
        b = HilbertCloak(cells=cm).cloak_batch(view, np.arange(n), ProfileArrays.from_profiles(profiles))
        assert a.ok.sum() > n // 2
        for field in ("status", "bbox", "k_achieved", "area_m2"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        ga, gb = a.group, b.group
        assert np.array_equal(
            np.where(ga >= 0, ga * cm.cells + (0 if cm.cells == 1 else int(cm.cell_of(39.9, 116.4)[0])), -1), gb
        )


def test_buckets_restart_at_each_cell() -> None:
    """Users on both sides of a cut are never in one bucket, so regions stop at the cell edge's users."""
    n = 40
    lat = np.full(n, 39.9)
    lon = 116.4 + np.arange(n) * 1e-5
    view = IndexView.from_points([f"u{i}" for i in range(n)], lat, lon, k=np.full(n, 4), min_area_m2=np.zeros(n))
    hv = _hv(lat, lon)
    order = np.argsort(hv)
    cm = CellMap([int(hv[order[10]]), int(hv[order[30]])])  # cells of 10, 20 and 10 users
    cloaker = HilbertCloak(cells=cm)
    cs = cloaker.celled_state(view)
    assert [len(r) for r in cs.rows_of] == [10, 20, 10]
    p = PrivacyProfile(k=4, min_area_m2=0.0)
    for r in range(n):
        res = cloaker.cloak(view, r, p)
        assert isinstance(res, Region)
        assert set(cs.cell[res.anon_set].tolist()) == {cs.cell[r]}
        assert len(res.anon_set) >= 4
    # Today's cloaker, for contrast, puts users 8–11 of the curve (two cells) in one bucket.
    flat = HilbertCloak().cloak(view, int(order[10]), p)
    assert isinstance(flat, Region) and int(order[9]) in flat.anon_set.tolist()


# -- safety: regions from one cell's users against the global population ---------------------------


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 80),
    cells=st.integers(1, 9),
    sample=st.sampled_from(["snapshot", "other"]),
)
def test_cell_regions_hold_k_of_the_global_snapshot_and_are_reciprocal(
    seed: int, n: int, cells: int, sample: str
) -> None:
    """Proof 1 in miniature, judged by the independent checker against every present user."""
    rng = np.random.default_rng(seed)
    lat = np.round(39.9 + rng.normal(0, 0.0008, n), rng.integers(4, 7))
    lon = np.round(116.4 + rng.normal(0, 0.0008, n), rng.integers(4, 7))
    k = rng.integers(1, 6, n)
    min_area = rng.choice([0.0, 100.0, 2e4], n)
    ids = [f"u-{i}" for i in range(n)]
    if sample == "snapshot":
        cm = CellMap.balanced(lat, lon, cells=cells)
    else:  # boundaries from another day's population: cells may be lopsided or empty
        cm = CellMap.balanced(39.9 + rng.normal(0, 0.001, 50), 116.4 + rng.normal(0, 0.001, 50), cells=cells)
    index = PositionIndex(stale_after_s=60.0)
    for i in range(n):
        index.update(ids[i], float(lat[i]), float(lon[i]), 100.0)
        index.set_profile(ids[i], PrivacyProfile(k=int(k[i]), min_area_m2=float(min_area[i]), max_area_m2=4e6))
    view = index.snapshot(120.0, seed=seed)
    snap = Snapshot.from_arrays(ids, lat, lon, now=120.0)
    stored = {ids[i]: PrivacyProfile(k=int(k[i]), min_area_m2=float(min_area[i]), max_area_m2=4e6) for i in range(n)}
    cloaker = HilbertCloak(cells=cm)
    forwarded = 0
    for u, row in view.row_of.items():
        res = cloaker.cloak(view, row, stored[u])
        if isinstance(res, Refusal):
            continue
        forwarded += 1
        published = Published.of(res)
        found = check_region(snap, u, published, effective=stored[u], stored=stored, cloaker=cloaker, view=view)
        inside = len(users_inside(snap, _dec(published)))
        assert inside >= res.k_achieved >= stored[u].k
        # Only an under-claimed k_achieved is allowed (users of other cells inside the region).
        assert [v for v in found if not (v.property == Property.K_ACHIEVED and res.k_achieved < inside)] == [], found
    # With one cell everybody who can be served is: the cells never refuse more than they must.
    if cells == 1 and n >= int(k.max()):
        assert forwarded == n

    # The same from the workers' side: one PositionIndex per cell holding only that cell's users
    # (random tie salts, as a real worker draws them), today's cloaker, judged against everyone.
    cell = cm.cell_of(lat, lon)
    for c in range(cm.cells):
        worker = PositionIndex(stale_after_s=60.0)
        mine = [i for i in range(n) if cell[i] == c]
        for i in mine:
            worker.update(ids[i], float(lat[i]), float(lon[i]), 100.0)
            worker.set_profile(ids[i], stored[ids[i]])
        wview = worker.snapshot(120.0, seed=seed)
        for u, row in wview.row_of.items():
            res = HilbertCloak().cloak(wview, row, stored[u])
            if isinstance(res, Refusal):
                continue
            assert {wview.user_ids[r] for r in res.anon_set.tolist()} <= {ids[i] for i in mine}
            published = Published.of(res)
            found = check_region(snap, u, published, effective=stored[u], stored=stored)
            inside = len(users_inside(snap, _dec(published)))
            assert inside >= res.k_achieved >= stored[u].k
            assert [v for v in found if not (v.property == Property.K_ACHIEVED and res.k_achieved < inside)] == []


def _dec(published: Published) -> Any:
    from decimal import Decimal

    return tuple(Decimal(repr(float(v))) for v in published.bbox)
