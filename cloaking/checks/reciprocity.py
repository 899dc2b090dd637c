"""Black-box attack evaluators over the ``Cloaker`` protocol (CONCEPTS §6.1, §6.3, §6.8).

``candidate_sets`` is the policy-aware inversion of §6.3: the attacker knows the algorithm, the
snapshot and every stored profile, re-runs ``cloak`` for every present user and keeps, for a
forwarded region R, the candidate set C(R) = {v : region(v) == R} (§1.5). ``centre_guess`` is the
identity version of the centre-of-region attack of §6.1: guess the present user nearest to the
bbox centre. Both only call the public ``cloak``; they know nothing of the algorithms.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.checks.regions import haversine_m, join_override
from kcloak.cloaking.cloakers.base import Cloaker
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox
from kcloak.core.profile import PrivacyProfile

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


def wilson_interval(successes: float, trials: int, confidence: float = 0.999) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion at two-sided ``confidence`` (§6.8)."""
    if trials <= 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)
    hi = 1.0 if successes >= trials else min(1.0, centre + half)
    return lo, hi


def stored_profiles(view: IndexView, default: PrivacyProfile | None = None) -> list[PrivacyProfile]:
    """Stored profiles of every view row from the view's ``k``/``min_area_m2``/``max_area_m2`` columns.

    The other fields come from ``default`` (contract defaults); ``max_area_m2`` is raised to the
    user's ``min_area_m2`` where needed so that every profile is valid.
    """
    base = default if default is not None else PrivacyProfile()
    return [
        PrivacyProfile(
            k=int(k),
            l=base.l,
            min_area_m2=float(a),
            max_area_m2=max(float(b), float(a)),
            max_delay_s=base.max_delay_s,
        )
        for k, a, b in zip(view.k.tolist(), view.min_area_m2.tolist(), view.max_area_m2.tolist(), strict=True)
    ]


def _effective(stored: PrivacyProfile, override: Mapping[str, Any] | None) -> PrivacyProfile | None:
    """``stored`` made at least as strict as ``override`` (None: that user cannot send it)."""
    out = join_override(stored, override)
    return out if isinstance(out, PrivacyProfile) else None


def _regions(
    cloaker: Cloaker, view: IndexView, profiles: Sequence[PrivacyProfile], override: Mapping[str, Any] | None
) -> tuple[list[BBox | None], list[int]]:
    """Every present user's region (None when refused or unable to send) and requested k."""
    boxes: list[BBox | None] = []
    ks: list[int] = []
    for row in range(len(view)):
        eff = _effective(profiles[row], override)
        if eff is None:
            boxes.append(None)
            ks.append(0)
            continue
        result = cloaker.cloak(view, row, eff)
        boxes.append(getattr(result, "bbox", None))
        ks.append(eff.k)
    return boxes, ks


@dataclass(frozen=True, slots=True, eq=False)
class CandidateSets:
    """§6.3 over a set of requests: ``size[i]`` = |C(R)| for the request of view row ``rows[i]``."""

    algorithm: str
    rows: I64
    k: I64
    size: I64
    refused: int

    @property
    def trials(self) -> int:
        return len(self.rows)

    @property
    def violations(self) -> int:
        """Requests whose candidate set is smaller than their requested k."""
        return int(np.count_nonzero(self.size < self.k))

    @property
    def k_violation_rate(self) -> float:
        """P[|C(R)| < k] over the answered requests (§6.8); 0 when nothing was answered."""
        return self.violations / self.trials if self.trials else 0.0

    @property
    def success_rate(self) -> float:
        """Mean identification probability 1/|C(R)| of the policy-aware attacker."""
        return float(np.mean(1.0 / self.size)) if self.trials else 0.0

    @property
    def baseline(self) -> float:
        """Mean 1/k of the answered requests."""
        return float(np.mean(1.0 / self.k)) if self.trials else 0.0

    def histogram(self) -> dict[int, int]:
        """Distribution of |C(R)|."""
        values, counts = np.unique(self.size, return_counts=True)
        return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}


