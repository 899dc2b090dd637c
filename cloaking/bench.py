"""The spatial-cloaking benchmark behind ``kcloak bench cloak`` (CONCEPTS §9.9; contract §9).

A run builds a population (clustered synthetic, or a snapshot of a real trace), gives every
user a stored profile personalized around ``K``, and for each algorithm cloaks one seeded
stream of requests against an immutable view: one call at a time (each call timed with
``perf_counter_ns``), then through ``cloak_batch``. It reports the quality metrics of §9.9
(success rate, achieved k, areas, area relative to the nearest-neighbour MBR, refusals by
code, the k-violation rate of §6.3 on a sample) and the costs (latency percentiles,
throughput, per-view preparation, index updates, memory per user). ``clique`` holds
requests (§4.5), so it is run as a stream of messages spread over simulated time instead.

No I/O here: the CLI (:mod:`kcloak.cli.bench_cloak`) reads files and renders the report.
"""

from __future__ import annotations

import gc
import importlib
import logging
import math
import os
import platform
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.bench_views import VIEW_ROUNDS, ViewsConfig, measure_views
from kcloak.cloaking.cloakers import SPATIAL_ALGORITHMS, cloaker_class
from kcloak.cloaking.cloakers.base import STATUS_OF, STATUS_OK, BatchResult, Refusal, Region
from kcloak.cloaking.index import IndexView, PositionIndex
from kcloak.core.errors import BenchError
from kcloak.core.geometry import EARTH_RADIUS_M, BBox
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode
from kcloak.core.readers import FixTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

_log = logging.getLogger(__name__)

CITY_LAT = 39.9
CITY_LON = 116.4
"""Centre of the synthetic city (Beijing, like the bundled POIs and the T-Drive trace)."""

SYNTHETIC_NOW = 1_700_000_000.0
"""Snapshot instant of synthetic populations (Unix s); every synthetic fix is 0–50 s older."""

STALE_AFTER_S = 60.0
"""Contract presence window (§2.3), used for synthetic populations."""

K_LEVEL_WEIGHTS: tuple[float, float, float] = (0.25, 0.5, 0.25)
"""Stored k is ⌈K/2⌉, K or ⌊3K/2⌋ with these probabilities (mean ≈ K)."""

UPDATE_CHUNK = 10_000
"""Fixes per ``update_batch`` call (the contract's batch limit, §1)."""

KVIOL_SAMPLE = 200
"""Successful requests checked for reciprocity violations (§6.3) per algorithm …"""
KVIOL_CALL_BUDGET = 20_000
"""… unless re-cloaking the members of their regions would take more calls than this."""

CLIQUE_QUERIES_PER_USER_MIN = 1.0
"""Arrival rate of the clique stream: each user queries once a minute (``simulate``'s default)."""


