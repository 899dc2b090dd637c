"""Linkage of published trajectories by an attacker who knows m points of a victim (CONCEPTS §7.6; S002).

The attacker of k^m-anonymity (S002 Def. 1; Terrovitis et al., PVLDB 2008) knows up to ``m``
values of a target record — here ``m`` fixes ``(t_j, p_j)`` drawn from the victim's *original*
trajectory — and looks for the published trajectory they belong to.

**Consistency (the attacker's rule, precisely).** For a published trajectory τ' let
``D(τ') = max_j dist(τ'(t_j), p_j)`` (haversine, contract §0; ``τ'(t)`` by linear interpolation,
clamped to τ'’s end points outside its span, §7.1). The attacker ranks the published
trajectories by ``D`` and calls *consistent* every τ' with ``D(τ') ≤ D* + δ``, where ``D*`` is the
best score: neither his knowledge nor a (k,δ) publication is precise below δ, and the members of
one (k,δ)-anonymity set are within δ of each other at every instant (§7.2), so the best match
brings its whole set — at least k trajectories — into the consistent set (triangle inequality).
He then names one consistent trajectory uniformly at random: the re-identification risk of the
victim is ``1/|C|`` when the victim's own published trajectory is in ``C``, else 0.

Against the raw data (target ``raw``) the victim's own trajectory scores ``D = 0``; only
trajectories passing within δ of all m points at the same instants hide it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import InputError
from kcloak.core.extras import require_pictures
from kcloak.core.geometry import haversine_m_array
from kcloak.streams.errors import StreamsError
from kcloak.streams.trajectory import Trajectory

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

DEFAULT_VICTIMS = 1000
"""Victims attacked per target (a seeded sample when there are more trajectories)."""


class LinkageError(StreamsError, InputError, ValueError):
    """Unusable attack input (no trajectories, bad m, a mapping naming unknown trajectories)."""


@dataclass(frozen=True, slots=True, eq=False)
class _Stacked:
    """Published trajectories concatenated, for interpolating all of them at one instant at once."""

    ids: tuple[str, ...]
    t: F64
    lat: F64
    lon: F64
    start: I64
    end: I64  # exclusive
    t0: float
    span: float
    keys: F64  # trajectory index · 2·span + (t − t0): one sorted key for every point

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory]) -> _Stacked:
        if not trajectories:
            raise LinkageError("no published trajectories")
        lens = np.array([len(tr) for tr in trajectories], np.int64)
        end = np.cumsum(lens)
        start = end - lens
        t = np.concatenate([tr.t for tr in trajectories])
        t0 = float(t.min())
        span = float(t.max()) - t0 + 1.0
        keys = np.repeat(np.arange(len(trajectories)), lens) * span * 2 + (t - t0)
        return cls(
            tuple(tr.traj_id for tr in trajectories),
            t,
            np.concatenate([tr.lat for tr in trajectories]),
            np.concatenate([tr.lon for tr in trajectories]),
            start,
            end,
            t0,
            span,
            keys,
        )

    def at(self, when: float) -> tuple[F64, F64]:
        """Every trajectory's position at ``when`` (linear interpolation, clamped to its end points)."""
        n = len(self.ids)
        q = np.arange(n) * self.span * 2 + (when - self.t0)
        hi = np.clip(np.searchsorted(self.keys, q, side="left"), self.start, self.end - 1)
        lo = np.clip(hi - 1, self.start, self.end - 1)
        t_lo, t_hi = self.t[lo], self.t[hi]
        w = np.where(t_hi > t_lo, np.clip((when - t_lo) / np.where(t_hi > t_lo, t_hi - t_lo, 1.0), 0.0, 1.0), 0.0)
        w = np.where(when >= t_hi, 1.0, w)
        lat = self.lat[lo] + w * (self.lat[hi] - self.lat[lo])
        lon = self.lon[lo] + w * (self.lon[hi] - self.lon[lo])
        return lat, lon


@dataclass(frozen=True, slots=True, eq=False)
class LinkageRisk:
    """Per-victim outcome: ``risk[i]`` = P(attacker names victim i's published trajectory)."""

    target: str
    m: int
    victims: tuple[str, ...]
    risk: F64
    candidates: I64
    suppressed: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def trials(self) -> int:
        return len(self.risk)

    @property
    def reidentification_rate(self) -> float:
        return float(np.mean(self.risk)) if self.trials else 0.0


