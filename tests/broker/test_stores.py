"""Durable stores: schema and pragmas of the contract, group commit, lock, crash safety."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kcloak.broker.stores import DataDir, MovementStore, ProfileStore, QueryLog, StoreError, WriteHealth
from kcloak.core.profile import PrivacyProfile


def test_data_dir_is_private_and_locked(tmp_path: Path) -> None:
    d = tmp_path / "data"
    with DataDir(d):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        with pytest.raises(StoreError, match="locked"), DataDir(d):
            pass
    with DataDir(d):  # released on exit
        pass


def test_profile_store_round_trip_and_schema(tmp_path: Path) -> None:
    path = tmp_path / "profiles.sqlite3"
    store = ProfileStore(path)
    p = PrivacyProfile(k=10, l=2, min_area_m2=5.0, max_area_m2=2e6, max_delay_s=10.0)
    store.put("alice", p, 123.5)
    store.put("bob", PrivacyProfile(), 1.0)
    store.delete("bob")
    store.close()
    again = ProfileStore(path)
    got = again.get("alice")
    assert got is not None and got.profile == p and got.updated_t == 123.5
    assert again.get("bob") is None
    assert [u for u, _ in again.all()] == ["alice"]
    again.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cols = [r[1] for r in conn.execute("PRAGMA table_info(profiles)")]
    assert cols == ["user_id", "k", "l", "min_area_m2", "max_area_m2", "max_delay_s", "updated_t"]


async def test_group_commit_writes_everything_once(tmp_path: Path) -> None:
    store = MovementStore(tmp_path / "movement.sqlite3", capacity=100_000)
    await asyncio.gather(*(store.append([(f"u{i}", float(t), 39.9, 116.4) for t in range(50)]) for i in range(40)))
    await store.append([("u0", 0.0, 1.0, 1.0)])  # duplicate (user, t) is ignored, not an error
    rows = store.fixes_between(0, 1000)
    assert len(rows) == 40 * 50
    assert store.writer.depth == 0
    latest = dict((u, t) for u, t, _, _ in store.latest_per_user(0))
    assert latest["u7"] == 49.0
    store.close()


async def test_retention_runs_in_chunks_between_concurrent_writes(tmp_path: Path) -> None:
    """Deletes go through the writer thread, interleaved with inserts: none waits on a lock."""
    store = MovementStore(tmp_path / "movement.sqlite3", capacity=1_000_000)
    await store.append([(f"u{i}", float(t), 39.9, 116.4) for i in range(20) for t in range(100)])
    writes = [store.append([(f"w{i}", 1000.0 + t, 39.9, 116.4) for t in range(200)]) for i in range(30)]
    deleted, *_ = await asyncio.gather(store.delete_older_than(60.0, keep_from=50.0, chunk=7), *writes)
    assert deleted == 20 * 50  # t < min(60, keep_from 50)
    assert len(store.fixes_between(0, 50)) == 0
    assert len(store.fixes_between(50, 100)) == 20 * 50
    assert len(store.fixes_between(1000, 2000)) == 30 * 200
    store.close()


def test_reservation_is_bounded(tmp_path: Path) -> None:
    store = MovementStore(tmp_path / "m.sqlite3", capacity=10)
    assert store.writer.try_reserve(8)
    assert not store.writer.try_reserve(3)
    store.close()


async def test_querylog_schema(tmp_path: Path) -> None:
    log = QueryLog(tmp_path / "querylog.sqlite3")
    row = (1.0, "knn", None, 5, "cafe", 116.0, 39.0, 116.1, 39.1, None, None, 1e6, 12, "hilbert", "ok")
    await log.record(row)
    log.close()
    conn = sqlite3.connect(tmp_path / "querylog.sqlite3")
    assert conn.execute("SELECT * FROM forwarded").fetchall() == [row]
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("INSERT INTO forwarded VALUES (1,'knn',NULL,5,NULL,0,0,1,1,NULL,NULL,1,5,'nn','lost')")


def test_acknowledged_fixes_survive_kill_9(tmp_path: Path) -> None:
    """A child acknowledges each committed batch on stdout; after SIGKILL every acked fix is on disk."""
    db = tmp_path / "movement.sqlite3"
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from kcloak.broker.stores import MovementStore
        async def main():
            store = MovementStore(Path({str(db)!r}))
            for b in range(10_000):
                await store.append([(f"u{{b}}", float(b), 1.0, 2.0)])
                print(b, flush=True)
        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-I", "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = -1
    for line in proc.stdout:
        acked = int(line)
        if acked >= 200:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    conn = sqlite3.connect(db)
    users = {r[0] for r in conn.execute("SELECT user_id FROM fixes")}
    assert {f"u{b}" for b in range(acked + 1)} <= users


async def test_housekeeping_survives_a_failed_retention(http_broker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store error during retention is logged and retried next period; the broker keeps running."""
    pipeline = http_broker.pipeline
    calls = 0

    async def failing(*_: object, **__: object) -> int:
        nonlocal calls
        calls += 1
        raise StoreError("disk full")

    monkeypatch.setattr(pipeline.movement, "delete_older_than", failing)
    task = asyncio.create_task(pipeline.run_housekeeping(period_s=0.02))
    try:
        for _ in range(200):
            if calls >= 3:
                break
            await asyncio.sleep(0.01)
        assert calls >= 3 and not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_lock_holds_after_kcloak_lock_is_deleted(tmp_path: Path) -> None:
    """Deleting kcloak.lock let a second broker lock a new file and run on the same data."""
    d = tmp_path / "data"
    with DataDir(d):
        (d / "kcloak.lock").unlink()
        with pytest.raises(StoreError, match="locked"), DataDir(d):
            pass
    with DataDir(d):  # the lock is released on exit, file or no file
        assert (d / "kcloak.lock").exists()


