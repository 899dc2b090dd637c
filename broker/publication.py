"""Live trajectory publication (contract §7 "Live windows", §11; CONCEPTS §7).

Every accepted fix is already in ``movement.sqlite3`` (written ahead by the movement store). The
:class:`WindowPublisher` cuts that history into windows ``[n·W, (n+1)·W)``; once no fix can arrive
for a window any more (now ≥ ``t_end`` + ``max_update_age_s``) it anonymizes the window's
trajectories with :func:`kcloak.streams.publish.anonymize` ((k,δ)-anonymity, CONCEPTS §7.2–§7.5) and
publishes the result exactly once. A window of :data:`PROCESS_MIN_ROWS` fixes or more is read,
anonymized and written out by :func:`anonymize_window` in a child process of its own, started for
that window, at a lower CPU priority (:data:`CHILD_NICE`) once it has read the window's fixes, and
ended once the window's CSV is written:

- the algorithm runs for seconds in Python and, in a thread, would hold the interpreter lock the
  event loop needs to answer queries meanwhile;
- the window's fixes (millions for a busy broker) never enter the broker's heap, and whatever the
  child allocated leaves with it (a child kept between windows keeps what the largest window took);
- on a small host the window competes with the broker and the LBS for the CPU: niced, it takes the
  time they leave, and queries keep their latency while a window closes.

Smaller windows, or any window when the child cannot run, are processed the same way in a thread.
The result is then:

1. write ``published/trajectories/<window_id>.csv`` and ``.json`` atomically (temp file, fsync,
   rename; the CSV's temp file is written by :func:`anonymize_window`);
2. record the window ``committed`` in the ``windows`` table;
3. publish it on ``kcloak/v1/published/trajectories`` in parts of at most 10,000 rows (QoS 1,
   each part acknowledged);
4. record it ``sent``.

After a crash, ``committed`` windows are sent again and windows never committed are processed
anew (their files, if any, are replaced, never duplicated). Retention never deletes fixes at or
after the first window that is not committed (:meth:`WindowPublisher.retention_floor`).

Which windows are published: windows from the one holding the first stored fix on, each once.
A window that ended before this process started and holds no stored fix is skipped (not
published, not recorded): after a long downtime the publisher jumps to the next window that holds
a fix, or to the window in which the process started, so there is never a backlog of empty windows.
Every window that ends while the process runs is published, empty if it has too few trajectories.
When ``publish.window_s`` changed between runs, publication resumes at the first window of the new
length that starts at or after the end of the last recorded window.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import csv
import dataclasses
import itertools
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak import __version__
from kcloak.broker.config import Config
from kcloak.broker.errors import BrokerError
from kcloak.broker.metrics import Metrics
from kcloak.broker.stores import GroupCommitWriter, MovementStore, read_fix_columns
from kcloak.core.logs import log_event
from kcloak.core.memory import release_free_memory
from kcloak.core.readers import FixTable, write_contract_csv
from kcloak.core.schemas import FIXES, WINDOWS, WindowState
from kcloak.streams.publish import METHODS, anonymize
from kcloak.wire.mqtt_client import MqttError

log = logging.getLogger("kcloak.publication")

TOPIC = "kcloak/v1/published/trajectories"
COLUMNS = ("traj_id", "t", "lat", "lon")
PART_ROWS = 10_000
"""Rows in one MQTT part at most (contract §1)."""
PART_BYTES = 1 << 20
"""Bytes in one MQTT part at most (contract §1)."""
PI_S_MAX = 60.0
"""NWA time granularity of live windows: ``min(60 s, window_s / 10)`` (60 s for the default 900 s)."""

PROCESS_MIN_ROWS = 20_000
"""Windows with at least this many fixes are processed in a child process (a second or more of work)."""
CHILD_NICE = 10
"""How much the window's child process lowers its CPU priority (``os.nice``): on a busy host it then takes
the CPU time the broker and the LBS leave, about a tenth of a core when they want all of it."""

WINDOW_ID = re.compile(r"^([0-9]{1,15})-([0-9]{1,15})\Z")

Send = Callable[[str, bytes], Awaitable[None]]
"""Publish one message at QoS 1 and return once it is acknowledged (raise otherwise)."""


class PublicationError(BrokerError, RuntimeError):
    """Publication cannot run with this configuration (e.g. a method this version lacks)."""


class WindowStatus(StrEnum):
    """``status`` of a window report (contract §7)."""

    PUBLISHED = "published"
    EMPTY = "empty"


@dataclass(frozen=True, slots=True)
class Window:
    """A publication window ``[t_start, t_end)`` in whole Unix seconds (contract §1 window id)."""

    t_start: int
    t_end: int

    @property
    def window_id(self) -> str:
        return f"{self.t_start}-{self.t_end}"

    @classmethod
    def parse(cls, window_id: str) -> Window | None:
        """The window named by ``window_id``, or None if it is not of the form ``{t_start}-{t_end}``."""
        m = WINDOW_ID.match(window_id)
        if m is None:
            return None
        start, end = int(m.group(1)), int(m.group(2))
        return cls(start, end) if start < end else None


@dataclass(frozen=True, slots=True)
class WindowRecord:
    """A row of the ``windows`` table."""

    window_id: str
    t_start: int
    t_end: int
    state: WindowState
    n_in: int
    n_out: int
    committed_t: float
    sent_t: float | None


def window_start(t: float, window_s: int) -> int:
    """Start of the window holding ``t``."""
    return math.floor(t / window_s) * window_s


LEDGER_CACHE_KIB = 64
"""The window ledger's SQLite page cache, KiB (:class:`WindowLedger`)."""


