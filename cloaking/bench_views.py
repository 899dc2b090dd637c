"""View preparation after a batch of moves, incremental against from scratch (``kcloak bench cloak``).

For each snapshot cloaker, on one position index holding the whole population: move ``B`` users
(distinct, random, σ 20 m), then time a fresh view two ways on the same index state:

- **incremental**: :meth:`PositionIndex.snapshot` (the index's kept Hilbert order, patched) and the
  first call of a cloaker that prepared the previous view (it carries what it can);
- **from scratch**: :meth:`PositionIndex.snapshot_from_scratch` and the first call of a new cloaker.

Both views are then cloaked with ``cloak_batch`` on a sample of users and compared (any difference
is reported as a mismatch; there must be none). After the batches, single calls on the last
incremental view are timed. The process's resident memory is read before and after the index is
built and at the end (peak too). Beside its wall time, the incremental view's process CPU time is
reported (``incremental_cpu_ms``: on a shared host, other jobs inflate the one, not the other).
"""

from __future__ import annotations

import gc
import logging
import math
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kcloak.cloaking.cloakers import Cloaker, CloakMode, cloaker_class
from kcloak.cloaking.cloakers.base import BatchResult
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.geometry import EARTH_RADIUS_M
from kcloak.core.profile import PrivacyProfile, ProfileArrays

VIEW_BATCHES: tuple[int, ...] = (1_000, 10_000)
"""Moved users per batch (``--view-batches``)."""
VIEW_ROUNDS = 3
"""Batches of each size per algorithm; the report gives the median and the range."""
VIEW_CHECK_SAMPLE = 5_000
"""Users cloaked on both views of every batch and compared."""
VIEW_SINGLE_CALLS = 20_000
"""Single calls timed on the last incremental view."""
MOVE_SIGMA_M = 20.0

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ViewsConfig:
    batches: tuple[int, ...] = VIEW_BATCHES
    rounds: int = VIEW_ROUNDS
    seed: int = 0


