"""MQTT 3.1.1 packets as bytes, both ways: the one codec of kcloak's client
(:mod:`kcloak.wire.mqtt_client`) and of its embedded server (:mod:`kcloak.broker.mqtt_server`).

Encoders build whole control packets. Decoders work in place on a receive buffer (a
``bytearray`` that grows as the socket delivers chunks): :func:`split_frames` cuts the complete
packets at its head, and the field readers take a packet's bounds so that no length field can
make them read past the packet's own end (MQTT 3.1.1 §1.5.3, §2.2.3). Anything that breaks the
protocol raises :class:`MalformedFrame`; the connection that sent it is then closed.
"""

from __future__ import annotations

import struct

from kcloak.wire.errors import WireError

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14

MAX_REMAINING_LENGTH = 268_435_455
"""The largest remaining length four bytes can encode (MQTT 3.1.1 §2.2.3)."""

PINGREQ_PACKET = bytes([PINGREQ << 4, 0])
PINGRESP_PACKET = bytes([PINGRESP << 4, 0])
DISCONNECT_PACKET = bytes([DISCONNECT << 4, 0])


class MalformedFrame(WireError, ValueError):
    """A packet that breaks MQTT 3.1.1: a remaining length over four bytes or over the allowed
    size, or a field (a topic, a string, a packet id) that runs past the end of its packet."""


# -- encoding ----------------------------------------------------------------------------------
def encode_remaining_length(n: int) -> bytes:
    """MQTT's variable-length "remaining length" field."""
    out = bytearray()
    while True:
        byte = n % 128
        n //= 128
        if n:
            byte |= 0x80
        out.append(byte)
        if not n:
            return bytes(out)


def encode_utf8(s: str) -> bytes:
    """An MQTT UTF-8 string: two length bytes, then the bytes."""
    b = s.encode("utf-8")
    return struct.pack("!H", len(b)) + b


def encode_packet(kind: int, flags: int, body: bytes) -> bytes:
    """A whole MQTT control packet: fixed header, remaining length, body."""
    return bytes([(kind << 4) | flags]) + encode_remaining_length(len(body)) + body


def encode_connect(
    client_id: str,
    *,
    username: str | None,
    password: str | None,
    keepalive_s: int,
    will: tuple[str, bytes] | None = None,
    clean_session: bool = True,
) -> bytes:
    """An MQTT 3.1.1 CONNECT, by default with a clean session; a ``will`` (topic, payload) is QoS 1
    and retained. A password is sent only with a username (MQTT 3.1.1 §3.1.2.9)."""
    flags = 0x02 if clean_session else 0
    payload = encode_utf8(client_id)
    if will is not None:
        topic, message = will
        flags |= 0x04 | (1 << 3) | 0x20  # will, will QoS 1, will retain
        payload += encode_utf8(topic) + struct.pack("!H", len(message)) + message
    if username is not None:
        flags |= 0x80
        payload += encode_utf8(username)
        if password is not None:
            flags |= 0x40
            payload += encode_utf8(password)
    body = encode_utf8("MQTT") + bytes([4, flags]) + struct.pack("!H", keepalive_s) + payload
    return encode_packet(CONNECT, 0, body)


def encode_publish(
    topic: str, payload: bytes, *, qos: int = 0, pid: int = 0, retain: bool = False, dup: bool = False
) -> bytes:
    """A PUBLISH; the packet id ``pid`` is written at QoS 1 and 2 only."""
    flags = (0x08 if dup else 0) | (qos << 1) | (1 if retain else 0)
    body = encode_utf8(topic) + (struct.pack("!H", pid) if qos else b"") + payload
    return encode_packet(PUBLISH, flags, body)


def encode_ack(kind: int, pid: int) -> bytes:
    """PUBACK, PUBREC, PUBREL (its reserved flags 0010) or PUBCOMP for packet id ``pid``."""
    return bytes([(kind << 4) | (2 if kind == PUBREL else 0), 2, pid >> 8, pid & 0xFF])


def encode_subscribe(pid: int, filters: list[str], qos: int = 1) -> bytes:
    """A SUBSCRIBE asking for ``qos`` on every filter."""
    body = struct.pack("!H", pid) + b"".join(encode_utf8(f) + bytes([qos]) for f in filters)
    return encode_packet(SUBSCRIBE, 2, body)


def encode_suback(pid: int, codes: bytes) -> bytes:
    """A SUBACK: one granted QoS (or 0x80, refused) per filter, in order."""
    return encode_packet(SUBACK, 0, struct.pack("!H", pid) + codes)


