"""The adapter for command-line models: one process per run, prompt on stdin, answer on stdout.

`adapter.command` is an argv (never a shell line); `{model}` in any element is replaced
by the run's target, e.g. `["llm", "-m", "{model}"]` or `["ollama", "run", "{model}"]`.

Prompt rendering (what the process reads on stdin, UTF-8, then EOF):

- completion: the `prompt` (a list of prompts is joined with newlines);
- chat with a single message: that message's text, verbatim, because that is what a
  CLI given a question on stdin expects;
- chat with several messages: a plain transcript, one `role: text` block per message,
  blocks separated by a blank line, so a system prompt and earlier turns are not lost.

Message text is the `content` string, or the text parts of a multimodal `content` list
(other parts, such as images, cannot travel through a text pipe and are dropped).

Whatever the process writes to stdout is the answer. It is read as it comes, decoded as
UTF-8 incrementally (a character split across two reads is never torn), and each piece is
emitted at once as an OpenAI `chat.completion.chunk` (or `text_completion` chunk for the
completion operation), with `model` = the target; for non-stream runs the pieces are
collected into one `chat.completion` / `text_completion`. Usage: prompt tokens from the
shared estimator (`schemas.tokens`), completion tokens from the output's length.

The answer is bounded as an engine bounds it: once the output reaches the request's
`max_completion_tokens` / `max_tokens` (counted by the same estimator as its usage, so
`max_tokens * CHARS_PER_TOKEN` characters), reading stops, the process group is ended and
the run finishes with `finish_reason: length`. A non-stream request without a limit is
bounded all the same, by what one response can carry over the Node's link
(`NON_STREAM_ANSWER_CHARS`); a stream's text is sent as it comes and only counted, so a
stream without a limit holds no more than one read. A run that does not finish within
`adapter.request_timeout_s` fails (`upstream_timeout`, or `upstream_stream_error` once
output was streamed).

The Node runs only the command lines its own operator allowed (`iop-node run
--allow-command 'llm -m {model}'`, `allow_commands` in its config file), whatever the
Edge's config says: a provider config is the Edge's, and without the Node's consent
anyone who could change it (a local user of the Edge's machine, through its loopback
admin API) would run programs on every Node. What is allowed is the whole argv template,
`{model}` included, compared with `adapter.command` as written: the Edge chooses no
argument of an allowed program (many programs run code given the right ones), only the
served model name in its `{model}` places, and a name that begins with `-` (an option
to the program) is refused. A provider whose command is not allowed is unavailable (its
status gives the flag that allows it) and refuses its runs without starting anything.

A non-zero exit is a run failure (`cli_failed`, with the exit status and the tail of
stderr). The process gets a session of its own, so cancelling a run (or a failure) kills
the whole process group — wrapper scripts and their children included — and reaps it,
within a bounded, shielded cleanup.
"""

from __future__ import annotations

import codecs
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

import msgspec
import trio
from msgspec import UNSET, UnsetType

from iop_node.adapters.base import AdapterError, Emit, RunResult
from schemas.config import ProviderConfig
from schemas.limits import MAX_PAYLOAD_BYTES
from schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    CompletionUsage,
    Delta,
    TextChoice,
    TextCompletion,
)
from schemas.tokens import CHARS_PER_TOKEN, estimate_input_tokens, text_tokens_of
from schemas.wire import FailureCode, ProviderStatus, Run, Usage

#: How much of stderr is kept for the failure message (the tail is what explains it).
_STDERR_TAIL_BYTES = 2048
#: Bound on killing and reaping the process once the run is over or cancelled.
_REAP_GRACE_S = 5.0
#: Characters of a non-stream answer when the request sets no limit: what one response
#: surely carries over the link (`schemas.limits`), JSON escaping (six bytes a character
#: at worst) and the envelope included.
NON_STREAM_ANSWER_CHARS: Final = MAX_PAYLOAD_BYTES // 8


