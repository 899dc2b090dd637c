"""kcloak's embedded MQTT 3.1.1 server, run inside ``kcloak serve`` (contract §3; docs/mqtt.md).

Why a server of our own: the amqtt child process it replaces acknowledged a publish as soon as it
had read it (so ``kill -9`` lost fixes whose PUBACK the app held), stored retained input and replayed
it, with no ACL check, to every later subscriber (kcloak's own intake included), let any user take
over another user's client id and session, failed MQTT 5 clients silently and outlived kcloak. No
Python library offers an embeddable broker that lets the application decide when to PUBACK, so this
module speaks exactly kcloak's interface: input topics go to ``dispatch`` and nowhere else, a QoS 1
input is acknowledged only once ``dispatch`` says it is durable, in arrival order (MQTT 3.1.1
§4.6), and the only messages ever delivered to subscribers are kcloak's own (:meth:`MqttServer.publish`).
Apps keep speaking standard MQTT 3.1.1; the wire codec is :mod:`kcloak.wire.mqtt_codec`, the
one kcloak's MQTT client uses too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import cast

from kcloak import __version__
from kcloak.broker.auth import TokenStore
from kcloak.broker.metrics import Metrics
from kcloak.core.logs import log_event
from kcloak.core.memory import bound_socket_reads
from kcloak.wire.mqtt_codec import (
    CONNECT,
    DISCONNECT,
    MAX_REMAINING_LENGTH,
    PINGREQ,
    PINGRESP_PACKET,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    MalformedFrame,
    decode_str,
    encode_ack,
    encode_connack,
    encode_packet,
    encode_publish,
    encode_suback,
    publish_head,
    read_bytes,
    read_header,
    read_str,
    read_u16,
    split_frames,
)
from kcloak.wire.payloads import valid_user_id

log = logging.getLogger("kcloak.mqtt_server")

PROTOCOL_LEVEL = 4
"""MQTT 3.1.1; any other level (3 = MQIsdp 3.1, 5 = MQTT 5) is refused with CONNACK 0x01."""

ACCEPTED, UNACCEPTABLE_PROTOCOL, IDENTIFIER_REJECTED, SERVER_UNAVAILABLE, BAD_CREDENTIALS, NOT_AUTHORIZED = range(6)

INPUT_KINDS = ("update", "updates", "profile", "query")
"""``kcloak/v1/{kind}/{user}`` topics that apps publish and only ``dispatch`` ever sees."""

MAX_CONNECT_BYTES = 128 * 1024
"""Largest CONNECT (its will included) and most bytes buffered before a client has authenticated."""

Dispatch = Callable[[str, bytes, bool], Awaitable[object] | None]


def valid_topic_name(topic: str) -> bool:
    return bool(topic) and "+" not in topic and "#" not in topic


def valid_topic_filter(flt: str) -> bool:
    if not flt:
        return False
    levels = flt.split("/")
    for n, level in enumerate(levels):
        if ("+" in level and level != "+") or ("#" in level and (level != "#" or n != len(levels) - 1)):
            return False
    return True


_TOPIC_NAMES: dict[bytes, tuple[str, tuple[str, str] | None]] = {}
TOPIC_NAME_CACHE = 65_536
"""PUBLISH topics already read and found valid, with their :func:`input_topic` reading (cleared
when full; see :func:`_topic_name`)."""


def _topic_name(raw: bytes) -> tuple[str, tuple[str, str] | None]:
    """A PUBLISH's topic name (strict MQTT UTF-8, no NUL, no wildcard, else :class:`MalformedFrame`)
    and its :func:`input_topic` reading. Remembered, since every app publishes on the same few
    topics over and over: a PUBLISH costs one lookup of its topic's bytes."""
    topic = decode_str(raw)
    if not valid_topic_name(topic):
        raise MalformedFrame("bad topic name")
    if len(_TOPIC_NAMES) >= TOPIC_NAME_CACHE:
        _TOPIC_NAMES.clear()
    entry = _TOPIC_NAMES[raw] = topic, input_topic(topic)
    return entry


def topic_matches(flt: str, topic: str) -> bool:
    """MQTT topic-filter matching (``+`` one level, ``#`` the rest, parent included)."""
    f, t = flt.split("/"), topic.split("/")
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(t) or (level != "+" and level != t[i]):
            return False
    return len(f) == len(t)


