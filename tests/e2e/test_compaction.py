"""Compaction made with the model (`core.responses.compaction`, `http.protocols.compaction`)
through a real
Edge and Node, with the `openai` SDK: `responses.compact` against the sim (translated)
and a fake runtime that speaks Responses natively, the compaction read back on the next
turn (as input items and through `previous_response_id`), principal-scoped, and a
`compaction_trigger` item, streamed and not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import trio

from iop_edge.core.responses.compaction import SUMMARY_INSTRUCTION, SUMMARY_PREFIX, unseal
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import (
    Stack,
    edge_config,
    principals_section,
    sim_provider,
    start_native_upstream,
    start_stack,
)
from tests.protocols.conformance import check_response, check_responses_event

ALICE = "alice-token-for-tests"
BOB = "bob-token-for-tests"
#: The model's output limit: the summary turn is bounded by it (below its own bound).
LIMIT = 48


def _model(provider: str, served: str) -> dict[str, Any]:
    return {
        "id": "m",
        "providers": {provider: served},
        "generation": {"max_tokens_limit": LIMIT, "defaults": {"max_tokens": 8}},
    }


@pytest.fixture
async def sim_stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1")],
        models=[_model("sim-1", "sim-small")],
        openai_section=principals_section({"alice": ALICE, "bob": BOB}),
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


async def _native(nursery: trio.Nursery, tmp_path: Path) -> tuple[FakeUpstream, Stack]:
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state", providers=[native], models=[_model("native", "fake-model")]
    )
    return fake, await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


def _sent(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [msgspec.json.decode(r.body) for r in fake.requests if r.path == "/v1/responses"]


def _text_of(item: dict[str, Any]) -> str:
    content = item["content"]
    return content if isinstance(content, str) else content[0]["text"]


async def test_compact_on_the_sim_and_go_on_from_it(sim_stack: Stack) -> None:
    conversation: list[Any] = [
        {"role": "user", "content": "Fix the failing test in `tests/test_io.py`."},
        {"role": "assistant", "content": "I ran the test; it fails on a missing newline."},
        {"role": "user", "content": "Add the newline and run it again."},
    ]
    async with sim_stack.client(api_key=ALICE) as client:
        compacted = await client.responses.compact(
            model="m", input=conversation, instructions="You are a coding agent."
        )
        assert compacted.object == "response.compaction"
        *users, item = compacted.output
        assert [u.role for u in users] == ["user", "user"]  # type: ignore[union-attr]
        assert item.type == "compaction"
        summary = unseal(item.encrypted_content)  # type: ignore[union-attr]
        assert summary  # the sim's words: what the model wrote
        assert compacted.usage.output_tokens > 0 and compacted.usage.input_tokens > 0
        # the compacted output is the next turn's input, as OpenAI's client passes it
        follow = [i.model_dump(exclude_none=True, warnings=False) for i in compacted.output]
        after = await client.responses.create(
            model="m", input=[*follow, {"role": "user", "content": "Go on."}]
        )
        assert after.status in ("completed", "incomplete") and after.output_text
        # stored for its principal: a conversation continues from it
        continued = await client.responses.create(
            model="m", input="Go on.", previous_response_id=compacted.id
        )
        assert continued.output_text
        alone = await client.responses.create(model="m", input="Go on.", store=False)
        assert continued.usage.input_tokens > alone.usage.input_tokens + len(summary) // 8
    async with sim_stack.client(api_key=BOB) as bob:
        with pytest.raises(openai.NotFoundError) as other:
            await bob.responses.create(model="m", input="x", previous_response_id=compacted.id)
    assert other.value.code == "previous_response_not_found"


async def test_compact_errors_name_the_field(sim_stack: Stack) -> None:
    async with sim_stack.http() as http:
        auth = {"authorization": f"Bearer {ALICE}"}
        missing = await http.post("/v1/responses/compact", json={"input": "hi"}, headers=auth)
        unknown = await http.post(
            "/v1/responses/compact", json={"model": "nope", "input": "hi"}, headers=auth
        )
        damaged = await http.post(
            "/v1/responses/compact",
            json={
                "model": "m",
                "input": [{"type": "compaction", "encrypted_content": "iopc1.YQ.AAAA"}],
            },
            headers=auth,
        )
        first = await http.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=auth)
        damaged_later = await http.post(
            "/v1/responses",
            json={
                "model": "m",
                "previous_response_id": first.json()["id"],
                "input": [
                    {"role": "user", "content": "go on"},
                    {"type": "compaction", "encrypted_content": "iopc1.YQ.AAAA"},
                ],
            },
            headers=auth,
        )
        got = await http.get("/v1/responses/compact", headers=auth)
        foreign = await http.post(
            "/v1/responses",
            json={
                "model": "m",
                "input": [
                    {"type": "compaction", "id": "cmp_x", "encrypted_content": "gAAAA-sealed"},
                    {"role": "user", "content": "go on"},
                ],
            },
            headers=auth,
        )
    assert missing.status_code == 400 and "model" in missing.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert damaged.status_code == 400
    assert damaged.json()["error"]["code"] == "invalid_compaction"
    assert "input[0].encrypted_content" in damaged.json()["error"]["message"]
    assert damaged.json()["error"]["param"] == "input[0].encrypted_content"
    # Named where the caller sent it, not where it sits after the stored conversation.
    assert first.status_code == 200, first.text
    assert damaged_later.status_code == 400
    later_error = damaged_later.json()["error"]
    assert (later_error["code"], later_error["param"]) == (
        "invalid_compaction",
        "input[1].encrypted_content",
    )
    assert later_error["message"].startswith("input[1].encrypted_content is not a compaction")
    assert got.status_code == 405
    # another service's compaction reaches the translating Node as it is, which refuses it
    assert foreign.status_code == 400, foreign.text
    assert "another service" in foreign.json()["error"]["message"]
    assert "input[0]" in foreign.text


async def test_a_native_runtime_summarises_and_reads_the_summary_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake, stack = await _native(nursery, tmp_path)
    async with stack.client() as client:
        first = await client.responses.create(model="m", input="Remember: the port is 8080.")
        compacted = await client.responses.compact(
            model="m", input="And the host is example.org.", previous_response_id=first.id
        )
        item = compacted.output[-1]
        summary = unseal(item.encrypted_content)  # type: ignore[union-attr]
        await client.responses.create(
            model="m",
            input=[
                *(i.model_dump(exclude_none=True, warnings=False) for i in compacted.output),
                {"role": "user", "content": "Which port?"},
            ],
        )
    turn, next_turn = _sent(fake)[1:]
    # the summary turn: the whole conversation, then the instruction; no tools, bounded
    assert _text_of(turn["input"][0]) == "Remember: the port is 8080."
    assert turn["input"][1]["role"] == "assistant"
    assert _text_of(turn["input"][-1]) == SUMMARY_INSTRUCTION
    assert turn["max_output_tokens"] == LIMIT and "tools" not in turn
    assert turn["store"] is False and turn["stream"] is False
    # the summary is the runtime's answer, and the next turn reads it as a user message
    assert summary == first.output_text.strip()
    roles = [(i["role"], _text_of(i)) for i in next_turn["input"]]
    assert roles == [
        ("user", "Remember: the port is 8080."),
        ("user", "And the host is example.org."),
        ("user", f"{SUMMARY_PREFIX}\n\n{summary}"),
        ("user", "Which port?"),
    ]


async def test_a_compaction_trigger_ends_a_turn_with_the_compaction(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake, stack = await _native(nursery, tmp_path)
    trigger = {"type": "compaction_trigger"}
    async with stack.client() as client:
        first = await client.responses.create(model="m", input="The port is 8080.")
        compacted = await client.responses.create(
            model="m",
            input=[trigger],
            previous_response_id=first.id,  # type: ignore[list-item]
        )
        assert [item.type for item in compacted.output] == ["compaction"]
        assert compacted.previous_response_id == first.id
        stream = await client.responses.create(
            model="m",
            input=[trigger],
            previous_response_id=first.id,
            stream=True,  # type: ignore[list-item]
        )
        events = [event async for event in stream]
        await client.responses.create(
            model="m", input="Which port?", previous_response_id=compacted.id
        )
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.compaction.compacting" in kinds
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["compaction"]
    summary = unseal(compacted.output[0].encrypted_content)  # type: ignore[union-attr]
    continued = _sent(fake)[-1]
    # the turns before the compaction are its summary now: the user's words and it remain
    assert [(i["role"], _text_of(i)) for i in continued["input"]] == [
        ("user", "The port is 8080."),
        ("user", f"{SUMMARY_PREFIX}\n\n{summary}"),
        ("user", "Which port?"),
    ]


async def test_a_trigger_on_the_sim_answers_a_conformant_response_and_stream(
    sim_stack: Stack,
) -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "Plan the release."},
            {"type": "compaction_trigger"},
        ],
    }
    auth = {"authorization": f"Bearer {ALICE}"}
    async with sim_stack.http() as http:
        reply = await http.post("/v1/responses", json=body, headers=auth)
        streamed = await http.post("/v1/responses", json={**body, "stream": True}, headers=auth)
    assert reply.status_code == 200, reply.text
    response = reply.json()
    check_response(response)
    assert [item["type"] for item in response["output"]] == ["compaction"]
    assert unseal(response["output"][0]["encrypted_content"])
    # completed even when the summary reached its bound: the compaction is whole
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [
        json.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: ")
    ]
    for event in events:
        check_responses_event(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["type"] == "compaction"


async def test_a_summary_turn_that_writes_nothing_is_the_runtimes_failure(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake, stack = await _native(nursery, tmp_path)
    fake.chunks = 0  # the runtime answers with no text at all
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as failed:
            await client.responses.compact(model="m", input="Summarise this.")
    assert failed.value.status_code == 502
    async with stack.client() as client:
        with pytest.raises(openai.NotFoundError):  # nothing was stored under its id
            await client.responses.retrieve(f"resp_{failed.value.response.headers['x-request-id']}")