class WindowLedger:
    """The ``windows`` table of ``movement.sqlite3`` on a connection of its own (thread-safe).

    Its reads are one-off: a window's fixes counted once when it is due, a few rows of ``windows``.
    So its page cache is kept at :data:`LEDGER_CACHE_KIB`: with SQLite's default (2 MiB a
    connection) the first count, over a window's part of the ``t`` index, left 2 MiB of pages no
    later read needed in the broker's memory for good."""

    def __init__(self, path: Path, writer: GroupCommitWriter) -> None:
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.execute(f"PRAGMA cache_size=-{LEDGER_CACHE_KIB}")
        self._lock = threading.Lock()
        self._writer = writer  # writes go through the movement store's writer thread

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    async def commit(self, window: Window, *, n_in: int, n_out: int, t: float) -> None:
        await self._writer.execute(
            _WINDOW_PUT,
            (window.window_id, window.t_start, window.t_end, WindowState.COMMITTED.value, n_in, n_out, t, None),
        )

    async def mark_sent(self, window_id: str, t: float) -> None:
        await self._writer.execute(
            f"UPDATE {WINDOWS.name} SET state = ?, sent_t = ? WHERE window_id = ?",
            (WindowState.SENT.value, t, window_id),
        )

    def get(self, window_id: str) -> WindowRecord | None:
        with self._lock:
            row = self._conn.execute(WINDOWS.select_sql(where="window_id = ?"), (window_id,)).fetchone()
        return None if row is None else _record(row)

    def records(self, *, since: int = 0, limit: int = 100, state: WindowState | None = None) -> list[WindowRecord]:
        """Windows with ``t_start ≥ since``, ascending ``t_start``, at most ``limit``."""
        sql = WINDOWS.select_sql(where="t_start >= ?")
        args: list[Any] = [since]
        if state is not None:
            sql += " AND state = ?"
            args.append(state.value)
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY t_start LIMIT ?", (*args, limit)).fetchall()
        return [_record(r) for r in rows]

    def latest_end(self) -> int | None:
        with self._lock:
            row = self._conn.execute(f"SELECT MAX(t_end) FROM {WINDOWS.name}").fetchone()
        return None if row[0] is None else int(row[0])

    def count_fixes(self, t0: float, t1: float) -> int:
        """How many stored fixes have ``t0 ≤ t < t1``."""
        with self._lock:
            row = self._conn.execute(f"SELECT COUNT(*) FROM {FIXES.name} WHERE t >= ? AND t < ?", (t0, t1)).fetchone()
        return int(row[0])

    def first_fix_at_or_after(self, t: float) -> float | None:
        with self._lock:
            row = self._conn.execute(f"SELECT MIN(t) FROM {FIXES.name} WHERE t >= ?", (t,)).fetchone()
        return None if row[0] is None else float(row[0])


