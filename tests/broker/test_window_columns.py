"""A publication window read from the movement store as columns, in chunks: the same fixes, in the
same order, as the row read, and without a list of row tuples as large as the window."""

from __future__ import annotations

import sqlite3
import tracemalloc
from pathlib import Path

import numpy as np

from kcloak.broker.stores import MovementStore


async def test_columns_are_the_rows_of_the_window_in_order(tmp_path: Path) -> None:
    store = MovementStore(tmp_path / "movement.sqlite3", capacity=100_000)
    rng = np.random.default_rng(3)
    fixes = [
        (f"user-{u:03d}{'x' * (u % 5)}", float(t), *rng.normal((39.9, 116.4), 0.01))
        for u in range(40)
        for t in range(50)
    ]
    await store.append([(u, t, float(la), float(lo)) for u, t, la, lo in fixes])
    store.close()
    store = MovementStore(tmp_path / "movement.sqlite3", capacity=100_000)
    for t0, t1 in ((0.0, 50.0), (10.0, 20.0), (49.5, 60.0), (100.0, 200.0)):
        cols = store.fix_columns_between(t0, t1, chunk=7)  # many chunks, with ids of several widths
        # Read the file independently, as any SQLite client would.
        with sqlite3.connect(tmp_path / "movement.sqlite3") as db:
            rows = db.execute(
                "SELECT user_id, t, lat, lon FROM fixes WHERE t >= ? AND t < ? ORDER BY user_id, t", (t0, t1)
            ).fetchall()
        assert len(cols) == len(rows)
        assert cols.traj_id.tolist() == [r[0] for r in rows]
        assert cols.t.tolist() == [r[1] for r in rows]
        assert cols.lat.tolist() == [r[2] for r in rows] and cols.lon.tolist() == [r[3] for r in rows]
        assert cols.t.dtype == np.float64 and cols.traj_id.dtype.kind == "U"
    store.close()


async def test_a_large_window_is_read_without_a_row_list_of_its_size(tmp_path: Path) -> None:
    store = MovementStore(tmp_path / "movement.sqlite3", capacity=1_000_000)
    n = 200_000
    await store.append([(f"s{i % 2000:06d}", float(i // 2000), 39.9, 116.4) for i in range(n)])
    tracemalloc.start()
    try:
        cols = store.fix_columns_between(0.0, 1e9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    store.close()
    assert len(cols) == n
    # The columns take 7 × 4 + 3 × 8 = 52 bytes a fix, plus one chunk of row tuples;
    # a list of all the rows took about 190 a fix.
    assert peak / n < 100, peak / n
