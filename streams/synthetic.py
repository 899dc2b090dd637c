"""Seeded synthetic traces shaped like the real data of issue 16 (tests and benchmarks; no research data needed).

* :func:`cab_hour_fixes` — one hour of city cabs (436 like the San Francisco hour of the issue): most
  cabs report for the whole hour, the rest join or leave on whole minutes, so NWA's time-span classes
  (CONCEPTS §7.3) are unequal and many hold fewer than ``k`` cabs.
* :func:`geolife_like_fixes` — GeoLife-shaped trajectories (964 of 31 users over five years, 453k points,
  heavy-tailed lengths, 1–5 s sampling): almost no two are co-temporal.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kcloak.core.geometry import Aeqd
from kcloak.core.readers import FixTable

F64 = npt.NDArray[np.float64]

SF_CENTRE = (37.7749, -122.4194)
BEIJING_CENTRE = (39.99, 116.33)
HOUR_T0 = 1_211_018_400.0
"""2008-05-17T10:00:00Z, an hour of the San Francisco cab traces' period."""


def _walk(rng: np.random.Generator, n_steps: int, step_s: F64, speed: float, start: F64) -> F64:
    """A correlated random walk (x, y metres) of ``n_steps`` samples ``step_s`` apart at about ``speed`` m/s."""
    heading = rng.uniform(0, 2 * np.pi) + np.cumsum(rng.normal(0.0, 0.35, n_steps))
    v = np.clip(rng.normal(speed, speed / 3.0, n_steps), 0.0, None)
    d = np.r_[0.0, np.diff(step_s)] * v
    xy = np.cumsum(np.stack([d * np.cos(heading), d * np.sin(heading)], axis=1), axis=0)
    out: F64 = start + xy
    return out


def cab_hour_fixes(
    n: int = 436,
    *,
    seed: int = 0,
    full_fraction: float = 0.62,
    n_partial_classes: int = 8,
    n_small: int = 103,
    period_s: float = 60.0,
) -> FixTable:
    """``n`` cabs over one hour; ``full_fraction`` of them report all hour (one big class at π = 60 s).

    Of the others, ``n_small`` start and end on minutes drawn so that their (start, end) classes hold
    1–3 cabs each; the rest share ``n_partial_classes`` common (start, end) pairs. Cabs drive a
    correlated random walk at ~8 m/s from points within 4 km of the centre, sampled every ``period_s``
    (±5 s jitter inside the minute, so trimming to π = 60 s puts a class on the same whole minutes).
    """
    rng = np.random.default_rng(seed)
    frame = Aeqd(*SF_CENTRE)
    n_full = round(full_fraction * n)
    n_small = min(n_small, n - n_full)
    n_mid = n - n_full - n_small
    spans: list[tuple[int, int]] = [(0, 60)] * n_full
    common = [
        (int(a), int(b))
        for a, b in zip(rng.integers(1, 25, n_partial_classes), rng.integers(35, 60, n_partial_classes), strict=True)
    ]
    spans += [common[i % n_partial_classes] for i in range(n_mid)]
    small: list[tuple[int, int]] = []
    used: set[tuple[int, int]] = set(common) | {(0, 60)}
    while len(small) < n_small:
        a = int(rng.integers(0, 50))
        b = int(rng.integers(a + 3, 61))
        if (a, b) in used:
            continue
        used.add((a, b))
        small += [(a, b)] * min(int(rng.integers(1, 4)), n_small - len(small))
    spans += small
    ids: list[str] = []
    ts: list[F64] = []
    xs: list[F64] = []
    for i, (a, b) in enumerate(spans):
        minutes = np.arange(a, b + 1, dtype=np.float64)
        t = HOUR_T0 + minutes * period_s + rng.uniform(5.0, 25.0, len(minutes))
        if a == 0:
            t[0] = HOUR_T0 + rng.uniform(0.0, 2.0)
        start = rng.normal(0.0, 1_600.0, 2)
        xs.append(_walk(rng, len(t), t, 8.0, start))
        ts.append(t)
        ids += [f"cab{i:04d}"] * len(t)
    xy = np.concatenate(xs)
    lat, lon = frame.inverse(xy[:, 0], xy[:, 1])
    t_all = np.round(np.concatenate(ts).astype(np.float64), 3).astype(np.float64)
    return FixTable(np.array(ids, dtype=np.str_), t_all, lat, lon)


def geolife_like_fixes(
    n: int = 964, points: int = 453_397, *, users: int = 31, seed: int = 0, years: float = 5.0, days: float = 400.0
) -> FixTable:
    """``n`` trajectories of ``users`` users with ``points`` fixes in all, spread over ``years`` years.

    Each user's trips fall within ``days`` days of the user's own start (a small ``days`` and ``years``
    make a dense, co-temporal stress case).

    Lengths are log-normal (a few trajectories hold tens of thousands of fixes, as GeoLife's do),
    sampling 1–5 s, walking to driving speeds; each user's trips fall on a few days of their own, so
    co-temporal pairs are rare. Deterministic for a given ``seed``.
    """
    rng = np.random.default_rng(seed)
    frame = Aeqd(*BEIJING_CENTRE)
    raw = rng.lognormal(5.6, 1.1, n)
    lengths = np.maximum(2, np.floor(raw / raw.sum() * points)).astype(np.int64)
    lengths[np.argmax(lengths)] += points - int(lengths.sum())
    user = rng.integers(0, users, n)
    user_t0 = 1_175_000_000.0 + rng.uniform(0.0, years * 365 * 86400, users)
    ids: list[npt.NDArray[np.str_]] = []
    ts: list[F64] = []
    xs: list[F64] = []
    for i in range(n):
        m = int(lengths[i])
        period = float(rng.choice([1.0, 2.0, 5.0]))
        t0 = user_t0[user[i]] + rng.uniform(0.0, days) * 86400 + rng.uniform(0.0, min(86400.0, days * 86400))
        t = t0 + period * np.arange(m) + rng.uniform(0.0, 0.4, m)
        xs.append(_walk(rng, m, t, float(rng.choice([1.4, 5.0, 12.0])), rng.normal(0.0, 6_000.0, 2)))
        ts.append(t)
        ids.append(np.full(m, f"{user[i]:03d}-{i:05d}", dtype="<U9"))
    xy = np.concatenate(xs)
    lat, lon = frame.inverse(xy[:, 0], xy[:, 1])
    t_all = np.round(np.concatenate(ts).astype(np.float64), 3).astype(np.float64)
    return FixTable(np.concatenate(ids), t_all, lat, lon)


__all__ = ["cab_hour_fixes", "geolife_like_fixes"]
