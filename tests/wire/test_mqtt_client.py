"""kcloak's one MQTT client and codec (kcloak/wire) on raw bytes and against raw peers on real
loopback sockets: frame checks, the PINGRESP deadline, the reconnection backoff."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest

from kcloak.wire.mqtt_client import Backoff, MqttClient, MqttError
from kcloak.wire.mqtt_codec import (
    PUBREL,
    MalformedFrame,
    encode_ack,
    encode_publish,
    publish_head,
    read_str,
    split_frames,
)
from tests.wire.peers import SilentPeer


def _head(packet: bytes, have: int | None = None) -> tuple[str, bytes | None, int] | None:
    buf = bytearray(packet)
    frames, _ = split_frames(buf)
    first, i, end = frames[0]
    return publish_head(buf, first, i, end, len(buf) if have is None else have)


def test_publish_head_reads_topic_packet_id_and_payload_start() -> None:
    packet = encode_publish("t/a", b"xyz", qos=1, pid=258)
    assert _head(packet) == ("t/a", b"\x01\x02", len(packet) - 3)
    assert _head(encode_publish("t/a", b"xyz")) == ("t/a", None, 2 + 2 + 3)
    assert _head(packet, have=4) is None  # the topic has not all arrived yet


@pytest.mark.parametrize(
    "body",
    [
        struct.pack("!H", 40) + b"t/a" + b"\x00\x07",  # topic length past the frame end
        struct.pack("!H", 3) + b"t/a" + b"\x00",  # packet id cut by the frame end
        struct.pack("!H", 3) + b"t/a" + b"\x00\x00",  # packet id 0
        b"\x00",  # no room for a topic length
    ],
)
def test_publish_head_rejects_fields_past_the_frame(body: bytes) -> None:
    packet = bytes([0x32, len(body)]) + body + encode_publish("t/next", b"n" * 40)  # more bytes behind it
    with pytest.raises(MalformedFrame):
        _head(packet)


def test_qos3_publish_and_strings_past_their_packet_are_malformed() -> None:
    with pytest.raises(MalformedFrame, match="QoS 3"):
        _head(bytes([0x36, 5]) + struct.pack("!H", 1) + b"t\x00\x01")
    with pytest.raises(MalformedFrame):
        read_str(bytearray(struct.pack("!H", 9) + b"abc" + b"after the packet"), 0, 5)
    assert encode_ack(PUBREL, 0x0102) == b"\x62\x02\x01\x02"  # PUBREL's reserved flags 0010


async def test_half_open_connection_is_noticed_within_keepalive_plus_deadline() -> None:
    async with (
        SilentPeer() as peer,
        MqttClient(host="127.0.0.1", port=peer.port, keepalive_s=2, ping_timeout_s=0.4) as c,
    ):
        started = time.monotonic()
        with pytest.raises(MqttError, match="no PINGRESP"):
            async with asyncio.timeout(5):
                await c.wait_closed()
        elapsed = time.monotonic() - started
        assert 1.3 <= elapsed < 2.2, elapsed  # first PINGREQ at 1 s (half the keep-alive), deadline 0.4 s
        with pytest.raises(MqttError, match="no PINGRESP"):
            await c.publish("t/a", b"x")  # and it says why to whoever uses it next


async def test_pending_publishes_fail_when_the_connection_is_found_dead() -> None:
    async with SilentPeer() as peer, MqttClient(host="127.0.0.1", port=peer.port, keepalive_s=1) as c:
        with pytest.raises(MqttError, match="no PINGRESP"):
            async with asyncio.timeout(5):
                await c.publish("t/a", b"never acknowledged", qos=1)
        assert c.in_flight == 0


async def test_backoff_doubles_up_to_its_cap_and_restarts_short_after_reset() -> None:
    backoff = Backoff(first_s=0.05, max_s=0.2)

    async def timed() -> float:
        t0 = time.monotonic()
        await backoff.wait()
        return time.monotonic() - t0

    waits = [await timed() for _ in range(4)]
    for got, expected in zip(waits, [0.05, 0.1, 0.2, 0.2], strict=True):
        assert expected <= got < expected + 0.1, waits
    backoff.reset()  # a successful connection
    assert await timed() < 0.15
