"""A window's trajectories partitioned by space or by NWA equivalence class, and the parts merged (issue 15).

Pure functions, no engine: :func:`plan_window` cuts a window into parts that can be anonymized
independently (on Dask, :mod:`kcloak.broker.cluster.windows`, or one after another here), each with
:func:`anonymize_part`; :meth:`WindowPlan.release` merges the parts' results and enforces the trash bound
over the **whole window**: the trashed trajectories of all parts together must stay within
``floor(trash_max · n)`` for the ``n`` trajectories of the window, else nothing is published
(``Release.ok`` false and :func:`refusal_reason` says why).

How a window is cut (docs/cluster.md "Window publication"):

- ``nwa``: by equivalence class, the time span trimmed to the granularity ``pi_s`` (CONCEPTS §7.3). NWA
  never puts two classes in one cluster and gives each class its own trash budget, so a class's result
  does not depend on the other classes: the parts give the very clusters the single run gives.
- ``w4m`` and ``microagg``: by the **start cell** of each trajectory (the cell of its first fix,
  :meth:`~kcloak.cloaking.cells.CellMap.cell_of`), never by a hash of an id. Trajectories of different
  parts are never grouped together, so clusters can only be tighter-or-trashed at part edges; every
  published group is still a (k,δ)-anonymity set (checked from the output alone).

Groups (classes or cells) are sorted and cut into ``parts`` contiguous runs of about equal size; a run
smaller than ``k`` trajectories joins its neighbour (it could publish nothing on its own). Inside a part
trajectories keep the window's order, and the merged result lists the parts in order, so with one part
the release is the single-process :func:`~kcloak.streams.publish.anonymize` release, bit for bit for a
given seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kcloak.cloaking.cells import CellMap
from kcloak.core.errors import InputError
from kcloak.core.readers import FixTable
from kcloak.streams.errors import StreamsError
from kcloak.streams.kdelta import KDeltaResult, check_params, trash_limit
from kcloak.streams.kdelta.nwa import trimmed_span
from kcloak.streams.publish import METHODS, Release, release_of, run_kdelta
from kcloak.streams.quality import RANGE_QUERIES
from kcloak.streams.trajectory import Trajectory, split_too_short, trajectories_from_fixes


class PartitionError(StreamsError, InputError, ValueError):
    """Parameters of a partitioned window that cannot be used (never echoes data)."""


@dataclass(frozen=True, slots=True)
class PartParams:
    """The algorithm parameters every part of a window shares."""

    method: str
    k: int
    delta_m: float
    trash_max: float = 0.1
    pi_s: float = 60.0
    tau_s: float | None = None
    distance: str = "edr"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise PartitionError(f"method: must be one of {', '.join(METHODS)}")
        if not (math.isfinite(self.pi_s) and self.pi_s > 0):
            raise PartitionError("pi_s: must be a finite number > 0 (seconds)")
        check_params(self.k, self.delta_m, self.trash_max)  # before any ledger write or Dask task


def anonymize_part(trajectories: Sequence[Trajectory], params: PartParams) -> KDeltaResult:
    """One part's (k,δ) result (a Dask task; the algorithm's own trash budget applies to the part)."""
    return run_kdelta(
        trajectories,
        method=params.method,
        k=params.k,
        delta_m=params.delta_m,
        trash_max=params.trash_max,
        pi_s=params.pi_s,
        tau_s=params.tau_s,
        distance=params.distance,
    )


def group_keys(
    trajectories: Sequence[Trajectory], params: PartParams, cells: CellMap | None
) -> list[tuple[float, ...]]:
    """The group of each trajectory: its NWA class ``(a, b)`` for ``nwa``, else ``(start cell,)``."""
    if not trajectories:
        return []
    if params.method == "nwa":
        out: list[tuple[float, ...]] = []
        for tr in trajectories:
            a, b = trimmed_span(tr.t_start, tr.t_end, params.pi_s)
            out.append((a, b) if a < b else (math.inf, math.inf))  # trashed by NWA in any part
        return out
    if cells is None:
        return [(0.0,)] * len(trajectories)
    lat = np.array([tr.lat[0] for tr in trajectories], dtype=np.float64)
    lon = np.array([tr.lon[0] for tr in trajectories], dtype=np.float64)
    return [(float(c),) for c in cells.cell_of(lat, lon).tolist()]


def cut_groups(sizes: Sequence[int], parts: int, min_size: int) -> list[int]:
    """Part index of each group (groups in sorted order): ``parts`` contiguous runs of about equal size,
    a run below ``min_size`` merged into its neighbour."""
    if parts < 1:
        raise PartitionError("parts: must be an integer >= 1")
    total = sum(sizes)
    target = max(1, math.ceil(total / parts))
    runs: list[list[int]] = [[]]
    filled = 0
    for g, size in enumerate(sizes):
        if filled >= target and len(runs) < parts:
            runs.append([])
            filled = 0
        runs[-1].append(g)
        filled += size
    merged: list[list[int]] = []
    for run in runs:
        if merged and sum(sizes[g] for g in run) < min_size:
            merged[-1].extend(run)
        else:
            merged.append(run)
    if len(merged) > 1 and sum(sizes[g] for g in merged[0]) < min_size:
        merged[1] = merged[0] + merged[1]
        merged.pop(0)
    out = [0] * len(sizes)
    for p, run in enumerate(merged):
        for g in run:
            out[g] = p
    return out


@dataclass(frozen=True, slots=True, eq=False)
class WindowPlan:
    """A window cut into parts: ``parts[i]`` is a list of trajectories (window order kept)."""

    params: PartParams
    inputs: tuple[Trajectory, ...]
    parts: tuple[tuple[Trajectory, ...], ...]
    n_too_short: int
    n_bad_rows: int
    started: float = field(default_factory=time.perf_counter)

    def merge(self, results: Sequence[KDeltaResult]) -> KDeltaResult:
        """The parts' results as one, with the trash limit of the whole window."""
        if len(results) != len(self.parts):
            raise PartitionError("one result per part is needed")
        published: list[Trajectory] = []
        originals: list[Trajectory] = []
        groups: list[tuple[int, ...]] = []
        trash: list[str] = []
        for r in results:
            offset = len(published)
            published.extend(r.published)
            originals.extend(r.originals)
            groups.extend(tuple(offset + i for i in g) for g in r.groups)
            trash.extend(r.trash)
        n_in = len(self.inputs)
        return KDeltaResult(
            published=tuple(published),
            originals=tuple(originals),
            groups=tuple(groups),
            trash=tuple(trash),
            n_in=n_in,
            trash_limit=trash_limit(n_in, self.params.trash_max),
        )

    def release(
        self, results: Sequence[KDeltaResult], *, seed: int | None = None, range_queries: int = RANGE_QUERIES
    ) -> Release:
        """The window's release: fresh ids and shuffle over the whole window, the trash bound over the whole window."""
        p = self.params
        return release_of(
            self.merge(results),
            self.inputs,
            method=p.method,
            k=p.k,
            delta_m=p.delta_m,
            trash_max=p.trash_max,
            pi_s=p.pi_s,
            n_too_short=self.n_too_short,
            n_bad_rows=self.n_bad_rows,
            started=self.started,
            seed=seed,
            range_queries=range_queries,
        )


