"""k-sharing with memorization (CONCEPTS §6.5, contract §6) against the independent checker.

Every refresh region is judged from the raw fixes by :mod:`kcloak.cloaking.checks` (brute force,
exact decimal containment): every present member of the group is strictly inside, at least k
members are present, the region itself passes :func:`check_region`, and the intersection of
the user sets of all the session's regions keeps at least k users.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcloak.cloaking.checks import (
    EARTH_RADIUS_M,
    Published,
    Snapshot,
    area_m2,
    check_region,
    strictly_inside,
    tight_box,
    users_inside,
)
from kcloak.cloaking.cloakers import Refusal, Region, get_cloaker
from kcloak.cloaking.continuous import SessionError, SharedGroup, ends_session
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.profile import PrivacyProfile, ReasonCode

NOW = 1_700_000_000.0
STALE_S = 60.0
STEP_S = 40.0


@dataclass
class World:
    """Raw latest fixes per user; views come from a real :class:`PositionIndex`, the checker's
    snapshot from the raw fixes (presence recomputed independently)."""

    fixes: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    now: float = NOW

    def put(self, user: str, lat: float, lon: float, t: float | None = None) -> None:
        self.fixes[user] = (lat, lon, self.now if t is None else t)

    def view(self) -> IndexView:
        index = PositionIndex(stale_after_s=STALE_S)
        for u, (lat, lon, t) in self.fixes.items():
            index.update(u, lat, lon, t)
        return index.snapshot(self.now)

    def snapshot(self) -> Snapshot:
        ids = list(self.fixes)
        lat = [self.fixes[u][0] for u in ids]
        lon = [self.fixes[u][1] for u in ids]
        t = [self.fixes[u][2] for u in ids]
        return Snapshot.from_arrays(ids, lat, lon, t, now=self.now, stale_after_s=STALE_S)


def dec_box(region: Region) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    b = region.bbox.to_geojson()
    return Decimal(repr(b[0])), Decimal(repr(b[1])), Decimal(repr(b[2])), Decimal(repr(b[3]))


def assert_session_region(
    world: World, querier: str, region: Region, group: set[str], profile: PrivacyProfile
) -> set[str]:
    """The observable guarantee of contract §6 for one forwarded region; returns its user set."""
    snap = world.snapshot()
    assert check_region(snap, querier, Published.of(region), effective=profile) == []
    box = dec_box(region)
    present = [u for u in group if u in snap.present_row]
    assert len(present) >= profile.k
    for u in present:
        r = snap.present_row[u]
        assert strictly_inside(float(snap.present_lat[r]), float(snap.present_lon[r]), box), u
    return set(users_inside(snap, box))


def grown_area_m2(box: tuple[Decimal, Decimal, Decimal, Decimal], min_area_m2: float) -> float:
    """Area of the tightest published box after the CONCEPTS §2.5 growth (width to √A first, then
    height), restated in local metres: the smallest region the session's rule can forward."""
    lon0, lat0, lon1, lat1 = (float(e) for e in box)
    area = area_m2(lon0, lat0, lon1, lat1)
    if area >= min_area_m2:
        return area
    w = EARTH_RADIUS_M * math.radians(lon1 - lon0) * math.cos(math.radians((lat0 + lat1) / 2))
    h = EARTH_RADIUS_M * math.radians(lat1 - lat0)
    w2 = max(w, math.sqrt(min_area_m2))
    return w2 * max(h, min_area_m2 / w2)


def start_session(world: World, querier: str, profile: PrivacyProfile, algorithm: str = "nn") -> SharedGroup:
    view = world.view()
    row = view.row(querier)
    assert row is not None
    first = get_cloaker(algorithm).cloak(view, row, profile)
    assert isinstance(first, Region)
    return SharedGroup.start(view, querier, first, profile)


def line_world(n: int, step_deg: float = 0.001) -> World:
    w = World()
    for i in range(n):
        w.put(f"u{i}", 39.9 + i * step_deg / 7, 116.4 + i * step_deg)
    return w


# -- worked examples ---------------------------------------------------------------------------


def test_group_is_the_users_inside_the_first_region_and_follows_them() -> None:
    w = line_world(10)
    p = PrivacyProfile(k=3, max_area_m2=2.5e9)
    g = start_session(w, "u0", p)
    first_users = set(users_inside(w.snapshot(), dec_box(get_cloaker("nn").cloak(w.view(), 0, p))))
    assert g.members == frozenset(first_users)
    assert {"u0", "u1", "u2"} <= g.members
    # Everyone drifts apart: the group's members are followed wherever they go.
    for i in range(10):
        w.put(f"u{i}", 39.9 + i * 0.01, 116.4 - i * 0.013, NOW + 5)
    w.now = NOW + 5
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Region)
    assert_session_region(w, "u0", r, set(g.members), p)
    assert g.members == frozenset(first_users)


