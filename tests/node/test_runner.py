"""One run end to end (`iop_node.runs.runner`): every way a run ends gives one terminal answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import pytest
import trio
import trio.testing

from iop_node.adapters.base import AdapterError, Emit, RunResult
from iop_node.runs.activity import ProviderActivity
from iop_node.runs.runner import Chunk, Outbound, RunHandle, execute_run
from schemas.config import ProviderConfig
from schemas.limits import MAX_REPORTED_TOKENS
from schemas.wire import ProviderStatus, Run, RunDone, RunEvents, RunFailed, Usage, encode

PROVIDER = ProviderConfig(id="p1", type="sim", models=["m"], capacity=1)

Behaviour = Callable[[Run, Emit], Awaitable[RunResult]]


class FakeAdapter:
    """An adapter whose `execute` is whatever the test says."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.provider = PROVIDER
        self._behaviour = behaviour
        self.started = trio.Event()

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        self.started.set()
        return await self._behaviour(run, emit)

    async def probe(self) -> ProviderStatus:
        return ProviderStatus(id=self.provider.id, health="available")

    async def aclose(self) -> None:
        pass


async def _forever(run: Run, emit: Emit) -> RunResult:
    await emit(b'{"first": true}')
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def _silent_forever(run: Run, emit: Emit) -> RunResult:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def _run() -> Run:
    return Run(run_id="r1", provider_id="p1", target="m", operation="chat", body=b"{}")


class Outbox:
    def __init__(self) -> None:
        self.messages: list[Outbound] = []

    async def send(self, message: Outbound) -> None:
        self.messages.append(message)


async def _execute(
    adapter: FakeAdapter | None, run: Run | None = None, handle: RunHandle | None = None
) -> list[Outbound]:
    outbox = Outbox()
    await execute_run(run or _run(), adapter, handle or RunHandle("r1"), outbox.send)
    return outbox.messages


async def test_success_sends_chunks_then_done() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        await emit(b'{"a":1}')
        await emit(b'{"b":2}')
        return RunResult(usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))

    messages = await _execute(FakeAdapter(behaviour))
    assert messages == [
        Chunk("r1", b'data: {"a":1}\n\n'),
        Chunk("r1", b'data: {"b":2}\n\n'),
        RunDone(
            run_id="r1",
            usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
            usage_source="provider",
        ),
    ]


async def test_chunks_and_response_are_shaped_for_the_caller() -> None:
    """The caller's alias in every chunk and response, usage kept for `run_done` and its
    chunk dropped when the caller did not ask for it (`iop_node.reply`)."""
    usage_chunk = (
        b'{"model":"served","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}'
    )

    async def stream(run: Run, emit: Emit) -> RunResult:
        await emit(b'{"model":"served","choices":[{"delta":{"content":"x"}}]}')
        await emit(usage_chunk)
        return RunResult()

    run = Run(
        run_id="r1",
        provider_id="p1",
        target="served",
        operation="chat",
        body=b"{}",
        stream=True,
        reply_model="alias",
        strip_usage=True,
    )
    assert await _execute(FakeAdapter(stream), run) == [
        Chunk("r1", b'data: {"model":"alias","choices":[{"delta":{"content":"x"}}]}\n\n'),
        RunDone(
            run_id="r1",
            usage=Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3),
            usage_source="provider",
        ),
    ]

    async def whole(run: Run, emit: Emit) -> RunResult:
        return RunResult(response=b'{"model":"served","object":"chat.completion"}')

    non_stream = msgspec.structs.replace(run, stream=False, strip_usage=False)
    assert await _execute(FakeAdapter(whole), non_stream) == [
        RunDone(
            run_id="r1",
            usage=Usage(),  # no prompt in `{}`, no text in the answer: an estimate of zero
            response=b'{"model":"alias","object":"chat.completion"}',
            usage_source="estimated",
        )
    ]


async def test_output_that_is_not_json_fails_the_run() -> None:
    async def before_any_chunk(run: Run, emit: Emit) -> RunResult:
        await emit(b"<html>")
        return RunResult()

    [failed] = await _execute(FakeAdapter(before_any_chunk))
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == ("upstream_error", True)

    async def after_a_chunk(run: Run, emit: Emit) -> RunResult:
        await emit(b"{}")
        await emit(b"oops")
        return RunResult()

    *_, failed = await _execute(FakeAdapter(after_a_chunk))
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == ("upstream_stream_error", False)

    async def bad_response(run: Run, emit: Emit) -> RunResult:
        return RunResult(response=b"[1]")

    [failed] = await _execute(FakeAdapter(bad_response))
    assert isinstance(failed, RunFailed) and failed.code == "upstream_error"


