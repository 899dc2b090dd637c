"""Per-user token buckets and the query-id dedup window (contract §9 ``[limits]``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class TokenBuckets:
    """One token bucket per key: ``rate`` tokens/s up to ``burst``. Idle buckets are forgotten."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._clock = clock
        self._state: dict[str, tuple[float, float]] = {}

    def take(self, key: str, n: int = 1, *, now: float | None = None) -> bool:
        """Take ``n`` tokens from ``key``'s bucket if it holds them. ``now`` (the clock's time) lets
        a caller that takes for many keys at once read the clock once."""
        if now is None:
            now = self._clock()
        state = self._state.get(key)
        if state is None:
            tokens = self.burst
        else:
            tokens = state[0] + (now - state[1]) * self.rate
            if tokens > self.burst:
                tokens = self.burst
        if tokens < n:
            self._state[key] = (tokens, now)
            return False
        self._state[key] = (tokens - n, now)
        if len(self._state) > 200_000:
            self._prune(now)
        return True

    def clock(self) -> float:
        """The time the buckets are filled by (for :meth:`take`'s ``now``)."""
        return self._clock()

    def _prune(self, now: float) -> None:
        full_after = self.burst / self.rate if self.rate > 0 else float("inf")
        for key in [k for k, (_, last) in self._state.items() if now - last > full_after]:
            del self._state[key]


class DedupWindow:
    """Remembers ``(user, query_id)`` for ``window_s``; a repeat inside the window is a duplicate."""

    def __init__(self, window_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()

    def first_time(self, user: str, query_id: str) -> bool:
        """True (and remembered) the first time; False for a duplicate."""
        now = self._clock()
        while self._seen:
            key, t = next(iter(self._seen.items()))
            if now - t <= self.window_s:
                break
            self._seen.popitem(last=False)
        key = (user, query_id)
        if key in self._seen:
            return False
        self._seen[key] = now
        return True
