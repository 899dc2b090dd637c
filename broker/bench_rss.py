"""The resident memory of a real ``kcloak serve`` holding N users (``kcloak bench cloak --broker-rss``).

The broker runs as its own process (``kcloak serve``: HTTP on a free loopback port, no MQTT, a data
directory of its own, the instant upstream of :mod:`kcloak.broker.bench`). Every user gets one fix
through the contract's batch route (``POST /v1/locations``, batches of the contract's 10,000 items
at most), stamped with the time it is sent; the broker's presence window is raised so that the
first users loaded are still present when the last arrive. Then the broker prepares views the way it
does in service: kNN queries through ``POST /v1/users/{user}/query`` (each answered with a view at
least as new as its user's fix) and the housekeeping tick. Its RSS and peak (``VmRSS``, ``VmHWM``,
``RssAnon`` of ``/proc/PID/status``) are read after the queries and again after the broker's own
``malloc_trim`` period, with the size of its SQLite files.
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kcloak.broker.bench import CENTRE, instant_upstream, scrape, serve_process, wait_healthy
from kcloak.broker.memory import TRIM_EVERY_S
from kcloak.wire.net import free_port

TARGET_MB = 400.0
"""The figure the broker must stay under at a million users."""
BATCH = 10_000
"""Fixes per ``POST /v1/locations`` (the contract's batch limit)."""


@dataclass(frozen=True, slots=True)
class BrokerRssConfig:
    users: int = 1_000_000
    algorithm: str = "hilbert"
    queries: int = 200
    settle_s: float = TRIM_EVERY_S + 5.0
    """Wait after the queries before the second reading: one ``malloc_trim`` period of the broker."""
    seed: int = 1
    serve_command: tuple[str, ...] = ()
    """The command that starts ``kcloak serve`` (default: this interpreter's ``-m kcloak serve``)."""


def read_status(pid: int) -> dict[str, float]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of process ``pid``, MB (10^6 bytes)."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[name] = int(value.split()[0]) * 1024 / 1e6
    return out


def _post(port: int, path: str, body: bytes, timeout_s: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def user_id(i: int) -> str:
    """The bench's user ids (8 characters, as many real ids are short)."""
    return f"u{i:07d}"


def load_users(port: int, users: int, seed: int, progress: Callable[[int], None] | None = None) -> int:
    """One fix per user through ``POST /v1/locations``; returns the fixes the broker accepted."""
    rnd = random.Random(seed)
    accepted = 0
    for start in range(0, users, BATCH):
        now = time.time()
        items = [
            {
                "user": user_id(i),
                "t": now,
                "lat": round(CENTRE[0] + rnd.gauss(0, 0.05), 7),
                "lon": round(CENTRE[1] + rnd.gauss(0, 0.07), 7),
            }
            for i in range(start, min(users, start + BATCH))
        ]
        body = json.dumps({"updates": items}, separators=(",", ":")).encode()
        for attempt in range(50):  # a full store queue answers items `overloaded`: send those again
            answer = _post(port, "/v1/locations", body)
            accepted += int(answer["accepted"])
            again = [items[r["index"]] for r in answer["rejected"] if r["code"] == "overloaded"]
            if not again:
                break
            time.sleep(0.2 * (attempt + 1))
            items = again
            body = json.dumps({"updates": items}, separators=(",", ":")).encode()
        if progress is not None:
            progress(min(users, start + BATCH))
    return accepted


def run_queries(port: int, users: int, queries: int, seed: int) -> dict[str, int]:
    """``queries`` kNN queries of random users through the HTTP query route: ``{status: count}``."""
    rnd = random.Random(seed + 1)
    counts: dict[str, int] = {}
    for q in range(queries):
        user = user_id(rnd.randrange(users))
        body = json.dumps({"query_id": f"rss-{q}", "kind": "knn", "n": 5}).encode()
        try:
            answer = _post(port, f"/v1/users/{user}/query", body, timeout_s=60.0)
            status = str(answer.get("status", "?"))
        except urllib.error.HTTPError as exc:
            status = f"http_{exc.code}"
        counts[status] = counts.get(status, 0) + 1
    return counts


def _sqlite_mb(data_dir: Path) -> dict[str, float]:
    return {
        p.name: round(p.stat().st_size / 1e6, 1)
        for p in sorted(data_dir.rglob("*"))
        if p.is_file() and (".sqlite" in p.name or ".db" in p.name)
    }


def _mb(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


@contextlib.contextmanager
def _broker(cfg: BrokerRssConfig, tmp: Path, upstream: str) -> Iterator[tuple[int, int]]:
    port = free_port()
    args = [
        "--http",
        f"127.0.0.1:{port}",
        "--mqtt",
        "none",
        "--upstream",
        upstream,
        "--data-dir",
        str(tmp / "data"),
        "--algorithm",
        cfg.algorithm,
        # Loading a million users takes longer than the default 60 s presence window.
        "--stale-after-s",
        "3600",
        "--max-update-age-s",
        "3600",
    ]
    stop_timeout_s = 60.0 if cfg.serve_command else 30.0  # another checkout's broker (side by side) gets 60 s to stop
    with serve_process(args, command=cfg.serve_command, stop_timeout_s=stop_timeout_s) as proc:
        wait_healthy(port, timeout=60)
        yield port, proc.pid


def measure_broker_rss(cfg: BrokerRssConfig, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start a broker, load ``cfg.users`` users, prepare views, read its memory (module docstring)."""
    say = log or (lambda _: None)
    with tempfile.TemporaryDirectory(prefix="kcloak-rss-") as tmp_name, instant_upstream() as upstream:
        tmp = Path(tmp_name)
        with _broker(cfg, tmp, upstream) as (port, pid):
            idle = read_status(pid)
            say(f"broker started (pid {pid}, RSS {idle['VmRSS']:.0f} MB); loading {cfg.users:,} users")
            t0 = time.monotonic()
            step = max(BATCH, cfg.users // 10)

            def progress(done: int) -> None:
                if done % step == 0 or done == cfg.users:
                    say(f"  {done:,} users loaded ({time.monotonic() - t0:.0f} s)")

            accepted = load_users(port, cfg.users, cfg.seed, progress)
            load_s = time.monotonic() - t0
            loaded = read_status(pid)
            say(f"loaded in {load_s:.0f} s; {cfg.queries} queries")
            t1 = time.monotonic()
            answers = run_queries(port, cfg.users, cfg.queries, cfg.seed)
            query_s = time.monotonic() - t1
            after_queries = read_status(pid)
            present = scrape(port).get("kcloak_users_present")
            say(f"waiting {cfg.settle_s:.0f} s for the broker's own memory trim")
            time.sleep(cfg.settle_s)
            settled = read_status(pid)
            files = _sqlite_mb(tmp / "data")
    return {
        "users": cfg.users,
        "algorithm": cfg.algorithm,
        "accepted": accepted,
        "users_present": None if present is None else int(present),
        "queries": cfg.queries,
        "answers": answers,
        "load_s": round(load_s, 1),
        "load_fixes_per_s": round(accepted / load_s) if load_s > 0 else None,
        "query_s": round(query_s, 1),
        "broker_rss_mb": _mb(settled["VmRSS"]),
        "broker_peak_mb": _mb(settled["VmHWM"]),
        "target_mb": TARGET_MB,
        "met": settled["VmRSS"] < TARGET_MB,
        "rss_mb_idle": _mb(idle["VmRSS"]),
        "rss_mb_loaded": _mb(loaded["VmRSS"]),
        "rss_mb_after_queries": _mb(after_queries["VmRSS"]),
        "rss_anon_mb": _mb(settled.get("RssAnon")),
        "rss_file_mb": _mb(settled.get("RssFile")),
        "sqlite_mb": files,
        "settle_s": cfg.settle_s,
    }
