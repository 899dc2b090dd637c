"""Output randomization and the anonymization report for trajectory releases (CONCEPTS §7.7, §7.8; contract §7).

Published trajectories get fresh 16-hex ids unrelated to their input ids; rows are sorted by ``t``
and in uniformly random order among equal ``t``, so nothing in the output follows input order, user
ids or cluster construction order. Shuffles and ids come from ``secrets`` unless a seed is given.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.core.geometry import haversine_m_array
from kcloak.core.names import KDeltaMethod, TrajectoryDistance, values
from kcloak.core.readers import FixTable
from kcloak.streams.errors import StreamsError
from kcloak.streams.kdelta import KDeltaError, KDeltaResult, SmallClass
from kcloak.streams.quality import RANGE_QUERIES, range_query_distortions, translation_m
from kcloak.streams.trajectory import Trajectory, fixes_of, split_too_short, trajectories_from_fixes

METHODS: tuple[str, ...] = values(KDeltaMethod)
"""Methods :func:`anonymize` runs (contract §9 ``--method``)."""
DISTANCES: tuple[str, ...] = values(TrajectoryDistance)
"""W4M's edit distances (``--distance``)."""


class NotPublished(StreamsError, RuntimeError):
    """A release refused as a whole (too few trajectories, or a trash over ``trash_max``): the command
    line's exit 1. ``report`` holds the contract §7 report fields of the refused release."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def check_anonymize_params(
    *,
    method: str,
    k: int,
    delta_m: float,
    trash_max: float,
    pi_s: float,
    tau_s: float | None = None,
    distance: str = "edr",
    max_time_shift_s: float | None = None,
    max_radius: float | None = None,
) -> None:
    """The parameter checks of ``kcloak anonymize`` (and of :func:`kcloak.anonymize`): :class:`KDeltaError`
    naming the option as the command line spells it (``--trash-max`` is the keyword ``trash_max``)."""

    def finite_at_least_0(x: float | None) -> bool:
        return x is None or (math.isfinite(x) and x >= 0)

    if method not in METHODS:
        raise KDeltaError(f"--method: must be one of {', '.join(METHODS)}")
    if distance not in DISTANCES:
        raise KDeltaError(f"--distance: must be one of {', '.join(DISTANCES)}")
    if not finite_at_least_0(tau_s):
        raise KDeltaError("--tau-s: must be a finite number of seconds ≥ 0")
    if not finite_at_least_0(max_time_shift_s):
        raise KDeltaError("--max-time-shift-s: must be a finite number of seconds ≥ 0")
    if not finite_at_least_0(max_radius):
        raise KDeltaError("--max-radius: must be a finite number ≥ 0")
    if method == "w4m" and max_radius is not None and max_radius > 1:
        raise KDeltaError("--max-radius: w4m's radius is a normalized distance within [0, 1]")
    if not (math.isfinite(pi_s) and pi_s > 0):
        raise KDeltaError("--pi-s: must be a finite number of seconds > 0")
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise KDeltaError("--k: must be an integer ≥ 2")
    if not finite_at_least_0(delta_m):
        raise KDeltaError("--delta: must be a finite number of metres ≥ 0")
    if not 0 <= trash_max < 1:
        raise KDeltaError("--trash-max: must be within [0, 1)")


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


def distribution(values: npt.ArrayLike) -> dict[str, float]:
    """Median, 95th percentile and maximum of per-point values (zeros when there are none)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0:
        return {"median": 0.0, "p95": 0.0, "max": 0.0}
    return {"median": float(np.median(v)), "p95": float(np.percentile(v, 95)), "max": float(v.max())}


