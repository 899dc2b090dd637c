"""CliqueCloak (Gedik & Liu, ICDCS 2005 / TMC 2008): held requests grouped into cliques (CONCEPTS §4.5).

Each pending request has a constraint box (the square of area ``max_area_m2`` centred on the
querier, §3.1) and a deadline (``t + max_delay_s``). Two requests are joined in the constraint
graph when each lies in the other's box; when an arrival completes a clique of ``k`` mutually
compatible requests, all of them are released together with one published bbox, so each is one
of ``k`` senders — reciprocal by construction. Requests are held, so the cloaker is driven by an
explicit clock (``submit``/``expire``) instead of the snapshot :class:`~kcloak.cloaking.cloakers.Cloaker`
protocol; the broker's timer calls :meth:`CliqueCloak.expire` at :meth:`CliqueCloak.next_deadline`
(§5.2).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from kcloak.cloaking.cloakers.base import CloakMode
from kcloak.core.geometry import (
    EARTH_RADIUS_M,
    UDEG_PER_DEG,
    WORLD_LAT_UDEG,
    WORLD_LON_UDEG,
    BBox,
    bbox_around_keys,
    expand_to_area,
)
from kcloak.core.profile import MAX_AREA_CAP_M2, PrivacyProfile

_BOX_CHECK_COST = 50  # budget units charged per candidate clique whose box is checked
_SHRINK = 1.0 - 1e-9  # the lat/lon box aims a hair inside the metric square


@dataclass(frozen=True, slots=True)
class CliqueRequest:
    """One held request (§4.5's message): position, receipt time ``t`` on the caller's clock, profile."""

    request_id: str
    user: str
    lat: float
    lon: float
    t: float
    k: int
    min_area_m2: float
    max_area_m2: float
    max_delay_s: float

    def __post_init__(self) -> None:
        if not (-90.0 <= self.lat <= 90.0 and -180.0 <= self.lon <= 180.0):
            raise ValueError("lat, lon: must be within [-90, 90] and [-180, 180]")
        if self.k < 1:
            raise ValueError("k: must be at least 1")
        if not (0.0 <= self.min_area_m2 <= self.max_area_m2 <= MAX_AREA_CAP_M2) or self.max_area_m2 <= 0:
            raise ValueError("min_area_m2, max_area_m2: must satisfy 0 <= min <= max <= 2.5e9, max > 0")
        if not (math.isfinite(self.t) and 0.0 <= self.max_delay_s <= 600.0):
            raise ValueError("t, max_delay_s: t must be finite and max_delay_s within [0, 600]")

    @classmethod
    def from_profile(
        cls, request_id: str, user: str, lat: float, lon: float, t: float, profile: PrivacyProfile
    ) -> CliqueRequest:
        """A request under the effective profile ``profile`` (§3.2); ``l`` is not used (``unsupported``)."""
        return cls(
            request_id=request_id,
            user=user,
            lat=lat,
            lon=lon,
            t=t,
            k=profile.k,
            min_area_m2=profile.min_area_m2,
            max_area_m2=profile.max_area_m2,
            max_delay_s=profile.max_delay_s,
        )

    @property
    def deadline(self) -> float:
        """Latest release time: ``t + max_delay_s`` (§5.2)."""
        return self.t + self.max_delay_s

    def constraint_box(self) -> BBox | None:
        """The µdeg box inside the metric square of area ``max_area_m2`` (``None`` if no point fits strictly inside)."""
        return _as_bbox(constraint_box_udeg(self.lat, self.lon, self.max_area_m2))


@dataclass(frozen=True, slots=True)
class CliqueRelease:
    """A clique released at ``released_at``: every member is forwarded with the same ``bbox``."""

    members: tuple[CliqueRequest, ...]
    bbox: BBox
    area_m2: float
    released_at: float

    @property
    def k_achieved(self) -> int:
        """Senders sharing the box (only message senders count, §4.5)."""
        return len(self.members)


def _as_bbox(box: tuple[int, int, int, int]) -> BBox | None:
    lon0, lat0, lon1, lat1 = box
    return BBox(lon0, lat0, lon1, lat1) if lon0 < lon1 and lat0 < lat1 else None


def constraint_box_udeg(lat: float, lon: float, max_area_m2: float) -> tuple[int, int, int, int]:
    """Whole-µdeg lat/lon box ``(lon0, lat0, lon1, lat1)`` contained in the querier's metric square (§3.1).

    The square has side ``√max_area_m2`` in the :class:`~kcloak.core.geometry.Aeqd` frame of the
    querier (§2.1). Parallels curve and meridians converge in that frame, so each side of the
    lat/lon box is pulled in (by whole micro-degrees) until its boundary maps inside the square.
    The boundary is checked where the frame's coordinates peak on it — corners, the querier's
    meridian, the equator — and at intermediate points. Edges cross (``lo > hi``) for a square
    narrower than a micro-degree.
    """
    h = math.sqrt(max_area_m2) / 2.0
    ang = math.degrees(h / EARTH_RADIUS_M)
    nearest_equator = 0.0 if lat - ang <= 0.0 <= lat + ang else min(abs(lat - ang), abs(lat + ang))
    target = h * _SHRINK
    # First guess to second order: the poleward parallel bows outwards by about h²·tan φ / 2R at
    # the corners, and distances grow by the factor c / sin c ≈ 1 + c²/6 away from the centre.
    c2 = 2.0 * (h / EARTH_RADIUS_M) ** 2
    bow = math.degrees(h * h * abs(math.tan(math.radians(max(min(lat, 89.0), -89.0)))) / (2 * EARTH_RADIUS_M**2))
    a_pole = max(ang * (1.0 - c2 / 6.0) - 2.0 * bow, ang / 2) * _SHRINK
    a_eq = ang * _SHRINK
    a_n, a_s = (a_pole, a_eq) if lat >= 0 else (a_eq, a_pole)
    cos_eq = max(math.cos(math.radians(nearest_equator)), 1e-9)
    b = math.degrees(h / (EARTH_RADIUS_M * cos_eq)) * (1.0 - c2 / 6.0) * _SHRINK
    lon0 = max(math.ceil((lon - b) * UDEG_PER_DEG), -WORLD_LON_UDEG)
    lon1 = min(math.floor((lon + b) * UDEG_PER_DEG), WORLD_LON_UDEG)
    lat0 = max(math.ceil((lat - a_s) * UDEG_PER_DEG), -WORLD_LAT_UDEG)
    lat1 = min(math.floor((lat + a_n) * UDEG_PER_DEG), WORLD_LAT_UDEG)
    p0 = math.radians(lat)
    sp0, cp0 = math.sin(p0), math.cos(p0)
    for _ in range(200):
        if lon0 > lon1 or lat0 > lat1:
            return lon0, lat0, lon1, lat1
        flon0, flon1, flat0, flat1 = lon0 / 1e6, lon1 / 1e6, lat0 / 1e6, lat1 / 1e6
        along = [flon0 + (flon1 - flon0) * f for f in _FRACTIONS]
        if flon0 < lon < flon1:
            along.append(lon)
        across = [flat0 + (flat1 - flat0) * f for f in _FRACTIONS]
        if flat0 < 0.0 < flat1:
            across.append(0.0)
        if flat0 < lat < flat1:
            across.append(lat)
        x_lo = x_hi = y_lo = y_hi = 0.0
        for plat, plon in [
            *((flat0, v) for v in along),
            *((flat1, v) for v in along),
            *((v, flon0) for v in across),
            *((v, flon1) for v in across),
        ]:
            x, y = _aeqd(sp0, cp0, lon, plat, plon)
            if x < x_lo:
                x_lo = x
            elif x > x_hi:
                x_hi = x
            if y < y_lo:
                y_lo = y
            elif y > y_hi:
                y_hi = y
        if y_hi <= target and -y_lo <= target and x_hi <= target and -x_lo <= target:
            return lon0, lat0, lon1, lat1
        # Pull each overflowing side in proportionally, by at least one micro-degree.
        if y_hi > target:
            lat1 = min(math.floor((lat + (flat1 - lat) * target / y_hi) * UDEG_PER_DEG), lat1 - 1)
        if -y_lo > target:
            lat0 = max(math.ceil((lat - (lat - flat0) * target / -y_lo) * UDEG_PER_DEG), lat0 + 1)
        if -x_lo > target:
            lon0 = max(math.ceil((lon - (lon - flon0) * target / -x_lo) * UDEG_PER_DEG), lon0 + 1)
        if x_hi > target:
            lon1 = min(math.floor((lon + (flon1 - lon) * target / x_hi) * UDEG_PER_DEG), lon1 - 1)
    raise ArithmeticError("constraint box did not converge")  # pragma: no cover - geometry bound


_FRACTIONS = (0.0, 0.5, 1.0)


def _aeqd(sp0: float, cp0: float, lon0: float, lat: float, lon: float) -> tuple[float, float]:
    """Scalar :meth:`kcloak.core.geometry.Aeqd.forward` (same formulas) for the frame at ``asin(sp0)``, ``lon0``."""
    p = math.radians(lat)
    dl = math.radians(lon - lon0)
    sp, cp, cdl = math.sin(p), math.cos(p), math.cos(dl)
    c = math.acos(min(max(sp0 * sp + cp0 * cp * cdl, -1.0), 1.0))
    kp = 1.0 if c < 1e-12 else c / math.sin(c)
    return EARTH_RADIUS_M * kp * cp * math.sin(dl), EARTH_RADIUS_M * kp * (cp0 * sp - sp0 * cp * cdl)


def exact_key(value: float) -> int:
    """Scalar :func:`kcloak.core.geometry.coordinate_key` in integer arithmetic (no numpy call per request)."""
    m = round(value * UDEG_PER_DEG)
    if m / UDEG_PER_DEG == value:  # the float of micro-degree m: on it, as a client reads it
        return 2 * m
    n, d = value.as_integer_ratio()
    return 2 * ((n * UDEG_PER_DEG) // d) + 1


@dataclass(slots=True, eq=False)
class _Pending:
    """A pending request with its exact keys, constraint box, graph neighbours and bucket."""

    req: CliqueRequest
    node: int
    lon_key: int
    lat_key: int
    box: tuple[int, int, int, int]
    order: int
    bucket: tuple[int, int]
    box_area_m2: float
    adj: set[int] = field(default_factory=set)

    def holds(self, other: _Pending) -> bool:
        """``other``'s position strictly inside this constraint box (so a published MBR stays inside)."""
        lon0, lat0, lon1, lat1 = self.box
        return 2 * lon0 < other.lon_key < 2 * lon1 and 2 * lat0 < other.lat_key < 2 * lat1


class CliqueCloak:
    """CliqueCloak with the local k-search (§4.5), holding requests until a clique forms or they expire.

    Keyword arguments:
        max_combinations: cap on the work of the exponential clique search for one arrival, in
            units of one candidate tried or one adjacency test (pruning included), a complete
            clique whose box is checked costing 50 (default 20,000: a few ms at most);
            past it the search gives up for this arrival, which keeps waiting and may still join
            a clique found by a later arrival (counted in :attr:`gave_up`).
        larger_cliques: also try cliques larger than the arrival's own ``k`` — sizes equal to a
            pending neighbour's larger ``k`` — so a request whose ``k`` exceeds the arrival's is
            not stranded (default ``True``; ``False`` is the paper's search for exactly ``k``).
        index_cell_udeg: side of the uniform grid buckets of the spatial index of pending
            requests, in micro-degrees (default 16,384 ≈ 1.8 km N–S).
        seed: secret for the salted hash that orders equally distant candidates (default: random);
            never request ids or arrival order.
    """

    name: ClassVar[str] = "clique"
    reciprocal: ClassVar[bool] = True
    supports_l: ClassVar[bool] = False
    cloak_mode: ClassVar[CloakMode] = CloakMode.HELD

    def __init__(
        self,
        *,
        max_combinations: int = 20_000,
        larger_cliques: bool = True,
        index_cell_udeg: int = 1 << 14,
        seed: int | None = None,
    ) -> None:
        if max_combinations < 1 or index_cell_udeg < 1:
            raise ValueError("max_combinations, index_cell_udeg: must be positive")
        self.max_combinations = max_combinations
        self.larger_cliques = larger_cliques
        self.index_cell_udeg = index_cell_udeg
        salt = secrets.randbits(64) if seed is None else seed & 0xFFFF_FFFF_FFFF_FFFF
        self._salt = salt.to_bytes(8, "little")
        self._nodes: dict[int, _Pending] = {}
        self._by_request: dict[str, int] = {}
        self._buckets: dict[tuple[int, int], set[int]] = {}
        self._heap: list[tuple[float, int]] = []
        self._seq = 0
        self.gave_up = 0
        """Arrivals whose clique search hit ``max_combinations`` (a quality counter)."""

    @property
    def pending(self) -> int:
        """Requests currently held."""
        return len(self._nodes)

    def next_deadline(self) -> float | None:
        """Earliest deadline among pending requests (when the broker's timer should call :meth:`expire`)."""
        heap = self._heap
        while heap and heap[0][1] not in self._nodes:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # -- arrivals ----------------------------------------------------------------------------
    def submit(self, request: CliqueRequest, now: float) -> list[CliqueRelease]:
        """Add a request at time ``now``; returns the clique it completes, if any (§4.5 ``on_message``).

        A request whose deadline is already past is held only until the next :meth:`expire`;
        with ``max_delay_s = 0`` a request is released now or expired at the next ``expire(now)``.
        """
        if request.request_id in self._by_request:
            raise ValueError("request_id: already pending")
        mc = self._insert(request)
        if request.deadline < now:
            return []
        found = self._local_k_search(mc, now)
        if found is None:
            return []
        members, bbox = found
        for m in members:
            self._remove(m)
        members.sort(key=lambda m: m.order)
        return [CliqueRelease(tuple(m.req for m in members), bbox, bbox.area_m2, now)]

    def expire(self, now: float) -> list[CliqueRequest]:
        """Remove and return every pending request whose deadline is ≤ ``now`` (refused ``expired``)."""
        out: list[CliqueRequest] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, node = heapq.heappop(heap)
            m = self._nodes.get(node)
            if m is not None:
                self._remove(m)
                out.append(m.req)
        return out

    def run_stream(
        self, requests_with_times: Iterable[tuple[float, CliqueRequest]]
    ) -> tuple[list[CliqueRelease], list[tuple[float, CliqueRequest]]]:
        """Drive :meth:`submit` and :meth:`expire` in time order, as the broker's timer would.

        Before each arrival at ``t``, requests whose deadline is earlier than ``t`` expire at their
        deadline; at the end every request still pending expires at its deadline. Returns the
        releases (each with ``released_at``) and the ``(expiry time, request)`` pairs.
        """
        releases: list[CliqueRelease] = []
        expired: list[tuple[float, CliqueRequest]] = []
        for t, req in sorted(requests_with_times, key=lambda e: e[0]):
            while (d := self.next_deadline()) is not None and d < t:
                expired.extend((d, r) for r in self.expire(d))
            releases.extend(self.submit(req, t))
        while (d := self.next_deadline()) is not None:
            expired.extend((d, r) for r in self.expire(d))
        return releases, expired

    # -- structures --------------------------------------------------------------------------
    def _bucket(self, lon_udeg: int, lat_udeg: int) -> tuple[int, int]:
        c = self.index_cell_udeg
        return lon_udeg // c, lat_udeg // c

    def _insert(self, req: CliqueRequest) -> _Pending:
        node = self._seq
        self._seq += 1
        lon_key, lat_key = exact_key(req.lon), exact_key(req.lat)
        digest = hashlib.blake2b(req.request_id.encode(), digest_size=8, key=self._salt).digest()
        box = constraint_box_udeg(req.lat, req.lon, req.max_area_m2)
        bbox = _as_bbox(box)
        mc = _Pending(
            req=req,
            node=node,
            lon_key=lon_key,
            lat_key=lat_key,
            box=box,
            box_area_m2=bbox.area_m2 if bbox is not None else 0.0,
            order=int.from_bytes(digest, "little"),
            bucket=self._bucket(lon_key >> 1, lat_key >> 1),
        )
        for other in self._range(mc.box):
            # Mutual containment (§4.5); two requests of one user never count as two senders.
            if other.holds(mc) and mc.holds(other) and other.req.user != req.user:
                mc.adj.add(other.node)
                other.adj.add(node)
        self._nodes[node] = mc
        self._by_request[req.request_id] = node
        self._buckets.setdefault(mc.bucket, set()).add(node)
        heapq.heappush(self._heap, (req.deadline, node))
        return mc

    def _range(self, box: tuple[int, int, int, int]) -> Iterator[_Pending]:
        """Pending requests whose bucket meets ``box`` (a superset of those inside it)."""
        lon0, lat0, lon1, lat1 = box
        if lon0 > lon1 or lat0 > lat1:
            return
        bx0, by0 = self._bucket(lon0 - 1, lat0 - 1)
        bx1, by1 = self._bucket(lon1, lat1)
        nodes = self._nodes
        if (bx1 - bx0 + 1) * (by1 - by0 + 1) > len(self._buckets):
            for key, members in self._buckets.items():
                if bx0 <= key[0] <= bx1 and by0 <= key[1] <= by1:
                    yield from (nodes[n] for n in members)
            return
        get = self._buckets.get
        for bx in range(bx0, bx1 + 1):
            for by in range(by0, by1 + 1):
                found = get((bx, by))
                if found:
                    yield from (nodes[n] for n in found)

    def _remove(self, m: _Pending) -> None:
        """Drop a request from the index, the graph and the maps (its heap entry dies lazily)."""
        del self._nodes[m.node]
        del self._by_request[m.req.request_id]
        bucket = self._buckets[m.bucket]
        bucket.discard(m.node)
        if not bucket:
            del self._buckets[m.bucket]
        for n in m.adj:
            self._nodes[n].adj.discard(m.node)
        m.adj.clear()

    # -- clique search -----------------------------------------------------------------------
    def _local_k_search(self, mc: _Pending, now: float) -> tuple[list[_Pending], BBox] | None:
        """§4.5 ``local_k_search``: a clique containing ``mc`` of size ``s ≥ k_s`` for every member.

        Sizes tried: ``mc.k``, then (``larger_cliques``) each larger ``k`` of a neighbour. Candidates
        are pruned to those with enough neighbours, then combinations are searched nearest first;
        the first clique whose published box meets every member's constraints is returned.
        """
        nodes = self._nodes
        if mc.req.min_area_m2 > mc.box_area_m2:
            return None  # no box of that area fits in its own constraint box: it can only expire
        # A neighbour whose A_min exceeds mc's box, or whose box is below mc's A_min, can never
        # share a box with mc (the box lies in both constraint boxes and is at least both A_min).
        nb = [
            o
            for o in (nodes[n] for n in mc.adj)
            if o.req.deadline >= now and o.req.min_area_m2 <= mc.box_area_m2 and mc.req.min_area_m2 <= o.box_area_m2
        ]
        sizes = {mc.req.k}
        if self.larger_cliques:
            sizes.update(o.req.k for o in nb if o.req.k > mc.req.k)
        budget = [self.max_combinations]
        coslat = math.cos(math.radians(mc.req.lat))
        for s in sorted(sizes):
            if s - 1 > len(nb):
                break
            uc = {o.node for o in nb if o.req.k <= s}
            changed = True
            while changed and len(uc) >= s - 1:
                changed = False
                budget[0] -= len(uc)
                for n in list(uc):
                    if len(nodes[n].adj & uc) < s - 2:
                        uc.discard(n)
                        changed = True
            if len(uc) < s - 1:
                continue
            order = sorted(
                uc,
                key=lambda n: (
                    ((nodes[n].lon_key - mc.lon_key) * coslat) ** 2 + (nodes[n].lat_key - mc.lat_key) ** 2,
                    nodes[n].order,
                ),
            )
            for combo in _cliques(order, nodes, s - 1, budget):
                budget[0] -= _BOX_CHECK_COST
                members = [mc, *(nodes[n] for n in combo)]
                bbox = _group_box(members)
                if bbox is not None:
                    return members, bbox
            if budget[0] <= 0:
                self.gave_up += 1
                break
        return None


def _cliques(order: list[int], nodes: dict[int, _Pending], need: int, budget: list[int]) -> Iterator[list[int]]:
    """Cliques of ``need`` nodes from ``order``, in lexicographic order of ``order`` (backtracking).

    Every node tried and every adjacency test costs one unit of ``budget[0]``; the search stops
    when it reaches zero.
    """
    if need == 0:
        yield []
        return
    chosen: list[int] = []
    stack: list[tuple[int, list[int]]] = [(0, order)]
    while stack:
        i, cand = stack[-1]
        remaining = need - len(chosen)
        if i > len(cand) - remaining or budget[0] <= 0:
            stack.pop()
            if chosen:
                chosen.pop()
            continue
        stack[-1] = (i + 1, cand)
        budget[0] -= 1
        v = cand[i]
        if remaining == 1:
            yield [*chosen, v]
            continue
        adj = nodes[v].adj
        budget[0] -= len(cand) - i - 1
        nxt = [w for w in cand[i + 1 :] if w in adj]
        if len(nxt) >= remaining - 1:
            chosen.append(v)
            stack.append((0, nxt))


def _group_box(members: list[_Pending]) -> BBox | None:
    """The one published box of a clique: strictly around every member, grown to the largest A_min.

    It must lie inside every member's constraint box (their intersection ``I``) and within every
    member's ``max_area_m2``. A box grown about the MBR's centre (§2.5) that sticks out of ``I``
    while fitting its size is translated into ``I``; it still contains the MBR, which lies in ``I``.
    The box depends on the group only, never on who arrived last (reciprocity, §1.5).
    """
    bbox = bbox_around_keys(
        min(m.lon_key for m in members),
        min(m.lat_key for m in members),
        max(m.lon_key for m in members),
        max(m.lat_key for m in members),
    )
    i_lon0 = max(m.box[0] for m in members)
    i_lat0 = max(m.box[1] for m in members)
    i_lon1 = min(m.box[2] for m in members)
    i_lat1 = min(m.box[3] for m in members)
    a_min = max(m.req.min_area_m2 for m in members)
    if a_min > 0 and bbox.area_m2 < a_min:
        grown = expand_to_area(bbox, a_min)
        if grown is None:
            return None
        lon0, lat0, lon1, lat1 = grown.min_lon_udeg, grown.min_lat_udeg, grown.max_lon_udeg, grown.max_lat_udeg
        if lon1 - lon0 > i_lon1 - i_lon0 or lat1 - lat0 > i_lat1 - i_lat0:
            return None
        dx = max(i_lon0 - lon0, 0) - max(lon1 - i_lon1, 0)
        dy = max(i_lat0 - lat0, 0) - max(lat1 - i_lat1, 0)
        bbox = BBox(lon0 + dx, lat0 + dy, lon1 + dx, lat1 + dy) if dx or dy else grown
        if bbox.area_m2 < a_min:
            return None
    if not (
        i_lon0 <= bbox.min_lon_udeg
        and i_lat0 <= bbox.min_lat_udeg
        and bbox.max_lon_udeg <= i_lon1
        and bbox.max_lat_udeg <= i_lat1
    ):
        return None
    area = bbox.area_m2
    if any(area > m.req.max_area_m2 for m in members):
        return None
    return bbox
