"""One run, end to end: adapter in, exactly one terminal wire message out.

`execute_run` is the isolation boundary between the Node and provider code. Whatever
the adapter does, the Edge hears exactly one of:

- `run_done{usage, response}` when `adapter.execute` returns;
- `run_failed` with the adapter's own fields when it raises `AdapterError`;
- `run_failed{code: <reason>}` when the run was cancelled through its `RunHandle`
  (`cancelled` for an Edge `cancel`, `registry_retired` when a retiring registry's drain
  timed out, `node_stopping` on shutdown). The reason is recorded before the scope is
  cancelled, so the answer names why the run stopped, and a cancel that races a
  finishing adapter still answers with the cancel (the Edge asked for it);
- `run_failed{code: unknown_provider}` when this Node has no such provider (the Edge's
  view and ours can differ for a moment around a refresh: another provider may succeed);
- `run_failed{code: internal}` for any other exception: an adapter bug fails its run,
  never the Node;
- `run_failed{code: response_too_large}` for a chunk or response larger than the wire
  carries: sent, it would cost the Node its link to the Edge and every run on it.

Only a cancellation from *outside* the run (the session ending) sends nothing: the
connection the answer would travel on is gone, and the Edge fails the run itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from iop_node.adapters.base import Adapter, AdapterError, RunResult
from schemas.limits import MAX_PAYLOAD_BYTES
from schemas.wire import FailureCode, Message, Run, RunChunk, RunDone, RunFailed

log = logging.getLogger(__name__)

Send = Callable[[Message], Awaitable[None]]
"""Queue one message for the Edge (the session's single writer sends it)."""


@dataclass(eq=False, slots=True)
class RunHandle:
    """A run's own cancel scope plus the reason it was cancelled, if it was."""

    run_id: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    cancel_code: FailureCode | None = None
    cancel_message: str = ""
    cancel_retryable: bool = False
    emitted: bool = False
    """Whether any chunk went out; a failure after that is never retryable."""

    def cancel(self, code: FailureCode, message: str, *, retryable: bool = False) -> None:
        """Stop the run at once; the first reason given is the one the Edge hears.

        `retryable`: another provider may take the run over (it still is not, once a
        chunk went out)."""
        if self.cancel_code is None:
            self.cancel_code = code
            self.cancel_message = message
            self.cancel_retryable = retryable
        self.scope.cancel()


async def execute_run(run: Run, adapter: Adapter | None, handle: RunHandle, send: Send) -> None:
    """Execute `run` through `adapter` and send its chunks and terminal message."""
    if adapter is None:
        await send(
            RunFailed(
                run_id=run.run_id,
                code=FailureCode.UNKNOWN_PROVIDER,
                message=f"provider {run.provider_id!r} is not configured on this node",
                retryable=True,
            )
        )
        return
    await send(await _outcome(run, adapter, handle, send))


async def _outcome(run: Run, adapter: Adapter, handle: RunHandle, send: Send) -> Message:
    async def emit(data: bytes) -> None:
        if len(data) > MAX_PAYLOAD_BYTES:
            raise _too_large("a chunk", len(data))
        handle.emitted = True
        await send(RunChunk(run_id=run.run_id, data=data))

    result: RunResult | None = None
    failure: RunFailed | None = None
    with handle.scope:
        try:
            result = await adapter.execute(run, emit)
        except Exception as exc:  # the isolation boundary: adapter errors fail the run only
            failure = _failure(run, handle, exc)
    if handle.cancel_code is not None:
        return _failed(
            run,
            handle,
            handle.cancel_code,
            handle.cancel_message,
            retryable=handle.cancel_retryable,
        )
    if failure is not None:
        return failure
    if result is None:  # only a misbehaving adapter that swallowed our cancellation
        return _failed(run, handle, FailureCode.INTERNAL, "adapter returned no result")
    if result.response is not None and len(result.response) > MAX_PAYLOAD_BYTES:
        # Sent, it would make the Edge drop this link and every run on it.
        error = _too_large("the response", len(result.response))
        return _failed(run, handle, error.code, error.message)
    return RunDone(run_id=run.run_id, usage=result.usage, response=result.response)


def _too_large(what: str, size: int) -> AdapterError:
    return AdapterError(
        FailureCode.RESPONSE_TOO_LARGE,
        f"{what} of {size} bytes exceeds the wire's limit of {MAX_PAYLOAD_BYTES} bytes",
    )


def _failure(run: Run, handle: RunHandle, exc: Exception) -> RunFailed:
    error = _adapter_error(exc)
    if error is not None:
        return RunFailed(
            run_id=run.run_id,
            code=error.code,
            message=error.message,
            retryable=error.retryable and not handle.emitted,
            capacity=error.capacity,
            status=error.status,
        )
    log.error(
        "run %s on provider %s failed inside its adapter",
        run.run_id,
        run.provider_id,
        exc_info=exc,
    )
    return _failed(
        run,
        handle,
        FailureCode.INTERNAL,
        f"adapter error: {type(exc).__name__}: {exc}",
        retryable=True,
    )


def _adapter_error(exc: BaseException) -> AdapterError | None:
    """The `AdapterError` behind `exc`, looking through exception groups that an adapter's
    own nursery may wrap it in; `None` when something else went wrong too."""
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(AdapterError)
        if matched is not None and rest is None:
            return _adapter_error(matched.exceptions[0])
    return None


def _failed(
    run: Run, handle: RunHandle, code: FailureCode, message: str, *, retryable: bool = False
) -> RunFailed:
    return RunFailed(
        run_id=run.run_id,
        code=code,
        message=message,
        retryable=retryable and not handle.emitted,
    )
