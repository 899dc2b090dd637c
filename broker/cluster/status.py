"""What ``kcloak cluster status`` shows: streams, pinned consumers, pending per partition and cell, the ledger.

Read-only: it asks the JetStream API (``STREAM.INFO``, ``CONSUMER.LIST``) and reads the ledger bucket; it creates
nothing. Counts and names only: no payload, user id or position is ever read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kcloak.broker.cluster.topology import (
    ANSWERS_STREAM,
    CELLS_STREAM,
    IN_STREAM,
    MOVES_STREAM,
    PUBLISHED_STREAM,
    WINDOWS_BUCKET,
    JetStreamApiError,
    api_request,
    connect_nats,
)
from kcloak.broker.publication import Window

STREAMS = (IN_STREAM, CELLS_STREAM, ANSWERS_STREAM, MOVES_STREAM, PUBLISHED_STREAM)
CONSUMER_NAME = re.compile(r"^(in|cell)-([0-9]+)\Z")


def _pinned(info: dict[str, Any]) -> str | None:
    """The pinned client id of a consumer's priority group, if one is pinned."""
    for group in info.get("priority_groups") or []:
        if isinstance(group, dict) and group.get("pinned_client_id"):
            return str(group["pinned_client_id"])
    return None


async def stream_rows(nc: Any, *, timeout: float = 5.0) -> list[dict[str, Any]]:
    """One row per kcloak stream: messages, bytes, consumers, leader, replicas (``missing`` if not created)."""
    rows: list[dict[str, Any]] = []
    for name in STREAMS:
        try:
            info = await api_request(nc, f"STREAM.INFO.{name}", None, timeout=timeout)
        except JetStreamApiError:
            rows.append({"stream": name, "state": "missing"})
            continue
        state = info.get("state") or {}
        cluster = info.get("cluster") or {}
        replicas = cluster.get("replicas") or []
        rows.append(
            {
                "stream": name,
                "state": "ok",
                "messages": int(state.get("messages", 0)),
                "bytes": int(state.get("bytes", 0)),
                "consumers": int(state.get("consumer_count", 0)),
                "leader": cluster.get("leader"),
                "current_replicas": sum(1 for r in replicas if isinstance(r, dict) and r.get("current")),
                "replicas": int((info.get("config") or {}).get("num_replicas", 1)),
            }
        )
    return rows


async def consumer_rows(nc: Any, *, timeout: float = 5.0) -> list[dict[str, Any]]:
    """One row per pinned consumer (``in-<p>``, ``cell-<c>``): pending, unacknowledged, pinned client."""
    rows: list[dict[str, Any]] = []
    for stream in (IN_STREAM, CELLS_STREAM):
        offset = 0
        while True:
            try:
                page = await api_request(nc, f"CONSUMER.LIST.{stream}", {"offset": offset}, timeout=timeout)
            except JetStreamApiError:
                break
            consumers = page.get("consumers") or []
            for info in consumers:
                name = str(info.get("name", ""))
                m = CONSUMER_NAME.match(name)
                if m is None:
                    continue
                rows.append(
                    {
                        "consumer": name,
                        "kind": "partition" if m.group(1) == "in" else m.group(1),
                        "index": int(m.group(2)),
                        "pending": int(info.get("num_pending", 0)),
                        "ack_pending": int(info.get("num_ack_pending", 0)),
                        "pinned": _pinned(info),
                    }
                )
            offset += len(consumers)
            if not consumers or offset >= int(page.get("total", 0)):
                break
    order = {"partition": 0, "cell": 1}
    rows.sort(key=lambda r: (order[str(r["kind"])], int(r["index"])))
    return rows


async def ledger_rows(nc: Any, *, limit: int = 10, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The ledger's last ``limit`` windows (newest first): state, coordinator, hash prefix, counts, reason."""
    from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError

    js = nc.jetstream(timeout=timeout)
    try:
        kv = await js.key_value(WINDOWS_BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError):
        return []
    windows = sorted((w for w in (Window.parse(k) for k in keys) if w is not None), key=lambda w: -w.t_start)
    rows = []
    for w in windows[:limit]:
        try:
            entry = await kv.get(w.window_id)
        except KeyNotFoundError:
            continue
        if entry.value is None:
            continue
        value = json.loads(entry.value)
        rows.append(
            {
                "window_id": w.window_id,
                "state": value.get("state"),
                "coordinator": value.get("coordinator"),
                "t": value.get("t"),
                "hash": (value.get("hash") or "")[:12] or None,
                "parts": value.get("parts"),
                "n_out": value.get("n_out"),
                "reason": value.get("reason"),
            }
        )
    return rows


async def cluster_status(servers: list[str], *, windows: int = 10, timeout: float = 5.0) -> dict[str, Any]:
    """Connect to ``servers`` and return ``{"servers", "streams", "consumers", "windows"}``."""
    nc = await connect_nats(servers, timeout=timeout, reconnect=False)
    try:
        return {
            "servers": list(servers),
            "connected": str(nc.connected_url.geturl()) if nc.connected_url else None,
            "streams": await stream_rows(nc, timeout=timeout),
            "consumers": await consumer_rows(nc, timeout=timeout),
            "windows": await ledger_rows(nc, limit=windows, timeout=timeout),
        }
    finally:
        await nc.close()


__all__ = ["cluster_status", "consumer_rows", "ledger_rows", "stream_rows"]
