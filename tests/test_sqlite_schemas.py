"""The data directory's SQLite files (contract §11): one schema each, shared by the broker's stores
(writer) and ``kcloak release DATADIR`` (reader), with a version the reader checks."""

from __future__ import annotations

import dataclasses
import re
import sqlite3
from pathlib import Path

import pytest

from kcloak.broker.publication import WindowRecord
from kcloak.broker.stores import MovementStore, ProfileStore, QueryLog, StoreError
from kcloak.cli.main import main
from kcloak.core.profile import PrivacyProfile
from kcloak.core.schemas import (
    DATA_FILES,
    FIXES,
    FORWARDED,
    MOVEMENT_FILE,
    PROFILES,
    PROFILES_FILE,
    QUERYLOG_FILE,
    SCHEMA_VERSION,
    WINDOWS,
    Column,
    QueryOutcome,
    SqliteFile,
    WindowState,
)
from kcloak.streams import tables
from kcloak.streams.tables import TableError, read_datadir_fixes, read_querylog

# The tables exactly as contract §11 writes them: what files written by earlier versions hold.
CONTRACT_DDL = {
    "profiles.sqlite3": """
        CREATE TABLE profiles(user_id TEXT PRIMARY KEY, k INTEGER, l INTEGER, min_area_m2 REAL,
            max_area_m2 REAL, max_delay_s REAL, updated_t REAL);""",
    "movement.sqlite3": """
        CREATE TABLE fixes(user_id TEXT, t REAL, lat REAL, lon REAL, PRIMARY KEY (user_id, t));
        CREATE INDEX fixes_t ON fixes(t);
        CREATE TABLE windows(window_id TEXT PRIMARY KEY, t_start INTEGER, t_end INTEGER,
            state TEXT CHECK (state IN ('committed','sent')), n_in INTEGER, n_out INTEGER,
            committed_t REAL, sent_t REAL);""",
    "querylog.sqlite3": """
        CREATE TABLE forwarded(t REAL, kind TEXT, radius_m REAL, n INTEGER, category TEXT, min_lon REAL,
            min_lat REAL, max_lon REAL, max_lat REAL, t_start REAL, t_end REAL, area_m2 REAL,
            k_achieved INTEGER, algorithm TEXT,
            outcome TEXT CHECK (outcome IN ('ok','upstream_error')));""",
}
FIX = ("alice", 1_700_000_000.0, 39.9, 116.4)
FORWARDED_ROW = (1.0, "knn", None, 5, "cafe", 116.0, 39.0, 116.1, 39.1, None, None, 1e6, 12, "hilbert", "ok")


def _columns(sql: str) -> tuple[str, ...]:
    """The column names an ``INSERT INTO t(a, b) ...`` or ``SELECT a, b FROM t ...`` statement names."""
    m = re.match(r"INSERT(?: OR \w+)? INTO \w+\(([^)]*)\)", sql) or re.match(r"SELECT (.*?) FROM ", sql)
    assert m is not None, sql
    return tuple(c.strip() for c in m.group(1).split(","))


def _shape(conn: sqlite3.Connection) -> dict[str, object]:
    """Tables with their columns (name, type, not null, default, primary-key position) and indexes."""
    shape: dict[str, object] = {}
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
        shape[name] = conn.execute(f"PRAGMA table_info({name})").fetchall()
        indexes = conn.execute(f"PRAGMA index_list({name})").fetchall()
        shape[f"{name} indexes"] = sorted(
            (unique, origin, conn.execute(f"PRAGMA index_info({idx})").fetchall())
            for _, idx, unique, origin, _ in indexes
        )
    return shape


@pytest.mark.parametrize("schema", DATA_FILES, ids=lambda f: f.filename)
def test_schema_creates_the_contract_tables(tmp_path: Path, schema: SqliteFile) -> None:
    """The one definition creates exactly the tables of contract §11 (so files of earlier versions match)."""
    ours, theirs = sqlite3.connect(tmp_path / "ours.db"), sqlite3.connect(tmp_path / "contract.db")
    ours.executescript(schema.create_script())
    theirs.executescript(CONTRACT_DDL[schema.filename])
    assert _shape(ours) == _shape(theirs)
    assert set(_shape(ours)) >= {t.name for t in schema.tables}


