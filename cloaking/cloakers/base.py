"""The common contract of every spatial cloaker (CONCEPTS §4.0).

A cloaker is a strategy object: ``cloak(view, row, profile)`` returns a :class:`Region` or a
:class:`Refusal` for the user at ``row`` of an immutable :class:`~kcloak.cloaking.index.IndexView`
under its effective profile; ``cloak_batch`` does the same for many requests against one
view and returns columns. Cloakers are deterministic given the view (its epoch seed
included) and cache per-view state in ``view.cache``.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.index import IndexView
from kcloak.core.geometry import BBox, expand_to_area
from kcloak.core.profile import PrivacyProfile, ProfileArrays, ReasonCode


class ViewRef:
    """The view a per-view state belongs to, for a state kept in that view's own cache.

    Held weakly there: a strong reference back from the cached state would make a cycle that only
    Python's full collection frees (about 250 ms at a million users, so it runs rarely), and every
    replaced view, ~100 MB at a million users, would stay resident until then. ``strong=True`` for a
    view held by nothing but the state (a sub-view made for it).
    """

    __slots__ = ("_ref", "_view")

    def __init__(self, view: IndexView, *, strong: bool = False) -> None:
        self._view = view if strong else None
        self._ref = None if strong else weakref.ref(view)

    def __call__(self) -> IndexView:
        view = self._view if self._ref is None else self._ref()
        if view is None:
            raise ReferenceError("the view of this state is gone")
        return view


I64 = npt.NDArray[np.int64]
_EMPTY = np.empty(0, np.int64)
_EMPTY.setflags(write=False)


class CloakMode(enum.StrEnum):
    """How a cloaker is driven: the capability it declares (``cloak_mode``), from which the broker picks
    the way it serves queries, never from the algorithm's name (CONCEPTS §4, §5)."""

    SNAPSHOT = "snapshot"
    """``cloak``/``cloak_batch`` on an immutable index view: answered at once (CONCEPTS §4.0)."""
    HELD = "held"
    """Requests are held until a group of senders forms or their deadline passes (§4.5, §5.2)."""
    TEMPORAL = "temporal"
    """A fixed region, held in time until k users visited it (§5.1)."""


