"""``LoopHistogram`` is exposed exactly as prometheus-client's histogram: the same observations on
both, one registry each, must give the same scrape text. prometheus-client is the reference."""

from __future__ import annotations

import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from kcloak.broker.metrics import LATENCY_BUCKETS, RATIO_BUCKETS, LoopHistogram

LABELS = ["mqtt", "http", "a b", 'q"uote']


def _observations(bounds: tuple[float, ...]) -> st.SearchStrategy[list[tuple[str, float]]]:
    """Values on bucket edges, just beside them, 0, negative, huge, and anywhere."""
    edge = st.sampled_from(bounds)
    value = st.one_of(
        edge,
        edge.map(lambda b: b * (1 + 1e-12)),
        edge.map(lambda b: b * (1 - 1e-12)),
        st.just(0.0),
        st.floats(min_value=-1.0, max_value=1e6, allow_nan=False),
        st.floats(min_value=0.0, max_value=0.01, allow_nan=False).map(lambda x: round(x, 6)),
    )
    return st.lists(st.tuples(st.sampled_from(LABELS), value), max_size=60)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), bounds=st.sampled_from([LATENCY_BUCKETS, RATIO_BUCKETS]), by_name=st.booleans())
def test_the_scrape_equals_prometheus_clients_histogram(
    data: st.DataObject, bounds: tuple[float, ...], by_name: bool
) -> None:
    observed = data.draw(_observations(bounds))
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistogram("kcloak_test_seconds", "A test", ["transport"], buckets=bounds, registry=ours_reg)
    theirs = prometheus_client.Histogram(
        "kcloak_test_seconds", "A test", ["transport"], buckets=bounds, registry=theirs_reg
    )
    for label, value in observed:
        (ours.labels(transport=label) if by_name else ours.labels(label)).observe(value)
        theirs.labels(transport=label).observe(value)
    assert generate_latest(ours_reg) == generate_latest(theirs_reg)


def test_a_name_a_position_and_a_second_metric_are_kept_apart() -> None:
    reg = CollectorRegistry()
    h = LoopHistogram("kcloak_a", "A", ["kind"], buckets=(1.0, 2.0), registry=reg)
    g = LoopHistogram("kcloak_b", "B", ["kind", "status"], buckets=(1.0,), registry=reg)
    assert h.labels("knn") is h.labels(kind="knn")
    h.labels("knn").observe(1.5)
    g.labels(kind="knn", status="ok").observe(0.5)
    assert g.labels("knn", "ok") is g.labels(status="ok", kind="knn")
    text = generate_latest(reg).decode()
    assert 'kcloak_a_bucket{kind="knn",le="1.0"} 0.0' in text
    assert 'kcloak_a_bucket{kind="knn",le="2.0"} 1.0' in text
    assert 'kcloak_b_bucket{kind="knn",le="1.0",status="ok"} 1.0' in text
    assert "kcloak_a_sum" in text and "kcloak_b_count" in text


def test_wrong_labels_and_buckets_are_refused() -> None:
    h = LoopHistogram("kcloak_c", "C", ["kind"], buckets=(1.0,), registry=CollectorRegistry())
    with pytest.raises(ValueError, match="labels of kcloak_c"):
        h.labels(other="x")
    with pytest.raises(ValueError, match="labels of kcloak_c"):
        h.labels("a", "b")
    with pytest.raises(ValueError, match="not both"):
        h.labels("a", kind="b")
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("kcloak_d", "D", ["kind"], buckets=(2.0, 1.0), registry=CollectorRegistry())
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopHistogram("kcloak_e", "E", [], buckets=(1.0,), registry=(reg := CollectorRegistry()))
        prometheus_client.Histogram("kcloak_e", "E", buckets=(1.0,), registry=reg)
