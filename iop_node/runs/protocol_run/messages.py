"""Anthropic Messages on the Node (design §14): its translator, and its own operation,
`count_tokens` (the package's Rule 7).

Natively, a runtime serves it at `{base_url}/messages` with Anthropic's version header
(the caller's, else the first stable one) and the provider's key as `x-api-key` too;
Claude Code's beta extras go as they are until the runtime refuses them (Rule 8).
Translated, the body becomes a chat request (`protocols.messages_request_to_chat`) and
the reply a Message (`messages_response_from_chat`, `MessagesStream`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import ClassVar, Final

from iop_node.adapters.base import Adapter, AdapterError, EmitEvents, NativeRelay, RunResult
from iop_node.protocols import (
    MessagesNative,
    MessagesStream,
    TokenUsage,
    TranslationError,
    message_start,
    messages_request_to_chat,
    messages_response_from_chat,
)
from iop_node.protocols.anthropic_betas import refuses_betas, without_betas
from iop_node.protocols.native import ANTHROPIC_VERSION, NativeForm
from iop_node.runs.protocol_run.token_count import count_tokens
from iop_node.runs.protocol_run.translator import (
    StreamTranslator,
    Translation,
    Translator,
    alias,
    invalid,
)
from iop_node.tracing import ProtocolTrace
from schemas.tokens import estimate_input_tokens
from schemas.wire import Run

__all__ = ["MESSAGES", "MessagesTranslator"]


class _MessagesTranslation(Translation):
    def stream(self, run: Run, input_tokens: int) -> StreamTranslator:
        return MessagesStream(alias(run), run.request_id or run.run_id, input_tokens=input_tokens)

    def reply(self, run: Run, response: bytes, usage: TokenUsage) -> bytes:
        return messages_response_from_chat(
            response, reply_model=alias(run), request_id=run.request_id or run.run_id, usage=usage
        )


def _opening(run: Run) -> bytes:
    """`message_start` for a native stream that began without it (`native` Rule 7): the
    prompt's tokens by IOP's estimate, as a translated stream's would say."""
    try:
        body = json.loads(run.body)
    except ValueError:
        body = None
    prompt = estimate_input_tokens(body) if isinstance(body, dict) else 0
    return message_start(alias(run), run.request_id or run.run_id, TokenUsage(prompt_tokens=prompt))


class MessagesTranslator(Translator):
    """Anthropic Messages (module docstring)."""

    name = "messages"
    operations: ClassVar[frozenset[str]] = frozenset({"messages", "count_tokens"})
    native = NativeForm(
        name="messages",
        path="/messages",
        reader=lambda run: MessagesNative(run.reply_model),
        ends=frozenset({"message_stop"}),
        tail=frozenset({"message_delta", "message_stop"}),
        headers={"anthropic-version": ANTHROPIC_VERSION},
        key_header="x-api-key",
        opens="message_start",
        opening=_opening,
    )
    trace = ProtocolTrace(
        name="messages",
        end_event=b"event: message_delta",
        end_reason=re.compile(rb'"stop_reason"\s*:\s*"([A-Za-z_]{1,64})"'),
    )
    delta_event = b"event: content_block_delta\n"
    chat_fields: ClassVar[Mapping[str, str]] = {
        "messages": "messages",
        "max_tokens": "max_tokens",
        "max_completion_tokens": "max_tokens",
        "stop": "stop_sequences",
        "tools": "tools",
    }

    def translate(self, run: Run) -> Translation:
        return _MessagesTranslation(messages_request_to_chat(run.body))

    async def execute(self, run: Run, adapter: Adapter, events: EmitEvents) -> RunResult:
        if run.operation == "count_tokens":
            relay = adapter if isinstance(adapter, NativeRelay) else None
            return await count_tokens(run, relay, lambda: self._count_body(run))
        return await super().execute(run, adapter, events)

    async def relay(
        self, run: Run, relay: NativeRelay, form: NativeForm, events: EmitEvents
    ) -> RunResult:
        """Rule 8: a native run, without Anthropic's beta extras once its provider refused
        them, and sent again without them the first time it does."""
        support = relay.protocol_support
        if not support.takes_betas:
            return await relay.execute_native(without_betas(run) or run, form, events)
        try:
            return await relay.execute_native(run, form, events)
        except AdapterError as exc:
            retry = without_betas(run) if refuses_betas(exc.status, exc.message) else None
            if retry is None:
                raise
            refused = exc
        try:
            result = await relay.execute_native(retry, form, events)
        except AdapterError as again:
            if refuses_betas(again.status, again.message):
                raise refused from None  # the extras were not the cause: nothing learned
            raise  # another failure proves nothing either way: nothing learned
        support.learn_refuses_betas(refused.message)
        return result

    def _count_body(self, run: Run) -> bytes:
        """A `count_tokens` request as the chat request its count is of."""
        try:
            return self.translate(self.without_hosted_tools(run)).chat_body
        except TranslationError as exc:
            raise invalid(exc) from None


MESSAGES: Final = MessagesTranslator()