def _range_fields(before: FixTable, after: FixTable, n: int, seed: int, uncertainty_m: float) -> dict[str, float]:
    """``range_query_distortion`` (PSI, docs/quality.md) with its DAI companion and the changed fraction."""
    d = range_query_distortions(before, after, n_queries=n, seed=seed, uncertainty_m=uncertainty_m)
    return {
        "range_query_distortion": d["psi"],
        "range_query_distortion_dai": d["dai"],
        "range_query_changed_fraction": d["changed_fraction"],
        "range_query_uncertainty_m": uncertainty_m,
    }


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
    per_point = (
        np.concatenate(
            [
                haversine_m_array(o.lat, o.lon, p.lat, p.lon)
                for o, p in zip(result.originals, result.published, strict=True)
            ]
        )
        if result.published
        else np.zeros(0)
    )
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
        "trash_limit": int(result.trash_limit),
        "trash_reasons": result.trash_by_reason(),
        # sizes only: the spans of classes below k would tell when a suppressed user moved
        "small_class_sizes": {str(n): c for n, c in sorted(Counter(c.n for c in result.small_classes).items())},
        "n_groups": len(sizes),
        "group_size_mean": float(np.mean(sizes)) if sizes else 0.0,
        "total_translation_m": total,
        "mean_translation_m": total / n_points_out if n_points_out else 0.0,
        "time_distortion_s": float(shift_all.sum()),
        "translation_m": distribution(per_point),
        "time_shift_s": distribution(shift_all),
        **_range_fields(fixes_of(inputs), published, range_queries, 0 if seed is None else seed, delta_m / 2.0),
        "range_queries": range_queries,
        "runtime_s": runtime_s,
    }
    if method == "w4m":  # CONCEPTS §7.4 extra measures (an extension of the contract §7 report)
        report["n_inserted"] = int(getattr(result, "n_inserted", 0))
        report["n_deleted"] = int(getattr(result, "n_deleted", 0))
        report["time_shift_max_s"] = float(shift_all.max()) if len(shift_all) else 0.0
    return report


def refusal_reason(report: dict[str, Any]) -> str:
    """Why a window cannot be published, from its report alone: counts per trash reason, the classes
    too small for ``k`` and the method or parameter that would place them (issue 16). No coordinate,
    id or instant appears in the text (it may be logged)."""
    n_in, n_trash, k = int(report["n_in"]), int(report["n_trash"]), int(report["k"])
    limit = int(report.get("trash_limit", 0))
    if n_in < k:
        return f"only {n_in} trajectories for k={k}"
    parts = [f"trash {n_trash} of {n_in} > {limit} allowed (trash_max {float(report['trash_max']):g})"]
    reasons: dict[str, int] = report.get("trash_reasons", {})
    small_words = "time-connected groups" if report.get("method") == "w4m" else "time-span classes"
    words = {
        "span_shorter_than_pi": "spans shorter than pi_s",
        "class_smaller_than_k": f"in {small_words} smaller than k={k}",
        "beyond_radius": "beyond the clustering radius",
        "no_match_within_bounds": "with no k-1 others within the time-shift bound and radius",
    }
    for name, n in reasons.items():
        parts.append(f"{n} {words.get(name, name)}")
    sizes: dict[str, int] = report.get("small_class_sizes", {})
    if sizes:
        shown = ", ".join(f"{cnt} of size {size}" for size, cnt in sorted(sizes.items(), key=lambda kv: int(kv[0])))
        parts.append(f"{sum(sizes.values())} {small_words} too small ({shown})")
    hint = ""
    method = report.get("method")
    unavoidable = int(reasons.get("class_smaller_than_k", 0)) + int(reasons.get("span_shorter_than_pi", 0))
    if method == "nwa" and unavoidable:
        hint = "; --method w4m and --method microagg accept unequal time spans, a larger --pi-s merges classes"
    elif method == "nwa" or method == "microagg":
        hint = "; --method w4m tolerates unequal spans and sampling"
    elif method == "w4m":
        hint = "; a larger --delta, --max-radius or --max-time-shift-s, or a smaller --k, would group more"
    return "; ".join(parts) + hint


