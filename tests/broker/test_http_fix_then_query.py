"""HTTP single fixes, read as a client sees them: a query sees its user's fix sent just before it, even
while that fix is still being committed (contract §1: a query waits for the fixes of its user
received before it); the body is JSON by its media type however the header spells it."""

from __future__ import annotations

import asyncio
import json
import time

from kcloak.broker.service import Broker


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, object]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    return int(lines[0].split()[1]), json.loads(await reader.readexactly(length))


async def test_query_right_behind_a_fix_on_another_connection_sees_it(http_broker: Broker) -> None:
    port = http_broker.http_port
    for i in range(20):  # each round a new user, with no fix before this one
        user = f"fresh{i}"
        fix_conn = await asyncio.open_connection("127.0.0.1", port)
        query_conn = await asyncio.open_connection("127.0.0.1", port)
        # Both requests leave in the same turn of this loop: the broker reads them together, the
        # query while the fix is still on its way to the movement store.
        fix_conn[1].write(_post(f"/v1/users/{user}/location", {"t": time.time(), "lat": 39.9, "lon": 116.4}))
        query_conn[1].write(_post(f"/v1/users/{user}/query", {"query_id": f"q{i}", "kind": "knn", "n": 1}))
        await asyncio.gather(fix_conn[1].drain(), query_conn[1].drain())
        fix_status, fix_body = await _answer(fix_conn[0])
        query_status, answer = await _answer(query_conn[0])
        assert fix_status == 200 and fix_body == {"accepted": 1, "rejected": []}
        # Alone, the user cannot be cloaked; but the broker knew where it was: never stale_position.
        assert query_status == 200 and answer.get("reason") != "stale_position", answer
        for _, writer in (fix_conn, query_conn):
            writer.close()
            await writer.wait_closed()


async def test_a_fix_is_taken_as_json_by_its_media_type_whatever_its_spelling(http_broker: Broker) -> None:
    """``application/json`` with parameters or in another case is JSON; any other type is 415."""
    reader, writer = await asyncio.open_connection("127.0.0.1", http_broker.http_port)
    cases = [
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
        ("text/plain", 415),
        ("application/jsonx", 415),
        ("application/json-patch+json", 415),
    ]
    for i, (ctype, status) in enumerate(cases):
        data = json.dumps({"t": time.time(), "lat": 39.9, "lon": 116.4}).encode()
        head = f"POST /v1/users/media{i}/location HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
        writer.write(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got, body = await _answer(reader)
        assert got == status, (ctype, body)
        if status == 415:
            refusal = {"code": "unsupported_media_type", "message": "Content-Type must be application/json"}
            assert body["error"] == refusal
    writer.close()
    await writer.wait_closed()
