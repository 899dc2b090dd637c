"""``kcloak bench soak``: a real broker under simulated street users for a long while, watched from outside.

It lives in the command-line layer because it orchestrates processes of layers that must not
import each other: a ``kcloak serve`` child and a ``kcloak lbs`` child (as ``kcloak demo`` starts
them), the broker benchmark's query load (:func:`kcloak.broker.bench.sustained_query_rate`) to
find the sustained rate, and the street users of :mod:`kcloak.simulators.traffic` at half that rate.
What is observed and judged is :mod:`kcloak.simulators.soak`.

The run, in order:

1. the reference LBS and the broker start on free loopback ports over a data directory of their
   own (the shipped configuration but for the ports, the data directory and the algorithm);
2. the sustained query rate is measured (closed-loop kNN queries over MQTT from two client
   processes, answered-ok per second from the broker's counters) unless ``rate`` is given;
3. ``users`` street users on the bundled Beijing network (profiles k = 5/10/20) send a fix each
   second and queries (Poisson, range and kNN) at half the sustained rate, over MQTT, for
   ``duration_s``; a separate MQTT connection (the ledger) counts every answer message per query id;
4. every ``sample_every_s`` a :class:`~kcloak.simulators.soak.Sample` is taken from outside: /proc,
   the data directory, ``/metrics`` and the clients' latencies of the interval;
5. after the users stop, late answers are awaited, and :func:`~kcloak.simulators.soak.verdict` judges.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from kcloak.broker.bench import histogram_quantile, scrape, sustained_query_rate
from kcloak.broker.config import Config
from kcloak.cli._demo_run import BrokerProcess, ReferenceLbs, demo_area, prepare_streets
from kcloak.simulators.soak import (
    AnswerLedger,
    Check,
    Criteria,
    Sample,
    Verdict,
    counter_sum,
    gauge_by_label,
    p99_ms,
    read_process,
    sqlite_sizes,
    verdict,
)
from kcloak.simulators.traffic import NullObserver, SimulationConfig, SimulationSummary, run_simulation
from kcloak.simulators.transport import MqttClient, MqttMessage
from kcloak.wire.net import free_port

LATE_ANSWERS_S: Final = 5.0
"""After the users stop (and the simulator's own drain), how long the ledger still listens for late
or repeated answers."""

END_GRACE_S: Final = 60.0
"""How long the simulated users may take to finish after the last sample before they are stopped."""

LOAD_SHARE: Final = 0.5
"""The soak runs at this share of the sustained query rate."""


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = 1200.0
    sample_every_s: float = 60.0
    rate: float | None = None
    """The sustained query rate (queries/s) to take instead of measuring it; the soak runs at half."""
    calibrate_s: float = 20.0
    users: int = 2000
    algorithm: str = "hilbert"
    query_kind: str = "mix"
    criteria: Criteria = field(default_factory=Criteria)
    seed: int = 1
    keep_dir: Path | None = None
    """Keep the broker's data directory and logs here (default: a temporary directory, removed)."""
    window_s: int | None = None
    """The broker's ``publish.window_s`` (default: the shipped 900 s)."""


@dataclass(slots=True)
class SoakObserver(NullObserver):
    """Hooks of :func:`kcloak.simulators.traffic.run_simulation`: the queries sent go to the ledger,
    the latencies of the answers are kept per interval."""

    ledger: AnswerLedger
    first_update_t: float | None = None
    sent: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def on_updates(self, n: int) -> None:
        if self.first_update_t is None:
            self.first_update_t = time.monotonic()

    def on_query_sent(self, query_id: str) -> None:
        self.ledger.sent_query(query_id)
        self.sent += 1

    def on_answer(self, answer: dict[str, Any], latency_s: float) -> None:
        self.latencies_s.append(latency_s)


class _Interval:
    """What changed since the previous sample: queries sent, answers, refusals, latencies, metrics."""

    def __init__(self, observer: SoakObserver, metrics: dict[str, float]) -> None:
        self.observer = observer
        self.sent = observer.sent
        self.answers = observer.ledger.first_answers
        self.refusals = Counter(observer.ledger.refusals)
        self.metrics = metrics

    def close(self, metrics: dict[str, float]) -> tuple[int, int, dict[str, int], list[float], _Interval]:
        obs = self.observer
        latencies, obs.latencies_s = obs.latencies_s, []
        refusals = Counter(obs.ledger.refusals)
        refusals.subtract(self.refusals)
        nxt = _Interval(obs, metrics)
        return (
            obs.sent - self.sent,
            obs.ledger.first_answers - self.answers,
            {k: v for k, v in refusals.items() if v},
            latencies,
            nxt,
        )


def _look(pid: int, data_dir: Path, http_port: int) -> tuple[Any, dict[str, int], dict[str, float]]:
    return read_process(pid), sqlite_sizes(data_dir), scrape(http_port, timeout_s=30)


def soak_broker_config(cfg: SoakConfig, *, data_dir: Path, upstream_url: str) -> Config:
    """The shipped configuration but for the loopback ports, the data directory and the algorithm."""
    return Config().with_values(
        {
            "http.listen": f"127.0.0.1:{free_port()}",
            "mqtt.mode": "embedded",
            "mqtt.listen": f"127.0.0.1:{free_port()}",
            "upstream.url": upstream_url,
            "storage.data_dir": str(data_dir),
            "cloaking.algorithm": cfg.algorithm,
            "log.level": "warning",
            "log.format": "text",
        }
        | ({} if cfg.window_s is None else {"publish.window_s": cfg.window_s})
    )


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 60:d}:{s % 60:02d}"


