"""IOP's token estimates (`schemas.tokens`), used when a provider reports no usage: the
output tally, and the input estimate calibrated against a real chat template."""

from __future__ import annotations

import json

import pytest

from schemas.tokens import (
    IMPLIED_SYSTEM_TOKENS,
    TOKEN_CHUNK_CHARS,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_REQUEST,
    OutputTally,
    estimate_input_tokens,
    input_text,
    output_chars,
    template_tokens,
)


def _delta(**fields: object) -> bytes:
    return json.dumps({"choices": [{"index": 0, "delta": fields}]}).encode()


@pytest.mark.parametrize(
    ("payload", "chars"),
    [
        (_delta(content="hello"), 5),
        (_delta(role="assistant", content=""), 0),
        (_delta(reasoning_content="hmm"), 3),
        (_delta(reasoning="hm"), 2),
        (_delta(refusal="no"), 2),
        (_delta(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": '{"a":1}'}}]), 7),
        (_delta(content=[{"type": "text", "text": "part"}]), 4),
        (json.dumps({"choices": [{"index": 0, "text": "once"}]}).encode(), 4),
        (json.dumps({"choices": [{"message": {"content": "whole answer"}}]}).encode(), 12),
        (json.dumps({"choices": [], "usage": {"prompt_tokens": 1}}).encode(), 0),
        (b'{"choices": "not a list"}', None),
        (b"not json", None),
    ],
)
def test_output_chars_reads_every_kind_of_generated_text(payload: bytes, chars: int | None) -> None:
    assert output_chars(payload) == chars


def test_a_token_sized_chunk_is_one_token() -> None:
    """Engines stream about a token per chunk: each short chunk is one token, whatever
    its length up to `TOKEN_CHUNK_CHARS` (so not characters / 4)."""
    tally = OutputTally()
    for piece in ("H", "ello", " understanding", "x" * TOKEN_CHUNK_CHARS):
        tally.add(_delta(content=piece))
    tally.add(_delta())  # the finish chunk carries nothing
    assert (tally.pieces, tally.tokens()) == (4, 4)


def test_a_longer_piece_counts_its_characters() -> None:
    tally = OutputTally()
    tally.add(_delta(content="x" * 40))  # several tokens in one chunk
    whole = json.dumps({"choices": [{"message": {"content": "short answer"}}]}).encode()
    tally.add(whole, whole=True)  # a whole response: characters only
    assert tally.tokens() == 10 + 3


def test_an_unreadable_chunk_still_counts_as_output() -> None:
    tally = OutputTally()
    tally.add(b"data the relay could not read")
    assert tally.tokens() == 1


def test_nothing_delivered_is_zero() -> None:
    assert OutputTally().tokens() == 0


# --- input estimate: the chat template's share --------------------------------------------------

#: Real prompt tokens, measured with llama.cpp's tokenizer over the prompt SmolLM2-135M-
#: Instruct's chat template renders (its GGUF's `tokenizer.chat_template`, generation
#: prompt added): (messages, tokens).
MEASURED = [
    ([{"role": "user", "content": "hi"}], 31),
    ([{"role": "user", "content": "Say hello to IOP."}], 36),
    ([{"role": "user", "content": "hello there"}], 32),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}], 20),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "How are you today?"},
        ],
        38,
    ),
    ([{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 20}], 231),
]


@pytest.mark.parametrize(("messages", "real"), MEASURED)
def test_a_chat_estimate_is_within_a_quarter_of_the_real_count(
    messages: list[dict[str, str]], real: int
) -> None:
    """The old rule (characters / 4 plus 4 a message) said 9 for "Say hello to IOP.",
    a quarter of the real 36: the template's framing and its default system prompt are
    most of a short chat."""
    estimate = estimate_input_tokens({"messages": messages})
    assert abs(estimate - real) <= real / 4, (estimate, real)


def test_the_template_share_is_framing_a_message_and_a_reply_and_an_implied_system_prompt() -> None:
    user = {"role": "user", "content": "x"}
    system = {"role": "system", "content": "y"}
    developer = {"role": "developer", "content": "y"}
    assert template_tokens({"messages": [user]}) == (
        TOKENS_PER_MESSAGE + TOKENS_PER_REQUEST + IMPLIED_SYSTEM_TOKENS
    )
    for first in (system, developer):
        assert template_tokens({"messages": [first, user]}) == (
            2 * TOKENS_PER_MESSAGE + TOKENS_PER_REQUEST
        )
    assert template_tokens({"prompt": "a completion has no template"}) == 0
    assert estimate_input_tokens({"prompt": "12345678"}) == 2


def test_the_input_text_is_what_a_tokenizer_counts() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]},
        ]
    }
    assert input_text(body) == "be brief\nlook"
    assert input_text({"prompt": ["a", "b"]}) == "a\nb"
    assert input_text({"input": "embed me"}) == "embed me"
    assert input_text({}) == ""
