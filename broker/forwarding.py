"""Forwarding: the upstream call, the query log and the exact filtering of the candidates (contract §2, §5).

Only the cloaked region and the query's public parameters go upstream; the candidates come back
filtered against the querier's exact position, which never leaves the broker. The query log is
written in the background (:class:`Background`): the answer does not wait for its commit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from kcloak.broker.metrics import Metrics
from kcloak.broker.stores import QueryLog
from kcloak.broker.upstream import Candidate, SearchRequest, Upstream, UpstreamError
from kcloak.cloaking.cloakers import Region
from kcloak.core.geometry import haversine_m
from kcloak.core.logs import log_event
from kcloak.core.profile import PrivacyProfile, ReasonCode
from kcloak.core.schemas import FORWARDED
from kcloak.wire.answers import Answer, AnsweredRegion, PoiResult
from kcloak.wire.payloads import Query

log = logging.getLogger("kcloak.pipeline")

MAX_RANGE_RESULTS = 1000


@dataclass(slots=True)
class Timing:
    """Seconds a query spent waiting outside the broker's own work (excluded from its added latency)."""

    upstream: float = 0.0
    hold: float = 0.0


class Background:
    """Writes the answer does not wait for (query-log rows, session status messages); a failure is
    logged, and :meth:`wait` lets them finish at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._flushes: list[Callable[[], None]] = []

    def before_wait(self, flush: Callable[[], None]) -> None:
        """Have :meth:`wait` first call ``flush`` (which spawns what a part still gathers)."""
        self._flushes.append(flush)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(log, "store_write_failed", logging.ERROR, store="querylog")

    async def wait(self, timeout_s: float) -> None:
        for flush in self._flushes:
            flush()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


class Forwarder:
    """Sends a cloaked query upstream and turns the candidates into its answer.

    Keyword arguments: ``algorithm`` (the configured algorithm, in answers, metrics and the query
    log), ``queue_capacity`` (``queues.upstream``: queries waiting for the provider beyond it are
    refused ``overloaded``), ``metrics``, ``upstream``, ``querylog``, ``background``, ``clock``,
    ``on_region`` (told the bounds and achieved k of each region the provider answered for).
    """

    def __init__(
        self,
        *,
        algorithm: str,
        queue_capacity: int,
        metrics: Metrics,
        upstream: Upstream,
        querylog: QueryLog,
        background: Background,
        clock: Callable[[], float] = time.time,
        on_region: Callable[[Sequence[float], int], None] | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.on_region = on_region
        self.queue_capacity = queue_capacity
        self.metrics = metrics
        self.upstream = upstream
        self.querylog = querylog
        self.background = background
        self.clock = clock
        metrics.queue_depth.labels(queue="upstream").set_function(lambda: upstream.waiting)  # read when scraped
        self._log_rows: list[tuple[Any, ...]] = []
        background.before_wait(self._flush_log)

    def _log(self, row: tuple[Any, ...]) -> None:
        """Queue a query-log row; the rows of one loop turn are written together, in the background:
        the answer does not wait for their commit (the writer thread drains every queued row before
        the store closes)."""
        if not self._log_rows:
            asyncio.get_running_loop().call_soon(self._flush_log)
        self._log_rows.append(row)

    def _flush_log(self) -> None:
        rows, self._log_rows = self._log_rows, []
        if rows:  # none when the background's wait took them first
            self.background.spawn(self.querylog.record_rows(rows))

    async def forward(
        self, q: Query, profile: PrivacyProfile, region: Region, lat: float, lon: float, timing: Timing
    ) -> Answer:
        """Forward ``region`` with ``q``'s parameters; filter the candidates against ``(lat, lon)``."""
        assert q.kind is not None
        bbox = region.bbox.to_geojson()
        request = SearchRequest(
            kind=q.kind,
            bbox=bbox,
            radius_m=q.radius_m,
            n=q.n,
            category=q.category,
            t_start=region.t_start,
            t_end=region.t_end,
        )
        if self.upstream.waiting >= self.queue_capacity:
            return Answer.refused(q.query_id, ReasonCode.OVERLOADED, "the upstream queue is full", self.clock())
        started = time.monotonic()
        outcome = "ok"
        try:
            candidates = await self.upstream.search(request)
        except UpstreamError:
            outcome = "upstream_error"
            candidates = []
        finally:
            timing.upstream += time.monotonic() - started
        forwarded_t = self.clock()
        self._log(
            FORWARDED.row(
                t=forwarded_t,
                kind=q.kind,
                radius_m=q.radius_m,
                n=q.n,
                category=q.category,
                min_lon=bbox[0],
                min_lat=bbox[1],
                max_lon=bbox[2],
                max_lat=bbox[3],
                t_start=region.t_start,
                t_end=region.t_end,
                area_m2=region.area_m2,
                k_achieved=region.k_achieved,
                algorithm=self.algorithm,
                outcome=outcome,
            )
        )
        if outcome != "ok":
            message = "the provider failed after retries"
            return Answer.refused(q.query_id, ReasonCode.UPSTREAM_ERROR, message, self.clock())
        self.metrics.upstream_candidates.labels(kind=q.kind).observe(len(candidates))
        if self.on_region is not None:
            self.on_region(bbox, region.k_achieved)
        self.metrics.region_area.labels(algorithm=self.algorithm).observe(region.area_m2)
        self.metrics.k_ratio.labels(algorithm=self.algorithm).observe(region.k_achieved / profile.k)
        truncated: bool | None = None
        if q.kind == "range":
            assert q.radius_m is not None
            results, truncated = filter_range(candidates, lat, lon, q.radius_m)
        else:
            assert q.n is not None
            results = filter_knn(candidates, lat, lon, q.n)
        return Answer(
            query_id=q.query_id,
            status="ok",
            algorithm=self.algorithm,
            k_achieved=region.k_achieved,
            area_m2=region.area_m2,
            region=answered_region(region),
            l_achieved=region.l_achieved if profile.l > 1 else None,
            results=tuple(results),
            truncated=truncated,
            t=self.clock(),
        )