def encode_connack(session_present: bool, code: int) -> bytes:
    return bytes([CONNACK << 4, 2, 1 if session_present else 0, code])


# -- decoding ----------------------------------------------------------------------------------
def read_header(buf: bytearray, pos: int) -> tuple[int, int] | None:
    """The remaining length and the body start of the packet that starts at ``buf[pos]``, or None
    while its fixed header is incomplete. Raises :class:`MalformedFrame` for a remaining length over
    four bytes."""
    mult, length, i, n = 1, 0, pos + 1, len(buf)
    while True:
        if i >= pos + 5:
            raise MalformedFrame("remaining length over four bytes")
        if i >= n:
            return None
        byte = buf[i]
        length += (byte & 0x7F) * mult
        i += 1
        if not byte & 0x80:
            return length, i
        mult *= 128


def split_frames(buf: bytearray, max_packet: int = MAX_REMAINING_LENGTH) -> tuple[list[tuple[int, int, int]], int]:
    """The complete control packets at the head of ``buf``, as ``(first byte, body start, body end)``,
    and how many bytes they span (an incomplete packet at the end stays for the next chunk).

    Raises :class:`MalformedFrame` for a remaining length over four bytes or over ``max_packet``.
    """
    frames: list[tuple[int, int, int]] = []
    pos, n = 0, len(buf)
    while n - pos >= 2:
        length = buf[pos + 1]
        if length < 0x80:  # a one-byte remaining length (packets under 128 bytes, such as most fixes)
            i = pos + 2
        else:
            head = read_header(buf, pos)
            if head is None:
                break
            length, i = head
        if length > max_packet:
            raise MalformedFrame("packet too large")
        end = i + length
        if end > n:
            break
        frames.append((buf[pos], i, end))
        pos = end
    return frames, pos


def read_u16(buf: bytearray, pos: int, end: int) -> int:
    """A two-byte integer at ``buf[pos]`` of a packet ending at ``end``."""
    if pos + 2 > end:
        raise MalformedFrame("truncated")
    return (buf[pos] << 8) | buf[pos + 1]


def read_bytes(buf: bytearray, pos: int, end: int) -> tuple[bytes, int]:
    """Length-prefixed binary data at ``buf[pos]`` and the position after it."""
    n = read_u16(buf, pos, end)
    if pos + 2 + n > end:
        raise MalformedFrame("field beyond the packet")
    return bytes(buf[pos + 2 : pos + 2 + n]), pos + 2 + n


def read_str(buf: bytearray, pos: int, end: int) -> tuple[str, int]:
    """A strict MQTT UTF-8 string (valid UTF-8, no NUL; MQTT 3.1.1 §1.5.3) and the position after it."""
    raw, pos = read_bytes(buf, pos, end)
    return decode_str(raw), pos


def decode_str(raw: bytes) -> str:
    """The bytes of a strict MQTT UTF-8 string as text (valid UTF-8, no NUL; MQTT 3.1.1 §1.5.3)."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedFrame("not UTF-8") from None
    if "\x00" in s:
        raise MalformedFrame("NUL in a string")
    return s


def publish_head(buf: bytearray, first: int, i: int, end: int, have: int) -> tuple[str, bytes | None, int] | None:
    """Topic, packet id (None at QoS 0) and payload start of the PUBLISH whose body spans
    ``buf[i:end]``, of which ``buf[:have]`` has arrived; None until they have arrived (a topic is
    at most 64 KiB). Raises :class:`MalformedFrame` when the topic or packet id would run past the
    packet's end, for QoS 3, and for a QoS 1 or 2 packet id 0. The topic is decoded leniently
    (undecodable bytes replaced): a client only compares it with its own subscriptions."""
    qos = (first >> 1) & 3
    if qos == 3:
        raise MalformedFrame("QoS 3")
    if end - i < 2:
        raise MalformedFrame("PUBLISH without a topic")
    if have - i < 2:
        return None
    j = i + 2 + ((buf[i] << 8) | buf[i + 1])
    start = j + 2 if qos else j
    if start > end:
        raise MalformedFrame("topic beyond the packet")
    if start > have:
        return None
    topic = bytes(buf[i + 2 : j]).decode("utf-8", "replace")
    if not qos:
        return topic, None, start
    pid = bytes(buf[j:start])
    if pid == b"\x00\x00":
        raise MalformedFrame("packet id 0")
    return topic, pid, start
