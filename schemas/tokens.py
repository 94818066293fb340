"""IOP's token estimators: input tokens, shared by the Edge's long-context admission and the
`sim` adapter's usage numbers so the two always agree, and output tokens, for the usage
of runs whose provider reports none (design §7, `usage_source: estimated`).

Rule: a request's input tokens are ceil(characters / 4) over every piece of text the
model will read (message contents, including text parts of multimodal content; the
`prompt` of a completion; the `input` of an embedding), plus, for a chat, the share of
the chat template the runtime wraps the messages in (`template_tokens`):

- `TOKENS_PER_MESSAGE` (5) a message: ChatML's `<|im_start|>`, the role, a newline,
  `<|im_end|>` and a newline; Llama 3's header tokens, role, blank line and `<|eot_id|>`
  come to the same;
- `TOKENS_PER_REQUEST` (3): the generation prompt that opens the reply
  (`<|im_start|>assistant` and a newline);
- `IMPLIED_SYSTEM_TOKENS` (20) when the request has no system (or developer) message: the
  system block many templates add then (SmolLM2's is 21 tokens, Qwen2.5's about as many,
  Llama 3.1's date header about 20; Mistral's and Gemma's add none).

Calibrated against llama.cpp's tokenizer over SmolLM2-135M-Instruct's own template: the
old rule (4 a message, nothing else) said 9 tokens for "Say hello to IOP." where the
runtime counts 36; this one says 33, and stays within a quarter of the real count from a
one-word chat to a 900-character one (`tests/unit/test_tokens.py`). Four characters per
token is the usual rule of thumb for English BPE vocabularies (4.5 measured on prose, 3
on short words). It is an estimate, never billed as such when the upstream reports real
usage; a Node whose runtime has a tokenizer counts the text with it instead and adds the
template's share (`input_text` is what it counts). (The output rule is stated above its
code, below.)
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 5
TOKENS_PER_REQUEST = 3
IMPLIED_SYSTEM_TOKENS = 20
#: Roles whose message stands in for the system block a template would otherwise add.
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})


def text_tokens(text: str) -> int:
    return text_tokens_of(len(text))


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    return 0


def estimate_input_tokens(body: dict[str, Any]) -> int:
    """Estimate the input tokens of an OpenAI chat, completion or embedding request body."""
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = 0
        for message in messages:
            if isinstance(message, dict):
                chars += _content_chars(message.get("content"))
        return -(-chars // CHARS_PER_TOKEN) + template_tokens(body)
    for key in ("prompt", "input"):
        value = body.get(key)
        if value is not None:
            return -(-_content_chars(value) // CHARS_PER_TOKEN)
    return 0


def template_tokens(body: dict[str, Any]) -> int:
    """The chat template's share of a request's input tokens (the rule above); 0 for a
    request that is not a chat (a completion's prompt is read as it is)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    implied = not any(
        isinstance(message, dict) and message.get("role") in _SYSTEM_ROLES for message in messages
    )
    return (
        TOKENS_PER_MESSAGE * len(messages)
        + TOKENS_PER_REQUEST
        + (IMPLIED_SYSTEM_TOKENS if implied else 0)
    )


def input_text(body: dict[str, Any]) -> str:
    """The text of a request the estimate counts (one line per message or prompt), for
    a runtime's own tokenizer to count instead."""
    messages = body.get("messages")
    if isinstance(messages, list):
        pieces = [m.get("content") for m in messages if isinstance(m, dict)]
    else:
        value = next((body[key] for key in ("prompt", "input") if key in body), None)
        pieces = value if isinstance(value, list) else [value]
    return "\n".join(filter(None, (_content_text(piece) for piece in pieces)))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part if isinstance(part, str) else part["text"]
            for part in content
            if isinstance(part, str)
            or (isinstance(part, dict) and isinstance(part.get("text"), str))
        )
    return ""


