"""Single fixes that reach the broker together (many connections, one turn of its event loop) are
answered each with its own outcome, and a 200 ``accepted`` means stored: read back from the
movement database by SQL, as a client-side auditor would, right after the answers arrive."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from kcloak.broker.service import Broker
from tests.broker.test_http_fix_then_query import _answer, _post

USERS = 12
Request = tuple[str, dict[str, object]]


async def _send_together(port: int, requests: list[Request]) -> list[tuple[int, dict[str, object]]]:
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in requests]
    for (_, writer), (path, body) in zip(conns, requests, strict=True):
        writer.write(_post(path, body))  # every request leaves in this one turn of the test's loop
    await asyncio.gather(*(writer.drain() for _, writer in conns))
    answers = [await _answer(reader) for reader, _ in conns]
    for _, writer in conns:
        writer.close()
        await writer.wait_closed()
    return answers


async def _metric(port: int, needle: str) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    text = (await reader.read()).decode()
    writer.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(needle))


async def test_fixes_sent_together_get_their_own_outcomes_and_the_accepted_ones_are_stored(
    http_broker: Broker, tmp_path: Path
) -> None:
    port = http_broker.http_port
    assert port is not None
    now = time.time()
    requests: list[Request] = []
    for u in range(USERS):
        user = f"together{u}"
        # Two fixes of the user on two connections at once: whichever the broker reads first, the
        # newer one is accepted, the older one accepted or out_of_order, never both stored out of order.
        for j, t in enumerate((now - 2.0, now - 1.0)):
            requests.append((f"/v1/users/{user}/location", {"t": t, "lat": 30.0 + u + j / 10, "lon": 116.4}))
        requests.append((f"/v1/users/{user}/location", {"t": now - 400 * 86400, "lat": 45.0, "lon": 116.4}))
        requests.append((f"/v1/users/{user}/location", {"t": now + 3600, "lat": 46.0, "lon": 116.4}))
    accepted_before = await _metric(port, 'kcloak_updates_accepted_total{source="update",transport="http"}')
    answers = await _send_together(port, requests)

    accepted: dict[str, set[float]] = {}
    for (path, body), (status, answer) in zip(requests, answers, strict=True):
        user, sent_t = path.split("/")[3], body["t"]
        assert isinstance(sent_t, float)
        t = sent_t
        if t > now + 60:
            assert status == 400 and answer["error"] == {
                "code": "invalid",
                "message": "t: more than max_clock_skew_s in the future",
                "field": "t",
            }
        elif t < now - 86400:
            assert (status, answer) == (200, {"accepted": 0, "rejected": [{"index": 0, "code": "too_old"}]})
        elif answer == {"accepted": 1, "rejected": []}:
            assert status == 200
            accepted.setdefault(user, set()).add(t)
        else:
            assert (status, answer) == (200, {"accepted": 0, "rejected": [{"index": 0, "code": "out_of_order"}]})
            assert t == now - 2.0  # only the older fix of a user can arrive out of order
    assert all(now - 1.0 in ts for ts in accepted.values()) and len(accepted) == USERS

    # Answered 200 means committed: the movement database holds exactly the accepted fixes.
    db = Path(http_broker.config.storage.data_dir) / "movement.sqlite3"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT user_id, t FROM fixes WHERE user_id LIKE 'together%'").fetchall()
    stored: dict[str, set[float]] = {}
    for user, t in rows:
        stored.setdefault(user, set()).add(t)
    assert stored == accepted and len(rows) == sum(map(len, accepted.values()))
    accepted_after = await _metric(port, 'kcloak_updates_accepted_total{source="update",transport="http"}')
    assert accepted_after - accepted_before == len(rows)
