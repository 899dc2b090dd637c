"""A publication window read from the movement store as columns, in chunks: the same fixes, in the
same order, as the row read, and without a list of row tuples as large as the window."""

from __future__ import annotations

import sqlite3
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

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


def test_a_window_file_reads_back_as_the_general_reader_reads_it(tmp_path: Path) -> None:
    from kcloak.broker.publication import read_window_csv
    from kcloak.core.readers import FixTable, read_contract_csv, write_contract_csv

    rng = np.random.default_rng(5)
    n = 45_000  # three chunks of the reader, two of the writer
    ids = np.array([f"t{i % 300}{'-x' * (i % 3)}" for i in range(n)])
    t = (1.7e9 + np.arange(n) // 300 + np.where(np.arange(n) % 7 == 0, 0.25, 0.0)).astype(np.float64)  # integral or not
    table = FixTable(ids, t, 39.9 + rng.random(n) / 100, 116.4 + rng.random(n) / 100)
    path = tmp_path / "w.csv"
    write_contract_csv(path, table)
    mine, general = read_window_csv(path), read_contract_csv(path)
    for got in (mine, general):
        assert got.traj_id.tolist() == ids.tolist()
        assert got.t.tolist() == t.tolist() and got.lat.tolist() == table.lat.tolist()
        assert got.lon.tolist() == table.lon.tolist()
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError):
        read_window_csv(tmp_path / "other.csv")
    none = np.empty(0, dtype=np.float64)
    write_contract_csv(tmp_path / "empty.csv", FixTable(np.empty(0, dtype=str), none, none, none))
    assert len(read_window_csv(tmp_path / "empty.csv")) == 0
