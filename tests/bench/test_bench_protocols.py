"""The bench's caller-protocol and prefix-cache parts, pure: the upstream's Messages and
Responses answers, the load generator's checks of them, the prefix-cache model, and the
goals judged from the protocol scenarios' numbers."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pydantic
import pytest
import trio
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from bench.load import (
    CALLER_EVENTS,
    Measurement,
    Protocol,
    Scenario,
    _BadResponse,
    _check_whole,
    _Markers,
    request_body,
)
from bench.result import IOP, IOP_TRANSLATED, LITELLM, BenchResult, Machine
from bench.targets import check_targets
from bench.upstream import (
    MESSAGES_PATH,
    MESSAGES_STREAM_EVENTS,
    RESPONSES_PATH,
    RESPONSES_STREAM_EVENTS,
    STREAM_TOKENS,
    BenchUpstream,
    _answers,
)
from bench.upstream_protocols import with_usage
from iop_node.adapters.sim.prefix_cache import (
    PrefillCost,
    PrefixCache,
    common_prefix_chars,
    render_prompt,
)

_anthropic_event = pydantic.TypeAdapter(RawMessageStreamEvent)
_openai_event = pydantic.TypeAdapter(ResponseStreamEvent)


def _data(event: bytes) -> Any:
    name, data = event.rstrip(b"\n").split(b"\n")
    assert name.startswith(b"event: ") and data.startswith(b"data: ")
    return json.loads(data[len(b"data: ") :])


def test_the_upstream_answers_each_protocol_as_its_sdk_reads_it() -> None:
    answers = _answers(STREAM_TOKENS)
    message = Message.model_validate_json(answers[MESSAGES_PATH].body)
    assert message.content[0].type == "text" and message.usage.output_tokens == STREAM_TOKENS
    response = Response.model_validate_json(answers[RESPONSES_PATH].body)
    assert response.status == "completed" and response.output_text == message.content[0].text
    for path, adapter in ((MESSAGES_PATH, _anthropic_event), (RESPONSES_PATH, _openai_event)):
        events = [_data(write.split(b"\r\n")[1] + b"\n\n") for write in answers[path].stream]
        for event in events:
            adapter.validate_python(event)
    assert len(answers[MESSAGES_PATH].stream) == MESSAGES_STREAM_EVENTS == CALLER_EVENTS["messages"]
    assert CALLER_EVENTS["responses"] == RESPONSES_STREAM_EVENTS
    assert answers[MESSAGES_PATH].stream[-1].endswith(b"0\r\n\r\n")  # the body's last chunk


async def test_the_upstream_serves_them_over_http() -> None:
    served: list[tuple[Protocol, str, bytes]] = [
        ("messages", "/v1/messages?beta=true", b"text_delta"),
        ("responses", "/v1/responses", b'"delta"'),
    ]
    async with trio.open_nursery() as nursery:
        root = await nursery.start(BenchUpstream().serve)
        async with httpx2.AsyncClient(base_url=root) as client:
            for protocol, path, delta in served:
                whole = await client.post(
                    path, content=request_body(stream=False, protocol=protocol)
                )
                assert whole.status_code == 200
                _check_whole(protocol, whole.content)
                streamed = await client.post(
                    path, content=request_body(stream=True, protocol=protocol)
                )
                markers = _Markers(delta)
                markers.feed(streamed.content)
                assert markers.counts[delta] == STREAM_TOKENS
        nursery.cancel_scope.cancel()


def test_the_load_generator_checks_whole_answers() -> None:
    _check_whole("messages", b'{"type": "message", "content": [{"type": "text", "text": "x"}]}')
    broken: list[tuple[Protocol, bytes]] = [
        ("messages", b'{"type":"message","content":[]}'),
        ("messages", b"<html>"),
        ("responses", b'{"object":"response","status":"failed","output":[{}]}'),
        ("chat", b"{}"),
    ]
    for protocol, body in broken:
        with pytest.raises(_BadResponse):
            _check_whole(protocol, body)


def test_markers_are_counted_across_reads() -> None:
    body = b'event: x\ndata: {"type":"text_delta"}\n\n' * 3 + b"event: message_stop\n\n"
    for size in (1, 2, 5, 7, len(body)):
        markers = _Markers(b"text_delta", b"message_stop")
        for index in range(0, len(body), size):
            markers.feed(body[index : index + size])
        assert markers.counts == {b"text_delta": 3, b"message_stop": 1}, size


def test_request_bodies_name_the_targets_model() -> None:
    messages = json.loads(request_body(stream=True, protocol="messages", model="m2"))
    assert (messages["model"], messages["stream"], messages["max_tokens"]) == ("m2", True, 64)
    responses = json.loads(request_body(stream=False, protocol="responses"))
    assert (responses["store"], responses["max_output_tokens"]) == (False, 64)


# --- the prefix-cache model ----------------------------------------------------------------------


def test_common_prefix() -> None:
    assert common_prefix_chars("abcdef", "abcxyz") == 3
    assert common_prefix_chars("abc", "abc") == 3
    assert common_prefix_chars("", "abc") == 0
    assert common_prefix_chars("x" * 100_000 + "a", "x" * 100_000 + "b") == 100_000


def test_a_prompt_reuses_its_longest_prefix_and_pays_for_the_rest() -> None:
    cache = PrefixCache(PrefillCost(uncached_us=100.0, cached_us=1.0), slots=2)
    first = cache.prefill("a" * 400)
    assert (first.tokens, first.cached_tokens) == (100, 0)
    assert first.seconds == pytest.approx(0.01)
    longer = cache.prefill("a" * 400 + "b" * 400)
    assert (longer.tokens, longer.cached_tokens) == (200, 100)
    assert longer.seconds == pytest.approx((100 * 100 + 100 * 1) / 1e6)
    # Two unrelated prompts fill both slots; the oldest one is forgotten.
    cache.prefill("c" * 400)
    cache.prefill("d" * 400)
    assert cache.prefill("a" * 400).cached_tokens == 0


def test_messages_and_chat_bodies_render_the_same_prompt() -> None:
    messages = {
        "system": [{"type": "text", "text": "Be brief."}],
        "tools": [{"name": "read"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    chat = {
        "tools": [{"name": "read"}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ],
    }
    assert render_prompt(messages).startswith("system: Be brief.")
    assert render_prompt(messages).endswith("user: hi")
    assert render_prompt(chat).endswith("user: hi")


def test_usage_is_rewritten_in_each_protocols_terms() -> None:
    answers = _answers(STREAM_TOKENS)
    message = json.loads(
        with_usage(answers[MESSAGES_PATH].body, MESSAGES_PATH, prompt_tokens=90, cached_tokens=80)
    )
    assert (message["usage"]["input_tokens"], message["usage"]["cache_read_input_tokens"]) == (
        10,
        80,
    )
    response = json.loads(
        with_usage(answers[RESPONSES_PATH].body, RESPONSES_PATH, prompt_tokens=90, cached_tokens=80)
    )
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 80


@pytest.mark.parametrize("bad", [(0.0, 0.0), (10.0, 20.0), (10.0, -1.0)])
def test_prefill_costs_are_checked(bad: tuple[float, float]) -> None:
    with pytest.raises(ValueError):
        PrefillCost(uncached_us=bad[0], cached_us=bad[1])


# --- the goals -----------------------------------------------------------------------------------


def _measured(target: str, scenario: Scenario, cpu_ms: float) -> Measurement:
    return Measurement(
        target=target,
        scenario=scenario,
        latencies_s=(0.001,) * 100,
        errors=0,
        wall_s=1.0,
        process_cpu_s={"all": cpu_ms * 100 / 1000},
    )


def test_protocol_goals_are_judged_per_concurrency() -> None:
    chat = [Scenario(c, True) for c in (1, 32)]
    messages = [scenario.like("messages") for scenario in chat]
    result = BenchResult(
        machine=Machine.this(),
        measurements=(
            _measured(IOP, chat[0], 2.0),
            _measured(IOP, chat[1], 1.0),
            _measured(IOP, messages[0], 2.1),  # 1.05x: within 10 %
            _measured(IOP, messages[1], 1.2),  # 1.2x: over
            _measured(IOP_TRANSLATED, messages[0], 3.0),
            _measured(IOP_TRANSLATED, messages[1], 2.0),
            _measured(LITELLM, messages[0], 30.0),  # 1/10
            _measured(LITELLM, messages[1], 20.0),  # 1/10
        ),
    )
    goals = {check.goal: (check.measured, check.verdict) for check in check_targets(result)}
    assert goals["Messages native: CPU per request <= 1.1x IOP's chat, stream"] == (
        "c=1 1.05x, c=32 1.20x",
        "MISS",
    )
    assert goals["Messages translated: CPU per request <= 1/5 of LiteLLM's, stream"] == (
        "c=1 1/10.0, c=32 1/10.0",
        "PASS",
    )
    assert goals["Responses translated: CPU per request <= 1/5 of LiteLLM's, stream"][1] == "n/a"
