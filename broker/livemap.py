"""The live map's data (``GET /map``, its feed ``GET /v1/map/stream``): aggregates only.

What a frame holds, and what it never holds:

- **regions**: the distinct cloaked regions forwarded upstream in the last ``map.region_age_s``
  seconds (at most :data:`MAX_REGIONS`, newest first), each as its bounds *rounded outward* to a grid of
  :data:`REGION_GRID_DEG` degrees (about 100 m) and given in units of that grid (integers),
  with its achieved k and its age. A forwarded region is already non-identifying (≥ k users
  strictly inside), but its edges are whole micro-degrees, the precision apps send, and may
  coincide with the coordinate of a user it does not count (a grid cell's edge, a box grown to
  ``min_area_m2``): the map shows a slightly larger box whose edges are grid lines, so no
  coordinate the broker received appears in a frame.
- **density**: present users counted per cell of a grid of ``map.cell_deg`` degrees (cell
  indices, integers); a cell with fewer than ``max(map.min_k, profile.k)`` users is left out
  (only the number of such cells and the users in them are given).
- **counters**: fixes accepted per second (over the last :data:`RATE_WINDOW_S` s), queries
  answered, the success rate, refusals by reason code, the p99 time from a query's receipt to its
  answer over the last :data:`LATENCY_WINDOW_S` s, users present.
- **windows**: published trajectory windows by outcome, and the latest few windows' ids, times,
  k and trajectory counts.

Never a user id, a query id, an exact position or a pseudonym. The numbers come from the
broker's own counters (:class:`kcloak.broker.metrics.Metrics`) and two small bounded rings
filled on the query path (:meth:`LiveMap.region`, :meth:`LiveMap.answered`); a frame is built
at most once a second, and only while someone watches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np

from kcloak.broker.config import Config, ConfigError
from kcloak.broker.metrics import Metrics
from kcloak.cloaking.index import IndexView
from kcloak.core.logs import log_event

log = logging.getLogger("kcloak.map")

REGION_GRID_DEG: Final = 0.001
"""Region bounds are rounded outward to multiples of this (degrees) and sent as multiples of it."""
MAX_REGIONS: Final = 500
"""At most this many regions in a frame (the newest)."""
RATE_WINDOW_S: Final = 5.0
LATENCY_WINDOW_S: Final = 60.0
FRAME_PERIOD_S: Final = 1.0
"""A frame is built at most this often, whatever the number of viewers."""
WINDOWS_PERIOD_S: Final = 5.0
RECENT_WINDOWS: Final = 5
MAX_VIEWERS: Final = 8
"""Concurrent feeds; one more is refused ``overloaded``."""
STREETS_MAX_BYTES: Final = 32 * 1024 * 1024
STREETS_DECIMALS: Final = 5


class _Snapshots(Protocol):
    def snapshot(self, now: float, *, epoch: int = 0, seed: int = 0) -> IndexView: ...


class _Windows(Protocol):
    def listing(self, *, since: int, limit: int) -> tuple[list[dict[str, Any]], int | None]: ...


def _totals(metric: Any) -> Iterator[tuple[dict[str, str], float]]:
    """The ``(labels, value)`` of every child of a prometheus counter."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                yield sample.labels, sample.value


def outward(lo: float, hi: float, step: float = REGION_GRID_DEG) -> tuple[int, int]:
    """``[lo, hi]`` widened to grid lines, in grid units (``lo ≥ i0·step``, ``hi ≤ i1·step``)."""
    i0 = math.floor(lo / step)
    i1 = math.ceil(hi / step)
    # float division can land a hair inside: widen until the grid lines hold the interval
    while i0 * step > lo:
        i0 -= 1
    while i1 * step < hi:
        i1 += 1
    return i0, i1


