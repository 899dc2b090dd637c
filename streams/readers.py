"""Trajectory fix readers: the project's one reader set (CONCEPTS §7.1; contract §7 "Files").

Every reader turns a file into :class:`FixTable` columns (``traj_id``, ``t``, ``lat``,
``lon``) in file order, plus the number of **bad rows**: a row with a missing, unparsable or
out-of-range value, or a repeated ``(traj_id, t)`` (the first occurrence in file order is
kept), is skipped and counted, never fatal. A file that cannot be read at all (missing,
undecodable gzip, no usable header) raises :class:`ReaderError` (the CLI's exit 2).

Formats are looked up in :data:`READERS` by name; :func:`detect_format` picks one from the
path (suffix, folder) and, for CSV, from the header. A new format (``geolife``, ``gpx``) is a
function ``(Path) -> FixTable`` built with :class:`FixBuilder`, registered in ``READERS`` and
known to :func:`detect_format`.
"""

from __future__ import annotations

import csv
import gzip
import io
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
StrArray = npt.NDArray[np.str_]

CONTRACT_COLUMNS: tuple[str, ...] = ("traj_id", "t", "lat", "lon")


class ReaderError(ValueError):
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
        self._lat: list[str] = []
        self._lon: list[str] = []
        self._bad = 0

    def add(self, traj_id: str | None, t: str | float | None, lat: str | None, lon: str | None) -> None:
        if traj_id is None or t is None or lat is None or lon is None:
            self._bad += 1
            return
        self._ids.append(traj_id.strip())
        self._t.append(t)
        self._lat.append(lat)
        self._lon.append(lon)

    def bad(self, n: int = 1) -> None:
        self._bad += n

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
    except ValueError:
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


# -- registry ---------------------------------------------------------------------------------
Reader = Callable[[Path], FixTable]

READERS: dict[str, Reader] = {
    "csv": read_contract_csv,
    "ais": read_ais,
}
"""Reader by contract ``--format`` name (``geolife`` and ``gpx`` are still to come)."""

FORMATS: tuple[str, ...] = ("csv", "geolife", "gpx", "ais")
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
]
