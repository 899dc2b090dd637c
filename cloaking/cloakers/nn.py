"""Nearest-neighbour k-cloak, the non-reciprocal baseline (CONCEPTS §4.1).

The region is the published bbox strictly around the querier and its ``k − 1`` nearest present
users by great-circle distance, grown to ``min_area_m2`` about its own centre (§2.5). Safe only
at K0: it is not reciprocal (§1.5, test ``recip_nn_line``) and centres on the querier (§6.1).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt
from scipy.spatial import cKDTree

from kcloak.cloaking.cloakers.base import (
    STATUS_OF,
    BatchResult,
    CloakMode,
    CloakResult,
    ViewRef,
    finish_region,
    refuse,
)
from kcloak.cloaking.cloakers.hilbert import bbox_areas_m2, bboxes_around_keys
from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import EARTH_RADIUS_M, BBox, bbox_around_keys, haversine_m_array
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

_CACHE_KEY = "nn"
_TIE_UM = 1e6
"""Ties are decided on distances in whole micrometres, so float noise never breaks one (§4.1)."""
_GAP_M = 3e-6
"""Above this gap between the last member and the next user, chord order alone fixes the group."""

_UNSUPPORTED = refuse(ReasonCode.UNSUPPORTED, "nn: l > 1 is not supported (no place diversity)")
_K_UNREACHABLE = refuse(ReasonCode.K_UNREACHABLE)


class _NNState:
    """Per-view KD-tree on unit-sphere vectors: chord order is great-circle order."""

    @property
    def view(self) -> IndexView:
        """The view this state belongs to (held weakly: the state sits in the view's cache)."""
        return self._view()

    def __init__(self, view: IndexView) -> None:
        self._view = ViewRef(view)
        self.n = len(view)
        phi = np.radians(view.lat)
        lam = np.radians(view.lon)
        cos_phi = np.cos(phi)
        self.xyz = np.column_stack([cos_phi * np.cos(lam), cos_phi * np.sin(lam), np.sin(phi)])
        self.tree = cKDTree(self.xyz) if self.n else None


def _state(view: IndexView) -> _NNState:
    st: _NNState | None = view.cache.get(_CACHE_KEY)
    if st is None:
        st = _NNState(view)
        view.cache[_CACHE_KEY] = st
    return st


def _distance_um(view: IndexView, row: int, others: I64) -> list[int]:
    """Haversine distance from the querier to ``others``, in whole micrometres."""
    d = haversine_m_array(view.lat[row], view.lon[row], view.lat[others], view.lon[others])
    out: list[int] = np.rint(d * _TIE_UM).astype(np.int64).tolist()
    return out


def _group_exact(st: _NNState, row: int, k: int) -> I64:
    """The querier and its ``k − 1`` nearest users, ties by (distance in µm, user id): exact, any input."""
    assert st.tree is not None
    kk = min(k + 1, st.n)
    dist, _ = st.tree.query(st.xyz[row], kk)
    # Everything at most as far as the kk-th neighbour (inflated past float noise): it holds the
    # k − 1 nearest others and every user tied with the last of them.
    radius = float(np.max(dist)) * (1 + 1e-9) + 1e-15
    cand = np.asarray(st.tree.query_ball_point(st.xyz[row], radius), dtype=np.int64)
    cand = cand[cand != row]
    dum = _distance_um(st.view, row, cand)
    ids = st.view.user_ids
    ranked = sorted(range(len(cand)), key=lambda i: (dum[i], ids[cand[i]]))
    return np.concatenate([[row], cand[ranked[: k - 1]]]).astype(np.int64)


def _group(st: _NNState, row: int, k: int) -> I64:
    """Scalar group: chord order decides unless the (k−1)-th and k-th others are within ``_GAP_M``."""
    if k <= 1:
        return np.array([row], np.int64)
    assert st.tree is not None
    kk = min(k + 1, st.n)
    dist, idx = st.tree.query(st.xyz[row], kk)
    il: list[int] = idx.tolist()
    if row in il:
        pos = il.index(row)
        del il[pos]
        dl: list[float] = dist.tolist()
        del dl[pos]
        if len(il) < k or (dl[k - 1] - dl[k - 2]) * EARTH_RADIUS_M > _GAP_M:
            return np.array([row, *il[: k - 1]], np.int64)
    return _group_exact(st, row, k)


def _groups(st: _NNState, rows: I64, k: int) -> I64:
    """Vectorized :func:`_group` for many queriers with the same ``k``: ``(m, k)`` rows, querier first.

    One KD-tree query for all; the rare rows with a near-tie at the boundary, or whose own row was
    crowded out by co-located users, are redone exactly.
    """
    m = len(rows)
    if k <= 1 or m == 0:
        return rows.reshape(m, 1).astype(np.int64)
    assert st.tree is not None
    kk = min(k + 1, st.n)
    dist, idx = st.tree.query(st.xyz[rows], kk, workers=-1)
    idx = np.asarray(idx, dtype=np.int64).reshape(m, kk)
    dist = np.asarray(dist, dtype=np.float64).reshape(m, kk)
    is_self = idx == rows[:, None]
    redo = ~is_self.any(axis=1)
    dist[is_self] = -1.0
    order = np.argsort(dist, axis=1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=1)
    if kk > k:
        dist = np.take_along_axis(dist, order, axis=1)
        redo |= (dist[:, k] - dist[:, k - 1]) * EARTH_RADIUS_M <= _GAP_M
    groups = idx[:, :k].copy()
    for i in np.flatnonzero(redo).tolist():
        groups[i] = _group_exact(st, int(rows[i]), k)
    return groups


def _group_bboxes(view: IndexView, groups: I64) -> I64:
    """Published ``(m, 4)`` micro-degree bboxes strictly around each group (exact keys, §2.2)."""
    lon_k = view.lon_key[groups]
    lat_k = view.lat_key[groups]
    return bboxes_around_keys(lon_k.min(axis=1), lat_k.min(axis=1), lon_k.max(axis=1), lat_k.max(axis=1))


def nn_mbr_area_m2(view: IndexView, rows: npt.ArrayLike, k: int) -> F64:
    """Area of the published MBR (no A_min growth) of each querier and its ``k − 1`` nearest users.

    The denominator of the benchmark's ``area_ratio_to_nn`` (contract §9); NaN when fewer than
    ``k`` users are present.
    """
    r = np.asarray(rows, dtype=np.int64).reshape(-1)
    if k > len(view):
        return np.full(len(r), np.nan)
    boxes = _group_bboxes(view, _groups(_state(view), r, k))
    return bbox_areas_m2(boxes)


class NearestNeighbourCloak:
    """MBR of the querier and its k − 1 nearest present users (CONCEPTS §4.1; not reciprocal).

    Great-circle order through a per-view KD-tree on unit vectors; ties by (distance in whole
    micrometres, user id) as the section's worked example requires. No parameters.
    """

    name: ClassVar[str] = "nn"
    reciprocal: ClassVar[bool] = False
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.SNAPSHOT
    vectorized: ClassVar[bool] = True

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        """Region of the querier's k-nearest group, or the refusal of §3.3."""
        if profile.l > 1:
            return _UNSUPPORTED
        if profile.k > len(view):
            return _K_UNREACHABLE
        group = _group(_state(view), row, profile.k)
        lon_k = view.lon_key[group]
        lat_k = view.lat_key[group]
        bbox = bbox_around_keys(int(lon_k.min()), int(lat_k.min()), int(lon_k.max()), int(lat_k.max()))
        group.setflags(write=False)
        return finish_region(view, bbox, profile, algorithm=self.name, anon_set=group)

    def cloak_batch(self, view: IndexView, rows: I64, profiles: ProfileArrays) -> BatchResult:
        """One vectorized KD-tree query per distinct k; A_min growth element by element."""
        rows = np.asarray(rows, dtype=np.int64)
        m = len(rows)
        out = BatchResult.empty(self.name, view.epoch, m)
        if m == 0:
            return out
        st = _state(view)
        unsupported = profiles.l > 1
        k_unreachable = ~unsupported & (profiles.k > st.n)
        out.status[unsupported] = STATUS_OF[ReasonCode.UNSUPPORTED]
        out.status[k_unreachable] = STATUS_OF[ReasonCode.K_UNREACHABLE]
        live = np.flatnonzero(~unsupported & ~k_unreachable)
        boxes = np.zeros((m, 4), np.int64)
        for k in np.unique(profiles.k[live]).tolist():
            sel = live[profiles.k[live] == k]
            boxes[sel] = _group_bboxes(view, _groups(st, rows[sel], int(k)))
        area = np.zeros(m)
        area[live] = bbox_areas_m2(boxes[live])
        grow = np.zeros(m, bool)
        grow[live] = area[live] < profiles.min_area_m2[live]
        plain = np.zeros(m, bool)
        plain[live] = ~grow[live]
        too_big = plain & (area > profiles.max_area_m2)
        out.status[too_big] = STATUS_OF[ReasonCode.AREA_EXCEEDED]
        ok = np.flatnonzero(plain & ~too_big)
        counts = view.count_in_many(boxes[ok])
        # As finish_region: a group on the world edge is not strictly inside any bbox; refuse it.
        short = counts < profiles.k[ok]
        out.status[ok[short]] = STATUS_OF[ReasonCode.K_UNREACHABLE]
        ok, counts = ok[~short], counts[~short]
        out.bbox[ok] = boxes[ok]
        out.area_m2[ok] = area[ok]
        out.k_achieved[ok] = counts
        for i in np.flatnonzero(grow).tolist():
            b = boxes[i]
            bbox = BBox(int(b[0]), int(b[1]), int(b[2]), int(b[3]))
            out.set(i, finish_region(view, bbox, profiles[i], algorithm=self.name))
        return out


__all__ = ["NearestNeighbourCloak", "nn_mbr_area_m2"]
