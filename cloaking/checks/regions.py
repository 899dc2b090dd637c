"""Independent checker of one forwarded region (CONCEPTS §9.0, §9.1; contract §0, §2).

It re-derives every property by brute force from the raw snapshot and the published bytes,
and imports only the standard library, :mod:`decimal` and numpy: the contract's sphere, area
formula and strict containment are restated here on purpose, never taken from
``kcloak.core.geometry``/``kcloak.cloaking.index`` or a cloaker. Containment is judged the two ways a
client of the JSON can judge it, and a point is inside only if both agree: float64 (the edge's
text and the coordinate's text each parsed to a float) and exact decimals (``Decimal`` of the
edge's text against ``Decimal`` of the coordinate's JSON text, ``repr`` of the float, which is
what ``json.dumps`` writes). Never the coordinate's exact binary value: ``116.30395`` is a float
slightly off that decimal, yet to every client an edge ``116.30395`` *is* that user's position.
Reciprocity and determinism call the cloaker's public ``cloak`` as a black box.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, InvalidOperation
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]

EARTH_RADIUS_M = 6_371_008.8
"""Sphere radius of contract §0, restated so that the checker shares no code with the cloakers."""

MAX_FRACTION_DIGITS = 6
WORLD_LON = Decimal(180)
WORLD_LAT = Decimal(90)
_EDGE_BAND_DEG = 1e-7
"""Points closer than this (as floats) to an edge are also compared as exact decimals; elsewhere the
float comparison decides both ways (a decimal and its float differ by < 1e-13°)."""

EdgeValue = float | str | Decimal
DecBox = tuple[Decimal, Decimal, Decimal, Decimal]


class Property(enum.StrEnum):
    """Names of the checked properties (§9.1 rows), as they appear in :class:`Violation`."""

    QUERIER_PRESENT = "querier_present"
    QUERIER_INSIDE = "querier_inside"
    GEOJSON_ORDER = "geojson_order"
    FRACTION_DIGITS = "fraction_digits"
    GEOMETRY = "geometry"
    K = "k"
    K_ACHIEVED = "k_achieved"
    AREA_BOUNDS = "area_bounds"
    AREA_M2 = "area_m2"
    L = "l"
    L_ACHIEVED = "l_achieved"
    EFFECTIVE_PROFILE = "effective_profile"
    VIEW = "view"
    RECIPROCITY = "reciprocity"
    DETERMINISM = "determinism"
    REFUSAL_CODE = "refusal_code"
    DEADLINE = "deadline"
    CONSTRAINT_BOX = "constraint_box"
    OUTCOME = "outcome"


@dataclass(frozen=True, slots=True)
class Violation:
    """One failed check (§9.0): which object, which property, what was expected and observed."""

    object_id: str
    property: Property
    expected: str
    observed: str


class ProfileLike(Protocol):
    """What the checker reads from a privacy profile (a dataclass, contract §2 field names)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def k(self) -> int: ...
    @property
    def l(self) -> int: ...  # noqa: E743 - the contract's field name
    @property
    def min_area_m2(self) -> float: ...
    @property
    def max_area_m2(self) -> float: ...


class ViewLike(Protocol):
    """The view handed to the black-box cloaker; the checker only maps user ids to rows."""

    @property
    def user_ids(self) -> Sequence[str]: ...


class CloakerLike(Protocol):
    """The public face of a snapshot cloaker (CONCEPTS §4.0), used as a black box."""

    @property
    def reciprocal(self) -> bool: ...

    def cloak(self, view: Any, row: int, profile: Any) -> object: ...


# -- geodesy of contract §0 ---------------------------------------------------------------------


def _area_of_span(dlon_deg: float, min_lat: float, max_lat: float) -> float:
    band = abs(math.sin(math.radians(max_lat)) - math.sin(math.radians(min_lat)))
    return EARTH_RADIUS_M * EARTH_RADIUS_M * math.radians(dlon_deg) * band


def area_m2(min_lon: float, min_lat: float, max_lon: float, max_lat: float) -> float:
    """Contract §0 bbox area: R² · Δλ · |sin φ2 − sin φ1| (angles in radians)."""
    return _area_of_span(max_lon - min_lon, min_lat, max_lat)


def decimal_box_area_m2(box: DecBox) -> float:
    """Area of a published box as any consumer of the JSON numbers computes it (float edges).

    The edges are parsed to floats first, exactly as the upstream reads them; an exact-decimal
    longitude span would differ by up to ~1e-8 (relative) for boxes a few micro-degrees wide.
    """
    min_lon, min_lat, max_lon, max_lat = (float(e) for e in box)
    return area_m2(min_lon, min_lat, max_lon, max_lat)


