"""Window publication exactly once, with a ledger in NATS KV (issue 15, docs/cluster.md "Window publication").

The ledger key of a window is its id (``<t_start>-<t_end>``) in bucket ``kcloak_windows``; its value is one
JSON object whose ``state`` moves forward only, each step a compare-and-set on the key's revision (KV
``create`` for the first, ``update(last=revision)`` after):

``started`` (coordinator, time) → ``anonymized`` (content hash, parts; the release itself in object store
``kcloak_window_content`` under ``<window id>/<hash>``) → ``published`` (content hash, parts, counts);
or ``started`` → ``refused`` (reason: ``trash_exceeded``, ``too_few_trajectories``…; nothing published).

A coordinator that dies at any point and is started again (or another one, once the lease of the dead one has
expired) continues from the ledger: after ``started`` it anonymizes anew (nothing was published yet); after
``anonymized`` it publishes the **stored** release, never a recomputed one (two different releases of one
window could be intersected), resuming after the last part already in stream ``KCLOAK_PUBLISHED`` (each part
carries its number and the content hash; message ids ``<window id>/<hash>/<part>`` make a repeated publish a
no-op within the duplicate window). ``published`` and ``refused`` are final: nothing is done again. Once
published, the window's stored releases (this attempt's and those of attempts that died before the ledger
named them) are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kcloak import __version__
from kcloak.broker.cluster.topology import PUBLISHED_STREAM, WINDOW_CONTENT_BUCKET, WINDOWS_BUCKET, published_subject
from kcloak.broker.errors import BrokerError
from kcloak.broker.publication import PART_ROWS, Window, WindowStatus, window_parts
from kcloak.core.logs import log_event
from kcloak.streams.partitioned import refusal_reason
from kcloak.streams.publish import Release

log = logging.getLogger("kcloak.cluster.publication")

STAGES = ("started", "stored", "anonymized", "part-1", "sent")
"""Points at which a test can make the coordinator SIGKILL itself (``crash_at``): after the ledger says
``started``; after the release is stored but before the ledger says so; after ``anonymized``; after the first
part is in the stream; after every part, before the ledger says ``published``."""

CRASH_ENV = "KCLOAK_PUBLISH_CRASH_AT"
"""Environment variable naming one of :data:`STAGES` (for crash tests only)."""

CONTENT_FORMAT = "kcloak.window-content/1"
PART_HEADER = "Kcloak-Part"
HASH_HEADER = "Kcloak-Content-Hash"


class LedgerState:
    STARTED = "started"
    ANONYMIZED = "anonymized"
    PUBLISHED = "published"
    REFUSED = "refused"
    FINAL = frozenset({PUBLISHED, REFUSED})


class PublicationConflict(BrokerError, RuntimeError):
    """The ledger or the stream disagrees with what this coordinator would publish: it publishes nothing."""


class WindowBusy(BrokerError, RuntimeError):
    """Another coordinator holds the window (its lease has not expired) or took it over meanwhile."""


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """What the ledger says after :meth:`WindowCoordinator.publish`; ``acted`` is false when it was final already."""

    window_id: str
    state: str
    content_hash: str | None
    parts: int
    acted: bool
    reason: str | None = None


def content_hash(parts: list[bytes]) -> str:
    """SHA-256 over the parts, each prefixed by its length (so a cut between parts changes the hash)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def window_report(window: Window, release: Release, *, published_t: float) -> dict[str, Any]:
    """The window's report (as the single-process publisher's JSON file), with the refusal reason if any."""
    report: dict[str, Any] = {
        "kcloak_version": __version__,
        "window_id": window.window_id,
        "t_start": window.t_start,
        "t_end": window.t_end,
        "published_t": published_t,
        "status": (WindowStatus.PUBLISHED if release.ok else WindowStatus.EMPTY).value,
        **release.report,
    }
    return report


