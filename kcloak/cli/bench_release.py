"""``kcloak bench release`` (contract §9; CONCEPTS §8.15, §9.9): table releases on real traces.

Builds trips, staypoints and places from a real trace (T-Drive by default, else the GeoLife
sample), releases each with every applicable algorithm at each k, and reports information loss
and runtime. ``acd_vs_aa`` compares ACD with AA on ``places`` against S002's claim (ACD's NCP
about ½–⅓ of AA's at 20–40 % more time): ``ncp_ratio`` = ACD NCP / AA NCP (mean over k),
``time_ratio`` = ACD time / AA time (CPU time summed over k), ``holds`` = ``ncp_ratio ≤ ½`` and
``time_ratio ≤ 1.4``. Mondrian also runs on ``--mondrian-rows`` synthetic trips (target:
1,000,000 rows in ≤ 60 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcloak.cli._progress import rich_bar
from kcloak.cli.main import UsageError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from kcloak.cli.main import SubParsers
    from kcloak.streams.tables import Table, TableKind

# Heavy modules (numpy, rich, the algorithms) are imported inside the functions, so that building
# the ``kcloak`` parser stays fast.

RESEARCH = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "research"
DEFAULT_DATA = (RESEARCH / "tdrive_beijing_20080202_1600-1630.csv.gz", RESEARCH / "geolife_sample")
"""Default traces, first present wins: T-Drive (30 minutes of Beijing taxis), then the GeoLife sample."""

NCP_CLAIM = 0.5
"""S002 §4: ACD's NCP is ½ to ⅓ of AA's (at most half counts as holding)."""
TIME_CLAIM = 1.4
"""S002 §4: ACD needs 20–40 % more time than AA."""
MONDRIAN_TARGET_S = 60.0


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One ``results`` row (contract §9 ``release``), plus ``status`` (``ok`` | ``unsatisfiable``) and ``cpu_s``."""

    table: str
    algorithm: str
    k: int
    rows: int
    runtime_s: float
    ncp: float | None
    discernibility: float | None
    suppressed_rows: int | None
    status: str = "ok"
    cpu_s: float | None = None
    """Process CPU time of the run: steadier than ``runtime_s`` on a loaded machine."""


def default_data() -> Path | None:
    return next((p for p in DEFAULT_DATA if p.exists()), None)


def _csv_list(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise UsageError(f"{flag}: give a comma-separated list")
    return items


def _ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in _csv_list(text, "--k")]
    except ValueError:
        raise UsageError("--k: must be comma-separated integers ≥ 1") from None
    if any(k < 1 for k in ks):
        raise UsageError("--k: must be comma-separated integers ≥ 1")
    return ks