class KnownPointsLinkage:
    """The km linkage attack (module doc): knows ``m`` fixes of the victim's original trajectory.

    Keyword arguments:
        m: number of known points (≥ 1).
        resolution_m: slack δ of the consistency rule (the publication's δ).
        seed: seed of which fixes the attacker knows.
    """

    def __init__(self, *, m: int, resolution_m: float, seed: int = 0) -> None:
        if m < 1:
            raise LinkageError("m: must be at least 1")
        if not resolution_m >= 0:
            raise LinkageError("resolution_m: must be ≥ 0")
        self.m = m
        self.resolution_m = resolution_m
        self.seed = seed

    def known_points(self, victim: Trajectory, index: int) -> tuple[F64, F64, F64]:
        """The m fixes (distinct when possible) of ``victim`` the attacker knows."""
        rng = np.random.default_rng([self.seed, self.m, index, 53])
        pick = np.sort(rng.choice(len(victim), size=self.m, replace=self.m > len(victim)))
        return victim.t[pick], victim.lat[pick], victim.lon[pick]

    def assess_risk(
        self,
        originals: Sequence[Trajectory],
        published: Sequence[Trajectory],
        truth: Mapping[str, str],
        *,
        target: str,
        victims: Sequence[int] | None = None,
    ) -> LinkageRisk:
        """Attack the victims ``originals[i]`` for ``i`` in ``victims`` (default: all).

        ``truth`` maps a published id to the original ``traj_id`` it comes from. Victims with no
        published trajectory (trashed) are counted in ``suppressed``, not attacked.
        """
        stacked = _Stacked.of(published)
        owner: dict[str, list[int]] = {}
        for i, pid in enumerate(stacked.ids):
            src = truth.get(pid)
            if src is not None:
                owner.setdefault(src, []).append(i)
        chosen = range(len(originals)) if victims is None else victims
        risks: list[float] = []
        sizes: list[int] = []
        names: list[str] = []
        suppressed = 0
        cache: dict[float, tuple[F64, F64]] = {}
        for i in chosen:
            victim = originals[i]
            own = owner.get(victim.traj_id)
            if not own:
                suppressed += 1
                continue
            kt, klat, klon = self.known_points(victim, i)
            score = np.zeros(len(stacked.ids))
            for tj, la, lo in zip(kt.tolist(), klat.tolist(), klon.tolist(), strict=True):
                pos = cache.get(tj)
                if pos is None:
                    pos = stacked.at(tj)
                    if len(cache) < 200_000:
                        cache[tj] = pos
                score = np.maximum(score, haversine_m_array(la, lo, pos[0], pos[1]))
            consistent = np.flatnonzero(score <= score.min() + self.resolution_m)
            hit = np.isin(own, consistent).any()
            names.append(victim.traj_id)
            sizes.append(len(consistent))
            risks.append(1.0 / len(consistent) if hit else 0.0)
        return LinkageRisk(
            target,
            self.m,
            tuple(names),
            np.asarray(risks, np.float64),
            np.asarray(sizes, np.int64),
            suppressed,
            {"candidates_median": float(np.median(sizes)) if sizes else None, "suppressed": suppressed},
        )


def victim_sample(n: int, limit: int = DEFAULT_VICTIMS, seed: int = 0) -> list[int]:
    """Indices of the victims attacked: all, or a seeded sample of ``limit``."""
    if n <= limit:
        return list(range(n))
    return sorted(np.random.default_rng([seed, 59]).choice(n, size=limit, replace=False).tolist())


# -- the trajectory audit ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LinkageRow:
    """One contract row (``target, m, reidentification_rate, trials, baseline``) plus details."""

    target: str
    m: int
    reidentification_rate: float | None
    trials: int
    baseline: float
    suppressed: int = 0
    candidates_median: float | None = None
    mean_translation_m: float | None = None
    tolerance: float | None = None

    def contract(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "m": self.m,
            "reidentification_rate": self.reidentification_rate,
            "trials": self.trials,
            "baseline": self.baseline,
        }

    def detailed(self) -> dict[str, Any]:
        return {
            **self.contract(),
            "tolerance": self.tolerance,
            "suppressed": self.suppressed,
            "candidates_median": self.candidates_median,
            "mean_translation_m": self.mean_translation_m,
        }