class WindowCoordinator:
    """Publishes windows exactly once over a connected ``nats.aio.client.Client`` (layout already ensured).

    ``name`` identifies this coordinator in the ledger; ``lease_s``: a window ``started`` or ``anonymized`` by
    another coordinator whose last ledger write is older than this is taken over (a live coordinator renews
    its lease while it anonymizes). ``crash_at``: one of :data:`STAGES`, for crash tests. ``part_rows``: rows
    per published part at most (:data:`~kcloak.broker.publication.PART_ROWS`).
    """

    def __init__(
        self,
        nc: Any,
        *,
        name: str,
        lease_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        crash_at: str | None = None,
        timeout: float = 10.0,
        part_rows: int = PART_ROWS,
    ) -> None:
        if crash_at is not None and crash_at not in STAGES:
            raise ValueError(f"crash_at: must be one of {', '.join(STAGES)}")
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout)
        self.name = name
        self.lease_s = lease_s
        self.clock = clock
        self.crash_at = crash_at
        self.part_rows = part_rows
        self._kv: Any = None
        self._obj: Any = None

    async def _stores(self) -> tuple[Any, Any]:
        if self._kv is None:
            self._kv = await self.js.key_value(WINDOWS_BUCKET)
            self._obj = await self.js.object_store(WINDOW_CONTENT_BUCKET)
        return self._kv, self._obj

    def _crash(self, stage: str) -> None:
        if self.crash_at == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    # -- the ledger ------------------------------------------------------------------------------
    async def entry(self, window_id: str) -> tuple[dict[str, Any] | None, int]:
        """The ledger value of a window and its revision (``(None, 0)`` when absent)."""
        from nats.js.errors import KeyNotFoundError

        kv, _ = await self._stores()
        try:
            got = await kv.get(window_id)
        except KeyNotFoundError:
            return None, 0
        if got.value is None:
            return None, int(got.revision or 0)
        value: dict[str, Any] = json.loads(got.value)
        return value, int(got.revision)

    async def _write(self, window_id: str, value: dict[str, Any], revision: int) -> int:
        """Compare-and-set: write ``value`` only if the key is still at ``revision`` (0: absent)."""
        from nats.js.errors import KeyWrongLastSequenceError

        kv, _ = await self._stores()
        data = json.dumps(value, separators=(",", ":")).encode()
        try:
            if revision == 0:
                return int(await kv.create(window_id, data))
            return int(await kv.update(window_id, data, last=revision))
        except KeyWrongLastSequenceError:
            raise WindowBusy(f"window {window_id}: the ledger changed meanwhile (another coordinator)") from None

    async def _claim(self, window_id: str) -> tuple[dict[str, Any] | None, int]:
        """Take the window (create ``started``, or take over an expired or own entry); None when final."""
        entry, revision = await self.entry(window_id)
        now = self.clock()
        if entry is None:
            value = {"state": LedgerState.STARTED, "coordinator": self.name, "t": now, "attempt": 1}
            return value, await self._write(window_id, value, revision)
        if entry.get("state") in LedgerState.FINAL:
            return None, revision
        if entry.get("coordinator") != self.name and now - float(entry.get("t", 0.0)) < self.lease_s:
            raise WindowBusy(f"window {window_id}: held by another coordinator (lease {self.lease_s:g} s)")
        value = {**entry, "coordinator": self.name, "t": now, "attempt": int(entry.get("attempt", 1)) + 1}
        revision = await self._write(window_id, value, revision)
        log_event(log, "window_taken_over", window_id=window_id, state=str(entry.get("state")))
        return value, revision

    # -- one window ------------------------------------------------------------------------------
    async def publish(self, window: Window, compute: Callable[[], Awaitable[Release]]) -> WindowOutcome:
        """Publish ``window`` exactly once; ``compute`` anonymizes it (called only when nothing is stored yet)."""
        wid = window.window_id
        value, revision = await self._claim(wid)
        if value is None:
            final, _ = await self.entry(wid)
            assert final is not None
            return WindowOutcome(
                wid, final["state"], final.get("hash"), int(final.get("parts", 0)), False, final.get("reason")
            )
        if value["state"] == LedgerState.STARTED:
            self._crash("started")
            release, revision = await self._compute_renewing(wid, value, revision, compute)
            report = window_report(window, release, published_t=self.clock())
            refusal = refusal_reason(release)
            if refusal is not None:
                refused = {
                    "state": LedgerState.REFUSED,
                    "coordinator": self.name,
                    "t": self.clock(),
                    **refusal,
                }
                await self._write(wid, refused, revision)
                log_event(log, "window_refused", logging.WARNING, window_id=wid, reason=refusal["reason"])
                return WindowOutcome(wid, LedgerState.REFUSED, None, 0, True, str(refusal["reason"]))
            parts = window_parts(wid, report, release.table, part_rows=self.part_rows)
            digest = content_hash(parts)
            await self._store(wid, digest, report, parts)
            self._crash("stored")
            value = {
                "state": LedgerState.ANONYMIZED,
                "coordinator": self.name,
                "t": self.clock(),
                "attempt": value.get("attempt", 1),
                "hash": digest,
                "parts": len(parts),
                "n_in": int(report["n_in"]),
                "n_out": int(report["n_out"]),
                "n_trash": int(report["n_trash"]),
            }
            revision = await self._write(wid, value, revision)
            self._crash("anonymized")
        digest = str(value["hash"])
        parts = await self._load(wid, digest)
        if len(parts) != int(value["parts"]):
            raise PublicationConflict(f"window {wid}: stored release does not match the ledger")
        await self._send(wid, digest, parts)
        self._crash("sent")
        done = {**value, "state": LedgerState.PUBLISHED, "coordinator": self.name, "t": self.clock()}
        await self._write(wid, done, revision)
        log_event(log, "window_published", window_id=wid, parts=len(parts), n_out=int(value.get("n_out", 0)))
        await self._forget(wid)
        return WindowOutcome(wid, LedgerState.PUBLISHED, digest, len(parts), True)

    async def _compute_renewing(
        self, wid: str, value: dict[str, Any], revision: int, compute: Callable[[], Awaitable[Release]]
    ) -> tuple[Release, int]:
        """Run ``compute`` while renewing the lease every third of it (a lost lease aborts: WindowBusy)."""
        task = asyncio.ensure_future(compute())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.lease_s / 3)
                if done:
                    return task.result(), revision
                value = {**value, "t": self.clock()}
                revision = await self._write(wid, value, revision)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _store(self, wid: str, digest: str, report: dict[str, Any], parts: list[bytes]) -> None:
        _, obj = await self._stores()
        doc = {"format": CONTENT_FORMAT, "window_id": wid, "report": report, "parts": [p.decode() for p in parts]}
        await obj.put(f"{wid}/{digest}", json.dumps(doc, separators=(",", ":")).encode())

    async def _load(self, wid: str, digest: str) -> list[bytes]:
        """The stored release's parts, checked against the ledger's hash."""
        _, obj = await self._stores()
        got = await obj.get(f"{wid}/{digest}")
        doc = json.loads(got.data)
        parts = [p.encode() for p in doc["parts"]]
        if doc.get("format") != CONTENT_FORMAT or content_hash(parts) != digest:
            raise PublicationConflict(f"window {wid}: stored release does not match the ledger's hash")
        return parts

    async def stored_names(self, wid: str) -> list[str]:
        """Names of the releases of ``wid`` in the content store (this attempt's and any earlier one's)."""
        _, obj = await self._stores()
        try:
            infos = await obj.list(ignore_deletes=True)
        except Exception as exc:  # nats-py raises NotFoundError for an empty store
            if type(exc).__name__ != "NotFoundError":
                raise
            return []
        return [info.name for info in infos if info.name.startswith(f"{wid}/") and not info.deleted]

    async def _forget(self, wid: str) -> None:
        """Remove the window's stored releases once it is published (the stream holds it now); best effort:
        a leftover is harmless, the ledger never points at it again."""
        _, obj = await self._stores()
        try:
            for name in await self.stored_names(wid):
                await obj.delete(name)
        except Exception as exc:
            log_event(log, "window_content_kept", logging.WARNING, window_id=wid, error=type(exc).__name__)

    async def published_parts(self, wid: str) -> tuple[int, str | None]:
        """The last part of ``wid`` in the stream and its content hash (``(0, None)``: none yet)."""
        from nats.js.errors import NotFoundError

        try:
            msg = await self.js.get_last_msg(PUBLISHED_STREAM, published_subject(wid))
        except NotFoundError:
            return 0, None
        headers = msg.headers or {}
        number = int(str(headers.get(PART_HEADER, "0/0")).split("/")[0])
        return number, headers.get(HASH_HEADER)

    async def _send(self, wid: str, digest: str, parts: list[bytes]) -> None:
        """Publish the parts not yet in the stream, in order, each acknowledged (PubAck) before the next."""
        last, last_hash = await self.published_parts(wid)
        if last and last_hash != digest:
            raise PublicationConflict(f"window {wid}: the stream holds parts of another release")
        for number in range(last + 1, len(parts) + 1):
            headers = {
                "Nats-Msg-Id": f"{wid}/{digest[:32]}/{number}",
                PART_HEADER: f"{number}/{len(parts)}",
                HASH_HEADER: digest,
            }
            await self.js.publish(published_subject(wid), parts[number - 1], headers=headers)
            self._crash(f"part-{number}")


__all__ = [
    "CRASH_ENV",
    "STAGES",
    "LedgerState",
    "PublicationConflict",
    "WindowBusy",
    "WindowCoordinator",
    "WindowOutcome",
    "content_hash",
]
