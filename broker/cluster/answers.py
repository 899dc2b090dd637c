"""A query's one answer in ``KCLOAK_ANSWERS`` (docs/cluster.md "Workers"), stored and read back.

Whoever decides a query (the router for a refusal, the cell owner otherwise) stores the answer under message id
``<token>/<qkey>``: the stream's duplicate window keeps the first one. Then, when the query came with a
``Kcloak-Reply`` (the inbox of the gateway waiting for it), the *stored* answer is sent there on core NATS: the
answer just published, or, when its PubAck said ``duplicate`` (an earlier attempt stored one first), the one the
stream holds. A gateway that misses that reply reads the stream (:func:`read_answer`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kcloak.broker.cluster.pinned import DuplicateSeq, PubAcks
from kcloak.broker.cluster.topology import ANSWERS_STREAM, answer_msg_id, answer_subject

READ_TIMEOUT_S = 2.0


async def read_answer(nc: Any, token: str, qkey: str, *, timeout: float = READ_TIMEOUT_S) -> bytes | None:
    """The stored answer of query ``qkey`` of user ``token`` (a direct get), None when none is stored; raises
    nats-py's errors (timeout, no responders) when the stream cannot be read."""
    reply = await nc.request(
        f"$JS.API.DIRECT.GET.{ANSWERS_STREAM}",
        json.dumps({"last_by_subj": answer_subject(token, qkey)}).encode(),
        timeout=timeout,
    )
    if (reply.headers or {}).get("Status"):
        return None  # 404: no message on that subject
    return bytes(reply.data)


async def store_answer(
    acks: PubAcks,
    nc: Any,
    token: str,
    qkey: str,
    data: bytes,
    *,
    reply: str | None,
    keep_trying: Callable[[], bool],
) -> None:
    """Store ``data`` as the query's answer (once: its message id), then send the stored answer to ``reply``."""
    seq = await acks.publish(
        answer_subject(token, qkey),
        data,
        stream=ANSWERS_STREAM,
        msg_id=answer_msg_id(token, qkey),
        keep_trying=keep_trying,
    )
    if reply:
        await send_stored(nc, token, qkey, reply, None if isinstance(seq, DuplicateSeq) else data)


async def send_stored(nc: Any, token: str, qkey: str, reply: str, data: bytes | None = None) -> None:
    """Send the query's stored answer (``data`` when the caller knows it is the stored one) to ``reply``; nothing
    when the stream cannot be read (the gateway reads it itself once its wait is over)."""
    if data is None:
        try:
            data = await read_answer(nc, token, qkey)
        except Exception:
            return
    if data is not None:
        await nc.publish(reply, data)


__all__ = ["read_answer", "send_stored", "store_answer"]
