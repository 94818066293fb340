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

Everything the run sends is shaped for the caller first (`reply.ReplyShaper`: the
caller's alias, usage kept and its chunk stripped when not asked for, stream chunks
framed as server-sent events), so the Edge relays bytes. A run in a caller protocol
(Messages, Responses, `count_tokens`) is shaped by `protocol_run` instead, natively or
translated, and its events and response arrive here caller-ready. Chunks leave as
`Chunk` items; the session's writer batches them into `run_events` messages. A
protocol stream's last events, held back for a run with `hold_tail`, leave inside its
`run_done` (`tail`), or ahead of it as a chunk when the end's message cannot hold them
beside a whole response.

Every terminal message says what the run consumed (design §7, no run unmetered): the
provider's usage when it reported some (`usage_source: provider`), else an estimate
(`estimated`): prompt tokens from `schemas.tokens.estimate_input_tokens` (for a run that
finished, the runtime's own tokenizer's count when it has one, asked then, briefly), completion
tokens from the output the run emitted (`OutputTally`). A failed run is estimated when it
produced output or was stopped while the provider worked on it (cancelled, timed out,
cut); one the upstream refused outright consumed nothing and carries no usage.

The runner also keeps the run's `RunActivity` (start, then every emitted chunk), which
the health monitor reads to tell a busy provider from a dead one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

import msgspec
import trio

