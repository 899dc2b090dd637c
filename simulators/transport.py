"""Lean client side of the contract (§3 MQTT, §4 HTTP) for simulators, replay, load and benchmarks.

A simulator must be able to saturate the broker from one process, so it cannot spend more CPU
per message than the broker does. General-purpose clients do: paho reads a byte at a time, and
aiohttp's client costs about as much as the server. These two clients speak only what a kcloak
client needs, over asyncio protocols, and parse every packet or response in each chunk the
socket delivers:

* :class:`MqttClient`: kcloak's one MQTT client (:mod:`kcloak.wire.mqtt_client`, the same the
  broker uses towards an external MQTT broker) with its errors as :class:`TransportError`.
* :class:`HttpClient`: HTTP/1.1 keep-alive connections in a pool, one request in flight per
  connection, ``Content-Length`` or chunked responses, an optional bearer token per request.

:class:`BrokerUrl` parses the ``--broker`` flag of every client command (contract §9).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

from kcloak.simulators.errors import SimulatorError
from kcloak.wire.http_client import HttpClientError as HttpError
from kcloak.wire.http_client import HttpConnectionError, HttpPool, HttpResponse, HttpTimeout
from kcloak.wire.mqtt_client import Incoming, MqttError
from kcloak.wire.mqtt_client import MqttClient as WireMqttClient
from kcloak.wire.mqtt_codec import MAX_REMAINING_LENGTH

DEFAULT_MQTT_PORT = 1883
DEFAULT_HTTP_PORT = 8470


class TransportError(SimulatorError, ConnectionError):
    """The broker is unreachable, refused us, or the connection broke (exit 1 at the CLI)."""


@dataclass(frozen=True, slots=True)
class BrokerUrl:
    """``mqtt://host[:port]`` (default port 1883) or ``http://host[:port]`` (default 8470); contract §9."""

    scheme: Literal["mqtt", "http"]
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> BrokerUrl:
        """Raises :class:`ValueError` naming the rule (never echoing credentials)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("mqtt", "http"):
            raise ValueError("--broker: must be mqtt://HOST[:PORT] or http://HOST[:PORT]")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError("--broker: only a scheme, host and port are allowed")
        try:
            port = parts.port
        except ValueError:
            raise ValueError("--broker: port must be 1-65535") from None
        host = parts.hostname
        if not host:
            raise ValueError("--broker: missing host")
        if scheme == "mqtt":
            return cls("mqtt", host, port or DEFAULT_MQTT_PORT)
        return cls("http", host, port or DEFAULT_HTTP_PORT)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


# -- MQTT --------------------------------------------------------------------------------------
MqttMessage = Incoming
"""One PUBLISH received from the MQTT broker (``topic``, ``payload``, ``qos``, ``retain``)."""


class MqttClient(WireMqttClient):
    """kcloak's MQTT client (:class:`kcloak.wire.mqtt_client.MqttClient`, async context manager)
    with its errors raised as :class:`TransportError`, a ``kcloak-sim-…`` client id by default and
    no size limit on received packets beyond the protocol's. Same keyword-only arguments."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("client_prefix", "kcloak-sim")
        kwargs.setdefault("max_packet", MAX_REMAINING_LENGTH)
        super().__init__(**kwargs)

    async def __aenter__(self) -> MqttClient:
        with _as_transport_error():
            await super().__aenter__()
        return self

    async def subscribe(self, filters: list[str], *, qos: int = 1) -> bytes:
        """Subscribe at QoS 1 and wait for the SUBACK; a refused filter raises :class:`TransportError`."""
        with _as_transport_error():
            return await super().subscribe(filters, qos=qos)

    async def send(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        with _as_transport_error():
            await super().send(topic, payload, qos=qos, retain=retain)

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        with _as_transport_error():
            await super().publish(topic, payload, qos=qos, retain=retain)


@contextlib.contextmanager
def _as_transport_error() -> Iterator[None]:
    try:
        yield
    except MqttError as exc:
        raise TransportError(str(exc)) from None


# -- HTTP --------------------------------------------------------------------------------------
class HttpClient:
    """A pool of keep-alive HTTP/1.1 connections to one kcloak listener (async context manager);
    the broker's lean client (:class:`kcloak.wire.http_client.HttpPool`) with errors as :class:`TransportError`.

    Keyword-only arguments:
        host, port: the kcloak HTTP listener.
        connections: most connections open at once (requests beyond wait for a free one); default 64.
        timeout_s: per-request limit (connect, send, full response); default 60.
    """

    def __init__(self, *, host: str, port: int, connections: int = 64, timeout_s: float = 60.0) -> None:
        self.host = host
        self.port = port
        self._pool = HttpPool(host=host, port=port, connections=connections, timeout_s=timeout_s)

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool.close()

    async def request(
        self, method: str, path: str, body: bytes | None = None, *, token: str | None = None
    ) -> HttpResponse:
        """Send one request (JSON body if given) and read the whole response; errors raise :class:`TransportError`."""
        headers = (("Authorization", f"Bearer {token}"),) if token is not None else ()
        try:
            return await self._pool.request(method, path, body, headers=headers)
        except HttpTimeout:
            raise TransportError("the broker did not answer in time") from None
        except HttpConnectionError as exc:
            raise TransportError(f"cannot reach the broker over HTTP: {exc}") from None
        except HttpError as exc:
            raise TransportError(f"the broker's HTTP response is invalid: {exc}") from None


__all__ = [
    "DEFAULT_HTTP_PORT",
    "DEFAULT_MQTT_PORT",
    "BrokerUrl",
    "HttpClient",
    "HttpResponse",
    "MqttClient",
    "MqttMessage",
    "TransportError",
]
