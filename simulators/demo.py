"""``kcloak demo``: the whole system on one machine for about a minute (contract §9 ``demo``).

:func:`run_demo` starts the reference LBS (``kcloak lbs``, bundled Beijing POIs) as a child
process and a real :class:`~broker.service.Broker` with its embedded MQTT broker, on free
loopback ports over a temporary data directory. Meanwhile the bundled Beijing street network is
cropped to a square around the city centre sized for the number of users (:func:`demo_area`)
and written as OSM XML for :func:`simulators.traffic.run_simulation`, which then drives the users
along those streets with a mix of privacy profiles (k = 5, 10, 20), through MQTT, like any
client (contract §3). A :class:`DemoObserver` counts what the clients saw; a live table on stderr
shows users, updates/s, queries, success rate, median cloak area and p99 latency. The run is
stopped ``duration_s`` after the first update (or at Ctrl-C); the broker's published trajectory
windows are counted (``GET /v1/published/windows``), everything is shut down and the report of
:mod:`simulators.report` is written.

Demo settings (shown in ``kcloak demo --help``, defined in :mod:`simulators.demo_cli`): each user
sends :data:`DEMO_QUERIES_PER_MIN` range queries a minute, so that a one-minute run answers
thousands of queries; trajectory windows are :data:`DEMO_PUBLISH_WINDOW_S` long and closed
:data:`DEMO_MAX_UPDATE_AGE_S` after their end (contract §7: a window is processed once
now ≥ ``t_end`` + ``max_update_age_s``), so a one-minute run can publish windows, which the
shipped 900 s windows never would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from broker.config import Config
from broker.mqtt import free_port
from broker.service import Broker
from simulators.demo_cli import (
    DEMO_MAX_AREA_SIDE_KM,
    DEMO_MAX_UPDATE_AGE_S,
    DEMO_PUBLISH_WINDOW_S,
    DEMO_QUERIES_PER_MIN,
    DEMO_QUERY_KIND,
    DEMO_USERS_PER_KM2,
)
from simulators.report import Observations, percentile, summarize, write_report
from simulators.streets import StreetGraph, load_street_graph
from simulators.traffic import DEFAULT_MIX, SimulationConfig, SimulationSummary, run_simulation
from simulators.transport import TransportError

CITY_CENTRE: Final = (39.905, 116.39)
"""Centre of the demo area (lat, lon): central Beijing, near Tiananmen."""

LIVE_PERIOD_S: Final = 0.5
PLAIN_PERIOD_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``kcloak demo`` runs; defaults are the contract's (§9)."""

    users: int = 3000
    duration_s: float = 60.0
    algorithm: str = "hilbert"
    report_dir: Path = Path("kcloak-demo-report")
    queries_per_min: float = DEMO_QUERIES_PER_MIN
    query_kind: str = DEMO_QUERY_KIND
    publish_window_s: int = DEMO_PUBLISH_WINDOW_S
    max_update_age_s: float = DEMO_MAX_UPDATE_AGE_S
    area: tuple[float, float, float, float] | None = None  # None: :func:`demo_area` for ``users``
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class DemoResult:
    """The summary (contract ``summary.json``), the files written and the phase timings."""

    summary: dict[str, Any]
    files: list[Path]
    timings_s: dict[str, float]
    interrupted: bool


@dataclass(slots=True)
class DemoObserver:
    """A :class:`simulators.traffic.SimulationObserver` filling :class:`Observations` and live rates."""

    obs: Observations = field(default_factory=Observations)
    first_update_t: float | None = None
    last_update_t: float | None = None
    users_seen: int = 0

    def on_updates(self, n: int) -> None:
        now = time.monotonic()
        if self.first_update_t is None:
            self.first_update_t = now
        self.last_update_t = now
        self.obs.updates += n

    def on_query(self) -> None:
        self.obs.queries += 1

    def on_answer(self, answer: dict[str, Any], latency_s: float) -> None:
        self.obs.record_answer(answer, latency_s)

    def on_positions(self, lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64]) -> None:
        self.obs.record_positions(lat, lon)
        self.users_seen = int(lat.size)

    def running_s(self) -> float:
        """Seconds since the first update was sent (0 before)."""
        return 0.0 if self.first_update_t is None else time.monotonic() - self.first_update_t

    def running_span_s(self) -> float:
        """Seconds from the first to the last update sent (0 before)."""
        if self.first_update_t is None or self.last_update_t is None:
            return 0.0
        return self.last_update_t - self.first_update_t


