"""The command line's progress display on stderr (``rich``), shared by the subcommands.

Library code below the command line reports progress through plain callbacks or the
:class:`kcloak.cloaking.bench.Progress` protocol; only this layer draws it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgressBar

    from kcloak.cloaking.bench import Progress


class RichProgress:
    """:class:`kcloak.cloaking.bench.Progress` drawn with ``rich`` on stderr, one bar per phase."""

    def __init__(self, bar: RichProgressBar) -> None:
        self._bar = bar
        self._task: Any = None

    def phase(self, description: str, total: int) -> None:
        if self._task is not None:
            self._bar.update(self._task, visible=False)
        self._task = self._bar.add_task(description, total=total)

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)


PLAIN_PERIOD_S = 10.0
"""Off a terminal, a progress line at most this often (besides each phase's first and last)."""


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class PlainProgress:
    """:class:`kcloak.cloaking.bench.Progress` as plain lines on stderr, for logs and pipes: a line when a
    phase starts, every :data:`PLAIN_PERIOD_S` seconds (done/total, elapsed, time left at the pace so far)
    and when it ends."""

    def __init__(self, write: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self._write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self._clock = clock
        self._description = ""
        self._total = 0
        self._done = 0
        self._t0 = self._last = 0.0

    def phase(self, description: str, total: int) -> None:
        self._description, self._total, self._done = description, total, 0
        self._t0 = self._last = self._clock()
        self._write(f"{description}: started ({total} steps)")

    def advance(self, n: int) -> None:
        self._done += n
        now = self._clock()
        elapsed = now - self._t0
        if self._done >= self._total:
            self._write(f"{self._description}: done in {_duration(elapsed)}")
        elif now - self._last >= PLAIN_PERIOD_S:
            self._last = now
            left = elapsed / self._done * (self._total - self._done) if self._done else None
            eta = f", about {_duration(left)} left" if left is not None else ""
            pct = self._done / self._total if self._total else 0.0
            self._write(f"{self._description}: {self._done}/{self._total} ({pct:.0%}), {_duration(elapsed)}{eta}")


def rich_bar() -> RichProgressBar:
    """The commands' progress bar on stderr (description, bar, done/total, elapsed, time left), gone when done."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as RichProgressBar

    return RichProgressBar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


@contextmanager
def phase_progress(show: bool) -> Iterator[Progress]:
    """A :class:`kcloak.cloaking.bench.Progress` on stderr when ``show``: a ``rich`` bar on a terminal, else
    :class:`PlainProgress` lines; one that shows nothing when not ``show``."""
    from kcloak.cloaking.bench import NullProgress

    if not show:
        yield NullProgress()
        return
    if not sys.stderr.isatty():
        yield PlainProgress()
        return
    with rich_bar() as bar:
        yield RichProgress(bar)
