"""The pipeline's parts run alone: fix intake without a cloaker, cloaking without fix intake.

A cluster will run them in different processes, so neither may need the other's state: intake
gets a movement store and the positions it writes to; a cloaking mode gets positions (filled
directly here) and a user with its effective profile. The mode is the one the cloaker declares.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kcloak.broker.config import CloakingConfig, LimitsConfig, QueuesConfig
from kcloak.broker.forwarding import Timing
from kcloak.broker.history import RecentFixes
from kcloak.broker.intake import FixIntake
from kcloak.broker.metrics import Metrics
from kcloak.broker.modes import (
    BATCH_MIN,
    Cloaked,
    HeldCloaking,
    SnapshotCloaking,
    TemporalCloaking,
    Views,
    build_cloaker,
    serving_mode,
)
from kcloak.broker.positions import Positions
from kcloak.broker.stores import MovementStore
from kcloak.cloaking.cloakers import BatchResult, CloakMode, CloakResult, Refusal, cloak_each, get_cloaker
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

PROFILE = PrivacyProfile(k=5, max_area_m2=2.5e9, max_delay_s=5.0)


STALE = (
    "no recent fix from you (present = a fix within the presence window, 60 s shipped): send a fix first, "
    "or put lat, lon and t in the query"
)


def metrics() -> Metrics:
    return Metrics(version="test", algorithm="test")


def crowd(n: int, t: float) -> list[tuple[str, float, float, float]]:
    """``n`` users around Beijing as ``(user, t, lat, lon)``."""
    rng = np.random.default_rng(3)
    return [
        (f"u{i:03d}", t, 39.9 + float(rng.uniform(-0.01, 0.01)), 116.4 + float(rng.uniform(-0.01, 0.01)))
        for i in range(n)
    ]


def positions_of(fixes: list[tuple[str, float, float, float]], *, history: bool = False) -> Positions:
    """Positions filled directly, as a cluster's cloaking node would receive them (no intake)."""
    index = PositionIndex(stale_after_s=60.0, default_profile=PrivacyProfile())
    positions = Positions(index=index, history=RecentFixes(3600.0) if history else None)
    positions.apply(fixes)
    return positions


@pytest.fixture
async def movement(tmp_path: Path) -> AsyncIterator[MovementStore]:
    async with MovementStore(tmp_path / "movement.sqlite3") as store:
        yield store


async def test_fix_intake_runs_with_a_store_and_positions_only(movement: MovementStore) -> None:
    index = PositionIndex(stale_after_s=60.0, default_profile=PrivacyProfile())
    positions = Positions(index=index)
    intake = FixIntake(
        cloaking=CloakingConfig(), limits=LimitsConfig(), metrics=metrics(), movement=movement, positions=positions
    )
    now = time.time()
    items: list[tuple[str, Any]] = [
        ("ann", {"t": now - 5, "lat": 39.9, "lon": 116.4}),
        ("ann", {"t": now - 9, "lat": 39.8, "lon": 116.3}),  # older than ann's last: out of order
        ("bob", {"t": now - 5, "lat": 100.0, "lon": 116.4}),  # no such latitude
        ("bob", {"t": now - 4000, "lat": 39.9, "lon": 116.4}),  # beyond max_update_age_s
        ("cid", {"t": now - 2, "lat": 39.91, "lon": 116.41}),
    ]
    result = await intake.submit_fixes("http", items)
    assert result.codes == [None, ReasonCode.OUT_OF_ORDER, ReasonCode.INVALID, ReasonCode.TOO_OLD, None]
    # Stored ahead, then applied: the index, the version and the store agree.
    assert index.fix("ann") == (39.9, 116.4, now - 5) and index.fix("cid") == (39.91, 116.41, now - 2)
    assert index.fix("bob") is None
    assert positions.version == 1 and positions.user_version("ann") == 1
    stored = movement.fixes_between(0, math.inf)
    assert stored == [("ann", now - 5, 39.9, 116.4), ("cid", now - 2, 39.91, 116.41)]
    # A restarted intake (new positions, same store) reloads each present user's latest fix.
    again = Positions(index=PositionIndex(stale_after_s=60.0, default_profile=PrivacyProfile()))
    restarted = FixIntake(
        cloaking=CloakingConfig(), limits=LimitsConfig(), metrics=metrics(), movement=movement, positions=again
    )
    assert restarted.restore() == 2
    assert again.fix("ann") == (39.9, 116.4, now - 5)
    res = await restarted.submit_fixes("mqtt", [("ann", {"t": now - 6, "lat": 39.9, "lon": 116.4})])
    assert res.codes == [ReasonCode.OUT_OF_ORDER]  # the restored fix still orders ann's fixes


