"""``kcloak bench broker`` end to end, briefly: a real ``kcloak serve``, mosquitto (or the embedded
broker), client processes; the contract's row fields (§9) and rates read from the broker's counters."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
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


async def test_mqtt_query_clients_keep_their_window_with_each_other_s_answers(tmp_path: Path) -> None:
    """Every client process subscribes to all answers (``kcloak/v1/answer/+``), so each also sees the
    others'; only its own may free a slot of its window, or closed loop turns into a flood. An
    answerer in the test replies to every query, in bursts, and tracks each client's outstanding
    queries."""
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
                        await conn.send(
                            f"kcloak/v1/answer/{user}", json.dumps({"query_id": qid, "status": "ok"}).encode(), qos=0
                        )

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


def test_a_zero_query_rate_is_explained() -> None:
    """A transport with 0 queries answered ok per second gets a line saying why, from the row's own numbers."""
    from kcloak.cli.bench_broker import zero_query_notes

    rows = [
        {"transport": "mqtt", "queries_per_s": 0.0, "queries_refused_per_s": 812.5},
        {"transport": "http", "queries_per_s": 0.0, "queries_refused_per_s": 0.0},
        {"transport": "http", "queries_per_s": 950.0, "queries_refused_per_s": 3.0},
    ]
    mqtt, http = zero_query_notes(rows)
    assert mqtt.startswith("kcloak bench broker: mqtt: 0 queries answered ok") and "refused (812.5/s" in mqtt
    assert http.startswith("kcloak bench broker: http: 0 queries answered ok") and "no query got any answer" in http
