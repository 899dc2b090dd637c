"""``kcloak bench broker``: sustained intake and query rates, and the latency the broker adds.

The broker runs as a real ``kcloak serve`` process; the MQTT broker is a spawned mosquitto
(when on PATH) or the embedded one; the upstream is an instant in-process provider (a minimal
HTTP/1.1 server in a thread). Load comes
from separate client processes so that the client is not the bottleneck on the broker's
process. Rates are read from the broker's own counters (``/metrics``), so they count what the
broker accepted and answered, not what clients managed to send. Added latency comes from the
broker's ``kcloak_added_latency_seconds`` histogram (receipt → answer, minus upstream and hold
time), interpolated within buckets, at half the sustained query rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from kcloak.wire.net import free_port

CENTRE = (39.9, 116.4)


@dataclass(frozen=True, slots=True)
class BrokerBenchConfig:
    duration_s: float = 10.0
    users: int = 10_000
    mqtt: str | None = None  # None: mosquitto if on PATH, else embedded
    algorithm: str = "hilbert"
    client_processes: int = 2
    mqtt_client: str = "mixed"
    """The load generators' MQTT client: ``mixed`` (fixes from paho-mqtt, whose sending pace does not
    depend on kcloak's code; queries and answers with kcloak's client, since paho reads a byte at a time
    and would be the bottleneck of the query phase: the generators of the bench before the one-client
    change), ``kcloak`` (both with kcloak's client) or ``paho`` (both with paho-mqtt)."""


def _positions(users: int, seed: int) -> list[tuple[str, float, float]]:
    rnd = random.Random(seed)
    return [(f"b{i:06d}", CENTRE[0] + rnd.gauss(0, 0.03), CENTRE[1] + rnd.gauss(0, 0.04)) for i in range(users)]


# -- metrics scraping ------------------------------------------------------------------------------
def scrape(port: int, timeout_s: float = 10.0) -> dict[str, float]:
    """The broker's ``/metrics`` on 127.0.0.1:``port`` as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _sum(metrics: dict[str, float], prefix: str, *needles: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix) and all(n in k for n in needles))


def histogram_quantile(before: dict[str, float], after: dict[str, float], transport: str, q: float) -> float | None:
    """Quantile (seconds) of ``kcloak_added_latency_seconds`` between two scrapes, linear in buckets."""
    prefix = "kcloak_added_latency_seconds_bucket"
    buckets: list[tuple[float, float]] = []
    for key, value in after.items():
        if key.startswith(prefix) and f'transport="{transport}"' in key:
            le = key.split('le="')[1].split('"')[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets.append((bound, value - before.get(key, 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    target = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= target:
            if bound == float("inf"):
                return prev_bound
            span = count - prev_count
            frac = 0.0 if span <= 0 else (target - prev_count) / span
            return prev_bound + frac * (bound - prev_bound)
        prev_bound, prev_count = bound, count
    return prev_bound


# -- processes -------------------------------------------------------------------------------------
INSTANT_ANSWER = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n{"candidates":[]}'
"""What the instant provider answers every request: no candidates, the connection kept open."""


class _InstantProvider(asyncio.Protocol):
    """One connection of :func:`instant_upstream`: every complete request (head and
    ``Content-Length`` body) is answered :data:`INSTANT_ANSWER`, the answers of one read in one
    write. It costs the host a few CPU-µs per query, so that the query phase measures the broker
    rather than the bench's provider (aiohttp there took about 95 CPU-µs per request, a third of
    what the broker spent)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        answers = 0
        while (end := buf.find(b"\r\n\r\n")) >= 0:
            length = 0
            for line in bytes(buf[:end]).split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(buf) < end + 4 + length:
                break
            del buf[: end + 4 + length]
            answers += 1
        if answers and self.transport is not None:
            self.transport.write(INSTANT_ANSWER * answers)


INSTANT_THREADS: dict[str, int] = {}
"""The thread id (as ``/proc/<id>/stat`` knows it) of each running :func:`instant_upstream`, by URL."""


