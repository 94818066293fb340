"""Counters and histograms that every finished request updates, kept in plain numbers.

prometheus_client's `Counter` and `Histogram` are made for any thread: each `inc` and
`observe` checks the metric, takes a lock per value and walks the buckets in Python, and
`labels()` converts, checks and locks too. A finished request updates a dozen series, so
that machinery cost more than the rest of the request's bookkeeping together. The Edge
updates these series from its event loop only, and reads them from there too (`/metrics`
is rendered on the loop), so they need no lock: a child is a few numbers in a slotted
object, a histogram finds its bucket by bisection.

Rules:
1. Exposition is prometheus_client's: a family is a `Collector` of its registry, and
   yields the `CounterMetricFamily` / `HistogramMetricFamily` a `Counter` / `Histogram` of
   the same name, help, labels and buckets would (samples `_total` and `_created`;
   `_bucket` per bound and `+Inf`, cumulative, `_count`, `_sum`, `_created`), values as
   floats, children in the order they were first used.
2. A child is created on first use of its label values, with its creation time
   (`_created`), and lives as long as the family, as a prometheus_client child does.
3. Updated and read on one thread (the event loop); nothing here locks.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import INF, floatToGoString

from iop_edge.runtime.metering.compat.prometheus import created_series_enabled

__all__ = ["CounterChild", "CounterSeries", "HistogramChild", "HistogramSeries"]

#: prometheus_client's spelling of a bucket bound in `le` (untyped there).
_go_float: Final[Callable[[float], str]] = floatToGoString


class CounterChild:
    """One labelled counter: `inc` adds."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    """One labelled histogram: `observe` counts a value in its bucket and adds it to the
    sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        """Per bucket, not cumulative; the last one is `+Inf`'s."""
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        # The first bound >= value: the bucket `le` that counts it (past them all: +Inf).
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class _Series(Collector):
    """What both kinds share: name, help, label names, children by label values."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames: Final = tuple(labelnames)
        registry.register(self)


class CounterSeries(_Series):
    """A labelled counter (see the module docstring)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self._children: dict[tuple[str, ...], CounterChild] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> CounterChild:
        """The child of these label values, created on first use (Rule 2)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values")
            child = self._children[values] = CounterChild()
        return child

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = created_series_enabled()
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value, created=child.created if created else None)
        yield family


class HistogramSeries(_Series):
    """A labelled histogram with fixed buckets (see the module docstring)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        bounds = tuple(float(bound) for bound in buckets)
        if bounds and bounds[-1] == INF:
            bounds = bounds[:-1]
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must be in increasing order")
        self._bounds = bounds
        self._les: Final = (*(_go_float(b) for b in bounds), "+Inf")
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> HistogramChild:
        """The child of these label values, created on first use (Rule 2)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values")
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = created_series_enabled()
        les = self._les
        for values, child in list(self._children.items()):
            cumulative = 0.0
            buckets = []
            for le, count in zip(les, child.counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(values, buckets, child.sum)
            if created:
                labels = dict(zip(self.labelnames, values, strict=True))
                family.samples.append(Sample(f"{self.name}_created", labels, child.created))
        yield family
