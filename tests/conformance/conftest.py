"""Black-box conformance harness: a real ``kcloak serve`` (and ``kcloak lbs``) as subprocesses.

Tests in this folder use only what an app or an attacker has: the command line, plain HTTP
(``urllib``), raw sockets, paho-mqtt and the mosquitto clients, and the tokens of their own
users. Nothing here imports kcloak; outputs are read as a client reads them (JSON → float64).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kcloak(*args: str) -> list[str]:
    """The ``kcloak`` command line, run with this interpreter."""
    return [sys.executable, "-I", "-m", "kcloak", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(
    method: str,
    url: str,
    body: object | None = None,
    *,
    token: str | None = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict[str, str], Any]:
    """One plain HTTP request; returns (status, headers, body parsed as JSON or the raw text)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, rh, text = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        status, rh, text = err.code, dict(err.headers), err.read()
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        parsed = text.decode("utf-8", "replace")
    return status, rh, parsed


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until ``url`` answers 200 (raises if ``proc`` exits first or on timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample ``name`` over the series whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, rest = head.partition("{")
        if metric_name != name:
            continue
        have = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    return total


@dataclass
class Served:
    """One running ``kcloak serve`` process."""

    proc: subprocess.Popen[bytes]
    http_port: int
    mqtt_port: int | None
    data_dir: Path
    log_path: Path
    args: list[str] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def logs(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def metrics(self) -> str:
        status, _, body = http_json("GET", self.url("/metrics"))
        assert status == 200
        return str(body)

    def metrics_once(self, name: str, reached: float, timeout_s: float = 5.0, **labels: str) -> str:
        """``/metrics`` once the sample ``name`` has reached ``reached`` (or after ``timeout_s``): one process
        counts a fix before its PUBACK, a cluster node (``cluster_mode.py``) when its router has judged it just
        after. The caller still asserts the exact value."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.metrics()
            if metric(text, name, **labels) >= reached or time.monotonic() > deadline:
                return text
            time.sleep(0.05)

    def kill9(self) -> None:
        """SIGKILL the broker (nothing of it may run on)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


class Servers:
    """Starts ``kcloak serve`` / ``kcloak lbs`` processes and stops every one at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self._n = 0

    def lbs(self) -> str:
        """The base URL of a real ``kcloak lbs`` (bundled Beijing POIs) on a free port. It is stateless,
        so one process serves the whole session (started on first use, stopped at the end)."""
        global _SESSION_LBS
        if _SESSION_LBS is None or _SESSION_LBS[0].poll() is not None:
            port = free_port()
            log = open(self.tmp_path / f"lbs-{port}.log", "wb")  # noqa: SIM115 - closed with the process
            proc = subprocess.Popen(
                kcloak("lbs", "--http", f"127.0.0.1:{port}"), stdout=log, stderr=log, cwd=ROOT, start_new_session=True
            )
            wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
            _SESSION_LBS = (proc, f"http://127.0.0.1:{port}")
        return _SESSION_LBS[1]

    def serve(
        self,
        *args: str,
        upstream: str | None = None,
        mqtt: bool = True,
        data_dir: Path | None = None,
        http_port: int | None = None,
        mqtt_port: int | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> Served:
        """``kcloak serve`` on free loopback ports with a data directory of its own.

        ``mqtt=False`` passes ``--mqtt none``; extra ``args`` go last (they may override).
        """
        self._n += 1
        http_port = http_port or free_port()
        data_dir = data_dir or self.tmp_path / f"data{self._n}"
        cmd = ["serve", "--http", f"127.0.0.1:{http_port}", "--data-dir", str(data_dir)]
        if upstream is not None:
            cmd += ["--upstream", upstream]
        if mqtt:
            mqtt_port = mqtt_port or free_port()
            cmd += ["--mqtt-listen", f"127.0.0.1:{mqtt_port}"]
        else:
            mqtt_port = None
            cmd += ["--mqtt", "none"]
        cmd += list(args)
        log_path = self.tmp_path / f"serve{self._n}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            kcloak(*cmd),
            stdout=log,
            stderr=log,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            start_new_session=True,
        )
        self.procs.append(proc)
        served = Served(proc, http_port, mqtt_port, data_dir, log_path, cmd)
        if wait:
            wait_http(served.url("/healthz"), proc=proc)
        return served

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


_SESSION_LBS: tuple[subprocess.Popen[bytes], str] | None = None


@pytest.fixture(scope="session", autouse=True)
def _stop_session_lbs() -> Iterator[None]:
    yield
    if _SESSION_LBS is not None and _SESSION_LBS[0].poll() is None:
        _SESSION_LBS[0].terminate()
        try:
            _SESSION_LBS[0].wait(timeout=15)
        except subprocess.TimeoutExpired:
            _SESSION_LBS[0].kill()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    s = Servers(tmp_path)
    try:
        yield s
    finally:
        s.close()
