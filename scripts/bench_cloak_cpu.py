"""The cloaking-core throughput figures in CPU time (docs/views.md "Batch path in slices").

The same population and request stream as ``kcloak bench cloak --users N --k 10 --requests 20000``
(``clustered_population``, ``make_workload``), single calls timed as the bench times them (a
``perf_counter_ns`` pair around each call, after a first call that prepares the view), the batch
as the bench times it (the first full batch after a 1,000-request warm-up; best of 5 more beside
it), and the plain-Python yardstick of the targets check, all in this thread's CPU time: on a
shared host, other processes then change the figures much less than the wall-clock ratios.

Usage: ``.venv/bin/python scripts/bench_cloak_cpu.py [--users 100000] [--seed 1]
[--algorithms interval,casper,hilbert]``. Prints one JSON line; not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kcloak.cloaking.bench import _head, build_index, clustered_population, make_workload
from kcloak.cloaking.cloakers import cloaker_class
from kcloak.core.memory import fix_mmap_threshold

cpu_ns = time.thread_time_ns


def yardstick(n: int = 200_000) -> float:
    """Plain-Python grid lookups per CPU second (the targets check's yardstick)."""
    rnd = random.Random(1)
    xs = [rnd.randrange(1 << 20) for _ in range(n)]
    ys = [rnd.randrange(1 << 20) for _ in range(n)]
    counts = {(x >> 12, y >> 12): 1 for x, y in zip(xs, ys, strict=True)}
    t = cpu_ns()
    for x, y in zip(xs, ys, strict=True):
        for s in (12, 13, 14):
            c = counts.get((x >> s, y >> s))
            if c is not None and c >= 10:
                break
    return n / ((cpu_ns() - t) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--algorithms", default="interval,casper,hilbert")
    a = ap.parse_args()
    fix_mmap_threshold()  # as `kcloak bench cloak` and `kcloak serve` do
    pop = clustered_population(a.users, seed=a.seed)
    work = make_workload(len(pop), k=10, requests=a.requests, max_area_m2=4.0e6, seed=a.seed)
    index = build_index(pop, work)
    y = max(yardstick() for _ in range(3))
    out: dict[str, object] = {"users": a.users, "requests": a.requests, "seed": a.seed, "yardstick_per_cpu_s": y}
    pc = time.perf_counter_ns
    for epoch, name in enumerate(a.algorithms.split(","), start=1):
        cloaker = cloaker_class(name)()
        view = index.snapshot(pop.now, epoch=epoch, seed=a.seed)
        rows = work.rows.tolist()
        profiles = work.profile_list()
        cloak = cloaker.cloak
        t = cpu_ns()
        cloak(view, rows[0], profiles[0])
        prepare_ms = (cpu_ns() - t) / 1e6
        t = cpu_ns()
        for r, p in zip(rows, profiles, strict=True):
            t0 = pc()
            cloak(view, r, p)
            _ = pc() - t0
        single_ms = (cpu_ns() - t) / 1e6
        arrays = work.profile_arrays()
        cloaker.cloak_batch(view, work.rows[:1000], _head(arrays, 1000))
        batch_ms = []
        for _ in range(6):
            t = cpu_ns()
            cloaker.cloak_batch(view, work.rows, arrays)
            batch_ms.append((cpu_ns() - t) / 1e6)
        m = len(rows)
        out[name] = {
            "prepare_cpu_ms": round(prepare_ms, 1),
            "single_cpu_ms": round(single_ms, 1),
            "single_ratio": round(m / single_ms * 1e3 / y, 3),
            "batch_cpu_ms": round(batch_ms[0], 2),
            "batch_best_cpu_ms": round(min(batch_ms[1:]), 2),
            "batch_ratio": round(m / batch_ms[0] * 1e3 / y, 2),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