@dataclass(slots=True)
class SoakRun:
    """The state of a run, for the report: filled as the run goes."""

    cfg: SoakConfig
    sustained_ok_per_s: float | None = None
    sustained_refused_per_s: float | None = None
    target_qps: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None
    simulation: SimulationSummary | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by SIGINT/SIGTERM (``kcloak bench soak``): the traffic ends at once, the samples so far are
    reported and the run counts as failed ("interrupted")."""
    interrupted_at_s: float | None = None

    def report(self, ledger: AnswerLedger, judged: Verdict) -> dict[str, Any]:
        c = self.cfg
        crit = asdict(c.criteria)
        crit["profile_reasons"] = sorted(c.criteria.profile_reasons)
        return {
            "bench": "soak",
            "duration_s": c.duration_s,
            "sample_every_s": c.sample_every_s,
            "users": c.users,
            "algorithm": c.algorithm,
            "query_kind": c.query_kind,
            "sustained_qps": {
                "measured": c.rate is None,
                "ok_per_s": self.sustained_ok_per_s,
                "refused_per_s": self.sustained_refused_per_s,
            },
            "target_qps": round(self.target_qps, 1),
            "criteria": crit,
            "results": [s.to_json() for s in self.samples],
            "ledger": asdict(ledger.totals()),
            "simulation": None if self.simulation is None else self.simulation.to_json(),
            "error": self.error,
            "interrupted": self.interrupted_at_s is not None,
            "interrupted_at_s": None if self.interrupted_at_s is None else round(self.interrupted_at_s, 3),
            "verdict": judged.to_json(),
            "host": {"cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
        }


async def run_soak(cfg: SoakConfig, *, say: Callable[[str], None], stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Run the soak (module docstring); returns the report (``verdict.passed`` says pass or fail).
    When ``stop`` is set the traffic ends early, the broker and the LBS are stopped, and the report
    holds the samples taken so far with a failed ``run`` check ("interrupted").

    Raises :class:`kcloak.cli._demo_run.DemoStartupError` when the broker or the LBS cannot start.
    """
    run = SoakRun(cfg) if stop is None else SoakRun(cfg, stop=stop)
    ledger = AnswerLedger()
    t_begin = time.monotonic()
    with contextlib.ExitStack() as stack:
        if cfg.keep_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kcloak-soak-")))
        else:
            work = cfg.keep_dir
            work.mkdir(parents=True, exist_ok=True)
        data_dir = work / "data"
        streets_task = asyncio.create_task(asyncio.to_thread(prepare_streets, demo_area(cfg.users)))
        async with ReferenceLbs(log_path=work / "lbs.log") as lbs:
            bcfg = soak_broker_config(cfg, data_dir=data_dir, upstream_url=lbs.url)
            async with BrokerProcess(bcfg, workdir=work) as broker:
                await broker.ready()
                await lbs.ready()
                pid = broker.pid
                assert pid is not None
                say(
                    f"broker pid {pid}: HTTP 127.0.0.1:{broker.http_port}, embedded MQTT 127.0.0.1:{broker.mqtt_port}, "
                    f"algorithm {cfg.algorithm}; reference LBS {lbs.url}; data {data_dir}"
                )
                if cfg.rate is None:
                    say(
                        f"measuring the sustained query rate ({cfg.calibrate_s:g} s of closed-loop kNN queries "
                        "over MQTT)"
                    )
                    ok, refused = await asyncio.to_thread(
                        sustained_query_rate,
                        broker.http_port,
                        broker.mqtt_port,
                        users=cfg.users,
                        duration_s=cfg.calibrate_s,
                    )
                    run.sustained_ok_per_s, run.sustained_refused_per_s = round(ok, 1), round(refused, 1)
                    sustained = ok
                else:
                    sustained = cfg.rate
                run.target_qps = sustained * LOAD_SHARE
                say(
                    f"sustained rate {sustained:,.0f} queries/s"
                    + (" (measured)" if cfg.rate is None else " (given)")
                    + f"; soak at {run.target_qps:,.0f} queries/s and {cfg.users:,} fixes/s for {cfg.duration_s:g} s"
                )
                if run.stop.is_set():
                    run.interrupted_at_s = 0.0
                elif run.target_qps <= 0:
                    run.error = "the broker answered no query while its sustained rate was measured"
                else:
                    streets = await streets_task
                    await _traffic(run, ledger, streets, broker, pid, data_dir, t_begin, say)
    judged = verdict(run.samples, ledger.totals(), run.target_qps, cfg.criteria)
    if run.interrupted_at_s is not None:
        run.error = (
            f"interrupted after {_clock(run.interrupted_at_s)} of {_clock(cfg.duration_s)} of traffic: "
            "the samples so far are reported, the run does not count"
        )
    if run.error is not None:
        judged = Verdict((*judged.checks, Check("run", False, None, None, run.error)))
    return run.report(ledger, judged)


