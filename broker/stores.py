"""Durable stores in the data directory (contract §11): profiles, movement, query log.

SQLite files in WAL mode, readable by other processes while the broker runs; their schemas
(tables, columns, version) are defined once in :mod:`kcloak.core.schemas`. Writes to the
movement store and the query log go through one writer thread per database that
**group-commits**: callers enqueue rows and await a future that resolves only after the
transaction holding them has committed, so an accepted fix survives ``kill -9``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from kcloak.broker.errors import BrokerError
from kcloak.core.profile import PrivacyProfile
from kcloak.core.readers import FixTable
from kcloak.core.schemas import (
    FIXES,
    FORWARDED,
    MOVEMENT_FILE,
    PROFILES,
    PROFILES_FILE,
    QUERYLOG_FILE,
    SchemaVersionError,
    SqliteFile,
)


class StoreError(BrokerError, RuntimeError):
    """A store that cannot be opened or written (data directory locked, disk error, …)."""


def storage_failure(exc: BaseException) -> bool:
    """True if ``exc`` says the database cannot be written (disk full, I/O error, read-only,
    locked, corrupt), as opposed to a bad row, which fails one write and says nothing about the
    store."""
    return isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError


class WriteHealth:
    """Whether a store can write: failing after a write fails for a storage reason, healthy again
    once a write commits. ``listener(store, ok)`` hears every failure and every recovery
    (metrics); ``/healthz`` reads :attr:`healthy`. Written from writer threads: plain values."""

    __slots__ = ("_listener", "failures", "healthy", "store")

    def __init__(self, store: str, listener: Callable[[str, bool], None] | None = None) -> None:
        self.store = store
        self.healthy = True
        self.failures = 0
        self._listener = listener

    def record(self, ok: bool) -> None:
        if ok and self.healthy:
            return  # the usual case, on every commit: nothing changes
        if not ok:
            self.failures += 1
        self.healthy = ok
        if self._listener is not None:
            self._listener(self.store, ok)


WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024
"""What a write-ahead log file is cut back to once it restarts from its beginning (``journal_size_limit``).

A long read (a publication window's fixes, a ``kcloak release`` of a running broker's data directory) holds
back checkpoints, so the log grows meanwhile (398 MiB in a soak); SQLite keeps the file at its largest size
afterwards unless a limit is set."""


def open_db(path: Path, schema: SqliteFile, *, wal_limit_bytes: int = WAL_SIZE_LIMIT_BYTES) -> sqlite3.Connection:
    """Open (creating if needed) a WAL-mode SQLite database of ``schema``, marked with its version, whose
    write-ahead log is cut back to ``wal_limit_bytes`` whenever it restarts.

    A file of another schema version is refused (:class:`StoreError`) before anything is written."""
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA journal_size_limit={int(wal_limit_bytes)}")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        version = schema.check_version(conn)
        conn.executescript(schema.create_script())
        conn.execute(f"PRAGMA user_version={version}")
    except SchemaVersionError as exc:
        conn.close()
        raise StoreError(str(exc)) from None
    except BaseException:
        conn.close()
        raise
    return conn


class DataDir:
    """The data directory: created with mode 0700 and locked for one ``kcloak serve`` (§11).

    The lock that counts is a ``flock`` on the directory itself, which cannot be deleted or
    replaced under a running broker (``kcloak.lock`` can: a second broker would then create a
    new file, lock it and run beside the first). ``kcloak.lock`` is still created and locked,
    as the contract names it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock_fds: list[int] = []

    def __enter__(self) -> DataDir:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)
            self._lock(os.open(self.path, os.O_RDONLY | os.O_DIRECTORY))
            self._lock(os.open(self.path / "kcloak.lock", os.O_RDWR | os.O_CREAT, 0o600))
        except StoreError:
            self._release()
            raise
        except OSError as exc:
            self._release()
            raise StoreError(f"data directory: cannot create or open {self.path}") from exc
        return self

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(f"data directory {self.path} is locked by another kcloak serve") from None
        self._lock_fds.append(fd)

    def _release(self) -> None:
        while self._lock_fds:
            fd = self._lock_fds.pop()
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __exit__(self, *exc: object) -> None:
        self._release()

    def file(self, name: str) -> Path:
        return self.path / name


@dataclass(frozen=True, slots=True)
class StoredProfile:
    profile: PrivacyProfile
    updated_t: float


