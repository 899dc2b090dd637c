"""Fix intake's per-user rules, held against a model written from the contract (§1 rules 4 and 5,
§9 ``update_rate``/``update_burst``): a fix not newer than its user's last accepted one is
``out_of_order``; otherwise each user has a token bucket (``update_burst`` tokens, refilled at
``update_rate`` per second) and a fix without a token is ``rate_limited``. Refused fixes change
neither the user's last time nor (out of order) the bucket; what is accepted is what is stored.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.broker.config import CloakingConfig, LimitsConfig
from kcloak.broker.intake import FixIntake
from kcloak.broker.metrics import Metrics
from kcloak.broker.positions import Positions
from kcloak.broker.stores import MovementStore
from kcloak.cloaking.index import PositionIndex
from kcloak.core.profile import PrivacyProfile

NOW = 1_800_000_000.0
RATE, BURST = 2.0, 3  # a token every 0.5 s; the waits below are multiples of 0.25 s (exact in binary)

users = st.sampled_from(["ann", "bob", "cid"])
# (user, t step in seconds after the user's previous fix in the test): mostly newer, sometimes a repeat or older.
fix_step = st.tuples(users, st.sampled_from([-1, 0, 1, 1, 1, 2]))
submission = st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]), st.lists(fix_step, min_size=1, max_size=10))


def with_times(submissions: list[tuple[float, list[tuple[str, int]]]]) -> list[tuple[float, list[tuple[str, int]]]]:
    """The steps as t offsets (seconds after NOW - 60)."""
    at: dict[str, int] = {}
    out = []
    for wait, steps in submissions:
        fixes = []
        for user, step in steps:
            at[user] = at.get(user, 10) + step
            fixes.append((user, at[user]))
        out.append((wait, fixes))
    return out


def expected_codes(submissions: list[tuple[float, list[tuple[str, int]]]]) -> list[list[str | None]]:
    """The contract's outcome of each fix, computed on its own (no code shared with the broker)."""
    last: dict[str, float] = {}
    tokens: dict[str, float] = {}
    seen_at: dict[str, float] = {}
    clock = 0.0
    out: list[list[str | None]] = []
    for wait, fixes in submissions:
        clock += wait
        codes: list[str | None] = []
        for user, offset in fixes:
            t = NOW - 60 + offset
            if user in last and t <= last[user]:
                codes.append("out_of_order")
                continue
            have = min(BURST, tokens.get(user, BURST) + (clock - seen_at.get(user, clock)) * RATE)
            seen_at[user] = clock
            if have < 1:
                tokens[user] = have
                codes.append("rate_limited")
                continue
            tokens[user] = have - 1
            last[user] = t
            codes.append(None)
        out.append(codes)
    return out


async def run_intake(
    submissions: list[tuple[float, list[tuple[str, int]]]], where: Path
) -> tuple[list[list[str | None]], list[tuple[Any, ...]], dict[str, tuple[float, float, float] | None]]:
    clock = [0.0]
    index = PositionIndex(stale_after_s=600.0, default_profile=PrivacyProfile())
    async with MovementStore(where / "movement.sqlite3") as movement:
        intake = FixIntake(
            cloaking=CloakingConfig(),
            limits=LimitsConfig(update_rate=RATE, update_burst=BURST),
            metrics=Metrics(version="test", algorithm="test"),
            movement=movement,
            positions=Positions(index=index),
            clock=lambda: NOW,
            bucket_clock=lambda: clock[0],
        )
        got: list[list[str | None]] = []
        for wait, fixes in submissions:
            clock[0] += wait
            items: list[tuple[str, Any]] = [
                (user, {"t": NOW - 60 + offset, "lat": 39.9 + offset / 1000, "lon": 116.4}) for user, offset in fixes
            ]
            result = await intake.submit_fixes("mqtt", items)
            got.append([None if c is None else c.value for c in result.codes])
        stored = movement.fixes_between(0, float("inf"))
    return got, stored, {u: index.fix(u) for u in ("ann", "bob", "cid")}


@settings(max_examples=80, deadline=None)
@given(st.lists(submission, min_size=1, max_size=6))
def test_order_and_rate_decisions_follow_the_contract(steps: list[tuple[float, list[tuple[str, int]]]]) -> None:
    submissions = with_times(steps)
    with tempfile.TemporaryDirectory() as tmp:
        got, stored, latest = asyncio.run(run_intake(submissions, Path(tmp)))
    assert got == expected_codes(submissions)
    accepted = [
        (user, NOW - 60 + offset, 39.9 + offset / 1000, 116.4)
        for (_, fixes), codes in zip(submissions, got, strict=True)
        for (user, offset), code in zip(fixes, codes, strict=True)
        if code is None
    ]
    assert stored == sorted(accepted)  # ordered by user, then time, as the store reads them back
    for user in ("ann", "bob", "cid"):
        mine = [a for a in accepted if a[0] == user]
        assert latest[user] == (None if not mine else (mine[-1][2], mine[-1][3], mine[-1][1]))
