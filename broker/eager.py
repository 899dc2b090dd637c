"""Tasks whose coroutine takes its first step at once, in the caller's turn of the event loop.

``loop.create_task`` queues a coroutine's first step behind every callback the loop has already
queued, so a query read from a socket starts only in the loop's next pass: under load that wait
was a third of a query's added latency at the p99 (docs/mqtt.md "Eleventh run"). Python 3.12's
eager tasks (``eager_start``, ``asyncio.eager_task_factory``) run the first step inside the call
instead; Python 3.11 has neither, so :func:`eager_task` does what they do for a coroutine started
from a callback (an MQTT connection's ``data_received``): the first step runs now, with the new
task as the loop's current task (``asyncio.timeout`` and ``current_task`` work in it) and in the
task's own copy of the context; from its first suspension on, the task drives the coroutine as
``asyncio.Task`` would (the future it waits for, cancellation passed on to that future or thrown
into the coroutine). Called while a task is running (an aiohttp handler), it is ``create_task``.
"""

from __future__ import annotations

import asyncio
import contextvars
from asyncio.tasks import _enter_task, _leave_task  # as 3.12's eager start does; present in 3.11
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def eager_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task running ``coro``, whose first step has run when this returns (none has when a task
    is running: then it is ``loop.create_task(coro)``)."""
    loop = asyncio.get_running_loop()
    if asyncio.current_task(loop) is not None:
        return loop.create_task(coro)
    drive = _drive(coro)
    context = contextvars.copy_context()
    task = loop.create_task(drive, context=context)
    _enter_task(loop, task)
    try:
        context.run(drive.send, None)  # the first step; stops at the hand-over, never raises
    finally:
        _leave_task(loop, task)
    return task


async def _drive(coro: Coroutine[Any, Any, T]) -> T:
    """Take ``coro``'s first step (in :func:`eager_task`'s call), hand over to the task, then wait
    for what the coroutine waits for and resume it, until it ends."""
    yielded: Any = None
    value: T | None = None
    finished = False
    error: BaseException | None = None
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        finished, value = True, stop.value
    except BaseException as exc:  # the task ends with it, in its first turn
        error = exc
    thrown: BaseException | None = None
    try:
        await asyncio.sleep(0)  # a bare yield: eager_task's call returns; the task's first turn resumes here
    except asyncio.CancelledError as exc:  # cancelled before its first turn: as if while waiting
        thrown = exc
    if error is not None:
        raise error
    if finished:
        return value  # type: ignore[return-value]  # T, returned by the first step
    if thrown is not None and asyncio.isfuture(yielded) and yielded.cancel():
        thrown = None  # the future it waits for is cancelled, as asyncio.Task.cancel does
    while True:
        if thrown is None:
            if yielded is None:  # a bare yield (asyncio.sleep(0)): one turn of the loop
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError as exc:
                    thrown = exc
            elif asyncio.isfuture(yielded):
                yielded._asyncio_future_blocking = False
                try:
                    await yielded
                except asyncio.CancelledError as exc:
                    if not yielded.cancelled():  # this task was cancelled, not the future it waited for
                        thrown = exc
                except BaseException:  # the coroutine reads the future's outcome itself
                    pass
            else:
                thrown = RuntimeError(f"eager task got a bad yield: {yielded!r}")
        try:
            yielded = coro.send(None) if thrown is None else coro.throw(thrown)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        thrown = None


__all__ = ["eager_task"]