_PROFILE_PUT = PROFILES.insert_sql(conflict="REPLACE")
_PROFILE_BY_USER = PROFILES.select_sql(where="user_id = ?")


def _stored_profile(row: Sequence[Any]) -> tuple[str, StoredProfile]:
    """A ``profiles`` row (every column, in :data:`PROFILES` order) as ``(user_id, StoredProfile)``."""
    user, k, l_div, min_area, max_area, max_delay, updated_t = row
    return user, StoredProfile(PrivacyProfile(int(k), int(l_div), min_area, max_area, max_delay), updated_t)


class ProfileStore:
    """``profiles.sqlite3``: at most one stored profile per user. Small synchronous writes; a
    write that fails raises :class:`StoreError` and is reported to ``health``."""

    def __init__(self, path: Path, *, health: WriteHealth | None = None) -> None:
        self._conn = open_db(path, PROFILES_FILE)
        self._lock = threading.Lock()
        self.health = health if health is not None else WriteHealth("profiles")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def get(self, user: str) -> StoredProfile | None:
        with self._lock:
            row = self._conn.execute(_PROFILE_BY_USER, (user,)).fetchone()
        return None if row is None else _stored_profile(row)[1]

    def put(self, user: str, profile: PrivacyProfile, t: float) -> None:
        self._write(
            _PROFILE_PUT,
            (user, profile.k, profile.l, profile.min_area_m2, profile.max_area_m2, profile.max_delay_s, t),
        )

    def delete(self, user: str) -> None:
        self._write(f"DELETE FROM {PROFILES.name} WHERE user_id = ?", (user,))

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self._conn.execute(sql, params)
            except sqlite3.Error as exc:
                if storage_failure(exc):
                    self.health.record(False)
                raise StoreError(f"profiles: write failed ({type(exc).__name__})") from exc
        self.health.record(True)

    def all(self) -> list[tuple[str, StoredProfile]]:
        with self._lock:
            rows = self._conn.execute(PROFILES.select_sql()).fetchall()
        return [_stored_profile(r) for r in rows]


MAX_STATEMENT_PARAMS = 32_766
"""Most parameters of one multi-row insert (SQLite's default limit since 3.32; a library built with a
lower ``SQLITE_LIMIT_VARIABLE_NUMBER``, such as 999 before 3.32, is asked and its limit used)."""

MAX_STATEMENT_ROWS = 1024
"""Most rows of one multi-row insert. Each size (a power of two) is compiled once and kept in the
connection's statement cache for good: a 1,024-row insert of fixes takes 0.47 MiB of SQLite's memory,
every size up to it about 1 MiB together. At 4,096 rows the set took 3.6 MiB, compiled when the
first large batch came, i.e. when the writer first fell behind: a step in the broker's memory in the
middle of a run. A batch of 20,000 rows is 20 statements (20 hand-backs of the interpreter lock)."""

MAX_BATCHES_PER_COMMIT = 4096
"""Most writes the writer thread commits in one transaction."""


class _Batch:
    __slots__ = ("future", "loop", "params", "rowcount", "rows", "sql", "urgent")

    def __init__(
        self,
        rows: Sequence[tuple[Any, ...]],
        loop: asyncio.AbstractEventLoop,
        sql: str | None = None,
        params: tuple[Any, ...] = (),
    ) -> None:
        self.rows = rows
        self.loop = loop
        self.sql = sql  # a single statement run instead of the insert (retention, window ledger)
        self.params = params
        self.rowcount = 0
        self.urgent = False  # a caller is waiting to answer: commit without lingering
        self.future: asyncio.Future[None] = loop.create_future()


