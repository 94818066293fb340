"""A caller protocol added by one module on each side (design §14): a toy protocol, defined
and registered here only, served end to end by a real Edge and a real Node over sockets.

The toy speaks `POST /v1/toy` with `{"model", "prompt", "limit", "stream"}` and answers
`{"text", "model", "tokens"}`, or a stream of `event: toy.text` events ended by
`event: toy.done` and a line of its own (`event: toy.end`); its errors have a shape of
their own (`{"toy_error": {...}}`). The Edge knows it by its `CallerProtocol`, the Node by
its `Translator` (to chat completions and back, for the `sim` runtime, which speaks chat
only); nothing else in either process is told about it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import trio

from iop_edge.http.errors import ApiError, invalid_request
from iop_edge.http.protocols.caller_protocol import (
    CallerProtocol,
    Planning,
    ToStore,
    catalog_model,
    check_max_tokens,
)
from iop_edge.http.protocols.protocol_registry import PROTOCOLS
from iop_edge.runtime.runs.dispatch import RunPlan
from iop_node.protocols import ReadChunk, TokenUsage
from iop_node.runs.protocol_run import TRANSLATORS, Translation, Translator
from iop_node.runs.protocol_run.translator import StreamTranslator, alias
from iop_node.tracing import ProtocolTrace
from schemas import wire
from schemas.wire import Run
from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack

TOY = "toy"
PATH = "/v1/toy"
STREAM_END = b"event: toy.end\ndata: {}\n\n"
LIMIT = 5000


# --- the Edge's side: one CallerProtocol ----------------------------------------------------


class _ToyRequest(msgspec.Struct, frozen=True):
    model: str
    prompt: str
    limit: int | None = None
    stream: bool = False


class ToyProtocol(CallerProtocol):
    name = TOY
    paths: ClassVar[Mapping[str, wire.Operation]] = {PATH: TOY}
    output_fields: ClassVar[Mapping[wire.Operation, tuple[str, ...]]] = {TOY: ("limit",)}
    stream_end = STREAM_END

    async def plan(
        self, operation: wire.Operation, request: Planning
    ) -> tuple[RunPlan, ToStore | None]:
        try:
            view = msgspec.convert(request.body, _ToyRequest)
        except msgspec.ValidationError as exc:
            raise invalid_request(exc) from None
        model = catalog_model(request.snapshot, request.caller, view.model)
        check_max_tokens(model, "limit", view.limit)
        plan = request.caller.plan(
            request.snapshot,
            model_id=view.model,
            operation=operation,
            body=request.body,
            stream=view.stream,
            prompt_tokens=len(view.prompt) // 4,
            caller_wants_usage=True,
            protocol=self,
        )
        return plan, None

    def conversation(self, body: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        return [], [body.get("prompt")]

    def error_body(self, error: ApiError, request_id: str | None = None) -> bytes:
        return json.dumps(
            {"toy_error": {"status": error.status, "code": error.code, "says": error.message}}
        ).encode()


# --- the Node's side: one Translator --------------------------------------------------------


class _ToyStream:
    def __init__(self, run: Run) -> None:
        self._run = run
        self.usage: TokenUsage | None = None

    def feed(self, chunk: bytes, read: ReadChunk | None = None) -> bytes:
        data = json.loads(chunk)
        if data.get("usage"):
            usage = data["usage"]
            self.usage = TokenUsage(
                prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"]
            )
        text = "".join(
            (choice.get("delta") or {}).get("content") or "" for choice in data.get("choices", [])
        )
        if not text:
            return b""
        return b"event: toy.text\ndata: " + json.dumps({"text": text}).encode() + b"\n\n"

    def finish(self, usage: TokenUsage | None = None) -> bytes:
        tokens = 0 if usage is None else usage.completion_tokens
        done = {"reason": "stop", "tokens": tokens, "model": alias(self._run)}
        return b"event: toy.done\ndata: " + json.dumps(done).encode() + b"\n\n"


class _ToyTranslation(Translation):
    def stream(self, run: Run, input_tokens: int) -> StreamTranslator:
        return _ToyStream(run)

    def reply(self, run: Run, response: bytes, usage: TokenUsage) -> bytes:
        message = json.loads(response)["choices"][0]["message"]
        reply = {"text": message["content"], "model": alias(run), "tokens": usage.completion_tokens}
        return json.dumps(reply).encode()


class ToyTranslator(Translator):
    name = TOY
    operations: ClassVar[frozenset[str]] = frozenset({TOY})
    trace = ProtocolTrace(
        name=TOY, end_event=b"event: toy.done", end_reason=re.compile(rb'"reason": "(\w+)"')
    )
    delta_event = b"event: toy.text\n"

    def translate(self, run: Run) -> Translation:
        body = json.loads(run.body)
        chat: dict[str, Any] = {
            "model": run.target,
            "messages": [{"role": "user", "content": body["prompt"]}],
            "stream": run.stream,
        }
        if body.get("limit") is not None:
            chat["max_tokens"] = body["limit"]
        if run.stream:
            chat["stream_options"] = {"include_usage": True}
        return _ToyTranslation(json.dumps(chat).encode())


# --- the test --------------------------------------------------------------------------------


@pytest.fixture
def toy_protocol() -> Iterator[None]:
    """The toy registered on both sides for one test."""
    PROTOCOLS.register(ToyProtocol())
    TRANSLATORS.register(ToyTranslator())
    try:
        yield
    finally:
        PROTOCOLS.unregister(TOY)
        TRANSLATORS.unregister(TOY)


@pytest.fixture
async def toy_stack(nursery: trio.Nursery, tmp_path: Path, toy_protocol: None) -> Stack:
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-1")],
        models=[
            {
                "id": "m",
                "providers": {"sim-1": "sim-small"},
                "generation": {"max_tokens_limit": LIMIT},
            }
        ],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


def _events(stream: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in stream.decode().split("\n\n"):
        if block:
            name, data = block.split("\n", 1)
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_a_protocol_registered_on_both_sides_runs_end_to_end(toy_stack: Stack) -> None:
    async with toy_stack.http() as http:
        whole = await http.post(PATH, json={"model": "m", "prompt": "Say hello.", "limit": 16})
        assert whole.status_code == 200, whole.text
        reply = whole.json()
        assert reply["model"] == "m" and reply["text"] and reply["tokens"] > 0
        assert whole.headers["x-iop-provider"] == "sim-1"

        streamed = await http.post(
            PATH, json={"model": "m", "prompt": "Say hello.", "limit": 16, "stream": True}
        )
        assert streamed.status_code == 200, streamed.text
        assert streamed.headers["content-type"] == "text/event-stream"
        assert streamed.content.endswith(STREAM_END)
        events = _events(streamed.content)
        names = [name for name, _ in events]
        assert names[0] == "toy.text" and names[-2:] == ["toy.done", "toy.end"]
        done = events[-2][1]
        assert done["reason"] == "stop" and done["model"] == "m" and done["tokens"] > 0
        text = "".join(data["text"] for name, data in events if name == "toy.text")
        assert text == reply["text"]  # the sim answers a prompt the same way each time

        # Its refusals come in its own shape, naming what is wrong.
        unknown = await http.post(PATH, json={"model": "nope", "prompt": "Hi"})
        assert unknown.status_code == 404
        assert unknown.json()["toy_error"]["code"] == "model_not_found"
        too_many = await http.post(PATH, json={"model": "m", "prompt": "Hi", "limit": LIMIT + 1})
        assert too_many.status_code == 400
        assert too_many.json()["toy_error"]["code"] == "max_tokens_exceeded"
        assert "limit" in too_many.json()["toy_error"]["says"]

    # Metered under its own name, as the wire carried it.
    assert (await toy_stack.requests_by_protocol()).get(TOY) == 2


async def test_a_protocol_only_the_edge_knows_fails_its_runs_clearly(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A Node of a release without the protocol's translator refuses its runs: the caller
    hears why in the protocol's shape, and the Node goes on serving the others."""
    PROTOCOLS.register(ToyProtocol())
    try:
        text = edge_config(
            tmp_path,
            providers=[sim_provider("sim-1")],
            models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        )
        stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
        async with stack.http() as http:
            refused = await http.post(PATH, json={"model": "m", "prompt": "Hi"})
            assert refused.status_code == 502
            error = refused.json()["toy_error"]
            assert error["code"] == "unsupported_operation"
            assert "no caller protocol this Node runs" in error["says"]
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
            )
            assert chat.status_code == 200
    finally:
        PROTOCOLS.unregister(TOY)


async def test_a_protocol_neither_side_knows_is_not_served(stack_one: Stack) -> None:
    async with stack_one.http() as http:
        response = await http.post(PATH, json={"model": "m", "prompt": "Hi"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"


def test_a_path_or_name_is_one_protocols_only(toy_protocol: None) -> None:
    with pytest.raises(ValueError, match="registered already"):
        PROTOCOLS.register(ToyProtocol())
    with pytest.raises(ValueError, match="toy"):
        TRANSLATORS.register(ToyTranslator())
