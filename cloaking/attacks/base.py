"""What every cloaking attack shares: the attacker's view of forwarded requests, risk, tolerance (CONCEPTS §6, §6.8).

An attack (STYLE: scikit-mobility's ``assess_risk(data, targets)``) is a class parameterized by
the attacker's background knowledge (§1.2). ``data`` is a :class:`CloakedWorld`: the positions
of every user over a few instants (frames), the region the audited algorithm forwards for
every present user at every frame, and the side knowledge of the scenario (homes, places).
``targets`` are the requests under attack; the outcome is a :class:`Risk` holding, per target,
the probability that the attacker names the querier (or, for attribute attacks, learns the
querier's sensitive context), next to the 1/k baseline of §6.8.
"""

from __future__ import annotations

import enum
import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.checks.reciprocity import wilson_interval
from kcloak.cloaking.errors import CloakingError
from kcloak.cloaking.index import IndexView
from kcloak.core.errors import InputError
from kcloak.core.geometry import UDEG_PER_DEG, BBox
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

DEFAULT_CONFIDENCE = 0.999
"""Two-sided confidence of the Wilson bound behind every tolerance (§6.8)."""


class AttackName(enum.StrEnum):
    """Audit names of contract §9 (``audit cloaking`` rows)."""

    CENTRE = "centre"
    BOUNDARY = "boundary"
    OBSERVATION = "observation"
    RESTRICTED_SPACE = "restricted_space"
    QUERY_TRACKING_NAIVE = "query_tracking_naive"
    QUERY_TRACKING_SESSION = "query_tracking_session"
    HOMOGENEITY = "homogeneity"


class AttackError(CloakingError, InputError, ValueError):
    """An attack that cannot run on the given data (missing background knowledge, bad parameter)."""


def tolerance(baseline: float, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """How far a success rate measured over ``trials`` requests may exceed ``baseline`` by chance alone.

    The upper end of the Wilson score interval (§6.8) of a binomial proportion equal to
    ``baseline`` over ``trials``, minus ``baseline``. Per-request risks lie in [0, 1] with mean p,
    so their variance is at most p(1 − p): the binomial bound is conservative for them too.
    A defence holds when ``success_rate ≤ baseline + tolerance``.
    """
    if trials <= 0:
        return 1.0
    _, hi = wilson_interval(baseline * trials, trials, confidence)
    return max(0.0, hi - baseline)


def z_of(confidence: float) -> float:
    """Two-sided normal quantile of ``confidence``."""
    return statistics.NormalDist().inv_cdf(1 - (1 - confidence) / 2)


# -- the data an attack reads -----------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # not slotted: lazily cached derived columns
class World:
    """Users over time: ``frames[f]`` is the snapshot (§2.4) of the users present at frame ``f``.

    ``present[f][row]`` is the global index (into ``user_ids``) of view row ``row`` of frame ``f``.
    ``homes`` (n_users × 2, lat/lon, NaN = unknown) and ``places`` are the background knowledge of
    restricted-space (§6.4) and homogeneity (§6.6) attackers; ``description`` goes into reports.
    """

    user_ids: tuple[str, ...]
    frames: tuple[IndexView, ...]
    present: tuple[I64, ...]
    homes: F64
    places: PlacesLayer | None
    description: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.frames) != len(self.present):
            raise ValueError("World: one present-array per frame")
        for view, glob in zip(self.frames, self.present, strict=True):
            if len(view) != len(glob):
                raise ValueError("World: present[f] must map every view row of frame f")
        if self.homes.shape != (len(self.user_ids), 2):
            raise ValueError("World: homes must be (n_users, 2)")

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    @cached_property
    def row_of_user(self) -> tuple[I64, ...]:
        """Per frame: global user index → view row (−1 when absent)."""
        out: list[I64] = []
        for glob in self.present:
            m = np.full(self.n_users, -1, np.int64)
            m[glob] = np.arange(len(glob))
            out.append(m)
        return tuple(out)


@dataclass(frozen=True, eq=False)  # not slotted: lazily cached groups and areas
class Forwarded:
    """What the algorithm forwards at one frame for every present user (view rows).

    ``bbox`` holds micro-degree edges ``[min_lon, min_lat, max_lon, max_lat]`` (undefined where
    ``ok`` is false: refused or expired). ``group[row]`` numbers the distinct regions (−1 when
    refused): the policy-aware candidate set of §1.5, C(R) = {v : region(v) == R}, is the rows of
    one group.
    """

    bbox: I64
    ok: npt.NDArray[np.bool_]

    @cached_property
    def group(self) -> I64:
        g = np.full(len(self.ok), -1, np.int64)
        rows = np.flatnonzero(self.ok)
        if len(rows):
            _, inv = np.unique(self.bbox[rows], axis=0, return_inverse=True)
            g[rows] = inv.reshape(-1)
        return g

    @cached_property
    def members(self) -> list[I64]:
        """Rows of each group (index = group number)."""
        g = self.group
        rows = np.flatnonzero(g >= 0)
        order = rows[np.argsort(g[rows], kind="stable")]
        counts = np.bincount(g[rows]) if len(rows) else np.zeros(0, np.int64)
        return list(np.split(order, np.cumsum(counts)[:-1])) if len(rows) else []

    def candidates(self, row: int) -> I64:
        """C(R) of the region forwarded for ``row`` (empty when refused)."""
        g = int(self.group[row])
        return self.members[g] if g >= 0 else np.empty(0, np.int64)

    def box(self, row: int) -> BBox:
        b = self.bbox[row]
        return BBox(int(b[0]), int(b[1]), int(b[2]), int(b[3]))

    @cached_property
    def area_m2(self) -> F64:
        """Contract area of every forwarded region (NaN where refused)."""
        from kcloak.core.geometry import bbox_area_m2_array

        b = self.bbox.astype(np.float64) / UDEG_PER_DEG
        a = np.asarray(bbox_area_m2_array(b[:, 0], b[:, 1], b[:, 2], b[:, 3]), dtype=np.float64)
        return np.where(self.ok, a, np.nan)


