"""kcloak's MQTT client against paho-mqtt 2.2 in the intake's role (docs/mqtt.md, "One client").

A real mosquitto (configured as ``kcloak mosquitto-config`` writes it) relays ``--messages`` QoS 1
fixes from a publisher process (always kcloak's client, so both runs get the same input) to a
subscriber in this process that acknowledges each one: kcloak's :class:`MqttClient` or a paho
client. Reported per subscriber: messages/s received and the subscriber's CPU µs per message.

    .venv/bin/python scripts/mqtt_client_bench.py --messages 100000 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kcloak.broker.bench import mosquitto
from kcloak.wire.mqtt_client import Incoming, MqttClient

TOPIC = "kcloak/v1/update/"
PAYLOAD = json.dumps({"t": 1.7e9, "lat": 39.9, "lon": 116.4}).encode()


def _publisher(port: int, n: int) -> None:
    async def main() -> None:
        async with MqttClient(host="127.0.0.1", port=port, client_prefix="bench-pub") as pub:
            for i in range(n):
                await pub.send(f"{TOPIC}u{i % 1000}", PAYLOAD, qos=1)
            await pub.flush(60)

    asyncio.run(main())


def _start_publisher(port: int, n: int) -> Any:
    proc = mp.get_context("spawn").Process(target=_publisher, args=(port, n), daemon=True)
    proc.start()
    return proc


def run_kcloak(port: int, n: int) -> tuple[float, float]:
    async def main() -> tuple[float, float]:
        done = asyncio.Event()
        got = 0
        first = 0.0

        def on_messages(batch: list[Incoming]) -> None:
            nonlocal got, first
            if not got:
                first = time.perf_counter()
            got += len(batch)
            if got >= n:
                done.set()

        async with MqttClient(host="127.0.0.1", port=port, client_prefix="bench-sub", on_messages=on_messages) as c:
            await c.subscribe([TOPIC + "+"])
            cpu0 = time.process_time()
            proc = _start_publisher(port, n)
            async with asyncio.timeout(300):
                await done.wait()
            wall, cpu = time.perf_counter() - first, time.process_time() - cpu0
        proc.join()
        return wall, cpu

    return asyncio.run(main())


def run_paho(port: int, n: int) -> tuple[float, float]:
    import paho.mqtt.client as paho

    done, subscribed = threading.Event(), threading.Event()
    state = {"got": 0, "first": 0.0}

    def on_message(_c: Any, _u: Any, _m: Any) -> None:
        if not state["got"]:
            state["first"] = time.perf_counter()
        state["got"] += 1
        if state["got"] >= n:
            done.set()

    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="bench-sub-paho")  # type: ignore[attr-defined]
    client.on_message = on_message
    client.on_subscribe = lambda *_: subscribed.set()
    client.max_inflight_messages_set(1000)
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.subscribe(TOPIC + "+", qos=1)
    subscribed.wait(10)
    cpu0 = time.process_time()
    proc = _start_publisher(port, n)
    done.wait(300)
    wall, cpu = time.perf_counter() - state["first"], time.process_time() - cpu0
    client.loop_stop()
    client.disconnect()
    proc.join()
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mosquitto(Path(tmp)) as (port, label):
        print(f"{label}, {args.messages} QoS 1 messages per run")
        for r in range(1, args.rounds + 1):
            for name, run in (("kcloak", run_kcloak), ("paho", run_paho)):
                wall, cpu = run(port, args.messages)
                print(
                    f"round {r} {name:6s}: {args.messages / wall:9.0f} messages/s received, "
                    f"{cpu / args.messages * 1e6:6.1f} µs CPU per message (subscriber process)"
                )


if __name__ == "__main__":
    main()