def haversine_m(lat1: npt.ArrayLike, lon1: npt.ArrayLike, lat2: npt.ArrayLike, lon2: npt.ArrayLike) -> F64:
    """Contract §0 great-circle distance on the sphere, vectorized (broadcasting)."""
    p1 = np.radians(np.asarray(lat1, dtype=np.float64))
    p2 = np.radians(np.asarray(lat2, dtype=np.float64))
    dl = np.radians(np.asarray(lon2, dtype=np.float64) - np.asarray(lon1, dtype=np.float64))
    a = np.sin((p2 - p1) / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    out: F64 = 2 * EARTH_RADIUS_M * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))
    return out


# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """Raw fixes at one instant (§2.3): presence is computed here, not trusted from the index.

    Several fixes of one user are allowed; the latest (largest ``t``, later row on a tie) is the
    user's position. ``present_*`` hold the present users' latest fixes, one entry per distinct id.
    """

    user_ids: tuple[str, ...]
    lat: F64
    lon: F64
    t: F64
    now: float
    stale_after_s: float = 60.0
    present_ids: tuple[str, ...] = field(init=False)
    present_lat: F64 = field(init=False)
    present_lon: F64 = field(init=False)
    present_row: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.user_ids)
        if not (len(self.lat) == len(self.lon) == len(self.t) == n):
            raise ValueError("snapshot: user_ids, lat, lon and t must have the same length")
        latest: dict[str, int] = {}
        t = self.t
        for i, u in enumerate(self.user_ids):
            j = latest.get(u)
            if j is None or t[i] >= t[j]:
                latest[u] = i
        rows = [i for i in latest.values() if t[i] >= self.now - self.stale_after_s]
        idx = np.asarray(rows, dtype=np.int64)
        ids = tuple(self.user_ids[i] for i in rows)
        object.__setattr__(self, "present_ids", ids)
        object.__setattr__(self, "present_lat", np.asarray(self.lat, dtype=np.float64)[idx])
        object.__setattr__(self, "present_lon", np.asarray(self.lon, dtype=np.float64)[idx])
        object.__setattr__(self, "present_row", {u: i for i, u in enumerate(ids)})

    @classmethod
    def from_arrays(
        cls,
        user_ids: Sequence[str],
        lat: npt.ArrayLike,
        lon: npt.ArrayLike,
        t: npt.ArrayLike | None = None,
        *,
        now: float = 0.0,
        stale_after_s: float = 60.0,
    ) -> Snapshot:
        """A snapshot from plain arrays; ``t`` defaults to ``now`` (everyone present)."""
        lat_a = np.array(lat, dtype=np.float64)
        t_a = np.full(len(lat_a), now) if t is None else np.array(t, dtype=np.float64)
        return cls(tuple(user_ids), lat_a, np.array(lon, dtype=np.float64), t_a, now, stale_after_s)

    @property
    def n_present(self) -> int:
        return len(self.present_ids)


@dataclass(frozen=True, slots=True, eq=False)
class Places:
    """A places layer (§1.6): points with a category each (any hashable label)."""

    lat: F64
    lon: F64
    category: tuple[Hashable, ...]

    @classmethod
    def from_arrays(cls, lat: npt.ArrayLike, lon: npt.ArrayLike, category: Sequence[Hashable]) -> Places:
        return cls(np.array(lat, dtype=np.float64), np.array(lon, dtype=np.float64), tuple(category))


@dataclass(frozen=True, slots=True)
class Published:
    """A forwarded region as serialized: bbox edges (``repr`` of floats, or strings) and its claims."""

    bbox: tuple[EdgeValue, EdgeValue, EdgeValue, EdgeValue]
    k_achieved: int
    area_m2: float
    l_achieved: int | None = None

    @classmethod
    def of(cls, region: Any) -> Published:
        """From a cloaker's region object (``bbox.to_geojson()``, ``k_achieved``, ``area_m2``, ``l_achieved``)."""
        b = region.bbox.to_geojson()
        return cls((b[0], b[1], b[2], b[3]), int(region.k_achieved), float(region.area_m2), region.l_achieved)


