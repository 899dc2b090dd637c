"""Mondrian throughput (CONCEPTS §8.9: O(n log n)); 20k rows by default, 1,000,000 rows marked slow (≤ 60 s)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kcloak.cloaking.tabular import QuasiIdentifier, anonymize_table

QIS = (
    QuasiIdentifier("start_t", "time", ("start_t",)),
    QuasiIdentifier("duration_s", "numeric", ("duration_s",)),
    QuasiIdentifier("origin", "latlon", ("origin_lat", "origin_lon")),
    QuasiIdentifier("dest", "latlon", ("dest_lat", "dest_lon")),
)


def _trips(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    start = (1714550400 + rng.integers(0, 30 * 86400, n)).tolist()
    dur = rng.integers(60, 7200, n).tolist()
    olat = np.round(39.8 + rng.random(n) * 0.3, 5).tolist()
    olon = np.round(116.2 + rng.random(n) * 0.4, 5).tolist()
    dlat = np.round(39.8 + rng.random(n) * 0.3, 5).tolist()
    dlon = np.round(116.2 + rng.random(n) * 0.4, 5).tolist()
    modes = np.asarray(["walk", "bike", "vehicle"])[rng.integers(0, 3, n)].tolist()
    return [
        {
            "origin_lat": olat[i],
            "origin_lon": olon[i],
            "dest_lat": dlat[i],
            "dest_lon": dlon[i],
            "start_t": start[i],
            "duration_s": dur[i],
            "mode": modes[i],
        }
        for i in range(n)
    ]


def _run(n: int, k: int, l: int | None) -> tuple[float, float]:  # noqa: E741
    """Wall and CPU seconds of one release (CPU time is what the budget bounds on a shared machine)."""
    rows = _trips(n)
    t0, c0 = time.perf_counter(), time.process_time()
    rel = anonymize_table(rows, quasi_identifiers=QIS, sensitive="mode", algorithm="mondrian", k=k, l=l, seed=1)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert len(rel.rows) == n and rel.k_achieved >= k
    assert l is None or (rel.l_achieved is not None and rel.l_achieved >= l)
    assert rel.classes >= n // (4 * 2 * k)  # median cuts keep classes small (≤ 2d(k−1) + o rows each)
    return wall, cpu


def test_mondrian_20k_rows() -> None:
    _, cpu = _run(20_000, 5, 2)
    assert cpu < 30.0


@pytest.mark.slow
def test_mondrian_1m_rows_under_60s() -> None:
    wall, cpu = _run(1_000_000, 5, None)
    print(f"mondrian 1,000,000 rows, 4 QIs (6 axes), k=5: wall {wall:.1f} s, cpu {cpu:.1f} s")
    assert cpu <= 60.0