async def _traffic(
    run: SoakRun,
    ledger: AnswerLedger,
    streets: Any,
    broker: BrokerProcess,
    pid: int,
    data_dir: Path,
    t_begin: float,
    say: Callable[[str], None],
) -> None:
    cfg = run.cfg
    observer = SoakObserver(ledger)

    def on_answers(batch: list[MqttMessage]) -> None:
        for m in batch:
            ledger.answer(m.payload)

    sim = SimulationConfig(
        users=cfg.users,
        model="street",
        graph=streets,
        query_rate_per_min=run.target_qps * 60.0 / cfg.users,
        query_kind=cfg.query_kind,
        duration_s=cfg.duration_s,
        seed=cfg.seed,
        broker=f"mqtt://127.0.0.1:{broker.mqtt_port}",
        profile_broker=broker.url,
    )
    async with MqttClient(
        host="127.0.0.1", port=broker.mqtt_port, client_prefix="kcloak-soak-ledger", on_messages=on_answers
    ) as conn:
        await conn.subscribe(["kcloak/v1/answer/+"])
        task = asyncio.create_task(run_simulation(sim, observer=observer))
        stopped = asyncio.create_task(run.stop.wait())
        try:
            await _sample(run, observer, task, stopped, pid, data_dir, broker.http_port, t_begin, say)
            if run.interrupted_at_s is None and not await _simulation_ended(run, task, stopped):
                run.error = f"the simulated users had not finished {END_GRACE_S:g} s after the end of the traffic"
            if not task.done():
                say("stopping the users, the broker and the LBS")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return
            if run.interrupted_at_s is not None:
                return
            run.simulation = task.result()
        except BaseException:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        finally:
            stopped.cancel()
        await asyncio.sleep(LATE_ANSWERS_S)


