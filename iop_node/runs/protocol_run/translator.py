"""What the Node does for a run of one caller protocol, behind one small interface, as
the adapters are behind theirs: a `Translator` (the package's rules say what it owes).

A translator names its protocol and the run operations it serves, how an upstream that
speaks the protocol serves it (`native`, a `NativeForm`; None: always translated), and
how it is traced. For a translated run it turns the caller's body into a chat
completions request (`translate`), and the `Translation` turns the chat reply back,
whole or a stream chunk at a time. Everything else a protocol run needs is here, once:
native first and learning (Rules 1-2), the hosted tools left out, the usage a runtime
never reported (Rule 4), the tail held for the run's end (Rule 6).
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Final, Protocol

import msgspec

from iop_node import tracing
from iop_node.adapters.base import (
    Adapter,
    AdapterError,
    EmitEvents,
    NativeRelay,
    NativeUnsupported,
    RunResult,
)
from iop_node.protocols import ReadChunk, ReplyTranslationError, TokenUsage, TranslationError
from iop_node.protocols.native import NativeForm
from iop_node.reply import ParsedChunk
from iop_node.tracing import ProtocolTrace
from schemas.hosted_tools import hosted_tool_types, may_offer_hosted_tools, without_hosted_tools
from schemas.tokens import chunk_tokens, estimate_input_tokens, output_chars
from schemas.wire import FailureCode, Run, Usage, UsageSource

__all__ = [
    "StreamTranslator",
    "Translation",
    "Translator",
    "alias",
    "estimate_prompt_tokens",
    "invalid",
]

log = logging.getLogger(__name__)

_encode: Final = msgspec.json.Encoder().encode
_decode_any: Final = msgspec.json.Decoder().decode
#: A `param`'s top-level field: what comes before its first `.` or `[`.
_TOP_FIELD: Final = re.compile(r"[^.\[]*")


class StreamTranslator(Protocol):
    """One run's chat stream, said in the caller's protocol (`iop_node.protocols`)."""

    @property
    def usage(self) -> TokenUsage | None: ...

    def feed(self, chunk: bytes, read: ReadChunk | None = None) -> bytes: ...

    def finish(self, usage: TokenUsage | None = None) -> bytes: ...


class Translation(ABC):
    """One run's request translated to chat completions, and its reply translated back."""

    def __init__(self, chat_body: bytes) -> None:
        self.chat_body = chat_body
        """The chat completions request the adapter runs."""

    @abstractmethod
    def stream(self, run: Run, input_tokens: int) -> StreamTranslator:
        """The translator of the run's stream (`input_tokens`: IOP's estimate of the
        prompt, for a protocol that reports it before the runtime has)."""

    @abstractmethod
    def reply(self, run: Run, response: bytes, usage: TokenUsage) -> bytes:
        """A whole chat reply in the caller's protocol; `usage` is what it shows where
        the reply has none. `ReplyTranslationError` when it cannot be said there."""

    def final_response(self) -> bytes | None:
        """The response object a kept run's stream ended with (`run.keep_output`), for
        `run_done.response`; None: the protocol keeps none."""
        return None


