"""``kcloak bench lbs``: per-request time and candidate-set size of the reference LBS (contract §5, §9).

A seeded stream of typical cloaked regions over a POI file (the bundled Beijing POIs by default):
boxes of 0.01 km² up to ``--max-area-m2`` around POIs, aspect ratio up to about 3:1, kNN with
``n`` in 1..``--n-max`` and range with a radius of 100 m to 2 km, half without and half with a
category. Each request is timed in-process on :class:`~kcloak.broker.lbs.LbsEngine` (wall clock and this
thread's CPU time), and its candidate set is compared with the exact answer at a uniform random
point of the region, computed by brute force with the contract's haversine (an answer outside the
candidates is counted as a violation; there must be none).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kcloak.broker.lbs import LbsEngine, LonLatBox
from kcloak.core.geometry import EARTH_RADIUS_M, haversine_m_array
from kcloak.core.places import PoiSet

M_PER_DEG = EARTH_RADIUS_M * math.pi / 180
MIN_AREA_M2 = 1e4
CENTRE_JITTER_M = 1000.0
RADIUS_RANGE_M = (100.0, 2000.0)
WARMUP_REQUESTS = 20


@dataclass(frozen=True, slots=True)
class LbsBenchConfig:
    """Flags of ``kcloak bench lbs`` (defaults as in the contract's style: typical cloaked regions)."""

    requests: int = 2000
    max_area_m2: float = 4e6
    n_max: int = 10
    seed: int = 0


@dataclass(frozen=True, slots=True)
class SearchCase:
    """One request of the stream: the region, both kinds' parameters and the category (or none)."""

    box: LonLatBox
    n: int
    radius_m: float
    category: str | None


def search_stream(pois: PoiSet, config: LbsBenchConfig) -> list[SearchCase]:
    """The seeded stream of regions (see the module docstring)."""
    rng = np.random.default_rng(config.seed)
    cats = [p.category for p in pois.pois]
    out: list[SearchCase] = []
    lo_area, hi_area = math.log10(MIN_AREA_M2), math.log10(max(config.max_area_m2, MIN_AREA_M2))
    for i in range(config.requests):
        j = int(rng.integers(len(cats)))
        lat = float(np.clip(pois.lat[j] + rng.normal(0, CENTRE_JITTER_M / M_PER_DEG), -89.0, 89.0))
        lon = float(pois.lon[j] + rng.normal(0, CENTRE_JITTER_M / (M_PER_DEG * math.cos(math.radians(lat)))))
        area, aspect = 10 ** rng.uniform(lo_area, hi_area), 10 ** rng.uniform(-0.5, 0.5)
        half_h = math.sqrt(area / aspect) / M_PER_DEG / 2
        half_w = math.sqrt(area * aspect) / (M_PER_DEG * math.cos(math.radians(lat))) / 2
        vals = (
            max(lon - half_w, -180.0),
            max(lat - half_h, -90.0),
            min(lon + half_w, 180.0),
            min(lat + half_h, 90.0),
        )
        box = LonLatBox.of([round(v, 6) for v in vals])
        radius = float(10 ** rng.uniform(*np.log10(RADIUS_RANGE_M)))
        category = None if i % 2 == 0 else cats[int(rng.integers(len(cats)))]
        out.append(SearchCase(box, int(rng.integers(1, config.n_max + 1)), round(radius, 1), category))
    return out


def exact_answer(
    pois: PoiSet, lat: float, lon: float, case: SearchCase, kind: str, cat_rows: dict[str | None, np.ndarray]
) -> set[int]:
    """Brute-force answer at one point (contract §5: range within r; kNN the n nearest, ties included)."""
    idx = cat_rows[case.category]
    d = haversine_m_array(lat, lon, pois.lat[idx], pois.lon[idx])
    if kind == "range":
        return set(idx[d <= case.radius_m].tolist())
    if len(idx) <= case.n:
        return set(idx.tolist())
    return set(idx[d <= np.partition(d, case.n - 1)[case.n - 1]].tolist())


def run_lbs_bench(
    pois: PoiSet, config: LbsBenchConfig, on_request: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """One row per kind (``knn``, ``range``) and category mode (``any``, ``one``)."""
    cases = search_stream(pois, config)
    engine = LbsEngine(pois)
    cat_rows: dict[str | None, np.ndarray] = {None: np.arange(len(pois), dtype=np.int64)}
    for c, _count in engine.categories():
        cat_rows[c] = np.array([i for i, p in enumerate(pois.pois) if p.category == c], np.int64)
    for case in cases[:WARMUP_REQUESTS]:
        engine.knn_candidates(case.box, case.n, case.category)
        engine.range_candidates(case.box, case.radius_m, case.category)
    rng = np.random.default_rng(config.seed + 1)
    stats: dict[tuple[str, str], dict[str, list[float]]] = {}
    try:
        for case in cases:
            lat = float(rng.uniform(case.box.min_lat, case.box.max_lat))
            lon = float(rng.uniform(case.box.min_lon, case.box.max_lon))
            for kind in ("knn", "range"):
                w0, c0 = time.perf_counter(), time.thread_time()
                if kind == "knn":
                    rows = engine.knn_candidates(case.box, case.n, case.category)
                else:
                    rows = engine.range_candidates(case.box, case.radius_m, case.category)
                wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                exact = exact_answer(pois, lat, lon, case, kind, cat_rows)
                s = stats.setdefault((kind, "any" if case.category is None else "one"), _empty())
                s["wall"].append(wall)
                s["cpu"].append(cpu)
                s["cand"].append(len(rows))
                s["exact"].append(len(exact))
                if exact:
                    s["ratio"].append(len(rows) / len(exact))
                s["violations"].append(float(not exact <= set(rows.tolist())))
            if on_request is not None:
                on_request()
    finally:
        engine.close()
    return [_row(kind, mode, stats[kind, mode], len(pois)) for kind, mode in sorted(stats)]


def _empty() -> dict[str, list[float]]:
    return {"wall": [], "cpu": [], "cand": [], "exact": [], "ratio": [], "violations": []}


def _row(kind: str, mode: str, s: dict[str, list[float]], n_pois: int) -> dict[str, Any]:
    def us(values: list[float], q: float) -> float:
        return round(float(np.percentile(values, q)) * 1e6, 1)

    return {
        "kind": kind,
        "category": mode,
        "requests": len(s["wall"]),
        "pois": n_pois,
        "us_p50": us(s["wall"], 50),
        "us_p99": us(s["wall"], 99),
        "cpu_us_p50": us(s["cpu"], 50),
        "cpu_us_p99": us(s["cpu"], 99),
        "candidates_mean": round(float(np.mean(s["cand"])), 3),
        "exact_mean": round(float(np.mean(s["exact"])), 3),
        "candidates_over_exact": round(float(np.mean(s["ratio"])), 3) if s["ratio"] else None,
        "violations": int(sum(s["violations"])),
    }


# ---------------------------------------------------------------------------------------------
# CLI.
