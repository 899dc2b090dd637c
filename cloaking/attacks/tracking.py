"""Query tracking on continuous queries (CONCEPTS §6.5; Chow & Mokbel, SSTD 2007).

Knowledge K2 + K3 (§1.2): the attacker links the successive requests of one continuous query
(by timing or overlap — kcloak sends no linking identifier) and knows who stood inside each
region; it intersects those user sets, C_n = ⋂_i users(R_i, S_{t_i}), and guesses uniformly in
C_n. Success = 1/|C_n| (the querier is inside every region it sends). ``query_tracking_naive``
re-cloaks every refresh independently; ``query_tracking_session`` uses k-sharing with
memorization (contract §6), whose regions keep every present member of the group inside.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kcloak.cloaking.attacks.base import (
    AttackError,
    AttackName,
    CloakedWorld,
    CloakingAttack,
    Risk,
    Target,
    box_udeg,
    nan_mean,
)
from kcloak.core.geometry import BBox


def _track(data: CloakedWorld, regions: Sequence[tuple[int, BBox]]) -> set[int]:
    """Global users inside every region of one tracked query."""
    common: set[int] | None = None
    for frame, box in regions:
        rows = data.inside(frame, np.asarray(box_udeg(box), np.int64))
        users = set(data.world.present[frame][rows].tolist())
        common = users if common is None else common & users
    return common if common is not None else set()


class _Tracking(CloakingAttack):
    """Shared bookkeeping: ``refreshes`` frames per tracked query, from the target's frame on."""

    def __init__(self, *, refreshes: int | None = None) -> None:
        if refreshes is not None and refreshes < 1:
            raise AttackError("refreshes: must be at least 1")
        self.refreshes = refreshes

    def _frames(self, data: CloakedWorld, start: int) -> range:
        end = len(data.world.frames) if self.refreshes is None else min(len(data.world.frames), start + self.refreshes)
        return range(start, end)

    def regions(self, data: CloakedWorld, target: Target) -> list[tuple[int, BBox]]:
        raise NotImplementedError

    def assess_risk(self, data: CloakedWorld, targets: Sequence[Target]) -> Risk:
        risk: list[float] = []
        done: list[Target] = []
        final: list[float] = []
        forwarded: list[float] = []
        below_k = 0
        refused = 0
        for tg in targets:
            regions = self.regions(data, tg)
            if not regions:
                refused += 1
                continue
            common = _track(data, regions)
            if tg.user not in common:  # pragma: no cover - a forwarded region always holds its querier
                raise AttackError("query tracking: a forwarded region does not contain its querier")
            done.append(tg)
            risk.append(1.0 / len(common))
            final.append(float(len(common)))
            forwarded.append(float(len(regions)))
            below_k += int(len(common) < data.k)
        return self._risk(
            data,
            done,
            risk,
            refused,
            {
                "final_candidates_mean": nan_mean(final),
                "final_candidates_min": int(min(final)) if final else None,
                "below_k_fraction": below_k / len(done) if done else None,
                "forwarded_per_query_mean": nan_mean(forwarded),
            },
        )


class QueryTrackingNaive(_Tracking):
    """Every refresh of the continuous query is cloaked on its own with the audited algorithm.

    Keyword arguments:
        refreshes: frames per tracked query (default: every frame from the target's on).
    """

    name = AttackName.QUERY_TRACKING_NAIVE

    def regions(self, data: CloakedWorld, target: Target) -> list[tuple[int, BBox]]:
        out: list[tuple[int, BBox]] = []
        for f in self._frames(data, target.frame):
            row = int(data.world.row_of_user[f][target.user])
            if row >= 0 and data.forwarded[f].ok[row]:
                out.append((f, data.forwarded[f].box(row)))
        return out


class QueryTrackingSession(_Tracking):
    """The continuous query runs as a session with k-sharing and memorization (§6.5, contract §6).

    ``data.session(start_frame, user)`` returns the regions the session forwards (its start from the
    audited algorithm, then its refreshes until it ends). A session that cannot start is refused.
    """

    name = AttackName.QUERY_TRACKING_SESSION

    def regions(self, data: CloakedWorld, target: Target) -> list[tuple[int, BBox]]:
        if data.session is None:
            raise AttackError("query_tracking_session: no session runner for this algorithm")
        frames = self._frames(data, target.frame)
        return [(f, b) for f, b in data.session(target.frame, target.user) if f in frames]


__all__ = ["QueryTrackingNaive", "QueryTrackingSession"]
