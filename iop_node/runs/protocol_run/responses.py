"""OpenAI Responses on the Node (design §14): its translator.

Natively, a runtime serves it at `{base_url}/responses`; a run the Edge stores
(`keep_output`) keeps the response object its stream ended with. Translated, the body is
read once (`protocols.read_responses_request`): the chat request is made from it, and the
reply echoes it and maps calls back through the same tools (`responses_response_from_chat`,
`ResponsesStream`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar, Final

from iop_node.protocols import (
    ResponsesNative,
    ResponsesRequest,
    ResponsesStream,
    TokenUsage,
    read_responses_request,
    responses_request_to_chat,
    responses_response_from_chat,
)
from iop_node.protocols.native import NativeForm, NativeReader
from iop_node.runs.protocol_run.translator import StreamTranslator, Translation, Translator, alias
from iop_node.tracing import ProtocolTrace
from schemas.wire import Run

__all__ = ["RESPONSES", "ResponsesTranslator"]

_ENDS: Final = frozenset({"response.completed", "response.incomplete"})


class _ResponsesTranslation(Translation):
    def __init__(self, request: ResponsesRequest) -> None:
        super().__init__(responses_request_to_chat(request))
        self._request = request
        self._stream: ResponsesStream | None = None

    def stream(self, run: Run, input_tokens: int) -> StreamTranslator:
        self._stream = ResponsesStream(
            alias(run),
            run.request_id or run.run_id,
            self._request,
            stored=run.keep_output,
            previous_response_id=run.previous_response_id or None,
        )
        return self._stream

    def reply(self, run: Run, response: bytes, usage: TokenUsage) -> bytes:
        return responses_response_from_chat(
            response,
            reply_model=alias(run),
            request_id=run.request_id or run.run_id,
            request=self._request,
            usage=usage,
            stored=run.keep_output,
            previous_response_id=run.previous_response_id or None,
        )

    def final_response(self) -> bytes | None:
        return None if self._stream is None else self._stream.final_response()


def _reader(run: Run) -> NativeReader:
    return ResponsesNative(
        run.reply_model,
        stored=run.keep_output,
        response_id=f"resp_{run.request_id or run.run_id}",
        previous_response_id=run.previous_response_id,
    )


class ResponsesTranslator(Translator):
    """OpenAI Responses (module docstring)."""

    name = "responses"
    operations: ClassVar[frozenset[str]] = frozenset({"responses"})
    native = NativeForm(
        name="responses",
        path="/responses",
        reader=_reader,
        ends=_ENDS,
        tail=_ENDS,
        keeps_output=True,
        answers=("object", "response"),
    )
    trace = ProtocolTrace(
        name="responses",
        end_event=b"event: response.",
        end_reason=re.compile(rb'"status"\s*:\s*"(completed|incomplete|failed)"'),
        status_is_reason=True,
    )
    delta_event = b".delta\n"
    chat_fields: ClassVar[Mapping[str, str]] = {
        "messages": "input",
        "max_tokens": "max_output_tokens",
        "max_completion_tokens": "max_output_tokens",
        "response_format": "text.format",
        "tools": "tools",
    }

    def translate(self, run: Run) -> Translation:
        return _ResponsesTranslation(read_responses_request(run.body))


RESPONSES: Final = ResponsesTranslator()
