"""A run in a caller protocol on the Node: sent natively, or translated to chat and back.

Anthropic Messages and OpenAI Responses runs (and Anthropic's `count_tokens`) arrive with
the caller's body (design §14). Translation is per-token work, so it happens here, on
the Node (design §3), and the Edge relays the bytes it is given.

Rules:
1. Native first. A run goes to the upstream as it is when its adapter relays natively
   (`NativeRelay`) and the provider speaks the protocol (`ProtocolSupport`); every
   other run is translated.
2. No caller sees a missing native endpoint. A 404/405 on it teaches the provider's
   `ProtocolSupport` (unless the operator's explicit `adapter.protocols` says
   otherwise: the run then fails with the upstream's answer) and the same run is
   translated at once.
3. Translated, the body becomes a chat completions request (`iop_node.protocols`); what
   cannot be said there is the caller's error: `invalid_request`, status 400, the
   message naming the field. The adapter runs chat as for any chat run, and the reply,
   or each stream chunk, is translated back. A reply the caller's protocol cannot carry
   fails the run as the upstream's fault (`upstream_error`, `upstream_stream_error`
   once output went out).
   Tools only a vendor's service runs are left out first and logged, unless the run's
   model refuses them (`run.hosted_tools`, `schemas.hosted_tools`).
4. A translated stream always asks the runtime for its usage chunk (`include_usage`);
   the chunk feeds the caller's protocol's own usage report and never reaches the caller
   as a chat chunk. A runtime that reports none (llama.cpp's Python server ignores the
   option; a cut stream) gets IOP's estimate (`schemas.tokens`): prompt tokens from the
   translated chat request, output tokens from the chunks it sent. A whole reply
   without usage shows the caller the counts the run is metered at, never zeros. A
   Messages stream's `message_start`, written before the runtime counted anything,
   reports that estimate of the prompt's tokens (its `message_delta`, the runtime's).
   A chunk the adapter has read already (`reply.ParsedChunk`) reaches the translator
   with that reading, so a chunk of text (most of a stream) is decoded once.
5. The caller's alias is the model name everywhere: the translators write it, and the
   native relay rewrites it (`adapters.native`).
6. `keep_output`: the final response object of a Responses stream (native: the
   `response.completed` event's; translated: the translator's) travels in
   `run_done.response`, so the Edge can store it. Such a response says `store: true`,
   as its caller asked, though the body says `store: false` (the Edge is the store and
   the runtime keeps nothing): the translators write it, the native relay rewrites it.
   With `hold_tail`, the events that end a stream travel in `run_done.tail` instead of
   ahead of the end (native: the relay's `message_delta`/`message_stop` or last
   `response.*`; translated: all the translator's `finish` writes), so no caller reads
   them before the Edge recorded the run's end.
7. `count_tokens` asks, in order: the upstream's own `/v1/messages/count_tokens` when it
   speaks Messages natively; the runtime's tokenizer endpoint, over the text of the
   request translated to chat (`rendered_prompt`: the messages, tool calls and tool
   definitions); IOP's estimator over that same text. Both counts of text add the chat
   template's share (`schemas.tokens.template_tokens`), which neither sees.
8. Claude Code's beta extras (`anthropic-beta`, `context_management`,
   `cache_control.ttl`) go to a native Messages runtime as they are; one that refuses
   them (400 "Extra inputs are not permitted") gets the run again without them, once,
   and, when that one succeeds, every later run without them (`protocols.anthropic_betas`).

The runner (`runner.py`) owns what is common to every run: the terminal message, the
output tally, cancellation, the payload bounds.
"""

from __future__ import annotations

import logging
from typing import Final, Protocol

import msgspec

from iop_node.adapters.base import (
    Adapter,
    AdapterError,
    EmitEvents,
    NativeRelay,
    NativeUnsupported,
    RunResult,
)
from iop_node.protocols import (
    MessagesStream,
    ReadChunk,
    ReplyTranslationError,
    ResponsesRequest,
    ResponsesStream,
    TokenUsage,
    TranslationError,
    messages_request_to_chat,
    messages_response_from_chat,
    read_responses_request,
    responses_request_to_chat,
    responses_response_from_chat,
)
from iop_node.protocols.anthropic_betas import refuses_betas, without_betas
from iop_node.reply import ParsedChunk
from schemas.hosted_tools import hosted_tool_types, may_offer_hosted_tools, without_hosted_tools
from schemas.protocols import CallerProtocol
from schemas.tokens import (
    chunk_tokens,
    estimate_input_tokens,
    output_chars,
    template_tokens,
    text_tokens,
)
from schemas.wire import FailureCode, Operation, Run, Usage, UsageSource

