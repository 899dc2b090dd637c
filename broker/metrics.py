"""Prometheus metrics of the broker (contract §10), on a registry of its own.

Label values come only from fixed sets (transports, topics, reason codes, algorithms, queue
names, HTTP route patterns): never a user id, query id, coordinate or anything a client chose.
The registry also carries prometheus-client's process collector (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ``process_open_fds``, ...; Linux only, empty elsewhere).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Self

import prometheus_client
from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client 0.26 lacks its "-> None"


class _CachedLabels(MetricWrapperBase):
    """``labels()`` memoized per label values: prometheus-client validates the values and takes a
    lock on every call, which costs more than the increment itself on the intake hot path.

    A mixin placed before the metric class (``class Counter(_CachedLabels, prometheus_client.Counter)``),
    so ``super().labels`` is the metric's own."""

    def labels(self, *values: object, **named: object) -> Self:
        key = values or tuple(named.items())
        cache: dict[tuple[object, ...], Self] | None = self.__dict__.get("_children_cache")
        if cache is None:
            cache = self.__dict__["_children_cache"] = {}
        child = cache.get(key)
        if child is None:
            child = cache[key] = super().labels(*values, **named)
        return child


class Counter(_CachedLabels, prometheus_client.Counter):
    pass


class Gauge(_CachedLabels, prometheus_client.Gauge):
    pass


class Histogram(_CachedLabels, prometheus_client.Histogram):
    pass


