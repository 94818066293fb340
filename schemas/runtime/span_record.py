"""One span as IOP records it: the data both the tracing runtime (`schemas.runtime.spans`) and the
OTLP writers (`schemas.runtime.otlp_encoding`, `schemas.runtime.compat.otlp_http`) read.

Apart so that the writers need nothing of the runtime that hands them the spans: the
runtime imports the writers, the writers import this, and nothing imports back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Literal

import msgspec

__all__ = [
    "AttributeValue",
    "Attributes",
    "Event",
    "Kind",
    "Parent",
    "Shared",
    "SharedAttributes",
    "SpanRecorder",
]

Kind = Literal["internal", "server", "client"]
AttributeValue = str | int | float | bool | Sequence[str]
Attributes = dict[str, AttributeValue]
Event = tuple[str, int, Attributes]
"""An event: its name, when (ns since the epoch), its attributes."""

_time_ns: Final = time.time_ns


class Parent(msgspec.Struct, frozen=True, gc=False):
    """The span a new span continues: the caller's or the Edge's (`remote`), or one of
    this process's own. Not tracked by the cyclic collector: it holds no container."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str = ""
    remote: bool = True


class SharedAttributes(msgspec.Struct, frozen=True, gc=False):
    """Attributes that many spans carry alike (a route's, a model's, a provider's),
    written as OTLP once (`schemas.runtime.otlp_encoding`): a span that carries the set costs
    one reference instead of an encoding per attribute. Made through `SharedSets`; not
    tracked by the cyclic collector (it holds names and numbers)."""

    values: Mapping[str, AttributeValue]
    encoded: bytes
    """The attributes as fields of a `Span` message."""


Shared = tuple[SharedAttributes, ...]
"""The shared attribute sets of a span (`SpanRecorder.shared`)."""


class SpanRecorder(msgspec.Struct, gc=False):
    """One span being recorded (see the module docstring); made by `Tracing.start`.
    `end` hands it on, once.

    Not tracked by the cyclic collector: a finished span waits in the export queue, and
    a queue of tracked objects is walked by every collection until it drains. What it
    holds refers to nothing that refers back to it, but for the pipeline that takes it:
    `end` lets go of that (`_emit`) as it hands the span on."""

    _emit: Callable[[SpanRecorder], None] | None
    name: str
    kind: Kind
    parent: Parent | None
    trace_id: int
    """The parent's, or new for a root."""
    span_id: int
    tracestate: str
    """The parent's `tracestate`, carried on."""
    sampled: bool
    start_ns: int
    end_ns: int = 0
    """When the span ended; 0 while it has not."""
    attributes: Attributes = {}
    """The span's own attributes (each written as it is exported)."""
    shared: Shared = ()
    """Attributes it shares with other spans (`SharedSets`, added with `+=`); no key is
    both here and in `attributes`."""
    events: list[Event] | None = None
    """Its events (None: none yet; most spans have none)."""
    error: bool = False

    def event(self, name: str, attributes: Attributes) -> None:
        if self.sampled:
            if self.events is None:
                self.events = [(name, _time_ns(), attributes)]
            else:
                self.events.append((name, _time_ns(), attributes))

    def carrier(self) -> tuple[str, str]:
        """`(traceparent, tracestate)` that make this span the parent of what follows."""
        flags = "01" if self.sampled else "00"
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{flags}", self.tracestate

    def as_parent(self) -> Parent:
        """This span as the parent of another span of this process."""
        return Parent(self.trace_id, self.span_id, self.sampled, self.tracestate, False)

    def end(self, end_ns: int | None = None) -> None:
        """The span is over (at `end_ns`, else now); later calls do nothing."""
        if self.end_ns:
            return
        self.end_ns = end_ns or _time_ns()
        emit = self._emit
        self._emit = None
        if self.sampled and emit is not None:
            emit(self)