__all__ = ["PROTOCOL_OPERATIONS", "estimate_prompt_tokens", "execute_protocol"]

#: The operations this module runs (the others go to `Adapter.execute` as they are).
PROTOCOL_OPERATIONS: Final[frozenset[Operation]] = frozenset(
    {"messages", "responses", "count_tokens"}
)

log = logging.getLogger(__name__)

_encode: Final = msgspec.json.Encoder().encode
_decode_any: Final = msgspec.json.Decoder().decode


async def execute_protocol(run: Run, adapter: Adapter, events: EmitEvents) -> RunResult:
    """Run `run` (one of `PROTOCOL_OPERATIONS`) on `adapter` (see the module rules)."""
    relay = adapter if isinstance(adapter, NativeRelay) else None
    match run.operation:
        case "count_tokens":
            return await _count_tokens(run, relay)
        case "messages" | "responses" as protocol:
            pass
        case other:
            raise AdapterError(
                FailureCode.UNSUPPORTED_OPERATION, f"{other!r} is not a caller protocol"
            )
    if relay is not None and relay.protocol_support.speaks(protocol):
        try:
            return await _native(run, protocol, relay, events)
        except NativeUnsupported as exc:
            if not relay.protocol_support.learn_unsupported(protocol, exc.failure.message):
                raise exc.failure from None
    return await _translated(run, protocol, adapter, events)


async def _native(
    run: Run, protocol: CallerProtocol, relay: NativeRelay, events: EmitEvents
) -> RunResult:
    """Rule 8: a native run, without Anthropic's beta extras once its provider refused them,
    and sent again without them the first time it does."""
    support = relay.protocol_support
    if protocol != "messages":
        return await relay.execute_native(run, events)
    if not support.takes_betas:
        return await relay.execute_native(without_betas(run) or run, events)
    try:
        return await relay.execute_native(run, events)
    except AdapterError as exc:
        retry = without_betas(run) if refuses_betas(exc.status, exc.message) else None
        if retry is None:
            raise
        refused = exc
    try:
        result = await relay.execute_native(retry, events)
    except AdapterError as again:
        if refuses_betas(again.status, again.message):
            raise refused from None  # the extras were not the cause: nothing learned
        raise  # another failure proves nothing either way: nothing learned
    support.learn_refuses_betas(refused.message)
    return result


def estimate_prompt_tokens(run: Run) -> int:
    """IOP's estimate of a protocol run's input tokens: over the request translated to
    chat (what the runtime reads), or over the caller's body when it does not translate."""
    try:
        return estimate_input_tokens(_decode_any(_to_chat(run)))
    except (TranslationError, msgspec.DecodeError):
        pass
    try:
        body = _decode_any(run.body)
    except msgspec.DecodeError:
        return 0
    return estimate_input_tokens(body) if isinstance(body, dict) else 0


# --- translated ---------------------------------------------------------------------------------


class _StreamTranslator(Protocol):
    """What the Node needs of a stream translator (`iop_node.protocols`)."""

    @property
    def usage(self) -> TokenUsage | None: ...

    def feed(self, chunk: bytes, read: ReadChunk | None = None) -> bytes: ...

    def finish(self, usage: TokenUsage | None = None) -> bytes: ...


#: What the event line of an output delta ends with, per protocol (data lines never hold
#: a raw newline: JSON escapes it).
_DELTA_EVENTS: Final[dict[CallerProtocol, bytes]] = {
    "messages": b"event: content_block_delta\n",
    "responses": b".delta\n",
}


def _to_chat(run: Run) -> bytes:
    """The run's body as a chat completions request; `TranslationError` when it cannot be."""
    if run.operation == "responses":
        return responses_request_to_chat(run.body)
    return messages_request_to_chat(run.body)


def _alias(run: Run) -> str:
    """The model a translated reply names (Rule 5). Messages and Responses replies must
    name one, so a run without an alias names the served model, not nothing."""
    return run.reply_model or run.target


def _invalid(exc: TranslationError) -> AdapterError:
    """The caller's request cannot be translated (Rule 3): a 400 naming the field, in its
    message and as `param` (an OpenAI-shaped error body has a place for it)."""
    return AdapterError(FailureCode.INVALID_REQUEST, str(exc), status=400, param=exc.param)


