"""Chat completions as the translators read them: a response, a stream chunk, a usage.

Runtimes differ in what they put in a chat reply, so these views are lenient on purpose:
every field is optional, unknown fields are skipped, and the two names runtimes use for
reasoning (`reasoning_content`: llama.cpp, vLLM, SGLang, DeepSeek; `reasoning`: newer
vLLM, Ollama, OpenRouter) are both read. Only what the Messages and Responses shapes can
carry is decoded; the rest of a chunk is never looked at.

A value of the wrong type (a runtime that sends `"usage": "n/a"`) is a
`ReplyTranslationError` naming the field, so a broken upstream fails its run with a
message that says where, rather than an exception from deep inside a translator.

A chunk a relay has read already (`ReadChunk`) is not decoded again when it carries
only text (`text_delta`), which is most of a stream: the relay's reading has all of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final, Literal, NamedTuple, Protocol

import msgspec

from iop_node.cache_timings import timings_cached
from iop_node.protocols.errors import ReplyTranslationError, join_path
from schemas.tokens import ChoiceView

__all__ = [
    "ChatChunk",
    "ChatResponse",
    "ChunkChoice",
    "Delta",
    "NamedCall",
    "ReadChunk",
    "StopReason",
    "TextDelta",
    "TokenUsage",
    "ToolCallDelta",
    "UsageView",
    "named_calls",
    "read_chunk",
    "read_response",
    "stop_reason",
    "text_delta",
]


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True):
    """A run's token counts as chat completions reports them. `prompt_tokens` includes
    `cached_tokens` (OpenAI's convention); `completion_tokens` includes
    `reasoning_tokens`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _CompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class UsageView(msgspec.Struct):
    """A chat `usage` object; counts an upstream leaves out are 0, negative ones too."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None

    def tokens(self, timings_cached: int | None = None) -> TokenUsage:
        """The counts; the cached ones from `prompt_tokens_details`, else from llama.cpp's
        `timings` (`timings_cached`, read by `ChatChunk.tokens`)."""
        prompt = max(self.prompt_tokens or 0, 0)
        details = self.prompt_tokens_details
        cached = details.cached_tokens if details is not None else None
        if cached is None:
            cached = timings_cached
        completion = self.completion_tokens_details
        return TokenUsage(
            prompt_tokens=prompt,
            completion_tokens=max(self.completion_tokens or 0, 0),
            cached_tokens=min(max(cached or 0, 0), prompt),
            reasoning_tokens=max((completion.reasoning_tokens if completion else 0) or 0, 0),
        )


class FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct):
    """A fragment of a tool call in a stream, or a whole one in a response."""

    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct):
    """A chunk's `delta`, or a response's `message` (the same fields, whole)."""

    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @property
    def thinking(self) -> str | None:
        """The reasoning text, under whichever name the runtime uses."""
        return self.reasoning_content or self.reasoning


class NamedCall(NamedTuple):
    """A whole reply's tool call, named, with where its arguments are (for errors)."""

    n: int
    id: str | None
    name: str
    arguments: str
    arguments_param: str


def named_calls(message: Delta) -> Iterator[NamedCall]:
    """A whole reply's tool calls, in order. A call without a name is a
    `ReplyTranslationError`: neither caller protocol can say a call to no tool."""
    for n, call in enumerate(message.tool_calls or ()):
        param = f"choices[0].message.tool_calls[{n}]"
        function = call.function
        if function is None or not function.name:
            raise ReplyTranslationError(
                "the runtime called a tool without naming it", param=f"{param}.function.name"
            )
        yield NamedCall(
            n, call.id, function.name, function.arguments or "", f"{param}.function.arguments"
        )


class ChunkChoice(msgspec.Struct):
    index: int = 0
    delta: Delta | None = None
    message: Delta | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """vLLM and SGLang: the stop string that ended the run (an int is a stop token id)."""

    @property
    def said(self) -> Delta | None:
        """What the choice says: a chunk's delta, or a whole response's message."""
        return self.delta if self.delta is not None else self.message


class ChatChunk(msgspec.Struct):
    """One chat completion chunk, or a whole chat completion (`message` for `delta`)."""

    id: str | None = None
    created: int | float | None = None
    choices: list[ChunkChoice] | None = None
    usage: UsageView | None = None
    timings: msgspec.Raw = msgspec.Raw()
    """llama.cpp's `timings` (`iop_node.cache_timings`), read only for its usage."""

    def tokens(self) -> TokenUsage | None:
        """Its usage's counts (None: it has none), with llama.cpp's `timings.cache_n` as the
        cached ones when the usage does not say."""
        if self.usage is None:
            return None
        return self.usage.tokens(timings_cached(self.timings))

    def first(self) -> ChunkChoice | None:
        """Choice 0: Messages and Responses have one answer per request (the translated
        request never asks for `n`), so other choices are never read."""
        for choice in self.choices or ():
            if choice.index == 0:
                return choice
        return None


ChatResponse = ChatChunk

_decode_chunk: Final = msgspec.json.Decoder(ChatChunk).decode


def _read(data: bytes, what: str) -> ChatChunk:
    try:
        return _decode_chunk(data)
    except msgspec.ValidationError as exc:
        message, _, path = str(exc).partition(" - at `$")
        raise ReplyTranslationError(
            f"the runtime's {what} does not read as chat completions ({message})",
            param=join_path(None, path.rstrip("`")),
        ) from None
    except msgspec.DecodeError as exc:
        raise ReplyTranslationError(f"the runtime's {what} is not JSON ({exc})") from None


def read_chunk(data: bytes) -> ChatChunk:
    """A chat stream chunk (the `data:` payload)."""
    return _read(data, "stream chunk")


class ReadChunk(Protocol):
    """A stream chunk a relay has read already (`iop_node.reply.ParsedChunk`): its
    top-level members as raw JSON, and its `choices` as the token estimate reads them
    (`schemas.tokens.ChoiceView`: text and finish, no tool-call fragment; anything else
    when they did not read as choices)."""

    @property
    def fields(self) -> Mapping[str, msgspec.Raw]: ...

    @property
    def choices(self) -> object: ...


class TextDelta(NamedTuple):
    """What the bulk of a stream's chunks say: a piece of reasoning, of text, of refusal."""

    thinking: str | None
    content: str | None
    refusal: str | None


def text_delta(read: ReadChunk) -> TextDelta | None:
    """The text of a chunk a relay has read, when that is all the translators need of
    it: one choice (the translated request never asks for `n`, so it is choice 0), a
    delta of text only, no finish, no usage. Most chunks of a stream are that, and the
    relay's reading has it all, so they are not decoded a second time. None: the chunk
    says more (a tool-call fragment, a finish, usage) and is read whole."""
    choices = read.choices
    if "usage" in read.fields or not isinstance(choices, list) or len(choices) != 1:
        return None
    choice = choices[0]
    if not isinstance(choice, ChoiceView):
        return None
    delta = choice.delta
    if (
        delta is None
        or choice.finish_reason is not None
        or choice.message is not None
        or choice.text is not None
        or delta.tool_calls
    ):
        return None
    content = delta.content
    if content is not None and not isinstance(content, str):
        return None  # content parts: the whole reading says whether it is broken
    return TextDelta(delta.reasoning_content or delta.reasoning, content, delta.refusal)


def read_response(data: bytes) -> ChatResponse:
    """A whole chat completion."""
    return _read(data, "response")


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


def stop_reason(
    finish_reason: str | None, *, called_tools: bool, matched: str | int | None = None
) -> tuple[StopReason, str | None]:
    """Anthropic's `stop_reason` (and `stop_sequence`) for a chat `finish_reason`.

    A run the output limit cut is `max_tokens`, tool calls or not (the last call may be
    incomplete: a caller raises the limit and asks again, it does not run it). Otherwise
    a run that called tools stopped for them whatever the runtime says: llama.cpp and
    Ollama have answered `stop` after a tool call, and an agent that reads `end_turn`
    there ends its turn with the calls unanswered. A `stop` that vLLM or SGLang says was
    a stop string (`stop_reason` is a string) is `stop_sequence`, with that string."""
    if finish_reason == "length":
        return "max_tokens", None
    if called_tools or finish_reason in ("tool_calls", "function_call"):
        return "tool_use", None
    if finish_reason == "content_filter":
        return "refusal", None
    if finish_reason == "stop" and isinstance(matched, str) and matched:
        return "stop_sequence", matched
    return "end_turn", None
