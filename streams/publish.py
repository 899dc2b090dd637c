"""Output randomization and the anonymization report for trajectory releases (CONCEPTS §7.7, §7.8; contract §7).

Published trajectories get fresh 16-hex ids unrelated to their input ids; rows are sorted by ``t``
and in uniformly random order among equal ``t``, so nothing in the output follows input order, user
ids or cluster construction order. Shuffles and ids come from ``secrets`` unless a seed is given.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kcloak.core.names import KDeltaMethod, values
from kcloak.core.readers import FixTable
from kcloak.streams.kdelta import KDeltaError, KDeltaResult
from kcloak.streams.quality import RANGE_QUERIES, range_query_distortion, translation_m
from kcloak.streams.trajectory import Trajectory, fixes_of, split_too_short, trajectories_from_fixes

METHODS: tuple[str, ...] = values(KDeltaMethod)
"""Methods :func:`anonymize` runs (contract §9 ``--method``)."""


def _rng(seed: int | None) -> random.Random:
    """``random.Random(seed)`` for reproducible tests, else the cryptographic ``secrets.SystemRandom``."""
    return secrets.SystemRandom() if seed is None else random.Random(seed)


def fresh_ids(n: int, rng: random.Random, *, avoid: Collection[str] = ()) -> list[str]:
    """``n`` distinct random ids of 16 lowercase hex chars, none in ``avoid`` (contract §1)."""
    out: list[str] = []
    seen = set(avoid)
    while len(out) < n:
        i = f"{rng.getrandbits(64):016x}"
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out


def publish_rows(
    trajectories: Sequence[Trajectory], *, seed: int | None = None, avoid: Collection[str] = ()
) -> tuple[FixTable, dict[str, str]]:
    """The published table (fresh ids; sorted by ``t``, random order among equal ``t``) and the audit mapping.

    The mapping is ``published id → input id``; it is for ``--mapping`` audits only (§7.7).
    """
    rng = _rng(seed)
    ids = fresh_ids(len(trajectories), rng, avoid=avoid)
    mapping = dict(zip(ids, (tr.traj_id for tr in trajectories), strict=True))
    renamed = [Trajectory(i, tr.t, tr.lat, tr.lon) for i, tr in zip(ids, trajectories, strict=True)]
    rows = fixes_of(renamed)
    perm = list(range(len(rows)))
    rng.shuffle(perm)
    p = np.array(perm, dtype=np.int64)
    order = p[np.argsort(rows.t[p], kind="stable")]
    table = FixTable(rows.traj_id[order], rows.t[order], rows.lat[order], rows.lon[order])
    return table, mapping


def anonymization_report(
    result: KDeltaResult,
    inputs: Sequence[Trajectory],
    published: FixTable,
    *,
    method: str,
    k: int,
    delta_m: float,
    trash_max: float,
    pi_s: float | None,
    n_too_short: int,
    n_bad_rows: int,
    runtime_s: float,
    seed: int | None = None,
    range_queries: int = RANGE_QUERIES,
) -> dict[str, Any]:
    """The contract §7 report fields (provenance fields ``kcloak_version``, ``input``… are the CLI's)."""
    moved = translation_m(result.originals, result.published)
    total = float(moved.sum())
    shifts = [np.abs(p.t - o.t) for o, p in zip(result.originals, result.published, strict=True)]
    shift_all = np.concatenate(shifts) if shifts else np.zeros(0)
    n_points_out = len(published)
    sizes = [len(g) for g in result.groups]
    n_in = len(inputs)
    report: dict[str, Any] = {
        "seed": seed,
        "method": method,
        "k": k,
        "delta": float(delta_m),
        "trash_max": float(trash_max),
        "pi_s": None if pi_s is None else float(pi_s),
        "n_in": n_in,
        "n_out": len(result.published),
        "n_trash": len(result.trash),
        "n_too_short": n_too_short,
        "n_bad_rows": n_bad_rows,
        "n_points_in": sum(len(tr) for tr in inputs),
        "n_points_out": n_points_out,
        "trash_fraction": len(result.trash) / n_in if n_in else 0.0,
        "n_groups": len(sizes),
        "group_size_mean": float(np.mean(sizes)) if sizes else 0.0,
        "total_translation_m": total,
        "mean_translation_m": total / n_points_out if n_points_out else 0.0,
        "time_distortion_s": float(shift_all.sum()),
        "range_query_distortion": range_query_distortion(
            fixes_of(inputs), published, n_queries=range_queries, seed=0 if seed is None else seed
        ),
        "range_queries": range_queries,
        "runtime_s": runtime_s,
    }
    if method == "w4m":  # CONCEPTS §7.4 extra measures (an extension of the contract §7 report)
        report["n_inserted"] = int(getattr(result, "n_inserted", 0))
        report["n_deleted"] = int(getattr(result, "n_deleted", 0))
        report["time_shift_max_s"] = float(shift_all.max()) if len(shift_all) else 0.0
    return report


@dataclass(frozen=True, slots=True, eq=False)
class Release:
    """A trajectory release: ``table`` to publish (empty when not ``ok``), audit ``mapping``, ``report``."""

    ok: bool
    table: FixTable
    mapping: dict[str, str]
    report: dict[str, Any]


def anonymize(
    fixes: FixTable,
    *,
    method: str = "nwa",
    k: int,
    delta_m: float,
    trash_max: float = 0.1,
    pi_s: float = 60.0,
    seed: int | None = None,
    range_queries: int = RANGE_QUERIES,
    tau_s: float | None = None,
    distance: str = "edr",
) -> Release:
    """Read-to-release pipeline of ``kcloak anonymize`` (contract §7): model, algorithm, randomization, report.

    ``ok`` is false (and ``table`` empty) when fewer than k trajectories are eligible or the trash would
    exceed ``trash_max``: the caller then exits 1 / publishes the window empty. ``tau_s`` (time tolerance,
    default :data:`~kcloak.streams.kdelta.w4m.DEFAULT_TAU_S`) and ``distance`` (``edr`` or ``lst``) apply to W4M only.
    """
    started = time.perf_counter()
    inputs, n_too_short = split_too_short(trajectories_from_fixes(fixes))
    result = run_kdelta(
        inputs, method=method, k=k, delta_m=delta_m, trash_max=trash_max, pi_s=pi_s, tau_s=tau_s, distance=distance
    )
    return release_of(
        result,
        inputs,
        method=method,
        k=k,
        delta_m=delta_m,
        trash_max=trash_max,
        pi_s=pi_s,
        n_too_short=n_too_short,
        n_bad_rows=fixes.bad_rows,
        started=started,
        seed=seed,
        range_queries=range_queries,
    )


def run_kdelta(
    inputs: Sequence[Trajectory],
    *,
    method: str,
    k: int,
    delta_m: float,
    trash_max: float,
    pi_s: float,
    tau_s: float | None = None,
    distance: str = "edr",
) -> KDeltaResult:
    """Run the (k,δ) algorithm ``method`` on trajectories of ≥ 2 instants (the algorithm step of :func:`anonymize`)."""
    from kcloak.streams.kdelta.microagg import microaggregate
    from kcloak.streams.kdelta.nwa import nwa
    from kcloak.streams.kdelta.w4m import DEFAULT_TAU_S, Distance, w4m

    if method == "nwa":
        return nwa(inputs, k=k, delta_m=delta_m, pi_s=pi_s, trash_max=trash_max)
    if method == "w4m":
        if distance not in tuple(Distance):
            raise KDeltaError(f"distance: must be one of {', '.join(Distance)}")
        tau = DEFAULT_TAU_S if tau_s is None else tau_s
        return w4m(inputs, k=k, delta_m=delta_m, trash_max=trash_max, tau_s=tau, distance=distance)
    if method == "microagg":
        return microaggregate(inputs, k=k, delta_m=delta_m, trash_max=trash_max)
    raise ValueError(f"method: must be one of {', '.join(METHODS)}")


def release_of(
    result: KDeltaResult,
    inputs: Sequence[Trajectory],
    *,
    method: str,
    k: int,
    delta_m: float,
    trash_max: float,
    pi_s: float,
    n_too_short: int,
    n_bad_rows: int,
    started: float,
    seed: int | None = None,
    range_queries: int = RANGE_QUERIES,
) -> Release:
    """The release of an algorithm's result (the randomization and report step of :func:`anonymize`).

    ``started`` is the :func:`time.perf_counter` value at which the work began (for ``runtime_s``).
    """
    ok = result.ok and len(inputs) >= k and len(result.published) > 0
    if ok:
        table, mapping = publish_rows(result.published, seed=seed, avoid=[tr.traj_id for tr in inputs])
    else:
        table, mapping = fixes_of([]), {}
        result = KDeltaResult((), (), (), result.trash, result.n_in, result.trash_limit)
    runtime_s = time.perf_counter() - started
    report = anonymization_report(
        result,
        inputs,
        table,
        method=method,
        k=k,
        delta_m=delta_m,
        trash_max=trash_max,
        pi_s=pi_s if method == "nwa" else None,
        n_too_short=n_too_short,
        n_bad_rows=n_bad_rows,
        runtime_s=runtime_s,
        seed=seed,
        range_queries=range_queries,
    )
    return Release(ok, table, mapping, report)


__all__ = [
    "METHODS",
    "Release",
    "anonymization_report",
    "anonymize",
    "fresh_ids",
    "publish_rows",
    "release_of",
    "run_kdelta",
]
