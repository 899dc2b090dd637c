"""Stopping a long command gracefully: SIGINT (Ctrl-C) or SIGTERM (``kill``, a service manager) sets an event
that the command's work watches, so it ends its run early and still reports; a second Ctrl-C more than a second
later interrupts at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator


@contextlib.contextmanager
def signals_stop(stop: asyncio.Event) -> Iterator[None]:
    """Within the running loop: SIGINT/SIGTERM set ``stop``; another SIGINT a second later raises
    :class:`KeyboardInterrupt`. Where the loop cannot take signal handlers (not the main thread), nothing changes."""
    loop = asyncio.get_running_loop()
    first_t: list[float] = []

    def on_signal() -> None:
        if not first_t:
            first_t.append(time.monotonic())
            stop.set()
        elif time.monotonic() - first_t[0] > 1.0:
            raise KeyboardInterrupt

    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
