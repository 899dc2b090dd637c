"""``kcloak cells``: the cell boundaries of a cluster (docs/cluster.md "Cells"), as a kcloak.cells/1 file.

The Hilbert curve is cut so that each of ``C`` cells holds about as many users of a population sample:
a trajectory file (one position per trajectory, its latest fix) or the simulator's users
(``--from-simulator N``: their start positions under ``--model``). The file is public configuration
(density at the resolution of C cells, nothing about any user); give the same file to every
``kcloak serve --cluster … --cells FILE``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kcloak.cli.main import SubParsers, UsageError


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser(
        "cells",
        help="cut the service area into population-balanced cells for kcloak serve --cluster",
        description=(
            "Write the cell boundaries of a kcloak cluster (kcloak.cells/1 JSON): the Hilbert curve of "
            "the hilbert cloaker cut into C cells holding equally many users of a population sample. "
            "Sample: --from-sample FILE (contract CSV, GeoLife, GPX or AIS; one position per trajectory, "
            "its latest fix) or --from-simulator N (N simulated users' start positions)."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-sample", type=Path, metavar="FILE", help="trajectory file or GeoLife folder")
    src.add_argument("--from-simulator", type=int, metavar="N", help="N users of the mobility simulator")
    p.add_argument("--format", default=None, metavar="NAME", help="input format of --from-sample (detected)")
    p.add_argument("--model", default="street", metavar="NAME", help="simulator model: street, waypoint, hotspot")
    p.add_argument("--seed", type=int, default=0, help="simulator seed (0)")
    p.add_argument(
        "--cells", type=int, required=True, metavar="C", help="number of cells (every worker's --cells file)"
    )
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the JSON ('-': stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from kcloak.cloaking.cells import CellMap

    if args.cells < 1:
        raise UsageError("--cells: must be at least 1")
    if args.from_sample is not None:
        from kcloak.core.readers import read_fixes

        table = read_fixes(args.from_sample, args.format)
        if len(table) == 0:
            raise UsageError("--from-sample: no readable fix in the file")
        ordered = table.sorted()
        last = np.ones(len(ordered), dtype=bool)
        last[:-1] = ordered.traj_id[1:] != ordered.traj_id[:-1]  # each trajectory's latest fix
        lat, lon = ordered.lat[last], ordered.lon[last]
    else:
        from kcloak.simulators.bench import build_model

        if args.from_simulator < 1:
            raise UsageError("--from-simulator: must be at least 1 user")
        try:
            model = build_model(args.model, args.from_simulator, seed=args.seed)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        lat, lon = model.positions()
    cells = CellMap.balanced(lat, lon, cells=args.cells)
    text = cells.to_json()
    if str(args.out) == "-":
        sys.stdout.write(text + "\n")
    else:
        args.out.write_text(text + "\n", encoding="utf-8")
        summary = {"cells": cells.cells, "sample_users": len(lat), "out": str(args.out)}
        print(json.dumps(summary))
    return 0