def edge_decimal(value: EdgeValue) -> Decimal:
    """The exact decimal a serialized edge stands for (a float is serialized with ``repr``)."""
    if isinstance(value, Decimal):
        return value
    if isinstance(value, str):
        return Decimal(value)
    return Decimal(repr(float(value)))


def region_box(result: object) -> DecBox | None:
    """Decimal edges of a black-box cloak result, or ``None`` for a refusal (anything without a bbox)."""
    bbox = getattr(result, "bbox", None)
    if bbox is None:
        return None
    b = bbox.to_geojson()
    return edge_decimal(b[0]), edge_decimal(b[1]), edge_decimal(b[2]), edge_decimal(b[3])


# -- exact containment --------------------------------------------------------------------------


def _inside_1d(v: Decimal | float, lo: Decimal | float, hi: Decimal | float, world: int) -> bool:
    """``lo < v < hi``, or equality at the world edge where strictness is impossible (contract §0)."""
    low_ok = lo < v or (v == lo == -world)
    high_ok = v < hi or (v == hi == world)
    return low_ok and high_ok


def coordinate_text(value: float) -> str:
    """The JSON text of a coordinate as a client sends it (``json.dumps`` writes ``repr``)."""
    return repr(float(value))


def strictly_inside(lat: float, lon: float, box: DecBox) -> bool:
    """Contract §0 containment of one coordinate in a published box, as every client reads it.

    Inside only if both hold: the float64 comparison (``float`` of the edge's text against the
    coordinate's float) and the exact decimal one (edge text against the coordinate's JSON text).
    """
    f0, f1, f2, f3 = (float(e) for e in box)
    as_float = _inside_1d(float(lon), f0, f2, 180) and _inside_1d(float(lat), f1, f3, 90)
    d_lon = Decimal(coordinate_text(lon))
    d_lat = Decimal(coordinate_text(lat))
    as_decimal = _inside_1d(d_lon, box[0], box[2], 180) and _inside_1d(d_lat, box[1], box[3], 90)
    return as_float and as_decimal


def inside_mask(lat: F64, lon: F64, box: DecBox) -> npt.NDArray[np.bool_]:
    """:func:`strictly_inside` for many points.

    The float64 comparison is vectorized; points it puts inside within ``_EDGE_BAND_DEG`` of an
    edge are also compared as exact decimals (further in, both comparisons agree).
    """
    if len(lat) == 0:
        return np.zeros(0, dtype=bool)
    lat = np.asarray(lat, dtype=np.float64)
    lon = np.asarray(lon, dtype=np.float64)
    f0, f1, f2, f3 = (float(e) for e in box)
    out: npt.NDArray[np.bool_] = (
        ((lon > f0) | ((lon == f0) & (f0 == -180.0)))
        & ((lon < f2) | ((lon == f2) & (f2 == 180.0)))
        & ((lat > f1) | ((lat == f1) & (f1 == -90.0)))
        & ((lat < f3) | ((lat == f3) & (f3 == 90.0)))
    )
    m = _EDGE_BAND_DEG
    clearly_in = (lon > f0 + m) & (lon < f2 - m) & (lat > f1 + m) & (lat < f3 - m)
    for i in np.flatnonzero(out & ~clearly_in).tolist():
        out[i] = strictly_inside(float(lat[i]), float(lon[i]), box)
    return out


def users_inside(snapshot: Snapshot, box: DecBox) -> list[str]:
    """Ids of present users strictly inside ``box`` (each distinct user once)."""
    mask = inside_mask(snapshot.present_lat, snapshot.present_lon, box)
    return [snapshot.present_ids[i] for i in np.flatnonzero(mask).tolist()]


def categories_inside(places: Places, box: DecBox) -> set[Hashable]:
    """Distinct categories of places strictly inside ``box`` (the checker's §1.6 definition)."""
    mask = inside_mask(places.lat, places.lon, box)
    return {places.category[i] for i in np.flatnonzero(mask).tolist()}


# -- profiles -----------------------------------------------------------------------------------

_STRICTER_IS_LARGER: dict[str, bool] = {
    "k": True,
    "l": True,
    "min_area_m2": True,
    "max_area_m2": False,
    "max_delay_s": False,
}


