"""Helpers for the worker proofs (tests/cluster/test_worker_*.py): a real ``kcloak lbs`` upstream, worker
processes (``python -m kcloak.cli.cluster_worker``), and an app's side of the intake and answers streams.

Counting users in regions is the tests' own code (:func:`count_inside`): nothing from kcloak."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kcloak.broker.cluster.worker import Worker

LAT0, LON0 = 39.90, 116.40  # Beijing: the bundled POIs of `kcloak lbs`


def one_cell_worker(
    urls: list[str], tmp: Path, *, name: str = "w", spread: float = 0.0, pinned_timeout_s: float = 2.0
) -> Worker:
    """An in-process :class:`Worker` of a 2-partition, 1-cell layout (R3), with an unreachable upstream."""
    import dataclasses

    from kcloak.broker.cluster.topology import Layout
    from kcloak.broker.cluster.worker import Worker
    from kcloak.broker.config import Config
    from kcloak.broker.metrics import Metrics
    from kcloak.cloaking.cells import CellMap

    config = Config()
    config = dataclasses.replace(
        config,
        upstream=dataclasses.replace(config.upstream, url="http://127.0.0.1:9"),
        storage=dataclasses.replace(config.storage, data_dir=str(tmp)),
    )
    return Worker(
        servers=urls,
        layout=Layout(partitions=2, cells=1, replicas=3, pinned_timeout_s=pinned_timeout_s),
        cells=CellMap([]),
        config=config,
        metrics=Metrics(version="t", algorithm="hilbert"),
        name=name,
        spread_s=spread,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def lbs_url(tmp_path: Path) -> Iterator[str]:
    """A real ``kcloak lbs`` on a free port."""
    port = free_port()
    with (tmp_path / "lbs.log").open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "kcloak", "lbs", "--http", f"127.0.0.1:{port}"],
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("kcloak lbs did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


class WorkerProcess:
    """``python -m kcloak.cli.cluster_worker`` as a subprocess; :meth:`kill9` is the failure under test."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-m", "kcloak.cli.cluster_worker", *args],
                stdout=out,
                stderr=out,
                start_new_session=True,
            )

    def wait_started(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while "worker_started" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start: " + self.log_path.read_text(errors="replace")[-2000:])
            time.sleep(0.05)

    def cpu_s(self) -> float:
        """utime + stime of the process, from /proc."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill9(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def worker_procs() -> Iterator[list[WorkerProcess]]:
    procs: list[WorkerProcess] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill9()


def token(ident: str) -> str:
    return ident.replace(".", "//")


def fnv1a_32(data: bytes) -> int:
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def partition(ident: str, partitions: int) -> int:
    return fnv1a_32(token(ident).encode()) % partitions


class App:
    """What gateways would publish (PubAck'ed intake messages) and what they read (stored answers)."""

    def __init__(self, nc: Any, partitions: int) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10)
        self.partitions = partitions
        self.counter = 0
        self.acked_fixes: list[tuple[str, float, float, float]] = []

    async def publish(self, user: str, kind: str, body: dict[str, Any], *, transport: str = "mqtt") -> int:
        self.counter += 1
        subject = f"kcloak.in.{partition(user, self.partitions)}.{kind}.{token(user)}"
        headers = {"Nats-Msg-Id": f"test/{self.counter}", "Kcloak-Transport": transport}
        for attempt in range(40):
            try:
                ack = await self.js.publish(subject, json.dumps(body).encode(), stream="KCLOAK_IN", headers=headers)
                return int(ack.seq)
            except Exception:
                if attempt == 39:
                    raise
                await asyncio.sleep(0.25)  # a stream leader election: retry, the message id dedups
        raise AssertionError("unreachable")

    async def fix(self, user: str, t: float, lat: float, lon: float) -> None:
        await self.publish(user, "update", {"t": t, "lat": lat, "lon": lon})
        self.acked_fixes.append((user, t, lat, lon))

    async def answer(self, user: str, qid: str) -> dict[str, Any] | None:
        """The stored answer of a query (direct get of the last message of its subject), or None."""
        subject = f"kcloak.ans.{token(user)}.{token(qid)}"
        try:
            reply = await self.nc.request(
                "$JS.API.DIRECT.GET.KCLOAK_ANSWERS", json.dumps({"last_by_subj": subject}).encode(), timeout=2
            )
        except Exception:
            return None
        if (reply.headers or {}).get("Status"):
            return None
        answer: dict[str, Any] = json.loads(reply.data)
        return answer

    async def answers_count(self, user: str, qid: str) -> int:
        """How many messages the answers stream holds or ever held on a query's subject (its last sequence
        number for the subject counts every stored one: max_msgs_per_subject=1 keeps only the last)."""
        info = await self.js.stream_info("KCLOAK_ANSWERS", subjects_filter=f"kcloak.ans.{token(user)}.{token(qid)}")
        return int((info.state.subjects or {}).get(f"kcloak.ans.{token(user)}.{token(qid)}", 0))


async def debug_status(nc: Any, wait_s: float = 0.4) -> list[dict[str, Any]]:
    """Every live worker's status with its owned users (core NATS request, several replies)."""
    inbox = nc.new_inbox()
    got: list[dict[str, Any]] = []

    async def cb(msg: Any) -> None:
        got.append(json.loads(msg.data))

    sub = await nc.subscribe(inbox, cb=cb)
    await nc.publish("kcloak.debug.status", b"", reply=inbox)
    await asyncio.sleep(wait_s)
    await sub.unsubscribe()
    return got


def count_inside(bbox: list[float], positions: dict[str, tuple[float, float]]) -> int:
    """Users strictly inside ``[min_lon, min_lat, max_lon, max_lat]`` (float64), the tests' own count."""
    min_lon, min_lat, max_lon, max_lat = (float(v) for v in bbox)
    return sum(1 for lat, lon in positions.values() if min_lat < lat < max_lat and min_lon < lon < max_lon)


def population(n: int, seed: int, spread: float = 0.03) -> dict[str, tuple[float, float]]:
    rng = random.Random(seed)
    return {
        f"u{i}.x": (round(LAT0 + rng.uniform(-spread, spread), 6), round(LON0 + rng.uniform(-spread, spread), 6))
        for i in range(n)
    }


class Rounds:
    """The proofs' traffic, in rounds: every user moves (some jump across the city, so across cells), the
    fixes are PubAck'ed, the test waits until every owner holds every user's latest fix (sampling, each time,
    that no user is in two live indexes), then queries and checks each stored answer against its own
    latest-fix reference."""

    def __init__(self, app: App, nc: Any, pop: dict[str, tuple[float, float]], *, k: int = 5, seed: int = 7) -> None:
        self.app = app
        self.nc = nc
        self.ref = dict(pop)
        self.ref_t: dict[str, float] = {}
        self.k = k
        self.rng = random.Random(seed)
        self.samples = 0
        self.max_rejected: dict[str, dict[str, int]] = {}
        self.answers: dict[str, dict[str, Any]] = {}
        self.ok = 0
        self.refused: list[str] = []
        self.republished: dict[str, int] = {}
        self._sub: Any = None

    async def start(self) -> None:
        async def cb(msg: Any) -> None:
            self.republished[msg.subject] = self.republished.get(msg.subject, 0) + 1

        self._sub = await self.nc.subscribe("kcloak.out.ans.>", cb=cb)

    async def move_all(self, jump: float = 0.2) -> None:
        t = round(time.time(), 3)
        for user, (lat, lon) in list(self.ref.items()):
            if self.rng.random() < jump:
                lat, lon = LAT0 + self.rng.uniform(-0.01, 0.01), LON0 + self.rng.uniform(-0.01, 0.01)
            else:
                lat, lon = lat + self.rng.uniform(-0.0005, 0.0005), lon + self.rng.uniform(-0.0005, 0.0005)
            lat, lon = round(lat, 6), round(lon, 6)
            await self.app.fix(user, t, lat, lon)
            self.ref[user] = (lat, lon)
            self.ref_t[user] = t

    async def sample(self) -> dict[str, float]:
        """One look at every live owner: asserts no user is in two live indexes; returns token → held t."""
        held: dict[str, float] = {}
        for status in await debug_status(self.nc, 0.15):
            rejected = {k: v for k, v in status["counters"]["router"].items() if k.startswith("rejected_")}
            prev = self.max_rejected.setdefault(status["name"], {})
            for key, value in rejected.items():
                prev[key] = max(prev.get(key, 0), value)
            for users in status["users"].values():
                for tok, t in users.items():
                    assert tok not in held, "a user is in two live indexes"
                    held[tok] = t
        self.samples += 1
        return held

    async def settle(self, timeout: float = 15.0) -> None:
        """Until every user's latest PubAck'ed fix is in exactly one live index."""
        want = {token(u): t for u, t in self.ref_t.items()}
        deadline = time.monotonic() + timeout
        while True:
            held = await self.sample()
            if held == want:
                return
            if time.monotonic() > deadline:
                missing = sum(1 for u, t in want.items() if held.get(u) != t)
                raise AssertionError(f"{missing} users' latest acknowledged fix not held after {timeout} s")

    async def query(self, tag: str, users: list[str], timeout: float = 15.0) -> None:
        qids = {user: f"{tag}:{i}" for i, user in enumerate(users)}
        for user, qid in qids.items():
            await self.app.publish(user, "query", {"query_id": qid, "kind": "knn", "n": 3})
        snapshot = dict(self.ref)
        deadline = time.monotonic() + timeout
        pending = dict(qids)
        while pending:
            for user, qid in list(pending.items()):
                answer = await self.app.answer(user, qid)
                if answer is not None:
                    self.answers[f"{user}/{qid}"] = answer
                    del pending[user]
                    self.check(answer, snapshot)
            if pending:
                assert time.monotonic() < deadline, f"{len(pending)} queries without an answer after {timeout} s"
                await asyncio.sleep(0.1)

    def check(self, answer: dict[str, Any], snapshot: dict[str, tuple[float, float]]) -> None:
        if answer["status"] == "ok":
            self.ok += 1
            inside = count_inside(answer["region"]["bbox"], snapshot)
            assert inside >= self.k, f"a forwarded region holds {inside} < k users of the reference"
            assert answer["k_achieved"] <= inside
        else:
            self.refused.append(answer["reason"])

    async def exactly_one_answer_each(self, wait_s: float = 1.0) -> None:
        await asyncio.sleep(wait_s)  # republished copies still on their way
        subjects = {f"kcloak.out.ans.{token(key.split('/')[0])}.{token(key.split('/')[1])}" for key in self.answers}
        counts = {s: self.republished.get(s, 0) for s in subjects}
        assert all(c == 1 for c in counts.values()), {c for c in counts.values()}
        assert not set(self.republished) - subjects, "an answer to a query nobody asked"

    def out_of_order(self) -> int:
        return sum(r.get("rejected_out_of_order", 0) + r.get("rejected_too_old", 0) for r in self.max_rejected.values())