class Progress(Protocol):
    """Where a long benchmark reports its phases (the CLI draws them with ``rich``)."""

    def phase(self, description: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...


class NullProgress:
    """Progress that shows nothing."""

    def phase(self, description: str, total: int) -> None:
        return None

    def advance(self, n: int) -> None:
        return None


# -- populations ------------------------------------------------------------------------------
def user_ids(n: int) -> list[str]:
    """Benchmark user ids ``u0000000`` … (valid contract user ids, unrelated to any source id)."""
    return [f"u{i:07d}" for i in range(n)]


@dataclass(frozen=True, slots=True, eq=False)
class Population:
    """Latest fixes of the users a benchmark cloaks: all present at ``now`` (§2.3).

    ``description`` says how the population was made; it goes into the JSON report.
    """

    lat: F64
    lon: F64
    t: F64
    now: float
    stale_after_s: float
    description: Mapping[str, Any]

    def __len__(self) -> int:
        return len(self.lat)


def clustered_population(
    n: int, *, seed: int, lat0: float = CITY_LAT, lon0: float = CITY_LON, background: float = 0.1
) -> Population:
    """Gaussian clusters of varying size and spread around a city, plus a uniform background.

    ``min(64, max(1, n // 500))`` cluster centres lie within ~13 km (1σ) of the city centre;
    cluster weights are log-normal, spreads log-uniform in 150 m … 3 km; a fraction
    ``background`` of the users is uniform over a ±0.3° × ±0.4° box (≈ 67 × 68 km).
    """
    if n < 1:
        raise BenchError("users: must be at least 1")
    rng = np.random.default_rng([seed, 1])
    n_bg = round(n * background)
    n_cl = n - n_bg
    clusters = min(64, max(1, n // 500))
    c_lat = lat0 + rng.normal(0.0, 0.12, clusters)
    c_lon = lon0 + rng.normal(0.0, 0.15, clusters)
    weights = rng.lognormal(0.0, 1.0, clusters)
    sigma_m = np.exp(rng.uniform(math.log(150.0), math.log(3000.0), clusters))
    member = rng.choice(clusters, size=n_cl, p=weights / weights.sum())
    m_per_deg = EARTH_RADIUS_M * math.pi / 180.0
    s_lat = sigma_m[member] / m_per_deg
    s_lon = s_lat / np.cos(np.radians(c_lat[member]))
    lat = np.concatenate([c_lat[member] + rng.normal(size=n_cl) * s_lat, lat0 + rng.uniform(-0.3, 0.3, n_bg)])
    lon = np.concatenate([c_lon[member] + rng.normal(size=n_cl) * s_lon, lon0 + rng.uniform(-0.4, 0.4, n_bg)])
    order = rng.permutation(n)  # cluster members must not sit in consecutive rows
    t = SYNTHETIC_NOW - rng.uniform(0.0, 50.0, n)
    return Population(
        lat=np.clip(lat[order], -90.0, 90.0),
        lon=np.clip(lon[order], -180.0, 180.0),
        t=t,
        now=SYNTHETIC_NOW,
        stale_after_s=STALE_AFTER_S,
        description={
            "source": "synthetic",
            "model": "clustered",
            "users": n,
            "centre": [lat0, lon0],
            "clusters": clusters,
            "background_fraction": background,
            "cluster_sigma_m": [150.0, 3000.0],
        },
    )


def auto_window_s(fixes: FixTable) -> float:
    """A staleness window suited to the trace: the 90th percentile of the gaps between consecutive
    fixes of a trajectory, rounded up to a whole minute, at least the contract's 60 s.

    T-Drive (gaps: median 131 s, p90 302 s) gets 360 s.
    """
    s = fixes.sorted()
    same = s.traj_id[1:] == s.traj_id[:-1]
    gaps = np.diff(s.t)[same]
    if len(gaps) == 0:
        return STALE_AFTER_S
    p90 = float(np.percentile(gaps, 90))
    return max(STALE_AFTER_S, 60.0 * math.ceil(p90 / 60.0))


def busiest_instant(fixes: FixTable, window_s: float) -> tuple[float, int]:
    """The instant ``T`` (a fix time) maximizing the trajectories with a fix in ``[T − window_s, T]``,
    and that number; ties go to the latest such ``T`` (the freshest snapshot).
    """
    if len(fixes) == 0:
        raise BenchError("data: no usable fixes")
    s = fixes.sorted()
    new_traj = np.ones(len(s), bool)
    new_traj[1:] = s.traj_id[1:] != s.traj_id[:-1]
    # Per trajectory, merge the intervals [t_i, t_i + w] into disjoint runs; coverage at T counts
    # the runs containing T, i.e. the trajectories with a fix in [T − w, T].
    start = new_traj.copy()
    start[1:] |= s.t[1:] > s.t[:-1] + window_s
    run_id = np.cumsum(start) - 1
    run_start = s.t[start]
    run_end = np.zeros(len(run_start))
    np.maximum.at(run_end, run_id, s.t + window_s)
    starts = np.sort(run_start)
    ends = np.sort(run_end)
    candidates = np.unique(s.t)
    cover = np.searchsorted(starts, candidates, "right") - np.searchsorted(ends, candidates, "left")
    best = int(cover.max())
    at = float(candidates[np.flatnonzero(cover == best)[-1]])
    return at, best


def snapshot_population(
    fixes: FixTable,
    *,
    window_s: float | None = None,
    max_users: int | None = None,
    seed: int = 0,
    source: str = "data",
) -> Population:
    """The latest fix of every trajectory at the busiest instant of a trace (§2.3, §2.4).

    ``window_s`` is the staleness window (``None``: :func:`auto_window_s`; ``0``: the whole
    trace, i.e. every trajectory's last fix). The instant ``T`` maximizes the number of
    trajectories with a fix in ``[T − window_s, T]`` (:func:`busiest_instant`); each of them
    contributes its latest fix at or before ``T``. ``max_users`` keeps a seeded random subset.
    """
    if len(fixes) == 0:
        raise BenchError("data: no usable fixes")
    if window_s is None:
        window = auto_window_s(fixes)
        rule = "auto: 90th percentile of consecutive-fix gaps, rounded up to a minute (min 60 s)"
    elif window_s == 0:
        window = float(fixes.t.max() - fixes.t.min()) + 1.0
        rule = "whole trace: the last fix of every trajectory"
    elif window_s > 0:
        window = float(window_s)
        rule = "given"
    else:
        raise BenchError("window-s: must be 0 (whole trace) or positive")
    at, count = busiest_instant(fixes, window)
    s = fixes.sorted()
    keep = (s.t <= at) & (s.t >= at - window)
    ids, t, lat, lon = s.traj_id[keep], s.t[keep], s.lat[keep], s.lon[keep]
    last = np.ones(len(ids), bool)
    last[:-1] = ids[1:] != ids[:-1]  # sorted by (traj_id, t): the last row of each id is its latest fix
    t, lat, lon = t[last], lat[last], lon[last]
    assert len(t) == count
    if max_users is not None and max_users < len(t):
        pick = np.sort(np.random.default_rng([seed, 2]).choice(len(t), max_users, replace=False))
        t, lat, lon = t[pick], lat[pick], lon[pick]
    return Population(
        lat=lat,
        lon=lon,
        t=t,
        now=at,
        stale_after_s=window,
        description={
            "source": source,
            "users": len(t),
            "snapshot": {
                "t": at,
                "window_s": window,
                "window_rule": rule,
                "trajectories_in_window": count,
                "trajectories": fixes.n_trajectories,
                "fixes": len(fixes),
                "bad_rows": fixes.bad_rows,
            },
        },
    )


# -- profiles and requests --------------------------------------------------------------------
DEFAULT_K_SPREAD = 0.5


def k_levels(k: int, spread: float = DEFAULT_K_SPREAD) -> tuple[int, int, int]:
    """The three stored-k values around ``k``: k·(1 − spread), k, k·(1 + spread), rounded inward
    (the default spread 0.5 gives ⌈k/2⌉, k, ⌊3k/2⌋; 0 makes every user ask for k)."""
    lo = max(1, k - int(k * spread))
    hi = min(1000, k + int(k * spread))
    return lo, k, hi


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Stored profiles of every user and the request stream (querier rows, in order)."""

    stored_k: I64
    profiles: Mapping[int, PrivacyProfile]
    rows: I64

    @property
    def requested_k(self) -> I64:
        out: I64 = self.stored_k[self.rows]
        return out

    def profile_list(self) -> list[PrivacyProfile]:
        """Effective profile of each request (= the querier's stored profile)."""
        by_k = self.profiles
        return [by_k[k] for k in self.requested_k.tolist()]

    def profile_arrays(self) -> ProfileArrays:
        return ProfileArrays.from_profiles(self.profile_list())


def make_workload(
    n_users: int, *, k: int, requests: int, max_area_m2: float, seed: int, k_spread: float = DEFAULT_K_SPREAD
) -> Workload:
    """Stored k personalized around ``k`` (:data:`K_LEVEL_WEIGHTS`), ``min_area_m2`` 0, ``max_area_m2``
    as given; queriers drawn uniformly with replacement. Seeded, independent of the algorithms run.
    """
    levels = k_levels(k, k_spread)
    rng = np.random.default_rng([seed, 3])
    stored = np.asarray(levels, np.int64)[rng.choice(3, size=n_users, p=K_LEVEL_WEIGHTS)]
    profiles = {lv: PrivacyProfile(k=lv, min_area_m2=0.0, max_area_m2=max_area_m2) for lv in set(levels)}
    rows = rng.integers(0, n_users, requests).astype(np.int64)
    return Workload(stored, profiles, rows)


def build_index(pop: Population, work: Workload, ids: Sequence[str] | None = None) -> PositionIndex:
    """A position index holding every user of ``pop`` with its stored profile."""
    uids = list(ids) if ids is not None else user_ids(len(pop))
    index = PositionIndex(stale_after_s=pop.stale_after_s)
    index.update_batch(uids, pop.lat, pop.lon, pop.t)
    set_profile = index.set_profile
    by_k = work.profiles
    for u, kv in zip(uids, work.stored_k.tolist(), strict=True):
        set_profile(u, by_k[kv])
    return index


# -- index costs ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class IndexCosts:
    """Algorithm-independent costs of the position index (the same in every result row)."""

    bytes_per_user: float
    updates_per_s: float
    batch_updates_per_s: float
    update_moves: int


def measure_index(pop: Population, work: Workload, *, seed: int, progress: Progress) -> IndexCosts:
    """Memory of an index holding every user (``tracemalloc``: numpy columns, the user → row dict,
    the id strings and the Hilbert order kept from one view to the next), then ``update`` one fix at
    a time and ``update_batch`` in chunks of :data:`UPDATE_CHUNK`, both on random moves (σ 20 m) of
    existing users taken in a seeded random order (one fix per user per chunk when there are at
    least that many users).
    """
    n = len(pop)
    progress.phase("index: memory", 1)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = build_index(pop, work, user_ids(n))  # fresh id strings, counted
        index.snapshot(pop.now)  # from its first view on, the index keeps its users' Hilbert order
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    progress.advance(1)

    moves = min(max(n, UPDATE_CHUNK), 200_000)
    rng = np.random.default_rng([seed, 4])
    who = np.resize(rng.permutation(n), moves)  # distinct users within every batch chunk (n ≥ chunk)
    ids = user_ids(n)
    uids = [ids[i] for i in who.tolist()]
    step = 20.0 / (EARTH_RADIUS_M * math.pi / 180.0)
    lat = np.clip(pop.lat[who] + rng.normal(0.0, step, moves), -90.0, 90.0)
    lon = np.clip(pop.lon[who] + rng.normal(0.0, step, moves), -180.0, 180.0)
    t = pop.now + 1.0 + np.arange(moves) * 1e-3
    lat_l, lon_l, t_l = lat.tolist(), lon.tolist(), t.tolist()

    progress.phase("index: updates", 2 * moves)
    update = index.update
    done = 0
    elapsed = 0
    pc = time.perf_counter_ns
    for lo in range(0, moves, UPDATE_CHUNK):
        hi = min(moves, lo + UPDATE_CHUNK)
        t0 = pc()
        for u, a, b, c in zip(uids[lo:hi], lat_l[lo:hi], lon_l[lo:hi], t_l[lo:hi], strict=True):
            update(u, a, b, c)
        elapsed += pc() - t0
        done += hi - lo
        progress.advance(hi - lo)
    single = done / (elapsed / 1e9)

    elapsed = 0
    for lo in range(0, moves, UPDATE_CHUNK):
        hi = min(moves, lo + UPDATE_CHUNK)
        chunk = uids[lo:hi]
        a, b, c = lat[lo:hi], lon[lo:hi], t[lo:hi]
        t0 = pc()
        index.update_batch(chunk, a, b, c)
        elapsed += pc() - t0
        progress.advance(hi - lo)
    batch = moves / (elapsed / 1e9)
    return IndexCosts(used / n, single, batch, moves)


# -- result rows ------------------------------------------------------------------------------
CONTRACT_FIELDS: tuple[str, ...] = (
    "algorithm",
    "users",
    "k",
    "requests",
    "success_rate",
    "achieved_k_mean",
    "area_m2_median",
    "area_m2_p95",
    "area_ratio_to_nn",
    "cloak_us_p50",
    "cloak_us_p99",
    "cloaks_per_s",
    "batch_cloaks_per_s",
    "updates_per_s",
    "batch_updates_per_s",
    "bytes_per_user",
)
"""The ``bench cloak`` row of contract §9, in order; a row's extra fields follow these."""


@dataclass(frozen=True, slots=True)
class CloakBenchRow:
    """One algorithm's result (contract §9 ``cloak`` row); ``extra`` holds development fields
    (``prepare_ms``, ``refusals``, ``k_violation_rate``, …, or ``error`` when it could not run).
    """

    algorithm: str
    users: int
    k: int
    requests: int
    success_rate: float | None = None
    achieved_k_mean: float | None = None
    area_m2_median: float | None = None
    area_m2_p95: float | None = None
    area_ratio_to_nn: float | None = None
    cloak_us_p50: float | None = None
    cloak_us_p99: float | None = None
    cloaks_per_s: float | None = None
    batch_cloaks_per_s: float | None = None
    updates_per_s: float | None = None
    batch_updates_per_s: float | None = None
    bytes_per_user: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: _num(getattr(self, name)) for name in CONTRACT_FIELDS}
        out.update({name: _num(v) for name, v in self.extra.items()})
        return out


def _num(v: Any, digits: int | None = 6) -> Any:
    """JSON-safe value: floats to ``digits`` significant digits (``None``: exact), non-finite to ``None``."""
    if isinstance(v, float | np.floating):
        f = float(v)
        if not math.isfinite(f):
            return None
        return f if digits is None else float(f"{f:.{digits}g}")
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, Mapping):
        return {str(k): _num(x, digits) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_num(x, digits) for x in v]
    return v


@dataclass(frozen=True, slots=True)
class CloakBenchConfig:
    """Parameters of one run (contract §9 ``bench cloak`` flags).

    ``time_limit_s`` bounds each algorithm's single-call stream (the remaining requests are
    dropped and the row says ``"truncated": true``); ``clique_queries_per_user_min`` sets the
    clique stream's arrival rate.
    """

    algorithms: tuple[str, ...] = SPATIAL_ALGORITHMS
    k: int = 10
    requests: int = 100_000
    max_area_m2: float = 4.0e6
    seed: int = 0
    time_limit_s: float = 300.0
    clique_queries_per_user_min: float = CLIQUE_QUERIES_PER_USER_MIN
    k_spread: float = DEFAULT_K_SPREAD
    view_batches: tuple[int, ...] = ()
    """Moved users per batch in the ``views`` section (empty, the default here: no section; the
    command line's default is :data:`~kcloak.cloaking.bench_views.VIEW_BATCHES`)."""
    view_rounds: int = VIEW_ROUNDS


@dataclass(frozen=True, slots=True)
class CloakBenchReport:
    """The whole run: result rows plus what was measured on what (top-level JSON extras)."""

    config: CloakBenchConfig
    population: Mapping[str, Any]
    index: IndexCosts
    rows: tuple[CloakBenchRow, ...]
    area_reference: str = "kcloak.cloaking.cloakers.nn.nn_mbr_area_m2"
    views: Mapping[str, Any] | None = None
    """View preparation after batches of moves, incremental against from scratch (bench_views)."""

    def to_json(self) -> dict[str, Any]:
        """``{"bench": "cloak", "results": [...]}`` plus ``seed``, ``population`` (with the snapshot
        instant and window for a trace), ``profiles``, ``area_reference``, ``index``, ``machine``.
        """
        c = self.config
        levels = k_levels(c.k, c.k_spread)
        return {
            "bench": "cloak",
            "results": [r.to_dict() for r in self.rows],
            "seed": c.seed,
            "population": _num(dict(self.population), None),  # exact: snapshot instants
            "profiles": {
                "k_levels": list(levels),
                "k_weights": list(K_LEVEL_WEIGHTS),
                "min_area_m2": 0.0,
                "max_area_m2": c.max_area_m2,
                "effective": "stored (no per-query override)",
            },
            "area_reference": self.area_reference,
            "notes": list(REPORT_NOTES),
            "index": {"update_moves": self.index.update_moves, "update_batch_chunk": UPDATE_CHUNK},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            **({"views": _num(dict(self.views))} if self.views is not None else {}),
        }

    @property
    def failed(self) -> bool:
        """True when no algorithm could be measured."""
        return all("error" in r.extra for r in self.rows)


REPORT_NOTES: tuple[str, ...] = (
    "updates_per_s, batch_updates_per_s and bytes_per_user belong to the PositionIndex: measured once, "
    "repeated in every row",
    "cloak_us_p50/p99 and cloaks_per_s time single calls on a prepared view; prepare_ms is the first call "
    "on a fresh view (per-view state), batch_cloaks_per_s one cloak_batch over the whole stream",
    "clique: a stream over simulated time; cloak_us_* is the wall time per arrival (due expiries + submit), "
    "latency_s_* the simulated hold (release - arrival), success = released / requests, "
    "k_achieved = senders sharing the box",
    "timings are wall-clock on a shared machine: compare runs made side by side",
)


# -- nearest-neighbour reference areas --------------------------------------------------------
NnAreaFn = Callable[[IndexView, I64, int], F64]


def load_nn_area() -> NnAreaFn | None:
    """``kcloak.cloaking.cloakers.nn.nn_mbr_area_m2`` if that module is there."""
    try:
        nn = importlib.import_module("kcloak.cloaking.cloakers.nn")
    except ImportError:
        return None
    fn: NnAreaFn | None = getattr(nn, "nn_mbr_area_m2", None)
    return fn


def nn_reference_areas(fn: NnAreaFn, view: IndexView, rows: I64, k: I64) -> F64:
    """Area of the MBR of each querier and its k−1 nearest users (one call per distinct k)."""
    out = np.full(len(rows), np.nan)
    for kv in np.unique(k).tolist():
        sel = k == kv
        out[sel] = np.asarray(fn(view, rows[sel], int(kv)), dtype=np.float64)
    return out


# -- the run ----------------------------------------------------------------------------------
def run_cloak_bench(pop: Population, config: CloakBenchConfig, *, progress: Progress | None = None) -> CloakBenchReport:
    """Benchmark every algorithm of ``config`` on ``pop`` (CONCEPTS §9.9)."""
    prog = progress if progress is not None else NullProgress()
    n = len(pop)
    if n < 1:
        raise BenchError("population: no users")
    work = make_workload(
        n,
        k=config.k,
        requests=config.requests,
        max_area_m2=config.max_area_m2,
        seed=config.seed,
        k_spread=config.k_spread,
    )
    classes: dict[str, type[Any] | str] = {}
    for name in config.algorithms:
        try:
            classes[name] = cloaker_class(name)
        except (ImportError, AttributeError) as exc:
            classes[name] = f"not available: {type(exc).__name__}: {exc}"
    if all(isinstance(c, str) for c in classes.values()):
        costs = IndexCosts(math.nan, math.nan, math.nan, 0)
        rows = [_error_row(_base(name, n, config), str(c)) for name, c in classes.items()]
        return CloakBenchReport(config, dict(pop.description), costs, tuple(rows), "not computed")

    costs = measure_index(pop, work, seed=config.seed, progress=prog)
    index = build_index(pop, work)
    nn_area: F64 | None = None
    fn = load_nn_area()
    reference = "kcloak.cloaking.cloakers.nn.nn_mbr_area_m2"
    if fn is None:
        reference = "unavailable: kcloak.cloaking.cloakers.nn.nn_mbr_area_m2 not found"
    else:
        prog.phase("nn reference areas", 1)
        try:
            view = index.snapshot(pop.now, seed=config.seed)
            nn_area = nn_reference_areas(fn, view, work.rows, work.requested_k)
        except Exception as exc:  # the reference is optional; its failure only blanks the ratio
            reference = f"failed: {type(exc).__name__}: {exc}"
        prog.advance(1)

    rows = []
    for epoch, (name, cls) in enumerate(classes.items(), start=1):
        base = _base(name, n, config)
        if isinstance(cls, str):
            rows.append(_error_row(base, cls))
            continue
        try:
            if name == "clique":
                row = _bench_clique(cls, base, pop, work, config, prog, fn if nn_area is not None else None, index)
            else:
                row = _bench_snapshot(cls(), base, index, pop, work, config, epoch, prog, nn_area)
        except Exception as exc:  # a bug in one cloaker must not hide the others' results
            _log.warning("bench_algorithm_failed", extra={"algorithm": name}, exc_info=True)
            rows.append(_error_row(base, f"failed: {type(exc).__name__}: {exc}"))
            continue
        rows.append(_with_index_costs(row, costs))
    views = None
    if config.view_batches:
        views = measure_views(
            index,
            pop.lat,
            pop.lon,
            work.profiles,
            pop.now,
            tuple(r.algorithm for r in rows if "error" not in r.extra),
            ViewsConfig(config.view_batches, config.view_rounds, config.seed),
            progress=prog,
        )
    return CloakBenchReport(config, dict(pop.description), costs, tuple(rows), reference, views)


def _base(name: str, n: int, config: CloakBenchConfig) -> CloakBenchRow:
    return CloakBenchRow(algorithm=name, users=n, k=config.k, requests=config.requests)


def _error_row(base: CloakBenchRow, message: str) -> CloakBenchRow:
    return CloakBenchRow(base.algorithm, base.users, base.k, base.requests, extra={"error": message})


def _with_index_costs(row: CloakBenchRow, costs: IndexCosts) -> CloakBenchRow:
    d = {name: getattr(row, name) for name in CONTRACT_FIELDS}
    d.update(
        updates_per_s=costs.updates_per_s,
        batch_updates_per_s=costs.batch_updates_per_s,
        bytes_per_user=costs.bytes_per_user,
    )
    return CloakBenchRow(**d, extra=row.extra)


@dataclass(slots=True)
class _Outcomes:
    """Per-request outcomes as columns (status code of ``BATCH_CODES``, −1 for other refusals)."""

    status: npt.NDArray[np.int8]
    bbox: I64
    k_achieved: I64
    area_m2: F64
    refusals: Counter[str]

    @classmethod
    def of(cls, results: Sequence[Region | Refusal]) -> _Outcomes:
        m = len(results)
        out = cls(np.zeros(m, np.int8), np.zeros((m, 4), np.int64), np.zeros(m, np.int64), np.zeros(m), Counter())
        for i, res in enumerate(results):
            if isinstance(res, Refusal):
                out.status[i] = STATUS_OF.get(res.reason, -1)
                out.refusals[str(res.reason)] += 1
            else:
                b = res.bbox
                out.bbox[i] = (b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg)
                out.k_achieved[i] = res.k_achieved
                out.area_m2[i] = res.area_m2
        return out


def _quality(out: _Outcomes, requested_k: I64, nn_area: F64 | None) -> dict[str, float | None]:
    """success_rate, achieved_k_mean (users in the region, as the demo's), area percentiles and
    area_ratio_to_nn over the successes; plus achieved_k_ratio_mean/median (k_achieved / requested k)."""
    m = len(out.status)
    ok = out.status == STATUS_OK
    n_ok = int(np.count_nonzero(ok))
    q: dict[str, float | None] = {
        "success_rate": n_ok / m if m else None,
        "achieved_k_mean": None,
        "area_m2_median": None,
        "area_m2_p95": None,
        "area_ratio_to_nn": None,
        "achieved_k_ratio_mean": None,
        "achieved_k_ratio_median": None,
    }
    if n_ok == 0:
        return q
    area = out.area_m2[ok]
    ratio = out.k_achieved[ok] / requested_k[ok]
    q["achieved_k_mean"] = float(np.mean(out.k_achieved[ok]))
    q["achieved_k_ratio_mean"] = float(np.mean(ratio))
    q["achieved_k_ratio_median"] = float(np.median(ratio))
    q["area_m2_median"] = float(np.median(area))
    q["area_m2_p95"] = float(np.percentile(area, 95))
    if nn_area is not None:
        ref = nn_area[ok]
        usable = np.isfinite(ref) & (ref > 0)
        if usable.any():
            q["area_ratio_to_nn"] = float(np.median(area[usable] / ref[usable]))
    return q


def _bench_snapshot(
    cloaker: Any,
    base: CloakBenchRow,
    index: PositionIndex,
    pop: Population,
    work: Workload,
    config: CloakBenchConfig,
    epoch: int,
    prog: Progress,
    nn_area: F64 | None,
) -> CloakBenchRow:
    """One snapshot cloaker: fresh view, first call (preparation), timed single calls, batch."""
    name = base.algorithm
    pc = time.perf_counter_ns
    t0 = pc()
    view = index.snapshot(pop.now, epoch=epoch, seed=config.seed)
    snapshot_ms = (pc() - t0) / 1e6
    rows = work.rows.tolist()
    profiles = work.profile_list()
    m = len(rows)
    cloak = cloaker.cloak

    prog.phase(f"{name}: prepare", 1)
    t0 = pc()
    cloak(view, rows[0], profiles[0])
    prepare_ms = (pc() - t0) / 1e6
    prog.advance(1)

    prog.phase(f"{name}: cloak", m)
    ns = np.zeros(m, np.int64)
    results: list[Region | Refusal] = []
    append = results.append
    deadline = time.monotonic() + config.time_limit_s
    done = 0
    chunk = 1000
    while done < m:
        hi = min(m, done + chunk)
        for i in range(done, hi):
            r, p = rows[i], profiles[i]
            t0 = pc()
            res = cloak(view, r, p)
            ns[i] = pc() - t0
            append(res)
        prog.advance(hi - done)
        done = hi
        if time.monotonic() > deadline:
            break
    ns = ns[:done]
    out = _Outcomes.of(results)
    req_k = work.requested_k[:done]
    q = _quality(out, req_k, nn_area[:done] if nn_area is not None else None)
    total_s = float(ns.sum()) / 1e9
    extra: dict[str, Any] = {
        "cloak_us_p999": float(np.percentile(ns, 99.9)) / 1e3,
        "cloak_us_max": float(ns.max()) / 1e3,
        "prepare_ms": prepare_ms,
        "snapshot_ms": snapshot_ms,
        "achieved_k_ratio_mean": q.pop("achieved_k_ratio_mean"),
        "achieved_k_ratio_median": q.pop("achieved_k_ratio_median"),
        "refusals": dict(sorted(out.refusals.items())),
    }
    if done < m:
        extra["truncated"] = True
        extra["requests_done"] = done

    batch_per_s, mismatches = _bench_batch(cloaker, view, work, out, done, prog, name)
    extra["batch_mismatches"] = mismatches
    extra.update(_k_violations(cloaker, view, work, out, config.seed, prog, name))
    return CloakBenchRow(
        algorithm=name,
        users=base.users,
        k=base.k,
        requests=done,
        cloak_us_p50=float(np.percentile(ns, 50)) / 1e3,
        cloak_us_p99=float(np.percentile(ns, 99)) / 1e3,
        cloaks_per_s=done / total_s if total_s > 0 else None,
        batch_cloaks_per_s=batch_per_s,
        extra=extra,
        **q,
    )


def _bench_batch(
    cloaker: Any, view: IndexView, work: Workload, single: _Outcomes, done: int, prog: Progress, name: str
) -> tuple[float | None, int | None]:
    """``cloak_batch`` over the same requests on the same view (after a small warm-up batch);
    returns the throughput and how many results differ from the single calls (must be 0).
    """
    batch = getattr(cloaker, "cloak_batch", None)
    if batch is None:
        return None, None
    rows = work.rows[:done]
    profiles = _head(work.profile_arrays(), done)
    prog.phase(f"{name}: batch", 1)
    warm = min(done, 1000)
    batch(view, rows[:warm], _head(profiles, warm))
    t0 = time.perf_counter_ns()
    res: BatchResult = batch(view, rows, profiles)
    elapsed = (time.perf_counter_ns() - t0) / 1e9
    prog.advance(1)
    ok = single.status == STATUS_OK
    differ = (res.status != single.status) | (
        ok & ((res.bbox != single.bbox).any(axis=1) | (res.k_achieved != single.k_achieved))
    )
    return (done / elapsed if elapsed > 0 else None), int(np.count_nonzero(differ))


def _head(p: ProfileArrays, n: int) -> ProfileArrays:
    return ProfileArrays(p.k[:n], p.l[:n], p.min_area_m2[:n], p.max_area_m2[:n], p.max_delay_s[:n])


def _k_violations(
    cloaker: Any, view: IndexView, work: Workload, out: _Outcomes, seed: int, prog: Progress, name: str
) -> dict[str, Any]:
    """k-violation rate of §6.3 on a sample of successful requests: re-cloak every user inside the
    region with its stored profile; ``C`` = users whose region is the same bbox; violation when
    ``|C| < k``. Reciprocal algorithms must show 0. Also counts the sampled regions whose
    ``k_achieved`` differs from a recount of the users strictly inside (must be 0, §4.0).
    """
    ok_idx = np.flatnonzero(out.status == STATUS_OK)
    if len(ok_idx) == 0:
        return {"k_violation_rate": None, "k_violation_sample": 0, "k_achieved_miscounts": 0}
    order = np.random.default_rng([seed, 5]).permutation(ok_idx)
    rows = work.rows
    req_k = work.requested_k
    by_k = work.profiles
    stored = view.k
    cloak = cloaker.cloak

    prog.phase(f"{name}: k-violations", min(KVIOL_SAMPLE, len(order)))
    sampled = violations = calls = miscounted = 0
    for i in order.tolist():
        if sampled >= KVIOL_SAMPLE:
            break
        b = out.bbox[i]
        bbox = BBox(int(b[0]), int(b[1]), int(b[2]), int(b[3]))
        inside = view.rows_in(bbox)
        if calls + len(inside) > KVIOL_CALL_BUDGET and sampled > 0:
            break
        same = 0
        for v in inside.tolist():
            res = cloak(view, v, by_k[int(stored[v])])
            if isinstance(res, Region) and res.bbox == bbox:
                same += 1
        calls += len(inside)
        miscounted += int(len(inside) != out.k_achieved[i])
        querier_in = bool(np.any(inside == rows[i]))
        if not querier_in or same < int(req_k[i]):
            violations += 1
        sampled += 1
        prog.advance(1)
    return {
        "k_violation_rate": violations / sampled if sampled else None,
        "k_violation_sample": sampled,
        "k_achieved_miscounts": miscounted,
    }


# -- clique: a stream over simulated time -----------------------------------------------------
def clique_arrivals(n_users: int, requests: int, *, queries_per_user_min: float, seed: int) -> tuple[I64, F64]:
    """Querier rows and arrival offsets (s) of the clique stream: a Poisson process of total rate
    ``n_users · queries_per_user_min / 60`` per second; queriers follow a seeded permutation of the
    users, repeated as needed, so no user has two requests pending at once while a full cycle
    (``60 / queries_per_user_min`` s) outlasts ``max_delay_s``.
    """
    rng = np.random.default_rng([seed, 6])
    rate = n_users * queries_per_user_min / 60.0
    offsets = np.cumsum(rng.exponential(1.0 / rate, requests))
    perm = rng.permutation(n_users)
    rows = np.resize(perm, requests).astype(np.int64)
    return rows, offsets


def _bench_clique(
    cls: type[Any],
    base: CloakBenchRow,
    pop: Population,
    work: Workload,
    config: CloakBenchConfig,
    prog: Progress,
    nn_fn: NnAreaFn | None,
    index: PositionIndex,
) -> CloakBenchRow:
    """CliqueCloak (§4.5) as a stream over simulated time: each arrival first expires the requests
    whose deadline passed (as the broker's timer would), then is submitted; the cost of that step
    is timed per arrival. Success = released / requests; latency = release − arrival (simulated).
    ``batch_cloaks_per_s`` is the cloaker's own ``run_stream`` over the same stream.
    """
    from kcloak.cloaking.cloakers.clique import CliqueRequest

    name = base.algorithm
    n = len(pop)
    rows_a, offsets = clique_arrivals(
        n, config.requests, queries_per_user_min=config.clique_queries_per_user_min, seed=config.seed
    )
    by_k = work.profiles
    ids = user_ids(n)
    lat, lon, stored = pop.lat, pop.lon, work.stored_k
    arrivals = [
        (
            pop.now + float(offsets[i]),
            CliqueRequest.from_profile(
                f"q{i}", ids[r], float(lat[r]), float(lon[r]), pop.now + float(offsets[i]), by_k[int(stored[r])]
            ),
        )
        for i, r in enumerate(rows_a.tolist())
    ]
    m = len(arrivals)

    prog.phase(f"{name}: stream", m)
    cloaker = cls(seed=config.seed)
    submit, expire, next_deadline = cloaker.submit, cloaker.expire, cloaker.next_deadline
    pc = time.perf_counter_ns
    ns = np.zeros(m, np.int64)
    releases: list[Any] = []
    expired_at: dict[str, float] = {}
    deadline_wall = time.monotonic() + config.time_limit_s
    done = 0
    while done < m:
        hi = min(m, done + 1000)
        for i in range(done, hi):
            t, req = arrivals[i]
            t0 = pc()
            while (d := next_deadline()) is not None and d < t:
                for r in expire(d):
                    expired_at[r.request_id] = d
            out = submit(req, t)
            ns[i] = pc() - t0
            if out:
                releases.extend(out)
        prog.advance(hi - done)
        done = hi
        if time.monotonic() > deadline_wall:
            break
    while (d := next_deadline()) is not None:
        for r in expire(d):
            expired_at[r.request_id] = d
    ns = ns[:done]

    # per-request outcomes, in arrival order
    pos = {req.request_id: i for i, (_, req) in enumerate(arrivals[:done])}
    out_c = _Outcomes(
        np.full(done, STATUS_OF[ReasonCode.EXPIRED], np.int8),
        np.zeros((done, 4), np.int64),
        np.zeros(done, np.int64),
        np.zeros(done),
        Counter(),
    )
    latency = np.full(done, np.nan)
    undersized = 0
    for rel in releases:
        b = rel.bbox
        box = (b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg)
        size = len(rel.members)
        for req in rel.members:
            i = pos[req.request_id]
            out_c.status[i] = STATUS_OK
            out_c.bbox[i] = box
            out_c.k_achieved[i] = size
            out_c.area_m2[i] = rel.area_m2
            latency[i] = rel.released_at - req.t
            undersized += int(size < req.k)
    n_expired = int(np.count_nonzero(out_c.status != STATUS_OK))
    if n_expired:
        out_c.refusals[str(ReasonCode.EXPIRED)] = n_expired
    req_k = stored[rows_a[:done]]
    nn_area = None
    if nn_fn is not None:
        nn_area = nn_reference_areas(nn_fn, index.snapshot(pop.now, seed=config.seed), rows_a[:done], req_k)
    q = _quality(out_c, req_k, nn_area)
    released = latency[np.isfinite(latency)]
    total_s = float(ns.sum()) / 1e9
    extra: dict[str, Any] = {
        "cloak_us_p999": float(np.percentile(ns, 99.9)) / 1e3 if done else None,
        "cloak_us_max": float(ns.max()) / 1e3 if done else None,
        "prepare_ms": None,
        "achieved_k_ratio_mean": q.pop("achieved_k_ratio_mean"),
        "achieved_k_ratio_median": q.pop("achieved_k_ratio_median"),
        "refusals": dict(out_c.refusals),
        "arrival_rate_per_s": n * config.clique_queries_per_user_min / 60.0,
        "queries_per_user_per_min": config.clique_queries_per_user_min,
        "stream_s": float(offsets[done - 1]) if done else 0.0,
        "latency_s_p50": float(np.percentile(released, 50)) if len(released) else None,
        "latency_s_p99": float(np.percentile(released, 99)) if len(released) else None,
        "k_violation_rate": undersized / len(released) if len(released) else None,
        "k_violation_sample": len(released),
        "search_gave_up": cloaker.gave_up,
    }
    if done < m:
        extra["truncated"] = True
        extra["requests_done"] = done

    batch_per_s: float | None = None
    run_stream = getattr(cls(seed=config.seed), "run_stream", None)
    if run_stream is not None:
        prog.phase(f"{name}: run_stream", 1)
        t0 = pc()
        b_releases, _ = run_stream(arrivals[:done])
        elapsed = (pc() - t0) / 1e9
        prog.advance(1)
        batch_per_s = done / elapsed if elapsed > 0 else None
        single_set = {(tuple(r.request_id for r in rel.members), rel.bbox, rel.released_at) for rel in releases}
        batch_set = {(tuple(r.request_id for r in rel.members), rel.bbox, rel.released_at) for rel in b_releases}
        extra["batch_mismatches"] = len(single_set ^ batch_set)
    return CloakBenchRow(
        algorithm=name,
        users=base.users,
        k=base.k,
        requests=done,
        cloak_us_p50=float(np.percentile(ns, 50)) / 1e3 if done else None,
        cloak_us_p99=float(np.percentile(ns, 99)) / 1e3 if done else None,
        cloaks_per_s=done / total_s if total_s > 0 else None,
        batch_cloaks_per_s=batch_per_s,
        extra=extra,
        **q,
    )
