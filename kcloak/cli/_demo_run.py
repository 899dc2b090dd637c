"""``kcloak demo``: the whole system on one machine for about a minute (contract §9 ``demo``).

It lives in the command-line layer (not in :mod:`kcloak.simulators`): it orchestrates a broker
(``kcloak serve`` with a configuration built and checked by :class:`kcloak.broker.config.Config`)
and a reference LBS as child processes and draws a live ``rich`` table, which the layers below
the command line may not do; the simulated users themselves are :mod:`kcloak.simulators.traffic`.

:func:`run_demo` starts, at once and as child processes, the reference LBS (``kcloak lbs``,
bundled Beijing POIs) and the broker (``kcloak serve`` with a generated TOML configuration and its
embedded MQTT broker) on free loopback ports over a temporary data directory, so that the broker,
the provider and the simulated users run on cores of their own, as in a deployment. Meanwhile the
bundled Beijing street network is cropped to a square around the city centre sized for the number
of users (:func:`demo_area`) and handed to :func:`kcloak.simulators.traffic.run_simulation`, which drives
the users along those streets with a mix of privacy profiles (k = 5, 10, 20), like any client:
fixes and queries through MQTT (contract §3), the profiles, set once at the start, through HTTP
(§4), which is several times quicker for thousands of users than round trips through the
embedded MQTT broker. A :class:`DemoObserver` counts what the clients saw; a live table on
stderr shows users, updates/s, queries, success rate, median cloak area and p99 latency.

``duration_s`` is the length of the whole demo, start-up included: users move until
:data:`TAIL_RESERVE_S` before its end (but at least half of it), which leaves time for the last
answers and the report, so the command ends about ``duration_s`` after it started. The summary's
``duration_s`` is the time users actually moved. Ctrl-C stops them early. Then the broker's
published trajectory windows are counted (``GET /v1/published/windows``) and the report of
:mod:`kcloak.simulators.report` is written while the child processes shut down.

Demo settings (shown in ``kcloak demo --help``, defined in :mod:`kcloak.cli.demo`): each user
sends :data:`DEMO_QUERIES_PER_MIN` queries a minute (range and knn), so that a one-minute run answers
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
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, Self, TypeVar

import numpy as np
import numpy.typing as npt
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from kcloak.broker.config import Config
from kcloak.cli._signals import signals_stop
from kcloak.cli.demo import (
    DEMO_MAX_UPDATE_AGE_S,
    DEMO_MIN_TRAFFIC_SHARE,
    DEMO_PUBLISH_WINDOW_S,
    DEMO_QUERIES_PER_MIN,
    DEMO_QUERY_KIND,
    DEMO_TAIL_RESERVE_S,
)
from kcloak.core.errors import KcloakError
from kcloak.simulators.area import populated_area
from kcloak.simulators.report import Observations, load_plotting, percentile, summarize, write_report
from kcloak.simulators.streets import StreetGraph, load_street_graph
from kcloak.simulators.traffic import (
    DEFAULT_MIX,
    NullObserver,
    SimulationConfig,
    SimulationSummary,
    crop_streets,
    run_simulation,
)
from kcloak.simulators.transport import TransportError
from kcloak.wire.net import free_port

T = TypeVar("T")

LIVE_PERIOD_S: Final = 0.5
PLAIN_PERIOD_S: Final = 10.0
TAIL_RESERVE_S: Final = DEMO_TAIL_RESERVE_S
MIN_TRAFFIC_SHARE: Final = DEMO_MIN_TRAFFIC_SHARE
STARTUP_TIMEOUT_S: Final = 60.0


class DemoStartupError(KcloakError, RuntimeError):
    """A part of the demo could not start (port in use, a child process exited); exit 1."""


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``kcloak demo`` runs; defaults are the contract's (§9)."""

    users: int = 3000
    duration_s: float = 60.0
    algorithm: str = "hilbert"
    report_dir: Path = Path("kcloak-demo-report")
    pictures: bool = True  # False: summary.json only (no report extra, or --no-pictures)
    queries_per_min: float = DEMO_QUERIES_PER_MIN
    query_kind: str = DEMO_QUERY_KIND
    publish_window_s: int = DEMO_PUBLISH_WINDOW_S
    max_update_age_s: float = DEMO_MAX_UPDATE_AGE_S
    area: tuple[float, float, float, float] | None = None  # None: :func:`demo_area` for ``users``
    seed: int | None = None
    open_map: bool = False  # open the live map in a browser (``--open``)


