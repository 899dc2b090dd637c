"""Per-user token buckets and the query-id dedup window (contract §9 ``[limits]``)."""

from __future__ import annotations

import time
from bisect import bisect_left
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
    keeps each as a 64-bit keyed hash of the pair and the time it was first seen in **8 bytes**, not
    the pair itself (about 290 bytes as a dict entry of strings: 33 MiB at 200 queries/s, which
    ``kcloak bench soak`` saw as resident memory growing for the first ten minutes). The hash is
    Python's ``hash`` of the pair, SipHash keyed at random per process, so a client can neither
    predict nor provoke a collision; two different pairs share a hash with probability about
    n²/2⁶⁵ per window (n = pairs in it: 10⁻⁷ at 3 million), and the later one would then be taken
    for a duplicate.

    Time is read in whole quanta of ``window_s``/60,000 (10 ms at 600 s; whole microseconds under
    60 ms): a pair is a duplicate while at most ``window_s`` has passed since it was first seen, and
    new again once ``window_s`` and two quanta have passed (one at 600 s), either in between: never
    new early.

    The pairs of the last ``window_s``/60 seconds (one second at least) sit in a dict; then they are
    merged into sorted arrays, from which expired pairs are dropped then. The arrays hold a hash as
    its 16 top bits implied by its place (``_starts``: where each of the 65,536 top-bit buckets begins, 256 KiB
    whatever the load), 32 bits in ``_hi`` and the 16 low bits in ``_lo`` beside the 16 low bits
    of its first time in quanta (the time modulo 2¹⁶: the pairs kept are younger than the window,
    60,000 quanta, so their age is read back exactly from the time of the last merge).
    """

    def __init__(
        self,
        window_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        hash_pair: Callable[[tuple[str, str]], int] = hash,
    ) -> None:
        """``hash_pair``: the pairs' hash (Python's keyed ``hash``; tests pass hashes that crowd the buckets)."""
        if not 0 <= window_s < float("inf"):
            raise ValueError(f"dedup window of {window_s} s: it must be 0 or more seconds")
        self.window_s = window_s
        self._clock = clock
        self._hash = hash_pair
        window_us = round(window_s * 1_000_000)
        self._quantum_us = max(-(-window_us // WINDOW_QUANTA), 1)
        self._window_q = -(-window_us // self._quantum_us)  # at most WINDOW_QUANTA
        self._merge_every_q = max(self._window_q // 60, -(-MIN_MERGE_EVERY_US // self._quantum_us))
        self._recent: dict[int, int] = {}  # hash: first time in quanta (the last merge period)
        self._merged_q = self._now()
        self._starts: npt.NDArray[np.uint32] = np.zeros(_BUCKETS + 1, dtype=np.uint32)
        self._hi: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self._lo: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self._starts_view, self._hi_view, self._lo_view = self._starts.data, self._hi.data, self._lo.data

    def _now(self) -> int:
        return round(self._clock() * 1_000_000) // self._quantum_us

    def __len__(self) -> int:
        """Pairs remembered (expired ones included until the next merge)."""
        return len(self._recent) + int(self._hi.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the merged arrays (the pairs of the last merge period, in the dict, apart)."""
        return int(self._starts.nbytes + self._hi.nbytes + self._lo.nbytes)

    def first_time(self, user: str, query_id: str) -> bool:
        """True (and remembered) the first time; False for a duplicate."""
        now = self._now()
        if now - self._merged_q >= self._merge_every_q:
            self._merge(now)
        key = self._hash((user, query_id)) & _MASK64
        seen = self._recent.get(key)
        if seen is not None and now - seen <= self._window_q:
            return False
        # The arrays are read through memoryviews (Python ints at C speed), the bucket's few
        # entries searched by bisection on the 32 middle bits.
        starts = self._starts_view
        bucket = key >> 48
        lo, end = starts[bucket], starts[bucket + 1]
        if lo < end:
            his, hi = self._hi_view, (key >> 16) & _MASK32
            i = bisect_left(his, hi, lo, end)
            low = key & _MASK16
            while i < end and his[i] == hi:
                entry = self._lo_view[i]
                if entry >> 16 == low:
                    age = ((self._merged_q - entry) & _MASK16) + now - self._merged_q
                    if age <= self._window_q:
                        return False
                    break
                i += 1
        self._recent[key] = now
        return True

    def _merge(self, now: int) -> None:
        # The pairs kept are those seen within the window. A kept pair's age is its age at the last
        # merge (the 16-bit difference, exact since it was under 60,000 quanta then) plus the time
        # since; the arrays are rebuilt from full 64-bit hashes, sorted, and split again.
        merged, window = self._merged_q, self._window_q
        his, lows = self._hi, self._lo
        ages = (np.uint32((merged & _MASK16) | (_MASK16 + 1)) - (lows & _MASK16)) & _MASK16
        live = ages <= window - (now - merged)
        floors = np.arange(_BUCKETS, dtype=np.uint64) << 48  # each bucket's lowest hash
        keys = (his.astype(np.uint64) << 16) | (lows >> 16)
        keys |= np.repeat(floors, np.diff(self._starts))
        times = lows & _MASK16
        if not live.all():
            keys, times = keys[live], times[live]
        recent = {k: t for k, t in self._recent.items() if now - t <= window}  # all, unless the clock jumped
        if recent:
            new_keys = np.fromiter(recent.keys(), dtype=np.uint64, count=len(recent))
            new_times = np.fromiter((t & _MASK16 for t in recent.values()), dtype=np.uint32, count=len(recent))
            order = np.argsort(new_keys)
            new_keys, new_times = new_keys[order], new_times[order]
            # A key of the dict was in the arrays only expired (else it was a duplicate): dropped above.
            at = np.searchsorted(keys, new_keys)
            keys, times = np.insert(keys, at, new_keys), np.insert(times, at, new_times)
        self._starts[:-1] = np.searchsorted(keys, floors)
        self._starts[-1] = keys.size
        self._hi = (keys >> 16).astype(np.uint32)  # the conversion keeps the 32 low bits
        lows = keys.astype(np.uint32)  # the 32 low bits
        lows <<= 16
        lows |= times
        self._lo = lows
        self._hi_view, self._lo_view = self._hi.data, self._lo.data
        self._recent = {}
        self._merged_q = now


WINDOW_QUANTA = 60_000
"""Most quanta in a dedup window: a time is read in whole quanta of ``window_s``/60,000 (rounded up
to whole microseconds), so a pair's age in the window fits the 16 bits kept of its time."""

MIN_MERGE_EVERY_US = 1_000_000
"""Shortest merge period (a merge costs a pass over the 65,536 buckets; short windows merge each second)."""

_BUCKETS = 1 << 16
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_MASK16 = (1 << 16) - 1
