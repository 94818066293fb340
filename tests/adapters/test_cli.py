"""CliAdapter with real subprocesses (small `python -c` scripts)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from iop_node.adapters.base import Adapter, AdapterError
from iop_node.adapters.cli import CliAdapter, build_argv, render_prompt
from iop_node.reply import ParsedChunk
from schemas.config import AdapterSettings, ProviderConfig
from schemas.tokens import estimate_input_tokens, text_tokens
from schemas.wire import Operation, Run
from tests.timing import PROCESS_GUARD_S

MODEL = "tiny-cli-model"

ECHO_STDIN = "import sys; sys.stdout.write(sys.stdin.read())"
# Prints lines with a pause between them, flushing each: output that arrives over time.
LINES = textwrap.dedent(
    """
    import sys, time
    for word in ["alpha ", "beta ", "gamma"]:
        sys.stdout.write(word)
        sys.stdout.flush()
        time.sleep(0.05)
    """
)


def adapter_for(*command: str, timeout_s: float = 600.0, allowed: bool = True) -> CliAdapter:
    """A cli adapter for `command`, which this Node allows unless `allowed` is False."""
    return CliAdapter(
        ProviderConfig(
            id="cli-1",
            type="cli",
            models=[MODEL],
            capacity=2,
            adapter=AdapterSettings(command=list(command), request_timeout_s=timeout_s),
        ),
        frozenset({command}) if allowed else frozenset(),
    )


def python(script: str, *args: str) -> CliAdapter:
    return adapter_for(sys.executable, "-c", script, *args)


def make_run(body: dict[str, Any], *, stream: bool, operation: Operation = "chat") -> Run:
    return Run(
        run_id="run-9",
        provider_id="cli-1",
        target=MODEL,
        operation=operation,
        body=json.dumps(body).encode(),
        stream=stream,
    )


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "say three words"}]}


class Collector:
    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.first = trio.Event()

    async def __call__(self, data: bytes) -> None:
        self.chunks.append(json.loads(data))
        self.first.set()

    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content", "") for c in self.chunks[:-1])


async def test_stream_emits_stdout_as_chat_chunks() -> None:
    collector = Collector()
    with trio.fail_after(PROCESS_GUARD_S):
        result = await python(LINES).execute(make_run(CHAT, stream=True), collector)
    assert collector.text() == "alpha beta gamma"
    assert len(collector.chunks) >= 2  # at least one delta, then the finish chunk
    first, last = collector.chunks[0], collector.chunks[-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["model"] == MODEL
    assert first["id"] == "chatcmpl-run-9"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in collector.chunks[1:])
    assert last["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert result.usage is not None
    assert result.usage.prompt_tokens == estimate_input_tokens(CHAT)
    assert result.usage.completion_tokens == text_tokens("alpha beta gamma")
    assert result.usage.total_tokens == (
        result.usage.prompt_tokens + result.usage.completion_tokens
    )
    assert result.response is None


async def test_stream_usage_chunk_when_asked() -> None:
    collector = Collector()
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with trio.fail_after(PROCESS_GUARD_S):
        result = await python(ECHO_STDIN).execute(make_run(body, stream=True), collector)
    usage_chunk = collector.chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": result.usage.prompt_tokens if result.usage else None,
        "completion_tokens": text_tokens("say three words"),
        "total_tokens": result.usage.total_tokens if result.usage else None,
    }


async def test_non_stream_collects_a_chat_completion() -> None:
    collector = Collector()
    with trio.fail_after(PROCESS_GUARD_S):
        result = await python(LINES).execute(make_run(CHAT, stream=False), collector)
    assert collector.chunks == []
    assert result.response is not None
    response = json.loads(result.response)
    assert response["object"] == "chat.completion"
    assert response["model"] == MODEL
    assert response["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "alpha beta gamma"},
            "finish_reason": "stop",
        }
    ]
    assert response["usage"]["completion_tokens"] == text_tokens("alpha beta gamma")


async def test_completion_gets_the_prompt_on_stdin_and_text_completion_shape() -> None:
    body = {"model": MODEL, "prompt": "Once upon a time, caf\u00e9"}
    with trio.fail_after(PROCESS_GUARD_S):
        result = await python(ECHO_STDIN).execute(
            make_run(body, stream=False, operation="completion"), Collector()
        )
    assert result.response is not None
    response = json.loads(result.response)
    assert response["object"] == "text_completion"
    assert response["choices"][0]["text"] == "Once upon a time, caf\u00e9"


async def test_chat_transcript_on_stdin() -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        ],
    }
    with trio.fail_after(PROCESS_GUARD_S):
        result = await python(ECHO_STDIN).execute(make_run(body, stream=False), Collector())
    assert result.response is not None
    content = json.loads(result.response)["choices"][0]["message"]["content"]
    assert content == "system: Be brief.\n\nuser: Hello"


async def test_model_is_substituted_in_argv() -> None:
    adapter = python("import sys; print(sys.argv[1:])", "{model}", "--model={model}")
    with trio.fail_after(PROCESS_GUARD_S):
        result = await adapter.execute(make_run(CHAT, stream=False), Collector())
    assert result.response is not None
    content = json.loads(result.response)["choices"][0]["message"]["content"]
    assert content == f"{[MODEL, f'--model={MODEL}']}\n"


async def test_non_zero_exit_reports_the_stderr_tail() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.stderr.write("noise " * 2000)
        sys.stderr.write("\\nfatal: model weights missing\\n")
        sys.exit(3)
        """
    )
    with trio.fail_after(PROCESS_GUARD_S), pytest.raises(AdapterError) as info:
        await python(script).execute(make_run(CHAT, stream=True), Collector())
    error = info.value
    assert error.code == "cli_failed"
    assert "exited with status 3" in error.message
    assert error.message.endswith("fatal: model weights missing")
    assert len(error.message) < 2500  # the tail, not the whole stderr
    assert error.retryable  # nothing was emitted: another provider may serve it


