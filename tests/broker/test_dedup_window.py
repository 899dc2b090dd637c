"""The query-id dedup window: a repeat within the window is a duplicate, after it is not, and it
holds a window of queries in a few bytes each."""

from __future__ import annotations

import tracemalloc

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
    clock.t += 0.001
    assert d.first_time("alice", "q1")  # expired: new again, and remembered anew
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


def test_a_window_of_queries_costs_a_few_dozen_bytes_each() -> None:
    clock = Clock()
    d = DedupWindow(600.0, clock=clock)
    users = [f"s{i:06d}" for i in range(2000)]
    tracemalloc.start()
    try:
        for i in range(60_000):  # 600 s at 100 queries/s
            clock.t += 0.01
            d.first_time(users[i % 2000], f"ab12cd34-q{i}")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The pairs as strings in a dict took about 290 bytes; a hash and a float64 time 16 plus the
    # dict of the last merge period (about 1.7 here); a hash and 32-bit milliseconds take 12.
    assert held / 60_000 < 15, held / 60_000


class MsClock:
    """A clock at whole milliseconds, so the expected answers need no rounding."""

    def __init__(self) -> None:
        self.ms = 5_000_000

    def __call__(self) -> float:
        return self.ms / 1000


# Steps from a millisecond to past the window, and jumps of weeks (the time base is moved then).
_steps = st.one_of(
    st.integers(0, 3),
    st.integers(0, 2_500),
    st.sampled_from([1_999, 2_000, 2_001]),
    st.integers(2_000_000_000, 4_000_000_000),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_steps, st.integers(0, 3), st.integers(0, 30)), min_size=1, max_size=400))
def test_a_pair_is_a_duplicate_exactly_while_the_window_since_its_first_time_lasts(
    ops: list[tuple[int, int, int]],
) -> None:
    clock = MsClock()
    d = DedupWindow(2.0, clock=clock)  # 2,000 ms; merges every 33 ms
    first_seen: dict[tuple[str, str], int] = {}  # the pairs themselves, as a client would track them
    for step, u, q in ops:
        clock.ms += step
        pair = (f"user-{u}", f"q{q}")
        seen = first_seen.get(pair)
        expect_new = seen is None or clock.ms - seen > 2_000
        assert d.first_time(*pair) == expect_new, (pair, seen, clock.ms)
        if expect_new:
            first_seen[pair] = clock.ms


def test_a_query_id_reused_just_after_the_window_is_new_again_after_weeks_of_running() -> None:
    clock = MsClock()
    d = DedupWindow(600.0, clock=clock)
    for day in range(40):  # past the 32-bit milliseconds (49 days) the times are counted in
        clock.ms += 86_400_000
        assert d.first_time("alice", f"q{day % 3}") and not d.first_time("alice", f"q{day % 3}")
        clock.ms += 600_000
        assert not d.first_time("alice", f"q{day % 3}")
        clock.ms += 1
        assert d.first_time("alice", f"q{day % 3}")