def test_absent_members_leave_for_good_and_newcomers_never_join() -> None:
    w = line_world(6)
    p = PrivacyProfile(k=3, min_area_m2=4e6, max_area_m2=2.5e9)
    g = start_session(w, "u0", p)
    members = set(g.members)
    assert len(members) == 6  # the area floor takes in the whole line
    leaver = sorted(members - {"u0"})[0]
    w.now = NOW + 90  # everyone else's fix is now stale
    w.put("u0", 39.9, 116.4)
    for u in members - {"u0", leaver}:
        w.put(u, 39.9005, 116.4005)
    w.put("newcomer", 39.9001, 116.4001)
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Region)
    assert leaver not in g.members and "newcomer" not in g.members
    # The leaver comes back: it stays out of G.
    w.now += 10
    for u in [*members, "newcomer"]:
        w.put(u, 39.9002, 116.4002)
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Region)
    assert leaver not in g.members
    assert_session_region(w, "u0", r, set(g.members), p)


def test_stale_querier_is_refused_and_the_session_stays_active() -> None:
    w = line_world(5)
    p = PrivacyProfile(k=3, max_area_m2=2.5e9)
    g = start_session(w, "u0", p)
    before = g.members
    w.now = NOW + 61
    for u in before - {"u0"}:
        w.put(u, 39.9, 116.4001)
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Refusal) and r.reason is ReasonCode.STALE_POSITION
    assert not ends_session(r) and not g.ended
    assert g.members == before  # nobody dropped while the querier is stale
    w.put("u0", 39.9, 116.4)
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Region)


def test_fewer_than_k_present_members_ends_the_session() -> None:
    w = line_world(4)
    p = PrivacyProfile(k=3, max_area_m2=2.5e9)
    g = start_session(w, "u0", p)
    w.now = NOW + 61
    w.put("u0", 39.9, 116.4)
    for i in range(4, 40):  # many present users, but none of them in G
        w.put(f"x{i}", 39.9, 116.4 + i * 1e-5)
    w.put(sorted(g.members - {"u0"})[0], 39.9, 116.40001)
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Refusal) and r.reason is ReasonCode.K_UNREACHABLE
    assert ends_session(r) and g.ended
    # Ended for good, even when the members come back.
    for u in g.members:
        w.put(u, 39.9, 116.4002)
    again = g.refresh(w.view(), "u0", p)
    assert isinstance(again, Refusal) and again.reason is ReasonCode.K_UNREACHABLE


def test_group_spreading_beyond_max_area_ends_the_session() -> None:
    w = line_world(5, step_deg=0.0001)
    p = PrivacyProfile(k=3, max_area_m2=1e6)
    g = start_session(w, "u0", p)
    w.now = NOW + 5
    far = sorted(g.members - {"u0"})[0]
    w.put(far, 40.1, 116.6)  # ~20 km away
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Refusal) and r.reason is ReasonCode.AREA_EXCEEDED
    assert ends_session(r) and g.ended


def test_region_grows_to_min_area_about_the_group() -> None:
    w = line_world(5, step_deg=0.00001)
    p = PrivacyProfile(k=3, min_area_m2=250_000.0, max_area_m2=1e6)
    g = start_session(w, "u0", p)
    w.now = NOW + 1
    r = g.refresh(w.view(), "u0", p)
    assert isinstance(r, Region)
    assert r.area_m2 >= 250_000.0
    assert_session_region(w, "u0", r, set(g.members), p)


def test_world_edge_group() -> None:
    w = World()
    for i in range(4):
        w.put(f"e{i}", 89.9999 + i * 1e-5, 180.0 - i * 1e-5)
    w.put("e0", 90.0, 180.0)
    p = PrivacyProfile(k=4, max_area_m2=2.5e9)
    g = start_session(w, "e0", p)
    w.now = NOW + 1
    r = g.refresh(w.view(), "e0", p)
    assert isinstance(r, Region)
    assert_session_region(w, "e0", r, set(g.members), p)


def test_start_rejects_a_region_without_the_querier_or_k_users() -> None:
    w = line_world(6)
    view = w.view()
    p = PrivacyProfile(k=3, max_area_m2=2.5e9)
    region = get_cloaker("nn").cloak(view, view.row("u5"), p)
    assert isinstance(region, Region)
    with pytest.raises(SessionError):
        SharedGroup.start(view, "u0", region, p)
    with pytest.raises(SessionError):
        SharedGroup.start(view, "u5", region, PrivacyProfile(k=region.k_achieved + 1, max_area_m2=2.5e9))


