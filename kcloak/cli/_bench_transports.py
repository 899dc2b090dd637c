"""The transport rows of ``kcloak bench simulate`` (contract §9): simulator throughput against a real broker.

It lives in the command-line layer because it orchestrates processes of two layers that must not
import each other: a ``kcloak serve`` child (with mosquitto or the embedded MQTT broker and an
instant upstream, started by :mod:`kcloak.broker.bench`) and the simulator's clients
(:func:`kcloak.simulators.traffic.saturate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kcloak.broker.bench import instant_upstream, mosquitto, scrape, serve_process, wait_healthy
from kcloak.simulators.bench import encode_rate
from kcloak.simulators.traffic import saturate
from kcloak.wire.net import free_port

TRANSPORTS = ("mqtt", "http")
"""Transport rows of ``kcloak bench simulate``, in order."""


def measure_transports(
    users: int = 100_000, duration_s: float = 10.0, seed: int = 0, *, log: Callable[[str], None] | None = None
) -> list[dict[str, object]]:
    """Contract rows ``{"transport", "updates_per_s", "broker_accepted_per_s"}`` for MQTT and HTTP.

    A real ``kcloak serve`` runs in a child process (MQTT through a spawned mosquitto when on PATH,
    else the embedded broker; an instant upstream), as ``kcloak bench broker`` starts it. One
    simulator process (this one) sends waypoint fixes in open-mode batches as fast as the broker
    takes them for ``duration_s``; ``updates_per_s`` is what it sent, ``broker_accepted_per_s``
    the growth of the broker's ``kcloak_updates_accepted_total`` over the same window. Extra
    field ``simulator_only_updates_per_s``: :func:`kcloak.simulators.bench.encode_rate` (the simulator with no network).
    """
    say = log or (lambda _msg: None)

    def scrape_slowly(http_port: int) -> dict[str, float]:
        return scrape(http_port, timeout_s=60)  # a saturated broker may take a while to serve /metrics

    def accepted(http_port: int, transport: str) -> float:
        metrics = scrape_slowly(http_port)
        return sum(
            v
            for k, v in metrics.items()
            if k.startswith("kcloak_updates_accepted_total") and f'transport="{transport}"' in k
        )

    def settle(http_port: int, timeout_s: float = 60.0) -> None:
        # Let the broker work off any backlog before the next phase (its counters stop moving).
        deadline, last = time.monotonic() + timeout_s, -1.0
        while time.monotonic() < deadline:
            m = scrape_slowly(http_port)
            now = sum(v for k, v in m.items() if k.startswith(("kcloak_updates_", "kcloak_messages_dropped")))
            if now == last:
                return
            last = now
            time.sleep(0.5)

    say("simulator only (no network)")
    ceiling = encode_rate(users, min(duration_s, 5.0), seed=seed)
    rows: list[dict[str, object]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kcloak-bench-sim-") as tmp,
        instant_upstream() as upstream,
        contextlib.ExitStack() as stack,
    ):
        try:
            mqtt_port, label = stack.enter_context(mosquitto(Path(tmp)))
            mqtt_args = ["--mqtt", f"mqtt://127.0.0.1:{mqtt_port}", "--mqtt-ingest-connections", "2"]
        except FileNotFoundError:
            mqtt_port, label = free_port(), "embedded"
            mqtt_args = ["--mqtt", "embedded", "--mqtt-listen", f"127.0.0.1:{mqtt_port}"]
        http_port = free_port()
        args = ["--http", f"127.0.0.1:{http_port}", "--upstream", upstream, "--data-dir", str(Path(tmp) / "data")]
        stack.enter_context(serve_process(args + mqtt_args))
        wait_healthy(http_port)
        for transport in TRANSPORTS:
            say(f"{transport} updates")
            url = f"mqtt://127.0.0.1:{mqtt_port}" if transport == "mqtt" else f"http://127.0.0.1:{http_port}"
            before, t0 = accepted(http_port, transport), time.monotonic()
            sent, elapsed = asyncio.run(saturate(url, users=users, duration_s=duration_s, seed=seed))
            after, t1 = accepted(http_port, transport), time.monotonic()
            settle(http_port)
            rows.append(
                {
                    "transport": transport,
                    "updates_per_s": round(sent / elapsed, 1),
                    "broker_accepted_per_s": round((after - before) / (t1 - t0), 1),
                    "simulator_only_updates_per_s": round(ceiling, 1),
                    "mqtt": label,
                    "users": users,
                }
            )
    return rows
