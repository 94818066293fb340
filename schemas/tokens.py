"""The one input-token estimator of IOP, shared by the Edge's long-context admission and the
`sim` adapter's usage numbers, so the two always agree.

Rule: a request's input tokens are ceil(characters / 4) over every piece of text the
model will read (message contents, including text parts of multimodal content; the
`prompt` of a completion; the `input` of an embedding), plus 4 tokens of framing per chat
message. Four characters per token is the usual rule of thumb for English BPE
vocabularies; it is an estimate for admission, never billed as such when the upstream
reports real usage.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4


def text_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


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
        return -(-chars // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)
    for key in ("prompt", "input"):
        value = body.get(key)
        if value is not None:
            return -(-_content_chars(value) // CHARS_PER_TOKEN)
    return 0
