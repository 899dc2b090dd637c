"""``kcloak bench broker`` end to end, briefly: a real ``kcloak serve``, mosquitto (or the embedded
broker), client processes; the contract's row fields (§9) and rates read from the broker's counters."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from kcloak.broker.bench import BrokerBenchConfig, run_broker_bench

ROW_FIELDS = {
    "transport",
    "mqtt",
    "users",
    "updates_per_s",
    "queries_per_s",
    "latency_at_qps",
    "added_latency_ms_p50",
    "added_latency_ms_p99",
}


def test_short_run_reports_every_field_with_answered_queries() -> None:
    report = run_broker_bench(BrokerBenchConfig(duration_s=1.5, users=3000, client_processes=2))
    assert report["bench"] == "broker" and [r["transport"] for r in report["results"]] == ["mqtt", "http"]
    for row in report["results"]:
        assert set(row) >= ROW_FIELDS, ROW_FIELDS - set(row)
        assert row["users"] == 3000
        assert row["updates_per_s"] > 0 and row["queries_per_s"] > 0
        # Closed-loop clients keep a bounded number of queries outstanding, so the broker is not
        # flooded into refusing (3,000 users stay below the per-user query rate): refusals stay a small share.
        assert row["queries_refused_per_s"] < 0.2 * row["queries_per_s"]
        assert row["added_latency_ms_p50"] is not None and row["added_latency_ms_p50"] >= 0
        # Intake beside its yardstick, measured in this run: the yardstick's own rate, kcloak's CPU
        # per accepted fix and the generators' CPU, all read from outside (counters, /proc).
        yard = row["yardstick"]
        assert yard["per_s"] > 0 and yard["cpu_us_per_item"] > 0, yard
        assert yard["generator_cpu_cores"] > 0 and yard["generator_cpu_max"] <= yard["generator_cpu_cores"]
        assert row["updates_vs_yardstick"] == round(row["updates_per_s"] / yard["per_s"], 3)
        assert row["cpu_us_per_fix"] > 0 and row["update_generator_cpu_cores"] > 0
        assert row["queries_note"] is None
    mqtt_yard, http_yard = (r["yardstick"] for r in report["results"])
    assert mqtt_yard["name"].startswith("mosquitto") and "pass-through" in mqtt_yard["name"]
    assert http_yard["name"] == "empty aiohttp handler"
    assert mqtt_yard["per_s"] != http_yard["per_s"]


def test_cpu_seconds_reads_a_busy_process_from_proc() -> None:
    from kcloak.broker.bench import cpu_seconds

    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.4)
        first = cpu_seconds(busy.pid)
        busy.wait(10)
    finally:
        busy.kill()
    assert first is not None and first > 0
    assert cpu_seconds(busy.pid) is None  # reaped: no /proc entry
    import os

    own = cpu_seconds(os.getpid())
    assert own is not None and own > 0


def test_cli_rejects_bad_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-I", "-m", "kcloak", "bench", "broker", "--duration", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert "--duration" in out.stderr
    assert "Traceback" not in out.stderr


async def test_mqtt_query_clients_keep_their_window_with_answers_to_other_queries(tmp_path: Path) -> None:
    """Every client process subscribes to its own users' answer topics, where answers to other
    queries (another phase's, another client's) may also arrive; only its own may free a slot of its
    window, or closed loop turns into a flood. An answerer in the test replies to every query, in
    bursts, each reply preceded by a stray answer on the same topic, and tracks each client's
    outstanding queries."""
    from kcloak.broker.bench import QUERY_WINDOW, _mqtt_query_worker, _run_workers, _split, mosquitto
    from kcloak.wire.mqtt_client import Incoming, MqttClient

    outstanding: dict[str, int] = {}
    most: dict[str, int] = {}
    held: list[tuple[str, str]] = []

    def on_queries(batch: list[Incoming]) -> None:
        for m in batch:
            qid = json.loads(m.payload)["query_id"]
            client = qid.rsplit("-", 1)[0]
            outstanding[client] = outstanding.get(client, 0) + 1
            most[client] = max(most.get(client, 0), outstanding[client])
            held.append((m.topic.rsplit("/", 1)[1], qid))

    with mosquitto(tmp_path) as (port, _):
        async with MqttClient(host="127.0.0.1", port=port, on_messages=on_queries) as conn:
            await conn.subscribe(["kcloak/v1/query/+"])

            async def answer_in_bursts() -> None:
                while True:
                    await asyncio.sleep(0.05)
                    burst, held[:] = held[:], []
                    for user, qid in burst:
                        outstanding[qid.rsplit("-", 1)[0]] -= 1
                        for answered in (f"other-{qid}", qid):  # compact JSON, as kcloak writes answers
                            body = json.dumps({"query_id": answered, "status": "ok"}, separators=(",", ":"))
                            await conn.send(f"kcloak/v1/answer/{user}", body.encode(), qos=0)

            answerer = asyncio.create_task(answer_in_bursts())
            users = [(f"w{i:04d}", 39.9, 116.4) for i in range(2000)]
            await asyncio.to_thread(
                _run_workers,
                _mqtt_query_worker,
                [(port, part, 3.0, None, f"c{i}") for i, part in enumerate(_split(users, 2))],
            )
            answerer.cancel()
            await asyncio.gather(answerer, return_exceptions=True)
    assert len(most) == 2
    assert all(QUERY_WINDOW // 2 <= n <= QUERY_WINDOW for n in most.values()), most


def test_zero_queries_per_s_always_comes_with_a_reason() -> None:
    from kcloak.broker.bench import _queries_note

    refused = 'kcloak_queries_total{kind="knn",reason="overloaded",status="refused",transport="mqtt"}'
    other = 'kcloak_queries_total{kind="knn",reason="rate_limited",status="refused",transport="http"}'
    before = {refused: 5.0, other: 1.0}
    after = {refused: 905.0, other: 9.0}
    assert _queries_note(12.5, 0.0, 20.0, before, after, "mqtt") is None
    assert _queries_note(0.0, 300.0, 300.0, before, after, "mqtt") == "every query was refused (overloaded)"
    assert "received no mqtt query" in (_queries_note(0.0, 0.0, 0.0, before, before, "mqtt") or "")
    assert "none answered" in (_queries_note(0.0, 0.0, 40.0, before, before, "mqtt") or "")
