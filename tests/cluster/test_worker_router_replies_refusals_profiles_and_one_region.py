"""One Worker object on a real 3-node cluster: what the router decides itself and what a retry forwards.

- a fix message with ``Kcloak-Reply`` gets ``{"kind":"fixes","codes":[…]}`` there: accepted (null), then
  ``out_of_order`` for an older fix, ``invalid`` for a batch item of another partition's user;
- a profile message stores the profile (KV ``kcloak_profiles``) and replies ``ok`` with it; a bad one
  replies ``refused``/``invalid``;
- a continuous query, and every query with a held algorithm (``clique``), is answered ``unsupported``;
  a query of a user without a fix is ``stale_position``;
- the region recorded for a query is the one a retried query forwards (create-only, first one wins).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kcloak.broker.cluster.owner import region_json, region_key
from kcloak.broker.cluster.topology import Layout, subject_token
from kcloak.broker.cluster.worker import Worker
from kcloak.broker.config import Config
from kcloak.broker.metrics import Metrics
from kcloak.cloaking.cells import CellMap
from kcloak.cloaking.cloakers import Region
from kcloak.core.geometry import BBox
from tests.cluster.worker_fixtures import App, partition

pytestmark = pytest.mark.cluster
nats = pytest.importorskip("nats")

P = 2


def worker(urls: list[str], tmp: Path, algorithm: str = "hilbert") -> Worker:
    config = Config()
    config = dataclasses.replace(
        config,
        cloaking=dataclasses.replace(config.cloaking, algorithm=algorithm),
        upstream=dataclasses.replace(config.upstream, url="http://127.0.0.1:9"),
        storage=dataclasses.replace(config.storage, data_dir=str(tmp)),
    )
    layout = Layout(partitions=P, cells=1, replicas=3, pinned_timeout_s=2.0)
    return Worker(
        servers=urls,
        layout=layout,
        cells=CellMap([]),
        config=config,
        metrics=Metrics(version="t", algorithm=algorithm),
        name="w",
        spread_s=0.0,
    )


async def request(app: App, user: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    inbox = app.nc.new_inbox()
    sub = await app.nc.subscribe(inbox)
    app.counter += 1
    await app.js.publish(
        f"kcloak.in.{partition(user, P)}.{kind}.{subject_token(user)}",
        json.dumps(body).encode(),
        stream="KCLOAK_IN",
        headers={"Nats-Msg-Id": f"r/{app.counter}", "Kcloak-Transport": "http", "Kcloak-Reply": inbox},
    )
    msg = await sub.next_msg(timeout=10)
    await sub.unsubscribe()
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def answer(app: App, user: str, qid: str) -> dict[str, Any]:
    await app.publish(user, "query", {"query_id": qid, "kind": "knn", "n": 1, "continuous": qid.startswith("c")})
    deadline = time.monotonic() + 10
    while (got := await app.answer(user, qid)) is None:
        assert time.monotonic() < deadline, "no answer"
        await asyncio.sleep(0.1)
    return got


def test_router_replies_refuses_stores_profiles_and_a_retry_reuses_the_region(
    nats_cluster: Any, tmp_path: Path
) -> None:
    async def scenario() -> None:
        w = worker(nats_cluster.urls, tmp_path)
        await w.start()
        nc = await nats.connect(servers=nats_cluster.urls)
        app = App(nc, P)
        now = time.time()
        alice = "alice.a"
        other = next(u for u in (f"bob{i}" for i in range(50)) if partition(u, P) != partition(alice, P))
        got = await request(app, alice, "update", {"t": now, "lat": 39.9, "lon": 116.4})
        assert got == {"kind": "fixes", "codes": [None]}
        got = await request(app, alice, "update", {"t": now - 1, "lat": 39.9, "lon": 116.4})
        assert got["codes"] == ["out_of_order"]
        batch = {"updates": [{"t": now + 1, "lat": 39.9, "lon": 116.4}, {"user": other, "t": now, "lat": 1, "lon": 1}]}
        got = await request(app, alice, "updates", batch)
        assert got["codes"] == [None, "invalid"]
        got = await request(app, alice, "profile", {"profile": {"k": 7}, "request_id": "p1"})
        assert got["status"] == "ok" and got["profile"]["k"] == 7 and got["request_id"] == "p1"
        entry = await (await app.js.key_value("kcloak_profiles")).get(subject_token(alice))
        assert json.loads(entry.value)["k"] == 7
        got = await request(app, alice, "profile", {"profile": {"k": "seven"}})
        assert got["status"] == "refused" and got["reason"] == "invalid"
        refused = await answer(app, alice, "c1")
        assert refused["status"] == "refused" and refused["reason"] == "unsupported"
        stale = await answer(app, "nobody", "q1")
        assert stale["reason"] == "stale_position"
        # a first attempt of a query recorded its region: a retry gets that one back, never its own
        owner = w.owners[0]
        first = Region(
            bbox=BBox(116_000_000, 39_000_000, 116_100_000, 39_100_000), k_achieved=9, area_m2=1.0, algorithm="hilbert"
        )
        second = Region(
            bbox=BBox(116_200_000, 39_200_000, 116_300_000, 39_300_000), k_achieved=5, area_m2=2.0, algorithm="hilbert"
        )
        assert await owner._record_region("alice//a", "q9", first) == first
        reused = await owner._record_region("alice//a", "q9", second)
        assert reused.bbox == first.bbox and reused.k_achieved == 9
        kv = await app.js.key_value("kcloak_regions")
        assert (await kv.get(region_key("alice//a", "q9"))).value == region_json(first)
        await w.stop()
        # a held algorithm: every query unsupported
        w2 = worker(nats_cluster.urls, tmp_path, algorithm="clique")
        await w2.start()
        await request(app, "carol", "update", {"t": time.time(), "lat": 39.9, "lon": 116.4})
        held = await answer(app, "carol", "q2")
        assert held["status"] == "refused" and held["reason"] == "unsupported"
        await w2.stop()
        await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
