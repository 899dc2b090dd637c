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
from kcloak.core.extras import require_pictures
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
        range_query_distortion_dai=rep["range_query_distortion_dai"] if release.ok else None,
        translation_median_m=rep["translation_m"]["median"] if release.ok else None,
        translation_p95_m=rep["translation_m"]["p95"] if release.ok else None,
        translation_max_m=rep["translation_m"]["max"] if release.ok else None,
        time_shift_p95_s=rep["time_shift_s"]["p95"] if release.ok else None,
        time_shift_max_s=rep["time_shift_s"]["max"] if release.ok else None,
        trash_reasons=rep["trash_reasons"],
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
    ks: tuple[int, ...] = ()
    deltas: tuple[float, ...] = ()

    def specs(self) -> list[RunSpec]:
        """The runs, size by size, each size with every method (and every (k, δ) of a trade-off sweep)."""
        ks = self.ks or (self.k,)
        deltas = self.deltas or (self.delta,)
        return [
            RunSpec(m, n, self.points, k, d, self.seed, self.trash_max, self.memory_limit_mb, self.pi_s)
            for n in self.sizes
            for m in self.methods
            for k in ks
            for d in deltas
        ]


def validate(config: AnonymizeBenchConfig, known_methods: Sequence[str]) -> None:
    """Reject configurations no run could use (:class:`BenchError`)."""
    if not config.sizes or any(n < 1 for n in config.sizes):
        raise BenchError("sizes: give at least one size ≥ 1")
    if config.points < 2:
        raise BenchError("points: must be at least 2")
    if config.k < 2 or any(k < 2 for k in config.ks):
        raise BenchError("k: must be an integer ≥ 2")
    if not all(math.isfinite(d) and d >= 0 for d in (config.delta, *config.deltas)):
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


# -- the (k, δ) trade-off -----------------------------------------------------------------------
TRADEOFF_MEASURES = (
    ("range_query_distortion", "range-query distortion (PSI)", ".3f"),
    ("mean_translation_m", "mean translation (m)", ",.0f"),
    ("trash_fraction", "trash fraction", ".1%"),
)
"""Measures of the trade-off table and picture: row key, label, format."""


def tradeoff_grid(
    rows: Sequence[dict[str, Any]], measure: str, *, failed_too: bool = False
) -> dict[tuple[str, int], dict[tuple[int, float], Any]]:
    """``{(method, n): {(k, δ): value}}`` of one measure over the rows (``None`` where the run did not
    publish, unless ``failed_too`` keeps the value of a refused run, e.g. its trash fraction)."""
    grid: dict[tuple[str, int], dict[tuple[int, float], Any]] = {}
    for r in rows:
        cell = grid.setdefault((str(r["method"]), int(r["n_trajectories"])), {})
        keep = r.get("status") == "ok" or (failed_too and r.get("status") == "failed")
        cell[(int(r["k"]), float(r["delta"]))] = r.get(measure) if keep else None
    return grid


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: str) -> None:
    """The (k, δ) trade-off as a picture (PNG/SVG/PDF by suffix): one panel per measure, range-query
    distortion, mean translation and trash against δ, one line per (method, k). Needs matplotlib."""
    require_pictures()
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, len(TRADEOFF_MEASURES), figsize=(5.0 * len(TRADEOFF_MEASURES), 4.2))
    series = sorted({(str(r["method"]), int(r["n_trajectories"]), int(r["k"])) for r in rows})
    colour = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(series)}
    for ax, (measure, label, _) in zip(axes, TRADEOFF_MEASURES, strict=True):
        grid = tradeoff_grid(rows, measure, failed_too=measure == "trash_fraction")
        for method, n, k in series:
            cells = grid.get((method, n), {})
            pts = sorted((d, v) for (kk, d), v in cells.items() if kk == k and v is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour[(method, n, k)])
        ax.set_xlabel("δ (m)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colour[s], marker="o") for s in series]
    fig.legend(handles, [f"{m} n={n} k={k}" for m, n, k in series], loc="lower center", ncol=min(6, len(series)))
    fig.suptitle("bench anonymize — (k, δ) trade-off (a missing point is a refused run; its trash is on the right)")
    fig.tight_layout(rect=(0.0, 0.12, 1.0, 1.0))
    fig.savefig(path)
    plt.close(fig)


def _worker(argv: Sequence[str]) -> int:
    """``python -m kcloak.streams.bench SPEC_JSON``: one run, its row as one JSON line on stdout."""
    spec = RunSpec(**json.loads(argv[0]))
    sys.stdout.write(json.dumps(run_in_process(spec)) + "\n")
    return 0


__all__ = [
    "STATUSES",
    "TRADEOFF_MEASURES",
    "AnonymizeBenchConfig",
    "BenchError",
    "RunSpec",
    "plot_tradeoff",
    "run_anonymize_bench",
    "run_in_process",
    "run_in_subprocess",
    "synthetic_fixes",
    "tradeoff_grid",
    "validate",
]


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1:]))