class _Display:
    """Live status on stderr: a rich table refreshed twice a second on a terminal, a line every 10 s otherwise."""

    def __init__(self, cfg: DemoConfig, observer: DemoObserver, *, live: bool, console: Console) -> None:
        self.cfg = cfg
        self.observer = observer
        self.console = console
        self.live = Live(console=console, auto_refresh=False, transient=False) if live else None
        self._rate_ref: tuple[float, int] = (time.monotonic(), 0)
        self._rate = 0.0
        self._last_plain = self._t_enter = time.monotonic()
        self._started = False

    def __enter__(self) -> _Display:
        self._t_enter = self._last_plain = time.monotonic()
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.tick()
            self.live.stop()

    def tick(self) -> None:
        now = time.monotonic()
        t0, n0 = self._rate_ref
        if now - t0 >= 1.0:
            self._rate = (self.observer.obs.updates - n0) / (now - t0)
            self._rate_ref = (now, self.observer.obs.updates)
        if self.live is not None:
            self.live.update(self._render(), refresh=True)
            return
        if self.observer.first_update_t is not None and not self._started:
            self._started = True
            self._last_plain = now
            self.console.print(f"      users are moving ({now - self._t_enter:.1f} s to place them)", highlight=False)
        elif self._started and now - self._last_plain >= PLAIN_PERIOD_S:
            self._last_plain = now
            s = self._stats()
            self.console.print(
                f"  {s['elapsed']:>4.0f} s  {s['users']} users  {s['rate']} updates/s  {s['queries']} queries  "
                f"success {s['success']}  median area {s['area']}  p99 latency {s['p99']}",
                highlight=False,
            )

    def _stats(self) -> dict[str, Any]:
        o = self.observer.obs
        area = percentile(o.area_m2, 50)
        p99 = percentile(o.latency_s, 99)
        answers = o.answers
        return {
            "elapsed": self.observer.running_s(),
            "users": f"{self.observer.users_seen:,}",
            "rate": f"{self._rate:,.0f}",
            "queries": f"{o.queries:,}",
            "answers": f"{answers:,} ({o.ok:,} ok, {o.refused:,} refused)",
            "success": "–" if not answers else f"{o.ok / answers * 100:.1f} %",
            "area": "–" if area is None else f"{area / 1e6:.3f} km²",
            "p99": "–" if p99 is None else f"{p99 * 1000:.1f} ms",
        }

    def _render(self) -> Group:
        s = self._stats()
        table = Table(title=f"kcloak demo · {self.cfg.algorithm}", title_justify="left", show_header=False, box=None)
        table.add_column(style="bold cyan")
        table.add_column(justify="right")
        rows = (
            ("users", s["users"] if self.observer.first_update_t else "starting…"),
            ("updates/s", s["rate"]),
            ("queries", s["queries"]),
            ("answers", s["answers"]),
            ("success rate", s["success"]),
            ("median cloak area", s["area"]),
            ("p99 latency", s["p99"]),
        )
        for name, value in rows:
            table.add_row(name, value)
        elapsed = min(s["elapsed"], self.cfg.duration_s)
        bar = ProgressBar(total=self.cfg.duration_s, completed=elapsed, width=40)
        clock = Table.grid(padding=(0, 1))
        clock.add_row(bar, f"{elapsed:.0f}/{self.cfg.duration_s:.0f} s  (Ctrl-C stops early)")
        return Group(table, clock)