def apply_override(stored: ProfileLike, override: Mapping[str, Any] | None) -> ProfileLike | None:
    """The effective profile of §3.2 for a user with ``stored`` sending ``override``.

    ``None`` when that user could not send this query: a field would loosen its stored profile,
    an unknown field, or an invalid result. Built with :func:`dataclasses.replace`, so the result
    has the type the cloaker expects without the checker importing it.
    """
    if not override:
        return stored
    for name, value in override.items():
        larger = _STRICTER_IS_LARGER.get(name)
        if larger is None:
            return None
        current = getattr(stored, name)
        if (value < current) if larger else (value > current):
            return None
    try:
        out: ProfileLike = dataclasses.replace(stored, **dict(override))
    except (TypeError, ValueError):
        return None
    return out


def join_override(stored: ProfileLike, override: Mapping[str, Any] | None) -> ProfileLike | None:
    """The profile member ``stored`` would use when sending the querier's ``override`` (§9.1 row 6).

    Each override field applies only where it is stricter than the member's own stored value
    (the member's stricter value prevails): "recompute every member with the same override"
    without excluding members whose stored profile is already stricter. A field equal to the
    querier's stored value therefore changes nothing. ``None`` when the result is invalid
    (min_area_m2 > max_area_m2): that member cannot send the query.
    """
    if not override:
        return stored
    values: dict[str, Any] = {}
    for name, value in override.items():
        larger = _STRICTER_IS_LARGER.get(name)
        if larger is None:
            return None
        current = getattr(stored, name)
        values[name] = max(value, current) if larger else min(value, current)
    try:
        out: ProfileLike = dataclasses.replace(stored, **values)
    except (TypeError, ValueError):
        return None
    return out


def _profile_values(p: ProfileLike) -> tuple[int, int, float, float]:
    return int(p.k), int(p.l), float(p.min_area_m2), float(p.max_area_m2)


# -- the checker --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Report:
    object_id: str
    out: list[Violation] = field(default_factory=list)

    def add(self, prop: Property, expected: object, observed: object) -> None:
        self.out.append(Violation(self.object_id, prop, str(expected), str(observed)))


def _fraction_digits(d: Decimal) -> int:
    exp = d.as_tuple().exponent
    return -exp if isinstance(exp, int) and exp < 0 else 0


def _parse_box(published: Published, rep: _Report) -> DecBox | None:
    """Checks 1 (digits) and 5 (geometry); the exact edges when they are usable."""
    if len(published.bbox) != 4:
        rep.add(Property.GEOMETRY, "4 edges [min_lon, min_lat, max_lon, max_lat]", f"{len(published.bbox)} values")
        return None
    try:
        edges = [edge_decimal(v) for v in published.bbox]
    except (InvalidOperation, ValueError, TypeError):
        rep.add(Property.GEOMETRY, "numeric edges", "unparsable edge")
        return None
    if not all(e.is_finite() for e in edges):
        rep.add(Property.GEOMETRY, "finite edges", "non-finite edge")
        return None
    for name, e in zip(("min_lon", "min_lat", "max_lon", "max_lat"), edges, strict=True):
        digits = _fraction_digits(e)
        if digits > MAX_FRACTION_DIGITS:
            rep.add(Property.FRACTION_DIGITS, f"{name}: at most {MAX_FRACTION_DIGITS} fractional digits", digits)
    min_lon, min_lat, max_lon, max_lat = edges
    if min_lon > max_lon:
        rep.add(Property.GEOMETRY, "min_lon <= max_lon (no antimeridian crossing)", f"{min_lon} > {max_lon}")
    if min_lat > max_lat:
        rep.add(Property.GEOMETRY, "min_lat <= max_lat", f"{min_lat} > {max_lat}")
    if not (min_lon >= -WORLD_LON and max_lon <= WORLD_LON):
        rep.add(Property.GEOMETRY, "longitudes within [-180, 180]", f"[{min_lon}, {max_lon}]")
    if not (min_lat >= -WORLD_LAT and max_lat <= WORLD_LAT):
        rep.add(Property.GEOMETRY, "latitudes within [-90, 90]", f"[{min_lat}, {max_lat}]")
    return min_lon, min_lat, max_lon, max_lat