class LiveMap:
    """The map's rings and its frames; one per broker (``pipeline.livemap``).

    Keyword arguments: ``config`` (``[map]``, ``profile.k``), ``metrics`` (the counters read),
    ``positions`` (present users, for the density grid), ``clock`` (wall clock of the pipeline).
    Raises :class:`kcloak.broker.config.ConfigError` when ``map.streets`` exists but holds no street
    lines (a file that does not exist yet is read when it appears, see :meth:`streets`).
    """

    def __init__(
        self, *, config: Config, metrics: Metrics, positions: _Snapshots, clock: Callable[[], float] = time.time
    ) -> None:
        mc = config.map
        self.min_k = max(mc.min_k, config.profile.k)
        self.cell_deg = mc.cell_deg
        self.region_age_s = mc.region_age_s
        # The latest windows start within this span (a window is published max_update_age_s after its
        # end, and processing may lag): asking for it alone keeps the listing short.
        window_s = config.publish.window_s
        self._recent_span_s = (
            (RECENT_WINDOWS + 2) * window_s + config.cloaking.max_update_age_s + 60.0 if window_s else 86_400.0
        )
        self.metrics = metrics
        self.positions = positions
        self.clock = clock
        self._streets_path = Path(mc.streets) if mc.streets else None
        self._streets: dict[str, Any] | None = None
        if self._streets_path is not None and self._streets_path.exists():
            self._streets = load_streets(self._streets_path)  # a bad file stops the start
        elif self._streets_path is not None:
            log_event(log, "map_streets_absent", logging.WARNING, note="map.streets is read once the file exists")
        self._regions: deque[tuple[float, int, int, int, int, int]] = deque(maxlen=4 * MAX_REGIONS)
        self._latencies: deque[tuple[float, float]] = deque(maxlen=100_000)
        self._updates: deque[tuple[float, float]] = deque()
        self._frame: tuple[float, bytes] | None = None
        self._windows: tuple[float, list[dict[str, Any]]] | None = None
        self._windows_seen = 0.0
        self._lock = asyncio.Lock()
        self.viewers = 0

    def streets(self) -> dict[str, Any] | None:
        """The street lines of ``map.streets``, or None; a file written after the start (``kcloak
        demo`` writes its streets while the broker starts) is read once it is there."""
        if self._streets is None and self._streets_path is not None and self._streets_path.exists():
            self._streets = load_streets(self._streets_path)
        return self._streets

    # -- fed by the query path (cheap: one append) ----------------------------------------------
    def region(self, bbox: Sequence[float], k_achieved: int) -> None:
        """A region ``(min_lon, min_lat, max_lon, max_lat)`` was forwarded upstream."""
        x0, x1 = outward(bbox[0], bbox[2])
        y0, y1 = outward(bbox[1], bbox[3])
        self._regions.append((time.monotonic(), x0, y0, x1, y1, int(k_achieved)))

    def answered(self, seconds: float) -> None:
        """A query was answered ``seconds`` after it was received."""
        now = time.monotonic()
        latencies = self._latencies
        latencies.append((now, seconds))
        # Only the last LATENCY_WINDOW_S are ever shown: older answers go now, not when a viewer next
        # asks (with no viewer the deque would otherwise stay at its 100,000 entries, ~9 MiB).
        while now - latencies[0][0] > LATENCY_WINDOW_S:
            latencies.popleft()

    # -- frames --------------------------------------------------------------------------------
    async def frame(self, windows: _Windows | None) -> bytes:
        """The current frame as one SSE event (built at most every :data:`FRAME_PERIOD_S`)."""
        async with self._lock:
            now = time.monotonic()
            if self._frame is not None and now - self._frame[0] < FRAME_PERIOD_S * 0.9:
                return self._frame[1]
            recent = await self._recent_windows(windows, now)
            body = json.dumps(self.snapshot(recent), separators=(",", ":"), allow_nan=False)
            event = f"event: frame\ndata: {body}\n\n".encode()
            self._frame = (now, event)
            return event

    async def _recent_windows(self, windows: _Windows | None, now: float) -> list[dict[str, Any]]:
        if windows is None:
            return []
        published = sum(v for _, v in _totals(self.metrics.published_windows))
        if self._windows is None or now - self._windows[0] >= WINDOWS_PERIOD_S or published != self._windows_seen:
            self._windows_seen = published
            since: int | None = max(0, int(self.clock() - self._recent_span_s))
            latest: list[dict[str, Any]] = []
            while since is not None:  # ascending pages: keep the tail of the last
                metas, since = await asyncio.to_thread(windows.listing, since=since, limit=1000)
                latest = (latest + metas)[-RECENT_WINDOWS:]
            keep = ("window_id", "t_start", "t_end", "k", "n_in", "n_out", "status")
            self._windows = (now, [{key: m[key] for key in keep} for m in latest][::-1])
        return self._windows[1]

    def snapshot(self, recent_windows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The frame's content (see the module's docstring)."""
        now = time.monotonic()
        return {
            "t": round(self.clock(), 1),
            "regions": self._region_rows(now),
            "density": self._density(),
            "counters": self._counters(now),
            "windows": self._window_counts(recent_windows or []),
        }

    def _region_rows(self, now: float) -> dict[str, Any]:
        rows: list[list[float]] = []
        seen: set[tuple[int, int, int, int, int]] = set()
        for t, x0, y0, x1, y1, k in reversed(self._regions):
            age = now - t
            if age > self.region_age_s or len(rows) >= MAX_REGIONS:
                break
            if (x0, y0, x1, y1, k) not in seen:  # the same region forwarded again: shown once, at its latest age
                seen.add((x0, y0, x1, y1, k))
                rows.append([x0, y0, x1, y1, k, round(age, 1)])
        return {"grid_deg": REGION_GRID_DEG, "max_age_s": self.region_age_s, "rows": rows}

    def _density(self) -> dict[str, Any]:
        view = self.positions.snapshot(self.clock())
        cells: list[list[int]] = []
        hidden_cells = hidden_users = 0
        if len(view.lat):
            cx = np.floor(view.lon / self.cell_deg).astype(np.int64)
            cy = np.floor(view.lat / self.cell_deg).astype(np.int64)
            # one integer key per cell (np.unique over rows is ~35× slower than over a 1-D array)
            x0, y0 = int(cx.min()), int(cy.min())
            span = int(cy.max()) - y0 + 1
            keys, counts = np.unique((cx - x0) * span + (cy - y0), return_counts=True)
            shown = counts >= self.min_k
            xs, ys = np.divmod(keys[shown], span)
            cells = [
                [x + x0, y + y0, int(n)]
                for x, y, n in zip(xs.tolist(), ys.tolist(), counts[shown].tolist(), strict=True)
            ]
            hidden_cells = int(np.count_nonzero(~shown))
            hidden_users = int(counts[~shown].sum())
        return {
            "cell_deg": self.cell_deg,
            "min_k": self.min_k,
            "cells": cells,
            "hidden_cells": hidden_cells,
            "hidden_users": hidden_users,
        }

    def _counters(self, now: float) -> dict[str, Any]:
        m = self.metrics
        updates = sum(v for _, v in _totals(m.updates_accepted))
        self._updates.append((now, updates))
        while len(self._updates) > 1 and now - self._updates[0][0] > RATE_WINDOW_S:
            self._updates.popleft()
        t0, u0 = self._updates[0]
        rate = (updates - u0) / (now - t0) if now - t0 >= 0.5 else None
        ok = 0.0
        refusals: dict[str, int] = {}
        for labels, value in _totals(m.queries):
            if labels.get("status") == "ok":
                ok += value
            elif value:
                reason = labels.get("reason", "unknown")
                refusals[reason] = refusals.get(reason, 0) + int(value)
        refused = sum(refusals.values())
        while self._latencies and now - self._latencies[0][0] > LATENCY_WINDOW_S:
            self._latencies.popleft()
        p99 = None
        if self._latencies:
            p99 = float(np.percentile(np.fromiter((s for _, s in self._latencies), dtype=np.float64), 99))
        answered = int(ok) + refused
        return {
            "updates": int(updates),
            "updates_per_s": None if rate is None else round(rate, 1),
            "queries": answered,
            "ok": int(ok),
            "refused": refused,
            "success_rate": round(ok / answered, 4) if answered else None,
            "refusals": dict(sorted(refusals.items(), key=lambda kv: -kv[1])),
            "p99_ms": None if p99 is None else round(p99 * 1000.0, 1),
            "latency_window_s": LATENCY_WINDOW_S,
            "users_present": int(sum(v for _, v in _gauge(m.users_present))),
        }

    def _window_counts(self, recent: list[dict[str, Any]]) -> dict[str, Any]:
        counts = {labels.get("outcome", "?"): int(v) for labels, v in _totals(self.metrics.published_windows)}
        return {"by_outcome": counts, "recent": recent}


def _gauge(metric: Any) -> Iterator[tuple[dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            yield sample.labels, sample.value


def load_streets(path: str | Path) -> dict[str, Any]:
    """The street lines of a GeoJSON file (LineString and MultiLineString geometries, in a
    FeatureCollection, a Feature or bare), as ``{"lines": [[lon, lat, lon, lat, …], …], "bbox":
    [min_lon, min_lat, max_lon, max_lat]}`` rounded to :data:`STREETS_DECIMALS` decimals."""
    p = Path(path)
    try:
        if p.stat().st_size > STREETS_MAX_BYTES:
            raise ConfigError(f"map.streets: larger than {STREETS_MAX_BYTES // 2**20} MiB")
        doc = json.loads(p.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError):
        raise ConfigError("map.streets: cannot read a GeoJSON document from the file") from None
    lines: list[list[float]] = []
    for geometry in _geometries(doc):
        kind, coords = geometry.get("type"), geometry.get("coordinates")
        parts = [coords] if kind == "LineString" else coords if kind == "MultiLineString" else []
        for part in parts if isinstance(parts, list) else []:
            flat = _line(part)
            if flat:
                lines.append(flat)
    if not lines:
        raise ConfigError("map.streets: no LineString in the GeoJSON document")
    lons = [v for line in lines for v in line[0::2]]
    lats = [v for line in lines for v in line[1::2]]
    return {"lines": lines, "bbox": [min(lons), min(lats), max(lons), max(lats)]}


def _geometries(doc: Any) -> Iterator[dict[str, Any]]:
    if not isinstance(doc, dict):
        return
    kind = doc.get("type")
    if kind == "FeatureCollection" and isinstance(doc.get("features"), list):
        for feature in doc["features"]:
            yield from _geometries(feature)
    elif kind == "Feature":
        yield from _geometries(doc.get("geometry"))
    elif kind == "GeometryCollection" and isinstance(doc.get("geometries"), list):
        for g in doc["geometries"]:
            yield from _geometries(g)
    else:
        yield doc


def _line(part: Any) -> list[float]:
    flat: list[float] = []
    if not isinstance(part, list):
        return flat
    for point in part:
        if not (isinstance(point, list) and len(point) >= 2):
            continue
        lon, lat = point[0], point[1]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (lon, lat)):
            continue
        if -180 <= lon <= 180 and -90 <= lat <= 90:
            flat += [round(float(lon), STREETS_DECIMALS), round(float(lat), STREETS_DECIMALS)]
    return flat if len(flat) >= 4 else []


__all__ = ["FRAME_PERIOD_S", "MAX_VIEWERS", "REGION_GRID_DEG", "LiveMap", "load_streets", "outward"]