class GroupCommitWriter:
    """A writer thread that inserts queued rows in as few transactions as possible.

    ``await writer.write(rows)`` returns once the rows are committed. The queue is bounded
    (``capacity`` rows); :meth:`try_reserve` lets callers refuse with ``overloaded`` instead of
    waiting. Timing of each commit is reported to ``on_commit(seconds)``. After the first queued
    write the thread lingers ``linger_s`` (2 ms) for more before it commits, unless a write queued
    with ``urgent`` is waiting (writes queued meanwhile still share that commit).
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        insert_sql: str,
        *,
        capacity: int,
        on_commit: Callable[[float], None] | None = None,
        name: str = "store",
        linger_s: float = 0.002,
        health: WriteHealth | None = None,
    ) -> None:
        self._conn = conn
        self.health = health if health is not None else WriteHealth(name)
        self._linger_s = linger_s
        self._sql = insert_sql
        self._multi_sql: dict[int, str] = {}
        self._max_params = min(MAX_STATEMENT_PARAMS, conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
        self._capacity = capacity
        self._pending_rows = 0
        self._count_lock = threading.Lock()
        self._pending: list[_Batch] = []
        """Writes handed over and not yet taken by the writer thread (under ``_pending_lock``)."""
        self._pending_lock = threading.Lock()
        self._idle = False
        """The writer thread waits on ``_wake`` for the next write (under ``_pending_lock``)."""
        self._urgent = False
        """An ``urgent`` write is pending: commit without lingering (under ``_pending_lock``)."""
        self._wake = threading.Event()
        self._stopping = False
        self._turn: dict[asyncio.AbstractEventLoop, list[_Batch]] = {}
        """Per event loop, the writes of its current turn: queued together when the turn ends."""
        self._closed = False
        self._on_commit = on_commit
        self._thread = threading.Thread(target=self._run, name=f"kcloak-{name}-writer", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self._pending_rows

    @property
    def capacity(self) -> int:
        return self._capacity

    def try_reserve(self, n: int) -> bool:
        with self._count_lock:
            if self._pending_rows + n > self._capacity:
                return False
            self._pending_rows += n
            return True

    async def write(self, rows: Sequence[tuple[Any, ...]], *, reserved: bool = False, urgent: bool = False) -> None:
        """Insert ``rows`` durably (raises :class:`StoreError` if the transaction failed); ``urgent``:
        a client waits for the answer, so the commit does not linger for more writes."""
        if not rows:
            return
        if not reserved:
            with self._count_lock:
                self._pending_rows += len(rows)
        batch = _Batch(rows, asyncio.get_running_loop())
        batch.urgent = urgent
        self._enqueue(batch)
        await batch.future

    def _enqueue(self, batch: _Batch) -> None:
        """Queue ``batch`` with the other writes of this loop turn: one hand-over to the writer
        thread (one wake-up) per turn instead of one per write, in the order they were made."""
        loop = batch.loop
        turn = self._turn.get(loop)
        if turn is None:
            turn = self._turn[loop] = []
            loop.call_soon(self._hand_over, loop)
        turn.append(batch)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        turn = self._turn.pop(loop, [])
        if self._closed:  # the thread has stopped: these would wait forever
            _settle_all([(b.future, RuntimeError("the writer is closed")) for b in turn])
            return
        # The thread is woken only when it waits for work: while it lingers or commits, the
        # writes of further turns are only appended (no wake-up, no switch of threads per turn).
        with self._pending_lock:
            self._pending += turn
            wake, self._idle = self._idle, False
            if any(b.urgent for b in turn):
                self._urgent = True
        if wake:
            self._wake.set()

    async def execute(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """Run one statement on the writer's connection, in order with the queued writes; returns its
        row count. Every write to the database goes through this thread, so writers never wait on
        each other's locks (a second connection could starve for its busy timeout under load)."""
        batch = _Batch((), asyncio.get_running_loop(), sql, params)
        self._enqueue(batch)
        await batch.future
        return batch.rowcount

    async def barrier(self) -> None:
        """Return once every write queued before this call has committed (or failed)."""
        batch = _Batch((), asyncio.get_running_loop())
        self._enqueue(batch)
        with contextlib.suppress(StoreError):
            await batch.future

    def _run(self) -> None:
        while True:
            with self._pending_lock:
                if not self._pending and not self._stopping:
                    self._idle = True
                    self._wake.clear()
            if self._idle:
                self._wake.wait()
            # Linger briefly for more writers: one transaction (and one wake-up of the event loop)
            # then serves many small writes, at the cost of up to ``linger_s`` of latency.
            with self._pending_lock:
                stopping, urgent, self._urgent = self._stopping, self._urgent, False
            if not stopping and not urgent and self._linger_s > 0:
                time.sleep(self._linger_s)
            with self._pending_lock:
                batches = self._pending[:MAX_BATCHES_PER_COMMIT]
                del self._pending[:MAX_BATCHES_PER_COMMIT]
                stopping, more = self._stopping, bool(self._pending)
            if batches:
                self._commit(batches)
            if stopping and not more:
                return

    def _commit(self, batches: list[_Batch]) -> None:
        started = time.perf_counter()
        error = self._transaction(batches)
        if error is not None and not storage_failure(error) and len(batches) > 1:
            # A bad row fails only its own write, not the others grouped with it.
            errors = [self._transaction([b]) for b in batches]
        else:
            errors = [error] * len(batches)
        elapsed = time.perf_counter() - started
        n = sum(len(b.rows) for b in batches)
        with self._count_lock:
            self._pending_rows -= n
        if self._on_commit is not None:
            self._on_commit(elapsed)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], BaseException | None]]] = {}
        for b, err in zip(batches, errors, strict=True):
            by_loop.setdefault(b.loop, []).append((b.future, err))
        for loop, outcomes in by_loop.items():
            loop.call_soon_threadsafe(_settle_all, outcomes)

    def _transaction(self, batches: list[_Batch]) -> BaseException | None:
        """Run ``batches`` in one transaction; returns the error that rolled it back, if any.

        Any exception is caught (a bad row can raise outside ``sqlite3.Error``): a dead writer
        thread would leave every later write waiting forever."""
        writes = any(b.rows or b.sql is not None for b in batches)
        try:
            self._conn.execute("BEGIN")
            rows: list[tuple[Any, ...]] = []  # consecutive writes' rows, inserted together
            for b in batches:
                if b.sql is not None:
                    self._insert(rows)
                    rows = []
                    b.rowcount = self._conn.execute(b.sql, b.params).rowcount
                else:
                    rows += b.rows
            self._insert(rows)
            self._conn.execute("COMMIT")
        except Exception as exc:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            if storage_failure(exc):
                self.health.record(False)
            return exc
        if writes:
            self.health.record(True)
        return None

    def _insert(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Insert ``rows`` with multi-row statements (``VALUES (…), (…), …``) of a power-of-two number
        of rows, at most :data:`MAX_STATEMENT_ROWS` and the library's parameter limit each.

        Each statement is one hand-back of the interpreter lock from SQLite to this thread, and while
        the event loop's thread is busy that hand-back waits for its switch interval (5 ms): with
        ``executemany`` (a hand-back per row) or statements of a few hundred rows, that wait, not
        SQLite, bounded the rows this thread could commit per second under load."""
        if not rows:
            return
        width = len(rows[0])
        size = self._rows_per_statement(width)
        i, n = 0, len(rows)
        while i < n:
            while n - i < size:
                size //= 2
            self._conn.execute(self._multi_row_sql(size), list(chain.from_iterable(rows[i : i + size])))
            i += size

    def _rows_per_statement(self, width: int) -> int:
        size = 1
        while size < MAX_STATEMENT_ROWS and size * 2 * width <= self._max_params:
            size *= 2
        return size

    def _multi_row_sql(self, rows: int) -> str:
        sql = self._multi_sql.get(rows)
        if sql is None:
            head, _, values = self._sql.rpartition("VALUES")
            sql = self._multi_sql[rows] = f"{head}VALUES {', '.join([values.strip()] * rows)}"
        return sql

    def close(self) -> None:
        """Finish every queued write, then stop the thread."""
        self._closed = True
        with self._pending_lock:
            self._stopping, self._idle = True, False
        self._wake.set()
        self._thread.join()


def _settle_all(outcomes: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for fut, error in outcomes:
        _settle(fut, error)


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(StoreError(f"store write failed: {type(error).__name__}"))


def read_fix_columns(conn: sqlite3.Connection, t0: float, t1: float, *, chunk: int = 20_000) -> FixTable:
    """Fixes with ``t0 ≤ t < t1`` of the movement database open on ``conn``, ordered by user then time,
    as columns read ``chunk`` rows at a time.

    A window of a busy broker holds millions of fixes; as one list of row tuples they would take
    about 190 bytes each in the heap (390 MiB for 2,000 users over 15 minutes), which the allocator
    keeps after the window is published. Read in chunks, only one chunk of tuples lives at a time
    and the columns are numpy arrays, which are given back when freed.
    """
    where = "t >= ? AND t < ?"
    n, width = conn.execute(
        f"SELECT COUNT(*), COALESCE(MAX(LENGTH(user_id)), 1) FROM {FIXES.name} WHERE {where}", (t0, t1)
    ).fetchone()
    users = np.empty(n, dtype=f"<U{width}")
    t, lat, lon = (np.empty(n, dtype=np.float64) for _ in range(3))
    cursor = conn.execute(FIXES.select_sql(where=where, order_by="user_id, t"), (t0, t1))
    at = 0
    while (rows := cursor.fetchmany(chunk)) and at < n:
        rows = rows[: n - at]  # fixes committed since the count are left for the next window read
        end = at + len(rows)
        users[at:end] = [r[0] for r in rows]
        t[at:end], lat[at:end], lon[at:end] = np.array([r[1:] for r in rows], dtype=np.float64).reshape(-1, 3).T
        at = end
    return FixTable(users[:at], t[:at], lat[:at], lon[:at])


class MovementStore:
    """``movement.sqlite3``: every accepted fix (the write-ahead history) and window states."""

    INSERT = FIXES.insert_sql(conflict="IGNORE")

    def __init__(
        self,
        path: Path,
        *,
        capacity: int = 200_000,
        on_commit: Callable[[float], None] | None = None,
        health: WriteHealth | None = None,
    ) -> None:
        self.path = path
        self._conn = open_db(path, MOVEMENT_FILE)
        self._read = sqlite3.connect(path, check_same_thread=False)
        self._read_lock = threading.Lock()
        self.writer = GroupCommitWriter(
            self._conn, self.INSERT, capacity=capacity, on_commit=on_commit, name="movement", health=health
        )
        self.health = self.writer.health

    async def __aenter__(self) -> MovementStore:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self.writer.close()
        self._conn.close()
        with self._read_lock:
            self._read.close()

    async def append(
        self, fixes: Iterable[tuple[str, float, float, float]], *, reserved: bool = False, urgent: bool = False
    ) -> None:
        """Durably record ``(user_id, t, lat, lon)`` fixes (``urgent``: see :meth:`GroupCommitWriter.write`)."""
        await self.writer.write(list(fixes), reserved=reserved, urgent=urgent)

    def fixes_between(self, t0: float, t1: float) -> list[tuple[str, float, float, float]]:
        """Fixes with ``t0 ≤ t < t1``, ordered by user then time."""
        with self._read_lock:
            return self._read.execute(
                FIXES.select_sql(where="t >= ? AND t < ?", order_by="user_id, t"), (t0, t1)
            ).fetchall()

    def fix_columns_between(self, t0: float, t1: float, *, chunk: int = 20_000) -> FixTable:
        """:meth:`fixes_between` as columns, read ``chunk`` rows at a time (:func:`read_fix_columns`)."""
        with self._read_lock:
            return read_fix_columns(self._read, t0, t1, chunk=chunk)

    def latest_per_user(self, since: float) -> list[tuple[str, float, float, float]]:
        """The latest fix of every user with a fix at or after ``since`` (restores the index)."""
        with self._read_lock:
            return self._read.execute(
                f"SELECT user_id, MAX(t), lat, lon FROM {FIXES.name} WHERE t >= ? GROUP BY user_id", (since,)
            ).fetchall()

    async def delete_older_than(self, t: float, *, keep_from: float | None = None, chunk: int = 20_000) -> int:
        """Retention: drop fixes older than ``t`` but never at or after ``keep_from``.

        Runs on the writer thread in chunks of ``chunk`` rows, so inserts keep flowing between them.
        """
        cutoff = t if keep_from is None else min(t, keep_from)
        total = 0
        while True:
            n = await self.writer.execute(
                f"DELETE FROM {FIXES.name} WHERE rowid IN (SELECT rowid FROM {FIXES.name} WHERE t < ? LIMIT ?)",
                (cutoff, chunk),
            )
            total += n
            if n < chunk:
                return total


QUERYLOG_LINGER_S = 0.05
"""The query log's writer gathers rows this long before it commits: no answer waits for them, and
under load one commit (one wake-up of the writer thread, one of the event loop) then serves
hundreds of queries instead of a few."""


class QueryLog:
    """``querylog.sqlite3``: one row per forwarded query; no user id, query id or pseudonym."""

    INSERT = FORWARDED.insert_sql()

    def __init__(
        self,
        path: Path,
        *,
        capacity: int = 100_000,
        on_commit: Callable[[float], None] | None = None,
        health: WriteHealth | None = None,
    ) -> None:
        self._conn = open_db(path, QUERYLOG_FILE)
        self.writer = GroupCommitWriter(
            self._conn,
            self.INSERT,
            capacity=capacity,
            on_commit=on_commit,
            name="querylog",
            health=health,
            linger_s=QUERYLOG_LINGER_S,
        )
        self.health = self.writer.health

    def close(self) -> None:
        self.writer.close()
        self._conn.close()

    async def record(self, row: tuple[Any, ...]) -> None:
        await self.writer.write([row])

    async def record_rows(self, rows: list[tuple[Any, ...]]) -> None:
        await self.writer.write(rows)