class _Session:
    """What survives a connection with clean session off: subscriptions, unacknowledged and queued
    QoS 1 messages, QoS 2 packet ids awaiting PUBREL. In memory only."""

    __slots__ = (
        "clean",
        "client_id",
        "conn",
        "expiry",
        "inflight",
        "inflight_bytes",
        "next_pid",
        "qos2",
        "queue",
        "queued_bytes",
        "server",
        "subscriptions",
        "user",
    )

    def __init__(self, server: MqttServer, user: str | None, client_id: str, clean: bool) -> None:
        self.server = server
        self.user = user
        self.client_id = client_id
        self.clean = clean
        self.conn: _Connection | None = None
        self.subscriptions: dict[str, int] = {}
        self.inflight: dict[int, tuple[str, bytes]] = {}
        self.inflight_bytes = 0
        self.queue: deque[tuple[str, bytes, bool]] = deque()
        self.queued_bytes = 0
        self.next_pid = 0
        self.qos2: dict[int, asyncio.Future[object] | None] = {}
        self.expiry: asyncio.TimerHandle | None = None

    def deliver(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        server = self.server
        if qos == 0:  # never queued: sent if the socket keeps up, else dropped (offline: silently)
            conn = self.conn
            if conn is not None:
                if conn.congested():
                    server._count_drop("slow_subscriber")
                else:
                    conn.write(encode_publish(topic, payload, qos=0, pid=0, retain=retain))
            return
        self.queue.append((topic, payload, retain))
        self.queued_bytes += len(payload)
        while len(self.queue) > server.max_queued_messages or self.queued_bytes > server.max_queued_bytes:
            _, dropped, _ = self.queue.popleft()
            self.queued_bytes -= len(dropped)
            server._count_drop("queue_full")
        self.pump()

    def pump(self) -> None:
        """Send queued QoS 1 messages while the in-flight window and the socket allow."""
        conn = self.conn
        server = self.server
        while (
            self.queue
            and conn is not None
            and len(self.inflight) < server.max_inflight_messages
            and self.inflight_bytes < server.max_inflight_bytes
            and not conn.congested()
        ):
            topic, payload, retain = self.queue.popleft()
            self.queued_bytes -= len(payload)
            pid = self._new_pid()
            self.inflight[pid] = (topic, payload)
            self.inflight_bytes += len(payload)
            conn.write(encode_publish(topic, payload, qos=1, pid=pid, retain=retain))

    def acked(self, pid: int) -> None:
        msg = self.inflight.pop(pid, None)
        if msg is not None:
            self.inflight_bytes -= len(msg[1])
            self.pump()

    def resend(self) -> None:
        """Retransmit every unacknowledged message with DUP set (a persistent session came back)."""
        conn = self.conn
        assert conn is not None
        for pid, (topic, payload) in self.inflight.items():
            conn.write(encode_publish(topic, payload, qos=1, pid=pid, retain=False, dup=True))
        self.pump()

    def _new_pid(self) -> int:
        while True:
            self.next_pid = self.next_pid % 65535 + 1
            if self.next_pid not in self.inflight:
                return self.next_pid


_WAIT_CONNECT, _OPEN, _CLOSED = 0, 1, 2


class _Connection(asyncio.Protocol):
    """One client's network connection (asyncio protocol: every packet of a chunk parsed at once)."""

    def __init__(self, server: MqttServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _WAIT_CONNECT
        self.session: _Session | None = None
        self.user: str | None = None
        self.will: tuple[str, bytes, bool] | None = None
        self.keepalive_s = 0
        self.last_rx = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None
        self.skip = 0  # bytes of an oversize PUBLISH still to discard as they arrive
        self.acks: deque[tuple[int, int, asyncio.Future[object] | None]] = deque()
        self.ack_wait: asyncio.Future[object] | None = None
        self.reading_paused = False
        self.writing_paused = False
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.counted = False
        self.closed: asyncio.Future[None] = self.loop.create_future()

    # -- transport callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)
        bound_socket_reads(transport)
        server = self.server
        if len(server._conns) >= server.max_connections:
            server._refused("too_many_connections")
            self.state = _CLOSED
            self.transport.abort()
            return
        server._conns.add(self)
        self.transport.set_write_buffer_limits(high=server.write_buffer_bytes)
        self.timer = self.loop.call_later(server.connect_timeout_s, self._connect_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        server = self.server
        server._conns.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.state == _OPEN:
            self._publish_will()
        self.state = _CLOSED
        self.out.clear()
        if self.counted:
            server.metrics.mqtt_connections.dec()
            self.counted = False
        session, self.session = self.session, None
        if session is not None and session.conn is self:
            server._detach(session)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.session is not None:
            self.session.pump()

    def data_received(self, data: bytes) -> None:
        if self.state == _CLOSED:
            return
        self.last_rx = self.loop.time()
        if self.skip:
            n = min(self.skip, len(data))
            self.skip -= n
            if n == len(data):
                return
            data = data[n:]
        self.buf += data
        try:
            self._process()
        except (ValueError, IndexError):  # MalformedFrame, or a field that overruns its packet
            self.close("malformed")

    # -- inbound --------------------------------------------------------------------------------
    def _limit(self) -> int:
        return self.server.max_packet_bytes if self.state == _OPEN else MAX_CONNECT_BYTES

    def _process(self) -> None:
        buf = self.buf
        while self.state != _CLOSED:
            frames, pos = split_frames(buf, MAX_REMAINING_LENGTH)
            limit = self._limit()
            for first, i, end in frames:
                if end - i > limit:
                    self._oversize(first, i, end - i)
                elif first >> 4 == PUBLISH and self.state == _OPEN:  # most packets: straight to it
                    self._on_publish(first, i, end)
                else:
                    self._packet(first, i, end)
                    limit = self._limit()  # a CONNECT raises it
                if self.state == _CLOSED:
                    return
            del buf[:pos]
            head = read_header(buf, 0) if buf else None
            if head is None:
                return
            length, hlen = head
            if length <= self._limit():
                return
            # An oversize packet is never buffered whole: read its topic and packet id, then skip it.
            if buf[0] >> 4 != PUBLISH or self.state != _OPEN:
                raise MalformedFrame("oversize packet")
            if publish_head(buf, buf[0], hlen, hlen + length, len(buf)) is None:
                return  # its topic and packet id are not all here yet (at most 64 KiB)
            total = hlen + length
            self._oversize(buf[0], hlen, length)
            self.skip = max(0, total - len(buf))
            del buf[: min(len(buf), total)]

    def _oversize(self, first: int, i: int, length: int) -> None:
        """A PUBLISH over ``max_packet_bytes``: dropped ``too_large`` and acknowledged."""
        if first >> 4 != PUBLISH or self.state != _OPEN:
            raise MalformedFrame("oversize packet")
        qos = (first >> 1) & 3
        if qos == 3:
            raise MalformedFrame("QoS 3")
        topic, pos = read_str(self.buf, i, i + length)
        if not valid_topic_name(topic):
            raise MalformedFrame("bad topic name")
        if qos:
            pid = read_u16(self.buf, pos, i + length)
            self._ack(PUBACK if qos == 1 else PUBREC, pid, None)
        parsed = input_topic(topic)
        if parsed is not None:
            own = self.user is None or parsed[1] == self.user
            self.server.dropped(topic, "too_large" if own else "forbidden")
        else:
            self.server._count_drop("topic_not_allowed")

    def _packet(self, first: int, i: int, end: int) -> None:
        kind = first >> 4
        if self.state == _WAIT_CONNECT:
            if kind != CONNECT:
                raise MalformedFrame("first packet is not CONNECT")
            self._on_connect(i, end)
            return
        if kind == PUBLISH:
            self._on_publish(first, i, end)
        elif kind == PUBACK:
            if self.session is not None:
                self.session.acked(read_u16(self.buf, i, end))
        elif kind == PUBREL:
            pid = read_u16(self.buf, i, end)
            if self.session is not None:
                self.session.qos2.pop(pid, None)
            self._ack(PUBCOMP, pid, None)
        elif kind in (SUBSCRIBE, UNSUBSCRIBE):
            if first & 0x0F != 2:
                raise MalformedFrame("SUBSCRIBE flags")
            if kind == SUBSCRIBE:
                self._on_subscribe(i, end)
            else:
                self._on_unsubscribe(i, end)
        elif kind == PINGREQ:
            self.write(PINGRESP_PACKET)
        elif kind == DISCONNECT:  # a clean end: no will
            self.will = None
            self.close("client")
        else:
            raise MalformedFrame("unexpected packet")

    def _on_connect(self, i: int, end: int) -> None:
        buf, server = self.buf, self.server
        name, pos = read_str(buf, i, end)
        if name not in ("MQTT", "MQIsdp") or pos + 4 > end:
            raise MalformedFrame("not an MQTT CONNECT")
        level, flags = buf[pos], buf[pos + 1]
        keepalive = read_u16(buf, pos + 2, end)
        pos += 4
        if level != PROTOCOL_LEVEL:
            self._refuse(UNACCEPTABLE_PROTOCOL, "protocol_version")
            return
        will_flag, will_qos, will_retain = flags & 0x04, (flags >> 3) & 3, flags & 0x20
        if flags & 0x01 or will_qos == 3 or (not will_flag and (will_qos or will_retain)):
            raise MalformedFrame("connect flags")
        if flags & 0x40 and not flags & 0x80:
            raise MalformedFrame("password without user name")
        clean = bool(flags & 0x02)
        client_id, pos = read_str(buf, pos, end)
        will: tuple[str, bytes, bool] | None = None
        if will_flag:
            will_topic, pos = read_str(buf, pos, end)
            will_payload, pos = read_bytes(buf, pos, end)
            if not valid_topic_name(will_topic):
                raise MalformedFrame("bad will topic")
            will = (will_topic, will_payload, bool(will_retain))
        username: str | None = None
        password: bytes | None = None
        if flags & 0x80:
            username, pos = read_str(buf, pos, end)
        if flags & 0x40:
            password, pos = read_bytes(buf, pos, end)
        if pos != end:
            raise MalformedFrame("trailing bytes in CONNECT")
        user: str | None = None
        if server.tokens is not None:
            if username is None or password is None:
                self._refuse(NOT_AUTHORIZED, "not_authorized")
                return
            try:
                ok = server.tokens.check(username, password.decode("utf-8"))
            except UnicodeDecodeError:
                ok = False
            if not ok:
                self._refuse(BAD_CREDENTIALS, "bad_credentials")
                return
            user = username
        if not client_id:
            if not clean:
                self._refuse(IDENTIFIER_REJECTED, "identifier_rejected")
                return
            client_id = f"kcloak-auto-{secrets.token_hex(8)}"
        if len(client_id) > server.max_client_id_chars:
            self._refuse(IDENTIFIER_REJECTED, "identifier_rejected")
            return
        owner = server._owners.get(client_id, user)
        if owner != user:
            # Another user's client id (connected or a stored session): never a takeover.
            self._refuse(IDENTIFIER_REJECTED, "identifier_rejected")
            return
        session, present = server._open_session(user, client_id, clean)
        if session is None:
            self._refuse(SERVER_UNAVAILABLE, "too_many_sessions")
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.user, self.will, self.keepalive_s = user, will, keepalive
        self.state = _OPEN
        self.session = session
        session.conn = self
        self.counted = True
        server.metrics.mqtt_connections.inc()
        self.write(encode_connack(present, ACCEPTED))
        if keepalive:
            self.timer = self.loop.call_later(keepalive * 1.5, self._check_keepalive)
        session.resend()

    def _refuse(self, code: int, reason: str) -> None:
        self.server._refused(reason)
        self.write(encode_connack(False, code))
        self.close("refused")

    def _on_publish(self, first: int, i: int, end: int) -> None:
        qos, retain = (first >> 1) & 3, bool(first & 1)
        if qos == 3:
            raise MalformedFrame("QoS 3")
        buf = self.buf
        if i + 2 > end:
            raise MalformedFrame("truncated")
        pos = i + 2 + ((buf[i] << 8) | buf[i + 1])
        if pos > end:
            raise MalformedFrame("field beyond the packet")
        raw = bytes(buf[i + 2 : pos])
        entry = _TOPIC_NAMES.get(raw)
        if entry is None:
            entry = _topic_name(raw)
        pid = 0
        if qos:
            pid = read_u16(self.buf, pos, end)
            if pid == 0:
                raise MalformedFrame("packet id 0")
            pos += 2
        session = self.session
        assert session is not None
        if qos == 2 and pid in session.qos2:  # a retransmission before PUBREL: delivered once only
            self._ack(PUBREC, pid, session.qos2[pid])
            return
        fut = self.server._route(self.user, entry[0], entry[1], bytes(buf[pos:end]), retain)
        if qos == 1:
            self._ack(PUBACK, pid, fut)
        elif qos == 2:
            session.qos2[pid] = fut
            self._ack(PUBREC, pid, fut)

    def _on_subscribe(self, i: int, end: int) -> None:
        buf, server = self.buf, self.server
        pid = read_u16(buf, i, end)
        pos = i + 2
        granted: list[tuple[str, int]] = []
        codes = bytearray()
        while pos < end:
            flt, pos = read_str(buf, pos, end)
            if pos >= end or buf[pos] & 0xFC:
                raise MalformedFrame("SUBSCRIBE options")
            requested = buf[pos]
            pos += 1
            if valid_topic_filter(flt) and server.may_subscribe(self.user, flt):
                qos = min(requested, 1)
                granted.append((flt, qos))
                codes.append(qos)
            else:
                server.metrics.mqtt_subscriptions_refused.inc()
                codes.append(0x80)
        if not codes:
            raise MalformedFrame("empty SUBSCRIBE")
        self.write(encode_suback(pid, bytes(codes)))
        session = self.session
        assert session is not None
        for flt, qos in granted:
            server._subscribe(session, flt, qos)
            for topic, payload in server._retained.items():
                if topic_matches(flt, topic):
                    session.deliver(topic, payload, qos, retain=True)

    def _on_unsubscribe(self, i: int, end: int) -> None:
        pid = read_u16(self.buf, i, end)
        pos = i + 2
        filters: list[str] = []
        while pos < end:
            flt, pos = read_str(self.buf, pos, end)
            filters.append(flt)
        if not filters:
            raise MalformedFrame("empty UNSUBSCRIBE")
        assert self.session is not None
        for flt in filters:
            self.server._unsubscribe(self.session, flt)
        self.write(encode_packet(UNSUBACK, 0, struct.pack("!H", pid)))

    # -- acknowledgements, in arrival order (MQTT 3.1.1 §4.6) -----------------------------------
    def _ack(self, kind: int, pid: int, fut: asyncio.Future[object] | None) -> None:
        if not self.acks and (fut is None or fut.done()):
            if fut is not None and not self._durable(fut):
                return
            self.write(encode_ack(kind, pid))
            return
        self.acks.append((kind, pid, fut))
        if len(self.acks) == 1:
            self._flush_acks()
        if len(self.acks) > self.server.max_pending_acks and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _flush_acks(self) -> None:
        out = bytearray()
        acks = self.acks
        while acks:
            kind, pid, fut = acks[0]
            if fut is not None:
                if not fut.done():
                    if self.ack_wait is not fut:
                        self.ack_wait = fut
                        fut.add_done_callback(self._ack_ready)
                    break
                if not self._durable(fut):
                    return
            acks.popleft()
            out += encode_ack(kind, pid)
        if out:
            self.write(bytes(out))
        if self.reading_paused and len(acks) <= self.server.max_pending_acks // 2 and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def _ack_ready(self, fut: asyncio.Future[object]) -> None:
        if self.ack_wait is fut:
            self.ack_wait = None
        if self.state != _CLOSED:
            self._flush_acks()

    def _durable(self, fut: asyncio.Future[object]) -> bool:
        """False (and the connection closed, unacknowledged) if kcloak could not make it durable."""
        if fut.cancelled() or fut.exception() is not None:
            self.close("dispatch_failed")
            return False
        return True

    # -- outbound -------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Queue bytes; everything written in one event-loop turn leaves in one system call."""
        if self.state == _CLOSED and not self.out:
            return
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out.append(data)
        self.out_bytes += len(data)

    def _flush(self) -> None:
        out, self.out = self.out, []
        self.out_bytes = 0
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))
            session = self.session
            if session is not None and session.queue and self.state == _OPEN:
                session.pump()  # the window was limited by what one turn may write

    def congested(self) -> bool:
        return self.writing_paused or self.out_bytes > self.server.write_buffer_bytes

    # -- ending ---------------------------------------------------------------------------------
    def close(self, reason: str) -> None:
        """Close after sending what is queued (CONNACK refusals, acknowledgements); unless the
        client said DISCONNECT, its will is published."""
        if self.state == _CLOSED:
            return
        if self.state == _OPEN:
            if reason != "client":
                self._publish_will()
            self.server.metrics.mqtt_disconnects.labels(reason=reason).inc()
        self.state = _CLOSED
        self._flush()
        if self.transport is not None:
            self.transport.close()

    def takeover(self) -> None:
        """The same user connected again with this client id: close without will (MQTT 3.1.1 §3.1.4)."""
        self.will = None
        self.session = None
        self.close("takeover")

    def _publish_will(self) -> None:
        will, self.will = self.will, None
        if will is not None:
            topic, payload, retain = will
            self.server._route(self.user, topic, input_topic(topic), payload, retain)

    def _connect_timeout(self) -> None:
        self.timer = None
        if self.state == _WAIT_CONNECT:
            self.server._refused("timeout")
            self.state = _CLOSED
            if self.transport is not None:
                self.transport.abort()

    def _check_keepalive(self) -> None:
        limit = self.keepalive_s * 1.5
        idle = self.loop.time() - self.last_rx
        if idle >= limit and not self.reading_paused:
            self.timer = None
            self.close("keepalive")
        else:
            self.timer = self.loop.call_later(max(limit - idle, 0.1), self._check_keepalive)


_INPUT_TOPICS: dict[str, tuple[str, str] | None] = {}
INPUT_TOPIC_CACHE = 65_536
"""Topics whose reading :func:`input_topic` remembers (cleared when full): every app publishes on
the same few topics, over and over."""


def input_topic(topic: str) -> tuple[str, str] | None:
    """(kind, user) of an input topic ``kcloak/v1/{kind}/{user}``; None for any other topic (the
    user level is returned as sent, unvalidated)."""
    try:
        return _INPUT_TOPICS[topic]
    except KeyError:
        pass
    parts = topic.split("/")
    if len(parts) != 4 or parts[0] != "kcloak" or parts[1] != "v1" or parts[2] not in INPUT_KINDS:
        known = None
    else:
        known = parts[2], parts[3]
    if len(_INPUT_TOPICS) >= INPUT_TOPIC_CACHE:
        _INPUT_TOPICS.clear()
    _INPUT_TOPICS[topic] = known
    return known


class MqttServer:
    """kcloak's embedded MQTT 3.1.1 server (async context manager).

    Keyword arguments:
    ``host`` ("127.0.0.1") and ``port`` (1883; 0 picks a free one, then read :attr:`port`);
    ``tokens``: a :class:`TokenStore` (user name = user id, password = token), or None for open mode;
    ``published_readers``: users who may subscribe to ``kcloak/v1/published/#`` (with tokens);
    ``dispatch(topic, payload, retain)``: called with every input message in arrival order; returns
    None (acknowledge now) or an awaitable done once the message is durable (acknowledged then);
    ``dropped(topic, reason)``: an input message dropped here (``too_large``, ``retained``, ``forbidden``);
    ``max_packet_bytes`` (1 MiB + 64 KiB): larger PUBLISHes are skipped unbuffered, ``too_large``;
    ``connect_timeout_s`` (10): time from TCP accept to a complete CONNECT;
    ``max_connections`` (10,000); ``max_sessions_per_user`` (64, with tokens) and ``max_sessions``
    (100,000) stored sessions; ``session_expiry_s`` (3,600): an offline persistent session's lifetime;
    ``max_queued_messages`` (1,000) and ``max_queued_bytes`` (16 MiB) per session, oldest dropped;
    ``max_inflight_messages`` (1,000) / ``max_inflight_bytes`` (8 MiB) unacknowledged per session;
    ``write_buffer_bytes`` (1 MiB) per socket before a subscriber counts as slow;
    ``max_pending_acks`` (10,000) acknowledgements waiting per connection before reading pauses;
    ``metrics``: the broker's :class:`Metrics` (a private one if None).

    Entering binds at once (``OSError`` if the port is in use); leaving closes every connection.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 1883,
        tokens: TokenStore | None = None,
        published_readers: frozenset[str] = frozenset(),
        dispatch: Dispatch,
        dropped: Callable[[str, str], None],
        max_packet_bytes: int = 1024 * 1024 + 64 * 1024,
        connect_timeout_s: float = 10.0,
        max_connections: int = 10_000,
        max_sessions_per_user: int = 64,
        max_sessions: int = 100_000,
        session_expiry_s: float = 3600.0,
        max_queued_messages: int = 1000,
        max_queued_bytes: int = 16 * 1024 * 1024,
        max_inflight_messages: int = 1000,
        max_inflight_bytes: int = 8 * 1024 * 1024,
        write_buffer_bytes: int = 1024 * 1024,
        max_pending_acks: int = 10_000,
        max_client_id_chars: int = 256,
        metrics: Metrics | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.tokens = tokens
        self.published_readers = published_readers
        self.dispatch = dispatch
        self.dropped = dropped
        self.max_packet_bytes = max_packet_bytes
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.max_sessions_per_user = max_sessions_per_user
        self.max_sessions = max_sessions
        self.session_expiry_s = session_expiry_s
        self.max_queued_messages = max_queued_messages
        self.max_queued_bytes = max_queued_bytes
        self.max_inflight_messages = max_inflight_messages
        self.max_inflight_bytes = max_inflight_bytes
        self.write_buffer_bytes = write_buffer_bytes
        self.max_pending_acks = max_pending_acks
        self.max_client_id_chars = max_client_id_chars
        self.metrics = metrics or Metrics(version=__version__, algorithm="none")
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()
        self._sessions: dict[tuple[str | None, str], _Session] = {}
        self._owners: dict[str, str | None] = {}
        self._user_sessions: dict[str | None, int] = {}
        self._exact: dict[str, dict[_Session, int]] = {}
        self._wild: dict[str, dict[_Session, int]] = {}
        self._retained: dict[str, bytes] = {}

    async def __aenter__(self) -> MqttServer:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, self.port, reuse_address=True)
        sockets = self._server.sockets or ()
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log_event(log, "mqtt_server_listening", port=self.port, auth="tokens" if self.tokens is not None else "open")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        conns = list(self._conns)
        for conn in conns:
            conn.will = None
            conn.close("server_stopped")
        waits = [c.closed for c in conns if not c.closed.done()]
        if waits:
            await asyncio.wait(waits, timeout=2.0)
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.abort()
        for session in self._sessions.values():
            if session.expiry is not None:
                session.expiry.cancel()
        self._sessions.clear()
        self._owners.clear()
        self._exact.clear()
        self._wild.clear()
        await server.wait_closed()

    @property
    def listening(self) -> bool:
        return self._server is not None

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Deliver kcloak's own message to every matching subscription (QoS ≤ 1, as granted);
        ``retain`` keeps it for later subscriptions (an empty payload clears it)."""
        if retain:
            if payload:
                self._retained[topic] = payload
            else:
                self._retained.pop(topic, None)
        targets: dict[_Session, int] = {}
        exact = self._exact.get(topic)
        if exact:
            targets.update(exact)
        for flt, subs in self._wild.items():
            if topic_matches(flt, topic):
                for session, qos in subs.items():
                    if qos > targets.get(session, -1):
                        targets[session] = qos
        for session, qos in targets.items():
            session.deliver(topic, payload, qos, retain=False)

    # -- ACL (contract §3) -----------------------------------------------------------------------
    def may_subscribe(self, user: str | None, flt: str) -> bool:
        """Whether ``user`` (None: open mode) may subscribe to ``flt``: only output topics, and with
        tokens only the user's own answers and status, the broker status, and published data for
        ``published_readers``. A wildcard is granted only if it can match nothing but output topics."""
        levels = flt.split("/")
        if len(levels) < 4 or levels[0] != "kcloak" or levels[1] != "v1":
            return False
        kind, rest = levels[2], levels[3:]
        if kind in ("answer", "status") and len(rest) == 1:
            who = rest[0]
            if user is None:
                return who == "+" or valid_user_id(who)
            return who == user
        if kind == "broker":
            return rest == ["status"]
        if kind == "published":
            return user is None or user in self.published_readers
        return False

    def _route(
        self, user: str | None, topic: str, parsed: tuple[str, str] | None, payload: bytes, retain: bool
    ) -> asyncio.Future[object] | None:
        """An app's PUBLISH (or will) on ``topic`` (``parsed``: its :func:`input_topic` reading):
        input topics of its own user go to ``dispatch``, nothing else goes anywhere."""
        if parsed is None:
            self._count_drop("topic_not_allowed")
            return None
        if user is not None and parsed[1] != user:
            self.dropped(topic, "forbidden")
            return None
        if retain:
            self.dropped(topic, "retained")
            return None
        try:
            result = self.dispatch(topic, payload, False)
        except Exception as exc:  # dispatch promises not to raise; a bug must not end the connection
            log_event(log, "mqtt_dispatch_failed", logging.ERROR, error=type(exc).__name__)
            return None
        if result is None:
            return None
        return result if isinstance(result, asyncio.Future) else asyncio.ensure_future(result)

    # -- sessions --------------------------------------------------------------------------------
    def _open_session(self, user: str | None, client_id: str, clean: bool) -> tuple[_Session | None, bool]:
        """The session for a CONNECT (None: over a session limit) and whether one was resumed."""
        key = (user, client_id)
        old = self._sessions.get(key)
        if old is not None:
            if old.conn is not None:
                old.conn.takeover()
                old.conn = None
            if old.expiry is not None:
                old.expiry.cancel()
                old.expiry = None
            if not clean and not old.clean:
                return old, True
            self._remove_session(old)
        if len(self._sessions) >= self.max_sessions or (
            user is not None and self._user_sessions.get(user, 0) >= self.max_sessions_per_user
        ):
            oldest = next((s for s in self._sessions.values() if s.conn is None and s.user == user), None)
            if oldest is None:
                return None, False
            self._remove_session(oldest)
        session = _Session(self, user, client_id, clean)
        self._sessions[key] = session
        self._owners[client_id] = user
        self._user_sessions[user] = self._user_sessions.get(user, 0) + 1
        return session, False

    def _detach(self, session: _Session) -> None:
        """The session's connection ended: a clean session ends with it, a persistent one waits."""
        session.conn = None
        if session.clean:
            self._remove_session(session)
        elif self._server is not None:
            session.expiry = asyncio.get_running_loop().call_later(self.session_expiry_s, self._remove_session, session)

    def _remove_session(self, session: _Session) -> None:
        key = (session.user, session.client_id)
        if self._sessions.get(key) is not session:
            return
        del self._sessions[key]
        if self._owners.get(session.client_id, session.user) == session.user:
            self._owners.pop(session.client_id, None)
        n = self._user_sessions.get(session.user, 1) - 1
        if n:
            self._user_sessions[session.user] = n
        else:
            self._user_sessions.pop(session.user, None)
        if session.expiry is not None:
            session.expiry.cancel()
            session.expiry = None
        for flt in list(session.subscriptions):
            self._unsubscribe(session, flt)
        session.queue.clear()
        session.inflight.clear()

    def _subscribe(self, session: _Session, flt: str, qos: int) -> None:
        session.subscriptions[flt] = qos
        index = self._wild if ("+" in flt or "#" in flt) else self._exact
        index.setdefault(flt, {})[session] = qos

    def _unsubscribe(self, session: _Session, flt: str) -> None:
        if session.subscriptions.pop(flt, None) is None:
            return
        index = self._wild if ("+" in flt or "#" in flt) else self._exact
        subs = index.get(flt)
        if subs is not None:
            subs.pop(session, None)
            if not subs:
                del index[flt]

    # -- counters --------------------------------------------------------------------------------
    def _refused(self, reason: str) -> None:
        self.metrics.mqtt_connects_refused.labels(reason=reason).inc()

    def _count_drop(self, reason: str) -> None:
        self.metrics.mqtt_server_dropped.labels(reason=reason).inc()
