"""``kcloak serve`` is started on a data directory whose SQLite files are of another schema version.

Defect: serve refused the file but died with a Python traceback (an uncaught ``StoreError``) instead
of contract §9's startup failure: exit 1 with a one-line reason. The file must be left as it was.
"""

from __future__ import annotations

import sqlite3
import subprocess

import pytest

from tests.conformance.conftest import Servers


@pytest.mark.parametrize("name", ["profiles.sqlite3", "movement.sqlite3", "querylog.sqlite3"])
def test_serve_refuses_a_store_of_another_schema_version(servers: Servers, name: str) -> None:
    data = servers.tmp_path / f"data-{name}"
    data.mkdir(mode=0o700)
    conn = sqlite3.connect(data / name)
    conn.execute("PRAGMA user_version=2")
    conn.commit()
    conn.close()
    served = servers.serve(mqtt=False, data_dir=data, wait=False)
    try:
        code = served.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        served.kill9()
        raise AssertionError("kcloak serve kept running on a store of another schema version") from None
    logs = served.logs()
    assert code == 1, logs
    assert f"{name} has schema version 2" in logs, logs
    assert "Traceback" not in logs, logs
    conn = sqlite3.connect(data / name)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    assert conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
    conn.close()
