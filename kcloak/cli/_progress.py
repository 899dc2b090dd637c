"""The command line's progress display on stderr (``rich``), shared by the subcommands.

Library code below the command line reports progress through plain callbacks or the
:class:`kcloak.cloaking.bench.Progress` protocol; only this layer draws it.
"""

from __future__ import annotations

from collections.abc import Iterator
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


def rich_bar() -> RichProgressBar:
    """The commands' progress bar on stderr (description, bar, done/total, elapsed), gone when done."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as RichProgressBar

    return RichProgressBar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


@contextmanager
def phase_progress(show: bool) -> Iterator[Progress]:
    """A :class:`kcloak.cloaking.bench.Progress` drawn on stderr when ``show``, else one that shows nothing."""
    from kcloak.cloaking.bench import NullProgress

    if not show:
        yield NullProgress()
        return
    with rich_bar() as bar:
        yield RichProgress(bar)
