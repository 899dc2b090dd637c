"""Upstream requests made by child processes (``[upstream] processes``, an extension: docs/contract-extensions.md
"Upstream requests in child processes").

A query's upstream exchange (building the request, HTTP on a pooled connection, timeouts,
retries with fresh pseudonyms, the strict check of the provider's answer) costs the broker's
event loop more than everything else a query does together, and that loop is one thread: under
load it is the limit while the machine's other cores wait. :class:`UpstreamProcesses` hands each
:class:`~kcloak.broker.upstream.SearchRequest` to one of ``processes`` child processes, each
running the same :class:`~kcloak.broker.upstream.UpstreamClient` (so the same policy, contract
§5) in an event loop of its own, and gets the checked candidates back.

What crosses the pipe: the request's allow-listed fields (what would go upstream anyway, no user
id, exact point or query id), then the candidates, the outcome and duration of every attempt
(for ``kcloak_upstream_seconds``) and the number of retries. Both directions send one frame per
event-loop turn: a 4-byte big-endian length, then MessagePack.

- Concurrency: the ``concurrency`` connections are split over the processes (together never
  more); a request goes to the process with the fewest outstanding. ``waiting`` counts those
  beyond each process's share, as the in-process client counts requests waiting for a connection.
- A process that exits (killed, crashed) fails its outstanding requests with
  :class:`~kcloak.broker.upstream.UpstreamError` (each query is still answered exactly once, with
  ``upstream_error``) and is started again, after a pause that doubles while it keeps dying early.
  A request not answered within ``deadline_s`` + 1 s (a process that hangs) fails the same way.
- The children run in a session of their own (a terminal's Ctrl-C reaches only the broker, which
  drains its queries while they go on). Leaving the context stops them; when the broker is
  killed, each sees its input end and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import msgspec

from kcloak.broker.metrics import Metrics
from kcloak.broker.upstream import Candidate, SearchRequest, UpstreamClient, UpstreamError, configured
from kcloak.core.logs import log_event, setup_logging

if TYPE_CHECKING:
    from kcloak.broker.config import UpstreamConfig

log = logging.getLogger("kcloak.upstream")

MAX_FRAME = 64 * 1024 * 1024
"""A frame longer than this from a child means its stream is corrupt: the child is stopped."""
DEADLINE_GRACE_S = 1.0
"""A request still unanswered ``deadline_s`` + this long after it was handed over fails."""
SWEEP_S = 0.25
RESTART_PAUSES_S = (0.5, 30.0)
"""The pause before starting an exited process again: the first, and the most it doubles to."""
PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent dies."""
STOP_S = 5.0
"""How long a child told to stop may take before it is killed."""
EARLY_EXIT_S = 10.0
"""A process that exits sooner than this after its start makes the next pause twice as long."""

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def _frame(obj: Any) -> bytes:
    body = _encode(obj)
    return len(body).to_bytes(4, "big") + body


def _frames(buf: bytearray) -> list[Any]:
    """The complete frames at the start of ``buf`` (removed from it); ValueError if corrupt."""
    out: list[Any] = []
    at, end = 0, len(buf)
    view = memoryview(buf)
    try:
        while end - at >= 4:
            n = int.from_bytes(view[at : at + 4], "big")
            if n > MAX_FRAME:
                raise ValueError("frame too long")
            if end - at - 4 < n:
                break
            out.append(_decode(view[at + 4 : at + 4 + n]))
            at += 4 + n
    except msgspec.DecodeError:
        raise ValueError("undecodable frame") from None
    finally:
        view.release()
    del buf[:at]
    return out