@dataclass(frozen=True, slots=True)
class WindowJob:
    """What :func:`anonymize_window` needs, picklable for a child process: the movement database, the
    window, where to write its CSV, the ``min_points`` filter and :func:`~kcloak.streams.publish.anonymize`'s
    parameters."""

    database: Path
    t_start: int
    t_end: int
    csv_path: Path
    min_points: int
    params: dict[str, Any]
    nice: int = 0
    """Lower the CPU priority by this much once the fixes are read (in a child process only)."""


@dataclass(frozen=True, slots=True)
class WindowResult:
    """What :func:`anonymize_window` returns: whether the release is published, its report, and the
    number of users left out for having fewer than ``min_points`` fixes."""

    ok: bool
    report: dict[str, Any]
    n_few: int


def anonymize_window(job: WindowJob) -> WindowResult:
    """Read a window's fixes from the movement database (a connection of its own), anonymize them and
    write the release to ``job.csv_path`` (fsynced, not renamed). If the algorithm fails, the window is
    published empty, so a bug never stalls publication.

    The read runs at full priority, then the priority is lowered by ``job.nice``: the read is one
    transaction, and while it is open SQLite cannot reset the write-ahead log the broker keeps writing
    fixes to. Niced from the start on a loaded host, a 15-minute window took 4 minutes to read and the
    log grew by 400 MB (a file SQLite keeps at its largest size)."""
    conn = sqlite3.connect(job.database)
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        fixes = read_fix_columns(conn, job.t_start, job.t_end)
    finally:
        conn.close()
    if job.nice:
        os.nice(job.nice)
    _, inverse, counts = np.unique(fixes.traj_id, return_inverse=True, return_counts=True)
    keep = counts[inverse] >= job.min_points
    n_few = int(np.count_nonzero(counts < job.min_points))
    table = FixTable(fixes.traj_id[keep], fixes.t[keep], fixes.lat[keep], fixes.lon[keep])
    del fixes, inverse, keep
    try:
        release = anonymize(table, **job.params)
    except Exception:
        log.exception("window_anonymize_failed")
        empty = FixTable(np.array([], dtype=str), np.array([]), np.array([]), np.array([]))
        release = anonymize(empty, **job.params)
    del table
    write_contract_csv(job.csv_path, release.table)
    _fsync_write(job.csv_path)
    return WindowResult(release.ok, release.report, n_few)


