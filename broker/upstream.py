"""The client of the upstream LBS provider (contract §5; CONCEPTS §1.1).

Every request is rebuilt from an allow-list — a fresh 128-bit pseudonym, the region, the kind
and its parameters — and every attempt, retries included, carries a new pseudonym. Headers are
fixed for all users, cookies are never kept, one connection pool serves everyone. Attempts
time out after ``timeout_s``; connection errors, timeouts, 5xx and 429 are retried (full-jitter
exponential backoff) within an overall ``deadline_s``; anything else fails at once. Responses
are checked strictly before the broker filters them.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kcloak import __version__
from kcloak.broker.errors import BrokerError
from kcloak.broker.metrics import Metrics
from kcloak.core.places import Poi
from kcloak.wire.http_client import HttpConnectionError, HttpPool, HttpProtocolError, HttpTimeout, Origin
from kcloak.wire.payloads import parse_json_object

if TYPE_CHECKING:
    from kcloak.broker.config import UpstreamConfig

MAX_RESPONSE_BYTES = 16 * 1024 * 1024


class UpstreamError(BrokerError, RuntimeError):
    """The provider failed after the retries (answer reason ``upstream_error``)."""


Candidate = Poi
"""One POI of the provider's answer: the same record as a POI of the places layer."""


@dataclass(frozen=True, slots=True)
class SearchRequest:
    """What may be sent upstream, and nothing more (contract §5)."""

    kind: str
    bbox: list[float]
    radius_m: float | None = None
    n: int | None = None
    category: str | None = None
    t_start: int | None = None
    t_end: int | None = None

    def body(self, pseudonym: str) -> dict[str, Any]:
        region: dict[str, Any] = {"bbox": self.bbox}
        if self.t_start is not None and self.t_end is not None:
            region["t_start"] = self.t_start
            region["t_end"] = self.t_end
        out: dict[str, Any] = {"pseudonym": pseudonym, "kind": self.kind, "region": region}
        if self.kind == "range":
            out["radius_m"] = self.radius_m
        else:
            out["n"] = self.n
        if self.category is not None:
            out["category"] = self.category
        return out


class Upstream(Protocol):
    """What the pipeline needs of the provider's side: :class:`UpstreamClient` (in the broker's
    event loop) or :class:`kcloak.broker.upstream_processes.UpstreamProcesses` (child processes)."""

    @property
    def waiting(self) -> int:
        """Requests waiting for a connection (the ``upstream`` queue)."""

    @property
    def healthy(self) -> bool | None:
        """Whether the last request succeeded (None before the first)."""

    async def search(self, request: SearchRequest) -> list[Candidate]:
        """Candidates for ``request``; raises :class:`UpstreamError` when the policy gives up."""


_RANDOM_BATCH = 4096
"""Bytes of the operating system's CSPRNG read at once for pseudonyms (256 of them per read)."""
_random = bytearray()
_random_lock = threading.Lock()


def _forget_random() -> None:
    """A forked child must not hand out the pseudonyms its parent still holds."""
    global _random_lock
    _random.clear()
    _random_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_random)


_ENCODER = msgspec.json.Encoder()
"""Request bodies: compact JSON, as ``json.dumps(…, separators=(",", ":"))`` but UTF-8 rather
than ``\\u`` escapes (the same values for any JSON reader)."""


def new_pseudonym() -> str:
    """32 lowercase hex characters, 128 random bits (contract §1), from ``os.urandom`` (read
    :data:`_RANDOM_BATCH` bytes at a time; each byte is handed out once, then dropped)."""
    with _random_lock:
        if not _random:
            _random.extend(os.urandom(_RANDOM_BATCH))
        out = _random[-16:].hex()
        del _random[-16:]
    return out


class _Retryable(BrokerError):
    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class _Final(BrokerError):
    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def configured(cfg: UpstreamConfig) -> dict[str, Any]:
    """The client's keyword arguments that ``[upstream]`` sets (the bearer token read from
    ``token_file`` when one is set)."""
    token = Path(cfg.token_file).read_text(encoding="utf-8").strip() if cfg.token_file else None
    return {
        "url": cfg.url,
        "timeout_s": cfg.timeout_s,
        "retries": cfg.retries,
        "deadline_s": cfg.deadline_s,
        "concurrency": cfg.concurrency,
        "token": token,
    }


