"""A cluster worker's own series (docs/cluster.md "Workers", "Metrics").

A query is counted once in ``kcloak_queries_total``: by the door that answered the app (the gateway), as in one
process. What a worker decided about a query (its router's refusal, or its cell owner's answer) is counted in
``kcloak_cluster_worker_queries_total`` (same labels), so a node running a gateway and a worker does not count
the query twice, and a worker without a gateway still shows what it did.
"""

from __future__ import annotations

import weakref

from kcloak.broker.metrics import Counter, Metrics

WORKER_QUERIES = "kcloak_cluster_worker_queries"


class WorkerMetrics:
    """The worker's series, on the broker's registry (labels from fixed sets only)."""

    def __init__(self, metrics: Metrics) -> None:
        self.queries = Counter(
            WORKER_QUERIES,
            "Queries a cluster worker decided (its router refused them or its cell owner answered them)",
            ["transport", "kind", "status", "reason"],
            registry=metrics.registry,
        )


_BY_REGISTRY: weakref.WeakKeyDictionary[object, WorkerMetrics] = weakref.WeakKeyDictionary()


def worker_metrics(metrics: Metrics) -> WorkerMetrics:
    """The one :class:`WorkerMetrics` of ``metrics``'s registry (every router and owner of a process shares it)."""
    found = _BY_REGISTRY.get(metrics.registry)
    if found is None:
        found = _BY_REGISTRY[metrics.registry] = WorkerMetrics(metrics)
    return found


__all__ = ["WORKER_QUERIES", "WorkerMetrics", "worker_metrics"]