def check_region(
    snapshot: Snapshot,
    querier: str,
    published: Published,
    *,
    effective: ProfileLike,
    stored: Mapping[str, ProfileLike] | None = None,
    default_profile: ProfileLike | None = None,
    override: Mapping[str, Any] | None = None,
    places: Places | None = None,
    cloaker: CloakerLike | None = None,
    view: ViewLike | None = None,
    replay_view: ViewLike | None = None,
    object_id: str | None = None,
    area_rel_tol: float = 1e-9,
) -> list[Violation]:
    """Every §9.1 check of one forwarded region; an empty list means pass.

    ``stored`` maps user ids to stored profiles (``default_profile`` for the others); when the
    querier's stored profile is known, E is recomputed from it and ``override`` and must equal
    ``effective``. ``places`` enables check 4. With ``cloaker`` and ``view`` (the view the region was
    computed on) the checker also runs check 7 (determinism; again on ``replay_view``, an
    independently built view of the same snapshot, if given) and, for a cloaker declared
    reciprocal, check 6, replaying ``override`` for every member with :func:`join_override`.
    Areas are compared with a relative tolerance ``area_rel_tol``.
    """
    rep = _Report(object_id if object_id is not None else querier)
    stored_map: Mapping[str, ProfileLike] = stored if stored is not None else {}

    def stored_of(user: str) -> ProfileLike | None:
        return stored_map.get(user, default_profile)

    # Effective profile (§3.2), recomputed from the stored profile and the override.
    eff = effective
    s_q = stored_of(querier)
    if s_q is not None:
        recomputed = apply_override(s_q, override)
        if recomputed is None:
            rep.add(Property.EFFECTIVE_PROFILE, "an override no looser than the stored profile", dict(override or {}))
        else:
            if _profile_values(recomputed) != _profile_values(effective):
                rep.add(Property.EFFECTIVE_PROFILE, _profile_values(recomputed), _profile_values(effective))
            eff = recomputed
    k, l_req, min_area, max_area = _profile_values(eff)

    box = _parse_box(published, rep)
    q_row = snapshot.present_row.get(querier)
    if q_row is None:
        rep.add(Property.QUERIER_PRESENT, "querier present in the snapshot", "absent or stale")
    if box is None:
        return rep.out
    geometry_ok = box[0] <= box[2] and box[1] <= box[3]

    # 1. querier strictly inside (world-edge exception), with a hint when the order is swapped.
    if q_row is not None:
        q_lat = float(snapshot.present_lat[q_row])
        q_lon = float(snapshot.present_lon[q_row])
        if not strictly_inside(q_lat, q_lon, box):
            rep.add(Property.QUERIER_INSIDE, "querier strictly inside the bbox", f"({q_lon!r}, {q_lat!r}) not inside")
            swapped = (box[1], box[0], box[3], box[2])
            if strictly_inside(q_lat, q_lon, swapped):
                rep.add(Property.GEOJSON_ORDER, "[min_lon, min_lat, max_lon, max_lat]", "[min_lat, min_lon, ...]")

    # 2. present distinct users strictly inside.
    inside = users_inside(snapshot, box) if geometry_ok else []
    n_in = len(inside)
    if n_in < k:
        rep.add(Property.K, f">= {k} present users strictly inside", n_in)
    if n_in != published.k_achieved:
        rep.add(Property.K_ACHIEVED, n_in, published.k_achieved)

    # 3. area with the contract formula, within the bounds and equal to the claim.
    area = decimal_box_area_m2(box)
    if not (area >= min_area * (1 - area_rel_tol)):
        rep.add(Property.AREA_BOUNDS, f">= min_area_m2 {min_area!r}", repr(area))
    if not (area <= max_area * (1 + area_rel_tol)):
        rep.add(Property.AREA_BOUNDS, f"<= max_area_m2 {max_area!r}", repr(area))
    claimed = published.area_m2
    if not (math.isfinite(claimed) and abs(claimed - area) <= area_rel_tol * max(abs(area), 1e-300)):
        rep.add(Property.AREA_M2, repr(area), repr(claimed))

    # 4. place categories.
    if places is not None:
        n_cat = len(categories_inside(places, box)) if geometry_ok else 0
        if l_req > 1 and n_cat < l_req:
            rep.add(Property.L, f">= {l_req} place categories strictly inside", n_cat)
        if (l_req > 1 or published.l_achieved is not None) and published.l_achieved != n_cat:
            rep.add(Property.L_ACHIEVED, n_cat, published.l_achieved)
    elif l_req > 1:
        rep.add(Property.L, f"a places layer to verify l = {l_req}", "no places layer given")

    if cloaker is None or view is None or q_row is None:
        return rep.out
    view_row = _rows_of(view)

    # 7. determinism: the same request again (and on an independently built view) gives the same answer.
    for label, v in (("same view", view), ("replayed view", replay_view)):
        if v is None:
            continue
        row = (view_row if v is view else _rows_of(v)).get(querier)
        if row is None:
            rep.add(Property.VIEW, f"querier in the {label}", "missing")
            continue
        again = cloaker.cloak(v, row, effective)
        again_box = region_box(again)
        if again_box != box:
            rep.add(Property.DETERMINISM, f"{label}: bbox {_fmt(box)}", _fmt(again_box) if again_box else repr(again))
        elif getattr(again, "k_achieved", None) != published.k_achieved:
            rep.add(Property.DETERMINISM, f"{label}: k_achieved {published.k_achieved}", again)

    # 6. reciprocity (§1.5): C = {v inside R : region(v) == R} holds the querier and |C| >= max k over C.
    if cloaker.reciprocal:
        members: list[str] = []
        k_max = 0
        for v_id in inside:
            row = view_row.get(v_id)
            if row is None:
                rep.add(Property.VIEW, f"present user {v_id} in the cloaker's view", "missing")
                continue
            s_v = stored_of(v_id)
            if s_v is None:
                raise ValueError(f"check_region: no stored profile for user {v_id} and no default_profile")
            e_v = join_override(s_v, override)
            if e_v is None:  # this user could not send the same override
                continue
            if region_box(cloaker.cloak(view, row, e_v)) == box:
                members.append(v_id)
                k_max = max(k_max, int(e_v.k))
        if querier not in members:
            rep.add(Property.RECIPROCITY, "querier among the users that produce this region", sorted(members))
        if len(members) < k_max:
            rep.add(Property.RECIPROCITY, f"|C| >= max k over C = {k_max}", f"|C| = {len(members)}")
    return rep.out


