"""Attacks on one forwarded request (CONCEPTS §6.1, §6.2, §6.4, §6.6).

Each class is one attacker, its constructor the attacker's knowledge. Where the attacker knows
the algorithm and every position (K1 + K2, §1.2) it is *policy-aware*: it first narrows the
candidates to C(R) = {v : region(v) == R} (§1.5, the §6.3 inversion) and then applies its rule
inside C(R); with ``policy_aware=False`` it works on the users strictly inside R instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kcloak.cloaking.attacks.base import (
    F64,
    I64,
    AttackError,
    AttackName,
    CloakedWorld,
    CloakingAttack,
    Risk,
    Target,
    nan_mean,
)
from kcloak.core.geometry import EARTH_RADIUS_M, UDEG_PER_DEG, haversine_m_array

M_PER_DEG = EARTH_RADIUS_M * np.pi / 180.0


def _pool(data: CloakedWorld, frame: int, row: int, policy_aware: bool) -> I64:
    fwd = data.forwarded[frame]
    if policy_aware:
        return fwd.candidates(row)
    return data.inside(frame, fwd.bbox[row])


def edge_distance_m(lat: F64, lon: F64, bbox: I64) -> F64:
    """Distance (m, local equirectangular) from each point to the nearest side of its box ``bbox`` (n × 4 µdeg)."""
    b = np.asarray(bbox, np.float64).reshape(-1, 4) / UDEG_PER_DEG
    d_lat = np.minimum(np.abs(lat - b[:, 1]), np.abs(b[:, 3] - lat)) * M_PER_DEG
    d_lon = np.minimum(np.abs(lon - b[:, 0]), np.abs(b[:, 2] - lon)) * M_PER_DEG * np.cos(np.radians(lat))
    out: F64 = np.minimum(d_lat, d_lon)
    return out


class CentreGuess(CloakingAttack):
    """§6.1 identity version: the querier is the candidate nearest to the centre of R (ties: uniform).

    Keyword arguments:
        policy_aware: candidates C(R) (K1 + K2, default) or every user inside R (K2).

    :func:`kcloak.cloaking.checks.centre_guess` is the same rule over every present user for one cloaker
    call per request; this class reads the regions already forwarded for everyone (it needs them
    for C(R)) and works on the candidate pool instead.
    """

    name = AttackName.CENTRE

    def __init__(self, *, policy_aware: bool = True) -> None:
        self.policy_aware = policy_aware

    def assess_risk(self, data: CloakedWorld, targets: Sequence[Target]) -> Risk:
        risk: list[float] = []
        done: list[Target] = []
        answered, refused = self._forwarded(data, targets)
        for tg, row in answered:
            fwd = data.forwarded[tg.frame]
            pool = _pool(data, tg.frame, row, self.policy_aware)
            b = fwd.bbox[row].astype(np.float64) / UDEG_PER_DEG
            view = data.world.frames[tg.frame]
            d = haversine_m_array((b[1] + b[3]) / 2, (b[0] + b[2]) / 2, view.lat[pool], view.lon[pool])
            nearest = pool[d == d.min()] if len(pool) else pool
            done.append(tg)
            risk.append(1.0 / len(nearest) if row in nearest else 0.0)
        return self._risk(data, done, risk, refused)


class BoundaryGuess(CloakingAttack):
    """§6.2: guess among the candidates on (or off) the sides of R, whichever the algorithm favours.

    A candidate is a *boundary user* when it lies within ``edge_m`` of a side of R (an MBR puts
    its extreme members there, to ≈ 0.1 m after outward rounding). The attacker, knowing the
    algorithm and the positions, first learns from the whole snapshot how often a user lies on the
    boundary of its own region (fraction f, by re-running the algorithm for everyone — no ground
    truth about queriers is used). For a region with boundary candidates B and inner candidates
    I it then guesses uniformly in B when f/|B| ≥ (1 − f)/|I|, else in I.

    Keyword arguments:
        policy_aware: candidates C(R) (default) or every user inside R.
        edge_m: distance to a side that makes a boundary user (default 1 m).
    """

    name = AttackName.BOUNDARY

    def __init__(self, *, policy_aware: bool = True, edge_m: float = 1.0) -> None:
        if not edge_m >= 0:
            raise AttackError("edge_m: must be ≥ 0")
        self.policy_aware = policy_aware
        self.edge_m = edge_m

    def _prior(self, data: CloakedWorld, frame: int) -> float:
        fwd = data.forwarded[frame]
        rows = np.flatnonzero(fwd.ok)
        if not len(rows):
            return 0.5
        view = data.world.frames[frame]
        d = edge_distance_m(view.lat[rows], view.lon[rows], fwd.bbox[rows])
        return float(np.mean(d <= self.edge_m))

    def assess_risk(self, data: CloakedWorld, targets: Sequence[Target]) -> Risk:
        priors: dict[int, float] = {}
        risk: list[float] = []
        done: list[Target] = []
        boundary_share: list[float] = []
        answered, refused = self._forwarded(data, targets)
        for tg, row in answered:
            fwd = data.forwarded[tg.frame]
            if tg.frame not in priors:
                priors[tg.frame] = self._prior(data, tg.frame)
            f = priors[tg.frame]
            pool = _pool(data, tg.frame, row, self.policy_aware)
            view = data.world.frames[tg.frame]
            on = edge_distance_m(view.lat[pool], view.lon[pool], np.tile(fwd.bbox[row], (len(pool), 1))) <= self.edge_m
            b_set, i_set = pool[on], pool[~on]
            if not len(b_set):
                guess = i_set
            elif not len(i_set):
                guess = b_set
            else:
                guess = b_set if f / len(b_set) >= (1 - f) / len(i_set) else i_set
            done.append(tg)
            boundary_share.append(len(b_set) / len(pool) if len(pool) else 0.0)
            risk.append(1.0 / len(guess) if row in guess else 0.0)
        return self._risk(
            data,
            done,
            risk,
            refused,
            {
                "boundary_fraction_mean": nan_mean(boundary_share),
                "querier_boundary_prior_mean": nan_mean(list(priors.values())),
            },
        )


class ObservationIdentification(CloakingAttack):
    """§6.4 (S003 §4.3, after Gedik & Liu): the attacker saw where a fraction of the users stand.

    At every frame a seeded random ``observed_fraction`` of the present users is observed; for a
    region the attacker guesses uniformly among the observed users inside it (none → failure).

    Keyword arguments:
        observed_fraction: share of users observed (contract default 0.1).
        seed: seed of who is observed.
    """

    name = AttackName.OBSERVATION

    def __init__(self, *, observed_fraction: float = 0.1, seed: int = 0) -> None:
        if not 0.0 <= observed_fraction <= 1.0:
            raise AttackError("observed_fraction: must be within [0, 1]")
        self.observed_fraction = observed_fraction
        self.seed = seed

    def observed(self, data: CloakedWorld, frame: int) -> np.ndarray:
        n = len(data.world.frames[frame])
        rng = np.random.default_rng([self.seed, frame, 11])
        return rng.random(n) < self.observed_fraction

    def assess_risk(self, data: CloakedWorld, targets: Sequence[Target]) -> Risk:
        seen: dict[int, np.ndarray] = {}
        risk: list[float] = []
        done: list[Target] = []
        no_guess = 0
        answered, refused = self._forwarded(data, targets)
        for tg, row in answered:
            fwd = data.forwarded[tg.frame]
            if tg.frame not in seen:
                seen[tg.frame] = self.observed(data, tg.frame)
            inside = data.inside(tg.frame, fwd.bbox[row])
            obs = inside[seen[tg.frame][inside]]
            done.append(tg)
            no_guess += int(len(obs) == 0)
            risk.append(1.0 / len(obs) if row in obs else 0.0)
        return self._risk(
            data, done, risk, refused, {"no_observed_user_fraction": no_guess / len(done) if done else None}
        )


class RestrictedSpaceIdentification(CloakingAttack):
    """§6.4: the attacker knows every user's home; a region holding exactly one home names its owner.

    Homes come with the world (synthetic: drawn by the generator; traces: stay points, see
    :mod:`kcloak.cloaking.audit`). A home counts when it lies inside the closed box R.
    """

    name = AttackName.RESTRICTED_SPACE

    def assess_risk(self, data: CloakedWorld, targets: Sequence[Target]) -> Risk:
        homes = data.world.homes
        known = np.flatnonzero(np.isfinite(homes[:, 0]))
        if not len(known):
            raise AttackError("restricted_space: the world has no known homes")
        h_lat_u = np.round(homes[known, 0] * UDEG_PER_DEG)
        h_lon_u = np.round(homes[known, 1] * UDEG_PER_DEG)
        risk: list[float] = []
        done: list[Target] = []
        single = 0
        answered, refused = self._forwarded(data, targets)
        for tg, row in answered:
            fwd = data.forwarded[tg.frame]
            b = fwd.bbox[row]
            hit = known[(h_lon_u >= b[0]) & (h_lon_u <= b[2]) & (h_lat_u >= b[1]) & (h_lat_u <= b[3])]
            done.append(tg)
            single += int(len(hit) == 1)
            risk.append(1.0 if len(hit) == 1 and int(hit[0]) == tg.user else 0.0)
        return self._risk(data, done, risk, refused, {"single_home_fraction": single / len(done) if done else None})


class Homogeneity(CloakingAttack):
    """§6.6: every user counted in R stands at the same kind of place → the querier's context leaks.

    Each present user takes the category of the nearest place of the places layer within
    ``radius_m`` (contract §8's stay-point rule), or none. The attack succeeds on a region when all
    users inside share one category (none does not count). This is attribute disclosure, not
    identification; it is reported next to 1/k like every audit.

    Keyword arguments:
        radius_m: largest distance to a place (default 100 m).
    """

    name = AttackName.HOMOGENEITY

    def __init__(self, *, radius_m: float = 100.0) -> None:
        if not radius_m > 0:
            raise AttackError("radius_m: must be positive")
        self.radius_m = radius_m

    def categories(self, data: CloakedWorld, frame: int) -> I64:
        """Category code of each view row of ``frame`` (−1: no place within ``radius_m``)."""
        from scipy.spatial import cKDTree

        places = data.world.places
        view = data.world.frames[frame]
        if places is None:
            raise AttackError("homogeneity: the world has no places layer")
        lat0 = float(np.mean(places.lat)) if len(places) else 0.0
        c = np.cos(np.radians(lat0))
        tree = cKDTree(np.column_stack([places.lat * M_PER_DEG, places.lon * M_PER_DEG * c]))
        d, i = tree.query(np.column_stack([view.lat * M_PER_DEG, view.lon * M_PER_DEG * c]))
        out: I64 = np.where(d <= self.radius_m, places.category_code[np.minimum(i, len(places) - 1)], -1).astype(
            np.int64
        )
        return out

    def assess_risk(self, data: CloakedWorld, targets: Sequence[Target]) -> Risk:
        cats: dict[int, I64] = {}
        risk: list[float] = []
        done: list[Target] = []
        top_share: list[float] = []
        answered, refused = self._forwarded(data, targets)
        for tg, row in answered:
            fwd = data.forwarded[tg.frame]
            if tg.frame not in cats:
                cats[tg.frame] = self.categories(data, tg.frame)
            inside = cats[tg.frame][data.inside(tg.frame, fwd.bbox[row])]
            known = inside[inside >= 0]
            share = float(np.bincount(known).max()) / len(inside) if len(known) else 0.0
            done.append(tg)
            top_share.append(share)
            risk.append(1.0 if len(inside) and share == 1.0 else 0.0)
        return self._risk(data, done, risk, refused, {"max_category_share_mean": nan_mean(top_share)})


__all__ = [
    "BoundaryGuess",
    "CentreGuess",
    "Homogeneity",
    "ObservationIdentification",
    "RestrictedSpaceIdentification",
    "edge_distance_m",
]
