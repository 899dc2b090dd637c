"""What SQLite keeps in the broker's memory stays small and is there from the start: counting a
large window's fixes (once per window) keeps no megabytes of pages for the rest of the run, and the
first large batch of fixes (the writer fell behind) compiles no megabytes of insert statements."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import sqlite3
from pathlib import Path

import pytest

from kcloak.broker.publication import WindowLedger
from kcloak.broker.stores import MovementStore


def _sqlite_library() -> ctypes.CDLL:
    """The SQLite library Python's ``sqlite3`` module runs on, to read its own heap counter."""
    name = ctypes.util.find_library("sqlite3")
    if name is None:
        pytest.skip("no shared SQLite library to read sqlite3_memory_used from")
    lib = ctypes.CDLL(name)
    lib.sqlite3_libversion.restype = ctypes.c_char_p
    lib.sqlite3_memory_used.restype = ctypes.c_int64
    if lib.sqlite3_libversion().decode() != sqlite3.sqlite_version:
        pytest.skip("Python's sqlite3 is not linked to the shared SQLite library")
    return lib


def test_counting_a_large_window_keeps_no_page_cache(tmp_path: Path) -> None:
    lib = _sqlite_library()
    path = tmp_path / "movement.sqlite3"
    store = MovementStore(path)
    try:
        # 250,000 fixes of 2,000 users over 125 s, written as the broker's writer would have.
        with sqlite3.connect(path) as fill:
            fill.executemany(
                "INSERT INTO fixes VALUES (?, ?, ?, ?)",
                ((f"user-{i % 2000:04d}", 1_000.0 + i / 2000, 39.9, 116.4) for i in range(250_000)),
            )
        fill.close()
        ledger = WindowLedger(path, store.writer)
        try:
            before = lib.sqlite3_memory_used()
            if before <= 0:
                pytest.skip("sqlite3_memory_used does not count this process's connections")
            assert ledger.count_fixes(1_000.0, 1_200.0) == 250_000
            assert ledger.first_fix_at_or_after(1_100.0) == 1_100.0
            kept = lib.sqlite3_memory_used() - before
        finally:
            ledger.close()
    finally:
        store.close()
    # SQLite's default cache (2 MiB a connection) kept about 2 MiB here.
    assert kept < 512 * 1024, kept


def test_the_first_large_batch_of_fixes_compiles_no_megabytes_of_statements(tmp_path: Path) -> None:
    lib = _sqlite_library()

    async def run() -> int:
        store = MovementStore(tmp_path / "movement.sqlite3")
        try:
            # Small batches (a loop turn's fixes) until the connection's page cache (2 MiB) is full...
            for s in range(300):
                await store.append([(f"user-{u:04d}", 1_000.0 + s, 39.9, 116.4) for u in range(200)])
            before = lib.sqlite3_memory_used()
            # ...then one of 16,383 rows, as the writer sees after falling behind for seconds: it is
            # inserted with statements of every size the writer uses.
            await store.append([(f"user-{i % 2000:04d}", 2_000.0 + i / 2000, 39.9, 116.4) for i in range(16_383)])
            return int(lib.sqlite3_memory_used() - before)
        finally:
            await asyncio.to_thread(store.close)

    kept = asyncio.run(run())
    # Statements of up to 4,096 rows kept 3.6 MiB.
    assert kept < 1536 * 1024, kept
