"""The series children one kind of finished run updates, found once (`EdgeMetrics`).

A finished run updates up to a dozen children (`series`): its request count, its
latency, its queue wait, its tokens... each found by its label values, a tuple made and
looked up per child. Runs of one kind (the same model, provider, status, code, principal
and token) update the same children every time, so they are kept together under that
kind, and a run finds them with one lookup.

Rules:
1. A child is still made on the first run that updates it, by its series' `labels`
   (series Rule 2: what `/metrics` shows is what it showed before); until then its slot
   is empty.
2. Keeping a child changes nothing: a child lives as long as its family anyway.
3. One `RunSeries` per kind that ended on this Edge: as many as the combinations of
   those labels its runs had, each a dozen references.
"""

from __future__ import annotations

from typing import TypeVar

from iop_edge.runtime.metering.series import CounterChild, HistogramChild

__all__ = ["RunKind", "RunSeries"]

#: model, provider, status, code, principal_ref, token_ref.
RunKind = tuple[str, str, int, str, str, str]
_Child = TypeVar("_Child", CounterChild, HistogramChild)


class RunSeries:
    """The children of one kind of run (see the module docstring), each None until its
    first use (Rule 1)."""

    __slots__ = (
        "cache_cached",
        "cache_prompt",
        "estimated_completion",
        "estimated_prompt",
        "latency",
        "principal_queue_wait",
        "queue_wait",
        "rejections",
        "requests",
        "tokens_completion",
        "tokens_prompt",
        "ttft",
    )

    def __init__(self) -> None:
        self.requests: CounterChild | None = None
        self.latency: HistogramChild | None = None
        self.ttft: HistogramChild | None = None
        self.queue_wait: HistogramChild | None = None
        self.principal_queue_wait: HistogramChild | None = None
        self.rejections: CounterChild | None = None
        self.tokens_prompt: CounterChild | None = None
        self.tokens_completion: CounterChild | None = None
        self.cache_prompt: CounterChild | None = None
        self.cache_cached: CounterChild | None = None
        self.estimated_prompt: CounterChild | None = None
        self.estimated_completion: CounterChild | None = None

    def keep(self, slot: str, child: _Child) -> _Child:
        """Keep `child` in `slot` (its first use, Rule 1) and return it."""
        setattr(self, slot, child)
        return child
