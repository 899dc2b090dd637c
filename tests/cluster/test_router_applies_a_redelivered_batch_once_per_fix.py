"""A gateway's intake ``batch`` (several users' fix messages of one partition in one intake message,
docs/cluster.md "Envelope") redelivered after a router failover: the fixes its predecessor applied are
accepted without a second event, the others are applied, and a user's two fixes in one message are both
applied (each fix is known by its intake sequence and its position in the message). A profile stored before
the router was pinned reaches the user's fix event (the router reads its partition's profiles at rebuild).

The predecessor is played by this test: it publishes the cell events a router that died half-way through
the batch would have left (the documented event format, ``in`` = intake sequence, ``i`` = position), then a
real :class:`Worker` is pinned, rebuilds and gets the batch. Read back: the last event of each user's cell
subject (``KCLOAK_CELLS`` keeps one per subject) with its stream sequence, and every ``KCLOAK_MOVES`` record
(one per applied fix).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kcloak.broker.cluster.topology import ensure_layout
from tests.cluster.worker_fixtures import one_cell_worker, partition, token

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")

P = 2


async def last_event(js: Any, user: str) -> tuple[int, dict[str, Any]]:
    msg = await js.get_msg("KCLOAK_CELLS", subject=f"kcloak.cell.0.0.{token(user)}")
    return int(msg.seq), json.loads(msg.data)


async def moves(js: Any) -> list[tuple[str, float]]:
    """``(user token, lat)`` of every move: a message is ``{"m": [[token, t, lat, lon], …]}``."""
    info = await js.stream_info("KCLOAK_MOVES")
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        out += [(m[0], m[2]) for m in json.loads((await js.get_msg("KCLOAK_MOVES", seq=seq)).data)["m"]]
    return out


def test_a_redelivered_batch_applies_exactly_the_fixes_not_yet_applied(nats_cluster: Any, tmp_path: Path) -> None:
    ann, ben, cat = (next(u for u in (f"{name}{i}" for i in range(99)) if partition(u, P) == 0) for name in "abc")

    async def scenario() -> None:
        nc = await nats.connect(servers=nats_cluster.urls)
        second = one_cell_worker(nats_cluster.urls, tmp_path)
        await ensure_layout(nc, second.layout)  # the streams and consumers, no member pulling yet
        js = nc.jetstream(timeout=10)
        t = time.time()
        fix = {ann: (t, 39.90), ben: (t, 39.91), cat: (t, 39.92)}
        parts = [
            {"user": token(ann), "kind": "update", "body": {"t": t, "lat": 39.90, "lon": 116.4}},
            {"user": token(ben), "kind": "update", "body": {"t": t, "lat": 39.91, "lon": 116.4}},
            {"user": token(ann), "kind": "updates", "body": {"updates": [{"t": t + 1, "lat": 39.93, "lon": 116.4}]}},
            {"user": token(cat), "kind": "update", "body": {"t": t, "lat": 39.92, "lon": 116.4}},
        ]
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        ack = await js.publish(
            f"kcloak.in.0.batch.{token(ann)}",
            json.dumps({"batch": parts}).encode(),
            stream="KCLOAK_IN",
            headers={"Nats-Msg-Id": "gw/1", "Kcloak-Transport": "http", "Kcloak-Reply": inbox},
        )
        # the predecessor applied the batch's first two fixes (ann's at position 0, ben's at 1), then died
        seeded = {}
        for i, user in enumerate((ann, ben)):
            body = {"e": "fix", "t": fix[user][0], "lat": fix[user][1], "lon": 116.4, "in": ack.seq, "i": i}
            subject = f"kcloak.cell.0.0.{token(user)}"
            seeded[user] = (await js.publish(subject, json.dumps(body).encode(), stream="KCLOAK_CELLS")).seq
        # cat's profile, stored before this router was pinned: read with the partition's profiles at its rebuild
        await (await js.key_value("kcloak_profiles")).put(token(cat), json.dumps({"k": 7}).encode())
        await second.start()
        try:
            reply = json.loads((await sub.next_msg(timeout=20)).data)
            assert reply["codes"] == [None, None, None, None]
            # ben: applied before the failover, not again (his subject's last event is the seeded one)
            seq, event = await last_event(js, ben)
            assert seq == seeded[ben] and (event["lat"], event["in"], event["i"]) == (39.91, ack.seq, 1)
            # ann: her first fix was applied before; her second (position 2) now
            seq, event = await last_event(js, ann)
            assert seq > seeded[ann] and (event["lat"], event["t"], event["in"], event["i"]) == (
                39.93,
                t + 1,
                ack.seq,
                2,
            )
            # cat: not applied before, applied now
            _, event = await last_event(js, cat)
            assert (event["lat"], event["in"], event["i"], event["k"]["k"]) == (39.92, ack.seq, 3, 7)
            assert "k" not in (await last_event(js, ann))[1]  # no stored profile: the default, no "k"
            # the movement history got exactly the fixes applied now, once each
            assert sorted(await moves(js)) == sorted([(token(ann), 39.93), (token(cat), 39.92)])
            assert second.status()["counters"]["router"]["redelivered"] == 2
        finally:
            await second.stop()
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 90))