async def _translated(
    run: Run, protocol: CallerProtocol, adapter: Adapter, events: EmitEvents
) -> RunResult:
    run = _without_hosted_tools(run, protocol)
    # A Responses request is read once: its reply echoes it and maps calls back through
    # the same tools.
    request: ResponsesRequest | None = None
    try:
        if protocol == "responses":
            request = read_responses_request(run.body)
            chat_body = responses_request_to_chat(request)
        else:
            chat_body = messages_request_to_chat(run.body)
    except TranslationError as exc:
        raise _invalid(exc) from None
    # The adapter runs plain chat: the translators write the caller's alias (Rule 5) and
    # the protocol headers mean nothing to a chat endpoint.
    chat_run = msgspec.structs.replace(
        run, operation="chat", body=chat_body, strip_usage=False, caller_headers={}
    )
    alias = _alias(run)
    request_id = run.request_id or run.run_id
    if not run.stream:
        return await _translated_response(run, request, chat_run, adapter)
    translator: _StreamTranslator
    # The prompt's tokens by IOP's estimator: what a Messages stream's `message_start`
    # reports before the runtime counts them, and the fallback when it never does.
    estimated_prompt = estimate_input_tokens(_decode_any(chat_body))
    if request is None:
        translator = MessagesStream(alias, request_id, input_tokens=estimated_prompt)
    else:
        translator = ResponsesStream(
            alias,
            request_id,
            request,
            stored=run.keep_output,
            previous_response_id=run.previous_response_id or None,
        )
    delta_marker = _DELTA_EVENTS[protocol]
    output_tokens = 0
    emitted = False

    async def emit(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
        nonlocal output_tokens, emitted
        try:
            out = translator.feed(data, parsed)
        except ReplyTranslationError as exc:
            raise _broken_reply(exc, emitted=emitted) from None
        # An adapter that read the chunk already says how much text it carries; for one
        # that did not (sim, cli), each delta event it made counts as one token, as for a
        # native stream, rather than the chunk being read twice.
        if parsed is not None:
            tokens = chunk_tokens(parsed.output_chars())
        else:
            tokens = out.count(delta_marker)
        output_tokens += tokens
        emitted = emitted or bool(out)
        await events(out, tokens)

    result = await adapter.execute(chat_run, emit)
    usage = translator.usage
    source: UsageSource = "provider"
    if usage is None and result.usage is not None:
        usage = TokenUsage(
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            cached_tokens=result.usage.cached_tokens,
        )
        source = result.usage_source
    if usage is None:  # Rule 4: the runtime reported none
        usage = TokenUsage(prompt_tokens=estimated_prompt, completion_tokens=output_tokens)
        source = "estimated"
    try:
        tail = translator.finish(usage)
    except ReplyTranslationError as exc:
        raise _broken_reply(exc, emitted=emitted) from None
    if not run.hold_tail:
        await events(tail, 0)
    final = None
    if run.keep_output and isinstance(translator, ResponsesStream):
        final = translator.final_response()
    return RunResult(
        usage=_wire_usage(usage),
        response=final,
        usage_source=source,
        tail=tail if run.hold_tail else None,
    )


def _without_hosted_tools(run: Run, protocol: CallerProtocol) -> Run:
    """The run without the hosted tools it offers (`schemas.hosted_tools`), logged; as it
    is when it offers none, or when its model refuses them (the translation then refuses
    the run naming the tool)."""
    if run.hosted_tools != "drop" or not may_offer_hosted_tools(run.body):
        return run
    try:
        body = _decode_any(run.body)
    except msgspec.DecodeError:
        return run  # the translation says what is wrong with it
    if not isinstance(body, dict) or not (dropped := hosted_tool_types(protocol, body)):
        return run
    log.info(
        "run %s on provider %s: left out the hosted tools %s, which only the vendor's "
        "service runs (the run is translated for a runtime)",
        run.run_id,
        run.provider_id,
        ", ".join(dropped),
    )
    return msgspec.structs.replace(run, body=_encode(without_hosted_tools(protocol, body)))


async def _translated_response(
    run: Run, request: ResponsesRequest | None, chat_run: Run, adapter: Adapter
) -> RunResult:
    """A whole reply, translated back: Responses when `request` is the Responses request
    read for the run, else Messages."""
    result = await adapter.execute(chat_run, _no_chunks)
    if result.response is None:
        raise AdapterError(
            FailureCode.UPSTREAM_ERROR,
            "the upstream sent no response",
            retryable=True,
            reply_fault=True,
        )
    usage, source = result.usage, result.usage_source
    if usage is None:
        # Rule 4, read off the chat exchange (the caller's protocol's shape has no
        # `choices` for the runner's estimate to count).
        prompt = estimate_input_tokens(_decode_any(chat_run.body))
        completion = chunk_tokens(output_chars(result.response), whole=True)
        usage = Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        source = "estimated"
    # The caller's body shows the runtime's own counts when its reply has them, else
    # what the run is metered at (an adapter's own count, or the estimate): never zeros.
    fallback = TokenUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )
    alias = _alias(run)
    request_id = run.request_id or run.run_id
    try:
        if request is None:
            response = messages_response_from_chat(
                result.response, reply_model=alias, request_id=request_id, usage=fallback
            )
        else:
            response = responses_response_from_chat(
                result.response,
                reply_model=alias,
                request_id=request_id,
                request=request,
                usage=fallback,
                stored=run.keep_output,
                previous_response_id=run.previous_response_id or None,
            )
    except ReplyTranslationError as exc:
        raise _broken_reply(exc, emitted=False) from None
    return RunResult(usage=usage, response=response, usage_source=source)