class LoopHistogramChild:
    """One label set of a :class:`LoopHistogram`: per-bucket counts (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bucket whose le ≥ amount
        self.total += amount


class LoopHistogram:
    """A histogram observed only on the event loop's thread, for the query path's histograms (six
    observations a query): an observation is a bisect and two additions, where prometheus-client's
    takes two locks (0.4 µs against 2.2 µs a call here, 3.3 µs with ``labels``). Registered as a
    collector, it is exposed exactly as a prometheus-client histogram of the same name, labels and
    buckets (``_bucket`` cumulative by ``le``, ``_count``, ``_sum``). A scrape on another thread could
    read one observation's bucket before its sum; scrapes run on the loop (``Metrics.render``).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError("buckets must be in increasing order")
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(bounds)
        self._calls: dict[object, LoopHistogramChild] = {}
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: object, **named: object) -> LoopHistogramChild:
        """The child of these label values (given by position or by name, as prometheus-client's)."""
        call = values or tuple(named.items())
        child = self._calls.get(call)
        if child is None:
            if values and named:
                raise ValueError("label values by position or by name, not both")
            if named and set(named) != set(self.labelnames):
                raise ValueError(f"labels of {self.name}: {', '.join(self.labelnames)}")
            key = tuple(str(v) for v in values) if values else tuple(str(named[n]) for n in self.labelnames)
            if len(key) != len(self.labelnames):
                raise ValueError(f"labels of {self.name}: {', '.join(self.labelnames)}")
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = LoopHistogramChild(self.bounds)
            self._calls[call] = child
        return child

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds]  # type: ignore[no-untyped-call]  # untyped in 0.26
        for key, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for le, n in zip(les, list(child.counts), strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric(list(key), buckets, child.total)
        yield family


LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HOLD_BUCKETS = (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
AREA_BUCKETS = (1e3, 1e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 2e6, 4e6, 1e7, 1e8, 1e9, 2.5e9)
RATIO_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
CANDIDATE_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
STORES = ("movement", "profiles", "querylog")


class Metrics:
    """Every metric of contract §10."""

    def __init__(self, *, version: str, algorithm: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        self.build_info = Gauge("kcloak_build_info", "Build information", ["version", "algorithm"], registry=r)
        self.build_info.labels(version=version, algorithm=algorithm).set(1)
        self.messages = Counter("kcloak_messages", "Messages received", ["transport", "topic"], registry=r)
        self.messages_dropped = Counter(
            "kcloak_messages_dropped", "Messages dropped", ["transport", "topic", "reason"], registry=r
        )
        self.updates_accepted = Counter(
            "kcloak_updates_accepted", "Fixes accepted", ["transport", "source"], registry=r
        )
        self.updates_rejected = Counter(
            "kcloak_updates_rejected", "Fixes rejected", ["transport", "reason"], registry=r
        )
        self.queries = Counter(
            "kcloak_queries", "Queries answered", ["transport", "kind", "status", "reason"], registry=r
        )
        self.profile_sets = Counter(
            "kcloak_profile_sets", "Profile messages handled", ["transport", "status", "reason"], registry=r
        )
        self.sessions_active = Gauge("kcloak_sessions_active", "Active continuous sessions", registry=r)
        self.sessions_closed = Counter("kcloak_sessions_closed", "Sessions closed", ["state"], registry=r)
        self.users_present = Gauge("kcloak_users_present", "Users with a present fix", registry=r)
        self.users_indexed = Gauge("kcloak_users_indexed", "Users in the position index", registry=r)
        self.queue_depth = Gauge("kcloak_queue_depth", "Items waiting in a bounded queue", ["queue"], registry=r)
        self.queue_capacity = Gauge("kcloak_queue_capacity", "Capacity of a bounded queue", ["queue"], registry=r)
        self.cloak_seconds = LoopHistogram(
            "kcloak_cloak_seconds", "Time to cloak one query", ["algorithm"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.hold_seconds = LoopHistogram(
            "kcloak_hold_seconds", "Time a query was held", ["algorithm"], buckets=HOLD_BUCKETS, registry=r
        )
        self.added_latency = LoopHistogram(
            "kcloak_added_latency_seconds",
            "Receipt to answer minus upstream and hold time",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_seconds = LoopHistogram(
            "kcloak_upstream_seconds", "Upstream attempts", ["outcome"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.upstream_retries = Counter("kcloak_upstream_retries", "Upstream retries", registry=r)
        self.upstream_candidates = LoopHistogram(
            "kcloak_upstream_candidates", "Candidate-set size", ["kind"], buckets=CANDIDATE_BUCKETS, registry=r
        )
        self.region_area = LoopHistogram(
            "kcloak_region_area_m2", "Area of forwarded regions", ["algorithm"], buckets=AREA_BUCKETS, registry=r
        )
        self.k_ratio = LoopHistogram(
            "kcloak_k_ratio", "k_achieved / k of forwarded regions", ["algorithm"], buckets=RATIO_BUCKETS, registry=r
        )
        self.store_commit = Histogram(
            "kcloak_store_commit_seconds", "Store transaction time", ["store"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.published_windows = Counter("kcloak_published_windows", "Publication windows", ["outcome"], registry=r)
        self.published_trajectories = Counter("kcloak_published_trajectories", "Trajectories published", registry=r)
        self.trashed_trajectories = Counter("kcloak_trashed_trajectories", "Trajectories trashed", registry=r)
        self.mqtt_connected = Gauge("kcloak_mqtt_connected", "1 while the MQTT session is up", registry=r)
        self.http_requests = Counter("kcloak_http_requests", "HTTP requests", ["route", "method", "status"], registry=r)
        # Extension: from the request head to the response written, by route pattern (never the concrete path).
        self.http_seconds = Histogram(
            "kcloak_http_request_duration_seconds",
            "HTTP request head to response written, by route pattern",
            ["route", "method", "status_class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Extensions (docs/contract-extensions.md): whether each store can write.
        self.store_healthy = Gauge(
            "kcloak_store_healthy",
            "1 unless the store's latest write failed (disk full, I/O error)",
            ["store"],
            registry=r,
        )
        self.store_write_failures = Counter(
            "kcloak_store_write_failures", "Store writes that failed for a storage reason", ["store"], registry=r
        )
        for store in STORES:
            self.store_healthy.labels(store=store).set(1)
            self.store_write_failures.labels(store=store)
        # The embedded MQTT server (broker/mqtt_server.py); labels are fixed reason codes, never a client id.
        self.mqtt_connections = Gauge(
            "kcloak_mqtt_connections", "Clients connected to the embedded MQTT server", registry=r
        )
        self.mqtt_connects_refused = Counter(
            "kcloak_mqtt_connects_refused",
            "CONNECTs the embedded MQTT server refused or timed out",
            ["reason"],
            registry=r,
        )
        self.mqtt_disconnects = Counter(
            "kcloak_mqtt_disconnects", "Connections the embedded MQTT server ended, by cause", ["reason"], registry=r
        )
        self.mqtt_server_dropped = Counter(
            "kcloak_mqtt_server_dropped",
            "Messages the embedded MQTT server dropped outside kcloak's input topics",
            ["reason"],
            registry=r,
        )
        self.mqtt_subscriptions_refused = Counter(
            "kcloak_mqtt_subscriptions_refused", "Topic filters refused by the embedded MQTT server's ACL", registry=r
        )

    def store_write(self, store: str, ok: bool) -> None:
        """Record a store write outcome (the ``listener`` of :class:`kcloak.broker.stores.WriteHealth`)."""
        self.store_healthy.labels(store=store).set(1 if ok else 0)
        if not ok:
            self.store_write_failures.labels(store=store).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