def candidate_sets(
    cloaker: Cloaker,
    view: IndexView,
    *,
    profiles: Sequence[PrivacyProfile] | None = None,
    rows: Sequence[int] | None = None,
    override: Mapping[str, Any] | None = None,
) -> CandidateSets:
    """Candidate-set sizes (§1.5, §6.3) for the requests of ``rows`` (default: every present user).

    ``profiles`` are the stored profiles by view row (default: :func:`stored_profiles`); every
    request, and every user the attacker re-runs, sends ``override`` joined with its own stored
    profile (:func:`~kcloak.cloaking.checks.regions.join_override`; None: its stored profile).
    One ``cloak`` call per present user: C(R) is the group of users sharing the region R.
    """
    stored = profiles if profiles is not None else stored_profiles(view)
    boxes, ks = _regions(cloaker, view, stored, override)
    counts = Counter(b for b in boxes if b is not None)
    asked = range(len(view)) if rows is None else rows
    out_rows: list[int] = []
    out_k: list[int] = []
    out_size: list[int] = []
    refused = 0
    for r in asked:
        b = boxes[r]
        if b is None:
            refused += 1
            continue
        out_rows.append(r)
        out_k.append(ks[r])
        out_size.append(counts[b])
    return CandidateSets(
        cloaker.name,
        np.asarray(out_rows, dtype=np.int64),
        np.asarray(out_k, dtype=np.int64),
        np.asarray(out_size, dtype=np.int64),
        refused,
    )


@dataclass(frozen=True, slots=True, eq=False)
class CentreGuess:
    """§6.1 identity guess: ``hit[i]`` is the probability the guess names the querier of request ``i``.

    The attacker guesses the present user nearest to the bbox centre (haversine, contract §0),
    uniformly among ties, so ``hit`` is 0 or 1 unless positions tie.
    """

    algorithm: str
    rows: I64
    k: I64
    hit: F64
    refused: int

    @property
    def trials(self) -> int:
        return len(self.rows)

    @property
    def successes(self) -> float:
        return float(np.sum(self.hit))

    @property
    def success_rate(self) -> float:
        return self.successes / self.trials if self.trials else 0.0

    @property
    def baseline(self) -> float:
        """Mean 1/k of the answered requests (§6.8)."""
        return float(np.mean(1.0 / self.k)) if self.trials else 0.0

    def interval(self, confidence: float = 0.999) -> tuple[float, float]:
        """Wilson interval of the success rate."""
        return wilson_interval(self.successes, self.trials, confidence)


def centre_guess(
    cloaker: Cloaker,
    view: IndexView,
    *,
    rows: Sequence[int] | None = None,
    profiles: Sequence[PrivacyProfile] | None = None,
) -> CentreGuess:
    """Run the centre-of-region identity guess on the requests of ``rows`` (default: everyone)."""
    stored = profiles if profiles is not None else stored_profiles(view)
    asked = range(len(view)) if rows is None else rows
    nearest_of: dict[BBox, set[int]] = {}
    out_rows: list[int] = []
    out_k: list[int] = []
    hits: list[float] = []
    refused = 0
    for r in asked:
        result = cloaker.cloak(view, r, stored[r])
        bbox = getattr(result, "bbox", None)
        if not isinstance(bbox, BBox):
            refused += 1
            continue
        nearest = nearest_of.get(bbox)
        if nearest is None:
            lon0, lat0, lon1, lat1 = bbox.to_geojson()
            d = haversine_m((lat0 + lat1) / 2, (lon0 + lon1) / 2, view.lat, view.lon)
            nearest = set(np.flatnonzero(d == d.min()).tolist())
            nearest_of[bbox] = nearest
        out_rows.append(r)
        out_k.append(stored[r].k)
        hits.append(1.0 / len(nearest) if r in nearest else 0.0)
    return CentreGuess(
        cloaker.name,
        np.asarray(out_rows, dtype=np.int64),
        np.asarray(out_k, dtype=np.int64),
        np.asarray(hits, dtype=np.float64),
        refused,
    )
