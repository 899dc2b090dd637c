"""The window ledger's reads leave no page cache behind in the broker: counting a large window's
fixes (once per window) must not keep megabytes of SQLite pages for the rest of the run."""

from __future__ import annotations

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
        # 400,000 fixes of 2,000 users over 200 s, written as the broker's writer would have.
        with sqlite3.connect(path) as fill:
            fill.executemany(
                "INSERT INTO fixes VALUES (?, ?, ?, ?)",
                ((f"user-{i % 2000:04d}", 1_000.0 + i / 2000, 39.9, 116.4) for i in range(400_000)),
            )
        fill.close()
        ledger = WindowLedger(path, store.writer)
        try:
            before = lib.sqlite3_memory_used()
            if before <= 0:
                pytest.skip("sqlite3_memory_used does not count this process's connections")
            assert ledger.count_fixes(1_000.0, 1_200.0) == 400_000
            assert ledger.first_fix_at_or_after(1_100.0) == 1_100.0
            kept = lib.sqlite3_memory_used() - before
        finally:
            ledger.close()
    finally:
        store.close()
    # SQLite's default cache (2 MiB a connection) kept about 2 MiB here.
    assert kept < 512 * 1024, kept
