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


async def _read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first = (await reader.readexactly(1))[0]
    mult, length = 1, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length += (byte & 0x7F) * mult
        mult *= 128
        if not byte & 0x80:
            break
    return first, await reader.readexactly(length)


def _packet(first: int, body: bytes) -> bytes:
    assert len(body) < 128
    return bytes([first, len(body)]) + body


class SilentPeer:
    """Answers CONNECT (and SUBSCRIBE, then ``after_suback``) and then never answers anything."""

    def __init__(self, after_suback: bytes = b"") -> None:
        self.after_suback = after_suback
        self.writers: list[asyncio.StreamWriter] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> SilentPeer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.writers:
            w.close()
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        first, _ = await _read_packet(reader)
        assert first >> 4 == 1
        writer.write(_packet(0x20, b"\x00\x00"))
        while True:
            try:
                first, body = await _read_packet(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if first >> 4 == 8:  # SUBSCRIBE: granted QoS 1, then the scripted bytes
                writer.write(_packet(0x90, body[:2] + b"\x01") + self.after_suback)
            # PINGREQ and everything else: no answer


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
    lying = _packet(0x32, struct.pack("!H", 40) + b"t/a" + b"\x00\x07")
    honest = _packet(0x30, struct.pack("!H", 6) + b"t/next" + b"n" * 40)
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
