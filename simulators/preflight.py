"""Check that a ``--broker`` URL leads to a running kcloak broker before any traffic is sent (contract §9).

A client command pointed at the wrong service must fail with exit 1 and say so, not send
traffic into the void and report zeros. Over HTTP kcloak answers ``GET /healthz`` with
``{"status", "version", "uptime_s", "mqtt", "upstream"}`` (contract §4); over MQTT it keeps the
retained ``kcloak/v1/broker/status`` message (contract §3), ``"state": "up"`` while it runs.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kcloak.simulators.transport import BrokerUrl, HttpClient, MqttClient, MqttMessage, TransportError

STATUS_TOPIC = "kcloak/v1/broker/status"
HEALTH_KEYS = frozenset({"status", "version", "mqtt", "upstream"})
"""Fields of the broker's ``/healthz`` answer that the reference LBS and other services lack."""

PROBE_TIMEOUT_S = 5.0


def _json_object(payload: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def probe_http(url: BrokerUrl, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """``GET /healthz`` must answer as a kcloak broker; raises :class:`TransportError` otherwise."""
    async with HttpClient(host=url.host, port=url.port, connections=1, timeout_s=timeout_s) as http:
        try:
            resp = await http.request("GET", "/healthz")
        except TransportError as exc:
            raise TransportError(f"{url}: GET /healthz: {exc}") from None
    health = _json_object(resp.body)
    if resp.status not in (200, 503) or health is None or not health.keys() >= HEALTH_KEYS:
        raise TransportError(f"{url}: not a kcloak broker (GET /healthz answered {resp.status} without its fields)")
    if health.get("status") == "draining":
        raise TransportError(f"{url}: the kcloak broker is shutting down")


async def probe_mqtt(
    url: BrokerUrl,
    *,
    username: str | None = None,
    password: str | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> None:
    """The retained broker status must say ``up``; raises :class:`TransportError` otherwise."""
    loop = asyncio.get_running_loop()
    status: asyncio.Future[dict[str, Any] | None] = loop.create_future()

    def on_messages(batch: list[MqttMessage]) -> None:
        for m in batch:
            if m.topic == STATUS_TOPIC and not status.done():
                status.set_result(_json_object(m.payload))

    try:
        async with asyncio.timeout(timeout_s):
            async with MqttClient(
                host=url.host, port=url.port, username=username, password=password, on_messages=on_messages
            ) as client:
                await client.subscribe([STATUS_TOPIC])
                obj = await status
    except TimeoutError:
        raise TransportError(
            f"{url}: no kcloak broker behind this MQTT broker (no retained {STATUS_TOPIC} within {timeout_s:g} s)"
        ) from None
    except TransportError as exc:
        raise TransportError(f"{url}: {exc}") from None
    state = obj.get("state") if obj is not None else None
    if state != "up":
        raise TransportError(f"{url}: the kcloak broker is not running ({STATUS_TOPIC} says {state or 'nothing'})")


async def probe_broker(
    broker: str | BrokerUrl, *, credentials: tuple[str, str] | None = None, timeout_s: float = PROBE_TIMEOUT_S
) -> None:
    """Probe ``broker`` (``mqtt://`` or ``http://``); ``credentials`` = one user's ``(user, token)`` for MQTT."""
    url = broker if isinstance(broker, BrokerUrl) else BrokerUrl.parse(broker)
    if url.scheme == "http":
        await probe_http(url, timeout_s=timeout_s)
        return
    user, token = credentials if credentials is not None else (None, None)
    await probe_mqtt(url, username=user, password=token, timeout_s=timeout_s)


__all__ = ["HEALTH_KEYS", "PROBE_TIMEOUT_S", "STATUS_TOPIC", "probe_broker", "probe_http", "probe_mqtt"]