def demo_broker_config(cfg: DemoConfig, *, data_dir: Path, upstream_url: str, mqtt_port: int) -> Config:
    """The broker's configuration for the demo: loopback only, temp data dir, short publication windows."""
    return Config().with_values(
        {
            "http.listen": "127.0.0.1:0",
            "mqtt.mode": "embedded",
            "mqtt.listen": f"127.0.0.1:{mqtt_port}",
            "upstream.url": upstream_url,
            "storage.data_dir": str(data_dir),
            "cloaking.algorithm": cfg.algorithm,
            "cloaking.max_update_age_s": cfg.max_update_age_s,
            "publish.window_s": cfg.publish_window_s,
            "log.level": "warning",
        }
    )


def count_published_windows(http_port: int) -> int:
    """Windows listed by ``GET /v1/published/windows`` (every page); 0 if the route fails."""
    total, since = 0, 0
    for _ in range(1000):
        url = f"http://127.0.0.1:{http_port}/v1/published/windows?since={since}&limit=1000"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError):
            return total
        windows = doc.get("windows") if isinstance(doc, dict) else None
        if not isinstance(windows, list):
            return total
        total += len(windows)
        nxt = doc.get("next_since")
        if not isinstance(nxt, int) or not windows:
            return total
        since = nxt
    return total


