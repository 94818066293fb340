"""prometheus_client's internal that metering reads (`metering.compat.prometheus`), proven
on the installed version: the switch exists, and it is the one `_created` samples follow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as prometheus_metrics

from iop_edge.runtime.metering.compat.prometheus import created_series_enabled


@pytest.fixture
def created_switch() -> Iterator[None]:
    before = prometheus_metrics._use_created
    yield
    prometheus_metrics._use_created = before


def test_the_switch_exists_and_is_a_bool() -> None:
    assert isinstance(prometheus_metrics._use_created, bool)


@pytest.mark.usefixtures("created_switch")
@pytest.mark.parametrize("enabled", [True, False])
def test_created_samples_follow_the_switch(enabled: bool) -> None:
    prometheus_metrics._use_created = enabled
    registry = CollectorRegistry()
    Counter("iop_probe_total", "a counter", registry=registry).inc()
    exposed = generate_latest(registry).decode()
    assert ("iop_probe_created" in exposed) is enabled
    assert created_series_enabled() is enabled