async def test_a_query_waits_for_an_earlier_fix_when_a_later_one_was_decided_first(movement: MovementStore) -> None:
    """A later fix of the user that is rejected at once (no commit to wait for) is decided before
    an earlier accepted one still being committed: the query must still wait for the earlier one."""
    positions = Positions(index=PositionIndex(stale_after_s=60.0, default_profile=PrivacyProfile()))
    intake = FixIntake(
        cloaking=CloakingConfig(), limits=LimitsConfig(), metrics=metrics(), movement=movement, positions=positions
    )
    now = time.time()
    first = intake.enqueue_fixes("mqtt", [("ann", {"t": now - 5, "lat": 39.9, "lon": 116.4})])
    other = intake.enqueue_fixes("mqtt", [("bob", {"t": now - 5, "lat": 39.8, "lon": 116.3})])
    await asyncio.sleep(0)  # the first fix is validated and waits for its commit
    rejected = intake.enqueue_fixes("mqtt", [("ann", {"t": now - 9, "lat": 39.7, "lon": 116.2})])
    await asyncio.wait_for(rejected, 5)
    assert (await rejected).codes == [ReasonCode.OUT_OF_ORDER]
    await asyncio.wait_for(intake.own_fixes_decided("ann"), 5)
    assert first.done()
    assert positions.fix("ann") == (39.9, 116.4, now - 5)
    await asyncio.wait_for(other, 5)
    await asyncio.wait_for(intake.own_fixes_decided("ann"), 5)  # nothing pending: returns at once


@pytest.mark.parametrize("size", [3, 40, 600])
def test_a_batch_of_fixes_leaves_each_user_at_its_last_fix(size: int) -> None:
    """Small and large batches (the latter written column by column) end alike: each user at the
    last of its fixes in the batch, new and known users, a user named several times included."""
    positions = positions_of(crowd(5, 100.0))
    rng = np.random.default_rng(size)
    batch = [
        (f"u{int(rng.integers(0, 9)):03d}", 200.0 + i, 39.0 + float(rng.uniform()), 116.0 + float(rng.uniform()))
        for i in range(size)
    ]
    before = positions.version
    positions.apply(batch)
    expected = {user: (lat, lon, t) for user, t, lat, lon in batch}
    for user in {f"u{i:03d}" for i in range(9)}:
        assert positions.fix(user) == expected.get(user, positions.fix(user))
        if user in expected:
            assert positions.user_version(user) == before + 1
    assert len(positions) == len({f"u{i:03d}" for i in range(5)} | set(expected))


async def test_snapshot_cloaking_runs_on_positions_filled_directly() -> None:
    now = time.time()
    positions = positions_of(crowd(40, now))
    views = Views(positions=positions, metrics=metrics())
    mode = serving_mode(
        get_cloaker("hilbert"), positions=positions, views=views, metrics=metrics(), queues=QueuesConfig()
    )
    assert isinstance(mode, SnapshotCloaking)
    task = asyncio.create_task(mode.run())
    try:
        out = await asyncio.gather(*(mode.cloak(f"u{i:03d}", PROFILE, Timing()) for i in range(20)))
        gone = await mode.cloak("nobody", PROFILE, Timing())
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for i, cloaked in enumerate(out):
        assert isinstance(cloaked, Cloaked) and cloaked.view is not None
        lat, lon, _ = positions.fix(f"u{i:03d}") or (0.0, 0.0, 0.0)
        assert (cloaked.lat, cloaked.lon) == (lat, lon)
        lon0, lat0, lon1, lat1 = cloaked.region.bbox.to_geojson()
        assert lon0 < lon < lon1 and lat0 < lat < lat1
        assert cloaked.region.k_achieved >= PROFILE.k
    assert gone == Refusal(ReasonCode.STALE_POSITION, STALE)


async def test_held_cloaking_releases_a_clique_from_positions_filled_directly() -> None:
    now = time.time()
    fixes = [(f"h{i}", now, 39.9 + i * 1e-4, 116.4 + i * 1e-4) for i in range(3)]
    positions = positions_of(fixes)
    views = Views(positions=positions, metrics=metrics())
    mode = serving_mode(
        build_cloaker("clique", cloaking=CloakingConfig()),
        positions=positions,
        views=views,
        metrics=metrics(),
        queues=QueuesConfig(),
    )
    assert isinstance(mode, HeldCloaking)
    profile = PrivacyProfile(k=3, max_area_m2=1e7, max_delay_s=5.0)
    task = asyncio.create_task(mode.run())
    try:
        out = await asyncio.gather(*(mode.cloak(u, profile, Timing()) for u, *_ in fixes))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert all(isinstance(c, Cloaked) for c in out)
    boxes = {c.region.bbox for c in out if isinstance(c, Cloaked)}
    assert len(boxes) == 1 and all(c.region.k_achieved == 3 for c in out if isinstance(c, Cloaked))


WINDOW_START = 1_800_000_000  # a multiple of the 60 s temporal window grid (CONCEPTS §5.1)


