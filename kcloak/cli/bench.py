"""``kcloak bench``: one group command whose benchmarks are modules of their own (contract §9).

This module creates the ``bench`` parser once; each module in :data:`BENCHMARKS` adds its
benchmark with ``add_parser(bench)``, ``bench`` being the group's sub-subcommand action.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kcloak.cli.main import SubParsers

BENCHMARKS: tuple[str, ...] = (
    "bench_cloak",
    "bench_lbs",
    "bench_broker",
    "bench_anonymize",
    "bench_simulate",
    "bench_release",
    "bench_cluster",
    "bench_soak",
)
"""Modules of :mod:`kcloak.cli` that add one benchmark each, in the order ``kcloak bench --help`` lists them."""


def add_parser(subparsers: SubParsers) -> None:
    """Add ``bench`` and every benchmark of :data:`BENCHMARKS` under it."""
    group = subparsers.add_parser(
        "bench",
        help="benchmarks: cloak, broker, lbs, anonymize, simulate, release, cluster, soak",
        description="Benchmarks. Each prints a readable table, or with --json exactly one JSON "
        'object {"bench": NAME, "results": [...]} on stdout; progress goes to stderr.',
    )
    bench = group.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHMARKS:
        importlib.import_module(f"kcloak.cli.{name}").add_parser(bench)