# --- output (completion) estimate ------------------------------------------------------------
#
# Used only when a provider does not report usage (llama.cpp's server ignores
# `stream_options`, a stream cut short, a cancelled run). Rule, per chunk (or per whole
# response) of generated text (content, reasoning, refusal, tool call arguments, a
# completion's `text`): a stream chunk of up to `TOKEN_CHUNK_CHARS` characters is one
# token, since engines stream token by token and one token of natural text rarely runs
# longer; a longer chunk, or a whole non-stream response, counts ceil(characters / 4).
# A chunk without text counts nothing, so a run that delivered output is never estimated
# at zero. Per-chunk counting matches a token-per-chunk stream (llama.cpp, vLLM) where
# characters / 4 alone is off by the vocabulary's average token length
# (docs/operations.md#real-runtimes-opt-in).

#: The longest chunk of text counted as a single token.
TOKEN_CHUNK_CHARS = 16


class _Function(msgspec.Struct):
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    function: _Function | None = None


class _Message(msgspec.Struct):
    """A chat message or a stream delta, as far as its text goes."""

    content: Any = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[_ToolCall] | None = None

    def chars(self) -> int:
        total = _content_chars(self.content)
        for text in (self.reasoning_content, self.reasoning, self.refusal):
            if text:
                total += len(text)
        for call in self.tool_calls or ():
            if call.function is not None and call.function.arguments:
                total += len(call.function.arguments)
        return total


class ChoiceView(msgspec.Struct):
    """One choice of a chunk or response, as far as its text and its end go."""

    delta: _Message | None = None
    message: _Message | None = None
    text: str | None = None
    finish_reason: Any = None

    def chars(self) -> int:
        total = len(self.text) if self.text else 0
        for message in (self.delta, self.message):
            if message is not None:
                total += message.chars()
        return total


class _Output(msgspec.Struct):
    choices: list[ChoiceView] | None = None


_decode_output: Final = msgspec.json.Decoder(_Output).decode
_decode_choices: Final = msgspec.json.Decoder(list[ChoiceView] | None).decode


def output_chars(payload: bytes) -> int | None:
    """Characters of generated text in one OpenAI chunk or response; None when `payload`
    is not shaped like one (it is counted as output all the same)."""
    try:
        output = _decode_output(payload)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None  # RecursionError: nested deeper than the decoder follows
    return sum(choice.chars() for choice in output.choices or ())


def read_choices(raw: bytes | msgspec.Raw) -> list[ChoiceView] | None:
    """The `choices` of a chunk or response (the raw JSON of that one field), for a
    reader that already split the object: raises `msgspec.DecodeError` (its subclass
    `ValidationError` included) or `RecursionError` when they are not shaped as choices."""
    return _decode_choices(raw)


class OutputTally:
    """Counts what a run delivered, chunk by chunk, for the completion estimate above."""

    __slots__ = ("_tokens", "pieces")

    def __init__(self) -> None:
        self._tokens = 0
        self.pieces = 0
        """Chunks (or responses) that carried generated text."""

    def add(self, payload: bytes, *, whole: bool = False) -> None:
        """Count one stream chunk, or (`whole`) a whole non-stream response, whose text
        is counted by characters only."""
        self.add_chars(output_chars(payload), whole=whole)

    def add_chars(self, chars: int | None, *, whole: bool = False) -> None:
        """`add` for a payload already read: its `output_chars` (None: unreadable)."""
        self.add_tokens(chunk_tokens(chars, whole=whole))

    def add_tokens(self, tokens: int) -> None:
        """Count output already reckoned in tokens (`chunk_tokens`, or one per event of a
        stream whose events are not chat chunks)."""
        if tokens > 0:
            self.pieces += 1
            self._tokens += tokens

    def tokens(self) -> int:
        return self._tokens


def chunk_tokens(chars: int | None, *, whole: bool = False) -> int:
    """The output tokens of one chunk (or, `whole`, one response) of `chars` characters
    of generated text, by the rule above; None (unreadable, but output all the same)
    counts as one character."""
    if chars is None:
        chars = 1
    if chars <= 0:
        return 0
    if whole or chars > TOKEN_CHUNK_CHARS:
        return text_tokens_of(chars)
    return 1


def text_tokens_of(chars: int) -> int:
    """Tokens of `chars` characters of text (the rule at the top of this module)."""
    return -(-chars // CHARS_PER_TOKEN)