@contextlib.contextmanager
def _sigint_stops(stop: asyncio.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set ``stop`` (the report is still written); another SIGINT a second later interrupts."""
    loop = asyncio.get_running_loop()
    first_t: list[float] = []

    def on_signal() -> None:
        if not first_t:
            first_t.append(time.monotonic())
            stop.set()
        elif time.monotonic() - first_t[0] > 1.0:
            raise KeyboardInterrupt

    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _requested_k() -> list[int]:
    """The k values of the simulation's profile mix (marked on the achieved-k picture)."""
    return [k for share in DEFAULT_MIX if isinstance(k := share.profile.get("k"), int)]


def demo_area(users: int) -> tuple[float, float, float, float]:
    """A square around :data:`CITY_CENTRE` holding about :data:`DEMO_USERS_PER_KM2` users per km²,
    at most :data:`DEMO_MAX_AREA_SIDE_KM` wide (about the 3rd Ring Road) and at least 2 km:
    ``(min_lon, min_lat, max_lon, max_lat)``. A fixed density keeps k = 20 reachable within the
    default 4 km² ``max_area_m2`` whatever the number of users (CONCEPTS §9: success depends on density).
    """
    side_km = min(DEMO_MAX_AREA_SIDE_KM, max(2.0, math.sqrt(users / DEMO_USERS_PER_KM2)))
    half_lat = math.degrees(side_km * 500.0 / 6_371_008.8)
    half_lon = half_lat / math.cos(math.radians(CITY_CENTRE[0]))
    lat, lon = CITY_CENTRE
    return (round(lon - half_lon, 6), round(lat - half_lat, 6), round(lon + half_lon, 6), round(lat + half_lat, 6))


def crop_streets(graph: StreetGraph, bbox: tuple[float, float, float, float]) -> StreetGraph:
    """The largest strongly connected part of the streets inside ``bbox`` (min_lon, min_lat, max_lon, max_lat)."""
    lo_lon, lo_lat, hi_lon, hi_lat = bbox
    keep = (graph.lon > lo_lon) & (graph.lon < hi_lon) & (graph.lat > lo_lat) & (graph.lat < hi_lat)
    return graph.subgraph(keep).largest_component()


def street_chains(graph: StreetGraph) -> list[tuple[list[int], int, bool]]:
    """The graph's street segments joined into chains: ``(node indices, class, one-way)``.

    A segment present in both directions is two-way, one present in one direction only is
    one-way (the chain then follows that direction). Consecutive segments of one class and kind
    are chained greedily; the chains' consecutive node pairs are exactly the graph's segments.
    """
    n = graph.nodes
    fwd = graph.tail * n + graph.head
    has_rev = np.isin(graph.head * n + graph.tail, fwd)
    emit = np.flatnonzero(~has_rev | (graph.tail < graph.head))
    tails, heads = graph.tail[emit].tolist(), graph.head[emit].tolist()
    classes, oneway = graph.edge_class[emit].tolist(), (~has_rev[emit]).tolist()
    # (node, class, one-way) -> segments touching it: for one-way, out-segments at tails and in-segments at heads.
    starts: dict[tuple[int, int, bool], list[int]] = {}
    ends: dict[tuple[int, int, bool], list[int]] = {}
    for i, (a, b, c, o) in enumerate(zip(tails, heads, classes, oneway, strict=True)):
        starts.setdefault((a, c, o), []).append(i)
        ends.setdefault((b, c, o), []).append(i)
        if not o:
            starts.setdefault((b, c, o), []).append(i)
            ends.setdefault((a, c, o), []).append(i)
    used = [False] * len(emit)

    def take(pool: list[int] | None) -> int:
        while pool:
            j = pool.pop()
            if not used[j]:
                used[j] = True
                return j
        return -1

    chains: list[tuple[list[int], int, bool]] = []
    for i in range(len(emit)):
        if used[i]:
            continue
        used[i] = True
        c, o = classes[i], oneway[i]
        nodes = [tails[i], heads[i]]
        while (j := take(starts.get((nodes[-1], c, o)))) >= 0:
            nodes.append(heads[j] if tails[j] == nodes[-1] else tails[j])
        head_part: list[int] = []
        first = nodes[0]
        while (j := take(ends.get((first, c, o)))) >= 0:
            first = tails[j] if heads[j] == first else heads[j]
            head_part.append(first)
        chains.append((head_part[::-1] + nodes, c, o))
    return chains


def write_osm(graph: StreetGraph, path: Path) -> None:
    """Write ``graph`` as OSM XML that :func:`simulators.streets.parse_osm` reads back as the same graph.

    Node ids and coordinates are the graph's; ways are :func:`street_chains` with their
    ``highway`` class (it sets the speed) and ``oneway=yes`` where the street runs one way.
    """
    ids = graph.node_id.tolist()
    with path.open("w", encoding="utf-8") as fh:
        fh.write("<?xml version='1.0' encoding='UTF-8'?>\n<osm version=\"0.6\" generator=\"kcloak demo\">\n")
        fh.writelines(
            f'<node id="{i}" lat="{la!r}" lon="{lo!r}"/>\n'
            for i, la, lo in zip(ids, graph.lat.tolist(), graph.lon.tolist(), strict=True)
        )
        for w, (nodes, c, o) in enumerate(street_chains(graph), start=1):
            refs = "".join(f'<nd ref="{ids[v]}"/>' for v in nodes)
            tag = '<tag k="oneway" v="yes"/>' if o else ""
            fh.write(f'<way id="-{w}">{refs}<tag k="highway" v="{graph.highway[c]}"/>{tag}</way>\n')
        fh.write("</osm>\n")


def prepare_streets(path: Path, bbox: tuple[float, float, float, float]) -> StreetGraph:
    """Crop the bundled Beijing network to ``bbox`` and write it to ``path`` for the simulation."""
    graph = crop_streets(load_street_graph(), bbox)
    write_osm(graph, path)
    return graph


class ReferenceLbs:
    """``kcloak lbs`` (bundled Beijing POIs) as a child process on a free loopback port (async context manager).

    A process of its own, as in a deployment: the provider's search runs on another core than the
    broker. Entering only spawns it (so the broker can start meanwhile); :meth:`ready` waits for it.
    It runs in a new session so that a terminal's Ctrl-C reaches the demo only, which stops the
    simulation first and the provider last.
    """

    def __init__(self, *, startup_timeout_s: float = 30.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> ReferenceLbs:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "broker.cli",
            "lbs",
            "--http",
            f"127.0.0.1:{self.port}",
            "--log-level",
            "warning",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    async def ready(self) -> int:
        """Wait until the provider answers; returns the number of POIs it serves (OSError if it never does)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc is None or self._proc.returncode is not None or time.monotonic() > deadline:
                raise OSError(f"the reference LBS did not start on 127.0.0.1:{self.port}")
            doc = await asyncio.to_thread(_get_json, f"{self.url}/v1/categories")
            if isinstance(doc, dict) and isinstance(doc.get("categories"), list):
                return sum(int(c.get("count", 0)) for c in doc["categories"] if isinstance(c, dict))
            await asyncio.sleep(0.1)

    async def __aexit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            async with asyncio.timeout(5):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _get_json(url: str) -> Any:
    """The JSON body of ``GET url`` (local services), None on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


async def _deadline(observer: DemoObserver, duration_s: float, stop: asyncio.Event) -> None:
    """Set ``stop`` ``duration_s`` after the first update, whatever the simulation's own pacing."""
    while observer.first_update_t is None:
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, observer.first_update_t + duration_s - time.monotonic()))
    stop.set()