@dataclass(frozen=True, slots=True)
class TrajectoryAudit:
    """Result of :func:`audit_trajectories`: the (k,δ) verdict on PUBLISHED and the linkage rows."""

    kdelta_ok: bool
    violations: tuple[tuple[str, str], ...]
    warnings: int
    n_published: int
    rows: tuple[LinkageRow, ...]
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The contract's ``--json`` object."""
        return {
            "kdelta": {"ok": self.kdelta_ok, "violations": len(self.violations), "trajectories": self.n_published},
            "results": [r.contract() for r in self.rows],
        }

    def detailed_json(self) -> dict[str, Any]:
        out = self.to_json()
        out["kdelta"]["no_cylinder_certificate"] = self.warnings
        out["kdelta"]["violation_list"] = [{"traj_id": t, "property": p} for t, p in self.violations[:1000]]
        out["results"] = [r.detailed() for r in self.rows]
        out["notes"] = list(self.notes)
        return out


def mean_translation_m(
    originals: Sequence[Trajectory], published: Sequence[Trajectory], truth: Mapping[str, str]
) -> float:
    """Mean distance between each published point and its original trajectory at the same instant (§7.8)."""
    by_id = {tr.traj_id: tr for tr in originals}
    total = 0.0
    points = 0
    for tr in published:
        src = by_id.get(truth.get(tr.traj_id, ""))
        if src is None:
            continue
        lat, lon = src.at(tr.t)
        total += float(haversine_m_array(lat, lon, tr.lat, tr.lon).sum())
        points += len(tr)
    return total / points if points else 0.0


def _rows(
    target: str,
    originals: Sequence[Trajectory],
    published: Sequence[Trajectory],
    truth: Mapping[str, str],
    *,
    k: int,
    delta_m: float,
    ms: Sequence[int],
    victims: Sequence[int],
    seed: int,
    translation: float | None,
) -> list[LinkageRow]:
    from kcloak.cloaking.attacks.base import tolerance

    rows: list[LinkageRow] = []
    for m in ms:
        r = KnownPointsLinkage(m=m, resolution_m=delta_m, seed=seed).assess_risk(
            originals, published, truth, target=target, victims=victims
        )
        rows.append(
            LinkageRow(
                target,
                m,
                r.reidentification_rate if r.trials else None,
                r.trials,
                1.0 / k,
                r.suppressed,
                float(np.median(r.candidates)) if r.trials else None,
                translation,
                tolerance(1.0 / k, r.trials),
            )
        )
    return rows


def check_audit_params(*, k: int, delta_m: float, ms: Sequence[int], methods: Sequence[str]) -> None:
    """The parameter checks of ``kcloak audit trajectories`` (and of :func:`kcloak.audit`): :class:`LinkageError`
    naming the option as the command line spells it."""
    from kcloak.streams.publish import METHODS

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise LinkageError("--k: must be at least 1")
    if not (math.isfinite(delta_m) and delta_m >= 0):
        raise LinkageError("--delta: must be a finite number of metres ≥ 0")
    if not ms:
        raise LinkageError("--m: give at least one value")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in ms):
        raise LinkageError("--m: every m must be at least 1")
    for method in methods:
        if method not in METHODS:
            raise LinkageError(f"--methods: unknown method {method!r} (known: {', '.join(METHODS)})")


def audit_seed(seed: int | None) -> int:
    """The seed an audit runs with: ``seed`` (≥ 0) or a random one, which the report then records."""
    import secrets

    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise LinkageError("--seed: must be non-negative")
    return seed if seed is not None else secrets.randbelow(2**31)