def _rows_of(view: ViewLike) -> Mapping[str, int]:
    """User id → view row: the view's own ``row_of`` map when it has one, else built from ``user_ids``."""
    known = getattr(view, "row_of", None)
    if isinstance(known, Mapping):
        return known
    return {u: i for i, u in enumerate(view.user_ids)}


def _fmt(box: DecBox | None) -> str:
    return "None" if box is None else "[" + ", ".join(str(e) for e in box) + "]"


# -- refusals (§9.1 row 9) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RefusalCheck:
    """Outcome of :func:`check_refusal`: hard violations plus the "unnecessary refusal" quality flag.

    ``unnecessary`` is True when brute force found a box with ≥ k present users (querier included)
    whose exact-point area, raised to ``min_area_m2``, fits within ``max_area_m2``; None when not
    evaluated (large n, or a code it does not apply to).
    """

    violations: list[Violation]
    unnecessary: bool | None
    min_box_area_m2: float | None


def min_box_area_m2(lat: F64, lon: F64, querier: int, k: int) -> float:
    """Smallest contract-formula area of a lat/lon box holding point ``querier`` and ≥ k points.

    Brute force over the longitude span pairs (O(n³ log n), for small n): a lower bound for
    every published box, which is strictly larger. ``inf`` when fewer than k points exist.
    """
    n = len(lat)
    if k > n:
        return math.inf
    if k <= 1:
        return 0.0
    order = np.argsort(lon, kind="stable")
    lon_s = lon[order]
    lat_s = lat[order]
    pos = int(np.flatnonzero(order == querier)[0])
    q = math.sin(math.radians(float(lat[querier])))
    best = math.inf
    for i in range(pos + 1):
        for j in range(pos, n):
            if j - i + 1 < k:
                continue
            dlon = math.radians(float(lon_s[j]) - float(lon_s[i]))
            sins = np.sort(np.sin(np.radians(lat_s[i : j + 1])))
            lo = sins[: len(sins) - k + 1]
            hi = sins[k - 1 :]
            ok = (lo <= q) & (hi >= q)
            if not ok.any():
                continue
            a = EARTH_RADIUS_M * EARTH_RADIUS_M * dlon * float(np.min((hi - lo)[ok]))
            best = min(best, a)
    return best