async def run_demo(
    cfg: DemoConfig,
    *,
    stop: asyncio.Event | None = None,
    say: Callable[[str], None] | None = None,
    live: bool = False,
    console: Console | None = None,
) -> DemoResult:
    """Run the demo and write its report; ``stop`` (or SIGINT/SIGTERM) ends the simulation early.

    The simulation is stopped ``duration_s`` after its first update even if it falls behind its
    own schedule (an overloaded machine), so the demo ends on time; then outstanding answers are
    awaited briefly (:data:`simulators.traffic.STOP_DRAIN_S`).
    """
    err = console or Console(stderr=True)
    tell = say or (lambda msg: err.print(msg, highlight=False))
    stop = stop or asyncio.Event()
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    observer = DemoObserver()
    broken: str | None = None
    interrupt = asyncio.Event()
    area = cfg.area or demo_area(cfg.users)
    with _sigint_stops(interrupt), tempfile.TemporaryDirectory(prefix="kcloak-demo-") as tmp:
        osm = Path(tmp) / "streets.osm"
        streets_task = asyncio.create_task(asyncio.to_thread(prepare_streets, osm, area))
        try:
            async with ReferenceLbs() as lbs:
                mqtt_port = free_port()
                bcfg = demo_broker_config(cfg, data_dir=Path(tmp) / "data", upstream_url=lbs.url, mqtt_port=mqtt_port)
                async with Broker(config=bcfg) as broker:
                    tell(
                        f"[1/4] kcloak broker: algorithm {cfg.algorithm}, embedded MQTT on 127.0.0.1:{mqtt_port}, "
                        f"HTTP on 127.0.0.1:{broker.http_port} ({time.monotonic() - t_start:.1f} s)"
                    )
                    n_pois = await lbs.ready()
                    tell(
                        f"[2/4] reference LBS: {n_pois} Beijing POIs on {lbs.url} ({time.monotonic() - t_start:.1f} s)"
                    )
                    streets = await streets_task
                    km = float(streets.length_m.sum()) / 2000.0
                    side_km = (area[3] - area[1]) * math.pi / 180 * 6371.0088
                    timings["startup_s"] = time.monotonic() - t_start
                    tell(
                        f"[3/4] {cfg.users:,} users on {km:,.0f} km of streets in central Beijing "
                        f"({side_km:.1f} km x {side_km:.1f} km) for {cfg.duration_s:g} s, {cfg.queries_per_min:g} "
                        f"{cfg.query_kind} queries per user per minute, profiles k = 5/10/20 "
                        f"({timings['startup_s']:.1f} s; Ctrl-C stops early)"
                    )
                    sim = SimulationConfig(
                        users=cfg.users,
                        model="street",
                        osm=osm,
                        query_rate_per_min=cfg.queries_per_min,
                        query_kind=cfg.query_kind,
                        duration_s=cfg.duration_s,
                        seed=cfg.seed,
                        broker=f"mqtt://127.0.0.1:{mqtt_port}",
                    )
                    t_sim = time.monotonic()
                    stop_on = asyncio.create_task(_forward(interrupt, stop))
                    timer = asyncio.create_task(_deadline(observer, cfg.duration_s, stop))
                    sim_summary: SimulationSummary | None = None
                    try:
                        with _Display(cfg, observer, live=live, console=err) as display:
                            task = asyncio.create_task(run_simulation(sim, observer=observer, stop=stop))
                            while not task.done():
                                await asyncio.wait([task], timeout=LIVE_PERIOD_S)
                                display.tick()
                            sim_summary = await task
                    except TransportError as exc:
                        if not stop.is_set():
                            raise
                        broken = str(exc)  # the MQTT broker went down with Ctrl-C: report what was seen
                    finally:
                        timer.cancel()
                        stop_on.cancel()
                    timings["simulation_s"] = time.monotonic() - t_sim
                    published = await asyncio.to_thread(count_published_windows, broker.http_port or 0)
        finally:
            if not streets_task.done():
                streets_task.cancel()
            with contextlib.suppress(BaseException):
                await streets_task
    if broken is not None:
        tell(f"      the simulation ended early: {broken}")
    t_report = time.monotonic()
    tell(f"[4/4] writing the report to {cfg.report_dir}")
    duration_s = sim_summary.duration_s if sim_summary is not None else observer.running_span_s()
    summary = summarize(
        observer.obs,
        users=cfg.users,
        duration_s=duration_s,
        algorithm=cfg.algorithm,
        published_windows=published,
    )
    files = await asyncio.to_thread(
        write_report,
        cfg.report_dir,
        observer.obs,
        summary,
        streets=streets,
        max_area_m2=bcfg.profile.max_area_m2,
        requested_k=_requested_k(),
    )
    timings["report_s"] = time.monotonic() - t_report
    timings["total_s"] = time.monotonic() - t_start
    return DemoResult(summary=summary, files=files, timings_s=timings, interrupted=interrupt.is_set())


