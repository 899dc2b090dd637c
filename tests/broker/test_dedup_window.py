"""The query-id dedup window: a repeat within the window is a duplicate, after it is not, and it
holds a window of queries in a few bytes each."""

from __future__ import annotations

import tracemalloc

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
    assert held / 60_000 < 40, held / 60_000  # the pairs as strings in a dict took about 290