@contextlib.contextmanager
def instant_upstream() -> Iterator[str]:
    """An instant provider in a thread of this process: a minimal HTTP/1.1 server
    (:class:`_InstantProvider`) that answers every request ``{"candidates": []}``."""
    import threading

    port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    servers: list[asyncio.Server] = []
    url = f"http://127.0.0.1:{port}"

    async def start() -> None:
        servers.append(await loop.create_server(_InstantProvider, "127.0.0.1", port))
        ready.set()

    def serve() -> None:
        INSTANT_THREADS[url] = threading.get_native_id()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield url
    finally:
        INSTANT_THREADS.pop(url, None)
        if servers:
            loop.call_soon_threadsafe(servers[0].close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@contextlib.contextmanager
def mosquitto(workdir: Path) -> Iterator[tuple[int, str]]:
    """A mosquitto on a free loopback port, configured as ``kcloak mosquitto-config`` would (open
    mode): ``(port, version label)``. FileNotFoundError when mosquitto is not installed."""
    with _mosquitto_process(workdir) as (port, label, _):
        yield port, label


@contextlib.contextmanager
def _mosquitto_process(workdir: Path) -> Iterator[tuple[int, str, int]]:
    from kcloak.broker.mosquitto import durability_lines

    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if exe is None:
        raise FileNotFoundError("mosquitto")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = workdir / "mosquitto.conf"
    # Persistence and limits as kcloak mosquitto-config writes them, so the bench runs as deployed.
    lines = [f"listener {port} 127.0.0.1", "allow_anonymous true", *durability_lines(workdir.resolve())]
    if os.getuid() == 0:
        lines.append("user root")
    conf.write_text("\n".join(lines) + "\n")
    version = subprocess.run([exe, "-h"], capture_output=True, text=True).stdout.splitlines()
    label = version[0].strip() if version else "mosquitto"
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port)
        yield port, label, proc.pid
    finally:
        proc.terminate()
        proc.wait(5)


