"""The ``kcloak`` command line (contract §9): thin parsing, work done by the owning package.

Each subcommand module exposes ``add_parser(subparsers)``; the parser's ``func`` default is a
callable taking the parsed namespace and returning the exit code. Exit codes: 0 success,
1 runtime failure, 2 usage or bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kcloak import __version__

# Modules that contribute subcommands, in the order ``--help`` lists them.
_COMMAND_MODULES: tuple[str, ...] = (
    "kcloak.cli.serve",
    "kcloak.broker.mosquitto",
    "kcloak.cli.bench_cloak",
    "kcloak.cli.lbs",
    "kcloak.cli.bench_lbs",
    "kcloak.cli.bench_broker",
    "kcloak.cli.anonymize",
    "kcloak.cli.bench_anonymize",
    "kcloak.cli.audit",
    "kcloak.cli.demo",
    "kcloak.cli.simulate",
    "kcloak.cli.release",
    "kcloak.cli.bench_release",
)


class UsageError(Exception):
    """Bad input detected after parsing (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kcloak",
        description=(
            "kcloak: a trusted anonymizer between mobile apps and location-based services. "
            "It cloaks each query into a region shared with at least k users before anything "
            "reaches the provider, and publishes movement data only in anonymized form."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kcloak {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    _tag_subparsers(parser)
    return parser


def _tag_subparsers(parser: argparse.ArgumentParser) -> None:
    """Let every (sub)command's namespace name its parser, so usage errors show that command's usage."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(_kcloak_parser=child)
                _tag_subparsers(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # "kcloak simulate: error: unrecognized arguments: …" with simulate's usage, exit 2
        owner: argparse.ArgumentParser = getattr(args, "_kcloak_parser", parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code: int = args.func(args)
    except UsageError as exc:
        print(f"kcloak: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kcloak: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    # Under ``python -m kcloak.cli.main`` this file runs as ``__main__``, a second copy beside the
    # ``kcloak.cli.main`` the subcommands import: run the canonical one, so that its UsageError is caught.
    from kcloak.cli.main import main as canonical_main

    raise SystemExit(canonical_main())
