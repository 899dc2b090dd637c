"""Per-user token buckets (contract §9 ``[limits]``): burst, refill at the rate, forgetting full ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.broker import ratelimit
from kcloak.broker.ratelimit import TokenBuckets


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_burst_then_the_rate() -> None:
    clock = Clock()
    b = TokenBuckets(rate=2.0, burst=5, clock=clock)
    assert [b.take("ann") for _ in range(6)] == [True] * 5 + [False]
    assert b.take("bob")  # buckets are per key
    clock.t += 0.49  # 0.98 tokens back: not yet one
    assert not b.take("ann")
    clock.t += 0.02
    assert b.take("ann") and not b.take("ann")
    clock.t += 100.0  # refilled up to the burst, not beyond
    assert [b.take("ann") for _ in range(6)] == [True] * 5 + [False]
    assert not b.take("cid", 6) and b.take("cid", 5)  # more than the burst at once: never


def test_refusals_take_nothing() -> None:
    clock = Clock()
    b = TokenBuckets(rate=1.0, burst=2, clock=clock)
    assert b.take("ann") and b.take("ann")
    for _ in range(10):
        assert not b.take("ann")
    clock.t += 1.0
    assert b.take("ann")


def test_a_rate_of_zero_never_refills() -> None:
    clock = Clock()
    b = TokenBuckets(rate=0.0, burst=3, clock=clock)
    assert [b.take("ann") for _ in range(4)] == [True, True, True, False]
    clock.t += 1e6
    assert not b.take("ann")


def test_full_buckets_are_forgotten_and_start_full_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "PRUNE_ABOVE", 10)
    clock = Clock()
    b = TokenBuckets(rate=1.0, burst=3, clock=clock)
    for i in range(10):
        assert b.take(f"u{i}")
    assert b.take("ann") and b.take("ann") and b.take("ann") and not b.take("ann")
    clock.t += 1.5  # the u* buckets are full again; ann's is not (1.5 of 3 tokens)
    for i in range(12):  # past twice the keys the last pruning (at ann's first take) left: the full ones go
        assert b.take(f"n{i}")
    assert set(b._state) == {"ann", *(f"n{i}" for i in range(12))}
    assert b.take("ann") and not b.take("ann")  # ann kept its state: 1.5 tokens, one taken
    assert all(b.take("u1") for _ in range(3)) and not b.take("u1")  # a forgotten bucket is full


def test_pruning_stays_cheap_when_few_buckets_are_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "PRUNE_ABOVE", 10)
    clock = Clock()
    b = TokenBuckets(rate=1.0, burst=3, clock=clock)
    scans = 0
    prune = b._prune

    def counted(now: float) -> None:
        nonlocal scans
        scans += 1
        prune(now)

    monkeypatch.setattr(b, "_prune", counted)
    for i in range(1000):  # none refills: every bucket is kept
        assert b.take(f"u{i}")
    assert len(b._state) == 1000
    assert scans <= 10  # the bound doubles with what a pruning leaves, not one scan a take
    clock.t += 10.0  # all full again: the next pruning forgets them
    for i in range(2000):
        b.take(f"v{i}")
    assert not any(key.startswith("u") for key in b._state)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.sampled_from([0.0, 0.5, 1.0, 3.0, 20.0]),
    burst=st.integers(1, 5),
    turns=st.lists(
        st.tuples(st.floats(0.0, 2.0), st.lists(st.sampled_from(["ann", "bob", "cid"]), max_size=12)),
        max_size=8,
    ),
)
def test_a_run_of_takes_decides_as_take_does_key_by_key(
    rate: float, burst: int, turns: list[tuple[float, list[str]]]
) -> None:
    """The intake's per-turn taker gives, key by key, the outcome and bucket state of ``take``."""
    clock_a, clock_b = Clock(), Clock()
    one, run = TokenBuckets(rate, burst, clock=clock_a), TokenBuckets(rate, burst, clock=clock_b)
    for advance, keys in turns:
        clock_a.t += advance
        clock_b.t += advance
        now = run.clock()
        take = run.taker(now)
        assert [take(k) for k in keys] == [one.take(k, now=now) for k in keys]
        run.prune(now)
        assert run._state == one._state
