"""A replaced view is freed as soon as nobody holds it, not at the next full collection.

A broker makes a fresh view of its users every second or so under load; one hilbert view of a
million users with its state is about 100 MB. If a cloaker's per-view state (kept in the view's own
cache) referred back to the view strongly, the two would form a reference cycle that only Python's
full collection frees, and every replaced view would stay resident until then. Checked here with
the cyclic collector off, on real index snapshots, after single and batch cloaks.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from kcloak.cloaking.cloakers import cloaker_class
from kcloak.cloaking.index import PositionIndex
from kcloak.core.profile import PrivacyProfile

T0 = 1_800_000_000.0


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def crowd(n: int = 400) -> PositionIndex:
    rng = np.random.default_rng(7)
    index = PositionIndex(stale_after_s=60.0)
    index.update_batch(
        [f"p{i:04d}" for i in range(n)], 39.9 + rng.normal(0, 0.01, n), 116.4 + rng.normal(0, 0.01, n), np.full(n, T0)
    )
    return index


@pytest.mark.parametrize("algorithm", ["hilbert", "nn", "interval", "casper", "privacygrid"])
def test_a_dropped_view_is_freed_without_the_cyclic_collector(algorithm: str, no_cyclic_gc: None) -> None:
    index = crowd()
    cloaker = cloaker_class(algorithm)()
    profile = PrivacyProfile(k=5)
    gone: list[weakref.ref[object]] = []
    for step in range(4):
        index.update_batch(["p0001", "p0002"], [39.91, 39.92], [116.41, 116.42], [T0 + step + 1] * 2)
        view = index.snapshot(T0 + step + 1.5, epoch=step + 1, seed=step + 1)
        for row in (0, 7, 99):
            cloaker.cloak(view, row, profile)
        gone.append(weakref.ref(view))
        del view
    # The cloaker may keep its latest view for the next one's incremental start, never the older ones.
    alive = [ref() is not None for ref in gone]
    assert not any(alive[:-1]), alive