@dataclass(frozen=True, slots=True, eq=False)
class Region:
    """A cloaked region ready to forward, with what the broker answers and records internally.

    ``anon_set`` (view rows) is internal and never forwarded (§1.1); ``k_achieved`` is the exact
    number of present users strictly inside ``bbox``, querier included.
    """

    bbox: BBox
    k_achieved: int
    area_m2: float
    algorithm: str
    epoch: int = 0
    anon_set: I64 = field(default_factory=lambda: _EMPTY)
    l_achieved: int | None = None
    t_start: int | None = None
    t_end: int | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request that cannot be met: nothing is forwarded (§3.3)."""

    reason: ReasonCode
    message: str


CloakResult = Region | Refusal


# -- fast construction on the hot paths ---------------------------------------------------------
#
# A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (a type lookup per
# field) and ``BBox`` also validates its edges: about half the cost of building a published region
# in a single call. These two write the same slots directly; the results are equal to (and
# indistinguishable from) the dataclass constructors' (tests/cloaking/test_fast_regions.py).

_new = object.__new__
_SET_BBOX = tuple(BBox.__dict__[f].__set__ for f in ("min_lon_udeg", "min_lat_udeg", "max_lon_udeg", "max_lat_udeg"))
_SET_REGION = tuple(
    Region.__dict__[f].__set__
    for f in ("bbox", "k_achieved", "area_m2", "algorithm", "epoch", "anon_set", "l_achieved", "t_start", "t_end")
)


def trusted_bbox(min_lon_udeg: int, min_lat_udeg: int, max_lon_udeg: int, max_lat_udeg: int) -> BBox:
    """``BBox(...)`` without the validation, for edges the caller has proven ordered and within the world."""
    b = _new(BBox)
    s0, s1, s2, s3 = _SET_BBOX
    s0(b, min_lon_udeg)
    s1(b, min_lat_udeg)
    s2(b, max_lon_udeg)
    s3(b, max_lat_udeg)
    return b


def new_region(bbox: BBox, k_achieved: int, area_m2: float, algorithm: str, epoch: int, anon_set: I64) -> Region:
    """``Region(bbox, k_achieved, area_m2, algorithm, epoch, anon_set)``, the same object, built faster."""
    r = _new(Region)
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = _SET_REGION
    s0(r, bbox)
    s1(r, k_achieved)
    s2(r, area_m2)
    s3(r, algorithm)
    s4(r, epoch)
    s5(r, anon_set)
    s6(r, None)
    s7(r, None)
    s8(r, None)
    return r


# Status codes of BatchResult.status: 0 = ok, otherwise the index in this tuple.
BATCH_CODES: tuple[ReasonCode | None, ...] = (
    None,
    ReasonCode.K_UNREACHABLE,
    ReasonCode.AREA_EXCEEDED,
    ReasonCode.L_UNREACHABLE,
    ReasonCode.UNSUPPORTED,
    ReasonCode.EXPIRED,
)
STATUS_OK = 0
STATUS_OF: dict[ReasonCode, int] = {c: i for i, c in enumerate(BATCH_CODES) if c is not None}


@dataclass(frozen=True, slots=True, eq=False)
class BatchResult:
    """Columns of ``cloak_batch`` results, one entry per request.

    ``bbox`` holds micro-degree edges ``[min_lon, min_lat, max_lon, max_lat]`` (undefined where
    ``status`` is not 0); ``group`` identifies the anonymizing set where the algorithm has one
    (Hilbert bucket, quadtree cell), else −1.
    """

    algorithm: str
    epoch: int
    status: npt.NDArray[np.int8]
    bbox: I64
    k_achieved: I64
    area_m2: npt.NDArray[np.float64]
    group: I64

    def __len__(self) -> int:
        return len(self.status)

    @classmethod
    def empty(cls, algorithm: str, epoch: int, n: int) -> BatchResult:
        return cls(
            algorithm,
            epoch,
            np.zeros(n, np.int8),
            np.zeros((n, 4), np.int64),
            np.zeros(n, np.int64),
            np.zeros(n, np.float64),
            np.full(n, -1, np.int64),
        )

    @property
    def ok(self) -> npt.NDArray[np.bool_]:
        out: npt.NDArray[np.bool_] = self.status == STATUS_OK
        return out

    def __getitem__(self, i: int) -> CloakResult:
        s = int(self.status[i])
        if s != STATUS_OK:
            code = BATCH_CODES[s]
            assert code is not None
            return Refusal(code, REFUSAL_MESSAGES[code])
        b = self.bbox[i]
        return Region(
            bbox=BBox(int(b[0]), int(b[1]), int(b[2]), int(b[3])),
            k_achieved=int(self.k_achieved[i]),
            area_m2=float(self.area_m2[i]),
            algorithm=self.algorithm,
            epoch=self.epoch,
        )

    def set(self, i: int, result: CloakResult) -> None:
        """Store one scalar result (used by cloakers whose batch path falls back to ``cloak``)."""
        if isinstance(result, Refusal):
            self.status[i] = STATUS_OF[result.reason]
            return
        self.status[i] = STATUS_OK
        bb = result.bbox
        self.bbox[i] = (bb.min_lon_udeg, bb.min_lat_udeg, bb.max_lon_udeg, bb.max_lat_udeg)
        self.k_achieved[i] = result.k_achieved
        self.area_m2[i] = result.area_m2


REFUSAL_MESSAGES: dict[ReasonCode, str] = {
    ReasonCode.K_UNREACHABLE: (
        "fewer users are present (a recent fix) than your profile's k: retry when more users are around, "
        "or store a lower k"
    ),
    ReasonCode.AREA_EXCEEDED: (
        "k users are present, but too few of them are near you for a region holding k users to fit within "
        "max_area_m2: retry when more users are near, or store a larger max_area_m2 or a lower k"
    ),
    ReasonCode.L_UNREACHABLE: (
        "no region with k users and l place categories fits within max_area_m2: lower l or raise max_area_m2"
    ),
    ReasonCode.STALE_POSITION: (
        "no recent fix from you (present = a fix within the presence window, 60 s shipped): send a fix first, "
        "or put lat, lon and t in the query"
    ),
    ReasonCode.UNSUPPORTED: "the algorithm cannot honour this profile",
    ReasonCode.EXPIRED: "not satisfiable within max_delay_s: raise max_delay_s or retry",
}


def refuse(code: ReasonCode, message: str | None = None) -> Refusal:
    return Refusal(code, message if message is not None else REFUSAL_MESSAGES[code])


@runtime_checkable
class Cloaker(Protocol):
    """One spatial cloaking algorithm (CONCEPTS §4.0)."""

    name: ClassVar[str]
    reciprocal: ClassVar[bool]
    supports_l: ClassVar[bool]
    cloak_mode: ClassVar[CloakMode]
    """:attr:`CloakMode.SNAPSHOT` for every cloaker of this protocol."""
    vectorized: ClassVar[bool]
    """``cloak_batch`` is faster than one ``cloak`` per request (the broker micro-batches then)."""

    def cloak(self, view: IndexView, row: int, profile: PrivacyProfile) -> CloakResult:
        """Cloak the request of the user at view row ``row`` under effective profile ``profile``."""
        ...

    def cloak_batch(self, view: IndexView, rows: I64, profiles: ProfileArrays) -> BatchResult:
        """Cloak many requests against one view."""
        ...


def cloak_each(cloaker: Cloaker, view: IndexView, rows: I64, profiles: ProfileArrays) -> BatchResult:
    """Batch by calling ``cloak`` per request (algorithms with no vectorized path)."""
    out = BatchResult.empty(cloaker.name, view.epoch, len(rows))
    for i, r in enumerate(rows.tolist()):
        out.set(i, cloaker.cloak(view, r, profiles[i]))
    return out


def finish_region(
    view: IndexView,
    bbox: BBox,
    profile: PrivacyProfile,
    *,
    algorithm: str,
    min_area_m2: float | None = None,
    anon_set: I64 = _EMPTY,
    k_achieved: int | None = None,
) -> CloakResult:
    """Grow ``bbox`` to the area floor, enforce ``max_area_m2`` and count the users inside.

    ``min_area_m2`` defaults to the profile's (group-based algorithms pass the group's maximum,
    §4.4). ``k_achieved`` may be given when the caller counted exactly; it is recounted after
    any growth. Refuses ``area_exceeded`` when the final bbox is too large.
    """
    floor = profile.min_area_m2 if min_area_m2 is None else max(min_area_m2, profile.min_area_m2)
    grown = expand_to_area(bbox, floor)
    if grown is None:
        return refuse(ReasonCode.AREA_EXCEEDED)
    area = grown.area_m2
    if area > profile.max_area_m2:
        return refuse(ReasonCode.AREA_EXCEEDED)
    if grown is not bbox or k_achieved is None:
        k_achieved = view.count_in(grown)
    if k_achieved < profile.k:
        # Cannot happen for a correct algorithm; refusing is the safe outcome.
        return refuse(ReasonCode.K_UNREACHABLE, "internal check: region holds fewer than k users")
    return Region(
        bbox=grown, k_achieved=k_achieved, area_m2=area, algorithm=algorithm, epoch=view.epoch, anon_set=anon_set
    )
