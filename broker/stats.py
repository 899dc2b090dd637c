"""The periodic stats line (``log.stats_interval_s``, ``--stats-interval-s``): counts only.

Every interval one JSON log line, event ``stats``, read from the broker's own Prometheus registry:
what happened during the interval (requests, messages, fixes, queries, profile writes, windows) and
what is there now (users present and indexed, sessions, MQTT connections). Every field is a count
or a duration: no label value is copied into it, so no user id, query id, token or coordinate can
reach the line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.registry import CollectorRegistry

from kcloak.core.logs import log_event

log = logging.getLogger("kcloak.stats")


@dataclass(frozen=True, slots=True)
class StatsField:
    """One field of the line: the sum of the samples ``sample`` whose labels include ``labels``;
    ``delta`` fields count what happened during the interval, the others are the current value."""

    name: str
    sample: str
    labels: tuple[tuple[str, str], ...] = ()
    delta: bool = True


FIELDS: tuple[StatsField, ...] = (
    StatsField("http_requests", "kcloak_http_requests_total"),
    StatsField("mqtt_messages", "kcloak_messages_total", (("transport", "mqtt"),)),
    StatsField("updates_accepted", "kcloak_updates_accepted_total"),
    StatsField("updates_rejected", "kcloak_updates_rejected_total"),
    StatsField("queries", "kcloak_queries_total"),
    StatsField("queries_ok", "kcloak_queries_total", (("status", "ok"),)),
    StatsField("profile_sets", "kcloak_profile_sets_total"),
    StatsField("published_windows", "kcloak_published_windows_total"),
    StatsField("users_present", "kcloak_users_present", delta=False),
    StatsField("users_indexed", "kcloak_users_indexed", delta=False),
    StatsField("sessions_active", "kcloak_sessions_active", delta=False),
    StatsField("mqtt_connections", "kcloak_mqtt_connections", delta=False),
)
"""The line's fields after ``interval_s``, in this order."""


def read_fields(registry: CollectorRegistry, fields: tuple[StatsField, ...] = FIELDS) -> dict[str, float]:
    """The current value of every field (a cumulative count for the ``delta`` ones), in one pass."""
    out = {f.name: 0.0 for f in fields}
    by_sample: dict[str, list[StatsField]] = {}
    for f in fields:
        by_sample.setdefault(f.sample, []).append(f)
    for family in registry.collect():
        for s in family.samples:
            for f in by_sample.get(s.name, ()):
                if all(s.labels.get(k) == v for k, v in f.labels):
                    out[f.name] += s.value
    return out


class StatsLine:
    """Logs the ``stats`` event every ``interval_s`` (> 0) from ``registry`` until cancelled.

    Keyword arguments: ``registry`` (the broker's), ``interval_s``, ``clock`` (monotonic, for the
    interval actually covered).
    """

    def __init__(
        self, *, registry: CollectorRegistry, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.clock = clock
        self._last = read_fields(registry)
        self._last_t = clock()

    def line(self) -> dict[str, int | float]:
        """The fields since the previous call (or since construction), and remember the values now."""
        now, t = read_fields(self.registry), self.clock()
        out: dict[str, int | float] = {"interval_s": round(t - self._last_t, 3)}
        for f in FIELDS:
            value = now[f.name] - self._last[f.name] if f.delta else now[f.name]
            out[f.name] = round(value)
        self._last, self._last_t = now, t
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            log_event(log, "stats", logging.INFO, **self.line())


__all__ = ["FIELDS", "StatsField", "StatsLine", "read_fields"]
