"""The query-id dedup window: a repeat within the window is a duplicate, after it is not, and it
holds a window of queries in a few bytes each."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.broker.ratelimit import DedupWindow


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_repeat_within_the_window_is_a_duplicate_and_after_it_is_not() -> None:
    clock = Clock()
    d = DedupWindow(600.0, clock=clock)
    assert d.first_time("alice", "q1")
    assert not d.first_time("alice", "q1")
    assert d.first_time("bob", "q1") and d.first_time("alice", "q2")
    for step in (5.0, 50.0, 300.0, 245.0):  # across merges of the recent pairs into the arrays
        clock.t += step
        assert not d.first_time("alice", "q1"), clock.t
    assert clock.t - 1000.0 == 600.0  # exactly the window: still a duplicate
    clock.t += 0.010
    assert d.first_time("alice", "q1")  # a quantum (10 ms) later: new again, and remembered anew
    assert not d.first_time("alice", "q1")
    clock.t += 599.0
    assert not d.first_time("alice", "q1")
    assert d.first_time("bob", "q1")  # bob's first q1 was 1,199 s ago


def test_many_queries_over_time_each_a_duplicate_until_it_expires() -> None:
    clock = Clock()
    d = DedupWindow(60.0, clock=clock)
    sent: list[tuple[float, str, str]] = []
    for i in range(20_000):
        clock.t += 0.01  # 200 s of 100 queries/s
        user, qid = f"u{i % 97}", f"q{i}"
        assert d.first_time(user, qid)
        sent.append((clock.t, user, qid))
        if i % 7 == 0:  # a repeat of an earlier query, inside or outside the window
            t0, u0, q0 = sent[i // 2]
            assert d.first_time(u0, q0) == (clock.t - t0 > 60.0), (i, clock.t - t0)
            if clock.t - t0 > 60.0:
                sent[i // 2] = (clock.t, u0, q0)
    # Memory is bounded by the window, not by the run: about 60 s × 100/s pairs remain (± a merge period).
    assert 5_000 <= len(d) <= 7_500


def test_a_window_of_queries_costs_eight_bytes_each() -> None:
    clock = Clock()
    d = DedupWindow(600.0, clock=clock)
    users = [f"s{i:06d}" for i in range(2000)]
    held: list[int] = []
    tracemalloc.start()
    try:
        for i in range(600_000):  # 600 s at 1,000 queries/s
            clock.t += 0.001
            d.first_time(users[i % 2000], f"ab12cd34-q{i}")
            if i in (299_999, 599_999):  # after 300 s and 600 s: the same time since the last merge
                held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    # What 300,000 more queries of the window hold: the pairs as strings in a dict took about 290
    # bytes; a hash and a float64 time 16; a hash and 32-bit milliseconds 12; now 8.
    assert (held[1] - held[0]) / 300_000 < 8.5, (held[1] - held[0]) / 300_000
    assert len(d) >= 590_000


class MsClock:
    """A clock at whole milliseconds, so the expected answers need no rounding."""

    def __init__(self) -> None:
        self.ms = 5_000_000

    def __call__(self) -> float:
        return self.ms / 1000


def _quantum_ms(window_ms: int) -> float:
    """The dedup window's time quantum: window/60,000 rounded up to whole microseconds."""
    return max(-(-window_ms * 1000 // 60_000), 1) / 1000


@st.composite
def _windows_and_steps(draw: st.DrawFn) -> tuple[int, bool, list[tuple[int, int, int]]]:
    window_ms = draw(st.sampled_from([0, 1, 50, 2_000, 60_000, 600_000, 3_600_000]))
    q = _quantum_ms(window_ms)
    near = sorted({max(0, round(window_ms + d)) for d in (-1, 0, 1, q, 2 * q, 2 * q + 1, -q)})
    steps = st.one_of(
        st.integers(0, 3),
        st.integers(0, max(window_ms // 4, 1)),
        st.sampled_from(near),
        st.integers(2_000_000_000, 4_000_000_000),  # weeks: past any 16- or 32-bit time
    )
    ops = draw(st.lists(st.tuples(steps, st.integers(0, 3), st.integers(0, 30)), min_size=1, max_size=300))
    return window_ms, draw(st.booleans()), ops


def _crowded_hash(pair: tuple[str, str]) -> int:
    """Distinct 64-bit hashes for the test's 124 pairs, crowded into two of the window's 65,536
    top-bit buckets, sharing their next 32 bits in fours and differing only in the 16 low bits."""
    u, q = int(pair[0].removeprefix("user-")), int(pair[1].removeprefix("q"))
    i = u * 31 + q
    bucket = (0, 0xFFFF)[i % 2]
    middle = (0, 1, 0xFFFF_FFFF, 7)[i // 2 % 4]
    return (bucket << 48) | (middle << 16) | (i // 8)


@settings(max_examples=300, deadline=None)
@given(_windows_and_steps())
def test_a_pair_is_a_duplicate_while_the_window_since_its_first_time_lasts(
    case: tuple[int, bool, list[tuple[int, int, int]]],
) -> None:
    """Within the window: a duplicate; past it by two quanta (window/60,000, rounded up to whole
    microseconds): new; in between, either, and the pair counts as first seen anew when it is new."""
    window_ms, crowded, ops = case
    clock = MsClock()
    d = DedupWindow(window_ms / 1000, clock=clock, hash_pair=_crowded_hash if crowded else hash)
    slack = 2 * _quantum_ms(window_ms)
    first_seen: dict[tuple[str, str], int] = {}  # the pairs themselves, as a client would track them
    news = 0
    for step, u, q in ops:
        clock.ms += step
        pair = (f"user-{u}", f"q{q}")
        seen = first_seen.get(pair)
        new = d.first_time(*pair)
        news += new
        if seen is None or clock.ms - seen >= window_ms + slack:
            assert new, (pair, seen, clock.ms)
        elif clock.ms - seen <= window_ms:
            assert not new, (pair, seen, clock.ms)
        if new:
            first_seen[pair] = clock.ms
    assert len(d) <= news  # a duplicate adds nothing


def test_a_query_id_reused_just_after_the_window_is_new_again_after_weeks_of_running() -> None:
    clock = MsClock()
    d = DedupWindow(600.0, clock=clock)
    for day in range(40):  # past 32-bit milliseconds (49 days) and 16-bit quanta (11 minutes)
        clock.ms += 86_400_000
        assert d.first_time("alice", f"q{day % 3}") and not d.first_time("alice", f"q{day % 3}")
        clock.ms += 600_000
        assert not d.first_time("alice", f"q{day % 3}")
        clock.ms += 10  # one quantum of a 600 s window
        assert d.first_time("alice", f"q{day % 3}")


def test_windows_of_any_length_from_zero_to_a_month() -> None:
    clock = MsClock()
    for window_s in (0.0, 0.000_001, 2_592_000.0):
        d = DedupWindow(window_s, clock=clock)
        assert d.first_time("alice", "q") and not d.first_time("alice", "q")
        clock.ms += round(window_s * 1000) + 1 + round(2 * _quantum_ms(round(window_s * 1000)))
        assert d.first_time("alice", "q")
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="dedup window"):
            DedupWindow(bad, clock=clock)
