"""The caller protocols the Node translates (design §14): Anthropic Messages and OpenAI
Responses, to chat completions and back, for runtimes that speak chat only.

Pure code, no I/O: bytes in, bytes out, so the translation of each direction is tested
synchronously and costs the Node nothing but CPU.

Requests (the caller's body, `model` already the served name) to a chat body:
`messages_request_to_chat`, `responses_request_to_chat` (a run reads a Responses body
once, `read_responses_request`, and hands that reading to both directions). Whole
replies back: `messages_response_from_chat`, `responses_response_from_chat`. Streams,
one translator per run, fed chat chunks (with the relay's reading of each, `ReadChunk`,
when it has one) and returning framed events: `MessagesStream`, `ResponsesStream`. What
cannot be translated is a `TranslationError` naming the field (a 400 in the caller's
protocol); a runtime reply that cannot be said in the caller's protocol is a
`ReplyTranslationError` (the run fails).

A provider that speaks the caller's protocol natively gets no translation; its reply is
read by `MessagesNative` / `ResponsesNative` for the alias and the usage.
"""

from iop_node.protocols.chat_body import sse_event
from iop_node.protocols.chat_view import ReadChunk, TokenUsage
from iop_node.protocols.errors import (
    ReplyTranslationError,
    TranslationError,
    translation_error_body,
)
from iop_node.protocols.messages_reply import messages_response_from_chat
from iop_node.protocols.messages_request import messages_request_to_chat
from iop_node.protocols.messages_stream import MessagesStream, message_start
from iop_node.protocols.native import MessagesNative, ResponsesNative
from iop_node.protocols.responses_reply import responses_response_from_chat
from iop_node.protocols.responses_request import (
    ResponsesRequest,
    read_responses_request,
    responses_request_to_chat,
)
from iop_node.protocols.responses_stream import ResponsesStream

__all__ = [
    "MessagesNative",
    "MessagesStream",
    "ReadChunk",
    "ReplyTranslationError",
    "ResponsesNative",
    "ResponsesRequest",
    "ResponsesStream",
    "TokenUsage",
    "TranslationError",
    "message_start",
    "messages_request_to_chat",
    "messages_response_from_chat",
    "read_responses_request",
    "responses_request_to_chat",
    "responses_response_from_chat",
    "sse_event",
    "translation_error_body",
]
