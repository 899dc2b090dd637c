"""Large batches of fixes are handed to the pipeline in chunks (``Pipeline.submit_fix_batch``):
the outcome is that of one call, and other work runs between the chunks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kcloak.broker.intake import FIX_CHUNK
from kcloak.broker.service import Broker
from kcloak.core.profile import ReasonCode


def _expected(items: list[tuple[str, dict[str, Any]]]) -> list[str | None]:
    """Per-fix outcome, modelled independently: invalid latitude, else out of order unless newer
    than the user's last accepted fix."""
    last: dict[str, float] = {}
    out: list[str | None] = []
    for user, fix in items:
        if not -90 <= fix["lat"] <= 90:
            out.append(ReasonCode.INVALID.value)
        elif user in last and fix["t"] <= last[user]:
            out.append(ReasonCode.OUT_OF_ORDER.value)
        else:
            last[user] = fix["t"]
            out.append(None)
    return out


async def test_a_chunked_batch_has_the_outcome_of_one_call(http_broker: Broker) -> None:
    pipeline = http_broker.pipeline
    assert pipeline is not None
    now = time.time()
    n_users = 700
    items: list[tuple[str, dict[str, Any]]] = []
    for i in range(3 * FIX_CHUNK + 17):  # users come back in later chunks, some with older fixes
        appearance = i // n_users
        t = now - 60.0 if i % 5 == 0 and appearance else now - 50.0 + 10.0 * appearance
        lat = 100.0 if i % 97 == 0 else 39.9 + (i % 100) * 1e-4
        items.append((f"u{i % n_users}", {"t": t, "lat": lat, "lon": 116.4 + appearance * 1e-3}))
    result = await pipeline.submit_fix_batch("http", items)
    expected = _expected(items)
    assert [c.value if c is not None else None for c in result.codes] == expected
    assert expected.count(ReasonCode.OUT_OF_ORDER.value) > 0 and expected.count(ReasonCode.INVALID.value) > 0
    final: dict[str, dict[str, Any]] = {}
    for (user, fix), code in zip(items, expected, strict=True):
        if code is None:
            final[user] = fix
    for user, fix in final.items():  # the index holds each user's last accepted fix
        got = pipeline.index.fix(user)
        assert got is not None and (got[0], got[1]) == (fix["lat"], fix["lon"])


async def test_other_work_runs_between_the_chunks(http_broker: Broker) -> None:
    pipeline = http_broker.pipeline
    assert pipeline is not None
    now = time.time() - 10
    n = 4 * FIX_CHUNK
    items = [(f"v{i}", {"t": now, "lat": 39.9, "lon": 116.4}) for i in range(n)]
    seen: list[int] = []

    async def probe() -> None:
        await asyncio.sleep(0)
        # fixes validated so far, stored or still being stored (one chunk, not the batch)
        seen.append(sum(pipeline.intake._last_t(user) is not None for user, _ in items))

    batch = asyncio.create_task(pipeline.submit_fix_batch("http", items))
    await asyncio.gather(batch, probe())
    assert all(c is None for c in batch.result().codes)
    assert seen and 0 < seen[0] < n


async def test_a_later_small_batch_never_overtakes_an_earlier_large_one(http_broker: Broker) -> None:
    """A small batch sent right after a large one is validated after every chunk of it: the users'
    newer fixes are accepted, never judged ``out_of_order`` against the older ones still queued."""
    pipeline = http_broker.pipeline
    assert pipeline is not None
    now = time.time() - 30
    users = [f"o{i}" for i in range(3 * FIX_CHUNK)]
    large = [(u, {"t": now, "lat": 39.9, "lon": 116.4}) for u in users]
    small = [(u, {"t": now + 1, "lat": 39.91, "lon": 116.41}) for u in users[-FIX_CHUNK // 2 :]]
    results = await asyncio.gather(pipeline.submit_fix_batch("mqtt", large), pipeline.submit_fix_batch("http", small))
    assert [[c for c in r.codes if c is not None] for r in results] == [[], []]
    first, last = pipeline.index.fix(users[0]), pipeline.index.fix(users[-1])
    assert first is not None and first[:2] == (39.9, 116.4)
    assert last is not None and last[:2] == (39.91, 116.41)
