"""The adapter interface every provider type implements.

An adapter owns the connection to one upstream runtime for one provider. The Node's
runner calls `execute` once per run, inside a cancel scope it owns: cancelling that scope
must stop the upstream work at once (close the HTTP stream, kill the process). Streamed
output goes out through `emit`, one OpenAI JSON chunk per call, as soon as it exists.

Failures are raised as `AdapterError`, whose fields map one-to-one onto the wire's
`run_failed`: the Edge decides on failover from `retryable` and `capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from iop_node.reply import ParsedChunk
from schemas.config import ProviderConfig
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
    adapter counts characters). With no `usage` at all, the runner estimates it."""

    usage: Usage | None = None
    response: bytes | None = None
    usage_source: UsageSource = "provider"


class AdapterError(Exception):
    """A run failed. `retryable`: nothing reached the upstream's output yet and another
    provider may succeed. `capacity`: the upstream said 429/503 (a load signal, not a
    health failure). `status`: the upstream HTTP status, when there was one."""

    def __init__(
        self,
        code: FailureCode,
        message: str,
        *,
        retryable: bool = False,
        capacity: bool = False,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.capacity = capacity
        self.status = status


class ProbeTimeout(Exception):
    """Raised by `probe()` when the upstream accepted the probe but did not answer in time.

    Not a verdict: a runtime that is generating may not answer its model list (SPEC §4.11),
    so the health monitor decides from the provider's runs whether it is busy or down."""


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
