"""Cost of the Hilbert cell map (docs/cluster.md "Cells"): ``cell_of`` per million positions and
HilbertCloak throughput with and without a cell map, in one run on one population.

Usage: ``.venv/bin/python scripts/bench_cells.py [--users 1000000] [--requests 100000] [--seed 1]``.
Prints plain text; not a test (timings depend on the machine).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kcloak.cloaking.bench import clustered_population, make_workload, user_ids
from kcloak.cloaking.cells import CellMap
from kcloak.cloaking.cloakers.hilbert import HilbertCloak
from kcloak.cloaking.index import IndexView
from kcloak.core.profile import ProfileArrays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--single", type=int, default=20_000, help="requests cloaked one call at a time")
    ap.add_argument("--cells", type=int, nargs="*", default=[16, 256])
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    pop = clustered_population(a.users, seed=a.seed)
    work = make_workload(a.users, k=10, requests=a.requests, max_area_m2=4e6, seed=a.seed)
    ids = user_ids(a.users)
    pick = np.random.default_rng([a.seed, 9]).choice(a.users, size=max(a.users // 10, 1), replace=False)
    sample_lat, sample_lon = pop.lat[pick], pop.lon[pick]  # a 10 % census sample balances the cells

    for c in a.cells:
        cm = CellMap.balanced(sample_lat, sample_lon, cells=c)
        best = min(_timed(lambda cm=cm: cm.cell_of(pop.lat, pop.lon)) for _ in range(3))
        counts = np.bincount(cm.cell_of(pop.lat, pop.lon), minlength=c)
        print(
            f"cell_of C={c}: {best / a.users * 1e6 * 1e3:.1f} ms per million positions;"
            f" busiest cell / mean = {counts.max() / counts.mean():.2f}"
        )

    profiles = ProfileArrays.from_profiles([work.profiles[int(k)] for k in work.stored_k[work.rows].tolist()])
    for c in [0, *a.cells]:
        cmap = CellMap.balanced(sample_lat, sample_lon, cells=c) if c else None
        view = IndexView.from_points(
            ids, pop.lat, pop.lon, k=work.stored_k, min_area_m2=np.zeros(a.users), max_area_m2=np.full(a.users, 4e6)
        )
        cloaker = HilbertCloak(cells=cmap)
        t0 = time.perf_counter()
        out = cloaker.cloak_batch(view, work.rows, profiles)  # first batch builds every cell's buckets
        first = time.perf_counter() - t0
        again = min(_timed(lambda c=cloaker, v=view: c.cloak_batch(v, work.rows, profiles)) for _ in range(3))
        rows = work.rows[: a.single].tolist()
        one = [profiles[i] for i in range(len(rows))]
        t0 = time.perf_counter()
        for i, r in enumerate(rows):
            cloaker.cloak(view, r, one[i])
        single = time.perf_counter() - t0
        ok = out.ok
        label = "no cell map" if cmap is None else f"C={c}"
        print(
            f"hilbert {label}: first batch (incl. per-view build) {first:.2f} s;"
            f" batch {a.requests / again:,.0f} req/s; single calls {len(rows) / single:,.0f} req/s;"
            f" success {ok.mean():.4f}; mean k_achieved {out.k_achieved[ok].mean():.2f};"
            f" median area {np.median(out.area_m2[ok]):,.0f} m²"
        )


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
