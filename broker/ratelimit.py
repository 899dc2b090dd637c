"""Per-user token buckets and the query-id dedup window (contract §9 ``[limits]``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

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

    def taker(self, now: float) -> Callable[[str], bool]:
        """:meth:`take` of one token at time ``now``, for a run of takes within one event-loop turn
        (the intake's per-fix check): the same outcome as ``take(key, now=now)`` key by key, without
        its attribute lookups per call. Pruning waits for the run's end: call :meth:`prune` then."""
        rate = self.rate
        if rate <= 0:
            return partial(self.take, now=now)
        state, burst, step = self._state, self.burst, 1 / rate
        get = state.get

        def take(key: str) -> bool:
            full_at = get(key)
            if full_at is None or full_at < now:
                full_at = now
            if burst - (full_at - now) * rate < 1:
                return False
            state[key] = full_at + step
            return True

        return take

    def prune(self, now: float) -> None:
        """Forget the full buckets if there are more than the bound (after a run of :meth:`taker`)."""
        if len(self._state) > self._prune_above:
            self._prune(now)

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
    keeps each as a 64-bit keyed hash of the pair (8 bytes) and the millisecond it was first seen
    (4 bytes, counted from a base moved forward as time goes on), **12 bytes**, not the pair itself
    (about 290 bytes as a dict entry of strings: 33 MiB at 200 queries/s, which ``kcloak bench
    soak`` saw as resident memory growing for the first ten minutes). The hash is Python's ``hash``
    of the pair, SipHash keyed at random per process, so a client can neither predict nor provoke a
    collision; two different pairs share a hash with probability about n²/2⁶⁵ per window (n =
    pairs in it: 10⁻⁷ at 3 million), and the later one would then be taken for a duplicate.

    Times are the clock rounded to the millisecond: a pair is a duplicate while at most
    ``window_s`` (in whole milliseconds) has passed since it was first seen, and new again after.
    The pairs of the last ``window_s``/60 seconds sit in a dict; then they are merged into two
    sorted arrays (hashes, times), from which expired pairs are dropped then.
    """

    def __init__(self, window_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._window_ms = round(window_s * 1000)
        if not 0 <= self._window_ms <= _REBASE_AFTER_MS:
            raise ValueError(f"dedup window of {window_s} s: 0 to {_REBASE_AFTER_MS // 1000} s")
        self._merge_every_ms = max(self._window_ms // 60, 1)
        self._recent: dict[int, int] = {}
        self._merged_ms = self._base_ms = round(clock() * 1000)
        self._keys: npt.NDArray[np.uint64] = np.empty(0, dtype=np.uint64)
        self._times: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)  # ms after ``_base_ms``

    def __len__(self) -> int:
        """Pairs remembered (expired ones included until the next merge)."""
        return len(self._recent) + int(self._keys.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the merged arrays (the pairs of the last merge period, in the dict, apart)."""
        return int(self._keys.nbytes + self._times.nbytes)

    def first_time(self, user: str, query_id: str) -> bool:
        """True (and remembered) the first time; False for a duplicate."""
        now = round(self._clock() * 1000)
        if now - self._merged_ms >= self._merge_every_ms:
            self._merge(now)
        key = hash((user, query_id)) & _MASK64
        seen = self._recent.get(key)
        if seen is not None and now - seen <= self._window_ms:
            return False
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        if (
            i < self._keys.size
            and int(self._keys[i]) == key
            and now - self._base_ms - int(self._times[i]) <= self._window_ms
        ):
            return False
        self._recent[key] = now
        return True

    def _merge(self, now: int) -> None:
        # Only pairs seen within the window stay; their times are kept as ``uint32`` ms after a
        # base, which is moved up to the window's start once it falls more than 2³⁰ ms behind it.
        oldest = now - self._window_ms
        seen = self._times.astype(np.int64) + self._base_ms
        live = seen >= oldest
        keys = self._keys[live]
        if oldest - self._base_ms > _REBASE_AFTER_MS:
            self._base_ms = oldest
        times = (seen[live] - self._base_ms).astype(np.uint32)
        recent = {k: t for k, t in self._recent.items() if t >= oldest}  # all, unless the clock jumped
        if recent:
            new_keys = np.fromiter(recent.keys(), dtype=np.uint64, count=len(recent))
            new_times = np.fromiter((t - self._base_ms for t in recent.values()), dtype=np.uint32, count=len(recent))
            order = np.argsort(new_keys)
            new_keys, new_times = new_keys[order], new_times[order]
            # A key of the dict was in the arrays only expired (else it was a duplicate): dropped above.
            at = np.searchsorted(keys, new_keys)
            keys, times = np.insert(keys, at, new_keys), np.insert(times, at, new_times)
        self._keys, self._times = keys, times
        self._recent = {}
        self._merged_ms = now


_MASK64 = (1 << 64) - 1
_REBASE_AFTER_MS = 1 << 30
"""How far the time base may fall behind the window before it is moved (times are ``uint32`` ms)."""
