"""Table builders for releases (contract §8; CONCEPTS §8): trips, staypoints, places, querylog.

Sources: trajectories (any §7 input through :mod:`kcloak.core.readers`, bad rows counted), a data
directory (fixes from ``movement.sqlite3``, each user's fixes one trajectory; forwarded
queries from ``querylog.sqlite3``; both opened read-only, so a running broker is no obstacle),
or a CSV that already holds a table's "before" columns.

Stay points follow Li et al. (2008): from an anchor fix, the following fixes within
``stay_radius_m`` of it form a stay if they span at least ``stay_min_s``; the scan resumes
after the stay, otherwise at the next fix. Every step is vectorized with numpy except a loop
over candidate anchors.
"""

from __future__ import annotations

import csv
import math
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np
import numpy.typing as npt
import shapely

from kcloak.core import geohash
from kcloak.core.errors import InputError
from kcloak.core.geometry import EARTH_RADIUS_M, haversine_m_array
from kcloak.core.places import PoiSet
from kcloak.core.readers import FixTable, ReaderError, open_text, read_fixes
from kcloak.core.schemas import FIXES, FORWARDED, MOVEMENT_FILE, QUERYLOG_FILE, SchemaVersionError, SqliteFile
from kcloak.streams.errors import StreamsError

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class TableKind(StrEnum):
    """The tables of contract §8."""

    TRIPS = "trips"
    STAYPOINTS = "staypoints"
    PLACES = "places"
    QUERYLOG = "querylog"


BEFORE_COLUMNS: dict[TableKind, tuple[str, ...]] = {
    TableKind.TRIPS: (
        "trip_id",
        "traj_id",
        "origin_lat",
        "origin_lon",
        "dest_lat",
        "dest_lon",
        "start_t",
        "duration_s",
        "mode",
    ),
    TableKind.STAYPOINTS: ("staypoint_id", "traj_id", "lat", "lon", "arrival_t", "duration_s", "category"),
    TableKind.PLACES: ("traj_id", "places"),
    TableKind.QUERYLOG: ("t", "lat", "lon", "area_m2", "kind", "radius_m", "n", "category"),
}
"""Built ("before") columns of each table (contract §8)."""

IDENTIFIERS: frozenset[str] = frozenset({"trip_id", "staypoint_id", "traj_id"})
"""Direct identifiers, dropped on release."""

WALK_MAX_MPS = 2.5
BIKE_MAX_MPS = 7.0
POI_RADIUS_M = 100.0
UNKNOWN_CATEGORY = "unknown"
ANY_CATEGORY = "any"
_BAD_TEXT = set("|{}[]")


class TableError(StreamsError, InputError, ValueError):
    """A source that cannot be read or does not fit the table (exit 2)."""


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """Building rules of contract §8 (``--stay-radius-m``, ``--stay-min-s``, ``--place-precision``)."""

    stay_radius_m: float = 200.0
    stay_min_s: float = 1200.0
    place_precision: int = 7
    poi_radius_m: float = POI_RADIUS_M

    def __post_init__(self) -> None:
        if not (math.isfinite(self.stay_radius_m) and self.stay_radius_m > 0):
            raise TableError("--stay-radius-m: must be a finite number of metres > 0")
        if not (math.isfinite(self.stay_min_s) and self.stay_min_s > 0):
            raise TableError("--stay-min-s: must be a finite number of seconds > 0")
        if not 1 <= self.place_precision <= geohash.MAX_PRECISION:
            raise TableError(f"--place-precision: must be within [1, {geohash.MAX_PRECISION}]")


@dataclass(frozen=True, slots=True, eq=False)
class Table:
    """A built table: its kind, the "before" columns and rows of written strings.

    ``n_bad_rows`` counts input rows skipped (bad fixes, bad table rows); ``n_trajectories`` the
    trajectories the table was built from (``None`` for querylog and table CSVs).
    """

    kind: TableKind
    rows: list[dict[str, str]]
    n_bad_rows: int = 0
    n_trajectories: int | None = None
    columns: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", BEFORE_COLUMNS[self.kind])

    def __len__(self) -> int:
        return len(self.rows)