def _child_init() -> None:
    """The window's child ignores a terminal's Ctrl-C: the broker ends it when it stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_child(
    job: WindowJob,
) -> tuple[concurrent.futures.ProcessPoolExecutor, concurrent.futures.Future[WindowResult]]:
    """A fresh process (``spawn``: nothing of the broker's heap is inherited) running :func:`anonymize_window`.

    One process per window, and no ``max_tasks_per_child``: with it, the executor's manager thread
    replaces the exiting worker right after the result arrives, so a fresh idle process (with its
    imports) would always wait for the next window, and one that is still being started is missed by
    :func:`_stop_child`. The process is registered by the time :meth:`submit` returns.
    """
    executor = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init
    )
    return executor, executor.submit(anonymize_window, dataclasses.replace(job, nice=CHILD_NICE))


def _stop_child(executor: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop the child now: a window still being anonymized is abandoned (it is processed anew after a
    restart), so the broker never waits at exit for an algorithm run of many seconds to finish. The
    child holds nothing worth a graceful exit (its half-written CSV is a temp file, replaced on the
    next run), so it is killed: that also ends a child that is stopped (SIGSTOP) or not scheduled."""
    # The executor keeps its processes private (3.14 adds terminate_workers()); without them, an idle
    # child still exits on the shutdown sentinel.
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()
    for process in processes:
        process.join(5.0)


_WINDOW_PUT = WINDOWS.insert_sql(conflict="REPLACE")


def _record(row: tuple[Any, ...]) -> WindowRecord:
    """A ``windows`` row (every column, in :data:`WINDOWS` order) as a :class:`WindowRecord`."""
    r = dict(zip(WINDOWS.column_names, row, strict=True))
    return WindowRecord(
        window_id=r["window_id"],
        t_start=int(r["t_start"]),
        t_end=int(r["t_end"]),
        state=WindowState(r["state"]),
        n_in=int(r["n_in"]),
        n_out=int(r["n_out"]),
        committed_t=r["committed_t"],
        sent_t=r["sent_t"],
    )


def _fsync_write(path: Path, data: bytes | None = None) -> None:
    """fsync ``path`` (writing ``data`` first when given)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if data is not None else 0), 0o600)
    try:
        if data is not None:
            os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def window_parts(window_id: str, report: dict[str, Any], table: FixTable, *, part_rows: int = PART_ROWS) -> list[bytes]:
    """The MQTT messages of a window (contract §7 live windows): its rows in parts of at most
    ``part_rows`` (:data:`PART_ROWS`) rows and :data:`PART_BYTES` bytes, each with the window's head."""
    head = {
        "window_id": window_id,
        "t_start": report["t_start"],
        "t_end": report["t_end"],
        "method": report["method"],
        "k": report["k"],
        "delta": report["delta"],
        "n_trajectories": report["n_out"],
    }
    n = len(table)
    per_part = max(1, min(part_rows, PART_ROWS))
    while True:
        # Rows become Python objects :data:`ROWS_AT_ONCE` at a time, each slice serialized before the
        # next is made: a whole window's (millions) would stay in the broker's heap after it is sent,
        # and even one part's 10,000 raised the broker's memory for good when the first window went.
        count = max(1, math.ceil(n / per_part))
        payloads: list[bytes] = []
        for n_part in range(count):
            start, stop = n_part * per_part, min((n_part + 1) * per_part, n)
            body = {**head, "part": n_part + 1, "parts": count, "columns": list(COLUMNS)}
            text = json.dumps(body, separators=(",", ":"))[:-1]  # the same bytes as with "rows" in the dict
            rows = ",".join(_rows_json(table, i, min(i + ROWS_AT_ONCE, stop)) for i in range(start, stop, ROWS_AT_ONCE))
            payloads.append(f'{text},"rows":[{rows}]}}'.encode())
            if per_part > 1 and len(payloads[-1]) > PART_BYTES:
                break
        else:
            return payloads
        per_part = max(1, per_part // 2)


ROWS_AT_ONCE = 1_000
"""Window rows held as Python objects at once while a window's files are read and its parts built."""


def _rows_json(table: FixTable, start: int, stop: int) -> str:
    """Rows ``start:stop`` of ``table`` as the JSON of a part's ``rows``, without the brackets."""
    part = slice(start, stop)
    rows = [
        [i, int(t) if t.is_integer() else t, la, lo]
        for i, t, la, lo in zip(
            table.traj_id[part].tolist(),
            table.t[part].tolist(),
            table.lat[part].tolist(),
            table.lon[part].tolist(),
            strict=True,
        )
    ]
    return json.dumps(rows, separators=(",", ":"))[1:-1]


def read_window_csv(path: Path, *, chunk: int = ROWS_AT_ONCE) -> FixTable:
    """A window's CSV as written by :func:`~kcloak.core.readers.write_contract_csv` (``traj_id,t,lat,lon``,
    no bad row), ``chunk`` rows at a time into numpy columns: the general reader keeps every field of
    every row as text until it has read them all (about 400 bytes a row in the broker's heap)."""
    ids: list[npt.NDArray[np.str_]] = []
    numbers: list[npt.NDArray[np.float64]] = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        if next(reader, None) != list(COLUMNS):
            raise ValueError(f"{path.name}: not a window file")
        while rows := list(itertools.islice(reader, chunk)):
            ids.append(np.array([r[0] for r in rows], dtype=str))
            numbers.append(np.array([r[1:] for r in rows], dtype=np.float64).reshape(-1, 3))
            del rows
    if not ids:
        empty = np.empty(0, dtype=np.float64)
        return FixTable(np.empty(0, dtype=str), empty, empty.copy(), empty.copy())
    values = np.concatenate(numbers)
    return FixTable(np.concatenate(ids), values[:, 0].copy(), values[:, 1].copy(), values[:, 2].copy())


class WindowPublisher:
    """Publishes the live windows of contract §7 from the movement store (run :meth:`run` as a task).

    Keyword arguments: ``config`` (``[publish]``, ``cloaking.max_update_age_s``), ``movement`` (the
    store the fixes are read from; the ledger opens its file again), ``directory`` (where window
    files go: ``<data dir>/published/trajectories``), ``metrics``, ``send`` (QoS 1 publish that
    returns once acknowledged; None without MQTT, then committed windows are marked sent at once)
    ``clock`` (Unix seconds; :func:`time.time`) and ``process_min_rows`` (windows with at least this
    many fixes are processed in a child process of their own; :data:`PROCESS_MIN_ROWS`).
    """

    def __init__(
        self,
        *,
        config: Config,
        movement: MovementStore,
        directory: Path,
        metrics: Metrics,
        send: Send | None = None,
        clock: Callable[[], float] = time.time,
        process_min_rows: int = PROCESS_MIN_ROWS,
    ) -> None:
        pub = config.publish
        self.window_s = pub.window_s
        self.enabled = pub.window_s > 0
        if self.enabled and pub.method not in METHODS:
            raise PublicationError(f"publish.method {pub.method}: not available in this version")
        self.config = config
        self.movement = movement
        self.directory = directory
        self.metrics = metrics
        self.send = send
        self.clock = clock
        self.pi_s = min(PI_S_MAX, pub.window_s / 10) if self.enabled else PI_S_MAX
        self.started_t = clock()
        self.ledger = WindowLedger(movement.path, movement.writer)
        self.process_min_rows = process_min_rows
        self._child: concurrent.futures.ProcessPoolExecutor | None = None
        self._child_lock = threading.Lock()  # starting a child vs. close() from another thread
        self._closed = False
        self._cursor: int | None = None
        self._unsent: list[str] | None = None

    def close(self) -> None:
        with self._child_lock:
            self._closed = True
            child, self._child = self._child, None
        if child is not None:
            _stop_child(child)
        self.ledger.close()

    # -- retention -----------------------------------------------------------------------------
    def retention_floor(self) -> float | None:
        """Fixes at or after this time must be kept: the start of the first window not committed.

        None when publication is off; ``-inf`` (keep everything) before the first window is known.
        """
        if not self.enabled:
            return None
        return -math.inf if self._cursor is None else float(self._cursor)

    # -- the loop ------------------------------------------------------------------------------
    async def run(self, *, poll_s: float = 1.0) -> None:
        """Publish due windows until cancelled; failures (disk, MQTT) are logged and retried."""
        if not self.enabled:
            return
        while True:
            try:
                await self.step()
            except (OSError, sqlite3.Error) as exc:
                log_event(log, "publication_failed", logging.ERROR, error=type(exc).__name__)
            except Exception:  # never take the broker down; the window is retried
                log.exception("publication_failed")
            await asyncio.sleep(self._sleep_s(poll_s))

    def _sleep_s(self, poll_s: float) -> float:
        if self._cursor is None or self._unsent:
            return poll_s
        due = self._cursor + self.window_s + self.config.cloaking.max_update_age_s
        return max(0.02, min(poll_s, due - self.clock()))

    async def step(self) -> list[str]:
        """Send what is committed but unsent, then process every due window; returns the ids committed."""
        if self._unsent is None:
            records = await asyncio.to_thread(self.ledger.records, limit=2**62, state=WindowState.COMMITTED)
            self._unsent = [r.window_id for r in records]
        await self._send_pending()
        done: list[str] = []
        while (window := await self._next_due()) is not None:
            await self._process(window)
            done.append(window.window_id)
            await self._send_pending()
        return done

    async def _next_due(self) -> Window | None:
        w = self.window_s
        if self._cursor is None:
            self._cursor = await asyncio.to_thread(self._initial_cursor)
            if self._cursor is None:
                return None
        first_live = window_start(self.started_t, w)
        if self._cursor < first_live:
            # Windows that ended before this process started and hold no fix are skipped.
            nxt = await asyncio.to_thread(self.ledger.first_fix_at_or_after, self._cursor)
            jump = first_live if nxt is None else min(first_live, window_start(nxt, w))
            self._cursor = max(self._cursor, jump)
        if self._cursor + w + self.config.cloaking.max_update_age_s <= self.clock():
            return Window(self._cursor, self._cursor + w)
        return None

    def _initial_cursor(self) -> int | None:
        latest = self.ledger.latest_end()
        if latest is not None:
            return math.ceil(latest / self.window_s) * self.window_s
        first = self.ledger.first_fix_at_or_after(-math.inf)
        return None if first is None else window_start(first, self.window_s)

    # -- one window ----------------------------------------------------------------------------
    async def _process(self, window: Window) -> None:
        # Every fix accepted so far was queued to the store before this point: wait until it is
        # committed, so the window's input is complete.
        await self.movement.writer.barrier()
        pub = self.config.publish
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        job = WindowJob(
            database=self.movement.path,
            t_start=window.t_start,
            t_end=window.t_end,
            csv_path=self._csv_tmp(window.window_id),
            min_points=pub.min_points,
            params={
                "method": pub.method,
                "k": pub.k,
                "delta_m": pub.delta_m,
                "trash_max": pub.trash_max,
                "pi_s": self.pi_s,
            },
        )
        n_fixes = await asyncio.to_thread(self.ledger.count_fixes, window.t_start, window.t_end)
        if n_fixes >= self.process_min_rows:
            release = await self._anonymize_in_child(job)
        else:
            release = await asyncio.to_thread(anonymize_window, job)
            await asyncio.to_thread(release_free_memory)  # what the window took here (kcloak.core.memory)
        status = WindowStatus.PUBLISHED if release.ok else WindowStatus.EMPTY
        report: dict[str, Any] = {
            "kcloak_version": __version__,
            "window_id": window.window_id,
            "t_start": window.t_start,
            "t_end": window.t_end,
            "published_t": self.clock(),
            "status": status.value,
            **release.report,
        }
        report["n_too_short"] += release.n_few
        await asyncio.to_thread(self._write_files, window, report)
        n_in, n_out = int(report["n_in"]), int(report["n_out"])
        await self.ledger.commit(window, n_in=n_in, n_out=n_out, t=self.clock())
        self._cursor = window.t_end
        assert self._unsent is not None
        self._unsent.append(window.window_id)
        self.metrics.published_windows.labels(outcome=status.value).inc()
        self.metrics.published_trajectories.inc(n_out)
        self.metrics.trashed_trajectories.inc(int(report["n_trash"]))
        log_event(
            log,
            "window_committed",
            window_id=window.window_id,
            status=status.value,
            n_in=n_in,
            n_out=n_out,
            n_trash=int(report["n_trash"]),
            runtime_s=round(float(report["runtime_s"]), 3),
        )

    async def _anonymize_in_child(self, job: WindowJob) -> WindowResult:
        """:func:`anonymize_window` in a child process of its own (in a thread if the child fails)."""
        try:
            future = await asyncio.to_thread(self._start_child, job)
            result = await asyncio.wrap_future(future)
        except Exception as exc:  # the child died or could not start, or the window failed there: run it here
            await asyncio.to_thread(self._end_child, stop=True)
            if self._closed:
                raise
            log_event(log, "publication_worker_failed", logging.WARNING, error=type(exc).__name__)
            return await asyncio.to_thread(anonymize_window, job)
        await asyncio.to_thread(self._end_child, stop=False)  # idle: it exits on the shutdown sentinel
        return result

    def _start_child(self, job: WindowJob) -> concurrent.futures.Future[WindowResult]:
        with self._child_lock:
            if self._closed:
                raise PublicationError("the publisher is closed")
            self._child, future = _start_child(job)
        return future

    def _end_child(self, *, stop: bool) -> None:
        with self._child_lock:
            child, self._child = self._child, None
        if child is None:
            return
        if stop:
            _stop_child(child)
        else:
            child.shutdown(wait=True)

    def _csv_tmp(self, window_id: str) -> Path:
        return self.directory / f".{window_id}.csv.tmp"

    def _write_files(self, window: Window, report: dict[str, Any]) -> None:
        """Write the report beside the CSV :func:`anonymize_window` wrote, then rename both into place."""
        json_tmp = self.directory / f".{window.window_id}.json.tmp"
        _fsync_write(json_tmp, (json.dumps(report, indent=1) + "\n").encode())
        os.replace(self._csv_tmp(window.window_id), self.csv_path(window.window_id))
        os.replace(json_tmp, self.report_path(window.window_id))
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # -- MQTT ----------------------------------------------------------------------------------
    async def _send_pending(self) -> None:
        assert self._unsent is not None
        while self._unsent:
            window_id = self._unsent[0]
            if self.send is not None:
                try:
                    parts = await asyncio.to_thread(self.parts, window_id)
                except (OSError, ValueError, KeyError) as exc:
                    # Files removed or damaged by hand: left committed (tried again after a restart).
                    log_event(log, "window_unreadable", logging.ERROR, window_id=window_id, error=type(exc).__name__)
                    self._unsent.pop(0)
                    continue
                try:
                    for payload in parts:
                        await self.send(TOPIC, payload)
                except (MqttError, OSError, TimeoutError) as exc:
                    log_event(log, "window_send_failed", logging.WARNING, window_id=window_id, error=type(exc).__name__)
                    return
            await self.ledger.mark_sent(window_id, self.clock())
            self._unsent.pop(0)
            log_event(log, "window_sent", window_id=window_id, mqtt=self.send is not None)

    def parts(self, window_id: str) -> list[bytes]:
        """The MQTT messages of a committed window, built from its files (so a re-send is identical)."""
        report = json.loads(self.report_path(window_id).read_text(encoding="utf-8"))
        table = read_window_csv(self.csv_path(window_id))
        return window_parts(window_id, report, table)

    # -- reading (HTTP) ------------------------------------------------------------------------
    def csv_path(self, window_id: str) -> Path:
        return self.directory / f"{window_id}.csv"

    def report_path(self, window_id: str) -> Path:
        return self.directory / f"{window_id}.json"

    def report(self, window_id: str) -> dict[str, Any] | None:
        """The report of a committed window, or None if there is no such window."""
        if Window.parse(window_id) is None or self.ledger.get(window_id) is None:
            return None
        try:
            data: dict[str, Any] = json.loads(self.report_path(window_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data

    def published_csv(self, window_id: str) -> Path | None:
        """The file of a committed window, or None if there is no such window."""
        if Window.parse(window_id) is None or self.ledger.get(window_id) is None:
            return None
        path = self.csv_path(window_id)
        return path if path.is_file() else None

    def listing(self, *, since: int, limit: int) -> tuple[list[dict[str, Any]], int | None]:
        """Window metas with ``t_start ≥ since`` (ascending) and the ``next_since`` of contract §4."""
        records = self.ledger.records(since=since, limit=limit + 1)
        more = records[limit] if len(records) > limit else None
        metas: list[dict[str, Any]] = []
        for rec in records[:limit]:
            report = self.report(rec.window_id)
            if report is None:
                continue
            metas.append(
                {
                    "window_id": rec.window_id,
                    "t_start": rec.t_start,
                    "t_end": rec.t_end,
                    "method": report["method"],
                    "k": report["k"],
                    "delta": report["delta"],
                    "n_in": report["n_in"],
                    "n_out": report["n_out"],
                    "published_t": report["published_t"],
                    "status": report["status"],
                    "csv": f"/v1/published/windows/{rec.window_id}.csv",
                }
            )
        return metas, None if more is None else more.t_start


__all__ = [
    "TOPIC",
    "PublicationError",
    "Window",
    "WindowJob",
    "WindowLedger",
    "WindowPublisher",
    "WindowRecord",
    "WindowResult",
    "WindowState",
    "WindowStatus",
    "anonymize_window",
    "window_parts",
    "window_start",
]
