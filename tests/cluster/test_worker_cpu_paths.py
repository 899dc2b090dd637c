"""The worker's cheaper per-message paths (docs/cluster.md "CPU per message") keep their guarantees: nats-py header
parsing gives the same headers, a micro-batch's PubAcks collected together give each event's stream sequence (and a
publish that cannot be stored raises), and a member pinned for the first time does not read again, one by one,
the messages its own pull delivered (catch-up only for what a predecessor may hold)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from kcloak.broker.cluster import pinned
from kcloak.broker.cluster.pinned import Delivered, PinnedMember, PubAcks, parse_header_lines
from kcloak.broker.cluster.topology import (
    CELLS_STREAM,
    IN_STREAM,
    JetStreamApiError,
    Layout,
    cell_subject,
    ensure_layout,
    in_filter,
    in_subject,
)

nats = pytest.importorskip("nats")

HEADER_BLOCKS = [
    b"Nats-Msg-Id: a/1\r\nKcloak-Transport: mqtt\r\nNats-Pin-Id: XYZ\r\n\r\n",
    b"Name:Value\r\nName2:\tValue2 \r\n",
    b"Bad Name: skipped\r\nGood: kept\r\n",
    b"Tab\tName: skipped\r\nFs\x1cName: skipped\r\nEnd\x1f: skipped\r\n",
    b"\xffbad: x\r\nok: \xff\xfe\r\n",
    b": empty name\r\nno colon here\r\n\r\n  Spaced  :  v  \r\n",
    b"",
    b"\r\n\r\n",
    b"Dup: 1\r\nDup: 2\r\n",
]


def test_header_parsing_gives_nats_py_headers() -> None:
    from nats.aio.client import Client

    original = pinned.NATS_HEADER_PARSER.get("original") or Client._parse_header_lines
    assert original is not parse_header_lines
    for raw in HEADER_BLOCKS:
        assert parse_header_lines(raw) == original(raw), raw
    assert pinned.install_fast_header_parsing()
    assert Client._parse_header_lines(HEADER_BLOCKS[0]) == original(HEADER_BLOCKS[0])


@pytest.mark.cluster
def test_pubacks_of_a_batch_give_each_event_its_stream_sequence(nats_cluster: Any) -> None:
    async def scenario() -> None:
        layout = Layout(partitions=1, cells=1, replicas=3, pinned_timeout_s=2.0)
        nc = await nats.connect(servers=nats_cluster.urls)
        await ensure_layout(nc, layout)
        acks = PubAcks(nc)
        sent = []
        for i in range(30):
            subject, data, msg_id = cell_subject(0, 0, f"t{i}"), f"{i}".encode(), f"ev/{i}"
            fut = await acks.send(subject, data, stream=CELLS_STREAM, msg_id=msg_id)
            sent.append((fut, subject, data, CELLS_STREAM, msg_id))
        seqs = await acks.settle(sent, keep_trying=lambda: False)
        assert seqs == sorted(seqs) and len(set(seqs)) == 30
        js = nc.jetstream()
        for seq, (_, subject, data, _, _) in zip(seqs, sent, strict=True):
            stored = await js.get_msg(CELLS_STREAM, seq, direct=False)
            assert (stored.subject, stored.data) == (subject, data)
        again = await acks.send(sent[0][1], sent[0][2], stream=CELLS_STREAM, msg_id="ev/0")  # same id: stored once
        assert (
            await acks.settle([(again, sent[0][1], sent[0][2], CELLS_STREAM, "ev/0")], keep_trying=lambda: False)
        ) == [seqs[0]]
        assert (await js.stream_info(CELLS_STREAM)).state.messages == 30
        lost = await acks.send("kcloak.nowhere.x", b"x", stream=CELLS_STREAM, msg_id="nowhere/1")
        with pytest.raises((JetStreamApiError, nats.errors.Error)):  # no stream stores it: never reported as stored
            await acks.settle([(lost, "kcloak.nowhere.x", b"x", CELLS_STREAM, "nowhere/1")], keep_trying=lambda: False)
        assert isinstance(lost.exception(), JetStreamApiError)
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.cluster
def test_fresh_pin_hands_over_each_message_once_without_reading_it_again(nats_cluster: Any) -> None:
    async def scenario() -> None:
        layout = Layout(partitions=1, cells=1, replicas=3, pinned_timeout_s=2.0)
        nc = await nats.connect(servers=nats_cluster.urls)
        await ensure_layout(nc, layout)
        js = nc.jetstream()
        published = [
            (await js.publish(in_subject(0, "update", f"u{i % 4}"), str(i).encode(), stream=IN_STREAM)).seq
            for i in range(60)
        ]
        seen: list[int] = []

        async def handle(batch: list[Delivered]) -> None:
            for msg in batch:
                seen.append(msg.seq)
                await m.ack(msg)

        m = PinnedMember(
            nc, IN_STREAM, "in-0", handler=handle, lease_s=1.0, catch_up=True, filter_subject=in_filter(0), batch=16
        )
        task = asyncio.create_task(m.run())
        deadline = time.monotonic() + 15
        while len(seen) < 60 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert seen == published, "every message once, in stream order"
        assert m.counters["catch_up"] == 0 and m.counters["skipped"] == 0, m.counters
        await m.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.cluster
def test_slow_hand_over_keeps_the_buffer_near_one_batch(nats_cluster: Any) -> None:
    """A member whose handler is behind pulls no more than about a batch ahead: a buffer that grows by one message
    per pull round trip keeps messages past ack_wait, and they come again (a second apply of each)."""

    async def scenario() -> None:
        layout = Layout(partitions=1, cells=1, replicas=3, pinned_timeout_s=2.0)
        nc = await nats.connect(servers=nats_cluster.urls)
        await ensure_layout(nc, layout)
        js = nc.jetstream()
        for i in range(150):
            await js.publish(in_subject(0, "update", f"u{i % 4}"), str(i).encode(), stream=IN_STREAM)
        seen: list[int] = []
        most = 0

        async def handle(batch: list[Delivered]) -> None:
            nonlocal most
            for msg in batch:
                seen.append(msg.seq)
                await m.ack(msg)
            await asyncio.sleep(0.1)
            most = max(most, m._buffered)

        m = PinnedMember(nc, IN_STREAM, "in-0", handler=handle, lease_s=1.0, expires_s=0.5, batch=8)
        task = asyncio.create_task(m.run())
        deadline = time.monotonic() + 20
        while len(seen) < 150 and time.monotonic() < deadline:
            most = max(most, m._buffered)
            await asyncio.sleep(0.01)
        assert len(seen) == 150 and m.pinned, "every message, the pin kept (the lease needs answered pulls)"
        assert most <= 2 * 8, f"{most} messages buffered for a batch of 8"
        await m.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
