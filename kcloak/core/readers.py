"""Trajectory fix readers: the project's one reader set (CONCEPTS §7.1; contract §7 "Files").

Every reader turns a file into :class:`FixTable` columns (``traj_id``, ``t``, ``lat``,
``lon``) in file order, plus the number of **bad rows**: a row with a missing, unparsable or
out-of-range value, or a repeated ``(traj_id, t)`` (the first occurrence in file order is
kept), is skipped and counted, never fatal. A file that cannot be read at all (missing,
undecodable gzip, no usable header) raises :class:`ReaderError` (the CLI's exit 2).

Formats are looked up in :data:`READERS` by name; :func:`detect_format` picks one from the
path (suffix, folder) and, for CSV, from the header. A format is a function
``(Path) -> FixTable`` built with :class:`FixBuilder`, registered in ``READERS`` and known to
:func:`detect_format`. :func:`write_contract_csv` is the one writer.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import CoreError, InputError
from kcloak.core.names import InputFormat, values

F64 = npt.NDArray[np.float64]
StrArray = npt.NDArray[np.str_]

CONTRACT_COLUMNS: tuple[str, ...] = ("traj_id", "t", "lat", "lon")


class ReaderError(CoreError, InputError, ValueError):
    """Input that cannot be read at all: unreadable file, unknown format, unusable header."""


@dataclass(frozen=True, slots=True, eq=False)
class FixTable:
    """Fixes as columns, one entry per good row, in file order (contract §7).

    ``traj_id`` is a numpy ``str`` array; ``t`` is Unix seconds; ``lat``/``lon`` WGS84 degrees.
    ``bad_rows`` counts the rows that were skipped.
    """

    traj_id: StrArray
    t: F64
    lat: F64
    lon: F64
    bad_rows: int = 0

    def __len__(self) -> int:
        return len(self.t)

    @property
    def n_trajectories(self) -> int:
        return len(np.unique(self.traj_id))

    def sorted(self) -> FixTable:
        """The same fixes ordered by ``(traj_id, t)`` (ids compared as strings)."""
        order = np.lexsort((self.t, self.traj_id))
        return FixTable(self.traj_id[order], self.t[order], self.lat[order], self.lon[order], self.bad_rows)


class FixBuilder:
    """Collects raw row values, then validates them all at once (shared by every reader).

    ``add`` takes the row's text values (``None`` for a missing field) or an already parsed
    time; ``bad`` counts a row rejected before that (e.g. a CSV syntax error). ``build``
    rejects missing ids, unparsable or non-finite numbers, out-of-range coordinates and
    repeated ``(traj_id, t)``.
    """

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._t: list[str | float] = []
        self._lat: list[str | float] = []
        self._lon: list[str | float] = []
        self._bad = 0

    def add(self, traj_id: str | None, t: str | float | None, lat: str | float | None, lon: str | float | None) -> None:
        if traj_id is None or t is None or lat is None or lon is None:
            self._bad += 1
            return
        self._ids.append(traj_id.strip())
        self._t.append(t)
        self._lat.append(lat)
        self._lon.append(lon)

    def bad(self, n: int = 1) -> None:
        self._bad += n

    def add_columns(
        self,
        traj_id: Sequence[str | None],
        t: Sequence[str | float | None],
        lat: Sequence[str | float | None],
        lon: Sequence[str | float | None],
    ) -> None:
        """``add`` for whole columns of equal length (values already in memory, e.g. a DataFrame's)."""
        if not len(traj_id) == len(t) == len(lat) == len(lon):
            raise ValueError("columns of unequal length")
        if any(None in column for column in (traj_id, t, lat, lon)):
            for row in zip(traj_id, t, lat, lon, strict=True):
                self.add(*row)
            return
        # no value is None (checked above); the filters only tell the type checker
        self._ids.extend(i.strip() for i in traj_id if i is not None)
        self._t.extend(v for v in t if v is not None)
        self._lat.extend(v for v in lat if v is not None)
        self._lon.extend(v for v in lon if v is not None)

    def build(self) -> FixTable:
        n = len(self._ids)
        ids = np.array(self._ids, dtype=np.str_) if n else np.empty(0, np.str_)
        t = _floats(self._t)
        lat = _floats(self._lat)
        lon = _floats(self._lon)
        ok = (
            (ids != "")
            & np.isfinite(t)
            & np.isfinite(lat)
            & np.isfinite(lon)
            & (np.abs(lat) <= 90.0)
            & (np.abs(lon) <= 180.0)
        )
        ok &= ~_repeats(ids, t, ok)
        bad = self._bad + int(n - np.count_nonzero(ok))
        return FixTable(ids[ok], t[ok], lat[ok], lon[ok], bad)


def _floats(values: Sequence[str | float]) -> F64:
    """Parse to float64, NaN where a value is not a number (vectorized, per item on failure)."""
    if not values:
        return np.empty(0, np.float64)
    try:
        return np.array(values, dtype=np.float64)
    except (ValueError, TypeError):
        return np.fromiter((_float_or_nan(v) for v in values), np.float64, len(values))


def _float_or_nan(v: str | float) -> float:
    try:
        return float(v)
    except (ValueError, TypeError):
        return float("nan")


def _repeats(ids: StrArray, t: F64, ok: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Rows whose ``(traj_id, t)`` already occurred in an earlier good row."""
    rows = np.flatnonzero(ok)
    out = np.zeros(len(ids), bool)
    if len(rows) < 2:
        return out
    order = rows[np.lexsort((rows, t[rows], ids[rows]))]
    same = (ids[order[1:]] == ids[order[:-1]]) & (t[order[1:]] == t[order[:-1]])
    out[order[1:][same]] = True
    return out


# -- opening files ---------------------------------------------------------------------------
def open_text(path: Path) -> io.TextIOBase:
    """Open a text file for :mod:`csv` (UTF-8, BOM dropped, undecodable bytes replaced), ``.gz`` by suffix."""
    try:
        if path.suffix.lower() == ".gz":
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", errors="replace", newline="")
        return open(path, encoding="utf-8-sig", errors="replace", newline="")
    except OSError as exc:
        raise ReaderError(f"{path.name}: cannot open ({exc.strerror or type(exc).__name__})") from exc


@contextmanager
def _csv_file(path: Path) -> Iterator[tuple[list[str], Iterator[list[str] | None]]]:
    """The stripped header and an iterator of rows (``None`` for a row the CSV parser rejected)."""
    with open_text(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise ReaderError(f"{path.name}: empty file, expected a CSV header") from None
        except (OSError, EOFError, zlib.error, csv.Error) as exc:
            raise ReaderError(f"{path.name}: unreadable ({type(exc).__name__})") from exc
        yield [h.strip() for h in header], _rows(reader, path)


def _rows(reader: Iterator[list[str]], path: Path) -> Iterator[list[str] | None]:
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error:
            yield None
            continue
        except (OSError, EOFError, zlib.error) as exc:
            raise ReaderError(f"{path.name}: unreadable ({type(exc).__name__})") from exc
        if row:  # blank lines are not rows
            yield row


def _column(header: list[str], name: str, *, case_insensitive: bool = False) -> int | None:
    want = name.lower() if case_insensitive else name
    for i, h in enumerate(header):
        if (h.lower() if case_insensitive else h) == want:
            return i
    return None


def _get(row: list[str], i: int) -> str | None:
    if i >= len(row):
        return None
    v = row[i]
    return v if v.strip() else None


# -- contract CSV -----------------------------------------------------------------------------
def read_contract_csv(path: str | Path) -> FixTable:
    """Contract CSV ``traj_id,t,lat,lon``: columns in any order, extra columns ignored (contract §7)."""
    p = Path(path)
    b = FixBuilder()
    with _csv_file(p) as (header, rows):
        idx = [_column(header, c) for c in CONTRACT_COLUMNS]
        missing = [c for c, i in zip(CONTRACT_COLUMNS, idx, strict=True) if i is None]
        if missing:
            raise ReaderError(f"{p.name}: CSV header must name traj_id, t, lat, lon (missing: {', '.join(missing)})")
        i_id, i_t, i_lat, i_lon = (i for i in idx if i is not None)
        for row in rows:
            if row is None:
                b.bad()
                continue
            b.add(_get(row, i_id), _get(row, i_t), _get(row, i_lat), _get(row, i_lon))
    return b.build()


# -- AIS --------------------------------------------------------------------------------------
def parse_iso8601(text: str) -> float:
    """Unix seconds of an ISO 8601 date-time; without an offset it is UTC (contract §7 ``ais``)."""
    s = text.strip()
    if s.endswith(("z", "Z")):
        s = s[:-1] + "+00:00"
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def read_ais(path: str | Path) -> FixTable:
    """AIS CSV: ``MMSI``, ``BaseDateTime`` (ISO 8601) or ``t`` (Unix s), ``LAT``, ``LON``, any case.

    One trajectory per MMSI (the MMSI text is the ``traj_id``); other columns are ignored. When
    both time columns exist, ``BaseDateTime`` is used.
    """
    p = Path(path)
    b = FixBuilder()
    parsed: dict[str, float] = {}  # AIS rows share timestamps: parse each text once
    nan = float("nan")
    with _csv_file(p) as (header, rows):
        i_id = _column(header, "mmsi", case_insensitive=True)
        i_dt = _column(header, "basedatetime", case_insensitive=True)
        i_t = _column(header, "t", case_insensitive=True)
        i_lat = _column(header, "lat", case_insensitive=True)
        i_lon = _column(header, "lon", case_insensitive=True)
        if i_id is None or i_lat is None or i_lon is None or (i_dt is None and i_t is None):
            raise ReaderError(f"{p.name}: AIS header must name MMSI, BaseDateTime (or t), LAT and LON")
        for row in rows:
            if row is None:
                b.bad()
                continue
            t: str | float | None
            if i_dt is not None:
                text = _get(row, i_dt)
                t = None if text is None else parsed.get(text)
                if text is not None and t is None:
                    try:
                        t = parse_iso8601(text)
                    except ValueError:
                        t = nan
                    parsed[text] = t
            else:
                assert i_t is not None
                t = _get(row, i_t)
            b.add(_get(row, i_id), t, _get(row, i_lat), _get(row, i_lon))
    return b.build()


# -- GeoLife ----------------------------------------------------------------------------------
GEOLIFE_HEADER_LINES = 6


def _geolife_files(p: Path) -> list[tuple[str, Path]]:
    """``(traj_id, file)`` of a ``.plt`` file or of a folder ``[Data/]<user>/Trajectory/*.plt``."""
    if p.is_file():
        user = p.parent.parent.name if p.parent.name.lower() == "trajectory" else p.parent.name
        return [(f"{user}/{_stem(p)}", p)]
    root = p / "Data" if (p / "Data").is_dir() else p
    files = [(f"{f.parent.parent.name}/{_stem(f)}", f) for f in sorted(root.glob("*/Trajectory/*.plt"))]
    files += [(f"{f.parent.parent.name}/{_stem(f)}", f) for f in sorted(root.glob("*/Trajectory/*.plt.gz"))]
    if not files:
        raise ReaderError(f"{p.name}: no <user>/Trajectory/*.plt files in this folder")
    return files


def _stem(p: Path) -> str:
    """File name without ``.gz`` and the format suffix (``a.plt.gz`` → ``a``)."""
    name = p.name[:-3] if p.name.lower().endswith(".gz") else p.name
    return name.rsplit(".", 1)[0] if "." in name else name


def _geolife_time(date: str, clock: str, days: dict[str, float]) -> float:
    """Unix seconds of GeoLife ``yyyy-mm-dd`` and ``hh:mm:ss`` (GMT); NaN when unparsable."""
    day = days.get(date)
    if day is None:
        try:
            day = datetime.fromisoformat(date.strip()).replace(tzinfo=UTC).timestamp()
        except ValueError:
            day = math.nan
        days[date] = day
    parts = clock.strip().split(":")
    if len(parts) != 3:
        return math.nan
    try:
        h, m, s = int(parts[0]), int(parts[1]), float(parts[2])
    except ValueError:
        return math.nan
    if not (0 <= h < 24 and 0 <= m < 60 and 0 <= s < 61):
        return math.nan
    return day + 3600 * h + 60 * m + s


def read_geolife(path: str | Path) -> FixTable:
    """GeoLife ``.plt`` file or folder (contract §7): 6 header lines, then ``lat,lon,0,alt,days,date,time`` (GMT).

    Each file is one trajectory ``<user>/<stem>``; the time comes from the date and time fields.
    """
    p = Path(path)
    b = FixBuilder()
    days: dict[str, float] = {}
    for traj_id, f in _geolife_files(p):
        with open_text(f) as text:
            try:
                for i, line in enumerate(text):
                    if i < GEOLIFE_HEADER_LINES or not line.strip():
                        continue
                    fields = line.split(",")
                    if len(fields) < 7:
                        b.bad()
                        continue
                    b.add(traj_id, _geolife_time(fields[5], fields[6], days), fields[0], fields[1])
            except (OSError, EOFError, zlib.error) as exc:
                raise ReaderError(f"{f.name}: unreadable ({type(exc).__name__})") from exc
    return b.build()


# -- GPX --------------------------------------------------------------------------------------
def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _children(elem: ET.Element, name: str) -> Iterable[ET.Element]:
    return (c for c in elem if _local(c.tag) == name)


def read_gpx(path: str | Path) -> FixTable:
    """GPX 1.0/1.1 (contract §7): each ``<trk>`` is a trajectory ``<file stem>:<index>`` (0-based, file order).

    Track points without ``<time>`` (or with a bad one) are bad rows; waypoints and routes are ignored.
    """
    p = Path(path)
    try:
        with gzip.open(p, "rb") if p.suffix.lower() == ".gz" else open(p, "rb") as f:
            root = ET.parse(f).getroot()
    except (OSError, EOFError, zlib.error, ET.ParseError) as exc:
        raise ReaderError(f"{p.name}: unreadable GPX ({type(exc).__name__})") from exc
    if _local(root.tag) != "gpx":
        raise ReaderError(f"{p.name}: not a GPX document (root element must be <gpx>)")
    b = FixBuilder()
    stem = _stem(p)
    for index, trk in enumerate(_children(root, "trk")):
        traj_id = f"{stem}:{index}"
        for seg in _children(trk, "trkseg"):
            for pt in _children(seg, "trkpt"):
                time = next((c.text for c in _children(pt, "time")), None)
                t: float | None = None
                if time is not None and time.strip():
                    try:
                        t = parse_iso8601(time)
                    except ValueError:
                        t = math.nan
                b.add(traj_id, t, pt.get("lat"), pt.get("lon"))
    return b.build()


# -- writer -----------------------------------------------------------------------------------
def _time_text(t: float) -> str:
    return str(int(t)) if float(t).is_integer() else repr(float(t))


def write_contract_csv(path: str | Path, table: FixTable) -> None:
    """Write exactly ``traj_id,t,lat,lon`` in table order (contract §7).

    Floats in ``repr`` (shortest round-trip) form, ``t`` as an int when integral; ``.gz`` by suffix.
    """
    p = Path(path)
    gz = p.suffix.lower() == ".gz"
    with gzip.open(p, "wt", encoding="utf-8", newline="") if gz else open(p, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(CONTRACT_COLUMNS)
        for start in range(0, len(table), 20_000):  # rows as Python objects a chunk at a time, not all at once
            part = slice(start, start + 20_000)
            cols = (
                table.traj_id[part].tolist(),
                table.t[part].tolist(),
                table.lat[part].tolist(),
                table.lon[part].tolist(),
            )
            w.writerows((i, _time_text(t), repr(la), repr(lo)) for i, t, la, lo in zip(*cols, strict=True))


# -- registry ---------------------------------------------------------------------------------
Reader = Callable[[Path], FixTable]

READERS: dict[str, Reader] = {
    "csv": read_contract_csv,
    "geolife": read_geolife,
    "gpx": read_gpx,
    "ais": read_ais,
}
"""Reader by contract ``--format`` name."""

FORMATS: tuple[str, ...] = values(InputFormat)
"""Every ``--format`` value of the contract (§9), supported or not yet."""


def detect_format(path: str | Path) -> str:
    """The contract format of ``path``: by folder or suffix, and for CSV by its header (``MMSI`` → ``ais``)."""
    p = Path(path)
    if p.is_dir():
        return "geolife"
    suffixes = [s.lower() for s in p.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last == ".plt":
        return "geolife"
    if last == ".gpx":
        return "gpx"
    with _csv_file(p) as (header, _):
        pass
    if _column(header, "mmsi", case_insensitive=True) is not None:
        return "ais"
    return "csv"


def read_fixes(path: str | Path, fmt: str | None = None) -> FixTable:
    """Read any supported trajectory file; ``fmt`` is a contract format name or ``None`` to detect it."""
    p = Path(path)
    if not p.exists():
        raise ReaderError(f"{p.name}: no such file or folder")
    name = fmt if fmt is not None else detect_format(p)
    reader = READERS.get(name)
    if reader is None:
        known = ", ".join(sorted(READERS))
        raise ReaderError(f"format {name!r} is not supported yet (supported: {known})")
    return reader(p)


__all__ = [
    "CONTRACT_COLUMNS",
    "FORMATS",
    "READERS",
    "FixBuilder",
    "FixTable",
    "ReaderError",
    "detect_format",
    "open_text",
    "parse_iso8601",
    "read_ais",
    "read_contract_csv",
    "read_fixes",
    "read_geolife",
    "read_gpx",
    "write_contract_csv",
]