def _wait_port(port: int, timeout: float = 15.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")


@contextlib.contextmanager
def serve_process(
    args: list[str], *, command: Sequence[str] = (), stop_timeout_s: float = 30.0
) -> Iterator[subprocess.Popen[bytes]]:
    """A ``kcloak serve`` child (``command``: another program to run as it, e.g. another checkout's), stopped
    with SIGTERM on exit and killed after ``stop_timeout_s``."""
    cmd = [*(command or (sys.executable, "-I", "-m", "kcloak", "serve")), *args, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_healthy(port: int, timeout: float = 30.0) -> None:
    """Block until ``GET /healthz`` on a local broker answers 200 (TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("the broker did not become healthy")


# -- load generators (run in child processes) ------------------------------------------------------
def _update_client(choice: str) -> str:
    """The MQTT client of the fix generators for a ``BrokerBenchConfig.mqtt_client`` choice."""
    return "kcloak" if choice == "kcloak" else "paho"


def _query_client(choice: str) -> str:
    """The MQTT client of the query generators for a ``BrokerBenchConfig.mqtt_client`` choice."""
    return "paho" if choice == "paho" else "kcloak"


def _mqtt_update_worker(
    port: int, users: list[tuple[str, float, float]], duration_s: float, client: str = "kcloak"
) -> None:
    """Fixes at QoS 0 as fast as the ``client`` (``kcloak``: kcloak's MQTT client; ``paho``) sends them."""
    if client == "paho":
        _paho_update_worker(port, users, duration_s)
        return
    from kcloak.wire.mqtt_client import MqttClient

    async def main() -> None:
        async with MqttClient(host="127.0.0.1", port=port, client_prefix="bench") as conn:
            end = time.monotonic() + duration_s
            i = 0
            n = len(users)
            while time.monotonic() < end:
                for _ in range(1000):
                    user, lat, lon = users[i % n]
                    payload = json.dumps({"t": time.time(), "lat": lat, "lon": lon}).encode()
                    await conn.send(f"kcloak/v1/update/{user}", payload, qos=0)
                    i += 1
                await asyncio.sleep(0)  # let the socket drain

    asyncio.run(main())


def _paho_update_worker(port: int, users: list[tuple[str, float, float]], duration_s: float) -> None:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"bench-{os.getpid()}",
    )
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    end = time.monotonic() + duration_s
    i = 0
    n = len(users)
    while time.monotonic() < end:
        user, lat, lon = users[i % n]
        payload = json.dumps({"t": time.time(), "lat": lat, "lon": lon})
        client.publish(f"kcloak/v1/update/{user}", payload, qos=0)
        i += 1
        if i % 1000 == 0:
            time.sleep(0.001)  # let paho's network thread drain its queue
    client.loop_stop()
    client.disconnect()


def _http_update_worker(port: int, users: list[tuple[str, float, float]], duration_s: float) -> None:
    """Single-fix POSTs over 128 keep-alive connections with kcloak's lean HTTP/1.1 client
    (aiohttp's client costs as much CPU as the server, which would make the client the bottleneck)."""
    from kcloak.wire.http_client import HttpPool

    async def connection(http: HttpPool, offset: int, end: float) -> None:
        i = offset
        while time.monotonic() < end:
            user, lat, lon = users[i % len(users)]
            i += 128
            body = json.dumps({"t": time.time(), "lat": lat, "lon": lon}).encode()
            await http.request("POST", f"/v1/users/{user}/location", body)

    async def main() -> None:
        end = time.monotonic() + duration_s
        async with HttpPool(host="127.0.0.1", port=port, connections=128) as http:
            await asyncio.gather(*(connection(http, j, end) for j in range(128)))

    asyncio.run(main())


def _http_query_worker(
    port: int, users: list[tuple[str, float, float]], duration_s: float, rate: float | None, tag: str
) -> None:
    """kNN queries with the lean HTTP/1.1 client: 64 in a closed loop, or open loop at ``rate``/s."""
    from kcloak.wire.http_client import HttpPool

    async def main() -> None:
        end = time.monotonic() + duration_s
        async with HttpPool(host="127.0.0.1", port=port, connections=128) as http:
            counter = [0]

            async def one() -> None:
                counter[0] += 1
                user = users[counter[0] % len(users)][0]
                q = {"query_id": f"{tag}-{os.getpid()}-{counter[0]}", "kind": "knn", "n": 3}
                await http.request("POST", f"/v1/users/{user}/query", json.dumps(q).encode())

            if rate is None:

                async def loop() -> None:
                    while time.monotonic() < end:
                        await one()

                await asyncio.gather(*(loop() for _ in range(64)))
            else:
                tasks = set()
                start = time.monotonic()
                sent = 0
                while time.monotonic() < end:
                    due = start + sent / rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    t = asyncio.create_task(one())
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    sent += 1
                if tasks:
                    await asyncio.wait(tasks, timeout=10)

    asyncio.run(main())


QUERY_WINDOW = 256
"""Most queries one MQTT client process keeps outstanding in the closed-loop phase."""


class _Queries:
    """The queries of one query worker: ``kcloak/v1/query/{user}`` topics and bodies, the users in
    turn, for ``duration_s`` from :meth:`begin`; paced at ``rate`` per second, or closed loop when
    ``rate`` is None."""

    def __init__(self, users: list[tuple[str, float, float]], duration_s: float, rate: float | None, tag: str) -> None:
        self.users = users
        self.rate = rate
        self.prefix = f"{tag}-{os.getpid()}-"
        self.mine = f'"query_id":"{self.prefix}'.encode()
        """In the answers to this worker's queries (its users' answers to other queries are not its own)."""
        self.duration_s = duration_s
        self.start = self.end = 0.0
        self.sent = 0

    def begin(self) -> None:
        self.start = time.monotonic()
        self.end = self.start + self.duration_s

    def running(self) -> bool:
        return time.monotonic() < self.end

    def delay(self) -> float:
        """Seconds until the next query is due (0 when closed loop)."""
        return 0.0 if self.rate is None else max(0.0, self.start + self.sent / self.rate - time.monotonic())

    def answer_topics(self) -> list[str]:
        """This worker's users' answer topics, subscribed one by one as each app subscribes to its
        own: a ``kcloak/v1/answer/+`` in every worker would have the broker encode and send every
        answer to every worker, and every worker read them all."""
        return [f"kcloak/v1/answer/{user}" for user, _, _ in self.users]

    def next(self) -> tuple[str, bytes]:
        user = self.users[self.sent % len(self.users)][0]
        body = {"query_id": f"{self.prefix}{self.sent}", "kind": "knn", "n": 3}
        self.sent += 1
        return f"kcloak/v1/query/{user}", json.dumps(body).encode()


def _mqtt_query_worker(
    port: int,
    users: list[tuple[str, float, float]],
    duration_s: float,
    rate: float | None,
    tag: str,
    client: str = "kcloak",
) -> None:
    """Queries at QoS 0 and answers read with the ``client`` (``kcloak``: kcloak's MQTT client;
    ``paho``); at most :data:`QUERY_WINDOW` queries outstanding when closed-loop (``rate`` None)."""
    if client == "paho":
        _paho_query_worker(port, users, duration_s, rate, tag)
        return
    from kcloak.wire.mqtt_client import Incoming, MqttClient

    async def main() -> None:
        window = asyncio.Semaphore(QUERY_WINDOW)
        queries = _Queries(users, duration_s, rate, tag)

        def on_answers(batch: list[Incoming]) -> None:
            for m in batch:
                if queries.mine in m.payload:
                    window.release()

        async with MqttClient(host="127.0.0.1", port=port, client_prefix="bench", on_messages=on_answers) as conn:
            await conn.subscribe(queries.answer_topics())
            queries.begin()
            while queries.running():
                if rate is not None:
                    await asyncio.sleep(queries.delay())
                else:
                    try:
                        async with asyncio.timeout(1):
                            await window.acquire()
                    except TimeoutError:
                        continue
                topic, body = queries.next()
                await conn.send(topic, body, qos=0)
                if queries.sent % 64 == 0:
                    await asyncio.sleep(0)
            await asyncio.sleep(1)

    asyncio.run(main())


def _paho_query_worker(
    port: int, users: list[tuple[str, float, float]], duration_s: float, rate: float | None, tag: str
) -> None:
    """:func:`_mqtt_query_worker` with paho-mqtt (its network thread reads the answers)."""
    import threading

    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    window = threading.Semaphore(QUERY_WINDOW)
    subscribed = threading.Event()
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"bench-{os.getpid()}",
    )
    client.on_subscribe = lambda *_: subscribed.set()
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    queries = _Queries(users, duration_s, rate, tag)
    client.subscribe([(topic, 1) for topic in queries.answer_topics()])
    subscribed.wait(10)
    client.on_message = lambda _c, _u, msg: window.release() if queries.mine in msg.payload else None
    queries.begin()
    while queries.running():
        if rate is not None:
            time.sleep(queries.delay())
        elif not window.acquire(timeout=1):
            continue
        client.publish(*queries.next(), qos=0)
    time.sleep(1)
    client.loop_stop()
    client.disconnect()


def _run_workers(target: Any, args_for: list[tuple[Any, ...]]) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a, daemon=True) for a in args_for]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    return [items[i::parts] for i in range(parts)]