class Translator(ABC):
    """What the Node does for the runs of one caller protocol (module docstring)."""

    name: ClassVar[str]
    """The protocol's name: the Edge's `CallerProtocol` of the same name plans its runs."""
    operations: ClassVar[frozenset[str]]
    """The run operations it serves: its name, and any of its own (`count_tokens`)."""
    native: ClassVar[NativeForm | None] = None
    """How an upstream that speaks the protocol serves it; None: always translated."""
    trace: ClassVar[ProtocolTrace]
    """How its runs are traced: the protocol's name and how a stream says why it ended."""
    delta_event: ClassVar[bytes]
    """What the event line of an output delta ends with (data lines never hold a raw
    newline: JSON escapes it): a translated stream counts a token per delta event of an
    adapter that did not read its chunks."""
    chat_fields: ClassVar[Mapping[str, str]] = {}
    """The chat request's fields said in this protocol, for the `param` of a translated
    run's upstream refusal (Rule 9): chat's `messages` is Responses' `input`. A mapped
    field is named alone, since its items do not correspond one to one (a tool result is
    a chat message of its own, a system prompt one more); an unmapped one is as sent."""

    @abstractmethod
    def translate(self, run: Run) -> Translation:
        """The run's body as a chat completions request (Rule 3); `TranslationError`
        naming the field when it cannot be."""

    async def execute(self, run: Run, adapter: Adapter, events: EmitEvents) -> RunResult:
        """Run `run` on `adapter`: natively when the upstream speaks the protocol (Rule 1),
        translated otherwise or once it turns out not to (Rule 2)."""
        relay = adapter if isinstance(adapter, NativeRelay) else None
        form = self.native
        if relay is not None and form is not None and relay.protocol_support.speaks(self.name):
            try:
                return await self.relay(run, relay, form, events)
            except NativeUnsupported as exc:
                if not relay.protocol_support.learn_unsupported(self.name, exc.failure.message):
                    raise exc.failure from None
        return await self.translated(run, adapter, events)

    async def relay(
        self, run: Run, relay: NativeRelay, form: NativeForm, events: EmitEvents
    ) -> RunResult:
        """A native run (a protocol whose runtimes differ overrides it: Messages' betas)."""
        return await relay.execute_native(run, form, events)

    def caller_param(self, param: str) -> str:
        """An upstream refusal's `param`, in chat's terms, said in the caller's
        (`chat_fields`)."""
        field = _TOP_FIELD.match(param)
        assert field is not None  # the pattern matches every string
        return self.chat_fields.get(field.group(), param)

    async def translated(self, run: Run, adapter: Adapter, events: EmitEvents) -> RunResult:
        """Rules 3-6 and 9: the run translated to chat, run as any chat run, and back."""
        run = self.without_hosted_tools(run)
        try:
            translation = self.translate(run)
        except TranslationError as exc:
            raise invalid(exc) from None  # its param is the caller's path already
        try:
            return await self._run_translation(run, translation, adapter, events)
        except AdapterError as exc:
            if exc.param is not None:
                exc.param = self.caller_param(exc.param)
            raise

    async def _run_translation(
        self, run: Run, translation: Translation, adapter: Adapter, events: EmitEvents
    ) -> RunResult:
        # The adapter runs plain chat: the translators write the caller's alias (Rule 5)
        # and the protocol headers mean nothing to a chat endpoint.
        chat_run = msgspec.structs.replace(
            run, operation="chat", body=translation.chat_body, strip_usage=False, caller_headers={}
        )
        if not run.stream:
            return await _translated_response(run, translation, chat_run, adapter)
        # The prompt's tokens by IOP's estimator: what a stream may report before the
        # runtime counts them (Messages' `message_start`), and the fallback when it never does.
        estimated_prompt = estimate_input_tokens(_decode_any(translation.chat_body))
        translator = translation.stream(run, estimated_prompt)
        delta_marker = self.delta_event
        output_tokens = 0
        emitted = False

        async def emit(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
            nonlocal output_tokens, emitted
            tracing.upstream_model(data)
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
        return RunResult(
            usage=_wire_usage(usage),
            response=translation.final_response() if run.keep_output else None,
            usage_source=source,
            tail=tail if run.hold_tail else None,
        )

    def without_hosted_tools(self, run: Run) -> Run:
        """The run without the hosted tools it offers (`schemas.hosted_tools`), logged; as
        it is when it offers none, or when its model refuses them (the translation then
        refuses the run naming the tool)."""
        if run.hosted_tools != "drop" or not may_offer_hosted_tools(run.body):
            return run
        try:
            body = _decode_any(run.body)
        except msgspec.DecodeError:
            return run  # the translation says what is wrong with it
        if not isinstance(body, dict) or not (dropped := hosted_tool_types(self.name, body)):
            return run
        log.info(
            "run %s on provider %s: left out the hosted tools %s, which only the vendor's "
            "service runs (the run is translated for a runtime)",
            run.run_id,
            run.provider_id,
            ", ".join(dropped),
        )
        return msgspec.structs.replace(run, body=_encode(without_hosted_tools(self.name, body)))


def estimate_prompt_tokens(run: Run, translator: Translator) -> int:
    """IOP's estimate of a protocol run's input tokens: over the request translated to
    chat (what the runtime reads), or over the caller's body when it does not translate."""
    try:
        return estimate_input_tokens(_decode_any(translator.translate(run).chat_body))
    except (TranslationError, msgspec.DecodeError):
        pass
    try:
        body = _decode_any(run.body)
    except msgspec.DecodeError:
        return 0
    return estimate_input_tokens(body) if isinstance(body, dict) else 0


def alias(run: Run) -> str:
    """The model a translated reply names (Rule 5). A caller protocol's replies name one,
    so a run without an alias names the served model, not nothing."""
    return run.reply_model or run.target


def invalid(exc: TranslationError) -> AdapterError:
    """The caller's request cannot be translated (Rule 3): a 400 naming the field, in its
    message and as `param` (an OpenAI-shaped error body has a place for it)."""
    return AdapterError(FailureCode.INVALID_REQUEST, str(exc), status=400, param=exc.param)


async def _translated_response(
    run: Run, translation: Translation, chat_run: Run, adapter: Adapter
) -> RunResult:
    """A whole reply, translated back."""
    result = await adapter.execute(chat_run, _no_chunks)
    if result.response is None:
        raise AdapterError(
            FailureCode.UPSTREAM_ERROR,
            "the upstream sent no response",
            retryable=True,
            reply_fault=True,
        )
    tracing.upstream_model(result.response)
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
    try:
        response = translation.reply(run, result.response, fallback)
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