# -- formatting ------------------------------------------------------------------------------
def _num(x: float) -> str:
    """Shortest round-trip form, integral values without ``.0``."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _ints(x: F64) -> list[str]:
    return [str(v) for v in np.rint(x).astype(np.int64).tolist()]


def _floats(x: F64, ndigits: int | None = None) -> list[str]:
    vals = np.round(x, ndigits) if ndigits is not None else x
    return [_num(v) for v in vals.tolist()]


# -- trajectories ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class Stays:
    """Stay points of sorted fixes: index ranges ``[first, last]`` into the fixes, mean positions."""

    first: I64
    last: I64
    lat: F64
    lon: F64

    def __len__(self) -> int:
        return len(self.first)


def _traj_bounds(fx: FixTable) -> tuple[I64, I64]:
    """Start index of each trajectory and, per fix, the end (exclusive) of its trajectory."""
    n = len(fx)
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    change = np.flatnonzero(fx.traj_id[1:] != fx.traj_id[:-1]) + 1
    starts = np.concatenate([[0], change]).astype(np.int64)
    ends = np.append(starts[1:], n)
    lengths = ends - starts
    return starts, np.repeat(ends, lengths)


_BLOCK_CELLS = 1 << 21
"""Largest anchors × offsets block of distances computed at once."""


def _unit_vectors(lat: F64, lon: F64) -> F64:
    """Points on the unit sphere (``n × 3``): the chord between two of them decides haversine distances."""
    la, lo = np.radians(lat), np.radians(lon)
    return np.stack([np.cos(la) * np.cos(lo), np.cos(la) * np.sin(lo), np.sin(la)], axis=1)


def _chord2(radius_m: float) -> float:
    """Squared unit-sphere chord of a great-circle distance (monotone in it, so ``≤`` is exact)."""
    return float((2.0 * math.sin(min(radius_m / EARTH_RADIUS_M, math.pi) / 2.0)) ** 2)


def _exits(fx: FixTable, end: I64, radius_m: float, min_s: float) -> I64:
    """Per fix ``i``: the first later fix of its trajectory farther than ``radius_m`` (or the end).

    ``-1`` marks anchors whose fixes stay within the radius for at least ``min_s``: stay
    candidates whose exact exit is only needed if the scan takes them (then found by
    :func:`_gallop`). Anchors are scanned in blocks of offsets that double in width, so the
    work per anchor is bounded by the fixes within ``min_s`` after it.
    """
    n = len(fx)
    t = fx.t
    xyz = _unit_vectors(fx.lat, fx.lon)
    chord2 = _chord2(radius_m)
    exit_ = np.full(n, -1, np.int64)
    active = np.arange(n, dtype=np.int64)
    d, width = 1, 4
    while active.size:
        offs = np.arange(d, d + width, dtype=np.int64)
        keep: list[I64] = []
        step = max(1, _BLOCK_CELLS // width)
        for c0 in range(0, active.size, step):
            a = active[c0 : c0 + step]
            j = a[:, None] + offs[None, :]
            inside = j < end[a][:, None]
            jc = np.minimum(j, n - 1)
            diff = xyz[jc] - xyz[a][:, None, :]
            within = inside & (np.einsum("ijk,ijk->ij", diff, diff) <= chord2)
            out = ~within
            has_exit = out.any(axis=1)
            exit_[a[has_exit]] = a[has_exit] + d + np.argmax(out[has_exit], axis=1)
            # all fixes so far within the radius: a stay candidate once min_s has passed
            long_enough = t[jc[:, -1]] - t[a] >= min_s
            keep.append(a[~has_exit & ~long_enough])
        active = np.concatenate(keep)
        d += width
        width = min(width * 2, 512)
    return exit_


def detect_stays(fx: FixTable, *, radius_m: float, min_s: float) -> Stays:
    """Stay points of fixes sorted by ``(traj_id, t)`` (Li et al. 2008 anchor scan).

    ``exit[i]`` is the first fix after ``i`` (same trajectory) farther than ``radius_m`` from
    fix ``i``, or the trajectory's end. An anchor ``i`` starts a stay when
    ``t[exit[i] − 1] − t[i] ≥ min_s``; the scan then resumes at ``exit[i]``, otherwise at
    ``i + 1``. Only anchors that can start a stay are visited in Python.
    """
    n = len(fx)
    _, end = _traj_bounds(fx)
    lat, lon, t = fx.lat, fx.lon, fx.t
    exit_ = _exits(fx, end, radius_m, min_s)
    xyz = _unit_vectors(lat, lon)
    chord2 = _chord2(radius_m)
    resolved = exit_ >= 0
    dur = np.zeros(n)
    r = np.flatnonzero(resolved)
    dur[r] = t[exit_[r] - 1] - t[r]
    cand = np.flatnonzero(~resolved | (dur >= min_s))
    first: list[int] = []
    last: list[int] = []
    next_free = 0
    for c in cand.tolist():
        if c < next_free:
            continue
        e = int(exit_[c]) if exit_[c] >= 0 else _gallop(xyz, c, int(end[c]), chord2)
        if t[e - 1] - t[c] >= min_s:
            first.append(c)
            last.append(e - 1)
            next_free = e
    fa = np.array(first, np.int64)
    la = np.array(last, np.int64)
    if len(fa) == 0:
        return Stays(fa, la, np.empty(0), np.empty(0))
    counts = la - fa + 1
    idx = np.repeat(fa, counts) + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
    mlat = np.add.reduceat(lat[idx], np.cumsum(counts) - counts) / counts
    mlon = np.add.reduceat(lon[idx], np.cumsum(counts) - counts) / counts
    return Stays(fa, la, mlat, mlon)


def _gallop(xyz: F64, i: int, end: int, chord2: float) -> int:
    """First index after ``i`` (before ``end``) farther than the radius from fix ``i``, else ``end``."""
    lo = i + 1
    size = 256
    while lo < end:
        hi = min(end, lo + size)
        diff = xyz[lo:hi] - xyz[i]
        far = np.flatnonzero(np.einsum("ij,ij->i", diff, diff) > chord2)
        if far.size:
            return lo + int(far[0])
        lo = hi
        size *= 2
    return end


def nearest_categories(lat: F64, lon: F64, pois: PoiSet, *, radius_m: float = POI_RADIUS_M) -> list[str]:
    """Category of the nearest POI within ``radius_m`` (haversine) of each point, ``unknown`` if none.

    Candidates come from an STRtree query of degree boxes that surely hold the radius; the
    exact distance then decides (ties: the POI first in the file).
    """
    n = len(lat)
    out = [UNKNOWN_CATEGORY] * n
    if n == 0 or len(pois) == 0:
        return out
    plat, plon = pois.lat, pois.lon
    tree = shapely.STRtree(shapely.points(plon, plat))
    dlat = math.degrees(radius_m / EARTH_RADIUS_M) * 1.01
    coslat = np.maximum(np.cos(np.radians(np.minimum(np.abs(lat) + dlat, 89.9))), 1e-6)
    dlon = np.minimum(dlat / coslat, 180.0)
    boxes = shapely.box(lon - dlon, lat - dlat, lon + dlon, lat + dlat)
    q_idx, p_idx = tree.query(boxes)
    if q_idx.size == 0:
        return out
    dist = haversine_m_array(lat[q_idx], lon[q_idx], plat[p_idx], plon[p_idx])
    ok = dist <= radius_m
    q_idx, p_idx, dist = q_idx[ok], p_idx[ok], dist[ok]
    order = np.lexsort((p_idx, dist, q_idx))
    q_sorted = q_idx[order]
    firsts = order[np.concatenate([[True], q_sorted[1:] != q_sorted[:-1]])] if order.size else order
    cats = pois.categories
    for q, p in zip(q_idx[firsts].tolist(), p_idx[firsts].tolist(), strict=True):
        out[q] = cats[p]
    return out


def build_staypoints(fx: FixTable, options: BuildOptions, pois: PoiSet) -> Table:
    """``staypoints`` rows (contract §8): mean position, arrival, duration, nearest POI category."""
    sfx = fx.sorted()
    stays = detect_stays(sfx, radius_m=options.stay_radius_m, min_s=options.stay_min_s)
    cats = nearest_categories(stays.lat, stays.lon, pois, radius_m=options.poi_radius_m)
    traj = sfx.traj_id[stays.first].tolist()
    arrival = _ints(sfx.t[stays.first])
    duration = _ints(sfx.t[stays.last] - sfx.t[stays.first])
    lat_s, lon_s = _floats(stays.lat, 6), _floats(stays.lon, 6)
    rows = [
        {
            "staypoint_id": f"{tid}#{i}",
            "traj_id": tid,
            "lat": lat_s[i],
            "lon": lon_s[i],
            "arrival_t": arrival[i],
            "duration_s": duration[i],
            "category": cats[i],
        }
        for i, tid in enumerate(traj)
    ]
    return Table(TableKind.STAYPOINTS, rows, fx.bad_rows, sfx.n_trajectories)


def trip_segments(fx: FixTable, stays: Stays) -> tuple[I64, I64]:
    """Fix index ranges ``[start, end]`` of the trips: trajectory ends and stays delimit them.

    Within a trajectory the delimiters alternate start (trajectory start, stay's last fix) and
    end (stay's first fix, trajectory's last fix), so sorted starts and ends pair up; trips of
    fewer than 2 fixes are dropped.
    """
    starts, _ = _traj_bounds(fx)
    if len(starts) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    traj_last = np.append(starts[1:], len(fx)) - 1
    seg_start = np.sort(np.concatenate([starts, stays.last]))
    seg_end = np.sort(np.concatenate([stays.first, traj_last]))
    keep = seg_end > seg_start
    return seg_start[keep], seg_end[keep]


def travel_modes(fx: FixTable, seg_start: I64, seg_end: I64) -> list[str]:
    """``walk`` ≤ 2.5 m/s < ``bike`` ≤ 7 m/s < ``vehicle`` by the median speed of each trip's legs."""
    if len(seg_start) == 0:
        return []
    legs = seg_end - seg_start
    a = np.repeat(seg_start, legs) + (np.arange(int(legs.sum())) - np.repeat(np.cumsum(legs) - legs, legs))
    speed = haversine_m_array(fx.lat[a], fx.lon[a], fx.lat[a + 1], fx.lon[a + 1]) / (fx.t[a + 1] - fx.t[a])
    group = np.repeat(np.arange(len(legs)), legs)
    order = np.lexsort((speed, group))
    s = speed[order]
    offs = np.cumsum(legs) - legs
    lo = s[offs + (legs - 1) // 2]
    hi = s[offs + legs // 2]
    median = (lo + hi) / 2
    modes: list[str] = np.where(
        median <= WALK_MAX_MPS, "walk", np.where(median <= BIKE_MAX_MPS, "bike", "vehicle")
    ).tolist()
    return modes


def build_trips(fx: FixTable, options: BuildOptions) -> Table:
    """``trips`` rows (contract §8): movement between consecutive stay points or trajectory ends."""
    sfx = fx.sorted()
    stays = detect_stays(sfx, radius_m=options.stay_radius_m, min_s=options.stay_min_s)
    s, e = trip_segments(sfx, stays)
    modes = travel_modes(sfx, s, e)
    traj = sfx.traj_id[s].tolist()
    olat, olon = _floats(sfx.lat[s]), _floats(sfx.lon[s])
    dlat, dlon = _floats(sfx.lat[e]), _floats(sfx.lon[e])
    start_t = _ints(sfx.t[s])
    duration = _ints(sfx.t[e] - sfx.t[s])
    rows = [
        {
            "trip_id": f"{tid}#{i}",
            "traj_id": tid,
            "origin_lat": olat[i],
            "origin_lon": olon[i],
            "dest_lat": dlat[i],
            "dest_lon": dlon[i],
            "start_t": start_t[i],
            "duration_s": duration[i],
            "mode": modes[i],
        }
        for i, tid in enumerate(traj)
    ]
    return Table(TableKind.TRIPS, rows, fx.bad_rows, sfx.n_trajectories)


def build_places(fx: FixTable, options: BuildOptions) -> Table:
    """``places`` rows (contract §8): each trajectory's bag of stay-point geohash cells, sorted.

    Trajectories without a stay point have an empty bag and no row.
    """
    sfx = fx.sorted()
    stays = detect_stays(sfx, radius_m=options.stay_radius_m, min_s=options.stay_min_s)
    cells = geohash.encode(stays.lat, stays.lon, options.place_precision)
    bags: dict[str, list[str]] = {}
    for tid, cell in zip(sfx.traj_id[stays.first].tolist(), cells, strict=True):
        bags.setdefault(tid, []).append(cell)
    rows = [{"traj_id": tid, "places": " ".join(sorted(bag))} for tid, bag in sorted(bags.items())]
    return Table(TableKind.PLACES, rows, fx.bad_rows, sfx.n_trajectories)


# -- data directory --------------------------------------------------------------------------
def _connect_ro(directory: str | Path, schema: SqliteFile) -> sqlite3.Connection:
    """``schema``'s file in the data directory, opened read-only after checking its schema version."""
    path = Path(directory) / schema.filename
    if not path.is_file():
        raise TableError(f"data directory: {path.name} not found")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        raise TableError(f"data directory: cannot open {path.name} read-only") from exc
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        conn.execute("PRAGMA schema_version").fetchone()
        schema.check_version(conn)
    except sqlite3.Error as exc:
        conn.close()
        raise TableError(f"data directory: cannot open {path.name} read-only") from exc
    except SchemaVersionError as exc:
        conn.close()
        raise TableError(f"data directory: {exc}") from None
    return conn


def is_data_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f.filename).is_file() for f in (MOVEMENT_FILE, QUERYLOG_FILE))


FIX_COLUMNS = ("user_id", "t", "lat", "lon")
"""Columns of :data:`~kcloak.core.schemas.FIXES` read back as a :class:`FixTable` (each user one trajectory)."""
_FIXES_SELECT = FIXES.select_sql(FIX_COLUMNS, order_by="user_id, t")  # built on import: a renamed column fails here


def read_datadir_fixes(path: str | Path) -> FixTable:
    """Fixes of ``movement.sqlite3`` (read-only), each user's fixes one trajectory; bad rows counted."""
    conn = _connect_ro(path, MOVEMENT_FILE)
    try:
        rows = conn.execute(_FIXES_SELECT).fetchall()
    except sqlite3.Error as exc:
        raise TableError(f"data directory: {MOVEMENT_FILE.filename} has no readable {FIXES.name} table") from exc
    finally:
        conn.close()
    ids = np.array([str(r[0]) if r[0] is not None else "" for r in rows], dtype=np.str_)
    num = np.array([[_real(r[1]), _real(r[2]), _real(r[3])] for r in rows], np.float64).reshape(-1, 3)
    t, lat, lon = num[:, 0], num[:, 1], num[:, 2]
    ok = (ids != "") & np.isfinite(num).all(axis=1) & (np.abs(lat) <= 90) & (np.abs(lon) <= 180)
    bad = int(np.count_nonzero(~ok))
    return FixTable(ids[ok], t[ok], lat[ok], lon[ok], bad)


def _real(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


QUERYLOG_COLUMNS = ("t", "kind", "radius_m", "n", "category", "min_lon", "min_lat", "max_lon", "max_lat", "area_m2")
"""Columns of :data:`~kcloak.core.schemas.FORWARDED` a ``querylog`` table is built from (the others,
``t_start``, ``t_end``, ``k_achieved``, ``algorithm`` and ``outcome``, are not released)."""
_QUERYLOG_SELECT = FORWARDED.select_sql(QUERYLOG_COLUMNS)


def read_querylog(path: str | Path) -> Table:
    """``querylog`` rows (contract §8) from ``querylog.sqlite3`` (read-only): one per forwarded query."""
    conn = _connect_ro(path, QUERYLOG_FILE)
    try:
        rows = conn.execute(_QUERYLOG_SELECT).fetchall()
    except sqlite3.Error as exc:
        raise TableError(f"data directory: {QUERYLOG_FILE.filename} has no readable {FORWARDED.name} table") from exc
    finally:
        conn.close()
    out: list[dict[str, str]] = []
    bad = 0
    for t, kind, radius, n, category, min_lon, min_lat, max_lon, max_lat, area in rows:
        nums = [_real(v) for v in (t, min_lon, min_lat, max_lon, max_lat, area)]
        if not all(math.isfinite(v) for v in nums) or not isinstance(kind, str) or not _text_ok(kind):
            bad += 1
            continue
        ft, x0, y0, x1, y1, a = nums
        if not (-180 <= x0 <= x1 <= 180 and -90 <= y0 <= y1 <= 90 and a >= 0):
            bad += 1
            continue
        cat = category if isinstance(category, str) and category else ANY_CATEGORY
        if not _text_ok(cat):
            bad += 1
            continue
        r = _real(radius)
        out.append(
            {
                "t": str(round(ft)),
                "lat": _num(round((y0 + y1) / 2, 7)),
                "lon": _num(round((x0 + x1) / 2, 7)),
                "area_m2": _num(a),
                "kind": kind,
                "radius_m": _num(r) if math.isfinite(r) else "",
                "n": str(int(n)) if isinstance(n, int) and not isinstance(n, bool) else "",
                "category": cat,
            }
        )
    return Table(TableKind.QUERYLOG, out, bad, None)


def _text_ok(s: str) -> bool:
    return 0 < len(s) <= 64 and not (_BAD_TEXT & set(s)) and all(ord(c) >= 0x20 and c != "\x7f" for c in s)


# -- table CSVs ------------------------------------------------------------------------------
_INT_COLUMNS = {"start_t", "duration_s", "arrival_t", "t"}
_FLOAT_COLUMNS = {"origin_lon", "dest_lon", "lon", "origin_lat", "dest_lat", "lat", "area_m2", "radius_m"}
_OPTIONAL = {"radius_m", "n"}


def has_columns(path: str | Path, kind: TableKind) -> bool:
    """Whether the CSV at ``path`` has ``kind``'s "before" columns (so it is a built table)."""
    p = Path(path)
    if not p.is_file() or p.suffix.lower() in {".plt", ".gpx"}:
        return False
    try:
        with open_text(p) as fh:
            header = next(csv.reader(fh), [])
    except (OSError, ReaderError, csv.Error, StopIteration):
        return False
    names = {h.strip() for h in header}
    return set(BEFORE_COLUMNS[kind]) <= names


def _cell_ok(col: str, v: str, precision: set[int]) -> bool:
    if col in _OPTIONAL and v == "":
        return True
    if col in _INT_COLUMNS or col == "n":
        try:
            x = float(v)
        except ValueError:
            return False
        return math.isfinite(x) and x.is_integer() and (col != "duration_s" or x >= 0)
    if col in _FLOAT_COLUMNS:
        try:
            x = float(v)
        except ValueError:
            return False
        if not math.isfinite(x):
            return False
        if col.endswith("lat"):
            return -90 <= x <= 90
        if col.endswith("lon"):
            return -180 <= x <= 180
        return x >= 0
    if col == "places":
        cells = v.split(" ")
        if not v or any(not c for c in cells):
            return False
        try:
            for c in cells:
                geohash.code_of(c)
        except geohash.GeohashError:
            return False
        precision.update(len(c) for c in cells)
        return True
    return _text_ok(v)


def read_table_csv(path: str | Path, kind: TableKind) -> Table:
    """A CSV holding ``kind``'s "before" columns (any order, extras ignored); bad rows counted."""
    p = Path(path)
    try:
        fh = open_text(p)
    except (OSError, ReaderError) as exc:
        raise TableError(f"{p.name}: cannot read") from exc
    cols = BEFORE_COLUMNS[kind]
    rows: list[dict[str, str]] = []
    bad = 0
    precision: set[int] = set()
    with fh:
        reader = csv.reader(fh)
        try:
            header = [h.strip() for h in next(reader)]
        except (StopIteration, csv.Error) as exc:
            raise TableError(f"{p.name}: no header") from exc
        missing = [c for c in cols if c not in header]
        if missing:
            raise TableError(f"{p.name}: missing columns for the {kind} table: {', '.join(missing)}")
        where = {c: header.index(c) for c in cols}
        for raw in _safe_rows(reader):
            if raw is None or len(raw) < len(header):
                bad += 1
                continue
            row = {c: raw[i].strip() for c, i in where.items()}
            if all(_cell_ok(c, v, precision) for c, v in row.items()):
                for c in _INT_COLUMNS & row.keys():
                    row[c] = str(int(float(row[c])))
                if kind is TableKind.PLACES:
                    row["places"] = " ".join(sorted(row["places"].split(" ")))
                rows.append(row)
            else:
                bad += 1
    if len(precision) > 1:
        raise TableError(f"{p.name}: places cells must all have one geohash precision")
    return Table(kind, rows, bad, None)


def _safe_rows(reader: Iterator[list[str]]) -> Iterator[list[str] | None]:
    while True:
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error:
            yield None


# -- one entry point -------------------------------------------------------------------------
SOURCE_FORMATS: tuple[str, ...] = ("csv", "geolife", "gpx", "ais", "table", "datadir")
"""``--format`` values of ``kcloak release`` (contract §9)."""


class NotApplicableSource(TableError):
    """The table cannot be built from this kind of source (e.g. querylog from trajectories)."""


def source_format(path: str | Path, kind: TableKind, fmt: str | None) -> str:
    """The source format: ``fmt`` if given, else data directory / built table / trajectory format."""
    if fmt is not None:
        if fmt not in SOURCE_FORMATS:
            raise TableError(f"--format: must be one of {', '.join(SOURCE_FORMATS)}")
        return fmt
    p = Path(path)
    if not p.exists():
        raise TableError(f"{p.name}: no such file or folder")
    if is_data_dir(p):
        return "datadir"
    if has_columns(p, kind):
        return "table"
    return "auto"


def build_table(
    path: str | Path,
    kind: TableKind,
    *,
    fmt: str | None = None,
    options: BuildOptions | None = None,
    pois: PoiSet | None = None,
) -> Table:
    """Build ``kind`` from any source of contract §8 (see the module docstring)."""
    opts = options if options is not None else BuildOptions()
    src = source_format(path, kind, fmt)
    if src == "table":
        return read_table_csv(path, kind)
    if kind is TableKind.QUERYLOG:
        if src != "datadir":
            raise NotApplicableSource("querylog: build it from a data directory or a querylog CSV")
        return read_querylog(path)
    if src == "datadir":
        fixes = read_datadir_fixes(path)
    else:
        try:
            fixes = read_fixes(path, None if src == "auto" else src)
        except ReaderError as exc:
            raise TableError(str(exc)) from None
    return build_from_fixes(fixes, kind, opts, pois)


def build_from_fixes(fx: FixTable, kind: TableKind, options: BuildOptions, pois: PoiSet | None = None) -> Table:
    """Build a trajectory-derived table (trips, staypoints, places) from fixes."""
    if kind is TableKind.TRIPS:
        return build_trips(fx, options)
    if kind is TableKind.STAYPOINTS:
        if pois is None:
            from kcloak.core.places import load_pois

            pois = load_pois(None)
        return build_staypoints(fx, options, pois)
    if kind is TableKind.PLACES:
        return build_places(fx, options)
    raise NotApplicableSource(f"{kind}: not built from trajectories")


def write_table_csv(path: str | Path, columns: Sequence[str], rows: Sequence[dict[str, str]]) -> None:
    """Write rows (strings) with exactly ``columns`` (RFC 4180, LF line ends); ``.gz`` by suffix."""
    import gzip

    p = Path(path)
    opener = gzip.open if p.suffix.lower() == ".gz" else open
    with opener(p, "wt", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow([r[c] for c in columns])


__all__ = [
    "BEFORE_COLUMNS",
    "IDENTIFIERS",
    "SOURCE_FORMATS",
    "BuildOptions",
    "NotApplicableSource",
    "Stays",
    "Table",
    "TableError",
    "TableKind",
    "build_from_fixes",
    "build_places",
    "build_staypoints",
    "build_table",
    "build_trips",
    "detect_stays",
    "has_columns",
    "is_data_dir",
    "nearest_categories",
    "read_datadir_fixes",
    "read_querylog",
    "read_table_csv",
    "source_format",
    "travel_modes",
    "trip_segments",
    "write_table_csv",
]
