"""Per-user token buckets and the query-id dedup window (contract §9 ``[limits]``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt


class TokenBuckets:
    """One token bucket per key: ``rate`` tokens/s up to ``burst``. Idle buckets are forgotten.

    A bucket is kept as one float, the time it is full again (with ``rate`` ≤ 0, which never
    refills: the tokens left), not as a (tokens, time) pair: a million users' buckets are a dict
    entry and a float each. A bucket that is full is the same as none, and the full ones are
    forgotten when the dict grows past :data:`PRUNE_ABOVE` keys, or twice the keys left by the
    previous pruning if more (so that pruning stays O(1) a take however many buckets are not full).
    """

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._clock = clock
        self._state: dict[str, float] = {}
        self._prune_above = PRUNE_ABOVE

    def take(self, key: str, n: int = 1, *, now: float | None = None) -> bool:
        """Take ``n`` tokens from ``key``'s bucket if it holds them. ``now`` (the clock's time) lets
        a caller that takes for many keys at once read the clock once."""
        if now is None:
            now = self._clock()
        state = self._state.get(key)
        rate = self.rate
        if rate <= 0:  # no refill: the state is the tokens left
            tokens = self.burst if state is None else state
            if tokens < n:
                return False
            self._state[key] = tokens - n
            return True
        full_at = now if state is None or state < now else state
        if self.burst - (full_at - now) * rate < n:
            return False
        self._state[key] = full_at + n / rate
        if len(self._state) > self._prune_above:
            self._prune(now)
        return True

    def clock(self) -> float:
        """The time the buckets are filled by (for :meth:`take`'s ``now``)."""
        return self._clock()

    def _prune(self, now: float) -> None:
        for key in [k for k, full_at in self._state.items() if full_at <= now]:
            del self._state[key]
        self._prune_above = max(PRUNE_ABOVE, 2 * len(self._state))


PRUNE_ABOVE = 1 << 15
"""Buckets kept before the full ones are forgotten (each holds its user id: ~120 B with the
dict entry; a million users who sent once are a million full buckets)."""


class DedupWindow:
    """Remembers ``(user, query_id)`` for ``window_s``; a repeat inside the window is a duplicate.

    It holds every query of the window (600 s by default: at 5,000 queries/s, 3 million), so it
    keeps each as a 64-bit keyed hash of the pair and the time it was first seen, 16 bytes, not
    the pair itself (about 290 bytes as a dict entry of strings: 33 MiB at 200 queries/s, which
    ``kcloak bench soak`` saw as resident memory growing for the first ten minutes). The hash
    is Python's ``hash`` of the pair, SipHash keyed at random per process, so a client can
    neither predict nor provoke a collision; two different pairs share a hash with probability
    about n²/2⁶⁵ per window (n = pairs in it: 10⁻⁷ at 3 million), and the later one would then be
    taken for a duplicate. The pairs of the last ``window_s``/60 seconds sit in a dict; then they
    are merged into two sorted arrays (hashes, times), from which expired pairs are dropped then.
    """

    def __init__(self, window_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._merge_every = max(window_s / 60.0, 0.001)
        self._recent: dict[int, float] = {}
        self._merged_at = clock()
        self._keys: npt.NDArray[np.uint64] = np.empty(0, dtype=np.uint64)
        self._times: npt.NDArray[np.float64] = np.empty(0, dtype=np.float64)

    def __len__(self) -> int:
        """Pairs remembered (expired ones included until the next merge)."""
        return len(self._recent) + int(self._keys.size)

    def first_time(self, user: str, query_id: str) -> bool:
        """True (and remembered) the first time; False for a duplicate."""
        now = self._clock()
        if now - self._merged_at >= self._merge_every:
            self._merge(now)
        key = hash((user, query_id)) & _MASK64
        seen = self._recent.get(key)
        if seen is not None and now - seen <= self.window_s:
            return False
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        if i < self._keys.size and int(self._keys[i]) == key and now - float(self._times[i]) <= self.window_s:
            return False
        self._recent[key] = now
        return True

    def _merge(self, now: float) -> None:
        live = now - self._times <= self.window_s
        keys, times = self._keys[live], self._times[live]
        if self._recent:
            new_keys = np.fromiter(self._recent.keys(), dtype=np.uint64, count=len(self._recent))
            new_times = np.fromiter(self._recent.values(), dtype=np.float64, count=len(self._recent))
            order = np.argsort(new_keys)
            new_keys, new_times = new_keys[order], new_times[order]
            # A key of the dict was in the arrays only expired (else it was a duplicate): dropped above.
            at = np.searchsorted(keys, new_keys)
            keys, times = np.insert(keys, at, new_keys), np.insert(times, at, new_times)
        self._keys, self._times = keys, times
        self._recent = {}
        self._merged_at = now


_MASK64 = (1 << 64) - 1