def answered_region(region: Region) -> AnsweredRegion:
    """The ``region`` of an answer: exactly what was sent upstream."""
    lon0, lat0, lon1, lat1 = region.bbox.to_geojson()
    return AnsweredRegion((lon0, lat0, lon1, lat1), region.t_start, region.t_end)


def _result(c: Candidate, d: float) -> PoiResult:
    return PoiResult(c.poi_id, c.lat, c.lon, c.category, c.name, round(d, 3))


def filter_range(candidates: list[Candidate], lat: float, lon: float, radius_m: float) -> tuple[list[PoiResult], bool]:
    """Every candidate within ``radius_m`` of the exact position, nearest first (ties by id),
    at most 1,000 (then ``truncated``)."""
    hits = [(haversine_m(lat, lon, c.lat, c.lon), c) for c in candidates]
    inside = sorted(((round(d, 3), c.poi_id, d, c) for d, c in hits if d <= radius_m), key=lambda x: (x[0], x[1]))
    truncated = len(inside) > MAX_RANGE_RESULTS
    return [_result(c, d) for _, _, d, c in inside[:MAX_RANGE_RESULTS]], truncated


def filter_knn(candidates: list[Candidate], lat: float, lon: float, n: int) -> list[PoiResult]:
    """The ``n`` candidates nearest to the exact position (ties by ``poi_id``)."""
    ranked = sorted(
        ((round(d, 3), c.poi_id, d, c) for d, c in ((haversine_m(lat, lon, c.lat, c.lon), c) for c in candidates)),
        key=lambda x: (x[0], x[1]),
    )
    return [_result(c, d) for _, _, d, c in ranked[:n]]


__all__ = ["MAX_RANGE_RESULTS", "Background", "Forwarder", "Timing", "answered_region", "filter_knn", "filter_range"]