async def _temporal_query(first_fix_t: float, clock_t: float, max_delay_s: float) -> Cloaked | Refusal:
    """t0…t5 one metre apart, a fix a second from ``first_fix_t`` on; t5 asks at the fixed ``clock_t``.

    The clock is injected (``Views(clock=…)``): which fixes fall inside the aligned window must not
    depend on where the wall clock stands on the minute grid.
    """
    fixes = [(f"t{i}", first_fix_t + i, 39.9 + i * 1e-5, 116.4 + i * 1e-5) for i in range(6)]
    positions = positions_of(fixes, history=True)
    views = Views(positions=positions, metrics=metrics(), clock=lambda: clock_t)
    cloaker = build_cloaker("temporal", cloaking=CloakingConfig())
    mode = serving_mode(cloaker, positions=positions, views=views, metrics=metrics(), queues=QueuesConfig())
    assert isinstance(mode, TemporalCloaking)
    return await mode.cloak("t5", PrivacyProfile(k=3, max_area_m2=1e8, max_delay_s=max_delay_s), Timing())


async def test_temporal_cloaking_reads_the_history_of_positions_filled_directly() -> None:
    fixes_t = [WINDOW_START + 10.0 + i for i in range(6)]
    cloaked = await _temporal_query(fixes_t[0], WINDOW_START + 40.0, max_delay_s=5.0)
    assert isinstance(cloaked, Cloaked) and cloaked.view is None
    region = cloaked.region
    assert region.algorithm == "temporal"
    # the aligned window of t5's fix, ending at the fix itself (k = 3 users were there before it)
    t_start, t_end = region.t_start, region.t_end
    assert (t_start, t_end) == (WINDOW_START, WINDOW_START + 15) and t_start is not None and t_end is not None
    lon0, lat0, lon1, lat1 = region.bbox.to_geojson()
    inside = [
        i
        for i in range(6)
        if lon0 < 116.4 + i * 1e-5 < lon1 and lat0 < 39.9 + i * 1e-5 < lat1 and t_start <= fixes_t[i] <= t_end
    ]
    assert len(inside) >= 3 and region.k_achieved == len(inside)


async def test_temporal_fixes_before_the_window_start_do_not_count() -> None:
    """The fixes straddle a window boundary: only two fall in t5's window, so the query expires."""
    cloaked = await _temporal_query(WINDOW_START - 4.0, WINDOW_START + 40.0, max_delay_s=0.3)
    assert isinstance(cloaked, Refusal) and cloaked.reason == ReasonCode.EXPIRED


class _Counting:
    """A snapshot cloaker under a name no registry knows: the mode follows what it declares."""

    name: ClassVar[str] = "counting"
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    vectorized: ClassVar[bool] = False

    def __init__(self) -> None:
        self.inner = get_cloaker("nn")
        self.batches = 0

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        result: CloakResult = self.inner.cloak(view, row, profile)
        return result

    def cloak_batch(self, view: IndexView, rows: Any, profiles: ProfileArrays) -> BatchResult:
        self.batches += 1
        return cloak_each(self, view, rows, profiles)


class _CountingVectorized(_Counting):
    vectorized: ClassVar[bool] = True


@pytest.mark.parametrize("cls", [_Counting, _CountingVectorized])
async def test_micro_batching_follows_the_declared_capability(cls: type[_Counting]) -> None:
    now = time.time()
    positions = positions_of(crowd(60, now))
    cloaker = cls()
    mode = serving_mode(
        cloaker,
        positions=positions,
        views=Views(positions=positions, metrics=metrics()),
        metrics=metrics(),
        queues=QueuesConfig(),
    )
    assert isinstance(mode, SnapshotCloaking)
    jobs = [mode.cloak(f"u{i:03d}", PROFILE, Timing()) for i in range(2 * BATCH_MIN)]
    queued = [asyncio.ensure_future(j) for j in jobs]
    await asyncio.sleep(0)  # every query is queued before the worker starts: one micro-batch
    task = asyncio.create_task(mode.run())
    try:
        out = await asyncio.gather(*queued)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert all(isinstance(c, Cloaked) for c in out)
    assert cloaker.batches == (1 if cls.vectorized else 0)


def test_the_present_count_is_the_number_of_users_a_view_holds() -> None:
    """What housekeeping sets the presence gauge to: the users a snapshot at that instant would hold
    (fresh, at the stale edge, stale, removed, re-added), counted by the test from its own record."""
    index = PositionIndex(stale_after_s=60.0)
    positions = Positions(index=index)
    fixes = [(f"u{i:03d}", 1000.0 - 10 * i, 39.9, 116.4) for i in range(20)]  # t from 1000 down to 810
    positions.apply(fixes)
    index.remove("u001")
    index.remove("u003")
    positions.apply([("u003", 1001.0, 39.9, 116.4)])
    record = {user: t for user, t, _, _ in fixes if user not in ("u001", "u003")} | {"u003": 1001.0}
    for now in (1000.0, 1010.0, 1060.0, 1200.0):
        expected = sum(1 for t in record.values() if t >= now - 60.0)
        assert positions.present_count(now) == expected == len(positions.snapshot(now))
