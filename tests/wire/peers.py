"""Scripted MQTT brokers on real loopback sockets, for tests of kcloak's MQTT client."""

from __future__ import annotations

import asyncio


async def read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One MQTT packet: (first byte, body)."""
    first = (await reader.readexactly(1))[0]
    mult, length = 1, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length += (byte & 0x7F) * mult
        mult *= 128
        if not byte & 0x80:
            break
    return first, await reader.readexactly(length)


def packet(first: int, body: bytes) -> bytes:
    """A short packet (under 128 bytes) from its first byte and body."""
    assert len(body) < 128
    return bytes([first, len(body)]) + body


class SilentPeer:
    """Answers CONNECT (and SUBSCRIBE, then sends ``after_suback``) and then nothing: PINGREQs go
    unanswered, as from a peer gone without a FIN (a half-open connection)."""

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
        first, _ = await read_packet(reader)
        assert first >> 4 == 1
        writer.write(packet(0x20, b"\x00\x00"))
        while True:
            try:
                first, body = await read_packet(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if first >> 4 == 8:  # SUBSCRIBE: granted QoS 1, then the scripted bytes
                writer.write(packet(0x90, body[:2] + b"\x01") + self.after_suback)
            # PINGREQ and everything else: no answer