def test_check_constraints_come_from_the_enums(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "m.db")
    conn.executescript(MOVEMENT_FILE.create_script() + QUERYLOG_FILE.create_script())
    for state in WindowState:
        conn.execute(WINDOWS.insert_sql(), (f"w-{state}", 0, 900, state.value, 1, 1, 1.0, None))
    for outcome in QueryOutcome:
        conn.execute(FORWARDED.insert_sql(), (*FORWARDED_ROW[:-1], outcome.value))
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(WINDOWS.insert_sql(), ("w-bad", 0, 900, "lost", 1, 1, 1.0, None))
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(FORWARDED.insert_sql(), (*FORWARDED_ROW[:-1], "lost"))


def test_every_column_the_writer_inserts_is_one_the_reader_selects() -> None:
    """Writer and readers name their columns from the one definition, so they cannot drift apart."""
    # movement.sqlite3, fixes: the movement store inserts every column; release reads every one back.
    assert _columns(MovementStore.INSERT) == FIXES.column_names
    assert _columns(tables._FIXES_SELECT) == FIXES.column_names
    # querylog.sqlite3, forwarded: the query log inserts every column; release reads all but those it never
    # releases (the held interval, the achieved k, the algorithm and the outcome).
    assert _columns(QueryLog.INSERT) == FORWARDED.column_names
    read = _columns(tables._QUERYLOG_SELECT)
    assert set(read) <= set(FORWARDED.column_names)
    assert set(FORWARDED.column_names) - set(read) == {"t_start", "t_end", "k_achieved", "algorithm", "outcome"}
    # movement.sqlite3, windows: the ledger's record type is the table's row, field for field.
    assert tuple(f.name for f in dataclasses.fields(WindowRecord)) == WINDOWS.column_names
    # profiles.sqlite3: the store's upsert names every column.
    assert _columns(PROFILES.insert_sql(conflict="REPLACE")) == PROFILES.column_names


def test_a_renamed_column_is_renamed_for_create_insert_and_select(tmp_path: Path) -> None:
    """Renaming a column in a definition renames it in every statement built from it; a reader asking
    for the old name is refused when its statement is built (on import), not on some later read."""
    columns = tuple(Column("latitude", c.sql_type) if c.name == "lat" else c for c in FIXES.columns)
    renamed = dataclasses.replace(FIXES, columns=columns)
    conn = sqlite3.connect(tmp_path / "m.db")
    conn.executescript(renamed.create_sql())
    conn.execute(renamed.insert_sql(), FIX)
    assert conn.execute(renamed.select_sql()).fetchall() == [FIX]
    assert "latitude" in renamed.create_sql() and "latitude" in renamed.insert_sql()
    with pytest.raises(ValueError, match="lat"):
        renamed.select_sql(tables.FIX_COLUMNS)


async def test_files_written_by_the_broker_stores_are_read_by_release(tmp_path: Path) -> None:
    movement = MovementStore(tmp_path / MOVEMENT_FILE.filename)
    await movement.append([FIX, ("bob", 1_700_000_060.0, 39.91, 116.41)])
    movement.close()
    log = QueryLog(tmp_path / QUERYLOG_FILE.filename)
    await log.record(FORWARDED_ROW)
    log.close()
    fixes = read_datadir_fixes(tmp_path)
    assert fixes.traj_id.tolist() == ["alice", "bob"] and fixes.lat.tolist() == [39.9, 39.91]
    rows = read_querylog(tmp_path).rows
    assert rows == [
        {
            "t": "1",
            "lat": "39.05",
            "lon": "116.05",
            "area_m2": "1000000",
            "kind": "knn",
            "radius_m": "",
            "n": "5",
            "category": "cafe",
        }
    ]
    for file in (MOVEMENT_FILE, QUERYLOG_FILE):
        with sqlite3.connect(tmp_path / file.filename) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


