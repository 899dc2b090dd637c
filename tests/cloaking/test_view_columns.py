"""Views of a position index copy no column (docs/views.md, "Views that copy nothing"): each column
is read from the index on first use, with the values its rows had at the view's snapshot.

The test keeps its own record of every user's fix and stored profile at each snapshot, keeps some
views untouched while the index goes on (moves, same-place fixes, departures, arrivals reusing
freed rows, profile changes, time passing, further snapshots), and only then reads those views'
columns, in a random order, as a client reads them: each must equal the record of its own instant,
and a fresh ``hilbert`` cloaker on an old view must answer as on a view built from the record.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.cloakers.hilbert import HilbertCloak
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.geometry import coordinate_keys
from kcloak.core.profile import PrivacyProfile

from .test_incremental_views import PROFILES, STALE_S, T0, Truth, outcome, reference_view, requests_of

COLUMNS = ["lat", "lon", "t", "k", "min_area_m2", "max_area_m2", "salt", "lon_key", "lat_key"]


@st.composite
def histories(draw: Any) -> tuple[list[list[tuple[Any, ...]]], list[int]]:
    """Steps of operations on users ``u0 … u29``; after each step a snapshot."""
    steps = []
    for _ in range(draw(st.integers(2, 7))):
        ops = []
        for _ in range(draw(st.integers(0, 20))):
            kind = draw(st.sampled_from(["fix", "fix", "fix", "same", "leave", "profile", "age"]))
            who = f"u{draw(st.integers(0, 29))}"
            lat = float(f"{39.9 + draw(st.integers(0, 50)) * 1e-5:.5f}")
            lon = float(f"{116.4 + draw(st.integers(0, 50)) * 1e-5:.5f}")
            ops.append((kind, who, lat, lon, draw(st.integers(0, len(PROFILES) - 1)), draw(st.integers(0, 9))))
        steps.append(ops)
    # Which views to read late, and in which order of columns (a permutation seed each).
    reads = draw(st.lists(st.integers(0, len(steps) - 1), min_size=1, max_size=len(steps)))
    return steps, reads


Record = tuple[dict[str, tuple[float, float, float]], dict[str, PrivacyProfile], float, dict[str, int]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.integers(0, 2**32 - 1))
def test_an_untouched_view_reads_its_own_instant_after_the_index_moved_on(
    history: tuple[list[list[tuple[Any, ...]]], list[int]], order_seed: int
) -> None:
    steps, reads = history
    index = PositionIndex(stale_after_s=STALE_S)
    truth = Truth()
    now = T0
    views: list[tuple[IndexView, Record]] = []
    removals: dict[str, int] = {}  # times each user was removed (a user back after one has a new salt)
    for ops in steps:
        now += 1.0
        for kind, u, lat, lon, p, age in ops:
            if kind == "fix":
                t = now - age * 10.0
                index.update(u, lat, lon, t)
                truth.fixes[u] = (lat, lon, t)
                truth.profiles.setdefault(u, PrivacyProfile())
            elif kind == "same" and u in truth.fixes:
                la, lo, _ = truth.fixes[u]
                index.update(u, la, lo, now)
                truth.fixes[u] = (la, lo, now)
            elif kind == "leave":
                index.remove(u)
                removals[u] = removals.get(u, 0) + 1
                truth.fixes.pop(u, None)
                truth.profiles.pop(u, None)
            elif kind == "profile" and u in truth.fixes:
                index.set_profile(u, PROFILES[p])
                truth.profiles[u] = PROFILES[p]
            elif kind == "age":
                now += 20.0
        view = index.snapshot(now, epoch=len(views) + 1, seed=len(views) + 1)
        views.append((view, (dict(truth.fixes), dict(truth.profiles), now, dict(removals))))
    rng = np.random.default_rng(order_seed)
    for i in reads:
        view, (fixes, profiles, at, removed) = views[i]
        present = sorted(u for u, (_, _, t) in fixes.items() if t >= at - STALE_S)
        ids = view.user_ids
        assert sorted(ids) == present
        want: dict[str, list[Any]] = {
            "lat": [fixes[u][0] for u in ids],
            "lon": [fixes[u][1] for u in ids],
            "t": [fixes[u][2] for u in ids],
            "k": [profiles[u].k for u in ids],
            "min_area_m2": [profiles[u].min_area_m2 for u in ids],
            "max_area_m2": [profiles[u].max_area_m2 for u in ids],
        }
        for name in rng.permutation(COLUMNS).tolist():
            got = getattr(view, name)
            if name in want:
                assert got.tolist() == want[name], name
            elif name == "lon_key":
                assert got.tolist() == coordinate_keys(np.array(want["lon"], np.float64)).tolist()
            elif name == "lat_key":
                assert got.tolist() == coordinate_keys(np.array(want["lat"], np.float64)).tolist()
        # The salt is the index's own: it must be the one of the same user in the latest view.
        latest, removed_by_then = views[-1][0], views[-1][1][3]
        for u, s in zip(ids, view.salt.tolist(), strict=True):
            r = latest.row(u)
            if r is not None and removed.get(u, 0) == removed_by_then.get(u, 0):  # not removed since
                assert int(latest.salt[r]) == s
        # A fresh cloaker on the old view answers as on a view built from the record of its instant.
        record = Truth(fixes=fixes, profiles=profiles)
        salts = dict(zip(ids, view.salt.tolist(), strict=True))
        ref = reference_view(record, at, salts, view.epoch, view.seed)
        mine, theirs = HilbertCloak(), HilbertCloak()
        for u in ids:
            for req in requests_of(profiles[u]):
                got_r = outcome(mine.cloak(view, ids.index(u), req), ids)
                want_r = outcome(theirs.cloak(ref, ref.row_of[u], req), ref.user_ids)
                assert got_r == want_r