def small_class_lines(small: Sequence[SmallClass], *, limit: int = 8) -> list[str]:
    """The largest small classes as ``span (UTC) — n trajectories``, at most ``limit`` lines (then a count)."""
    from datetime import UTC, datetime

    def at(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")

    ordered = sorted(small, key=lambda c: (-c.n, c.t_start, c.t_end))
    lines = [f"{at(c.t_start)} .. {at(c.t_end)} UTC: {c.n}" for c in ordered[:limit]]
    if len(ordered) > limit:
        lines.append(f"… and {len(ordered) - limit} more")
    return lines


def other_methods(fixes: FixTable, refused: dict[str, Any], **params: Any) -> list[str]:
    """For a refused release: one line per other method saying whether it would publish the same input
    with the same ``k``, δ and ``trash_max`` (issue 16: "say which method would publish it")."""
    lines: list[str] = []
    for method in METHODS:
        if method == refused["method"]:
            continue
        rel = anonymize(
            fixes,
            method=method,
            k=int(refused["k"]),
            delta_m=float(refused["delta"]),
            trash_max=float(refused["trash_max"]),
            range_queries=0,
            seed=0,
            **params,
        )
        rep = rel.report
        if rel.ok:
            lines.append(
                f"--method {method} would publish {rep['n_out']} of {rep['n_in']} (trash {rep['n_trash']}, "
                f"translation median {rep['translation_m']['median']:.0f} m, max {rep['translation_m']['max']:.0f} m)"
            )
        else:
            lines.append(
                f"--method {method} would not publish it either (trash {rep['n_trash']} > {rep['trash_limit']})"
            )
    return lines


@dataclass(frozen=True, slots=True, eq=False)
class Release:
    """A trajectory release: ``table`` to publish (empty when not ``ok``), audit ``mapping``, ``report``."""

    ok: bool
    table: FixTable
    mapping: dict[str, str]
    report: dict[str, Any]
    small_classes: tuple[SmallClass, ...] = ()
    """The classes (NWA) or time-connected groups (W4M) smaller than k, with their spans: for the operator's
    console only (the report carries their sizes, not their spans)."""
    trash: tuple[str, ...] = ()
    """The input ids of the trajectories never published: for the data's owner only (the report carries
    their count and reasons, not their ids)."""


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
    max_time_shift_s: float | None = None,
    max_radius: float | None = None,
) -> Release:
    """Read-to-release pipeline of ``kcloak anonymize`` (contract §7): model, algorithm, randomization, report.

    ``ok`` is false (and ``table`` empty) when fewer than k trajectories are eligible or the trash would
    exceed ``trash_max``: the caller then exits 1 / publishes the window empty. ``tau_s`` (time tolerance,
    default :data:`~kcloak.streams.kdelta.w4m.DEFAULT_TAU_S`), ``distance`` (``edr`` or ``lst``) and
    ``max_time_shift_s`` (default an hour) apply to W4M only; ``max_radius`` is the clustering radius of
    NWA (root-mean-square metres per instant, default unbounded) or W4M (normalized, default 0.9),
    beyond which a trajectory is trash.
    """
    started = time.perf_counter()
    inputs, n_too_short = split_too_short(trajectories_from_fixes(fixes))
    result = run_kdelta(
        inputs,
        method=method,
        k=k,
        delta_m=delta_m,
        trash_max=trash_max,
        pi_s=pi_s,
        tau_s=tau_s,
        distance=distance,
        max_time_shift_s=max_time_shift_s,
        max_radius=max_radius,
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
    max_time_shift_s: float | None = None,
    max_radius: float | None = None,
) -> KDeltaResult:
    """Run the (k,δ) algorithm ``method`` on trajectories of ≥ 2 instants (the algorithm step of :func:`anonymize`)."""
    from kcloak.streams.kdelta.microagg import microaggregate
    from kcloak.streams.kdelta.nwa import nwa
    from kcloak.streams.kdelta.w4m import DEFAULT_MAX_TIME_SHIFT_S, DEFAULT_TAU_S, Distance, w4m

    if method == "nwa":
        return nwa(inputs, k=k, delta_m=delta_m, pi_s=pi_s, trash_max=trash_max, max_rms_m=max_radius)
    if method == "w4m":
        if distance not in tuple(Distance):
            raise KDeltaError(f"distance: must be one of {', '.join(Distance)}")
        tau = DEFAULT_TAU_S if tau_s is None else tau_s
        shift = DEFAULT_MAX_TIME_SHIFT_S if max_time_shift_s is None else max_time_shift_s
        return w4m(
            inputs,
            k=k,
            delta_m=delta_m,
            trash_max=trash_max,
            tau_s=tau,
            distance=distance,
            max_time_shift_s=shift,
            max_radius=max_radius,
        )
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
        result = KDeltaResult(
            (), (), (), result.trash, result.n_in, result.trash_limit, result.trash_reasons, result.small_classes
        )
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
    return Release(ok, table, mapping, report, result.small_classes, result.trash)


__all__ = [
    "DISTANCES",
    "METHODS",
    "NotPublished",
    "Release",
    "anonymization_report",
    "anonymize",
    "check_anonymize_params",
    "fresh_ids",
    "other_methods",
    "publish_rows",
    "refusal_reason",
    "release_of",
    "run_kdelta",
]