async def _simulation_ended(run: SoakRun, task: asyncio.Task[SimulationSummary], stopped: asyncio.Task[Any]) -> bool:
    """Wait for the simulated users to finish after the last sample: False after :data:`END_GRACE_S`,
    or at once when ``stopped`` is done (``run.interrupted_at_s`` is then set too)."""
    await asyncio.wait([task, stopped], timeout=END_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
    if run.stop.is_set() and not task.done():
        run.interrupted_at_s = run.cfg.duration_s
    return task.done()


async def _sample(
    run: SoakRun,
    observer: SoakObserver,
    task: asyncio.Task[SimulationSummary],
    stopped: asyncio.Task[Any],
    pid: int,
    data_dir: Path,
    http_port: int,
    t_begin: float,
    say: Callable[[str], None],
) -> None:
    """Take a sample every ``sample_every_s`` from the first fix until ``duration_s``; stops early when
    the simulation ends, the broker is gone (``run.error``) or ``stopped`` (``run.stop`` was set) is done
    (``run.interrupted_at_s``)."""
    cfg = run.cfg
    while observer.first_update_t is None:
        if task.done():
            return
        if stopped.done():
            run.interrupted_at_s = 0.0
            return
        await asyncio.sleep(0.05)
    t0 = observer.first_update_t
    say(
        f"street users moving ({time.monotonic() - t_begin:.0f} s after start); "
        f"first sample in {cfg.sample_every_s:g} s"
    )
    _, _, metrics = await asyncio.to_thread(_look, pid, data_dir, http_port)
    interval = _Interval(observer, metrics)
    n = math.ceil(cfg.duration_s / cfg.sample_every_s - 1e-9)
    prev_t = 0.0
    for i in range(1, n + 1):
        t_s = min(i * cfg.sample_every_s, cfg.duration_s)
        await asyncio.wait(
            [task, stopped], timeout=max(0.0, t0 + t_s - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
        )
        if stopped.done():
            run.interrupted_at_s = time.monotonic() - t0
            return
        if task.done() and task.exception() is not None:
            run.error = f"the simulated users stopped: {type(task.exception()).__name__}: {task.exception()}"
            return
        try:
            proc, sizes, metrics = await asyncio.to_thread(_look, pid, data_dir, http_port)
        except OSError as exc:
            run.error = f"the broker could not be observed any more ({type(exc).__name__}: {exc})"
            return
        before = interval.metrics
        sent, answers, refusals, latencies, interval = interval.close(metrics)
        added = histogram_quantile(before, metrics, "mqtt", 0.99)
        sample = Sample(
            t_s=round(t_s, 3),
            interval_s=round(t_s - prev_t, 3),
            rss_bytes=proc.rss_bytes,
            children_rss_bytes=proc.children_rss_bytes,
            open_files=proc.open_files,
            cpu_s=round(proc.cpu_s, 2),
            sqlite_bytes=sizes,
            queue_depths=gauge_by_label(metrics, "kcloak_queue_depth", "queue"),
            queries_sent=sent,
            answers=answers,
            refusals=refusals,
            p99_ms=p99_ms(latencies),
            added_p99_ms=None if added is None else round(added * 1000.0, 3),
            fixes_accepted=round(
                counter_sum(metrics, "kcloak_updates_accepted_total")
                - counter_sum(before, "kcloak_updates_accepted_total")
            ),
            windows=round(
                counter_sum(metrics, "kcloak_published_windows_total")
                - counter_sum(before, "kcloak_published_windows_total")
            ),
            upstream_failures=upstream_failures(before, metrics),
            loadavg_1m=round(os.getloadavg()[0], 2),
        )
        run.samples.append(sample)
        prev_t = t_s
        say(progress_line(sample, run, time.monotonic() - t_begin))


def upstream_failures(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Upstream attempts that failed between two scrapes, by outcome (``ok`` left out, zeros too)."""
    name = "kcloak_upstream_seconds_count"
    was = gauge_by_label(before, name, "outcome")
    grown = {k: round(v - was.get(k, 0.0)) for k, v in gauge_by_label(after, name, "outcome").items() if k != "ok"}
    return {k: v for k, v in sorted(grown.items()) if v > 0}


def progress_line(s: Sample, run: SoakRun, elapsed_s: float) -> str:
    """One line per sample on stderr, with the time left."""
    cfg = run.cfg
    left = cfg.duration_s - s.t_s + LATE_ANSWERS_S
    refused = sum(s.refusals.values())
    codes = ", ".join(f"{k} {v}" for k, v in sorted(s.refusals.items(), key=lambda kv: -kv[1])[:3])
    queues = " ".join(f"{k} {v:.0f}" for k, v in sorted(s.queue_depths.items())) or "–"
    p99 = "–" if s.p99_ms is None else f"{s.p99_ms:.1f} ms"
    return (
        f"{_clock(s.t_s)}/{_clock(cfg.duration_s)} (ETA {_clock(left)}, {_clock(elapsed_s)} elapsed): "
        f"RSS {s.rss_bytes / 2**20:.1f} MiB, {s.open_files} files, SQLite {s.sqlite_total() / 2**20:.1f} MiB, "
        f"{s.answers / s.interval_s:,.0f} answers/s (target {run.target_qps:,.0f}), p99 {p99}, "
        f"{refused} refused{f' ({codes})' if codes else ''}, queues {queues}"
    )


def plot_soak(report: dict[str, Any], path: Path) -> None:
    """RSS, p99 latency and refusals over time (PNG, or any format matplotlib knows by the suffix)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report["results"]
    warmup = report["criteria"]["warmup_s"] / 60.0
    minutes = [r["t_s"] / 60.0 for r in rows]
    fig = Figure(figsize=(8, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_rss, ax_p99, ax_ref = fig.subplots(3, 1, sharex=True)
    verdict_word = "pass" if report["verdict"]["passed"] else "FAIL"
    span = report["duration_s"]
    fig.suptitle(
        f"kcloak bench soak: {report['users']:,} street users, {report['target_qps']:,.0f} queries/s, "
        + (f"{span / 60:.0f} min" if span >= 120 else f"{span:g} s")
        + f" — {verdict_word}"
    )
    ax_rss.plot(minutes, [r["rss_bytes"] / 2**20 for r in rows], marker="o", label="broker process")
    if any(r["children_rss_bytes"] for r in rows):
        ax_rss.plot(minutes, [r["children_rss_bytes"] / 2**20 for r in rows], ls="--", label="its children")
    base = next((r for r in rows if r["t_s"] >= report["criteria"]["warmup_s"] - 1e-6), None)
    if base is not None:
        limit = base["rss_bytes"] / 2**20 * (1 + report["criteria"]["rss_growth_max"])
        ax_rss.axhline(limit, color="tab:red", lw=0.8, ls=":", label="limit (+5 % over warm-up end)")
        ax_rss.set_ylim(0, max(limit, *(r["rss_bytes"] / 2**20 for r in rows)) * 1.08)
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.legend(loc="lower right", fontsize="small")
    ax_p99.plot(minutes, [r["p99_ms"] for r in rows], marker="o", label="p99, clients (send → answer)")
    ax_p99.plot(minutes, [r["added_p99_ms"] for r in rows], marker=".", ls="--", label="p99 added by the broker")
    ax_p99.set_ylabel("latency (ms)")
    ax_p99.set_ylim(bottom=0)
    ax_p99.legend(loc="lower right", fontsize="small")
    profile = set(report["criteria"]["profile_reasons"])
    ok_r = [sum(n for c, n in r["refusals"].items() if c in profile) / r["interval_s"] for r in rows]
    bad_r = [sum(n for c, n in r["refusals"].items() if c not in profile) / r["interval_s"] for r in rows]
    width = min(r["interval_s"] for r in rows) / 60.0 * 0.8 if rows else 1.0
    ax_ref.bar(minutes, ok_r, width=width, label="profile-driven refusals/s", color="tab:gray")
    ax_ref.bar(minutes, bad_r, width=width, bottom=ok_r, label="other refusals/s (failures)", color="tab:red")
    ax_ref.set_ylabel("refusals / s")
    ax_ref.set_xlabel("minutes of traffic")
    ax_ref.legend(loc="upper right", fontsize="small")
    for ax in (ax_rss, ax_p99, ax_ref):
        ax.axvspan(0, warmup, color="0.92", zorder=0)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)


__all__ = ["SoakConfig", "plot_soak", "run_soak"]