async def _forward(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def print_summary(result: DemoResult, cfg: DemoConfig, console: Console) -> None:
    """The final summary table (stdout) with the report's location."""
    s = result.summary
    table = Table(title="kcloak demo summary", title_justify="left")
    table.add_column("measure", style="bold cyan")
    table.add_column("value", justify="right")

    def fmt(v: Any, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
        if v is None:
            return "–"
        if isinstance(v, int):
            return f"{v:,}{unit}"
        return f"{v * scale:,.{digits}f}{unit}"

    rate = s["success_rate"]
    refusals = ", ".join(f"{code} {n:,}" for code, n in s["refusals"].items()) or "none"
    rows = (
        ("algorithm", s["algorithm"]),
        ("users", fmt(s["users"])),
        ("duration", fmt(s["duration_s"], " s")),
        ("updates", f"{s['updates']:,} ({s['updates_per_s']:,.0f}/s)"),
        ("queries", fmt(s["queries"])),
        ("answered ok", fmt(s["ok"])),
        ("refused", f"{s['refused']:,} ({refusals})"),
        ("success rate", "–" if rate is None else f"{rate * 100:.1f} %"),
        ("median cloak area", fmt(s["cloak_area_m2_median"], " km²", 1e-6, 3)),
        ("mean achieved k", fmt(s["achieved_k_mean"], "", 1.0, 2)),
        ("latency p50 / p99", f"{fmt(s['latency_ms_p50'])} / {fmt(s['latency_ms_p99'], ' ms')}"),
        ("published windows", f"{s['published_windows']} ({cfg.publish_window_s} s windows, demo setting)"),
    )
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    t = result.timings_s
    console.print(
        f"startup {t.get('startup_s', 0):.1f} s, simulation {t.get('simulation_s', 0):.1f} s, "
        f"report {t.get('report_s', 0):.1f} s, total {t.get('total_s', 0):.1f} s"
        + (" (stopped early)" if result.interrupted else ""),
        highlight=False,
    )
    console.print(f"report: {cfg.report_dir}/ " + ", ".join(p.name for p in result.files), highlight=False)


__all__ = [
    "DemoConfig",
    "DemoObserver",
    "DemoResult",
    "crop_streets",
    "prepare_streets",
    "print_summary",
    "run_demo",
    "write_osm",
]
