"""Attack (or operator error): delete ``kcloak.lock`` and start a second broker on the same data.

With the lock on a file that can be unlinked, the second ``kcloak serve`` creates a fresh
``kcloak.lock``, locks it and runs: two brokers then write the same databases and both publish
every window. Contract §11: one ``kcloak serve`` per data directory; a second one exits 1. The
lock must be on something that cannot be replaced under a running broker.
"""

from __future__ import annotations

import subprocess

from tests.conformance.conftest import ROOT, Servers, free_port, http_json, kcloak


def test_second_broker_refused_after_lock_file_deleted(servers: Servers) -> None:
    first = servers.serve(mqtt=False)
    (first.data_dir / "kcloak.lock").unlink()
    port = free_port()
    second = subprocess.run(
        kcloak("serve", "--http", f"127.0.0.1:{port}", "--mqtt", "none", "--data-dir", str(first.data_dir)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1, second.stderr[-2000:]
    assert "locked" in second.stderr
    # the first broker is untouched and still the only one serving this directory
    status, _, health = http_json("GET", first.url("/healthz"))
    assert status == 200 and health["status"] == "ok"
    assert first.stop() == 0
    # once the first has stopped, the directory can be served again
    again = servers.serve(mqtt=False, data_dir=first.data_dir)
    assert again.stop() == 0
