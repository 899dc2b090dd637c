"""Continuous queries: k-sharing with memorization (CONCEPTS §6.5; contract §6).

Chow & Mokbel (SSTD 2007) show that independent cloaks of a continuous query let an attacker
who links the requests intersect their user sets until only the querier remains (query
tracking). The defence fixes the group ``G`` when the session starts — the present users
strictly inside the first region, querier included — and builds every later region from the
current positions of ``G``'s present members only. Members that stop being present leave ``G``
for good and are never replaced, so every present member of ``G`` is inside every region of the
session and the intersection of the regions' user sets never drops below ``E.k``.

Pure and synchronous: the broker keeps one :class:`SharedGroup` per session and calls
:meth:`SharedGroup.refresh` with a fresh :class:`~kcloak.cloaking.index.IndexView` on every refresh.
"""

from __future__ import annotations

import numpy as np

from kcloak.cloaking.cloakers.base import Refusal, Region, finish_region, refuse
from kcloak.cloaking.errors import CloakingError
from kcloak.cloaking.index import IndexView
from kcloak.core.errors import InputError
from kcloak.core.geometry import bbox_around_keys
from kcloak.core.profile import PrivacyProfile, ReasonCode

ENDING_REASONS: frozenset[ReasonCode] = frozenset({ReasonCode.K_UNREACHABLE, ReasonCode.AREA_EXCEEDED})
"""Refusals of a refresh that end the session (contract §6); any other keeps it active."""


class SessionError(CloakingError, InputError, ValueError):
    """A session cannot start from the given region (the caller passed an unusable first region)."""


def ends_session(result: Region | Refusal) -> bool:
    """True when a refresh outcome ends the session (``k_unreachable`` or ``area_exceeded``)."""
    return isinstance(result, Refusal) and result.reason in ENDING_REASONS


class SharedGroup:
    """k-sharing with memorization for one continuous session (Chow & Mokbel; CONCEPTS §6.5, contract §6).

    ``members`` is the current group ``G``: it only ever shrinks, as members stop being present.
    ``ended`` becomes True once a refresh refused ``k_unreachable`` or ``area_exceeded``; the
    group then refuses every further refresh the same way (the client starts a new session).
    ``algorithm`` names the cloaker that produced the first region; refresh regions carry it.
    """

    __slots__ = ("_ended_by", "algorithm", "members")

    def __init__(self, members: frozenset[str], algorithm: str) -> None:
        self.members = members
        self.algorithm = algorithm
        self._ended_by: Refusal | None = None

    @classmethod
    def start(cls, view: IndexView, querier: str, region: Region, profile: PrivacyProfile) -> SharedGroup:
        """Fix ``G`` = the present users of ``view`` strictly inside the first ``region``.

        ``view`` must be the snapshot the region was computed (or counted) on. Raises
        :class:`SessionError` when the querier is not inside or fewer than ``profile.k`` users are:
        such a region could not have been forwarded.
        """
        rows = view.rows_in(region.bbox)
        members = frozenset(view.user_ids[r] for r in rows.tolist())
        if querier not in members:
            raise SessionError("session start: the querier is not inside the first region")
        if len(members) < profile.k:
            raise SessionError("session start: the first region holds fewer than k present users")
        return cls(members, region.algorithm)

    @property
    def ended(self) -> bool:
        return self._ended_by is not None

    def refresh(self, view: IndexView, querier: str, profile: PrivacyProfile) -> Region | Refusal:
        """The next region of the session, built from ``G``'s present members only.

        * querier not present in ``view`` → ``stale_position`` (``G`` unchanged, session active);
        * members absent from ``view`` leave ``G`` for good;
        * fewer than ``profile.k`` present members → ``k_unreachable`` (session ends);
        * region = the published bbox strictly around the members' current positions (exact
          keys, §2.2), grown to ``min_area_m2`` about its own centre (§2.5); over
          ``max_area_m2`` → ``area_exceeded`` (session ends).
        """
        if self._ended_by is not None:
            return self._ended_by
        if querier not in self.members:
            raise SessionError("session refresh: the querier is not a member of the group")
        if view.row(querier) is None:
            return refuse(ReasonCode.STALE_POSITION)
        present = [u for u in self.members if view.row(u) is not None]
        self.members = frozenset(present)
        if len(present) < profile.k:
            return self._end(
                refuse(ReasonCode.K_UNREACHABLE, "fewer than k members of the session's group are present")
            )
        rows = np.fromiter((view.row_of[u] for u in present), np.int64, len(present))
        lon_k = view.lon_key[rows]
        lat_k = view.lat_key[rows]
        bbox = bbox_around_keys(int(lon_k.min()), int(lat_k.min()), int(lon_k.max()), int(lat_k.max()))
        rows.setflags(write=False)
        result = finish_region(view, bbox, profile, algorithm=self.algorithm, anon_set=rows)
        if isinstance(result, Refusal):
            if result.reason is ReasonCode.AREA_EXCEEDED:
                return self._end(
                    refuse(ReasonCode.AREA_EXCEEDED, "the session's group no longer fits within max_area_m2")
                )
            return self._end(result)
        inside = result.bbox.contains_keys(lon_k, lat_k)
        if not bool(inside.all()):  # cannot happen: the bbox is built around these keys
            return self._end(refuse(ReasonCode.K_UNREACHABLE, "internal check: a group member is outside"))
        return result

    def _end(self, refusal: Refusal) -> Refusal:
        self._ended_by = refusal
        return refusal


__all__ = ["ENDING_REASONS", "SessionError", "SharedGroup", "ends_session"]