@dataclass(frozen=True, slots=True)
class DemoResult:
    """The summary (contract ``summary.json``), the files written and the phase timings."""

    summary: dict[str, Any]
    files: list[Path]
    timings_s: dict[str, float]
    interrupted: bool


@dataclass(slots=True)
class DemoObserver(NullObserver):
    """A :class:`kcloak.simulators.traffic.SimulationObserver` filling :class:`Observations` and live rates."""

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

    def running_span_s(self) -> float:
        """Seconds from the first to the last update sent (0 before)."""
        if self.first_update_t is None or self.last_update_t is None:
            return 0.0
        return self.last_update_t - self.first_update_t


class _Display:
    """Live status on stderr: a rich table refreshed twice a second on a terminal, a line every 10 s otherwise."""

    def __init__(
        self, cfg: DemoConfig, observer: DemoObserver, *, live: bool, console: Console, t_start: float
    ) -> None:
        self.cfg = cfg
        self.observer = observer
        self.console = console
        self.t_start = t_start
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
            self.console.print(
                f"      users are moving ({now - self._t_enter:.1f} s to place them and set their profiles)",
                highlight=False,
                soft_wrap=True,
            )
        elif self._started and now - self._last_plain >= PLAIN_PERIOD_S:
            self._last_plain = now
            s = self._stats()
            self.console.print(
                f"  {s['clock']:>4.0f} s  {s['users']} users  {s['rate']} updates/s  {s['queries']} queries  "
                f"success {s['success']}  median area {s['area']}  p99 latency {s['p99']}",
                highlight=False,
                soft_wrap=True,
            )

    def _stats(self) -> dict[str, Any]:
        o = self.observer.obs
        area = percentile(o.area_m2, 50)
        p99 = percentile(o.latency_s, 99)
        answers = o.answers
        return {
            "clock": time.monotonic() - self.t_start,
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
        elapsed = min(s["clock"], self.cfg.duration_s)
        bar = ProgressBar(total=self.cfg.duration_s, completed=elapsed, width=40)
        clock = Table.grid(padding=(0, 1))
        clock.add_row(bar, f"{elapsed:.0f}/{self.cfg.duration_s:.0f} s  (Ctrl-C stops early)")
        return Group(table, clock)


def demo_broker_config(
    cfg: DemoConfig, *, data_dir: Path, upstream_url: str, mqtt_port: int, http_port: int, streets: Path | None = None
) -> Config:
    """The broker's configuration for the demo: loopback only, temp data dir, short publication windows,
    the demo's streets under the live map."""
    return Config().with_values(
        {
            "map.streets": None if streets is None else str(streets),
            "http.listen": f"127.0.0.1:{http_port}",
            "mqtt.mode": "embedded",
            "mqtt.listen": f"127.0.0.1:{mqtt_port}",
            "upstream.url": upstream_url,
            "storage.data_dir": str(data_dir),
            "cloaking.algorithm": cfg.algorithm,
            "cloaking.max_update_age_s": cfg.max_update_age_s,
            "publish.window_s": cfg.publish_window_s,
            "log.level": "warning",
            "log.format": "text",
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


def _requested_k() -> list[int]:
    """The k values of the simulation's profile mix (marked on the achieved-k picture)."""
    return [k for share in DEFAULT_MIX if isinstance(k := share.profile.get("k"), int)]


def demo_area(users: int) -> tuple[float, float, float, float]:
    """A square around :data:`CITY_CENTRE` holding about :data:`DEMO_USERS_PER_KM2` users per km²,
    at most :data:`DEMO_MAX_AREA_SIDE_KM` wide (about the 3rd Ring Road) and at least 2 km:
    ``(min_lon, min_lat, max_lon, max_lat)``; ``kcloak simulate``'s default area too
    (:func:`kcloak.simulators.area.populated_area`).
    """
    return populated_area(users)


def write_streets_geojson(streets: StreetGraph, path: Path) -> Path:
    """The street segments as one GeoJSON MultiLineString (each undirected segment once), for the live map."""
    tail, head = streets.tail, streets.head
    keep = tail < head
    pairs = {(int(a), int(b)) for a, b in zip(tail[keep].tolist(), head[keep].tolist(), strict=True)}
    pairs |= {(int(b), int(a)) for a, b in zip(tail[~keep].tolist(), head[~keep].tolist(), strict=True)}
    lat, lon = streets.lat.tolist(), streets.lon.tolist()
    lines = [[[round(lon[a], 6), round(lat[a], 6)], [round(lon[b], 6), round(lat[b], 6)]] for a, b in sorted(pairs)]
    doc = {"type": "Feature", "properties": {}, "geometry": {"type": "MultiLineString", "coordinates": lines}}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    partial.replace(path)  # whole or absent: the broker reads it once it is there
    return path


async def _open_browser(url: str, tell: Callable[[str], None]) -> None:
    """Open ``url`` in the user's browser (Python's :mod:`webbrowser`); say so if there is none."""
    import webbrowser

    try:
        opened = await asyncio.to_thread(webbrowser.open, url)
    except webbrowser.Error:
        opened = False
    if not opened:
        tell(f"      --open: no browser to open here; open {url} yourself")


def prepare_streets(bbox: tuple[float, float, float, float]) -> StreetGraph:
    """The bundled Beijing network cropped to ``bbox`` (its largest strongly connected part)."""
    return crop_streets(load_street_graph(), bbox)


class ChildProcess:
    """A ``kcloak`` subcommand as a child process on loopback (async context manager).

    It runs in a new session, so that a terminal's Ctrl-C reaches the demo only, which stops the
    simulation first and its children last; leaving the context terminates it (SIGTERM, then
    SIGKILL after ``stop_timeout_s``) whatever happened inside. Its stderr goes to ``log_path``,
    whose last line explains a failed start. Entering only spawns it; :meth:`wait_ready` polls an
    HTTP route until it answers.
    """

    name: str = "child"

    def __init__(self, args: list[str], *, log_path: Path, stop_timeout_s: float = 10.0) -> None:
        self.args = args
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id once started (None before)."""
        return None if self._proc is None else self._proc.pid

    async def __aenter__(self) -> Self:
        self._log = self.log_path.open("wb")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",  # isolated: no current folder or PYTHONPATH on sys.path, so nothing there can shadow kcloak
                "-m",
                "kcloak",
                *self.args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=self._log,
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.stop()
        finally:
            if self._log is not None:
                self._log.close()

    async def stop(self) -> None:
        """Terminate the process and wait for it (idempotent)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            async with asyncio.timeout(self.stop_timeout_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        except BaseException:  # cancelled (a second Ctrl-C): do not leave it running
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise

    def _last_error(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines() if ln]
        except OSError:
            return ""
        return lines[-1].strip()[:300] if lines else ""

    async def wait_ready(self, url: str, *, timeout_s: float, accept: Callable[[Any], bool]) -> Any:
        """Poll ``GET url`` until ``accept`` takes its JSON body; :class:`DemoStartupError` if the process exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None or self._proc.returncode is not None:
                detail = self._last_error()
                raise DemoStartupError(f"{self.name} did not start" + (f": {detail}" if detail else ""))
            if time.monotonic() > deadline:
                raise DemoStartupError(f"{self.name} did not answer within {timeout_s:g} s")
            doc = await asyncio.to_thread(_get_json, url)
            if doc is not None and accept(doc):
                return doc
            await asyncio.sleep(0.1)


class ReferenceLbs(ChildProcess):
    """``kcloak lbs`` (bundled Beijing POIs) on a free loopback port: the provider searches on another core."""

    name = "the reference LBS"

    def __init__(self, *, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            ["lbs", "--http", f"127.0.0.1:{self.port}", "--log-level", "warning"], log_path=log_path, stop_timeout_s=5.0
        )

    async def ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> int:
        """Wait until the provider answers; returns the number of POIs it serves."""
        doc = await self.wait_ready(
            f"{self.url}/v1/categories",
            timeout_s=timeout_s,
            accept=lambda d: isinstance(d, dict) and isinstance(d.get("categories"), list),
        )
        return sum(int(c.get("count", 0)) for c in doc["categories"] if isinstance(c, dict))


class BrokerProcess(ChildProcess):
    """``kcloak serve --config <generated TOML>`` with its embedded MQTT broker, on free loopback ports.

    The broker runs in a process of its own, so cloaking, storing fixes and publishing answers do
    not compete with the simulated users for one interpreter.
    """

    name = "the kcloak broker"

    def __init__(self, config: Config, *, workdir: Path) -> None:
        self.config = config
        self.config_path = workdir / "kcloak.toml"
        self.http_port = int(config.http.listen.rsplit(":", 1)[1])
        self.mqtt_port = int(config.mqtt.listen.rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.http_port}"
        grace = config.server.shutdown_grace_s
        super().__init__(
            ["serve", "--config", str(self.config_path)], log_path=workdir / "broker.log", stop_timeout_s=grace + 5.0
        )

    async def __aenter__(self) -> Self:
        self.config_path.write_text(self.config.to_toml(), encoding="utf-8")
        await super().__aenter__()
        return self

    async def ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until ``GET /healthz`` answers ok (HTTP listens once the MQTT door is connected)."""
        await self.wait_ready(
            f"{self.url}/healthz",
            timeout_s=timeout_s,
            accept=lambda d: isinstance(d, dict) and d.get("status") == "ok",
        )


def _get_json(url: str) -> Any:
    """The JSON body of ``GET url`` (local services), None on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def traffic_end(t_start: float, first_update_t: float, duration_s: float) -> float:
    """When users stop (monotonic clock): :data:`TAIL_RESERVE_S` before the demo's end, but after at
    least :data:`MIN_TRAFFIC_SHARE` of ``duration_s`` of traffic."""
    return max(t_start + duration_s - TAIL_RESERVE_S, first_update_t + MIN_TRAFFIC_SHARE * duration_s)


async def _deadline(observer: DemoObserver, t_start: float, duration_s: float, stop: asyncio.Event) -> None:
    """Set ``stop`` at :func:`traffic_end`, whatever the simulation's own pacing."""
    while observer.first_update_t is None:
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, traffic_end(t_start, observer.first_update_t, duration_s) - time.monotonic()))
    stop.set()


async def run_demo(
    cfg: DemoConfig,
    *,
    stop: asyncio.Event | None = None,
    say: Callable[[str], None] | None = None,
    live: bool = False,
    console: Console | None = None,
    started: float | None = None,
    observer: DemoObserver | None = None,
) -> DemoResult:
    """Run the demo and write its report; ``stop`` (or SIGINT/SIGTERM) ends the simulation early.

    ``started`` (:func:`time.monotonic`; default now) is when the demo began, e.g. when the
    ``kcloak`` process started: ``duration_s`` and the timings count from there. ``observer``
    (default a new :class:`DemoObserver`) sees what the simulated users send and receive.

    Users stop at :func:`traffic_end` even if the simulation falls behind its own schedule (an
    overloaded machine), so the demo ends on time; outstanding answers are then awaited briefly
    (:data:`kcloak.simulators.traffic.STOP_DRAIN_S`). Raises :class:`DemoStartupError` when the broker or
    the provider cannot start, :class:`TransportError` when the MQTT broker is unreachable.
    """
    err = console or Console(stderr=True)
    tell = say or (lambda msg: err.print(msg, highlight=False, soft_wrap=True))
    stop = stop or asyncio.Event()
    t_start = time.monotonic() if started is None else started
    timings: dict[str, float] = {}
    observer = DemoObserver() if observer is None else observer
    broken: str | None = None
    interrupt = asyncio.Event()
    area = cfg.area or demo_area(cfg.users)
    sim_summary: SimulationSummary | None = None
    with signals_stop(interrupt), tempfile.TemporaryDirectory(prefix="kcloak-demo-") as tmp:
        work = Path(tmp)
        streets_task = asyncio.create_task(asyncio.to_thread(prepare_streets, area))
        streets_task.add_done_callback(
            lambda t: (
                None
                if t.cancelled() or t.exception() is not None
                else tell(f"      streets of central Beijing loaded ({time.monotonic() - t_start:.1f} s)")
            )
        )
        try:
            async with ReferenceLbs(log_path=work / "lbs.log") as lbs:
                # The live map draws the demo's streets, written once they are ready (the broker reads
                # the file when it appears).
                streets_file = work / "streets.geojson"
                bcfg = demo_broker_config(
                    cfg,
                    data_dir=work / "data",
                    upstream_url=lbs.url,
                    mqtt_port=free_port(),
                    http_port=free_port(),
                    streets=streets_file,
                )
                async with BrokerProcess(bcfg, workdir=work) as broker:
                    tell(
                        "      started the kcloak broker and the reference LBS (child processes), loading the "
                        f"streets; waiting for them ({time.monotonic() - t_start:.1f} s)"
                    )
                    await _first_of(_waiting(broker.ready(), "the kcloak broker to start", tell, t_start), interrupt)
                    tell(
                        f"[1/4] kcloak broker: algorithm {cfg.algorithm}, embedded MQTT on "
                        f"127.0.0.1:{broker.mqtt_port}, HTTP on 127.0.0.1:{broker.http_port} "
                        f"({time.monotonic() - t_start:.1f} s)"
                    )
                    tell(f"      live map: {broker.url}/map (while the demo runs)")
                    opener = asyncio.create_task(_open_browser(f"{broker.url}/map", tell)) if cfg.open_map else None
                    lbs_ready = _waiting(lbs.ready(), "the reference LBS to start", tell, t_start)
                    n_pois = await _first_of(lbs_ready, interrupt)
                    tell(
                        f"[2/4] reference LBS: {n_pois} Beijing POIs on {lbs.url} ({time.monotonic() - t_start:.1f} s)"
                    )
                    streets = await _waiting(asyncio.shield(streets_task), "the streets to load", tell, t_start)
                    await asyncio.to_thread(write_streets_geojson, streets, streets_file)
                    km = float(streets.length_m.sum()) / 2000.0
                    side_km = (area[3] - area[1]) * math.pi / 180 * 6371.0088
                    timings["startup_s"] = time.monotonic() - t_start
                    tell(
                        f"[3/4] {cfg.users:,} users on {km:,.0f} km of streets in central Beijing "
                        f"({side_km:.1f} km x {side_km:.1f} km), {cfg.queries_per_min:g} {cfg.query_kind} queries "
                        f"per user per minute, profiles k = 5/10/20, until {cfg.duration_s:g} s "
                        f"({timings['startup_s']:.1f} s; Ctrl-C stops early)"
                    )
                    tell(f"      setting {cfg.users:,} privacy profiles and placing the users on the streets")
                    sim = SimulationConfig(
                        users=cfg.users,
                        model="street",
                        graph=streets,
                        query_rate_per_min=cfg.queries_per_min,
                        query_kind=cfg.query_kind,
                        duration_s=cfg.duration_s,
                        seed=cfg.seed,
                        broker=f"mqtt://127.0.0.1:{broker.mqtt_port}",
                        profile_broker=broker.url,
                    )
                    t_sim = time.monotonic()
                    plotting = asyncio.create_task(asyncio.to_thread(load_plotting if cfg.pictures else _nothing))
                    stop_on = asyncio.create_task(_forward(interrupt, stop))
                    timer = asyncio.create_task(_deadline(observer, t_start, cfg.duration_s, stop))
                    try:
                        with _Display(cfg, observer, live=live, console=err, t_start=t_start) as display:
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
                    if opener is not None and not opener.done():
                        opener.cancel()  # the browser command is still running: the demo does not wait for it
                    moving_s = sim_summary.duration_s if sim_summary is not None else observer.running_span_s()
                    if observer.first_update_t is not None:
                        timings["placing_s"] = observer.first_update_t - t_sim
                        timings["moving_s"] = moving_s
                        timings["drain_s"] = max(timings["simulation_s"] - timings["placing_s"] - moving_s, 0.0)
                    published = await asyncio.to_thread(count_published_windows, broker.http_port)
                    t_report = time.monotonic()
                    if broken is not None:
                        tell(f"      the simulation ended early: {broken}")
                    tell(f"[4/4] writing the report to {cfg.report_dir}")
                    summary = summarize(
                        observer.obs,
                        users=cfg.users,
                        duration_s=moving_s,
                        algorithm=cfg.algorithm,
                        published_windows=published,
                        skipped_steps=sim_summary.skipped_steps if sim_summary is not None else 0,
                    )
                    with contextlib.suppress(Exception):
                        await plotting
                    # The report is drawn while the broker and the provider shut down.
                    report_task = asyncio.create_task(
                        asyncio.to_thread(
                            write_report,
                            cfg.report_dir,
                            observer.obs,
                            summary,
                            streets=streets,
                            max_area_m2=bcfg.profile.max_area_m2,
                            requested_k=_requested_k(),
                            pictures=cfg.pictures,
                        )
                    )
                    try:
                        await asyncio.gather(broker.stop(), lbs.stop())
                    finally:
                        files = await report_task
        finally:
            if not streets_task.done():
                streets_task.cancel()
            with contextlib.suppress(BaseException):
                await streets_task
    timings["report_s"] = time.monotonic() - t_report
    timings["total_s"] = time.monotonic() - t_start
    return DemoResult(summary=summary, files=files, timings_s=timings, interrupted=interrupt.is_set())


WAIT_NOTE_S: Final = 5.0
"""While a start-up step takes longer than this, a line says what the demo is still waiting for."""


async def _waiting(work: Awaitable[T], what: str, tell: Callable[[str], None], t_start: float) -> T:
    """Await ``work``, saying every :data:`WAIT_NOTE_S` seconds that the demo still waits for ``what``."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WAIT_NOTE_S)
            if done:
                return task.result()
            tell(
                f"      still waiting for {what} to start ({time.monotonic() - t_start:.0f} s; a busy machine is slow)"
            )
    finally:
        if not task.done():
            task.cancel()


async def _first_of(work: Awaitable[T], interrupt: asyncio.Event) -> T:
    """Await ``work``; a Ctrl-C meanwhile (``interrupt``) cancels it and raises :class:`KeyboardInterrupt`."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(interrupt.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise KeyboardInterrupt
    return task.result()


def _nothing() -> None:
    """What the demo warms up instead of :func:`load_plotting` when it draws no pictures."""


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
    n_skipped = int(s.get("skipped_steps") or 0)
    skipped = f"; {n_skipped} one-second steps skipped, the machine fell behind" if n_skipped else ""
    refusals = ", ".join(f"{code} {n:,}" for code, n in s["refusals"].items()) or "none"
    rows = (
        ("algorithm", s["algorithm"]),
        ("users", fmt(s["users"])),
        ("users moving", fmt(s["duration_s"], " s")),
        ("updates", f"{s['updates']:,} ({s['updates_per_s']:,.0f}/s)" + skipped),
        ("queries", fmt(s["queries"])),
        ("answered ok", fmt(s["ok"])),
        ("refused", f"{s['refused']:,} ({refusals})"),
        *((("unanswered", fmt(s["unanswered"])),) if s.get("unanswered") else ()),
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
        f"start-up {t.get('startup_s', 0):.1f} s, placing users {t.get('placing_s', 0):.1f} s, "
        f"users moving {t.get('moving_s', 0):.1f} s, last answers {t.get('drain_s', 0):.1f} s, "
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
]