# --- OpenAI output ----------------------------------------------------------------------------

_encode: Final = msgspec.json.Encoder().encode


class _Shaper:
    """Builds the OpenAI JSON of one run's output: chat or text-completion flavour.

    A command-line model has no log probabilities, so chat choices carry no `logprobs`
    field (text-completion choices keep OpenAI's `logprobs: null`)."""

    def __init__(self, run: Run) -> None:
        self._chat = run.operation == "chat"
        self._id = ("chatcmpl-" if self._chat else "cmpl-") + (run.request_id or run.run_id)
        self._model = run.target
        self._created = int(time.time())
        self._first = True

    def chunk(self, text: str | None, finish_reason: str | None = None) -> bytes:
        if not self._chat:
            choice = TextChoice(text=text or "", finish_reason=finish_reason)
            return self._text([choice])
        role = "assistant" if self._first else None
        self._first = False
        return self._chat_chunk(
            [ChunkChoice(delta=Delta(role=role, content=text), finish_reason=finish_reason)]
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        if not self._chat:
            return self._text([], CompletionUsage.of(usage))
        return self._chat_chunk([], CompletionUsage.of(usage))

    def response(self, text: str, usage: Usage, finish_reason: str) -> bytes:
        if not self._chat:
            return self._text(
                [TextChoice(text=text, finish_reason=finish_reason)], CompletionUsage.of(usage)
            )
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return _encode(
            ChatCompletion(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[choice],
                usage=CompletionUsage.of(usage),
            )
        )

    def _chat_chunk(
        self, choices: list[ChunkChoice], usage: CompletionUsage | UnsetType = UNSET
    ) -> bytes:
        return _encode(
            ChatCompletionChunk(
                id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
            )
        )

    def _text(self, choices: list[TextChoice], usage: CompletionUsage | UnsetType = UNSET) -> bytes:
        return _encode(
            TextCompletion(
                id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
            )
        )


# --- prompt rendering (pure) ----------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        return "".join(parts)
    return ""


def render_prompt(body: dict[str, Any], operation: Literal["chat", "completion"]) -> str:
    """The text a CLI reads on stdin for one request (rules in the module docstring)."""
    if operation == "completion":
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if isinstance(prompt, str):
            return prompt
        raise AdapterError(
            FailureCode.UNSUPPORTED_REQUEST,
            "cli providers take a text prompt (not token ids)",
            retryable=True,
        )
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    if len(messages) == 1:
        return _text_of(messages[0].get("content"))
    return "\n\n".join(f"{m.get('role', 'user')}: {_text_of(m.get('content'))}" for m in messages)


#: The command lines a Node's operator allows, each an argv template (`{model}` kept).
AllowedCommands = frozenset[tuple[str, ...]]


def build_argv(command: list[str], target: str) -> list[str]:
    return [part.replace("{model}", target) for part in command]


def max_output_chars(body: dict[str, Any]) -> int | None:
    """How many characters of output the request allows (its `max_completion_tokens`,
    else `max_tokens`, by the estimator's characters per token); None: no limit."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value * CHARS_PER_TOKEN
    return None


class _Answer:
    """One answer so far, cut at its limit: the request's (`max_output_chars`) or, for a
    non-stream answer, what a response can carry. A non-stream answer keeps its text; a
    stream's is sent as it comes, so only its length is kept."""

    __slots__ = ("_room", "chars", "pieces", "truncated")

    def __init__(self, limit_chars: int | None, *, keep_text: int | None) -> None:
        """`keep_text`: keep the text, up to this many characters; None: count it only."""
        if keep_text is not None:
            limit_chars = min(limit_chars or keep_text, keep_text)
        self._room = limit_chars
        self.chars = 0
        self.pieces: list[str] | None = None if keep_text is None else []
        self.truncated = False
        """The limit was reached: the rest of the output is not wanted."""

    def take(self, text: str) -> str:
        """The part of `text` that fits (all of it without a limit); notes when full."""
        if self._room is not None:
            text = text[: self._room]
            self._room -= len(text)
            self.truncated = self._room == 0
        self.chars += len(text)
        if text and self.pieces is not None:
            self.pieces.append(text)
        return text

    def text(self) -> str:
        return "".join(self.pieces or ())


# --- process plumbing ---------------------------------------------------------------------


async def _feed(stdin: trio.abc.SendStream, data: bytes) -> None:
    """Write the prompt and close stdin; a process that exits without reading is fine."""
    try:
        async with stdin:
            if data:
                await stdin.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _keep_tail(stderr: trio.abc.ReceiveStream, tail: bytearray) -> None:
    """Keep the last bytes of stderr: the end is what explains a failure."""
    try:
        async for data in stderr:
            tail += data
            del tail[:-_STDERR_TAIL_BYTES]
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def _kill(process: trio.Process) -> None:
    """Kill the process and everything it started (its own session/process group), the
    children of a command that exited already included (one that left a helper holding
    its stdout, say)."""
    if os.name != "posix":  # pragma: no cover - POSIX is what we run on
        if process.returncode is None:
            process.kill()
        return
    if _reaped(process.pid):
        return  # its pid (and group id) may belong to someone else by now
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reaped(pid: int) -> bool:
    """Whether our child `pid` was reaped. One that runs, or exited and waits to be
    reaped, still holds its pid and so its process group's id; asking (`WNOWAIT`) does
    not reap it, as reading `trio.Process.returncode` would."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# --- the adapter --------------------------------------------------------------------------


class CliAdapter:
    """Run each request as a local process (`adapter.command`) and relay its stdout."""

    non_stream_answer_chars: int = NON_STREAM_ANSWER_CHARS
    """A non-stream answer's bound when the request sets none."""

    def __init__(
        self, provider: ProviderConfig, allowed_commands: AllowedCommands = frozenset()
    ) -> None:
        """`allowed_commands`: the command lines this Node's operator allows (module
        docstring)."""
        command = provider.adapter.command
        if not command:
            raise ValueError(f"provider {provider.id!r}: adapter.command is required")
        self.provider = provider
        self.command = list(command)
        line = shlex.join(self.command)
        self._refusal = (
            None
            if tuple(self.command) in allowed_commands
            else f"this Node does not run `{line}` for its Edge: its operator allows it "
            f"with `iop-node run --allow-command {shlex.quote(line)}`"
        )

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        if self._refusal is not None:
            raise AdapterError(FailureCode.UPSTREAM_MISCONFIGURED, self._refusal, retryable=True)
        if run.target.startswith("-") and any("{model}" in part for part in self.command):
            raise AdapterError(
                FailureCode.UPSTREAM_MISCONFIGURED,
                f"the served model name {run.target!r} begins with '-': in the command's "
                "{model} place the program would read it as an option",
                retryable=True,
            )
        match run.operation:
            case "chat" | "completion" as operation:
                pass
            case other:  # Messages and Responses reach a CLI translated to chat (design §14)
                raise AdapterError(
                    FailureCode.UNSUPPORTED_OPERATION,
                    f"cli providers do not serve the {other} operation",
                    retryable=True,
                )
        try:
            body = msgspec.json.decode(run.body, type=dict[str, Any])
        except msgspec.DecodeError as exc:
            raise AdapterError(FailureCode.INVALID_REQUEST, f"request body: {exc}") from None
        prompt = render_prompt(body, operation)
        shaper = _Shaper(run)
        answer = _Answer(
            max_output_chars(body), keep_text=None if run.stream else self.non_stream_answer_chars
        )
        emitted = 0

        async def on_text(text: str) -> bool:
            nonlocal emitted
            text = answer.take(text)
            if run.stream and text:
                await emit(shaper.chunk(text))
                emitted += 1
            return not answer.truncated

        timeout_s = self.provider.adapter.request_timeout_s
        with trio.move_on_after(timeout_s) as scope:
            code, stderr_tail = await self._run_process(run, prompt.encode(), on_text)
        if scope.cancelled_caught:
            raise AdapterError(
                FailureCode.UPSTREAM_TIMEOUT if not emitted else FailureCode.UPSTREAM_STREAM_ERROR,
                f"{self.command[0]} did not finish within {timeout_s:g}s",
                retryable=not emitted,
            )
        if code is not None and code != 0:
            message = f"{self.command[0]} {_exit_description(code)}"
            if stderr_tail:
                message += f": {stderr_tail}"
            raise AdapterError(FailureCode.CLI_FAILED, message, retryable=not emitted)

        finish_reason = "length" if answer.truncated else "stop"
        prompt_tokens, completion_tokens = estimate_input_tokens(body), text_tokens_of(answer.chars)
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        if not run.stream:
            response = shaper.response(answer.text(), usage, finish_reason)
            return RunResult(usage=usage, response=response, usage_source="estimated")
        await emit(shaper.chunk(None, finish_reason=finish_reason))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await emit(shaper.usage_chunk(usage))
        return RunResult(usage=usage, usage_source="estimated")

    async def _run_process(
        self, run: Run, stdin_data: bytes, on_text: Callable[[str], Awaitable[bool]]
    ) -> tuple[int | None, str]:
        """Run the command to completion, passing decoded stdout to `on_text` as it comes,
        until `on_text` says it wants no more.

        Returns the exit status (None when `on_text` stopped the reading) and the decoded
        tail of stderr. However this ends (normal exit, enough output, failure,
        cancellation), the process group is killed and the process reaped.
        """
        argv = build_argv(self.command, run.target)
        try:
            process = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise AdapterError(
                FailureCode.CLI_FAILED,
                f"cannot start {argv[0]}: {exc.strerror or exc}",
                retryable=True,
            ) from None
        assert process.stdin is not None and process.stdout is not None
        assert process.stderr is not None
        tail = bytearray()
        try:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_feed, process.stdin, stdin_data)
                    nursery.start_soon(_keep_tail, process.stderr, tail)
                    code = await self._relay_stdout(process, on_text)
                    if code is None:  # enough output: end the process, its stdin and stderr
                        _kill(process)
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # `_feed` and `_keep_tail` never raise, so a group holds the body's own
                # exception (an emit failure, a cancellation): surface it as itself, as
                # every other adapter does.
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
        finally:
            with trio.move_on_after(_REAP_GRACE_S, shield=True):
                _kill(process)
                await process.wait()
                for stream in (process.stdin, process.stdout, process.stderr):
                    await stream.aclose()
        return code, tail.decode("utf-8", errors="replace").strip()

    @staticmethod
    async def _relay_stdout(
        process: trio.Process, on_text: Callable[[str], Awaitable[bool]]
    ) -> int | None:
        """Pass stdout to `on_text` as it arrives, then wait for the exit status; None,
        at once, when `on_text` wants no more (the caller ends the process)."""
        assert process.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for data in process.stdout:
            text = decoder.decode(data)
            if text and not await on_text(text):
                return None
        rest = decoder.decode(b"", final=True)
        if rest and not await on_text(rest):
            return None
        return await process.wait()

    async def probe(self) -> ProviderStatus:
        if self._refusal is not None:
            return ProviderStatus(id=self.provider.id, health="unavailable", detail=self._refusal)
        executable = self.command[0]
        found = await trio.to_thread.run_sync(shutil.which, executable)
        if found is None:
            return ProviderStatus(
                id=self.provider.id,
                health="unavailable",
                detail=f"executable {executable!r} not found",
            )
        return ProviderStatus(
            id=self.provider.id, health="available", models=list(self.provider.models)
        )

    async def aclose(self) -> None:
        """Nothing long-lived: every process belongs to (and dies with) its run."""