def _wait_for_exit_handle(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        pytest.skip("os.pidfd_open is not available: needs Linux 5.3 or later")


#: A command that starts a helper of its own (as wrapper scripts do) and reports both pids.
_WITH_HELPER = textwrap.dedent(
    """
    import subprocess, sys, os, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(os.getpid(), helper.pid, flush=True)
    """
)


async def _cancel_once_started(
    script: str, before_cancel: Callable[[int], Awaitable[None]]
) -> tuple[int, int]:
    """Run `script` (which prints its pid and its helper's), await `before_cancel(pid)`,
    then cancel the run and wait until the helper is gone; the two pids."""
    adapter = python(script)
    seen = ""
    pids_known = trio.Event()

    async def emit(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
        nonlocal seen
        seen += json.loads(data)["choices"][0]["delta"].get("content") or ""
        if "\n" in seen:
            pids_known.set()

    with trio.fail_after(PROCESS_GUARD_S):
        with trio.CancelScope() as runner_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(adapter.execute, make_run(CHAT, stream=True), emit)
                await pids_known.wait()
                pid, helper_pid = (int(p) for p in seen.split())
                await before_cancel(pid)
                helper_exit = _wait_for_exit_handle(helper_pid)
                runner_scope.cancel()
        assert runner_scope.cancelled_caught
        try:
            await trio.lowlevel.wait_readable(helper_exit)  # the helper died too
        finally:
            os.close(helper_exit)
    return pid, helper_pid


async def _nothing(pid: int) -> None:
    pass


async def test_cancel_kills_the_process_group() -> None:
    # The command would then run for a minute; cancelling the run must kill and reap
    # both it and its helper at once.
    pid, _ = await _cancel_once_started(_WITH_HELPER + "time.sleep(60)\n", _nothing)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped: the pid no longer exists


async def test_a_helper_left_holding_stdout_is_killed_with_its_command() -> None:
    """A command that exits but leaves a helper of its own holding its stdout never ends
    its output: when the run ends (here, cancelled), the helper dies with it though its
    parent is gone."""

    async def command_gone(pid: int) -> None:
        command_exit = _wait_for_exit_handle(pid)
        try:
            await trio.lowlevel.wait_readable(command_exit)
        finally:
            os.close(command_exit)

    await _cancel_once_started(_WITH_HELPER, command_gone)


async def test_request_timeout_kills_a_stuck_process() -> None:
    adapter = adapter_for(sys.executable, "-c", "import time; time.sleep(60)", timeout_s=0.3)
    with trio.fail_after(PROCESS_GUARD_S), pytest.raises(AdapterError) as info:
        await adapter.execute(make_run(CHAT, stream=True), Collector())
    assert (info.value.code, info.value.retryable) == ("upstream_timeout", True)


async def test_embeddings_are_unsupported() -> None:
    body = {"model": MODEL, "input": "hello"}
    with pytest.raises(AdapterError) as info:
        await python(ECHO_STDIN).execute(
            make_run(body, stream=False, operation="embedding"), Collector()
        )
    assert info.value.code == "unsupported_operation"


async def test_missing_executable_fails_the_run() -> None:
    adapter = adapter_for("/nonexistent/iop-test-cli", "{model}")
    with trio.fail_after(PROCESS_GUARD_S), pytest.raises(AdapterError) as info:
        await adapter.execute(make_run(CHAT, stream=True), Collector())
    assert (info.value.code, info.value.retryable) == ("cli_failed", True)


async def test_probe_checks_the_executable() -> None:
    available = await python(ECHO_STDIN).probe()
    assert (available.id, available.health, available.models) == ("cli-1", "available", [MODEL])
    missing = await adapter_for("/nonexistent/iop-test-cli").probe()
    assert missing.health == "unavailable"
    assert missing.detail is not None and "/nonexistent/iop-test-cli" in missing.detail


async def test_a_command_this_node_does_not_allow_is_never_started(tmp_path: Path) -> None:
    """The Edge's config names the command; the Node's operator decides whether it runs."""
    ran = tmp_path / "ran"
    adapter = adapter_for(sys.executable, "-c", f"open({str(ran)!r}, 'w')", allowed=False)
    status = await adapter.probe()
    assert status.health == "unavailable"
    line = shlex.join(adapter.command)
    assert status.detail == (
        f"this Node does not run `{line}` for its Edge: its operator allows it "
        f"with `iop-node run --allow-command {shlex.quote(line)}`"
    )
    with trio.fail_after(PROCESS_GUARD_S), pytest.raises(AdapterError) as refused:
        await adapter.execute(make_run(CHAT, stream=False), Collector())
    assert (refused.value.code, refused.value.retryable) == ("upstream_misconfigured", True)
    assert refused.value.message == status.detail
    assert not ran.exists()


async def test_an_allowed_program_runs_only_with_the_arguments_allowed() -> None:
    """The whole command line is what the operator allows: the same program with other
    arguments (which could make it run code), or named another way, is not allowed."""

    def adapter(command: list[str], *allowed: tuple[str, ...]) -> CliAdapter:
        settings = AdapterSettings(command=command)
        provider = ProviderConfig(id="c", type="cli", models=[MODEL], capacity=1, adapter=settings)
        return CliAdapter(provider, frozenset(allowed))

    template = (sys.executable, "-c", ECHO_STDIN, "{model}")
    assert (await adapter(list(template), template).probe()).health == "available"
    for command in (
        [sys.executable, "-c", "import os", "{model}"],  # the arguments the Edge chose
        [sys.executable, "-c", ECHO_STDIN],  # fewer of them
        ["python3", "-c", ECHO_STDIN, "{model}"],  # another spelling of the program
    ):
        assert (await adapter(command, template).probe()).health == "unavailable", command


async def test_a_served_name_that_reads_as_an_option_is_refused() -> None:
    """An allowed template's {model} place takes the served name: one that begins with
    `-` would be read by the program as an option the operator never allowed."""
    adapter = python(ECHO_STDIN, "{model}")
    run = msgspec.structs.replace(make_run(CHAT, stream=False), target="--exec=evil")
    with trio.fail_after(PROCESS_GUARD_S), pytest.raises(AdapterError) as refused:
        await adapter.execute(run, Collector())
    assert (refused.value.code, refused.value.retryable) == ("upstream_misconfigured", True)
    assert "begins with '-'" in refused.value.message


def test_render_prompt_rules() -> None:
    single = {"messages": [{"role": "user", "content": "just this"}]}
    assert render_prompt(single, "chat") == "just this"
    assert render_prompt({"prompt": ["a", "b"]}, "completion") == "a\nb"
    with pytest.raises(AdapterError):
        render_prompt({"prompt": [1, 2, 3]}, "completion")


def test_build_argv() -> None:
    assert build_argv(["llm", "-m", "{model}", "x{model}y"], "m1") == ["llm", "-m", "m1", "xm1y"]


def test_is_an_adapter() -> None:
    adapter: Adapter = python(ECHO_STDIN)  # checked statically by mypy
    assert adapter.provider.type == "cli"


def test_command_is_required() -> None:
    with pytest.raises(ValueError, match="command"):
        CliAdapter(ProviderConfig(id="c", type="cli", models=[MODEL], capacity=1))
