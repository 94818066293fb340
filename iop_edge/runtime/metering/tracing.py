"""The Edge's trace of each caller request (design §16), for OpenTelemetry.

One SERVER span per request on the run endpoints, opened as the request arrives and
ended once its reply is written. It continues the caller's W3C `traceparent`, and its
own context travels to the Node in `run.traceparent`, so the Node's attempt spans, and
the upstream call under each, join the same trace.

What happens to the request shows as events on the span, added by the run
(`runs.dispatch`): `iop.admitted` when it got a slot (its queue wait, the provider and
node, which attempt), `iop.not_admitted` when it did not (queue full, queue timeout, a
principal's limit), `iop.attempt_failed` for an attempt that failed before its first
byte (the failure code) and `iop.failover` when another provider gets the run, with the
code that sent it there. When the run ends, its metering record gives the GenAI
attributes (`schemas.runtime.telemetry` has the vocabulary): operation, provider name, the alias
asked for, `max_tokens`, the usage and where it came from, plus IOP's own: principal,
provider id, node id, caller protocol. The Edge relays the provider's bytes without
reading them, so what only the output says (the response model, the finish reasons) is
on the Node's span.

Rules:
1. Nothing here runs unless tracing is on: the Edge then holds an `EdgeTracing`, else
   None, and every call site checks that None first. Importing this module imports no
   OpenTelemetry module.
2. A span that the sampler dropped still carries its trace context downstream (flags 00,
   so the Node drops its spans too) and records nothing: each method returns at once.
3. Attributes hold names, ids, counts and codes; never a prompt, a completion, a token or
   a credential (the principal's `principal_ref`, not its token).
4. The span is recorded by `schemas.runtime.spans` (a plain record, handed to the SDK's export
   pipeline as it ends). What many requests say alike (the route; the operation, model,
   principal and protocol; who served it) is one shared attribute set each
   (`schemas.runtime.spans.SharedSets`), written once; the request id, bound, usage and status
   are the span's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import trio

from iop_edge.runtime.metering.metering import RunRecord
from schemas.config import TelemetrySection
from schemas.runtime.spans import (
    Attributes,
    SharedSets,
    SpanRecorder,
    Tracing,
    remote_parent,
    start_tracing,
)
from schemas.runtime.telemetry import OPERATION_NAMES, SHUTDOWN_TIMEOUT_S, trace_settings

__all__ = ["EdgeTracing", "RequestTrace", "edge_tracing"]

#: How the Edge config spells each telemetry setting (error messages name it).
_CONFIG_KEYS: Final = {
    name: f"edge.telemetry.{name}"
    for name in ("endpoint", "protocol", "sampler", "sampler_arg", "service_name")
}
#: The request fields that bound a run's output, by caller protocol.
_MAX_TOKENS_KEYS: Final = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def edge_tracing(
    section: TelemetrySection,
    environ: Mapping[str, str],
    *,
    instance_id: str,
    version: str,
    provider_name: Callable[[str], str],
) -> EdgeTracing | None:
    """The Edge's tracing per its config and environment, or None when off
    (`schemas.runtime.telemetry` Rules 1-2). Raises `TelemetryError` naming a bad setting, and
    `TelemetryUnavailable` when the SDK is missing."""
    settings = trace_settings(section, environ, default_service="iop-edge", names=_CONFIG_KEYS)
    if settings is None:
        return None
    return EdgeTracing(
        start_tracing(settings, instance_id=instance_id, version=version), provider_name
    )


class EdgeTracing:
    """Opens a `RequestTrace` per request; owns the export pipeline (`aclose`)."""

    def __init__(self, tracing: Tracing, provider_name: Callable[[str], str]) -> None:
        self._tracing = tracing
        self.provider_name = provider_name
        """`gen_ai.provider.name` of a provider id (the running config's)."""
        self._shared = SharedSets()

    @property
    def endpoint(self) -> str:
        return self._tracing.settings.endpoint

    def begin(
        self, *, method: str, path: str, request_id: str, traceparent: str, tracestate: str
    ) -> RequestTrace:
        """The span of a request that just arrived, continuing the caller's trace; it
        carries the `x-request-id` the caller gets from the start, so a request refused
        before it was planned joins its access line too."""
        span = self._tracing.start(
            f"{method} {path}", "server", remote_parent(traceparent, tracestate)
        )
        if span.sampled:
            key = ("route", method, path)
            route = self._shared.get(key)
            if route is None:
                route = self._shared.add(key, {"http.request.method": method, "url.path": path})
            span.shared += route
            span.attributes["iop.request_id"] = request_id
        return RequestTrace(span, self.provider_name, self._shared)

    async def aclose(self) -> None:
        """Send what is queued and stop exporting, in a worker thread, under a deadline
        (a receiver that does not answer must not hold a stopping Edge)."""
        with trio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
            await trio.to_thread.run_sync(self._tracing.shutdown, abandon_on_cancel=True)


class RequestTrace:
    """The span of one caller request (see the module docstring)."""

    __slots__ = ("_provider_name", "_shared", "recording", "span", "traceparent", "tracestate")

    def __init__(
        self, span: SpanRecorder, provider_name: Callable[[str], str], shared: SharedSets
    ) -> None:
        self.span = span
        self._provider_name = provider_name
        self._shared = shared
        self.recording = span.sampled
        self.traceparent, self.tracestate = span.carrier()
        """What the Node continues (`run.traceparent`): this span as the parent."""

    def planned(
        self,
        *,
        model: str,
        operation: str,
        protocol: str,
        principal_ref: str,
        body: Mapping[str, Any],
    ) -> None:
        """The request is valid: what it asks for."""
        if not self.recording:
            return
        plan_key = ("plan", operation, model, principal_ref, protocol)
        plan = self._shared.get(plan_key)
        if plan is None:
            plan = self._shared.add(
                plan_key,
                {
                    "gen_ai.operation.name": OPERATION_NAMES.get(operation, operation),
                    "gen_ai.request.model": model,
                    "iop.principal_ref": principal_ref,
                    "iop.protocol": protocol,
                },
            )
        self.span.shared += plan
        attributes = self.span.attributes
        for key in _MAX_TOKENS_KEYS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                attributes["gen_ai.request.max_tokens"] = value
                break

    def admitted(self, *, queued_s: float, provider_id: str, node_id: str, attempt: int) -> None:
        self.span.event(
            "iop.admitted",
            {
                "iop.queue_wait_s": queued_s,
                "iop.provider.id": provider_id,
                "iop.node.id": node_id,
                "iop.attempt": attempt,
            },
        )

    def not_admitted(self, *, reason: str, code: str) -> None:
        """The request was refused before it ran: `code` is its error's (`queue_full`,
        `rate_limit_requests`...), `reason` its message."""
        self.span.event("iop.not_admitted", {"iop.reason": code, "message": reason})

    def attempt_failed(
        self, *, provider_id: str, node_id: str, code: str, retryable: bool, attempt: int
    ) -> None:
        self.span.event(
            "iop.attempt_failed",
            {
                "iop.provider.id": provider_id,
                "iop.node.id": node_id,
                "error.type": code,
                "iop.retryable": retryable,
                "iop.attempt": attempt,
            },
        )

    def failover(self, *, provider_id: str, reason: str) -> None:
        self.span.event("iop.failover", {"iop.provider.id": provider_id, "iop.reason": reason})

    def finished(self, record: RunRecord) -> None:
        """The run ended: who served it and what it consumed."""
        if not self.recording:
            return
        provider = record.provider
        name = self._provider_name(provider) if provider else ""
        key = ("served", record.usage_source, provider, name, record.node)
        served = self._shared.get(key)
        if served is None:
            values: Attributes = {"iop.usage_source": record.usage_source}
            if provider:
                values["iop.provider.id"] = provider
                values["gen_ai.provider.name"] = name
            if record.node:
                values["iop.node.id"] = record.node
            served = self._shared.add(key, values)
        self.span.shared += served
        usage = record.usage
        if usage is not None:
            attributes = self.span.attributes
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens

    def end(self, *, status: int, code: str | None) -> None:
        """The reply is written (or the caller left: 499): the span ends."""
        span = self.span
        if self.recording:
            attributes = span.attributes
            attributes["http.response.status_code"] = status
            if status >= 400:
                attributes["error.type"] = code or str(status)
            span.error = status >= 500
        span.end()
