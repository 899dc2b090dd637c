"""The SQLite files of the data directory (contract §11), each defined once.

The broker's stores create and write these files, ``kcloak release DATADIR`` and the publication
ledger read them back; all of them build their SQL (``CREATE``, ``INSERT``, ``SELECT``) from the
definitions here, so a column renamed here is renamed for the writer and every reader at once.
Every file carries ``PRAGMA user_version`` = :data:`SCHEMA_VERSION`; a file without the marker
(``user_version`` 0: freshly created, or written by another tool) is read as version 1, the only
version there has been. A file of any other version is refused with :class:`SchemaVersionError`.
See ``docs/storage.md``.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from enum import StrEnum

from kcloak.core.errors import CoreError

SCHEMA_VERSION = 1
"""The version every file is written with (``PRAGMA user_version``)."""

UNMARKED_VERSION = 0
"""``user_version`` of a file that has no marker: read as :data:`SCHEMA_VERSION`."""


class SchemaVersionError(CoreError, ValueError):
    """A SQLite file of a schema version this kcloak does not read."""


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its name, SQL type and optional ``CHECK`` constraint on it."""

    name: str
    sql_type: str
    check: str | None = None

    def ddl(self) -> str:
        text = f"{self.name} {self.sql_type}"
        return text if self.check is None else f"{text} CHECK ({self.check})"


@dataclass(frozen=True, slots=True)
class Table:
    """One table: columns in order, primary key, and single-column indexes ``(name, column)``."""

    name: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...] = ()
    indexes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        names = self.column_names
        if len(set(names)) != len(names):
            raise ValueError(f"table {self.name}: a column is named twice")
        unknown = [c for c in (*self.primary_key, *(col for _, col in self.indexes)) if c not in names]
        if unknown:
            raise ValueError(f"table {self.name}: key or index on unknown columns {unknown}")

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def row(self, **values: object) -> tuple[object, ...]:
        """One row for :meth:`insert_sql`: the values by column name, in column order.

        A missing or unknown column is a ``ValueError``, so a writer's row cannot drift from the
        table it is written into."""
        names = self.column_names
        if values.keys() != set(names):
            missing = sorted(set(names) - values.keys())
            unknown = sorted(values.keys() - set(names))
            raise ValueError(f"table {self.name}: missing columns {missing}, unknown columns {unknown}")
        return tuple(values[n] for n in names)

    def create_sql(self) -> str:
        """``CREATE TABLE IF NOT EXISTS`` and its indexes (several statements, for ``executescript``)."""
        parts = [c.ddl() for c in self.columns]
        if len(self.primary_key) == 1:
            parts[self.column_names.index(self.primary_key[0])] += " PRIMARY KEY"
        elif self.primary_key:
            parts.append(f"PRIMARY KEY ({', '.join(self.primary_key)})")
        statements = [f"CREATE TABLE IF NOT EXISTS {self.name}({', '.join(parts)});"]
        statements += [f"CREATE INDEX IF NOT EXISTS {idx} ON {self.name}({col});" for idx, col in self.indexes]
        return "\n".join(statements)

    def insert_sql(self, *, conflict: str | None = None) -> str:
        """``INSERT`` of one full row, every column named, values in :attr:`column_names` order.

        ``conflict`` is SQLite's conflict clause (``"IGNORE"``, ``"REPLACE"``)."""
        verb = "INSERT" if conflict is None else f"INSERT OR {conflict}"
        marks = ", ".join("?" * len(self.columns))
        return f"{verb} INTO {self.name}({', '.join(self.column_names)}) VALUES ({marks})"

    def select_sql(self, columns: tuple[str, ...] | None = None, *, where: str = "", order_by: str = "") -> str:
        """``SELECT`` of ``columns`` (every column, in order, by default), naming each one."""
        chosen = self.column_names if columns is None else columns
        unknown = [c for c in chosen if c not in self.column_names]
        if unknown:
            raise ValueError(f"table {self.name}: no columns {unknown}")
        sql = f"SELECT {', '.join(chosen)} FROM {self.name}"
        if where:
            sql += f" WHERE {where}"
        if order_by:
            sql += f" ORDER BY {order_by}"
        return sql