from iop_node import tracing
from iop_node.adapters.base import Adapter, AdapterError, RunResult
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.reply import NotAnObject, ParsedChunk, ReplyShaper, read_chunk
from iop_node.runs.activity import RunActivity
from iop_node.runs.protocol_run import (
    ADAPTER_OPERATIONS,
    TRANSLATORS,
    Translator,
    estimate_prompt_tokens,
)
from schemas.limits import MAX_PAYLOAD_BYTES
from schemas.tokens import OutputTally, estimate_input_tokens
from schemas.wire import FailureCode, Message, Run, RunDone, RunFailed, Usage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Caller-ready bytes of one run on their way to the writer, which batches them."""

    run_id: str
    data: bytes


Outbound = Message | Chunk
Send = Callable[[Outbound], Awaitable[None]]
"""Queue one message or chunk for the Edge (the session's single writer sends it)."""


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
    activity: RunActivity | None = None
    """The run's signs of life, for the health monitor (set by the registry)."""

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
    """Execute `run` through `adapter` and send its chunks and terminal message.

    When the Node traces, the run is one attempt span (`iop_node.tracing`): it ends as
    the run's answer leaves, or without one when the run is cut from outside. The run is
    awaited here, not in a helper coroutine: each await in the chain is one more frame
    every resumption of the run passes through."""
    translator = TRANSLATORS.of(run.operation)  # None: the adapter runs it as it is
    node_tracing = tracing.current()
    if node_tracing is None:
        if adapter is None:
            await send(_unknown_provider(run))
        else:
            await send(await _outcome(run, adapter, handle, send, None, translator=translator))
        return
    trace = node_tracing.attempt(
        run,
        adapter.provider if adapter is not None else None,
        None if translator is None else translator.trace,
    )
    message: Message | None = None
    try:
        if adapter is None:
            message = _unknown_provider(run)
        else:
            with trace.active():
                message = await _outcome(run, adapter, handle, send, trace, translator=translator)
    finally:
        trace.finish(message)  # before the Edge hears the end: the span is complete
    await send(message)


def _unknown_provider(run: Run) -> RunFailed:
    return RunFailed(
        run_id=run.run_id,
        code=FailureCode.UNKNOWN_PROVIDER,
        message=f"provider {run.provider_id!r} is not configured on this node",
        retryable=True,
    )


async def _outcome(
    run: Run,
    adapter: Adapter,
    handle: RunHandle,
    send: Send,
    trace: tracing.AttemptTrace | None,
    *,
    translator: Translator | None,
) -> Message:
    shaper = ReplyShaper(run)
    tally = OutputTally()
    activity = handle.activity

    async def emit(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
        if len(data) > MAX_PAYLOAD_BYTES:
            raise _too_large("a chunk", len(data))
        try:
            if parsed is None:
                parsed = read_chunk(data)
            if trace is not None:  # before the shaper puts the caller's alias in
                trace.chunk(parsed.fields, parsed.choices)
            event = shaper.event(parsed)
        except NotAnObject as exc:
            raise _broken_output(handle, f"a chunk is {exc}") from None
        if activity is not None:
            activity.output()
        tally.add_chars(parsed.output_chars())
        if event is not None:
            handle.emitted = True
            await send(Chunk(run.run_id, event))

    async def emit_events(events: bytes, output_tokens: int, /) -> None:
        """Caller-ready events of a protocol run (`protocol_run`)."""
        if len(events) > MAX_PAYLOAD_BYTES:
            raise _too_large("a chunk", len(events))
        if activity is not None:
            activity.output()
        if trace is not None:
            trace.events(events)
        tally.add_tokens(output_tokens)
        if events:
            handle.emitted = True
            await send(Chunk(run.run_id, events))

    result: RunResult | None = None
    failure: RunFailed | None = None
    with handle.scope:
        try:
            if translator is not None:
                result = await translator.execute(run, adapter, emit_events)
            elif run.operation in ADAPTER_OPERATIONS:
                result = await adapter.execute(run, emit)
            else:  # a caller protocol this Node has no translator for (another release's)
                raise AdapterError(
                    FailureCode.UNSUPPORTED_OPERATION,
                    f"operation {run.operation!r} is no caller protocol this Node runs",
                )
        except Exception as exc:  # the isolation boundary: adapter errors fail the run only
            failure = _failure(run, handle, exc)
    if handle.cancel_code is not None:
        failure = _failed(
            run,
            handle,
            handle.cancel_code,
            handle.cancel_message,
            retryable=handle.cancel_retryable,
        )
    elif failure is None and result is None:  # a misbehaving adapter swallowed our cancel
        failure = _failed(run, handle, FailureCode.INTERNAL, "adapter returned no result")
    if failure is not None:
        if run.operation != "count_tokens" and (tally.pieces or failure.code in _CUT_WHILE_WORKING):
            failure = msgspec.structs.replace(
                failure, usage=_estimate(run, tally, translator), usage_source="estimated"
            )
        return failure
    assert result is not None
    response = result.response
    if trace is not None and response is not None:
        trace.response(response, upstream_model=translator is None)
    if response is not None and translator is None:
        try:
            response = shaper.response(response, read_usage=result.usage is None)
        except NotAnObject as exc:
            return _failure(run, handle, _broken_output(handle, f"the response is {exc}"))
    if response is not None and len(response) > MAX_PAYLOAD_BYTES:
        # Sent, it would make the Edge drop this link and every run on it.
        error = _too_large("the response", len(response))
        return _failed(run, handle, error.code, error.message)
    tail = result.tail or None
    if trace is not None and tail is not None:
        trace.events(tail)  # the held-back end says why the stream ended
    if tail is not None and len(tail) > MAX_PAYLOAD_BYTES:
        error = _too_large("the stream's last events", len(tail))  # as a chunk would
        return _failed(run, handle, error.code, error.message)
    if tail is not None and len(response or b"") + len(tail) > MAX_PAYLOAD_BYTES:
        # The end's message cannot hold both (a stored Responses run repeats its whole
        # output in each): the events go ahead, as from a Node that holds none back.
        await send(Chunk(run.run_id, tail))
        tail = None
    usage = result.usage or shaper.usage
    if usage is not None:
        return RunDone(
            run_id=run.run_id,
            usage=usage.bounded(),
            response=response,
            usage_source=result.usage_source if result.usage is not None else "provider",
            tail=tail,
        )
    if response is not None:
        tally.add(response, whole=True)
    return RunDone(
        run_id=run.run_id,
        usage=(await _counted_estimate(run, tally, adapter, translator)).bounded(),
        response=response,
        usage_source="estimated",
        tail=tail,
    )


def _broken_output(handle: RunHandle, what: str) -> AdapterError:
    """The upstream's output cannot be shaped for the caller (`reply`, Rule 4)."""
    if handle.emitted:
        return AdapterError(
            FailureCode.UPSTREAM_STREAM_ERROR, f"upstream output broke: {what}", reply_fault=True
        )
    return AdapterError(
        FailureCode.UPSTREAM_ERROR, f"bad upstream output: {what}", retryable=True, reply_fault=True
    )


#: Failures that stop a run while the provider may be working on it: what it consumed
#: is estimated even when it produced nothing yet (its prompt was being read).
_CUT_WHILE_WORKING = frozenset(
    {
        FailureCode.CANCELLED,
        FailureCode.REGISTRY_RETIRED,
        FailureCode.NODE_STOPPING,
        FailureCode.UPSTREAM_TIMEOUT,
        FailureCode.UPSTREAM_STREAM_ERROR,
    }
)

_decode_body = msgspec.json.Decoder().decode
#: How long a run that finished without usage may wait for the runtime's own count of its
#: prompt (`_counted_estimate`); past it, the estimate stands.
RUNTIME_COUNT_TIMEOUT_S: Final = 0.5
#: The operations whose prompt a runtime's tokenizer counts (embeddings report usage).
_COUNTED: Final = frozenset({"chat", "completion"})


def _estimate(run: Run, tally: OutputTally, translator: Translator | None) -> Usage:
    """The run's usage by IOP's estimators (see the module docstring); `translator`: its
    caller protocol's, when it is not run as it is."""
    if translator is not None:
        prompt = estimate_prompt_tokens(run, translator)
    else:
        try:
            body = _decode_body(run.body)
        except msgspec.DecodeError:
            body = None
        prompt = estimate_input_tokens(body) if isinstance(body, dict) else 0
    completion = tally.tokens()
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def _counted_estimate(
    run: Run, tally: OutputTally, adapter: Adapter, translator: Translator | None
) -> Usage:
    """`_estimate`, with the prompt counted by the runtime's own tokenizer when it has
    one: asked only here (a run that finished without usage), within
    `RUNTIME_COUNT_TIMEOUT_S`, past which the estimate stands."""
    usage = _estimate(run, tally, translator)
    if not isinstance(adapter, OpenAICompatAdapter) or run.operation not in _COUNTED:
        return usage
    try:
        body = _decode_body(run.body)
    except msgspec.DecodeError:
        return usage
    if not isinstance(body, dict):
        return usage
    with trio.move_on_after(RUNTIME_COUNT_TIMEOUT_S):
        counted = await adapter.runtime_prompt_tokens(run.target, body)
        if counted is not None:
            completion = usage.completion_tokens
            return Usage(
                prompt_tokens=counted,
                completion_tokens=completion,
                total_tokens=counted + completion,
            )
    return usage


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
            message=_bounded_text(error.message),
            retryable=error.retryable and not handle.emitted,
            capacity=error.capacity,
            status=error.status,
            upstream_code=error.upstream_code,
            param=error.param,
            reply_fault=error.reply_fault,
            retry_after_s=error.retry_after_s,
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
        message=_bounded_text(message),
        retryable=retryable and not handle.emitted,
    )


#: The longest failure text a run's end carries (the Edge keeps no more, and a batch of
#: run ends must stay far below the wire's frame limit).
MAX_FAILURE_TEXT: Final = 8192


def _bounded_text(text: str) -> str:
    return text if len(text) <= MAX_FAILURE_TEXT else text[: MAX_FAILURE_TEXT - 1] + "…"
