"""Anthropic's `count_tokens` on the Node (the package's Rule 7): the upstream's own count
when it speaks Messages natively; the runtime's tokenizer over the request's text
translated to chat; IOP's estimator over that same text. Both counts of text add the chat
template's share (`schemas.tokens.template_tokens`), which neither sees. Counting
consumes nothing: the usage is zero, whoever counted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec

from iop_node.adapters.base import NativeRelay, RunResult
from iop_node.protocols.anthropic_betas import without_betas
from schemas.tokens import template_tokens, text_tokens
from schemas.wire import Run, Usage, UsageSource

__all__ = ["count_tokens", "rendered_prompt"]

_encode: Final = msgspec.json.Encoder().encode
_decode_any: Final = msgspec.json.Decoder().decode


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


async def count_tokens(
    run: Run, relay: NativeRelay | None, to_chat: Callable[[], bytes]
) -> RunResult:
    """Count a `count_tokens` run's input tokens (module docstring); `to_chat` translates
    its request to chat, asked only when the upstream did not count (it raises the
    caller's error when the request cannot be translated)."""
    if relay is not None and relay.protocol_support.counts_tokens:
        native_run = run
        if not relay.protocol_support.takes_betas:
            native_run = without_betas(run) or run
        count = await relay.count_tokens_native(native_run)
        if count is not None:
            return _counted(count, "provider")
    chat_body = to_chat()
    text = rendered_prompt(chat_body)
    template = template_tokens(_decode_any(chat_body))
    if relay is not None:
        count = await relay.tokenize_count(run.target, text)
        if count is not None:
            return _counted(count + template, "provider")
    return _counted(text_tokens(text) + template, "estimated")


def _counted(count: int, source: UsageSource) -> RunResult:
    return RunResult(usage=Usage(), response=_encode({"input_tokens": count}), usage_source=source)