def check_refusal(
    snapshot: Snapshot,
    querier: str,
    reason: str,
    *,
    effective: ProfileLike,
    allowed: Collection[str],
    supports_l: bool,
    object_id: str | None = None,
    brute_force_max_n: int = 80,
) -> RefusalCheck:
    """Refusal sanity (§3.3, §9.1 row 9) for a snapshot cloaker.

    Hard rules: the code is one the algorithm may return (``allowed``); ``unsupported`` iff
    ``l > 1`` on an algorithm without place diversity; otherwise ``k_unreachable`` iff fewer
    than E.k users are present. For ``area_exceeded`` with at most ``brute_force_max_n`` present
    users, also reports whether the refusal was unnecessary for an unconstrained box.
    """
    rep = _Report(object_id if object_id is not None else querier)
    k, l_req, min_area, max_area = _profile_values(effective)
    n = snapshot.n_present
    if reason not in allowed:
        rep.add(Property.REFUSAL_CODE, f"one of {sorted(allowed)}", reason)
    if l_req > 1 and not supports_l:
        if reason != "unsupported":
            rep.add(Property.REFUSAL_CODE, "unsupported (l > 1 without place diversity)", reason)
        return RefusalCheck(rep.out, None, None)
    if reason == "unsupported":
        rep.add(Property.REFUSAL_CODE, "no unsupported refusal for a supported profile", reason)
    if n < k and reason != "k_unreachable":
        rep.add(Property.REFUSAL_CODE, f"k_unreachable ({n} present < k = {k})", reason)
    if n >= k and reason == "k_unreachable":
        rep.add(Property.REFUSAL_CODE, f"not k_unreachable ({n} present >= k = {k})", reason)
    unnecessary: bool | None = None
    best: float | None = None
    q_row = snapshot.present_row.get(querier)
    if reason == "area_exceeded" and q_row is not None and n <= brute_force_max_n:
        best = min_box_area_m2(snapshot.present_lat, snapshot.present_lon, q_row, k)
        unnecessary = max(best, min_area) <= max_area
    return RefusalCheck(rep.out, unnecessary, best)


# -- CliqueCloak streams (§9.4) ------------------------------------------------------------------


def aeqd_xy(lat0: float, lon0: float, lat: F64, lon: F64) -> tuple[F64, F64]:
    """Spherical azimuthal equidistant coordinates (m) of points in the frame centred on (lat0, lon0) (§2.1)."""
    p0 = math.radians(lat0)
    p = np.radians(lat)
    dl = np.radians(lon - lon0)
    cos_c = np.clip(math.sin(p0) * np.sin(p) + math.cos(p0) * np.cos(p) * np.cos(dl), -1.0, 1.0)
    c = np.arccos(cos_c)
    sin_c = np.sin(c)
    scale = np.where(c < 1e-12, 1.0, c / np.where(sin_c == 0, 1.0, sin_c))
    x: F64 = EARTH_RADIUS_M * scale * np.cos(p) * np.sin(dl)
    y: F64 = EARTH_RADIUS_M * scale * (math.cos(p0) * np.sin(p) - math.sin(p0) * np.cos(p) * np.cos(dl))
    return x, y


def box_outline(box: DecBox, per_edge: int = 33) -> tuple[F64, F64]:
    """Points along the four edges of a lat/lon box (corners included, plus the equator if crossed)."""
    lon0, lat0, lon1, lat1 = (float(e) for e in box)
    lats = np.linspace(lat0, lat1, per_edge)
    lons = np.linspace(lon0, lon1, per_edge)
    if lat0 < 0 < lat1:
        lats = np.append(lats, 0.0)
    lat = np.concatenate([lats, lats, np.full(len(lons), lat0), np.full(len(lons), lat1)])
    lon = np.concatenate([np.full(len(lats), lon0), np.full(len(lats), lon1), lons, lons])
    return lat, lon


_UDEG = Decimal("0.000001")


def _tight_edge_below(v: float) -> Decimal:
    """§2.2 outward rounding of a lower bound: the largest whole micro-degree strictly below ``v``
    as a client reads it (as float64 and as the exact decimal of ``v``'s JSON text)."""
    text = Decimal(coordinate_text(v))
    e = text.quantize(_UDEG, rounding=ROUND_FLOOR)
    while not (e < text and float(e) < v):
        e -= _UDEG
    return e


def _tight_edge_above(v: float) -> Decimal:
    text = Decimal(coordinate_text(v))
    e = text.quantize(_UDEG, rounding=ROUND_CEILING)
    while not (e > text and float(e) > v):
        e += _UDEG
    return e


def tight_box(lat: Sequence[float], lon: Sequence[float]) -> DecBox:
    """The §2.2 published MBR of points: each edge rounded strictly outward, clipped to the world."""
    return (
        max(_tight_edge_below(min(lon)), -WORLD_LON),
        max(_tight_edge_below(min(lat)), -WORLD_LAT),
        min(_tight_edge_above(max(lon)), WORLD_LON),
        min(_tight_edge_above(max(lat)), WORLD_LAT),
    )


