"""The ``kcloak`` command line (contract §9): thin parsing, work done by the owning package.

Each subcommand has one module in :mod:`kcloak.cli` (listed in :data:`COMMANDS`) exposing
``add_parser(subparsers)``; ``bench`` is one group module (:mod:`kcloak.cli.bench`) whose
benchmarks are modules of their own. A parser's ``func`` default is a callable taking the parsed
namespace and returning the exit code. Exceptions that reach :func:`main` are mapped to exit codes
by one table, :data:`EXIT_CODES`. Command modules import only argparse-level code at the top
(``kcloak --help`` stays fast); the work, numpy and the algorithms are imported inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from kcloak import __version__
from kcloak.core.errors import InputError, KcloakError

COMMANDS: tuple[str, ...] = (
    "serve",
    "cells",
    "mosquitto_config",
    "bench",
    "lbs",
    "anonymize",
    "audit",
    "demo",
    "simulate",
    "replay",
    "load",
    "release",
    "cluster",
)
"""Modules of :mod:`kcloak.cli` that add one subcommand each, in the order ``kcloak --help`` lists them."""


class UsageError(InputError):
    """Bad input detected after parsing (exit 2)."""


EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (KeyboardInterrupt, 130),  # interrupted (Ctrl-C)
    (InputError, 2),  # usage or bad input: UsageError and every package's input errors
    (KcloakError, 1),  # any other failure kcloak reports: runtime failure
)
"""Exception roots → exit codes, first match wins (0 success; argparse's own errors also exit 2)."""


def exit_code(exc: BaseException) -> int | None:
    """The exit code of ``exc`` from :data:`EXIT_CODES`, or ``None`` when no root matches."""
    for root, code in EXIT_CODES:
        if isinstance(exc, root):
            return code
    return None


class SubParsers(Protocol):
    """What a command module uses of ``add_subparsers()``'s result: ``add_parser``."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class CommandParser(argparse.ArgumentParser):
    """A (sub)command's parser that records itself in the namespace it fills, so that usage errors
    found after parsing show that command's usage (the innermost command's parser wins)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(_kcloak_parser=self)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kcloak",
        description=(
            "kcloak: a trusted anonymizer between mobile apps and location-based services. "
            "It cloaks each query into a region shared with at least k users before anything "
            "reaches the provider, and publishes movement data only in anonymized form."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kcloak {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"kcloak.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # "kcloak simulate: error: unrecognized arguments: …" with simulate's usage, exit 2
        owner: argparse.ArgumentParser = getattr(args, "_kcloak_parser", parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code: int = args.func(args)
    except (KeyboardInterrupt, KcloakError) as exc:
        mapped = exit_code(exc)
        if mapped is None:  # pragma: no cover - every root above is in the table
            raise
        print("kcloak: interrupted" if mapped == 130 else f"kcloak: error: {exc}", file=sys.stderr)
        return mapped
    return code