async def test_non_stream_response_is_passed_through() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        return RunResult(response=b'{"object": "chat.completion"}')

    [done] = await _execute(FakeAdapter(behaviour))
    assert isinstance(done, RunDone)
    assert done.response == b'{"object": "chat.completion"}'


# --- usage: the provider's, else an estimate (design §7) ------------------------------------

#: 8 + 2 characters of content in two messages, a system message among them:
#: ceil(10 / 4) + 2 * 5 framing + 3 for the reply's opening = 16 tokens.
BODY = (
    b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}'
)
PROMPT = 16


def _chunk(text: str) -> bytes:
    return b'{"choices": [{"index": 0, "delta": {"content": "%s"}}]}' % text.encode()


def _estimated(prompt: int, completion: int) -> Usage:
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _body_run() -> Run:
    return Run(run_id="r1", provider_id="p1", target="m", operation="chat", body=BODY, stream=True)


async def test_a_stream_without_usage_is_estimated_from_what_it_emitted() -> None:
    """llama.cpp ignores `stream_options`: no usage chunk, so the Node estimates. Each
    content chunk is at least one token; long ones count their characters / 4."""

    async def behaviour(run: Run, emit: Emit) -> RunResult:
        for text in ("Hel", "lo", ", a much longer piece of text"):  # 1 + 1 + ceil(29 / 4)
            await emit(_chunk(text))
        await emit(b'{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}')
        return RunResult()

    done = (await _execute(FakeAdapter(behaviour), _body_run()))[-1]
    assert done == RunDone(run_id="r1", usage=_estimated(PROMPT, 10), usage_source="estimated")


async def test_a_non_stream_response_without_usage_is_estimated_from_its_text() -> None:
    response = b'{"choices": [{"message": {"role": "assistant", "content": "twelve chars"}}]}'

    async def behaviour(run: Run, emit: Emit) -> RunResult:
        return RunResult(response=response)

    [done] = await _execute(FakeAdapter(behaviour), _body_run())
    assert done == RunDone(
        run_id="r1", usage=_estimated(PROMPT, 3), response=response, usage_source="estimated"
    )


async def test_an_adapters_own_estimate_is_flagged_as_such() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        return RunResult(usage=_estimated(4, 2), usage_source="estimated")

    [done] = await _execute(FakeAdapter(behaviour))
    assert done == RunDone(run_id="r1", usage=_estimated(4, 2), usage_source="estimated")


async def test_a_usage_count_beyond_any_run_is_bounded_before_it_reaches_the_link() -> None:
    """An upstream's count is any JSON integer; one msgpack cannot carry would fail the
    link's writer and every run on the link."""
    huge = 10**26

    async def behaviour(run: Run, emit: Emit) -> RunResult:
        return RunResult(
            usage=Usage(
                prompt_tokens=huge, completion_tokens=-5, total_tokens=huge, cached_tokens=3
            )
        )

    [done] = await _execute(FakeAdapter(behaviour))
    assert isinstance(done, RunDone) and done.usage is not None
    assert done.usage == Usage(
        prompt_tokens=MAX_REPORTED_TOKENS,
        completion_tokens=0,
        total_tokens=MAX_REPORTED_TOKENS,  # at least prompt + completion, as the Edge meters
        cached_tokens=3,
    )
    encode(RunEvents(ends=[done]))  # the link's writer can send it


async def test_a_stream_cut_mid_way_reports_what_it_consumed() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        await emit(_chunk("one"))
        await emit(_chunk("two"))
        raise AdapterError("upstream_stream_error", "connection reset (after 2 chunks)")

    failed = (await _execute(FakeAdapter(behaviour), _body_run()))[-1]
    assert isinstance(failed, RunFailed)
    assert (failed.usage, failed.usage_source) == (_estimated(PROMPT, 2), "estimated")


async def test_an_upstream_refusal_consumed_nothing() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        raise AdapterError("upstream_rejected", "bad schema", status=400)

    [failed] = await _execute(FakeAdapter(behaviour), _body_run())
    assert isinstance(failed, RunFailed)
    assert (failed.usage, failed.usage_source) == (None, None)


async def test_a_run_cancelled_before_output_still_counts_its_prompt() -> None:
    handle = RunHandle("r1")
    handle.cancel("cancelled", "by the edge")
    [failed] = await _execute(FakeAdapter(_silent_forever), _body_run(), handle=handle)
    assert isinstance(failed, RunFailed)
    assert (failed.usage, failed.usage_source) == (_estimated(PROMPT, 0), "estimated")