def rss_mb() -> float | None:
    """Resident memory of this process in MB (Linux ``/proc``), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * resource.getpagesize() / 1e6


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak / 1e3


def _prepare(cloaker: Cloaker, view: IndexView, by_k: Mapping[int, PrivacyProfile]) -> None:
    """The first call on a view (its first user, stored profile): it builds the per-view state."""
    if len(view):  # the first user's stored k, without reading the view's whole column
        cloaker.cloak(view, 0, by_k[int(view.column_at("k", np.zeros(1, np.int64))[0])])


def _stored(view: IndexView, rows: list[int], by_k: Mapping[int, PrivacyProfile]) -> list[PrivacyProfile]:
    """The stored profile of each given view row (the view's own k column)."""
    return [by_k[k] for k in view.k[rows].tolist()]


def _differences(a: BatchResult, b: BatchResult) -> int:
    ok = a.status == 0
    differ = (a.status != b.status) | (ok & ((a.bbox != b.bbox).any(axis=1) | (a.k_achieved != b.k_achieved)))
    differ |= ok & (a.area_m2 != b.area_m2)
    return int(np.count_nonzero(differ))


def _stats(ms: list[float]) -> dict[str, float]:
    return {"median": float(np.median(ms)), "min": float(min(ms)), "max": float(max(ms))}


def measure_views(
    index: PositionIndex,
    lat: Any,
    lon: Any,
    by_k: Mapping[int, PrivacyProfile],
    now: float,
    algorithms: tuple[str, ...],
    config: ViewsConfig,
    *,
    progress: Any,
) -> dict[str, Any]:
    """The ``views`` section of the report (see the module docstring). ``lat``/``lon`` are every
    user's current position (row ``i`` is user ``user_ids[i]`` of the index); every request is
    its user's stored profile (``by_k``: the profile of each stored k)."""
    ids = index.user_ids()
    n = len(ids)
    lat = np.array(lat, dtype=np.float64)
    lon = np.array(lon, dtype=np.float64)
    rng = np.random.default_rng([config.seed, 9])
    out: dict[str, Any] = {
        "users": n,
        "batches": list(config.batches),
        "rounds": config.rounds,
        "move_sigma_m": MOVE_SIGMA_M,
        "check_sample": min(n, VIEW_CHECK_SAMPLE),
        "results": [],
    }
    for i, name in enumerate(algorithms, start=1):
        cls = cloaker_class(name)
        if cls.cloak_mode is not CloakMode.SNAPSHOT:
            continue
        try:
            out["results"].append(
                _views_of(cls, name, index, ids, lat, lon, by_k, now, config, rng, progress, 1_000_000 * i)
            )
        except Exception as exc:  # a bug in one cloaker must not hide the others' figures
            _log.warning("bench_views_failed", extra={"algorithm": name}, exc_info=True)
            out["results"].append({"algorithm": name, "error": f"failed: {type(exc).__name__}: {exc}"})
    out["rss_mb"] = rss_mb()
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def _views_of(
    cls: type[Any],
    name: str,
    index: PositionIndex,
    ids: list[str],
    lat: Any,
    lon: Any,
    by_k: Mapping[int, PrivacyProfile],
    now: float,
    config: ViewsConfig,
    rng: np.random.Generator,
    progress: Any,
    epoch: int,
) -> dict[str, Any]:
    """One algorithm's row of the views section (moves ``lat``/``lon`` in place); its views are
    numbered from ``epoch`` on."""
    n = len(ids)
    step = MOVE_SIGMA_M / (EARTH_RADIUS_M * math.pi / 180.0)
    live: Cloaker = cls()
    epoch += 1
    view = index.snapshot(now, epoch=epoch, seed=epoch)
    _prepare(live, view, by_k)
    row: dict[str, Any] = {
        "algorithm": name,
        "incremental_state": bool(getattr(cls, "incremental_views", False)),
        "batches": [],
    }
    mismatches = 0
    progress.phase(f"{name}: views", len(config.batches) * config.rounds)
    for b in config.batches:
        b = min(b, n)
        inc_ms: list[float] = []
        snap_ms: list[float] = []
        scratch_ms: list[float] = []
        cpu_ms: list[float] = []  # process CPU time of the incremental view (what other jobs do not inflate)
        carried = 0
        for _ in range(config.rounds):
            who = rng.choice(n, b, replace=False)
            lat[who] += rng.normal(0.0, step, b)
            lon[who] += rng.normal(0.0, step, b)
            np.clip(lat, -90.0, 90.0, out=lat)
            np.clip(lon, -180.0, 180.0, out=lon)
            index.update_batch([ids[i] for i in who.tolist()], lat[who], lon[who], np.full(b, now))
            epoch += 1
            gc.collect()
            c0 = time.process_time()
            t0 = time.perf_counter()
            view = index.snapshot(now, epoch=epoch, seed=epoch)
            t1 = time.perf_counter()
            _prepare(live, view, by_k)
            t2 = time.perf_counter()
            cpu_ms.append((time.process_time() - c0) * 1e3)
            carried += bool(getattr(live, "carried_over", lambda v: True)(view))
            ref = index.snapshot_from_scratch(now, epoch=epoch, seed=epoch)
            _prepare(cls(), ref, by_k)
            t3 = time.perf_counter()
            inc_ms.append((t2 - t0) * 1e3)
            snap_ms.append((t1 - t0) * 1e3)
            scratch_ms.append((t3 - t2) * 1e3)
            sample = rng.choice(len(view), min(len(view), VIEW_CHECK_SAMPLE), replace=False).astype(np.int64)
            ref_rows = np.array([ref.row(view.user_ids[r]) for r in sample.tolist()], np.int64)
            req = ProfileArrays.from_profiles(_stored(view, sample.tolist(), by_k))
            mismatches += _differences(live.cloak_batch(view, sample, req), cls().cloak_batch(ref, ref_rows, req))
            del ref
            progress.advance(1)
        row["batches"].append(
            {
                "moved": b,
                "incremental_ms": _stats(inc_ms),
                "incremental_snapshot_ms": _stats(snap_ms),
                "incremental_cpu_ms": _stats(cpu_ms),
                "scratch_ms": _stats(scratch_ms),
                "speedup": float(np.median(scratch_ms) / np.median(inc_ms)),
                "carried_views": carried if hasattr(live, "carried_over") else None,
            }
        )
    row["mismatches"] = mismatches
    row.update(_single_calls(live, view, by_k, rng))
    return row


def _single_calls(
    cloaker: Cloaker, view: IndexView, by_k: Mapping[int, PrivacyProfile], rng: np.random.Generator
) -> dict[str, float]:
    """p50/p99 of single calls (stored profiles) on a prepared incremental view."""
    m = min(len(view), VIEW_SINGLE_CALLS)
    rows = rng.choice(len(view), m, replace=False).tolist()
    reqs = _stored(view, rows, by_k)
    ns = np.zeros(m, np.int64)
    pc = time.perf_counter_ns
    cloak = cloaker.cloak
    for i, (r, p) in enumerate(zip(rows, reqs, strict=True)):
        t0 = pc()
        cloak(view, r, p)
        ns[i] = pc() - t0
    return {"single_us_p50": float(np.percentile(ns, 50)) / 1e3, "single_us_p99": float(np.percentile(ns, 99)) / 1e3}