def audit_trajectories(
    original: Any,
    published: Any,
    *,
    k: int,
    delta_m: float,
    ms: Sequence[int] = (1, 2, 3),
    mapping: Mapping[str, str] | None = None,
    methods: Sequence[str] = (),
    seed: int = 0,
    victims: int = DEFAULT_VICTIMS,
    progress: Any = None,
) -> TrajectoryAudit:
    r"""``kcloak audit trajectories`` (contract §9): verify PUBLISHED, then the km linkage of §7.6.

    ``original`` and ``published`` are :class:`~kcloak.core.readers.FixTable`\ s. (k,δ) is verified from
    the published rows alone with the independent verifier (§9.6). The linkage runs against the
    raw data (``raw``), against PUBLISHED when ``mapping`` (published id → traj_id) gives the
    ground truth (``published``), and against each of ``methods`` run here on ORIGINAL.
    """
    from kcloak.streams.publish import METHODS, anonymize
    from kcloak.streams.quality import verify_k_delta
    from kcloak.streams.trajectory import split_too_short, trajectories_from_fixes

    def step(what: str) -> None:
        if progress is not None:
            progress(what)

    if k < 1 or not delta_m >= 0 or not ms or any(m < 1 for m in ms):
        raise LinkageError("k ≥ 1, delta ≥ 0 and every m ≥ 1 are required")
    step("verifying (k,δ)")
    verdict = verify_k_delta(published, k, delta_m)
    originals, _ = split_too_short(trajectories_from_fixes(original))
    if not originals:
        raise LinkageError("original: no trajectory with at least 2 distinct instants")
    chosen = victim_sample(len(originals), victims, seed)
    notes: list[str] = []
    if len(originals) > victims:
        notes.append(f"victims: a seeded sample of {victims} of {len(originals)} original trajectories")
    rows: list[LinkageRow] = []
    step("linkage against the raw data")
    rows += _rows(
        "raw",
        originals,
        originals,
        {tr.traj_id: tr.traj_id for tr in originals},
        k=k,
        delta_m=delta_m,
        ms=ms,
        victims=chosen,
        seed=seed,
        translation=0.0,
    )
    if mapping is not None:
        pub = trajectories_from_fixes(published)
        known = {tr.traj_id for tr in originals}
        if mapping and not any(v in known for v in mapping.values()):
            raise LinkageError("mapping: no traj_id of the mapping names an original trajectory")
        step("linkage against PUBLISHED")
        rows += _rows(
            "published",
            originals,
            pub,
            mapping,
            k=k,
            delta_m=delta_m,
            ms=ms,
            victims=chosen,
            seed=seed,
            translation=mean_translation_m(originals, pub, mapping),
        )
    else:
        notes.append("published: no --mapping, so no ground truth; only (k,δ) was verified")
    for method in methods:
        if method not in METHODS:
            notes.append(f"{method}: not available in this version; skipped")
            continue
        step(f"anonymizing with {method}")
        release = anonymize(original, method=method, k=k, delta_m=delta_m, seed=seed)
        if not release.ok:
            notes.append(f"{method}: anonymization failed (too few trajectories or trash over the bound)")
            continue
        step(f"linkage against {method}")
        rows += _rows(
            method,
            originals,
            trajectories_from_fixes(release.table),
            release.mapping,
            k=k,
            delta_m=delta_m,
            ms=ms,
            victims=chosen,
            seed=seed,
            translation=float(release.report.get("mean_translation_m") or 0.0),
        )
    return TrajectoryAudit(
        verdict.ok,
        tuple((t, str(v)) for t, v in verdict.failures),
        len(verdict.warnings),
        verdict.n_trajectories,
        tuple(rows),
        tuple(notes),
    )


def write_trajectory_figures(audit: TrajectoryAudit, directory: Any) -> list[str]:
    """``linkage.png`` (re-identification per target and m against 1/k) and ``frontier.png`` (vs translation)."""
    from pathlib import Path

    require_pictures()
    import matplotlib.pyplot as plt

    out = Path(directory)
    rows = [r for r in audit.rows if r.reidentification_rate is not None]
    targets = list(dict.fromkeys(r.target for r in rows))
    ms = sorted({r.m for r in rows})
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / max(1, len(ms))
    for j, m in enumerate(ms):
        vals = [
            next((r.reidentification_rate or 0.0 for r in rows if r.target == t and r.m == m), np.nan) for t in targets
        ]
        errs = [next((r.tolerance or 0.0 for r in rows if r.target == t and r.m == m), 0.0) for t in targets]
        ax.bar(
            np.arange(len(targets)) + (j - (len(ms) - 1) / 2) * width, vals, width, yerr=errs, capsize=2, label=f"m={m}"
        )
    if rows:
        ax.axhline(rows[0].baseline, color="k", linestyle="dashed", linewidth=0.8, label="1/k")
    ax.set_xticks(np.arange(len(targets)), targets)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("re-identification rate")
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.95)
    fig.savefig(out / "linkage.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for m in ms:
        pts = sorted((r.mean_translation_m or 0.0, r.reidentification_rate or 0.0, r.target) for r in rows if r.m == m)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"m={m}")
        for x, y, t in pts:
            ax.annotate(t, (x, y), fontsize=7)
    if rows:
        ax.axhline(rows[0].baseline, color="k", linestyle="dashed", linewidth=0.8, label="1/k")
    ax.set_xlabel("mean translation (m)")
    ax.set_ylabel("re-identification rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.95)
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
    return ["linkage.png", "frontier.png"]


__all__ = [
    "DEFAULT_VICTIMS",
    "KnownPointsLinkage",
    "LinkageError",
    "LinkageRisk",
    "LinkageRow",
    "TrajectoryAudit",
    "audit_seed",
    "audit_trajectories",
    "check_audit_params",
    "mean_translation_m",
    "victim_sample",
    "write_trajectory_figures",
]
