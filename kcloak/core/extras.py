"""Optional parts of kcloak (the package's extras) and the one-line hint when one is missing.

``pip install kcloak`` serves, cloaks, simulates, anonymizes and releases. What only some users need
comes with an extra of the package (``[project.optional-dependencies]`` in ``pyproject.toml``):

- ``report``: pictures (matplotlib): the demo's map and distributions, ``kcloak audit --report``'s
  figures, ``kcloak bench anonymize --plot``;
- ``cluster``: kcloak on NATS JetStream and Dask (``kcloak cluster``, ``kcloak serve --cluster``).

Code that needs an extra imports its module through :func:`require`, which raises
:class:`MissingExtra` with the install command when it is absent; the command line prints it as one
line, ``kcloak: error: pictures need the report extra: pip install 'kcloak[report]'``, and exits 1
(``kcloak.cli.main.EXIT_CODES``: the installation lacks a part, the input was fine).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from kcloak.core.errors import CoreError


class MissingExtra(CoreError, ImportError):
    """A module of an extra is not installed; the message says what needs it and how to install it."""

    def __init__(self, purpose: str, extra: str) -> None:
        super().__init__(hint(purpose, extra))
        self.purpose = purpose
        self.extra = extra


def hint(purpose: str, extra: str) -> str:
    """``"pictures need the report extra: pip install 'kcloak[report]'"``."""
    return f"{purpose} need the {extra} extra: pip install 'kcloak[{extra}]'"


def require(module: str, *, extra: str, purpose: str) -> ModuleType:
    """``module`` imported, or :class:`MissingExtra` naming ``extra`` (``purpose`` says what needs it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(purpose, extra) from None


def available(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path), without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


PICTURES = "pictures"
REPORT = "report"
CLUSTER = "cluster"


def require_pictures() -> ModuleType:
    """matplotlib (set to its Agg canvas, no display needed), or :class:`MissingExtra` for the ``report`` extra."""
    matplotlib = require("matplotlib", extra=REPORT, purpose=PICTURES)
    matplotlib.use("Agg")
    return matplotlib


def pictures_available() -> bool:
    """Whether the ``report`` extra (matplotlib) is installed."""
    return available("matplotlib")


__all__ = [
    "CLUSTER",
    "PICTURES",
    "REPORT",
    "MissingExtra",
    "available",
    "hint",
    "pictures_available",
    "require",
    "require_pictures",
]