def _fill_to_page_limit(conn: sqlite3.Connection) -> None:
    """A real SQLITE_FULL: the database may not grow by a single page any more."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")


def test_profile_store_full_disk_raises_store_error_and_recovers(tmp_path: Path) -> None:
    outcomes: list[tuple[str, bool]] = []
    health = WriteHealth("profiles", lambda store, ok: outcomes.append((store, ok)))
    store = ProfileStore(tmp_path / "profiles.sqlite3", health=health)
    _fill_to_page_limit(store._conn)
    with pytest.raises(StoreError, match="write failed") as err:
        for i in range(10_000):  # the last page fills up after a few dozen rows
            store.put(f"u{i}", PrivacyProfile(), 1.0)
    assert isinstance(err.value.__cause__, sqlite3.OperationalError)
    assert not health.healthy and health.failures == 1 and outcomes == [("profiles", False)]
    store._conn.execute("PRAGMA max_page_count = 1000000")
    store.put("again", PrivacyProfile(k=9), 2.0)
    assert health.healthy and outcomes[-1] == ("profiles", True)
    got = store.get("again")
    assert got is not None and got.profile.k == 9
    store.close()


async def test_group_commit_full_disk_fails_the_write_and_recovers(tmp_path: Path) -> None:
    store = MovementStore(tmp_path / "movement.sqlite3", capacity=1_000_000)
    try:
        _fill_to_page_limit(store._conn)
        with pytest.raises(StoreError):
            await asyncio.wait_for(store.append([(f"u{i}", 1.0, 39.9, 116.4) for i in range(5000)]), 10)
        assert not store.health.healthy and store.health.failures >= 1
        await asyncio.wait_for(store.writer.barrier(), 10)  # an empty commit says nothing
        assert not store.health.healthy
        store._conn.execute("PRAGMA max_page_count = 1000000")
        await asyncio.wait_for(store.append([("u0", 2.0, 39.9, 116.4)]), 10)
        assert store.health.healthy and store.writer.depth == 0
        assert len(store.fixes_between(0, 10)) == 1
    finally:
        store.close()


async def test_a_bad_row_fails_only_its_own_write(tmp_path: Path) -> None:
    """A row SQLite cannot bind used to raise outside sqlite3.Error in the writer thread: the
    thread died and every later write waited forever."""
    store = MovementStore(tmp_path / "movement.sqlite3", capacity=100_000)
    try:
        bad = store.append([("\ud800", 1.0, 39.9, 116.4)])  # a lone surrogate cannot be encoded
        good = [store.append([(f"u{i}", 1.0, 39.9, 116.4)]) for i in range(20)]
        results = await asyncio.wait_for(asyncio.gather(bad, *good, return_exceptions=True), 10)
        assert isinstance(results[0], StoreError)
        assert all(r is None for r in results[1:])
        assert store.health.healthy  # bad data says nothing about the disk
        await asyncio.wait_for(store.append([("later", 1.0, 39.9, 116.4)]), 10)
        assert len(store.fixes_between(0, 10)) == 21
    finally:
        store.close()


@pytest.mark.parametrize("sizes", [[1], [3, 129, 1000], [257, 2, 64], [4095, 9000, 1]])
async def test_writes_of_any_size_store_every_row_once_first_duplicate_kept(tmp_path: Path, sizes: list[int]) -> None:
    """Rows go in as multi-row statements of whatever sizes fit: every row of every write is there,
    read back with a plain connection, and a repeated (user, t) keeps its first row (INSERT OR IGNORE)."""
    store = MovementStore(tmp_path / "movement.sqlite3")
    expected: dict[tuple[str, float], tuple[float, float]] = {}
    writes = []
    for w, n in enumerate(sizes):
        rows = [(f"u{i % 97}", 1000.0 * w + i, 10.0 + i / 1e4, 20.0 - w) for i in range(n)]
        rows.append((rows[0][0], rows[0][1], -1.0, -1.0))  # the same key again, other values: ignored
        for user, t, lat, lon in rows:
            expected.setdefault((user, t), (lat, lon))
        writes.append(store.append(rows))
    await asyncio.gather(*writes)  # one loop turn: handed to the writer together
    store.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "movement.sqlite3")) as conn:
        got = {(u, t): (la, lo) for u, t, la, lo in conn.execute("SELECT user_id, t, lat, lon FROM fixes")}
    assert got == expected


async def test_a_statement_queued_after_writes_of_the_same_turn_runs_after_them(tmp_path: Path) -> None:
    store = MovementStore(tmp_path / "movement.sqlite3")
    write = asyncio.ensure_future(store.append([("a", 1.0, 0.0, 0.0), ("b", 2.0, 0.0, 0.0)]))
    await asyncio.sleep(0)  # the write is queued in this turn
    deleted = await store.delete_older_than(10.0)
    await write
    assert deleted == 2
    store.close()


def test_a_write_ahead_log_grown_under_a_long_read_is_cut_back(tmp_path: Path) -> None:
    """A reader that holds back checkpoints lets the log grow past the limit; once it is gone, the log restarts
    and its file is cut back to the limit (without one, SQLite keeps the file at its largest size)."""
    from kcloak.broker.stores import WAL_SIZE_LIMIT_BYTES, open_db
    from kcloak.core.schemas import MOVEMENT_FILE

    limit = 256 * 1024
    sizes: dict[str, int] = {}
    for label, wal_limit in (("limited", limit), ("unlimited", -1)):
        path = tmp_path / f"{label}.sqlite3"
        writer = open_db(path, MOVEMENT_FILE, wal_limit_bytes=wal_limit)
        reader = sqlite3.connect(path, isolation_level=None)
        writer.execute("CREATE TABLE blob_rows (b BLOB)")
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM blob_rows").fetchone()  # a read snapshot: no checkpoint past it
        for _ in range(40):
            writer.execute("INSERT INTO blob_rows VALUES (randomblob(65536))")
        grown = Path(f"{path}-wal").stat().st_size
        assert grown > 8 * limit
        reader.execute("COMMIT")
        reader.close()
        writer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        writer.execute("INSERT INTO blob_rows VALUES (randomblob(16))")  # the log restarts from its beginning
        sizes[label] = Path(f"{path}-wal").stat().st_size
        writer.close()
    assert sizes["limited"] <= limit
    assert sizes["unlimited"] > 8 * limit  # the control: SQLite alone keeps the grown file
    default = open_db(tmp_path / "default.sqlite3", MOVEMENT_FILE)  # what the stores open
    assert default.execute("PRAGMA journal_size_limit").fetchone()[0] == WAL_SIZE_LIMIT_BYTES
    default.close()