async def _no_chunks(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
    """A non-stream run emits nothing; an adapter that does anyway is broken."""
    raise AdapterError(
        FailureCode.INTERNAL, "the adapter emitted a stream chunk for a non-stream run"
    )


def _broken_reply(exc: ReplyTranslationError, *, emitted: bool) -> AdapterError:
    """The runtime's reply cannot be said in the caller's protocol (Rule 3)."""
    message = f"the upstream's reply cannot be translated: {exc}"
    if emitted:
        return AdapterError(FailureCode.UPSTREAM_STREAM_ERROR, message, reply_fault=True)
    return AdapterError(FailureCode.UPSTREAM_ERROR, message, retryable=True, reply_fault=True)


def _wire_usage(usage: TokenUsage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )


# --- count_tokens -------------------------------------------------------------------------------


class _Function(msgspec.Struct):
    name: str = ""
    arguments: str = ""
    description: str | None = None
    parameters: msgspec.Raw = msgspec.Raw()


class _ToolCall(msgspec.Struct):
    function: _Function | None = None


class _Part(msgspec.Struct):
    text: str | None = None


class _Message(msgspec.Struct):
    role: str = ""
    content: str | list[_Part] | None = None
    reasoning_content: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Tool(msgspec.Struct):
    function: _Function | None = None


class _Prompt(msgspec.Struct):
    """A chat request as far as its text goes."""

    messages: list[_Message] = []
    tools: list[_Tool] | None = None


_decode_prompt: Final = msgspec.json.Decoder(_Prompt).decode


def rendered_prompt(chat_body: bytes) -> str:
    """The text a runtime reads of a chat request: every message's role and text, its
    reasoning and tool calls, and the tool definitions (a chat template writes them into
    the prompt too, and an agent's run dozens of them: counting only the messages would
    leave out most of its prompt)."""
    prompt = _decode_prompt(chat_body)
    lines: list[str] = []
    for tool in prompt.tools or ():
        function = tool.function
        if function is not None:
            lines.append(function.name)
            if function.description:
                lines.append(function.description)
            if function.parameters:
                lines.append(bytes(function.parameters).decode())
    for message in prompt.messages:
        lines.append(message.role)
        content = message.content
        if isinstance(content, str):
            lines.append(content)
        elif content:
            lines.extend(part.text for part in content if part.text)
        if message.reasoning_content:
            lines.append(message.reasoning_content)
        for call in message.tool_calls or ():
            if call.function is not None:
                lines += (call.function.name, call.function.arguments)
    return "\n".join(lines)


async def _count_tokens(run: Run, relay: NativeRelay | None) -> RunResult:
    """Rule 7. Counting consumes nothing: the usage is zero, whoever counted."""
    if relay is not None and relay.protocol_support.counts_tokens:
        native_run = run
        if not relay.protocol_support.takes_betas:
            native_run = without_betas(run) or run
        count = await relay.count_tokens_native(native_run)
        if count is not None:
            return _counted(count, "provider")
    try:
        chat_body = messages_request_to_chat(_without_hosted_tools(run, "messages").body)
    except TranslationError as exc:
        raise _invalid(exc) from None
    text = rendered_prompt(chat_body)
    template = template_tokens(_decode_any(chat_body))
    if relay is not None:
        count = await relay.tokenize_count(run.target, text)
        if count is not None:
            return _counted(count + template, "provider")
    return _counted(text_tokens(text) + template, "estimated")


def _counted(count: int, source: UsageSource) -> RunResult:
    return RunResult(usage=Usage(), response=_encode({"input_tokens": count}), usage_source=source)