def test_without_memorization_the_intersection_shrinks_below_k() -> None:
    """Query tracking (CONCEPTS §6.5): independent cloaks, intersected, single out the querier;
    the same movements with a shared group keep k candidates."""
    k = 3
    p = PrivacyProfile(k=k, max_area_m2=2.5e9)
    w = World()
    # Two clusters; the querier's neighbours change at every step while it stays put.
    for i in range(12):
        w.put(f"u{i}", 39.9 + (i % 6) * 1e-4, 116.4 + (i // 6) * 0.05 + (i % 6) * 1e-4)
    nn = get_cloaker("nn")
    g = start_session(w, "u0", p)
    naive: set[str] | None = None
    shared: set[str] | None = None
    rng = np.random.default_rng(3)
    for step in range(1, 8):
        w.now = NOW + step * 5
        for i in range(1, 12):
            w.put(f"u{i}", 39.9 + float(rng.uniform(-0.01, 0.01)), 116.4 + float(rng.uniform(-0.01, 0.01)))
        w.put("u0", 39.9, 116.4)
        view = w.view()
        snap = w.snapshot()
        plain = nn.cloak(view, view.row("u0"), p)
        assert isinstance(plain, Region)
        users = set(users_inside(snap, dec_box(plain)))
        naive = users if naive is None else naive & users
        r = g.refresh(view, "u0", p)
        assert isinstance(r, Region)
        s_users = assert_session_region(w, "u0", r, set(g.members), p)
        shared = s_users if shared is None else shared & s_users
    assert naive is not None and shared is not None
    assert "u0" in naive and len(naive) < k
    assert len(shared) >= k and g.members <= shared


# -- property test over random movement ---------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(3, 40),
    k=st.integers(1, 8),
    steps=st.integers(1, 10),
    move_deg=st.sampled_from([0.0, 1e-5, 1e-3, 0.02]),
    p_silent=st.sampled_from([0.0, 0.2, 0.5]),
    min_area=st.sampled_from([0.0, 1e5, 3e6]),
    max_area=st.sampled_from([4e6, 2.5e9]),
    place=st.sampled_from(["city", "one_point", "grid", "world_edge"]),
    algorithm=st.sampled_from(["nn", "hilbert", "casper"]),
)
def test_every_refresh_keeps_k_present_members_strictly_inside(
    seed: int,
    n: int,
    k: int,
    steps: int,
    move_deg: float,
    p_silent: float,
    min_area: float,
    max_area: float,
    place: str,
    algorithm: str,
) -> None:
    rng = np.random.default_rng(seed)
    p = PrivacyProfile(k=k, min_area_m2=min_area, max_area_m2=max_area)
    w = World()
    if place == "world_edge":
        lat0, lon0 = 89.99, 179.99
    else:
        lat0, lon0 = float(rng.uniform(-60, 60)), float(rng.uniform(-170, 170))
    decimals = int(rng.choice([4, 5, 6]))

    def position() -> tuple[float, float]:
        if place == "one_point":
            return lat0, lon0
        if place == "grid":  # on a 4-, 5- or 6-decimal grid: whole micro-degrees as clients send them
            scale = 10**decimals
            return (
                (round(lat0 * scale) + int(rng.integers(0, 20))) / scale,
                (round(lon0 * scale) + int(rng.integers(0, 20))) / scale,
            )
        lat = min(90.0, lat0 + float(rng.uniform(-0.01, 0.01)))
        lon = min(180.0, lon0 + float(rng.uniform(-0.01, 0.01)))
        return lat, lon

    for i in range(n):
        w.put(f"u{i}", *position())
    view = w.view()
    first = get_cloaker(algorithm).cloak(view, 0, p)
    if not isinstance(first, Region):
        return
    g = SharedGroup.start(view, "u0", first, p)
    expected = set(users_inside(w.snapshot(), dec_box(first)))
    assert g.members == frozenset(expected) and len(expected) >= k
    intersection = set(expected)
    for step in range(1, steps + 1):
        w.now = NOW + step * STEP_S
        for i in range(n + 3):
            u = f"u{i}"
            if rng.random() < p_silent:
                continue  # no fix this step: stale after two silent steps
            old = w.fixes.get(u)
            if old is None or move_deg == 0.0:
                lat, lon = position() if old is None else old[:2]
            else:
                lat = float(np.clip(old[0] + rng.uniform(-move_deg, move_deg), -90, 90))
                lon = float(np.clip(old[1] + rng.uniform(-move_deg, move_deg), -180, 180))
            w.put(u, lat, lon)
        snap = w.snapshot()
        was_ended = g.ended
        r = g.refresh(w.view(), "u0", p)
        if was_ended:
            assert isinstance(r, Refusal) and ends_session(r)
            continue
        if "u0" not in snap.present_row:
            assert isinstance(r, Refusal) and r.reason is ReasonCode.STALE_POSITION
            assert g.members == frozenset(expected)
            continue
        expected = {u for u in expected if u in snap.present_row}
        assert g.members == frozenset(expected)
        if len(expected) < k:
            assert isinstance(r, Refusal) and r.reason is ReasonCode.K_UNREACHABLE and g.ended
            continue
        if isinstance(r, Refusal):
            assert r.reason is ReasonCode.AREA_EXCEEDED and g.ended
            if place == "world_edge":
                continue  # growth to min_area_m2 next to a pole may overshoot: a refusal, never unsafe
            rows = [snap.present_row[u] for u in expected]
            tight = tight_box(snap.present_lat[rows].tolist(), snap.present_lon[rows].tolist())
            assert grown_area_m2(tight, min_area) > max_area * (1 - 1e-3)
            continue
        users = assert_session_region(w, "u0", r, expected, p)
        intersection &= users
        assert expected <= intersection
        assert len(intersection) >= k
        assert math.isfinite(r.area_m2)
