"""The adapter interface every provider type implements.

An adapter owns the connection to one upstream runtime for one provider. The Node's
runner calls `execute` once per run, inside a cancel scope it owns: cancelling that scope
must stop the upstream work at once (close the HTTP stream, kill the process). Streamed
output goes out through `emit`, one OpenAI JSON chunk per call, as soon as it exists.

Failures are raised as `AdapterError`, whose fields map one-to-one onto the wire's
`run_failed`: the Edge decides on failover from `retryable` and `capacity`.

Every adapter speaks chat completions. One whose upstream may also speak the caller
protocols natively (Anthropic Messages, OpenAI Responses; design §14) is a `NativeRelay`
too: the Node sends such runs to it as they are while its `protocol_support` says the
upstream speaks them, and translates them to chat for every other adapter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from iop_node.protocol_support import ProtocolSupport
from iop_node.protocols.native import NativeForm
from iop_node.reply import ParsedChunk
from schemas.config import ProviderConfig
from schemas.protocols import CallerProtocol
from schemas.wire import FailureCode, ProviderStatus, Run, Usage, UsageSource


class Emit(Protocol):
    """Send one OpenAI JSON chunk (raw bytes) to the Edge; may block on back-pressure.

    An adapter that read the chunk already (`reply.read_chunk`) passes its reading along,
    so the chunk is parsed once (`reply`, Rule 5)."""

    async def __call__(self, data: bytes, parsed: ParsedChunk | None = None, /) -> None: ...


@dataclass(frozen=True, slots=True)
class RunResult:
    """How a run ended well: usage when known, and the whole JSON response for non-stream.

    `usage_source`: "estimated" when the adapter made the numbers up itself (the `cli`
    adapter counts characters). With no `usage` at all, the runner estimates it.

    `tail`: a caller-protocol stream's last events, held back from `events` for the
    run's end to carry (`run_done.tail`, when the run asks for it with `hold_tail`)."""

    usage: Usage | None = None
    response: bytes | None = None
    usage_source: UsageSource = "provider"
    tail: bytes | None = None


class AdapterError(Exception):
    """A run failed. `retryable`: nothing reached the upstream's output yet and another
    provider may succeed. `capacity`: the upstream said 429/503 (a load signal, not a
    health failure). `status`: the upstream HTTP status, when there was one.
    `upstream_code`, `param`: the upstream's error code and the field it named, for a
    request it refused (the caller acts on them). `reply_fault`: the upstream answered
    with an empty or malformed reply (`wire.RunFailed.reply_fault`). `retry_after_s`:
    how long a 429/503 upstream asked to be left alone (its `Retry-After`)."""

    def __init__(
        self,
        code: FailureCode,
        message: str,
        *,
        retryable: bool = False,
        capacity: bool = False,
        status: int | None = None,
        upstream_code: str | None = None,
        param: str | None = None,
        reply_fault: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.capacity = capacity
        self.status = status
        self.upstream_code = upstream_code
        self.param = param
        self.reply_fault = reply_fault
        self.retry_after_s = retry_after_s


class ProbeTimeout(Exception):
    """Raised by `probe()` when the upstream accepted the probe but did not answer in time.

    Not a verdict: a runtime that is generating may not answer its model list (design §4 item 11),
    so the health monitor decides from the provider's runs whether it is busy or down."""


@runtime_checkable
class ProbeWitness(Protocol):
    """An adapter that can tell whether its last probe reached the upstream: the runtime
    accepted the connection and the request went out, whatever came back. A probe that
    then times out met a runtime that is alive but busy (another client may be keeping
    it so), not one that is down (design §4 item 11)."""

    @property
    def probe_reached_upstream(self) -> bool: ...


class Adapter(Protocol):
    provider: ProviderConfig

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        """Run one request upstream; for `run.stream`, emit chunks as they come."""
        ...

    async def probe(self) -> ProviderStatus:
        """One cheap health check (list models, never a billed completion).

        The health monitor bounds it (callers own deadlines); a timeout the adapter sees
        itself is raised as `ProbeTimeout`, any other failure is an `unavailable` status."""
        ...

    async def aclose(self) -> None:
        """Release long-lived resources (HTTP clients). Called once, after the last run."""
        ...


# --- models on demand (design §18) ---------------------------------------------------------


class ModelCommandFailed(Exception):
    """The runtime did not load (or unload) the model; the message says why, in the
    runtime's words where it gave any."""


@runtime_checkable
class ModelLifecycle(Protocol):
    """An adapter whose runtime loads and unloads models on request. Each call returns
    once the runtime has done it (a load: the model answers), or raises
    `ModelCommandFailed`; the caller bounds the wait (`adapter.load_timeout_s`)."""

    async def load_model(self, model: str) -> None: ...

    async def unload_model(self, model: str) -> None: ...


# --- caller protocols spoken natively ---------------------------------------------------------


class EmitEvents(Protocol):
    """Send caller-ready bytes (whole server-sent events in the run's protocol) to the
    Edge; may block on back-pressure. `output` counts the generated pieces they carry
    (for the usage estimate of a run whose upstream reports none); empty `events` only
    tell that the upstream is alive."""

    async def __call__(self, events: bytes, output: int, /) -> None: ...


class NativeUnsupported(Exception):
    """The upstream has no endpoint for the run's protocol: its route answered 404, or
    405. The Node decides (`ProtocolSupport.learn_unsupported`) whether the run is
    translated instead or fails with `failure`."""

    def __init__(self, protocol: CallerProtocol, failure: AdapterError) -> None:
        super().__init__(failure.message)
        self.protocol = protocol
        self.failure = failure


class NativeRelay(ABC):
    """An adapter whose upstream may speak the caller protocols natively."""

    protocol_support: ProtocolSupport

    @abstractmethod
    async def execute_native(self, run: Run, native: NativeForm, events: EmitEvents) -> RunResult:
        """Send a run of the caller protocol `native` describes (Messages, Responses) to
        the upstream's own endpoint for it as it is.

        The reply comes back as the upstream wrote it but for `model` (`run.reply_model`):
        a non-stream run's object in `RunResult.response`, a stream's events through
        `events` (with `run.hold_tail`, its last events in `RunResult.tail` instead), and
        for a stream with `run.keep_output` the final response object in
        `RunResult.response`. Raises `NativeUnsupported` when the endpoint is missing."""

    @abstractmethod
    async def count_tokens_native(self, run: Run) -> int | None:
        """The upstream's own count of a `count_tokens` run's input tokens; None when it
        has no such endpoint (404/405)."""

    @abstractmethod
    async def tokenize_count(self, model: str, text: str) -> int | None:
        """The tokens of `text` by the runtime's own tokenizer; None when the runtime
        offers no tokenizer endpoint or it failed (the caller then estimates)."""