async def test_files_without_a_version_marker_read_as_version_1(tmp_path: Path) -> None:
    """A file holding the contract's tables but no ``user_version`` (another tool wrote it) is version 1:
    release reads it and the broker's stores open it and mark it."""
    for name, ddl in CONTRACT_DDL.items():
        conn = sqlite3.connect(tmp_path / name)
        conn.executescript(ddl)
        conn.close()
    conn = sqlite3.connect(tmp_path / MOVEMENT_FILE.filename)
    conn.execute("INSERT INTO fixes VALUES (?, ?, ?, ?)", FIX)
    conn.commit()
    conn.close()
    assert read_datadir_fixes(tmp_path).traj_id.tolist() == ["alice"]
    movement = MovementStore(tmp_path / MOVEMENT_FILE.filename)
    assert movement.fixes_between(0, 2e9) == [FIX]
    movement.close()
    profiles = ProfileStore(tmp_path / PROFILES_FILE.filename)
    profiles.put("alice", PrivacyProfile(k=5), 1.0)
    stored = profiles.get("alice")
    assert stored is not None and stored.profile.k == 5
    profiles.close()
    with sqlite3.connect(tmp_path / MOVEMENT_FILE.filename) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def _foreign_data_dir(path: Path, version: int) -> Path:
    """A data directory whose movement and querylog files are of schema ``version``, with rows."""
    path.mkdir()
    for name in (MOVEMENT_FILE.filename, QUERYLOG_FILE.filename):
        conn = sqlite3.connect(path / name)
        conn.executescript(CONTRACT_DDL[name])
        conn.execute(f"PRAGMA user_version={version}")
        conn.commit()
        conn.close()
    return path


@pytest.mark.parametrize("kind", ["trips", "querylog"])
def test_release_refuses_a_data_dir_of_another_schema_version(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file of a schema version this kcloak does not know is refused with a one-line reason (exit 2),
    never read as if its columns meant what ours do, never a traceback."""
    data = _foreign_data_dir(tmp_path / "data", SCHEMA_VERSION + 1)
    out = tmp_path / "out.csv"
    assert main(["release", kind, str(data), "-o", str(out), "--k", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "schema version 2" in err and "version 1" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_reader_error_names_file_and_versions(tmp_path: Path) -> None:
    data = _foreign_data_dir(tmp_path / "data", 7)
    with pytest.raises(TableError, match=r"movement\.sqlite3 has schema version 7; this kcloak reads version 1"):
        read_datadir_fixes(data)
    with pytest.raises(TableError, match=r"querylog\.sqlite3 has schema version 7"):
        read_querylog(data)


@pytest.mark.parametrize("store", [MovementStore, QueryLog, ProfileStore])
def test_stores_refuse_a_file_of_another_schema_version_and_leave_it_alone(
    tmp_path: Path, store: type[MovementStore] | type[QueryLog] | type[ProfileStore]
) -> None:
    path = tmp_path / "file.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version=3")
    conn.close()
    with pytest.raises(StoreError, match="schema version 3; this kcloak reads version 1"):
        store(path)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
        assert conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
    conn.close()


def test_a_row_is_built_by_column_name_and_refuses_missing_or_unknown_columns() -> None:
    from kcloak.core.schemas import FORWARDED

    values = {name: i for i, name in enumerate(FORWARDED.column_names)}
    assert FORWARDED.row(**values) == tuple(range(len(FORWARDED.column_names)))
    shuffled = dict(reversed(list(values.items())))
    assert FORWARDED.row(**shuffled) == FORWARDED.row(**values)
    with pytest.raises(ValueError, match="missing columns \\['t'\\]"):
        FORWARDED.row(**{k: v for k, v in values.items() if k != "t"})
    with pytest.raises(ValueError, match="unknown columns \\['user'\\]"):
        FORWARDED.row(**values, user="alice")
