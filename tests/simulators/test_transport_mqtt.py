"""The simulators' MQTT client (``kcloak.simulators.transport.MqttClient``) against scripted peers
on real loopback sockets: a peer that stops answering PINGREQ (half open) and a PUBLISH whose
topic length runs past its own frame."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator

import pytest

from kcloak.simulators.transport import MqttClient, MqttMessage, TransportError
from tests.wire.peers import SilentPeer, packet


@pytest.fixture
async def silent() -> AsyncIterator[SilentPeer]:
    async with SilentPeer() as peer:
        yield peer


async def test_client_notices_a_peer_that_stops_answering_pings(silent: SilentPeer) -> None:
    async with MqttClient(host="127.0.0.1", port=silent.port, keepalive_s=1) as client:
        started = time.monotonic()
        async with asyncio.timeout(5):
            await client.closed  # no PINGRESP by the deadline: the connection is dead
        assert time.monotonic() - started < 2.5
        with pytest.raises(TransportError):
            await client.publish("kcloak/v1/update/u1", b"{}")


async def test_a_topic_length_past_the_frame_end_closes_the_connection() -> None:
    # A PUBLISH (QoS 1) whose topic length (40) runs past its own end into the next packet.
    lying = packet(0x32, struct.pack("!H", 40) + b"t/a" + b"\x00\x07")
    honest = packet(0x30, struct.pack("!H", 6) + b"t/next" + b"n" * 40)
    got: list[MqttMessage] = []
    async with (
        SilentPeer(after_suback=lying + honest) as peer,
        MqttClient(host="127.0.0.1", port=peer.port, on_messages=got.extend) as client,
    ):
        await client.subscribe(["t/+"])
        async with asyncio.timeout(5):
            await client.closed
        assert client.error is not None and "malformed" in str(client.error)
    assert got == []  # nothing read from beyond the frame, nor anything after the malformed one