@dataclass(frozen=True, slots=True)
class SqliteFile:
    """One SQLite file of the data directory: its file name and its tables."""

    filename: str
    tables: tuple[Table, ...]
    version: int = SCHEMA_VERSION

    def create_script(self) -> str:
        return "\n".join(t.create_sql() for t in self.tables)

    def check_version(self, conn: sqlite3.Connection) -> int:
        """The file's schema version (an unmarked file reads as :data:`SCHEMA_VERSION`).

        Raises :class:`SchemaVersionError` for any other version: a file written by another
        version of kcloak, whose columns may differ."""
        found = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if found == UNMARKED_VERSION:
            return self.version
        if found != self.version:
            raise SchemaVersionError(
                f"{self.filename} has schema version {found}; this kcloak reads version {self.version} only"
            )
        return found


class WindowState(StrEnum):
    """State of a window in ``movement.sqlite3``'s ``windows`` table (contract §11)."""

    COMMITTED = "committed"
    SENT = "sent"


class QueryOutcome(StrEnum):
    """``outcome`` of a forwarded query in ``querylog.sqlite3`` (contract §11)."""

    OK = "ok"
    UPSTREAM_ERROR = "upstream_error"


def _one_of(column: str, values: type[StrEnum]) -> str:
    return f"{column} IN ({','.join(repr(v.value) for v in values)})"


PROFILES = Table(
    "profiles",
    (
        Column("user_id", "TEXT"),
        Column("k", "INTEGER"),
        Column("l", "INTEGER"),
        Column("min_area_m2", "REAL"),
        Column("max_area_m2", "REAL"),
        Column("max_delay_s", "REAL"),
        Column("updated_t", "REAL"),
    ),
    primary_key=("user_id",),
)
"""At most one stored profile per user."""

FIXES = Table(
    "fixes",
    (Column("user_id", "TEXT"), Column("t", "REAL"), Column("lat", "REAL"), Column("lon", "REAL")),
    primary_key=("user_id", "t"),
    indexes=(("fixes_t", "t"),),
)
"""Every accepted fix (the write-ahead history); a row is ``(user_id, t, lat, lon)``."""

WINDOWS = Table(
    "windows",
    (
        Column("window_id", "TEXT"),
        Column("t_start", "INTEGER"),
        Column("t_end", "INTEGER"),
        Column("state", "TEXT", _one_of("state", WindowState)),
        Column("n_in", "INTEGER"),
        Column("n_out", "INTEGER"),
        Column("committed_t", "REAL"),
        Column("sent_t", "REAL"),
    ),
    primary_key=("window_id",),
)
"""The publication ledger: one row per window committed (then sent)."""

FORWARDED = Table(
    "forwarded",
    (
        Column("t", "REAL"),
        Column("kind", "TEXT"),
        Column("radius_m", "REAL"),
        Column("n", "INTEGER"),
        Column("category", "TEXT"),
        Column("min_lon", "REAL"),
        Column("min_lat", "REAL"),
        Column("max_lon", "REAL"),
        Column("max_lat", "REAL"),
        Column("t_start", "REAL"),
        Column("t_end", "REAL"),
        Column("area_m2", "REAL"),
        Column("k_achieved", "INTEGER"),
        Column("algorithm", "TEXT"),
        Column("outcome", "TEXT", _one_of("outcome", QueryOutcome)),
    ),
)
"""One row per forwarded query (not per attempt); no user id, query id or pseudonym."""

PROFILES_FILE = SqliteFile("profiles.sqlite3", (PROFILES,))
MOVEMENT_FILE = SqliteFile("movement.sqlite3", (FIXES, WINDOWS))
QUERYLOG_FILE = SqliteFile("querylog.sqlite3", (FORWARDED,))
DATA_FILES = (PROFILES_FILE, MOVEMENT_FILE, QUERYLOG_FILE)

__all__ = [
    "DATA_FILES",
    "FIXES",
    "FORWARDED",
    "MOVEMENT_FILE",
    "PROFILES",
    "PROFILES_FILE",
    "QUERYLOG_FILE",
    "SCHEMA_VERSION",
    "WINDOWS",
    "Column",
    "QueryOutcome",
    "SchemaVersionError",
    "SqliteFile",
    "Table",
    "WindowState",
]