# -- yardsticks (the bench's own servers, in child processes) --------------------------------------
def _count_subscriber(port: int, topic_filter: str, count: Any, ready: Any, stop: Any) -> None:
    """An MQTT 3.1.1 subscriber on a raw socket that counts the PUBLISHes it receives on
    ``topic_filter`` (QoS 0) into ``count``: parsing fixed headers only, it keeps up with far more
    messages per second than the servers it measures."""
    import socket

    from kcloak.wire.mqtt_codec import PUBLISH, SUBACK, encode_connect, encode_subscribe, split_frames

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(encode_connect(f"bench-count-{os.getpid()}", username=None, password=None, keepalive_s=0))
        sock.sendall(encode_subscribe(1, [topic_filter], qos=0))
        sock.settimeout(0.2)
        buf = bytearray()
        n = 0
        while not stop.is_set():
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                return
            buf += chunk
            frames, pos = split_frames(buf)
            for first, _, _ in frames:
                if first >> 4 == PUBLISH:
                    n += 1
                elif first >> 4 == SUBACK:
                    ready.set()
            del buf[:pos]
            count.value = n


def _empty_http_server(port: int, count: Any, ready: Any, stop: Any) -> None:
    """aiohttp with an empty handler on kcloak's single-fix route: it counts the request into
    ``count`` and answers what kcloak answers an accepted fix, without reading or checking anything."""
    from kcloak.broker.http_server import ACCEPTED_ONE

    async def empty(request: web.Request) -> web.Response:
        count.value += 1
        return web.Response(body=ACCEPTED_ONE, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/users/{user}/location", empty)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await runner.cleanup()

    asyncio.run(main())


@contextlib.contextmanager
def _counting_child(target: Any, *args: Any) -> Iterator[tuple[Callable[[], list[float]], int]]:
    """Run ``target(*args, count, ready, stop)`` in a child process until the block ends; yields a
    sampler of its count (for :func:`_run_phase`) and its pid."""
    ctx = mp.get_context("spawn")
    count = ctx.RawValue("q", 0)
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=target, args=(*args, count, ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise TimeoutError(f"{target.__name__} did not start")
        assert proc.pid is not None
        yield (lambda: [float(count.value)]), proc.pid
    finally:
        stop.set()
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def mosquitto_pass_through(
    workdir: Path, users: list[tuple[str, float, float]], duration_s: float, parts: int, client: str
) -> tuple[str, Phase]:
    """The MQTT yardstick: the fix generators of the MQTT phase (same client, users and payloads,
    QoS 0) publishing into a mosquitto of its own, whose deliveries one subscriber of
    ``kcloak/v1/update/+`` counts. Returns mosquitto's version label and the phase (the server CPU
    is mosquitto's)."""
    with contextlib.ExitStack() as stack:
        port, label, pid = stack.enter_context(_mosquitto_process(workdir))
        sample, counter_pid = stack.enter_context(_counting_child(_count_subscriber, port, "kcloak/v1/update/+"))
        phase = _run_phase(
            _mqtt_update_worker,
            [(port, part, duration_s, client) for part in _split(users, parts)],
            sample,
            pid,
            extra_generators=[counter_pid],
        )
    return label, phase


def empty_http_handler(users: list[tuple[str, float, float]], duration_s: float, parts: int) -> Phase:
    """The HTTP yardstick: the single-fix generators of the HTTP phase against aiohttp with an empty
    handler (:func:`_empty_http_server`, a process of its own, whose CPU is the phase's server CPU)."""
    port = free_port()
    with _counting_child(_empty_http_server, port) as (sample, pid):
        return _run_phase(_http_update_worker, [(port, part, duration_s) for part in _split(users, parts)], sample, pid)


# -- phases ----------------------------------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, or None where there is no such
    file (the process has ended, or the system has no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count fields after it.
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat`` utime + stime), or
    None where there is no such file (the process has ended, or the system has no ``/proc``)."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass(slots=True)
class Phase:
    """What one load phase measured over the middle of its run: the rates of what the server
    counted, and the load generators' CPU seconds per second, summed (``generator_cpu_cores``) and
    of the busiest process (``generator_cpu_max``: near 1.0, that generator had a whole core and
    may be the bottleneck). ``cpu_us_per_item``: the server's CPU microseconds (its child processes
    included) per item of the first counter from the start of that interval until the server had
    worked off what it had received (so a backlog it had read but not yet counted at the interval's
    end is neither missed nor charged to the interval); None without a server pid or ``/proc``."""

    rates: list[float]
    cpu_us_per_item: float | None
    generator_cpu_cores: float | None
    generator_cpu_max: float | None
    side_cpu_us_per_item: float | None = None
    """CPU microseconds of the ``side`` thread or process of :func:`_run_phase` per item of the
    first counter, over the measured interval."""


def tree_cpu_seconds(pid: int) -> float | None:
    """:func:`cpu_seconds` of ``pid`` with that of its children: the running ones (found by their
    parent in ``/proc/*/stat``) and the ended ones it has reaped (its ``cutime`` + ``cstime``), so
    that work a server hands to child processes (``[upstream] processes``) is charged to it."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    total = sum(int(f) for f in fields[11:15]) / CLOCK_TICKS  # utime, stime, cutime, cstime
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (child := _stat_fields(entry.name)) is not None and child[1] == str(pid):
            total += (int(child[11]) + int(child[12])) / CLOCK_TICKS
    return total


def _cpu_of(pids: list[int]) -> list[float | None]:
    return [cpu_seconds(pid) for pid in pids]


WORKER_SPARE_S = 30.0
"""Seconds a phase's workers may run beyond the phase's duration (they are stopped once it is measured)."""


def _run_phase(
    target: Any,
    args_for: list[tuple[Any, ...]],
    sample: Callable[[], list[float]],
    server_pid: int | None,
    *,
    extra_generators: list[int] = [],  # noqa: B006 (never mutated)
    side: int | None = None,
) -> Phase:
    """Run workers; the rate of each counter that ``sample`` reads, over the middle of the run, with
    the CPU the server process (``server_pid``) and the workers (with ``extra_generators``, other
    processes of the load side such as a counting subscriber) spent over the same interval, and
    that of ``side`` (a thread or process id, e.g. the instant provider's thread) per item."""
    ctx = mp.get_context("spawn")
    duration = args_for[0][2]
    # Workers start only after their interpreter has started and imported the bench (seconds on a
    # busy host), so the clock starts when the server counts the first of their work, not when they
    # were spawned; they are given time to spare and stopped once the interval is measured, so that
    # they are still sending during all of it (a server with a backlog would otherwise be measured
    # partly idle, and the generators' CPU over the interval would read zero).
    procs = [
        ctx.Process(target=target, args=(*a[:2], duration + WORKER_SPARE_S, *a[3:]), daemon=True) for a in args_for
    ]
    for p in procs:
        p.start()
    warm = min(1.0, duration / 5)
    started = _wait_for_movement(sample, procs)
    time.sleep(max(started + warm - time.monotonic(), 0.0))
    pids = [p.pid for p in procs if p.pid is not None] + extra_generators
    server = [] if server_pid is None else [server_pid]
    sides = [] if side is None else [side]
    c0, g0, s0, m0, t0 = _server_cpu(server), _cpu_of(pids), _cpu_of(sides), sample(), time.monotonic()
    time.sleep(max(started + duration - warm - t0, 0.5))
    g1, s1, m1, t1 = _cpu_of(pids), _cpu_of(sides), sample(), time.monotonic()
    for p in procs:
        p.terminate()
    for p in procs:
        p.join()
    drained = _drained(sample)
    c2 = _server_cpu(server)
    wall = t1 - t0
    cpu_us: float | None = None
    if server and c0[0] is not None and c2[0] is not None and drained[0] > m0[0]:
        cpu_us = round((c2[0] - c0[0]) / (drained[0] - m0[0]) * 1e6, 2)
    spent = [(b - a) / wall for a, b in zip(g0, g1, strict=True) if a is not None and b is not None]
    side_us: float | None = None
    if sides and s0[0] is not None and s1[0] is not None and m1[0] > m0[0]:
        side_us = round((s1[0] - s0[0]) / (m1[0] - m0[0]) * 1e6, 2)
    return Phase(
        rates=[(b - a) / wall for a, b in zip(m0, m1, strict=True)],
        cpu_us_per_item=cpu_us,
        generator_cpu_cores=round(sum(spent), 3) if spent else None,
        generator_cpu_max=round(max(spent), 3) if spent else None,
        side_cpu_us_per_item=side_us,
    )


def _server_cpu(server: list[int]) -> list[float | None]:
    return [tree_cpu_seconds(pid) for pid in server]


def _drained(sample: Callable[[], list[float]], timeout_s: float = 60.0) -> list[float]:
    """The counters once they have stopped moving (the server has worked off its backlog)."""
    deadline = time.monotonic() + timeout_s
    last = sample()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sample()
        if now == last:
            return now
        last = now
    return last


def _metric_sampler(http_port: int, metric: str, needle_sets: list[tuple[str, ...]]) -> Callable[[], list[float]]:
    """A sampler of the broker's ``metric`` (one sum per set of label needles) for :func:`_run_phase`."""

    def sample() -> list[float]:
        m = scrape(http_port)
        return [_sum(m, metric, *needles) for needles in needle_sets]

    return sample


def _measure(
    http_port: int, target: Any, args_for: list[tuple[Any, ...]], metric: str, *needles: str, server_pid: int | None
) -> Phase:
    """Run workers; the broker-side rate of ``metric`` over the middle of the run, and the CPU spent."""
    return _run_phase(target, args_for, _metric_sampler(http_port, metric, [needles]), server_pid)


def _wait_for_movement(sample: Callable[[], list[float]], procs: list[Any], timeout_s: float = 30.0) -> float:
    """The monotonic time at which a counter of ``sample`` first moved, polled every 20 ms; the time
    of giving up if the workers end or ``timeout_s`` passes first (the rate is then what it is)."""
    base = sample()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if sample() != base:
            break
        time.sleep(0.02)
    return time.monotonic()


def _quiesce(http_port: int, timeout_s: float = 60.0) -> None:
    """Wait until the broker has drained its backlog (its message counters stop moving)."""
    deadline = time.monotonic() + timeout_s
    last = -1.0
    while time.monotonic() < deadline:
        m = scrape(http_port)
        now = _sum(m, "kcloak_updates_") + _sum(m, "kcloak_queries_total") + _sum(m, "kcloak_messages_dropped")
        if now == last:
            return
        last = now
        time.sleep(0.5)


def _preload(http_port: int, users: list[tuple[str, float, float]]) -> None:
    now = time.time()
    for chunk in range(0, len(users), 5000):
        items = [{"user": u, "t": now, "lat": la, "lon": lo} for u, la, lo in users[chunk : chunk + 5000]]
        req = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/locations",
            data=json.dumps({"updates": items}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


def _yardstick(name: str, phase: Phase) -> dict[str, Any]:
    rate = phase.rates[0]
    return {
        "name": name,
        "per_s": round(rate, 1),
        "cpu_us_per_item": phase.cpu_us_per_item,
        "generator_cpu_cores": phase.generator_cpu_cores,
        "generator_cpu_max": phase.generator_cpu_max,
    }


def _intake(phase: Phase, yardstick: dict[str, Any]) -> dict[str, Any]:
    """A transport's fix intake beside its yardstick, as the row's fields."""
    rate = phase.rates[0]
    base = yardstick.get("per_s")
    return {
        "updates_per_s": round(rate, 1),
        "cpu_us_per_fix": phase.cpu_us_per_item,
        "update_generator_cpu_cores": phase.generator_cpu_cores,
        "update_generator_cpu_max": phase.generator_cpu_max,
        "yardstick": yardstick,
        "updates_vs_yardstick": round(rate / base, 3) if base else None,
    }


def _query_sampler(http_port: int, transport: str) -> Callable[[], list[float]]:
    """Queries answered ok, refused, and received (``kcloak_messages_total`` of the query topic)."""
    where = f'transport="{transport}"'
    return _metric_sampler(
        http_port,
        "kcloak_",
        [
            ("kcloak_queries_total", where, 'status="ok"'),
            ("kcloak_queries_total", where, 'status="refused"'),
            ("kcloak_messages_total", where, 'topic="query"'),
        ],
    )


def _queries_note(
    qps: float, refused: float, received: float, before: dict[str, float], after: dict[str, float], transport: str
) -> str | None:
    """Why no query was answered ok (None when some were): what the broker received, refused or dropped."""
    if qps > 0:
        return None
    if received <= 0:
        return f"the broker received no {transport} query during the phase (the query generators sent none it saw)"
    if refused > 0:
        reasons = sorted(
            {
                k.split('reason="')[1].split('"')[0]
                for k, v in after.items()
                if k.startswith("kcloak_queries_total")
                and f'transport="{transport}"' in k
                and 'status="refused"' in k
                and v > before.get(k, 0.0)
            }
        )
        return f"every query was refused ({', '.join(reasons) or 'see kcloak_queries_total'})"
    return f"{received:.0f} queries/s received, none answered within the phase (see kcloak_messages_dropped_total)"


def run_broker_bench(cfg: BrokerBenchConfig, *, log: Any = None) -> dict[str, Any]:
    """Run every phase; returns the contract's ``{"bench": "broker", "results": [...]}``."""
    say = log or (lambda *_: None)
    users = _positions(cfg.users, seed=1)
    parts = max(1, cfg.client_processes)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kcloak-bench-") as tmp, instant_upstream() as upstream:
        workdir = Path(tmp)
        stack = contextlib.ExitStack()
        with stack:
            mode = cfg.mqtt
            label = "embedded"
            mqtt_port = free_port()
            if mode is None or mode == "mosquitto":
                try:
                    mqtt_port, label = stack.enter_context(mosquitto(workdir))
                    mode = f"mqtt://127.0.0.1:{mqtt_port}"
                except FileNotFoundError:
                    mode = "embedded"
            elif mode.startswith("mqtt://"):
                label = mode
                mqtt_port = int(mode.rsplit(":", 1)[1])
            http_port = free_port()
            args = [
                "--http",
                f"127.0.0.1:{http_port}",
                "--upstream",
                upstream,
                "--data-dir",
                str(workdir / "data"),
                "--algorithm",
                cfg.algorithm,
            ]
            if mode == "embedded":
                args += ["--mqtt", "embedded", "--mqtt-listen", f"127.0.0.1:{mqtt_port}"]
            else:
                args += ["--mqtt", mode, "--mqtt-ingest-connections", "2"]
            server = stack.enter_context(serve_process(args))
            wait_healthy(http_port)
            d = cfg.duration_s
            update_client = _update_client(cfg.mqtt_client)
            say("mqtt yardstick: mosquitto pass-through")
            try:
                mosquitto_label, mqtt_yard = mosquitto_pass_through(
                    workdir / "yardstick", users, d, parts, update_client
                )
                mqtt_yardstick: dict[str, Any] = _yardstick(
                    f"{mosquitto_label} pass-through to a counting subscriber", mqtt_yard
                )
            except FileNotFoundError:
                mqtt_yardstick = {"name": "mosquitto pass-through (not measured: mosquitto is not installed)"}
            say("mqtt updates")
            mqtt_updates = _measure(
                http_port,
                _mqtt_update_worker,
                [(mqtt_port, part, d, update_client) for part in _split(users, parts)],
                "kcloak_updates_accepted_total",
                'transport="mqtt"',
                server_pid=server.pid,
            )
            _quiesce(http_port)
            say("http yardstick: empty aiohttp handler")
            http_yardstick = _yardstick("empty aiohttp handler", empty_http_handler(users, d, parts))
            say("http updates")
            http_updates = _measure(
                http_port,
                _http_update_worker,
                [(http_port, part, d) for part in _split(users, parts)],
                "kcloak_updates_accepted_total",
                'transport="http"',
                server_pid=server.pid,
            )
            intake = {
                "mqtt": _intake(mqtt_updates, mqtt_yardstick),
                "http": _intake(http_updates, http_yardstick),
            }
            _preload(http_port, users)
            for transport, worker, port in (
                ("mqtt", _mqtt_query_worker, mqtt_port),
                ("http", _http_query_worker, http_port),
            ):
                _quiesce(http_port)
                _preload(http_port, users)
                extra = (_query_client(cfg.mqtt_client),) if transport == "mqtt" else ()
                say(f"{transport} queries")
                # Sustained = answered ok; refusals (overloaded above all) are reported beside it.
                q_before = scrape(http_port)
                queries = _run_phase(
                    worker,
                    [(port, part, d, None, f"max{i}", *extra) for i, part in enumerate(_split(users, parts))],
                    _query_sampler(http_port, transport),
                    server.pid,
                    side=INSTANT_THREADS.get(upstream),
                )
                qps, refused_qps, received_qps = queries.rates
                note = _queries_note(qps, refused_qps, received_qps, q_before, scrape(http_port), transport)
                _quiesce(http_port)
                _preload(http_port, users)
                say(f"{transport} latency at {qps / 2:.0f} queries/s")
                before = scrape(http_port)
                if qps > 0:
                    _run_workers(
                        worker,
                        [
                            (port, part, d, qps / 2 / parts, f"lat{i}", *extra)
                            for i, part in enumerate(_split(users, parts))
                        ],
                    )
                    _quiesce(http_port)
                after = scrape(http_port)
                p50 = histogram_quantile(before, after, transport, 0.5)
                p99 = histogram_quantile(before, after, transport, 0.99)
                row: dict[str, Any] = {
                    "transport": transport,
                    "mqtt": label,
                    "mqtt_client": cfg.mqtt_client,
                    "users": cfg.users,
                    "updates_per_s": intake[transport]["updates_per_s"],
                    "queries_per_s": round(qps, 1),
                    "queries_refused_per_s": round(refused_qps, 1),
                    "latency_at_qps": round(qps / 2, 1),
                    "added_latency_ms_p50": None if p50 is None else round(p50 * 1000, 3),
                    "added_latency_ms_p99": None if p99 is None else round(p99 * 1000, 3),
                    "cpu_us_per_query": queries.cpu_us_per_item,
                    "upstream_cpu_us_per_query": queries.side_cpu_us_per_item,
                    "query_generator_cpu_cores": queries.generator_cpu_cores,
                    "query_generator_cpu_max": queries.generator_cpu_max,
                    **{k: v for k, v in intake[transport].items() if k != "updates_per_s"},
                    "queries_note": note,
                }
                rows.append(row)
    return {"bench": "broker", "algorithm": cfg.algorithm, "duration_s": cfg.duration_s, "results": rows}


def sustained_query_rate(
    http_port: int, mqtt_port: int, *, users: int, duration_s: float, processes: int = 2, seed: int = 1
) -> tuple[float, float]:
    """The broker's sustained MQTT query rate as ``kcloak bench broker`` measures it: ``(ok/s, refused/s)``.

    ``users`` users get a fresh fix each (``POST /v1/locations``), then ``processes`` client
    processes send kNN queries in a closed loop (at most :data:`QUERY_WINDOW` outstanding each) for
    ``duration_s``; the rates are read from the broker's ``kcloak_queries_total`` over the middle of
    the run. The broker has worked off its backlog when this returns.
    """
    positions = _positions(users, seed)
    _preload(http_port, positions)
    phase = _run_phase(
        _mqtt_query_worker,
        [
            (mqtt_port, part, duration_s, None, f"rate{i}", "kcloak")
            for i, part in enumerate(_split(positions, processes))
        ],
        _metric_sampler(
            http_port,
            "kcloak_queries_total",
            [('transport="mqtt"', 'status="ok"'), ('transport="mqtt"', 'status="refused"')],
        ),
        None,
    )
    ok, refused = phase.rates
    _quiesce(http_port)
    return ok, refused
