"""Trajectory anonymization benchmark behind ``kcloak bench anonymize`` (contract §9; CONCEPTS §7.3–§7.5, §7.8).

Each (method, size) runs in its own Python process so that ``peak_rss_mb`` is that run's own peak
resident set (``getrusage(RUSAGE_SELF)`` in the worker, and the parent's sampling of the child) and a
run past the time limit can be stopped (``"status": "timeout"``). The worker generates the seeded
synthetic data, then times :func:`kcloak.streams.publish.anonymize` end to end (model, algorithm, fresh ids
and shuffle) — the ``runtime_s`` of the contract report; quality measures come from that report.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import BenchError
from kcloak.core.geometry import Aeqd
from kcloak.core.readers import FixTable

F64 = npt.NDArray[np.float64]

CITY_CENTRE = (39.9, 116.4)
"""Centre of the synthetic city (Beijing), WGS84."""

CITY_RADIUS_M = 15_000.0
"""Hubs lie within this distance of the centre."""

SAMPLING_PERIODS_S = (10.0, 20.0, 30.0)
"""Per-trajectory sampling periods of the synthetic data, drawn with :data:`SAMPLING_WEIGHTS`."""

SAMPLING_WEIGHTS = (0.7, 0.2, 0.1)

START_SPREAD_S = 300.0
"""Trajectory start times are uniform over this many seconds after the base time."""

BASE_T = 1_714_550_400.0
"""Base Unix time of the synthetic data (2024-05-01T08:00:00Z)."""

STATUSES = ("ok", "failed", "timeout", "out_of_memory", "error")
"""Row ``status``: ``failed`` = the anonymization refused (too few trajectories or trash over the bound)."""


# -- synthetic data ---------------------------------------------------------------------------
def synthetic_fixes(
    n: int,
    points: int = 100,
    *,
    seed: int = 0,
    hubs: int = 24,
    centre: tuple[float, float] = CITY_CENTRE,
) -> FixTable:
    """``n`` seeded trajectories of ``points`` fixes moving through a city, as one fix table.

    Each trajectory travels from one of ``hubs`` origins (Zipf-weighted popularity) to another along a
    bent two-leg route (a via point off the straight line), at a constant speed of 6–14 m/s, and waits
    at its destination once there. Sampling periods are 10, 20 or 30 s (70/20/10 %) with ±1 s jitter
    per fix, start times are uniform over five minutes, so spans and instants differ between
    trajectories; GPS noise is 8 m (σ). Deterministic for a given ``seed``.
    """
    if n < 0 or points < 2:
        raise BenchError("synthetic data: need n ≥ 0 trajectories of at least 2 points")
    rng = np.random.default_rng(seed)
    hub_xy = rng.normal(0.0, CITY_RADIUS_M / 2.5, (hubs, 2))
    norm = np.hypot(hub_xy[:, 0], hub_xy[:, 1])
    hub_xy *= np.minimum(1.0, CITY_RADIUS_M / np.maximum(norm, 1e-9))[:, None]
    weight = 1.0 / np.arange(1, hubs + 1) ** 0.8
    weight /= weight.sum()
    o = rng.choice(hubs, n, p=weight)
    d = rng.choice(hubs, n, p=weight)
    same = d == o
    d[same] = (o[same] + 1 + rng.integers(0, hubs - 1, int(same.sum()))) % hubs
    start = hub_xy[o] + rng.normal(0.0, 300.0, (n, 2))
    end = hub_xy[d] + rng.normal(0.0, 300.0, (n, 2))
    chord = end - start
    length = np.maximum(np.hypot(chord[:, 0], chord[:, 1]), 1.0)
    perp = np.stack([-chord[:, 1], chord[:, 0]], axis=1) / length[:, None]
    via = (start + end) / 2.0 + perp * (rng.normal(0.0, 0.15, n) * length)[:, None]
    leg1 = np.hypot(*(via - start).T)
    leg2 = np.hypot(*(end - via).T)
    period = rng.choice(np.array(SAMPLING_PERIODS_S), n, p=np.array(SAMPLING_WEIGHTS))
    t0 = BASE_T + rng.uniform(0.0, START_SPREAD_S, n)
    jitter = rng.uniform(-1.0, 1.0, (n, points))
    jitter[:, 0] = 0.0
    t_rel = np.arange(points)[None, :] * period[:, None] + jitter
    travelled = np.minimum(rng.uniform(6.0, 14.0, n)[:, None] * t_rel, (leg1 + leg2)[:, None])
    on1 = travelled <= leg1[:, None]
    f1 = np.clip(travelled / np.maximum(leg1, 1e-9)[:, None], 0.0, 1.0)
    f2 = np.clip((travelled - leg1[:, None]) / np.maximum(leg2, 1e-9)[:, None], 0.0, 1.0)
    xy1 = start[:, None, :] + f1[..., None] * (via - start)[:, None, :]
    xy2 = via[:, None, :] + f2[..., None] * (end - via)[:, None, :]
    xy = np.where(on1[..., None], xy1, xy2) + rng.normal(0.0, 8.0, (n, points, 2))
    lat, lon = Aeqd(*centre).inverse(xy[..., 0].ravel(), xy[..., 1].ravel())
    width = max(6, len(str(max(n - 1, 0))))
    ids = np.repeat(np.array([f"s{i:0{width}d}" for i in range(n)], dtype=np.str_), points)
    t = np.round((t0[:, None] + t_rel).ravel(), 3)
    return FixTable(ids, t, lat, lon)


# -- one run ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunSpec:
    """One benchmark run: ``method`` on ``n_trajectories`` synthetic trajectories of ``points`` fixes."""

    method: str
    n_trajectories: int
    points_per_trajectory: int
    k: int
    delta: float
    seed: int
    trash_max: float = 0.1
    memory_limit_mb: float | None = None
    pi_s: float = 60.0


def _peak_rss_mb() -> float:
    """Peak resident set of this process (Linux reports KiB, macOS bytes)."""
    peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def run_in_process(spec: RunSpec) -> dict[str, Any]:
    """Generate the data and anonymize it here (the worker side); the contract row plus extras."""
    from kcloak.streams.publish import anonymize

    if spec.memory_limit_mb is not None:
        limit = int(spec.memory_limit_mb * 1024 * 1024)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    row = _row(spec, "error")
    started = time.perf_counter()
    try:
        fixes = synthetic_fixes(spec.n_trajectories, spec.points_per_trajectory, seed=spec.seed)
        row["generate_s"] = time.perf_counter() - started
        release = anonymize(
            fixes, method=spec.method, k=spec.k, delta_m=spec.delta, trash_max=spec.trash_max, pi_s=spec.pi_s, seed=0
        )
    except MemoryError:
        row["status"] = "out_of_memory"
        row["peak_rss_mb"] = _peak_rss_mb()
        return row
    rep = release.report
    row.update(
        status="ok" if release.ok else "failed",
        runtime_s=rep["runtime_s"],
        peak_rss_mb=_peak_rss_mb(),
        trash_fraction=rep["trash_fraction"],
        mean_translation_m=rep["mean_translation_m"] if release.ok else None,
        time_distortion_s=rep["time_distortion_s"] if release.ok else None,
        range_query_distortion=rep["range_query_distortion"] if release.ok else None,
        n_out=rep["n_out"],
        n_groups=rep["n_groups"],
        total_s=time.perf_counter() - started,
    )
    return row


def _row(spec: RunSpec, status: str) -> dict[str, Any]:
    """A contract row (§9 ``anonymize`` shape) with no measurements yet."""
    return {
        "method": spec.method,
        "n_trajectories": spec.n_trajectories,
        "points_per_trajectory": spec.points_per_trajectory,
        "k": spec.k,
        "delta": float(spec.delta),
        "status": status,
        "runtime_s": None,
        "peak_rss_mb": None,
        "trash_fraction": None,
        "mean_translation_m": None,
        "time_distortion_s": None,
        "range_query_distortion": None,
    }


def _rss_mb(pid: int) -> float | None:
    """Current resident set of process ``pid`` from ``/proc`` (Linux), or ``None`` when unavailable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def run_in_subprocess(spec: RunSpec, *, time_limit_s: float, poll_s: float = 0.2) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter; kill it past ``time_limit_s`` (``"status": "timeout"``).

    The child's resident set is also sampled every ``poll_s`` so a killed run still reports a peak.
    """
    cmd = [sys.executable, "-I", "-m", "kcloak.streams.bench", json.dumps(asdict(spec))]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampled = 0.0
    timed_out = False
    while proc.poll() is None:
        sampled = max(sampled, _rss_mb(proc.pid) or 0.0)
        if time.perf_counter() - started > time_limit_s:
            proc.kill()
            timed_out = True
            break
        time.sleep(poll_s)
    out, err = proc.communicate()
    elapsed = time.perf_counter() - started
    if timed_out:
        row = _row(spec, "timeout")
        row["runtime_s"] = elapsed
        row["peak_rss_mb"] = sampled or None
        return row
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        row = _row(spec, "out_of_memory" if "MemoryError" in err else "error")
        row["peak_rss_mb"] = sampled or None
        row["error"] = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return row
    row = dict(json.loads(lines[-1]))
    if row.get("peak_rss_mb") is not None:
        row["peak_rss_mb"] = max(float(row["peak_rss_mb"]), sampled)
    return row


# -- the benchmark ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AnonymizeBenchConfig:
    """Flags of ``kcloak bench anonymize`` (contract §9 defaults)."""

    sizes: tuple[int, ...] = (1000, 10_000, 100_000)
    points: int = 100
    k: int = 5
    delta: float = 500.0
    methods: tuple[str, ...] = ("nwa", "w4m", "microagg")
    time_limit_s: float = 600.0
    seed: int = 0
    trash_max: float = 0.1
    memory_limit_mb: float | None = 8192.0
    pi_s: float = 60.0

    def specs(self) -> list[RunSpec]:
        """The runs, size by size, each size with every method."""
        return [
            RunSpec(m, n, self.points, self.k, self.delta, self.seed, self.trash_max, self.memory_limit_mb, self.pi_s)
            for n in self.sizes
            for m in self.methods
        ]


def validate(config: AnonymizeBenchConfig, known_methods: Sequence[str]) -> None:
    """Reject configurations no run could use (:class:`BenchError`)."""
    if not config.sizes or any(n < 1 for n in config.sizes):
        raise BenchError("sizes: give at least one size ≥ 1")
    if config.points < 2:
        raise BenchError("points: must be at least 2")
    if config.k < 2:
        raise BenchError("k: must be an integer ≥ 2")
    if not (math.isfinite(config.delta) and config.delta >= 0):
        raise BenchError("delta: must be a finite number of metres ≥ 0")
    if not config.methods:
        raise BenchError("methods: name at least one method")
    for m in config.methods:
        if m not in known_methods:
            raise BenchError(f"methods: unknown method {m!r} (known: {', '.join(known_methods)})")
    if not (math.isfinite(config.time_limit_s) and config.time_limit_s > 0):
        raise BenchError("time limit: must be a positive number of seconds")
    if not (math.isfinite(config.pi_s) and config.pi_s > 0):
        raise BenchError("pi_s: must be a positive number of seconds")
    if config.memory_limit_mb is not None and not config.memory_limit_mb >= 256:
        raise BenchError("memory limit: must be at least 256 MB")


def run_anonymize_bench(
    config: AnonymizeBenchConfig, *, on_row: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Every (size, method) run in its own process; rows in run order."""
    from kcloak.streams.publish import METHODS

    validate(config, METHODS)
    rows: list[dict[str, Any]] = []
    for spec in config.specs():
        row = run_in_subprocess(spec, time_limit_s=config.time_limit_s)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _worker(argv: Sequence[str]) -> int:
    """``python -m kcloak.streams.bench SPEC_JSON``: one run, its row as one JSON line on stdout."""
    spec = RunSpec(**json.loads(argv[0]))
    sys.stdout.write(json.dumps(run_in_process(spec)) + "\n")
    return 0


__all__ = [
    "STATUSES",
    "AnonymizeBenchConfig",
    "BenchError",
    "RunSpec",
    "run_anonymize_bench",
    "run_in_process",
    "run_in_subprocess",
    "synthetic_fixes",
    "validate",
]


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1:]))
