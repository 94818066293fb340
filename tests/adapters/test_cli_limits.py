"""The `cli` adapter's bounds, with real processes that write for ever: `max_tokens` stops
the run (finish reason `length`, output counted by the shared estimator, the process
group ended), a whole answer without one stops at what a response can carry, and
`adapter.request_timeout_s` ends a run that never finishes."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from iop_node.adapters.base import AdapterError
from iop_node.adapters.cli import NON_STREAM_ANSWER_CHARS, CliAdapter
from iop_node.reply import ParsedChunk
from schemas.config import AdapterSettings, ProviderConfig
from schemas.limits import MAX_PAYLOAD_BYTES
from schemas.tokens import CHARS_PER_TOKEN, text_tokens
from schemas.wire import Operation, Run
from tests.timing import PROCESS_GUARD_S

GUARD_S = PROCESS_GUARD_S  # starting an interpreter can take a moment on a loaded machine
MODEL = "endless"

#: Writes its pid to the file named by argv[1], then words to stdout for ever.
ENDLESS = textwrap.dedent(
    """
    import os, sys
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    while True:
        sys.stdout.write("word ")
        sys.stdout.flush()
    """
)


def endless(pid_file: Path, *, timeout_s: float = 600.0) -> CliAdapter:
    settings = AdapterSettings(
        command=[sys.executable, "-c", ENDLESS, str(pid_file)], request_timeout_s=timeout_s
    )
    return CliAdapter(
        ProviderConfig(id="cli-1", type="cli", models=[MODEL], capacity=1, adapter=settings),
        frozenset({tuple(settings.command or ())}),
    )


def make_run(body: dict[str, Any], *, stream: bool, operation: Operation = "chat") -> Run:
    return Run(
        run_id="run-1",
        provider_id="cli-1",
        target=MODEL,
        operation=operation,
        body=json.dumps(body).encode(),
        stream=stream,
    )


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], **extra}


class Chunks:
    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []

    async def __call__(self, data: bytes, parsed: ParsedChunk | None = None, /) -> None:
        self.chunks.append(json.loads(data))


def assert_gone(pid_file: Path) -> None:
    """The process was ended and reaped: its pid no longer exists."""
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_stops_a_stream_with_finish_reason_length(
    tmp_path: Path, key: str
) -> None:
    pid_file = tmp_path / "pid"
    chunks = Chunks()
    body = chat(**{key: 5}, stream_options={"include_usage": True})
    with trio.fail_after(GUARD_S):
        result = await endless(pid_file).execute(make_run(body, stream=True), chunks)
    *content, finish, usage_chunk = chunks.chunks
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in content)
    assert len(text) == 5 * CHARS_PER_TOKEN and text.startswith("word word")
    assert finish["choices"][0]["finish_reason"] == "length"
    assert result.usage is not None and result.usage.completion_tokens == 5 == text_tokens(text)
    assert usage_chunk["usage"]["completion_tokens"] == 5
    assert_gone(pid_file)


async def test_max_tokens_stops_a_whole_answer_with_finish_reason_length(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "pid"
    with trio.fail_after(GUARD_S):
        result = await endless(pid_file).execute(
            make_run(chat(max_tokens=3), stream=False), Chunks()
        )
    assert result.response is not None
    [choice] = json.loads(result.response)["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["message"]["content"]) == 3 * CHARS_PER_TOKEN
    assert result.usage is not None and result.usage.completion_tokens == 3
    assert_gone(pid_file)


async def test_max_tokens_stops_a_text_completion(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 2}
    with trio.fail_after(GUARD_S):
        result = await endless(pid_file).execute(
            make_run(body, stream=False, operation="completion"), Chunks()
        )
    assert result.response is not None
    [choice] = json.loads(result.response)["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("word wor", "length")
    assert_gone(pid_file)


async def test_the_run_timeout_ends_a_process_that_writes_for_ever(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    chunks = Chunks()
    # Time for an interpreter to start and stream on a loaded machine, then the deadline.
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as raised:
        await endless(pid_file, timeout_s=3.0).execute(make_run(chat(), stream=True), chunks)
    assert chunks.chunks  # it streamed until the deadline...
    assert raised.value.code == "upstream_stream_error" and not raised.value.retryable
    assert "did not finish within 3s" in raised.value.message
    assert_gone(pid_file)  # ...and was ended with it

    unbounded = endless(pid_file, timeout_s=0.5)
    unbounded.non_stream_answer_chars = sys.maxsize  # the deadline, not the answer's bound
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as raised:
        await unbounded.execute(make_run(chat(), stream=False), Chunks())
    assert raised.value.code == "upstream_timeout"
    assert_gone(pid_file)


async def test_a_whole_answer_without_a_limit_stops_at_what_a_response_carries(
    tmp_path: Path,
) -> None:
    assert NON_STREAM_ANSWER_CHARS * 8 <= MAX_PAYLOAD_BYTES
    pid_file = tmp_path / "pid"
    adapter = endless(pid_file)
    adapter.non_stream_answer_chars = 1000  # the real bound, megabytes, takes a while
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(make_run(chat(), stream=False), Chunks())
    assert result.response is not None
    [choice] = json.loads(result.response)["choices"]
    assert (choice["finish_reason"], len(choice["message"]["content"])) == ("length", 1000)
    assert result.usage is not None and result.usage.completion_tokens == 1000 // CHARS_PER_TOKEN
    assert_gone(pid_file)
    # A request's own limit below the bound is kept; above it, the bound holds.
    for max_tokens, chars in ((100, 100 * CHARS_PER_TOKEN), (10**6, 1000)):
        with trio.fail_after(GUARD_S):
            result = await adapter.execute(
                make_run(chat(max_tokens=max_tokens), stream=False), Chunks()
            )
        assert result.response is not None
        assert len(json.loads(result.response)["choices"][0]["message"]["content"]) == chars


async def test_a_stream_is_not_cut_at_a_whole_answers_bound(tmp_path: Path) -> None:
    """A stream's text goes out as it comes (it is counted, not kept): the bound of a
    whole answer does not cut it, and the usage counts every character sent."""
    pid_file = tmp_path / "pid"
    adapter = endless(pid_file, timeout_s=600.0)
    adapter.non_stream_answer_chars = 10
    chunks = Chunks()
    body = chat(max_tokens=500, stream_options={"include_usage": True})
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(make_run(body, stream=True), chunks)
    *content, finish, _ = chunks.chunks
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in content)
    assert len(text) == 500 * CHARS_PER_TOKEN  # past the whole answer's bound of 10
    assert finish["choices"][0]["finish_reason"] == "length"
    assert result.usage is not None and result.usage.completion_tokens == 500