def shares(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` connections split over ``processes`` (sizes differ by at most one)."""
    base, extra = divmod(concurrency, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


class _Child(asyncio.SubprocessProtocol):
    """One child process: its pipes, its outstanding requests and the frame not yet sent."""

    def __init__(self, owner: UpstreamProcesses, index: int, share: int) -> None:
        self.owner = owner
        self.index = index
        self.share = share
        self.transport: asyncio.SubprocessTransport | None = None
        self.stdin: asyncio.WriteTransport | None = None
        self.outstanding: set[int] = set()
        self.unsent: list[list[Any]] = []
        self.flush_scheduled = False
        self.started = 0.0
        self.alive = False
        self.exited: asyncio.Future[None] | None = None
        self._buf = bytearray()

    # -- asyncio.SubprocessProtocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # cast, not isinstance: uvloop's transports (KCLOAK_EVENT_LOOP=uvloop) are not asyncio's classes
        self.transport = cast(asyncio.SubprocessTransport, transport)
        self.stdin = cast(asyncio.WriteTransport, self.transport.get_pipe_transport(0))

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._buf += data
        try:
            frames = _frames(self._buf)
        except ValueError:
            log_event(log, "upstream_process_stream_corrupt", logging.ERROR, process=self.index)
            self.kill()
            return
        for frame in frames:
            self.owner._results(self, frame)

    def connection_lost(self, exc: Exception | None) -> None:
        """The process has exited and its pipes are read to the end (``process_exited`` can come
        before the last answers it wrote are read)."""
        self.alive = False
        code = self.transport.get_returncode() if self.transport is not None else None
        if self.exited is not None and not self.exited.done():
            self.exited.set_result(None)
        self.owner._exited(self, code)

    # -- sending ---------------------------------------------------------------------------
    def send(self, job: list[Any]) -> None:
        self.unsent.append(job)
        if not self.flush_scheduled and self.alive:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.unsent and self.stdin is not None and self.alive and not self.stdin.is_closing():
            jobs, self.unsent = self.unsent, []
            self.stdin.write(_frame(jobs))

    def kill(self) -> None:
        if self.transport is not None and self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.transport.kill()


class UpstreamProcesses:
    """The upstream client's policy, carried out by ``processes`` child processes (async context
    manager; the same ``search``, ``waiting`` and ``healthy`` as :class:`UpstreamClient`).

    Keyword arguments: those of :class:`UpstreamClient` (``url``, ``timeout_s``, ``retries``,
    ``deadline_s``, ``concurrency``, ``token``, ``metrics``), and ``processes`` (≥ 1, at most
    ``concurrency``).
    """

    def __init__(
        self,
        *,
        url: str,
        processes: int = 1,
        timeout_s: float = 2.0,
        retries: int = 2,
        deadline_s: float = 5.0,
        concurrency: int = 64,
        token: str | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        if not 1 <= processes <= concurrency:
            raise ValueError("processes: must be ≥ 1 and ≤ concurrency")
        self._settings = {
            "url": url,
            "timeout_s": timeout_s,
            "retries": retries,
            "deadline_s": deadline_s,
            "concurrency": 0,  # each child's share, set when it starts
            "token": token,
        }
        self.deadline_s = deadline_s
        self._metrics = metrics
        self._children = [_Child(self, i, share) for i, share in enumerate(shares(concurrency, processes))]
        self._jobs: dict[int, tuple[asyncio.Future[list[Candidate]], float, _Child]] = {}
        self._next_job = 0
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._pauses = [RESTART_PAUSES_S[0]] * processes
        self.healthy: bool | None = None
        self.restarts = 0
        self._waiting = 0

    @classmethod
    def from_config(cls, cfg: UpstreamConfig, *, metrics: Metrics | None = None) -> UpstreamProcesses:
        """The processes ``[upstream]`` configures (``processes`` ≥ 1)."""
        return cls(**configured(cfg), processes=cfg.processes, metrics=metrics)

    async def __aenter__(self) -> UpstreamProcesses:
        for child in self._children:
            await self._start(child)
        self._spawn(self._sweep())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop the children (their input closed, then SIGTERM; killed after :data:`STOP_S`): the
        broker has drained its queries before it gets here, and what is still unanswered fails, as
        the in-process client's searches fail when its pool closes."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        for child in self._children:
            if child.stdin is not None and not child.stdin.is_closing():
                child.stdin.close()
            if child.alive and child.transport is not None:
                with contextlib.suppress(ProcessLookupError):
                    child.transport.terminate()
        for child in self._children:
            if child.alive and child.exited is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(child.exited), STOP_S)
                except TimeoutError:
                    child.kill()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(child.exited), STOP_S)
            if child.transport is not None:
                child.transport.close()
        for job in list(self._jobs):
            self._fail(job, "the upstream client is closed")

    @property
    def pids(self) -> list[int]:
        """Process ids of the children running now."""
        return [c.transport.get_pid() for c in self._children if c.alive and c.transport is not None]

    # -- the client's interface ------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests beyond the processes' connections (the ``upstream`` queue)."""
        return self._waiting

    def _take(self, child: _Child, job: int) -> None:
        child.outstanding.add(job)
        if len(child.outstanding) > child.share:
            self._waiting += 1

    def _drop(self, child: _Child, job: int) -> None:
        if job in child.outstanding:
            if len(child.outstanding) > child.share:
                self._waiting -= 1
            child.outstanding.remove(job)

    async def search(self, request: SearchRequest) -> list[Candidate]:
        """Candidates for ``request``; raises :class:`UpstreamError` after the retry policy, or
        when the process holding it exits or does not answer in time."""
        child = min(self._children, key=_load)
        job = self._next_job
        self._next_job += 1
        future: asyncio.Future[list[Candidate]] = asyncio.get_running_loop().create_future()
        self._jobs[job] = (future, time.monotonic() + self.deadline_s + DEADLINE_GRACE_S, child)
        self._take(child, job)
        r = request
        child.send([job, r.kind, r.bbox, r.radius_m, r.n, r.category, r.t_start, r.t_end])
        try:
            return await future
        finally:
            if job in self._jobs:  # cancelled: the child's late answer is dropped
                del self._jobs[job]
                self._drop(child, job)

    # -- the children's answers ------------------------------------------------------------
    def _results(self, child: _Child, frame: Any) -> None:
        ok, failed, attempts, retries = frame
        metrics = self._metrics
        if metrics is not None:
            seconds = metrics.upstream_seconds
            for outcome, s in attempts:
                seconds.labels(outcome=outcome).observe(s)
            if retries:
                metrics.upstream_retries.inc(retries)
        jobs = self._jobs
        for job, rows in ok:
            entry = jobs.pop(job, None)
            self._drop(child, job)
            if entry is not None and not entry[0].done():
                entry[0].set_result([Candidate(*row) for row in rows])
        for job, message in failed:
            self._drop(child, job)
            self._fail(job, message)
        if ok:
            self.healthy = True
        elif failed:
            self.healthy = False

    def _fail(self, job: int, message: str) -> None:
        entry = self._jobs.pop(job, None)
        if entry is None:
            return
        future, _, child = entry
        self._drop(child, job)
        if not future.done():
            future.set_exception(UpstreamError(message))

    def _exited(self, child: _Child, code: int | None) -> None:
        for job in list(child.outstanding):
            self._fail(job, "the upstream process exited")
        if self._closing:
            return
        self.healthy = False
        lived = time.monotonic() - child.started
        pause = self._pauses[child.index]
        self._pauses[child.index] = min(pause * 2, RESTART_PAUSES_S[1]) if lived < EARLY_EXIT_S else RESTART_PAUSES_S[0]
        log_event(log, "upstream_process_exited", logging.WARNING, process=child.index, code=code, restart_in_s=pause)
        # Requests go to the other processes meanwhile; with none left they wait for this one.
        self._spawn(self._restart(child, pause))

    async def _restart(self, child: _Child, pause: float) -> None:
        await asyncio.sleep(pause)
        if child.transport is not None:
            child.transport.close()
        self.restarts += 1
        try:
            await self._start(child)
        except OSError:
            log_event(log, "upstream_process_start_failed", logging.ERROR, process=child.index)
            self._exited(child, None)

    async def _start(self, child: _Child) -> None:
        loop = asyncio.get_running_loop()
        child.exited = loop.create_future()
        child.started = time.monotonic()
        await loop.subprocess_exec(
            lambda: child,
            *child_command(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,
            start_new_session=True,
        )
        child.alive = True
        assert child.stdin is not None
        child.stdin.write(_frame({**self._settings, "concurrency": child.share}))
        child.flush()  # what queued while it was down

    async def _sweep(self) -> None:
        """Fail the requests a process has held past their deadline (a hung process)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            late = []
            for job, (_, deadline, _) in self._jobs.items():
                if deadline > now:
                    break  # handed over in order, all with the same deadline
                late.append(job)
            for job in late:
                self._fail(job, "deadline")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def child_command() -> list[str]:
    """This interpreter in isolated mode, as every child kcloak starts (docs/architecture.md):
    nothing from the working folder or ``PYTHONPATH`` can shadow kcloak."""
    return [sys.executable, "-I", "-m", "kcloak.broker.upstream_processes", str(os.getpid())]


def _load(child: _Child) -> tuple[bool, int]:
    return (not child.alive, len(child.outstanding))


# -- the child process -------------------------------------------------------------------------


class _Input(asyncio.Protocol):
    def __init__(self, on_frame: Callable[[Any], None], on_end: Callable[[], None]) -> None:
        self._buf = bytearray()
        self._on_frame = on_frame
        self._on_end = on_end

    def data_received(self, data: bytes) -> None:
        self._buf += data
        for frame in _frames(self._buf):
            self._on_frame(frame)

    def eof_received(self) -> bool:
        self._on_end()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_end()


class _ChildSide:
    """Runs in the child: reads requests, answers each as its search ends (one frame per turn)."""

    def __init__(self, out: asyncio.WriteTransport) -> None:
        self.out = out
        self.client: UpstreamClient | None = None
        self.ok: list[Any] = []
        self.failed: list[Any] = []
        self.attempts: list[Any] = []
        self.retries = 0
        self.scheduled = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.ended = asyncio.get_running_loop().create_future()
        self.settings: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.ready = asyncio.Event()
        """Set once the client is entered (requests may arrive in the settings' own read)."""

    def frame(self, frame: Any) -> None:
        if not self.settings.done():
            self.settings.set_result(frame)
            return
        loop = asyncio.get_running_loop()
        for job in frame:
            task = loop.create_task(self.run(job))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def end(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)
        if not self.settings.done():
            self.settings.cancel()

    async def run(self, job: list[Any]) -> None:
        await self.ready.wait()
        assert self.client is not None
        job_id, kind, bbox, radius_m, n, category, t_start, t_end = job
        request = SearchRequest(kind, bbox, radius_m, n, category, t_start, t_end)
        try:
            found = await self.client.search(request)
        except UpstreamError as exc:
            self.failed.append((job_id, str(exc)))
        except Exception as exc:  # a defect must not leave the query unanswered
            log_event(log, "upstream_process_error", logging.ERROR, error=type(exc).__name__)
            self.failed.append((job_id, "internal"))
        else:
            self.ok.append((job_id, [(c.poi_id, c.lat, c.lon, c.category, c.name) for c in found]))
        self.schedule()

    def attempt(self, outcome: str, seconds: float) -> None:
        self.attempts.append((outcome, seconds))
        self.schedule()

    def retry(self) -> None:
        self.retries += 1

    def schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        if self.ok or self.failed or self.attempts or self.retries:
            frame = (self.ok, self.failed, self.attempts, self.retries)
            self.ok, self.failed, self.attempts, self.retries = [], [], [], 0
            if not self.out.is_closing():
                self.out.write(_frame(frame))


async def _child_main(out_fd: int) -> None:
    loop = asyncio.get_running_loop()
    out, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, os.fdopen(out_fd, "wb", buffering=0))
    side = _ChildSide(out)
    await loop.connect_read_pipe(lambda: _Input(side.frame, side.end), os.fdopen(0, "rb", buffering=0))
    try:
        settings = await side.settings
    except asyncio.CancelledError:
        return  # input closed before the settings: nothing to do
    client = UpstreamClient(**settings, on_attempt=side.attempt, on_retry=side.retry)
    async with client:
        side.client = client
        side.ready.set()
        await side.ended  # input closed: the broker waits for nothing more
        for task in list(side.tasks):
            task.cancel()
        if side.tasks:
            await asyncio.wait(set(side.tasks))
    out.close()


def _die_with(parent: int) -> None:
    """On Linux the kernel kills this process when the broker dies (``PR_SET_PDEATHSIG``): at
    once, even while it is busy; elsewhere, or if that fails, the end of its input ends it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the broker died before the line above
        os._exit(0)


def child_main() -> None:
    """The child's entry point (``python -m kcloak.broker.upstream_processes BROKER_PID``): frames on a private
    copy of standard output, whose descriptor then points at standard error, so that no stray
    write can corrupt the stream."""
    if len(sys.argv) > 1:
        _die_with(int(sys.argv[1]))
    out_fd = os.dup(1)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the broker decides when this process ends
    setup_logging("warning")
    asyncio.run(_child_main(out_fd))


if __name__ == "__main__":
    child_main()
