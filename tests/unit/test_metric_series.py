"""The per-request series (`metering.series`) expose exactly what prometheus_client's own
`Counter` and `Histogram` would, for the same observations."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from iop_edge.runtime.metering.series import CounterSeries, HistogramSeries

BUCKETS = (0.005, 0.01, 0.1, 1, 2.5)
#: On a bound, between bounds, below the first, past the last, zero, a large count.
VALUES = (0.005, 0.0051, 0.0001, 0.0, 0.1, 0.7, 1.0, 2.5, 2.6, 1e9)


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition without `_created` samples (their timestamps differ)."""
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


def test_counters_and_histograms_expose_what_prometheus_client_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = CounterSeries("iop_things", "Things counted", ["model", "kind"], ours)
    histogram = HistogramSeries("iop_wait_seconds", "Waits", ["model"], ours, buckets=BUCKETS)
    their_counter = Counter("iop_things", "Things counted", ["model", "kind"], registry=theirs)
    their_histogram = Histogram(
        "iop_wait_seconds", "Waits", ["model"], buckets=BUCKETS, registry=theirs
    )
    for model in ("b", "a"):  # children in the order they were first used
        for kind, amount in (("prompt", 12), ("completion", 0), ("prompt", 3)):
            counter.labels(model, kind).inc(amount)
            their_counter.labels(model, kind).inc(amount)
        for value in VALUES:
            histogram.labels(model).observe(value)
            their_histogram.labels(model).observe(value)
    counter.labels("c", "x").inc()
    their_counter.labels("c", "x").inc()
    assert _exposition(ours) == _exposition(theirs)
    assert ours.get_sample_value("iop_wait_seconds_bucket", {"model": "a", "le": "0.005"}) == 3.0
    assert ours.get_sample_value("iop_wait_seconds_count", {"model": "a"}) == len(VALUES)
    assert ours.get_sample_value("iop_wait_seconds_sum", {"model": "a"}) == pytest.approx(
        math.fsum(VALUES)
    )


def test_every_child_has_its_created_sample() -> None:
    registry = CollectorRegistry()
    CounterSeries("iop_c", "c", ["x"], registry).labels("1").inc()
    HistogramSeries("iop_h", "h", ["x"], registry, buckets=BUCKETS).labels("1").observe(0.2)
    assert registry.get_sample_value("iop_c_created", {"x": "1"}) is not None
    assert registry.get_sample_value("iop_h_created", {"x": "1"}) is not None


def test_a_family_with_no_child_yet_is_still_described() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    CounterSeries("iop_c", "c", ["x"], ours)
    HistogramSeries("iop_h", "h", ["x"], ours, buckets=BUCKETS)
    Counter("iop_c", "c", ["x"], registry=theirs)
    Histogram("iop_h", "h", ["x"], buckets=BUCKETS, registry=theirs)
    assert _exposition(ours) == _exposition(theirs)


def test_misuse_is_refused_as_prometheus_client_refuses_it() -> None:
    registry = CollectorRegistry()
    counter = CounterSeries("iop_c", "c", ["x", "y"], registry)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("1", "2").inc(-1)
    with pytest.raises(ValueError, match="iop_c: expected 2 label values"):
        counter.labels("1")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        CounterSeries("iop_c", "again", ["x"], registry)
    with pytest.raises(ValueError, match="iop_h: buckets must be in increasing order"):
        HistogramSeries("iop_h", "h", ["x"], registry, buckets=(1, 0.5))