async def test_every_emitted_chunk_is_a_sign_of_life(autojump_clock: trio.abc.Clock) -> None:
    activity = ProviderActivity()
    handle = RunHandle("r1", activity=activity.start(PROVIDER, stream=True))

    async def behaviour(run: Run, emit: Emit) -> RunResult:
        await trio.sleep(7)
        await emit(_chunk("x"))
        return RunResult()

    await _execute(FakeAdapter(behaviour), _body_run(), handle=handle)
    assert handle.activity is not None
    assert handle.activity.last_sign_of_life == 7


async def test_unknown_provider_fails_retryably() -> None:
    [failed] = await _execute(None)
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == ("unknown_provider", True)
    assert "p1" in failed.message


async def test_adapter_error_fields_map_onto_run_failed() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        raise AdapterError(
            "upstream_unavailable", "503 from upstream", retryable=True, capacity=True, status=503
        )

    assert await _execute(FakeAdapter(behaviour)) == [
        RunFailed(
            run_id="r1",
            code="upstream_unavailable",
            message="503 from upstream",
            retryable=True,
            capacity=True,
            status=503,
        )
    ]


async def test_failure_after_a_chunk_is_never_retryable() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        await emit(b'{"partial": true}')
        raise AdapterError("upstream_error", "stream broke", retryable=True)

    messages = await _execute(FakeAdapter(behaviour))
    assert isinstance(messages[-1], RunFailed)
    assert messages[-1].retryable is False


async def test_adapter_error_inside_an_exception_group_is_unwrapped() -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        async with trio.open_nursery() as nursery:

            async def fail() -> None:
                raise AdapterError("process_failed", "exit status 3")

            nursery.start_soon(fail)
        raise AssertionError("unreachable")

    [failed] = await _execute(FakeAdapter(behaviour))
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.message) == ("process_failed", "exit status 3")


async def test_unexpected_exception_is_an_internal_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def behaviour(run: Run, emit: Emit) -> RunResult:
        raise KeyError("oops")

    [failed] = await _execute(FakeAdapter(behaviour))
    assert isinstance(failed, RunFailed)
    assert failed.code == "internal"
    assert "KeyError" in failed.message
    assert failed.retryable is True
    assert "failed inside its adapter" in caplog.text


async def test_cancel_answers_cancelled_at_once(autojump_clock: trio.abc.Clock) -> None:
    adapter = FakeAdapter(_forever)
    handle = RunHandle("r1")
    outbox = Outbox()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(execute_run, _run(), adapter, handle, outbox.send)
        await adapter.started.wait()
        await trio.testing.wait_all_tasks_blocked()
        cancelled_at = trio.current_time()
        handle.cancel("cancelled", "cancelled by the edge")
    assert trio.current_time() == cancelled_at
    assert outbox.messages == [
        Chunk("r1", b'data: {"first": true}\n\n'),
        RunFailed(
            run_id="r1",
            code="cancelled",
            message="cancelled by the edge",
            usage=Usage(),  # `_run()` has no prompt, and `{"first": true}` no text
            usage_source="estimated",
        ),
    ]


async def test_first_cancel_reason_wins() -> None:
    handle = RunHandle("r1")
    handle.cancel("cancelled", "by the edge")
    handle.cancel("registry_retired", "later")
    [failed] = await _execute(FakeAdapter(_silent_forever), handle=handle)
    assert isinstance(failed, RunFailed)
    assert failed.code == "cancelled"


async def test_cancel_racing_a_finished_adapter_still_answers_cancelled() -> None:
    handle = RunHandle("r1")

    async def behaviour(run: Run, emit: Emit) -> RunResult:
        handle.cancel("cancelled", "too late, but asked")  # no checkpoint after this
        return RunResult()

    [failed] = await _execute(FakeAdapter(behaviour), handle=handle)
    assert isinstance(failed, RunFailed)
    assert failed.code == "cancelled"


async def test_retryable_cancel_reason() -> None:
    handle = RunHandle("r1")
    handle.cancel("node_stopping", "bye", retryable=True)

    [failed] = await _execute(FakeAdapter(_silent_forever), handle=handle)
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == ("node_stopping", True)


async def test_outside_cancellation_sends_nothing(autojump_clock: trio.abc.Clock) -> None:
    outbox = Outbox()
    with trio.move_on_after(1):
        await execute_run(_run(), FakeAdapter(_forever), RunHandle("r1"), outbox.send)
    assert outbox.messages == [Chunk("r1", b'data: {"first": true}\n\n')]
