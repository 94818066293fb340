"""prometheus_client's one internal that metering reads: whether `_created` series are on.

prometheus_client exposes a `_created` sample beside every counter and histogram unless
`PROMETHEUS_DISABLE_CREATED_SERIES` is set or `disable_created_metrics()` was called; it
keeps that switch in the private `prometheus_client.metrics._use_created`. IOP's own
series (`metering.series`) follow the same switch, so the two kinds of metric agree.
Bounded above in `pyproject.toml`; `tests/compat/test_prometheus.py` checks the
attribute and its meaning on the installed version.
"""

from __future__ import annotations

from prometheus_client import metrics as _prometheus_metrics

__all__ = ["created_series_enabled"]


def created_series_enabled() -> bool:
    """Whether `_created` samples are exposed (prometheus_client's own switch)."""
    return bool(getattr(_prometheus_metrics, "_use_created", True))