def check_clique_stream(
    requests: Sequence[Any],
    releases: Sequence[Any],
    expired: Sequence[tuple[float, Any]],
    *,
    tolerance_m: float = 1e-6,
    area_rel_tol: float = 1e-9,
) -> list[Violation]:
    """§9.4 over one CliqueCloak run; an empty list means pass.

    ``requests`` (each with ``request_id``, ``user``, ``lat``, ``lon``, receipt time ``t``, ``k``,
    ``min_area_m2``, ``max_area_m2``, ``max_delay_s``) are everything submitted; ``releases`` (each
    with ``members``, ``bbox``, ``area_m2``, ``released_at``) and ``expired`` (``(time, request)``)
    are the outcomes. Per release: ≥ k_s distinct senders for every member, the box strictly around
    every member, equal to their published MBR unless grown to the members' largest A_min (then
    containing it, with area ≥ that A_min), inside every member's constraint square (the square of
    area ``max_area_m2`` centred on it in its AEQD frame, ``tolerance_m``), area within every
    member's ``max_area_m2`` and equal to the claim, released between receipt and deadline. Every
    request ends exactly once: in one release, or expired no earlier than its deadline.
    """
    out: list[Violation] = []
    by_id = {r.request_id: r for r in requests}
    outcome: dict[str, int] = dict.fromkeys(by_id, 0)
    for i, rel in enumerate(releases):
        rid = f"release {i}"
        rep = _Report(rid)
        members = list(rel.members)
        b = rel.bbox.to_geojson()
        box = _parse_box(Published((b[0], b[1], b[2], b[3]), len(members), float(rel.area_m2)), rep)
        if box is None:
            out += rep.out
            continue
        users = {m.user for m in members}
        for m in members:
            if m.request_id not in by_id:
                rep.add(Property.VIEW, f"{m.request_id} among the submitted requests", "unknown")
                continue
            outcome[m.request_id] += 1
            if len(users) < m.k:
                rep.add(Property.K, f"{m.request_id}: >= {m.k} distinct senders", len(users))
            if not strictly_inside(m.lat, m.lon, box):
                rep.add(Property.QUERIER_INSIDE, f"{m.request_id} strictly inside", "not inside")
            if not (m.t <= rel.released_at <= m.t + m.max_delay_s):
                rep.add(
                    Property.DEADLINE,
                    f"{m.request_id}: released within [{m.t}, {m.t + m.max_delay_s}]",
                    rel.released_at,
                )
            x, y = aeqd_xy(m.lat, m.lon, *box_outline(box))
            h = math.sqrt(m.max_area_m2) / 2
            over = max(float(np.max(np.abs(x))), float(np.max(np.abs(y)))) - h
            if over > tolerance_m:
                rep.add(
                    Property.CONSTRAINT_BOX,
                    f"{m.request_id}: inside its square of half-side {h!r} m",
                    f"{over!r} m out",
                )
        area = decimal_box_area_m2(box)
        a_min = max(m.min_area_m2 for m in members)
        tight = tight_box([m.lat for m in members], [m.lon for m in members])
        if decimal_box_area_m2(tight) >= a_min:
            if box != tight:
                rep.add(Property.GEOMETRY, f"the members' published MBR {_fmt(tight)}", _fmt(box))
        else:
            contains = box[0] <= tight[0] and box[1] <= tight[1] and box[2] >= tight[2] and box[3] >= tight[3]
            if not contains or area < a_min * (1 - area_rel_tol):
                rep.add(Property.AREA_BOUNDS, f"the MBR grown to >= {a_min!r} m²", f"{_fmt(box)}, {area!r} m²")
        for m in members:
            if area > m.max_area_m2 * (1 + area_rel_tol):
                rep.add(Property.AREA_BOUNDS, f"{m.request_id}: <= max_area_m2 {m.max_area_m2!r}", repr(area))
        if not abs(float(rel.area_m2) - area) <= area_rel_tol * max(area, 1e-300):
            rep.add(Property.AREA_M2, repr(area), repr(rel.area_m2))
        out += rep.out
    for t, req in expired:
        rep = _Report(str(req.request_id))
        if req.request_id in outcome:
            outcome[req.request_id] += 1
        if t < req.t + req.max_delay_s:
            rep.add(Property.DEADLINE, f"expired no earlier than the deadline {req.t + req.max_delay_s!r}", t)
        out += rep.out
    for rid, n in outcome.items():
        if n != 1:
            out.append(Violation(rid, Property.OUTCOME, "forwarded once or expired once", f"{n} outcomes"))
    return out