def plan_window(fixes: FixTable, params: PartParams, *, parts: int = 1, cells: CellMap | None = None) -> WindowPlan:
    """Cut a window's fixes into at most ``parts`` parts (see the module docstring)."""
    started = time.perf_counter()
    inputs, n_too_short = split_too_short(trajectories_from_fixes(fixes))
    keys = group_keys(inputs, params, cells)
    ordered = sorted(set(keys))
    index = {key: g for g, key in enumerate(ordered)}
    sizes = [0] * len(ordered)
    for key in keys:
        sizes[index[key]] += 1
    part_of_group = cut_groups(sizes, parts, params.k) if ordered else []
    n_parts = max(part_of_group, default=0) + 1
    buckets: list[list[Trajectory]] = [[] for _ in range(n_parts)]
    for tr, key in zip(inputs, keys, strict=True):
        buckets[part_of_group[index[key]]].append(tr)
    return WindowPlan(
        params=params,
        inputs=tuple(inputs),
        parts=tuple(tuple(b) for b in buckets),
        n_too_short=n_too_short,
        n_bad_rows=fixes.bad_rows,
        started=started,
    )


def anonymize_partitioned(
    fixes: FixTable, params: PartParams, *, parts: int = 1, cells: CellMap | None = None, seed: int | None = None
) -> Release:
    """The partitioned release computed here, part after part (what the Dask runner distributes)."""
    plan = plan_window(fixes, params, parts=parts, cells=cells)
    return plan.release([anonymize_part(part, params) for part in plan.parts], seed=seed)


def refusal_reason(release: Release) -> dict[str, Any] | None:
    """Why a release publishes nothing (``None`` when it publishes): a reason code and the counts behind it."""
    if release.ok:
        return None
    r = release.report
    n_in, n_trash, k = int(r["n_in"]), int(r["n_trash"]), int(r["k"])
    limit = trash_limit(n_in, float(r["trash_max"]))
    if n_in < k:
        code = "too_few_trajectories"
    elif n_trash > limit:
        code = "trash_exceeded"
    else:
        code = "nothing_published"
    return {"reason": code, "n_in": n_in, "n_trash": n_trash, "trash_limit": limit, "k": k}


__all__ = [
    "PartParams",
    "PartitionError",
    "WindowPlan",
    "anonymize_part",
    "anonymize_partitioned",
    "cut_groups",
    "group_keys",
    "plan_window",
    "refusal_reason",
]