def box_udeg(box: BBox) -> tuple[int, int, int, int]:
    """``(min_lon, min_lat, max_lon, max_lat)`` in micro-degrees."""
    return box.min_lon_udeg, box.min_lat_udeg, box.max_lon_udeg, box.max_lat_udeg


Session = Callable[[int, int], list[tuple[int, BBox]]]
"""``session(start_frame, user)`` → the ``(frame, bbox)`` pairs a continuous session forwards."""


@dataclass(frozen=True, slots=True, eq=False)
class CloakedWorld:
    """The data of ``assess_risk``: a world, the audited algorithm at one ``k``, its forwarded regions.

    ``session`` runs a continuous query with k-sharing and memorization (§6.5) for the
    query-tracking attacks; None when the algorithm cannot start sessions.
    """

    world: World
    algorithm: str
    profile: PrivacyProfile
    forwarded: tuple[Forwarded, ...]
    session: Session | None = None
    _inside: dict[tuple[int, bytes], I64] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return self.profile.k

    def inside(self, frame: int, bbox: I64 | BBox) -> I64:
        """View rows of ``frame`` strictly inside a forwarded region (exact, contract §0)."""
        box = bbox if isinstance(bbox, BBox) else BBox(int(bbox[0]), int(bbox[1]), int(bbox[2]), int(bbox[3]))
        key = (frame, np.array(box_udeg(box), np.int64).tobytes())
        hit = self._inside.get(key)
        if hit is None:
            hit = self.world.frames[frame].rows_in(box)
            self._inside[key] = hit
        return hit


@dataclass(frozen=True, slots=True)
class Target:
    """A request under attack: the user (global index) querying at ``frame`` (first frame of a session)."""

    frame: int
    user: int


@dataclass(frozen=True, slots=True, eq=False)
class Risk:
    """Per-target outcome of one attack (§6.8): ``risk[i]`` = P(attacker names the querier of target i).

    Targets whose request was refused (nothing forwarded) are not trials; they are counted in
    ``refused``. ``extra`` carries attack-specific metrics (e.g. tracking survival).
    """

    attack: AttackName
    targets: tuple[Target, ...]
    risk: F64
    k: I64
    refused: int
    extra: Mapping[str, float | int | None] = field(default_factory=dict)

    @property
    def trials(self) -> int:
        return len(self.risk)

    @property
    def success_rate(self) -> float:
        return float(np.mean(self.risk)) if self.trials else 0.0

    @property
    def baseline(self) -> float:
        """Mean 1/k of the attacked requests (§6.8)."""
        return float(np.mean(1.0 / self.k)) if self.trials else 0.0

    @property
    def tolerance(self) -> float:
        return tolerance(self.baseline, self.trials)

    def holds(self) -> bool:
        """The defence holds: success within the sampling tolerance of 1/k."""
        return self.success_rate <= self.baseline + self.tolerance

    def interval(self, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
        """Wilson interval of the success rate."""
        return wilson_interval(float(np.sum(self.risk)), self.trials, confidence)


class CloakingAttack(ABC):
    """One attack of §6 on forwarded regions; subclasses set ``name`` and implement ``assess_risk``."""

    name: ClassVar[AttackName]

    @abstractmethod
    def assess_risk(self, data: CloakedWorld, targets: Sequence[Target]) -> Risk:
        """Attack the requests of ``targets``; risk per target."""

    @staticmethod
    def _forwarded(data: CloakedWorld, targets: Sequence[Target]) -> tuple[list[tuple[Target, int]], int]:
        """The targets whose request was forwarded, each with its querier's row; and how many were refused."""
        answered: list[tuple[Target, int]] = []
        refused = 0
        for tg in targets:
            row = int(data.world.row_of_user[tg.frame][tg.user])
            if row < 0 or not data.forwarded[tg.frame].ok[row]:
                refused += 1
            else:
                answered.append((tg, row))
        return answered, refused

    def _risk(
        self,
        data: CloakedWorld,
        targets: Sequence[Target],
        risk: Sequence[float],
        refused: int,
        extra: Mapping[str, float | int | None] | None = None,
    ) -> Risk:
        return Risk(
            self.name,
            tuple(targets),
            np.asarray(risk, np.float64),
            np.full(len(risk), data.k, np.int64),
            refused,
            dict(extra or {}),
        )


def nan_mean(values: Sequence[float]) -> float | None:
    """Mean of a possibly empty sequence (None when empty)."""
    return float(np.mean(values)) if len(values) else None


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


__all__ = [
    "DEFAULT_CONFIDENCE",
    "AttackError",
    "AttackName",
    "CloakedWorld",
    "CloakingAttack",
    "Forwarded",
    "Risk",
    "Session",
    "Target",
    "World",
    "box_udeg",
    "finite_or_none",
    "nan_mean",
    "tolerance",
    "z_of",
]