class UpstreamClient:
    """Async context manager owning the shared connection pool.

    Keyword arguments: ``url`` (base URL; ``/v1/search`` is appended), ``timeout_s`` (2.0),
    ``retries`` (2), ``deadline_s`` (5.0), ``concurrency`` (64), ``token`` (operator-wide bearer
    token or None), ``metrics`` (or None), or instead of ``metrics`` the hooks ``on_attempt(outcome,
    seconds)`` (each attempt) and ``on_retry()`` (each retry).
    """

    def __init__(
        self,
        *,
        url: str,
        timeout_s: float = 2.0,
        retries: int = 2,
        deadline_s: float = 5.0,
        concurrency: int = 64,
        token: str | None = None,
        metrics: Metrics | None = None,
        on_attempt: Callable[[str, float], None] | None = None,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/v1/search"
        self._path = ""
        self.timeout_s = timeout_s
        self.retries = retries
        self.deadline_s = deadline_s
        self.concurrency = concurrency
        self._token = token
        if metrics is not None:
            seconds, retried = metrics.upstream_seconds, metrics.upstream_retries
            on_attempt = on_attempt or (lambda outcome, s: seconds.labels(outcome=outcome).observe(s))
            on_retry = on_retry or retried.inc
        self._on_attempt = on_attempt
        self._on_retry = on_retry
        self._pool: HttpPool | None = None
        self._sem = asyncio.Semaphore(concurrency)
        self.waiting = 0
        self.healthy: bool | None = None

    @classmethod
    def from_config(cls, cfg: UpstreamConfig, *, metrics: Metrics | None = None) -> UpstreamClient:
        """The client ``[upstream]`` configures."""
        return cls(**configured(cfg), metrics=metrics)

    async def __aenter__(self) -> UpstreamClient:
        headers = [("User-Agent", f"kcloak/{__version__}")]
        if self._token:
            headers.append(("Authorization", f"Bearer {self._token}"))
        origin = Origin.parse(self.url)
        self._path = origin.path
        self._pool = HttpPool(
            host=origin.host,
            port=origin.port,
            scheme=origin.scheme,
            connections=self.concurrency,
            timeout_s=self.timeout_s,
            headers=headers,
            max_body=MAX_RESPONSE_BYTES,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def search(self, request: SearchRequest) -> list[Candidate]:
        """Candidates for ``request``; raises :class:`UpstreamError` after the retry policy."""
        assert self._pool is not None, "UpstreamClient used outside its context"
        deadline = time.monotonic() + self.deadline_s
        if self._sem.locked():  # only a wait for a free connection needs its deadline
            self.waiting += 1
            try:
                async with asyncio.timeout(self.deadline_s):
                    await self._sem.acquire()
            except TimeoutError:
                raise UpstreamError("upstream deadline passed while waiting for a connection") from None
            finally:
                self.waiting -= 1
        else:
            await self._sem.acquire()  # returns at once, without suspending
        try:
            attempt = 0
            while True:
                attempt += 1
                try:
                    result = await self._attempt(request, deadline)
                    self.healthy = True
                    return result
                except _Final as exc:
                    self.healthy = False
                    raise UpstreamError(exc.outcome) from None
                except _Retryable as exc:
                    self.healthy = False
                    if attempt > self.retries:
                        raise UpstreamError(exc.outcome) from None
                    pause = random.uniform(0, 0.1 * 2 ** (attempt - 1))
                    if time.monotonic() + pause >= deadline:
                        raise UpstreamError("deadline") from None
                    if self._on_retry is not None:
                        self._on_retry()
                    await asyncio.sleep(pause)
        finally:
            self._sem.release()

    async def _attempt(self, request: SearchRequest, deadline: float) -> list[Candidate]:
        assert self._pool is not None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Final("deadline")
        started = time.perf_counter()
        outcome = "ok"
        try:
            body = _ENCODER.encode(request.body(new_pseudonym()))
            try:
                resp = await self._pool.request("POST", self._path, body, timeout_s=min(self.timeout_s, remaining))
            except HttpTimeout:
                outcome = "timeout"
                raise _Retryable(outcome) from None
            except HttpProtocolError:  # not HTTP, or a head or body beyond the limits
                outcome = "invalid_response"
                raise _Final(outcome) from None
            except HttpConnectionError:
                outcome = "connection_error"
                raise _Retryable(outcome) from None
            if resp.status >= 500 or resp.status == 429:
                outcome = "http_error"
                raise _Retryable(outcome)
            if resp.status != 200:
                outcome = "http_error"
                raise _Final(outcome)
            try:
                return parse_candidates(resp.body, request.category)
            except ValueError:
                outcome = "invalid_response"
                raise _Final(outcome) from None
        finally:
            if self._on_attempt is not None:
                self._on_attempt(outcome, time.perf_counter() - started)


def parse_candidates(raw: bytes, category: str | None) -> list[Candidate]:
    """Strict check of a provider response (contract §5); ValueError when invalid."""
    doc = parse_json_object(raw)  # UTF-8, an object, no NaN or Infinity, bounded nesting
    if not isinstance(doc.get("candidates"), list):
        raise ValueError("candidates")
    out: list[Candidate] = []
    for c in doc["candidates"]:
        if not isinstance(c, dict):
            raise ValueError("candidate")
        pid, lat, lon, cat, name = c.get("poi_id"), c.get("lat"), c.get("lon"), c.get("category"), c.get("name", "")
        if not isinstance(pid, str) or not 1 <= len(pid) <= 64 or not isinstance(cat, str):
            raise ValueError("candidate")
        if isinstance(lat, bool) or isinstance(lon, bool) or not isinstance(lat, (int, float)):
            raise ValueError("candidate")
        if not isinstance(lon, (int, float)) or not (math.isfinite(lat) and math.isfinite(lon)):
            raise ValueError("candidate")
        if not (-90 <= lat <= 90 and -180 <= lon <= 180):
            raise ValueError("candidate")
        if category is not None and cat != category:
            raise ValueError("candidate")
        out.append(Candidate(pid, float(lat), float(lon), cat, name if isinstance(name, str) else ""))
    return out
