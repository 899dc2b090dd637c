"""``eager_task``: the first step runs inside the call; from then on the task behaves as
``asyncio.Task`` does. The reference is asyncio's own task: every program below runs once under
``loop.create_task`` and once under ``eager_task``, and must see the same things."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.broker.eager import eager_task

# A step of a program: wait for a future the driver then resolves ("ok"), fails ("error") or
# cancels ("cancel_future"); cancel the task while it waits ("cancel_task"); or a bare yield.
STEPS = st.sampled_from(["ok", "error", "cancel_future", "cancel_task", "sleep0"])


class Boom(Exception):
    pass


async def _program(steps: list[str], waiting: list[asyncio.Future[int]], seen: list[str], ret: str) -> str:
    """Run ``steps`` and note what each await gave; ``ret`` decides how it ends."""
    loop = asyncio.get_running_loop()
    seen.append("start")
    for i, step in enumerate(steps):
        try:
            if step == "sleep0":
                await asyncio.sleep(0)
                seen.append(f"{i}:slept")
                continue
            fut: asyncio.Future[int] = loop.create_future()
            waiting.append(fut)
            seen.append(f"{i}:got {await fut}")
        except asyncio.CancelledError:
            seen.append(f"{i}:cancelled")
        except Boom:
            seen.append(f"{i}:boom")
    if ret == "raise":
        raise Boom("end")
    return "done"


async def _run(factory: str, steps: list[str], ret: str) -> tuple[list[str], str, list[str]]:
    """The program under one task factory, driven from outside; (what it saw, how the task ended,
    what it had seen when the factory returned)."""
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[int]] = []
    seen: list[str] = []
    coro = _program(steps, waiting, seen, ret)
    holder: list[asyncio.Task[str]] = []

    def start() -> None:  # from a callback, as the MQTT door starts queries: no task is running
        holder.append(eager_task(coro) if factory == "eager" else loop.create_task(coro))

    loop.call_soon(start)
    while not holder:
        await asyncio.sleep(0)
    at_return = list(seen)
    task = holder[0]
    handled = 0
    waits = [s for s in steps if s != "sleep0"]
    for _ in range(200):
        if task.done():
            break
        if handled < len(waiting):
            fut, how = waiting[handled], waits[handled]
            handled += 1
            if how == "ok":
                fut.set_result(handled)
            elif how == "error":
                fut.set_exception(Boom())
            elif how == "cancel_future":
                fut.cancel()
            else:
                task.cancel()
        await asyncio.sleep(0)
    assert task.done()
    if task.cancelled():
        end = "cancelled"
    elif task.exception() is not None:
        end = f"raised {type(task.exception()).__name__}"
    else:
        end = f"returned {task.result()}"
    return seen, end, at_return


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(STEPS, max_size=6), ret=st.sampled_from(["return", "raise"]))
def test_a_program_sees_the_same_under_an_eager_task_and_asyncio_task(steps: list[str], ret: str) -> None:
    plain = asyncio.run(_run("plain", steps, ret))
    eager = asyncio.run(_run("eager", steps, ret))
    assert eager[:2] == plain[:2]
    assert plain[2] == []  # asyncio's task has not begun when create_task returns
    assert eager[2] == ["start"]  # the eager one has run up to its first wait (a bare yield too)


def test_the_first_step_runs_inside_the_call_with_the_task_current() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list[Any] = []

        async def body() -> str:
            me = asyncio.current_task()
            seen.append(me)
            async with asyncio.timeout(5):  # needs a current task
                seen.append("in timeout")
            await asyncio.sleep(0)
            assert asyncio.current_task() is me
            return "ok"

        holder: list[asyncio.Task[str]] = []

        def start() -> None:
            holder.append(eager_task(body()))
            seen.append("returned")

        loop.call_soon(start)
        while not holder:
            await asyncio.sleep(0)
        task = holder[0]
        assert seen == [task, "in timeout", "returned"]
        assert await task == "ok"
        assert asyncio.current_task() is not task

    asyncio.run(main())


def test_a_coroutine_that_never_waits_is_a_done_task_in_the_next_turn() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def body() -> int:
            return 7

        async def fails() -> int:
            raise Boom("first step")

        holder: list[asyncio.Task[int]] = []
        loop.call_soon(lambda: holder.extend([eager_task(body()), eager_task(fails())]))
        while len(holder) < 2:
            await asyncio.sleep(0)
        assert await holder[0] == 7
        with pytest.raises(Boom, match="first step"):
            await holder[1]

    asyncio.run(main())


def test_the_first_step_runs_in_the_tasks_own_context() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="caller")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list[str] = []

        async def body() -> None:
            var.set("task")
            await asyncio.sleep(0)
            seen.append(var.get())

        holder: list[asyncio.Task[None]] = []

        def start() -> None:
            holder.append(eager_task(body()))
            seen.append(var.get())  # the caller's context is untouched by the first step

        loop.call_soon(start)
        while not holder:
            await asyncio.sleep(0)
        await holder[0]
        assert seen == ["caller", "task"]

    asyncio.run(main())


def test_inside_a_running_task_it_is_an_ordinary_task() -> None:
    async def main() -> None:
        seen: list[str] = []

        async def body() -> None:
            seen.append("began")

        task = eager_task(body())  # called from main's task: the first step waits its turn
        assert seen == []
        await task
        assert seen == ["began"]

    asyncio.run(main())


def test_cancelled_before_its_first_turn_the_coroutine_sees_the_cancellation() -> None:
    """Cancelled right after the eager first step, before the task's first turn: the coroutine gets
    the cancellation at the await it stopped at (and may answer it), as with asyncio's own task
    cancelled while waiting."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list[str] = []
        waited: list[asyncio.Future[None]] = []

        async def body() -> str:
            fut: asyncio.Future[None] = loop.create_future()
            waited.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                seen.append("cancelled at its await")
                return "answered"
            return "not cancelled"

        holder: list[asyncio.Task[str]] = []

        def start() -> None:
            holder.append(eager_task(body()))
            holder[0].cancel()

        loop.call_soon(start)
        while not holder:
            await asyncio.sleep(0)
        assert await holder[0] == "answered"
        assert seen == ["cancelled at its await"]
        assert waited[0].cancelled()

    asyncio.run(main())