def add_parser(bench: SubParsers) -> None:
    """Add ``bench release`` to the ``bench`` group."""
    p = bench.add_parser(
        "release",
        help="table releases on real traces: information loss and runtime; ACD vs AA; Mondrian at scale",
        description=(
            "Build trips, staypoints and places tables from a real trace and release each with every applicable "
            "algorithm at each k. Reports NCP, discernibility, suppressed rows and runtime, ACD against AA "
            "(S002's claim) and Mondrian on synthetic rows. "
            'JSON: {"bench": "release", "results": [{table, algorithm, k, rows, runtime_s, ncp, discernibility, '
            'suppressed_rows, status, cpu_s}, ...], "acd_vs_aa": {ncp_ratio, time_ratio, holds, ...}, ...}. '
            "Exit codes: 0 done (unsatisfiable releases are rows with status unsatisfiable), 2 bad flags or "
            "an unreadable or empty trace."
        ),
    )
    p.add_argument("--data", default=None, metavar="CSV", help="trace (default: T-Drive research file, else GeoLife)")
    p.add_argument("--tables", default="trips,staypoints,places", metavar="T,…", help="(trips,staypoints,places)")
    p.add_argument(
        "--algorithms", default=None, metavar="A,…", help="(mondrian for tables; acd,aa for places; others skipped)"
    )
    p.add_argument("--k", dest="ks", default="5,10,20", metavar="K,…", help="(5,10,20)")
    p.add_argument("--m", type=int, default=2, metavar="M", help="places: attacker knows ≤ M items (2)")
    p.add_argument(
        "--mondrian-rows",
        type=int,
        default=1_000_000,
        metavar="N",
        help="synthetic Mondrian rows, 0 skips (1000000)",
    )
    p.add_argument("--seed", type=int, default=1, metavar="N", help="seed of releases and synthetic rows (1)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


@contextmanager
def _bar(enabled: bool, total: int) -> Iterator[tuple[Progress | None, Any]]:
    if not enabled:
        yield None, None
        return
    with rich_bar() as bar:
        yield bar, bar.add_task("bench release", total=total)


def _plan(tables: Sequence[TableKind], algorithms: Sequence[str] | None) -> list[tuple[TableKind, str]]:
    from kcloak.cloaking.tabular import ALGORITHMS
    from kcloak.streams.release import KM_ALGORITHMS
    from kcloak.streams.tables import TableKind

    plan = []
    for t in tables:
        if t is TableKind.PLACES:
            algos = [a for a in (algorithms or KM_ALGORITHMS) if a in KM_ALGORITHMS]
        else:
            algos = [a for a in (algorithms or ["mondrian"]) if a in ALGORITHMS and a != "anatomy"]
        plan += [(t, a) for a in algos]
    return plan


def run_release_rows(
    tables: dict[TableKind, Table],
    plan: Sequence[tuple[TableKind, str]],
    ks: Sequence[int],
    m: int,
    seed: int,
    tick: Callable[[], None] | None = None,
) -> list[BenchRow]:
    """Release every (table, algorithm) of ``plan`` at each k; one row each."""
    from kcloak.streams.release import ReleaseParams, ReleaseUnsatisfiable, release_table
    from kcloak.streams.tables import TableKind

    out: list[BenchRow] = []
    for kind, algo in plan:
        table = tables[kind]
        for k in ks:
            params = ReleaseParams(
                k=k, algorithm=algo, m=m if kind is TableKind.PLACES else None, max_suppression=0.01, seed=seed
            )
            started, cpu0 = time.perf_counter(), time.process_time()
            try:
                rel = release_table(table, params)
            except ReleaseUnsatisfiable:
                elapsed = time.perf_counter() - started
                row = BenchRow(kind.value, algo, k, len(table), elapsed, None, None, None, "unsatisfiable")
            else:
                rep = rel.report
                row = BenchRow(
                    kind.value,
                    algo,
                    k,
                    len(table),
                    float(rep["runtime_s"]),
                    rep["metrics"]["ncp"],
                    rep["metrics"]["discernibility"],
                    int(rep["suppressed_rows"]),
                )
            out.append(replace(row, cpu_s=round(time.process_time() - cpu0, 4)))
            if tick is not None:
                tick()
    return out


def acd_vs_aa(rows: Sequence[BenchRow]) -> dict[str, Any]:
    """S002's claim on ``places``: ratios over the k both algorithms released."""
    import numpy as np

    # Only releases of a non-empty table compare: on zero rows both lose nothing in no time.
    acd = {r.k: r for r in rows if r.table == "places" and r.algorithm == "acd" and r.ncp is not None and r.rows}
    aa = {r.k: r for r in rows if r.table == "places" and r.algorithm == "aa" and r.ncp is not None and r.rows}
    ks = sorted(set(acd) & set(aa))
    if not ks:
        return {"ncp_ratio": None, "time_ratio": None, "holds": None, "ks": []}
    ratios = []
    for k in ks:
        a, b = float(acd[k].ncp or 0.0), float(aa[k].ncp or 0.0)
        if b > 0 or a == 0:  # a ratio is undefined when only AA lost nothing
            ratios.append(a / b if b > 0 else 1.0)
    if not ratios:
        return {"ncp_ratio": None, "time_ratio": None, "holds": None, "ks": ks}
    ncp_ratio = float(np.mean(ratios))

    def spent(r: BenchRow) -> float:  # CPU time when measured: wall time is noisy on a shared machine
        return r.cpu_s if r.cpu_s is not None else r.runtime_s

    time_ratio = sum(spent(acd[k]) for k in ks) / max(sum(spent(aa[k]) for k in ks), 1e-9)
    return {
        "ncp_ratio": round(ncp_ratio, 4),
        "time_ratio": round(time_ratio, 4),
        "holds": bool(ncp_ratio <= NCP_CLAIM and time_ratio <= TIME_CLAIM),
        "ncp_claim_holds": bool(ncp_ratio <= NCP_CLAIM),
        "time_claim_holds": bool(time_ratio <= TIME_CLAIM),
        "ks": ks,
    }


def synthetic_trips(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` trips-like rows: uniform over central Beijing and 30 days (for Mondrian's scale test)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cols = {
        "origin_lat": np.round(39.8 + rng.random(n) * 0.3, 5).tolist(),
        "origin_lon": np.round(116.2 + rng.random(n) * 0.4, 5).tolist(),
        "dest_lat": np.round(39.8 + rng.random(n) * 0.3, 5).tolist(),
        "dest_lon": np.round(116.2 + rng.random(n) * 0.4, 5).tolist(),
        "start_t": (1714550400 + rng.integers(0, 30 * 86400, n)).tolist(),
        "duration_s": rng.integers(60, 7200, n).tolist(),
        "mode": np.asarray(["walk", "bike", "vehicle"])[rng.integers(0, 3, n)].tolist(),
    }
    names = list(cols)
    return [dict(zip(names, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]


def mondrian_row(n: int, k: int, seed: int) -> BenchRow:
    from kcloak.cloaking.tabular import Unsatisfiable, anonymize_table
    from kcloak.streams.release import QUASI_IDENTIFIERS
    from kcloak.streams.tables import TableKind

    rows = synthetic_trips(n, seed)
    started, cpu0 = time.perf_counter(), time.process_time()
    try:
        rel = anonymize_table(
            rows,
            quasi_identifiers=QUASI_IDENTIFIERS[TableKind.TRIPS],
            sensitive="mode",
            algorithm="mondrian",
            k=k,
            seed=seed,
        )
    except Unsatisfiable:
        return BenchRow(
            "synthetic-trips", "mondrian", k, n, time.perf_counter() - started, None, None, None, "unsatisfiable"
        )
    return BenchRow(
        "synthetic-trips",
        "mondrian",
        k,
        n,
        time.perf_counter() - started,
        rel.metrics["ncp"],
        rel.metrics["discernibility"],
        rel.suppressed_rows,
        cpu_s=round(time.process_time() - cpu0, 4),
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kcloak.cloaking.tabular import ALGORITHMS
    from kcloak.core.places import load_pois
    from kcloak.core.readers import FixTable, ReaderError, read_fixes
    from kcloak.streams.release import KM_ALGORITHMS
    from kcloak.streams.tables import BuildOptions, TableKind, build_from_fixes

    try:
        tables_wanted = [TableKind(t) for t in _csv_list(args.tables, "--tables")]
    except ValueError:
        raise UsageError("--tables: choose among trips, staypoints, places, querylog") from None
    if TableKind.QUERYLOG in tables_wanted:
        raise UsageError("--tables: querylog needs a data directory; bench release uses a trace")
    algorithms = _csv_list(args.algorithms, "--algorithms") if args.algorithms else None
    known = set(ALGORITHMS) | set(KM_ALGORITHMS)
    if algorithms and (bad := [a for a in algorithms if a not in known]):
        raise UsageError(f"--algorithms: unknown {', '.join(bad)}")
    ks = _ks(args.ks)
    if args.m < 1 or args.mondrian_rows < 0:
        raise UsageError("--m must be ≥ 1 and --mondrian-rows ≥ 0")
    data = Path(args.data) if args.data else default_data()
    if data is None:
        raise UsageError("--data: no trace given and neither research trace (T-Drive, GeoLife sample) is present")
    err = Console(stderr=True)
    try:
        fixes: FixTable = read_fixes(data)
    except ReaderError as exc:
        raise UsageError(str(exc)) from None
    if len(fixes) == 0:
        raise UsageError(f"--data: {data.name} has no usable fixes ({fixes.bad_rows} bad rows)")
    plan = _plan(tables_wanted, algorithms)
    total = len(plan) * len(ks) + (1 if args.mondrian_rows else 0)
    progress = not args.no_progress and sys.stderr.isatty()
    build_s: dict[str, float] = {}
    with _bar(progress, total) as (bar, task):
        built: dict[TableKind, Table] = {}
        pois = load_pois(None)
        for kind in {t for t, _ in plan}:
            t0 = time.perf_counter()
            built[kind] = build_from_fixes(fixes, kind, BuildOptions(), pois)
            build_s[kind.value] = round(time.perf_counter() - t0, 4)

        def tick() -> None:
            if bar is not None:
                bar.update(task, advance=1)

        results = run_release_rows(built, plan, ks, args.m, args.seed, tick)
        if args.mondrian_rows:
            results.append(mondrian_row(args.mondrian_rows, min(ks), args.seed))
            tick()
    comparison = acd_vs_aa(results)
    report: dict[str, Any] = {
        "bench": "release",
        "results": [asdict(r) for r in results],
        "acd_vs_aa": comparison,
        "data": str(data),
        "fixes": len(fixes),
        "bad_rows": fixes.bad_rows,
        "build_s": build_s,
        "m": args.m,
        "mondrian_target_s": MONDRIAN_TARGET_S,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    _print(err, results, comparison, data)
    return 0


def _fmt(v: float | None, digits: int = 4) -> str:
    return "—" if v is None else f"{v:.{digits}g}"


def _print(err: Console, rows: Sequence[BenchRow], comparison: dict[str, Any], data: Path) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    out = Console()
    tab = RichTable(title=f"bench release on {data.name}")
    for col in ("table", "algorithm", "k", "rows", "runtime_s", "ncp", "discernibility", "suppressed", "status"):
        tab.add_column(col)
    for r in rows:
        tab.add_row(
            r.table,
            r.algorithm,
            str(r.k),
            str(r.rows),
            f"{r.runtime_s:.3f}",
            _fmt(r.ncp),
            _fmt(r.discernibility),
            "—" if r.suppressed_rows is None else str(r.suppressed_rows),
            r.status,
        )
    out.print(tab)
    out.print(
        f"ACD vs AA (places): NCP ratio {comparison['ncp_ratio']}, time ratio {comparison['time_ratio']}, "
        f"S002's claim (NCP ≤ ½ of AA's at ≤ +40 % time) holds: {comparison['holds']}"
    )
    del err


__all__ = ["BenchRow", "acd_vs_aa", "add_parser", "default_data", "mondrian_row", "run", "run_release_rows"]
