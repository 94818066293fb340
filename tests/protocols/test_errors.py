"""Errors in the caller's protocol for a request that cannot be translated."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from iop_node.protocols import (
    TranslationError,
    messages_request_to_chat,
    responses_request_to_chat,
    translation_error_body,
)

from .replay_server import ReplayServer

BAD_BLOCK = {
    "model": "m",
    "max_tokens": 5,
    "messages": [{"role": "user", "content": [{"type": "hologram"}]}],
}


def test_messages_error_is_anthropic_shaped(
    replay: ReplayServer, anthropic_client: anthropic.Anthropic
) -> None:
    with pytest.raises(TranslationError) as caught:
        messages_request_to_chat(json.dumps(BAD_BLOCK).encode())
    replay.answer(translation_error_body("messages", caught.value), status=400)
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client.messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert raised.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0].content[0].type: unknown type 'hologram'",
        },
        "request_id": None,
    }


def test_responses_error_names_the_field(
    replay: ReplayServer, openai_client: openai.OpenAI
) -> None:
    body = {
        "model": "m",
        "input": [{"type": "function_call_output", "call_id": "c9", "output": "?"}],
    }
    with pytest.raises(TranslationError) as caught:
        responses_request_to_chat(json.dumps(body).encode())
    replay.answer(translation_error_body("responses", caught.value), status=400)
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.responses.create(model="m", input="x")
    assert raised.value.param == "input[0].call_id"
    assert raised.value.code is None
    assert "no earlier call item" in raised.value.message
