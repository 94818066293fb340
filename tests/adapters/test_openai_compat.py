"""OpenAICompatAdapter against the fake upstream, over real loopback sockets."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import trio

from iop_node.adapters.base import AdapterError, ProbeTimeout, RunResult
from iop_node.adapters.openai_compat import OpenAICompatAdapter, status_failure
from iop_node.adapters.upstream_errors import MESSAGE_LIMIT, error_message
from iop_node.adapters.upstream_http import exchange
from iop_node.adapters.upstream_http.failures import retry_after
from iop_node.reply import ParsedChunk
from schemas.config import AdapterSettings, ProviderConfig
from schemas.wire import Operation, Run, Usage
from tests.timing import GUARD_S

from .conftest import MODEL, MakeAdapter
from .fake_upstream import (
    PROMPT_TOKENS,
    FakeUpstream,
    error_body,
    expected_events,
    expected_response,
    invalid_report,
)

FAKE_KEY_ENV = "IOP_TEST_FAKE_UPSTREAM_KEY"
FAKE_KEY = "sk-test-not-a-real-key"


def make_run(
    *, stream: bool = False, operation: Operation = "chat", **extra: Any
) -> tuple[Run, bytes]:
    if operation == "embedding":
        payload: dict[str, Any] = {"model": MODEL, "input": "hello"}
    elif operation == "completion":
        payload = {"model": MODEL, "prompt": "Once upon a time"}
    else:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        payload["stream"] = True
    payload.update(extra)
    # Unusual but valid formatting: the upstream must receive exactly these bytes.
    body = json.dumps(payload, indent=1).encode()
    run = Run(
        run_id="run-1",
        provider_id="p1",
        target=MODEL,
        operation=operation,
        body=body,
        stream=stream,
    )
    return run, body


class Collector:
    """An `emit` that records chunks and lets a test wait for the n-th one."""

    def __init__(self, expect: int = 32) -> None:
        self.chunks: list[bytes] = []
        self.readings: list[ParsedChunk | None] = []
        self.seen = [trio.Event() for _ in range(expect)]

    async def __call__(self, data: bytes, parsed: ParsedChunk | None = None, /) -> None:
        self.chunks.append(data)
        self.readings.append(parsed)
        self.seen[len(self.chunks) - 1].set()


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def expect_failure(adapter: OpenAICompatAdapter, run: Run) -> AdapterError:
    collector = Collector()
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await adapter.execute(run, collector)
    return info.value


# --- success paths ----------------------------------------------------------------------------


async def test_non_stream_returns_the_upstream_body_and_usage(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    adapter = make_adapter(upstream.base_url)
    run, body = make_run()
    collector = Collector()
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(run, collector)
    assert result == RunResult(
        usage=Usage(
            prompt_tokens=PROMPT_TOKENS, completion_tokens=3, total_tokens=PROMPT_TOKENS + 3
        ),
        response=expected_response(MODEL, 3),
    )
    assert collector.chunks == []
    request = upstream.requests[-1]
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert request.body == body
    assert request.headers["content-type"] == "application/json"
    assert "authorization" not in request.headers


@pytest.mark.parametrize(
    ("operation", "path"),
    [("completion", "/v1/completions"), ("embedding", "/v1/embeddings")],
)
async def test_each_operation_has_its_path(
    upstream: FakeUpstream, make_adapter: MakeAdapter, operation: Operation, path: str
) -> None:
    adapter = make_adapter(upstream.base_url)
    run, body = make_run(operation=operation)
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(run, Collector())
    assert result.response == expected_response(MODEL, 3, operation=operation)
    assert result.usage is not None and result.usage.prompt_tokens == PROMPT_TOKENS
    assert (upstream.requests[-1].path, upstream.requests[-1].body) == (path, body)


async def test_stream_relays_each_event_before_the_next_exists(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    adapter = make_adapter(upstream.base_url)
    collector = Collector()

    async def pace(index: int) -> None:
        # The upstream sends event i only once event i-1 has reached `emit`: a relay that
        # buffered anything would deadlock here (and trip the guard).
        if index:
            await collector.seen[index - 1].wait()

    upstream.chunks = 5
    upstream.pace = pace
    run, _ = make_run(stream=True, stream_options={"include_usage": True})
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(run, collector)
    # Byte for byte: provider extras, key order, spacing and \u escapes all survive.
    assert collector.chunks == expected_events(MODEL, 5, include_usage=True)
    assert b'"provider_extra"' in collector.chunks[0]
    assert b"caf\\u00e9" in collector.chunks[0]
    assert b'"reasoning_content"' in collector.chunks[0]
    assert result == RunResult(
        usage=Usage(
            prompt_tokens=PROMPT_TOKENS, completion_tokens=5, total_tokens=PROMPT_TOKENS + 5
        )
    )
    assert upstream.requests[-1].headers["accept"] == "text/event-stream"
    # Each chunk comes with the adapter's reading of it: the runner parses nothing again.
    assert [r.data if r is not None else None for r in collector.readings] == collector.chunks
    assert sum(r is not None and r.finished for r in collector.readings) == 1


async def test_stream_without_usage_still_succeeds(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    adapter = make_adapter(upstream.base_url)
    run, _ = make_run(stream=True, operation="completion")
    collector = Collector()
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(run, collector)
    assert collector.chunks == expected_events(MODEL, 3, operation="completion")
    assert result == RunResult(usage=None)


async def test_runs_reuse_one_connection(upstream: FakeUpstream, make_adapter: MakeAdapter) -> None:
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        for stream in (False, True, False, True):
            run, _ = make_run(stream=stream)
            await adapter.execute(run, Collector())
    assert upstream.requests_total == 4
    assert upstream.connections_total == 1


# --- failures -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "capacity"),
    [
        (500, "upstream_error", False),
        (502, "upstream_error", False),
        (429, "upstream_busy", True),
        (503, "upstream_busy", True),
    ],
)
async def test_retryable_statuses(
    upstream: FakeUpstream, make_adapter: MakeAdapter, status: int, code: str, capacity: bool
) -> None:
    upstream.status = status
    upstream.error_message = "engine overloaded"
    adapter = make_adapter(upstream.base_url)
    for stream in (False, True):
        run, _ = make_run(stream=stream)
        error = await expect_failure(adapter, run)
        assert (error.code, error.retryable, error.capacity, error.status) == (
            code,
            True,
            capacity,
            status,
        )
        assert "engine overloaded" in error.message


async def test_a_busy_upstream_says_how_long_to_rest(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.status = 429
    upstream.error_headers = {"Retry-After": "12"}
    adapter = make_adapter(upstream.base_url)
    for stream in (False, True):
        error = await expect_failure(adapter, make_run(stream=stream)[0])
        assert (error.capacity, error.retry_after_s) == (True, 12.0)
    upstream.error_headers = {}
    error = await expect_failure(adapter, make_run(stream=False)[0])
    assert (error.capacity, error.retry_after_s) == (True, None)


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ([(b"Retry-After", b"7")], 7.0),
        ([(b"retry-after", b" 0.5 ")], 0.5),
        ([(b"retry-after-ms", b"1500"), (b"retry-after", b"9")], 1.5),  # OpenAI's, first
        ([(b"retry-after-ms", b"soon"), (b"retry-after", b"9")], 9.0),
        ([(b"Retry-After", b"Wed, 21 Oct 2015 07:28:30 GMT")], 30.0),
        ([(b"Retry-After", b"Wed, 21 Oct 2015 07:27:00 GMT")], 0.0),  # already past
        ([(b"Retry-After", b"-3")], None),
        ([(b"Retry-After", b"nan")], None),
        ([(b"Retry-After", b"tomorrow")], None),
        ([(b"Retry-After", b"Wed, 21 Oct 2015 07:28:30")], None),  # no zone: not HTTP's
        ([(b"content-type", b"application/json")], None),
    ],
)
def test_retry_after_reads_seconds_dates_and_openais_milliseconds(
    headers: list[tuple[bytes, bytes]], seconds: float | None
) -> None:
    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert retry_after(headers, now=now) == seconds


async def test_a_body_that_breaks_off_after_done_is_a_whole_stream(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    """The stream ended (`[DONE]`) and its usage came: a body that then breaks off (no
    chunked terminator) broke nothing the caller reads, and blames nobody."""
    upstream.cut_after_end = True
    adapter = make_adapter(upstream.base_url)
    run, _ = make_run(stream=True, stream_options={"include_usage": True})
    collector = Collector()
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(run, collector)
    assert result.usage is not None and result.usage.completion_tokens == upstream.chunks
    assert collector.chunks  # every chunk reached the caller


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{}", "no answer in it"),
        (b'{"object": "chat.completion", "usage": null}', "no answer in it"),
        (b'{"error": {"message": "model overloaded"}}', "model overloaded"),
    ],
)
async def test_a_whole_answer_with_no_answer_in_it_fails_the_run(
    upstream: FakeUpstream, make_adapter: MakeAdapter, body: bytes, says: str
) -> None:
    upstream.answer_body = body
    error = await expect_failure(make_adapter(upstream.base_url), make_run(stream=False)[0])
    assert (error.code, error.retryable) == ("upstream_error", True)
    assert says in error.message


async def test_a_whole_answer_past_the_wire_limit_is_not_read_to_its_end(
    upstream: FakeUpstream, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Node stops reading once the body passes what the wire carries, so an upstream
    that sends gigabytes costs it no more memory than that."""
    monkeypatch.setattr(exchange, "MAX_PAYLOAD_BYTES", 4096)
    upstream.answer_body = b'{"choices": [], "pad": "' + b"x" * 100_000 + b'"}'
    error = await expect_failure(make_adapter(upstream.base_url), make_run(stream=False)[0])
    assert error.code == "response_too_large"
    assert "exceeds the wire's limit of 4096 bytes" in error.message


async def test_rejection_carries_the_upstream_message(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.status = 400
    upstream.error_message = "max_tokens must be at most 4096"
    adapter = make_adapter(upstream.base_url)
    error = await expect_failure(adapter, make_run(stream=True)[0])
    assert error.code == "upstream_rejected"
    assert error.message == "max_tokens must be at most 4096"
    assert (error.retryable, error.capacity, error.status) == (False, False, 400)


async def test_connection_refused_is_unreachable(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter(f"http://127.0.0.1:{closed_port()}/v1", connect_timeout_s=1.0)
    error = await expect_failure(adapter, make_run()[0])
    assert (error.code, error.retryable, error.status) == ("upstream_unreachable", True, None)


async def test_hung_upstream_times_out_before_first_byte(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.hang = True
    adapter = make_adapter(upstream.base_url, first_byte_timeout_s=0.2, request_timeout_s=0.5)
    for stream in (True, False):
        started = trio.current_time()
        error = await expect_failure(adapter, make_run(stream=stream)[0])
        assert (error.code, error.retryable) == ("upstream_timeout", True)
        # The first-byte bound is for streams; a non-stream body comes only at the end.
        elapsed = trio.current_time() - started
        assert elapsed < 0.5 if stream else elapsed >= 0.5
    # Giving up closed the connection, which is how the upstream learns to stop.
    with trio.fail_after(GUARD_S):
        await upstream.wait_for(lambda: upstream.disconnects == 2)


async def test_first_byte_of_a_stream_is_its_first_event(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    never = trio.Event()

    async def pace(index: int) -> None:
        await never.wait()  # headers go out at once, then prefill "never ends"

    upstream.pace = pace
    adapter = make_adapter(upstream.base_url, first_byte_timeout_s=0.2, request_timeout_s=5.0)
    error = await expect_failure(adapter, make_run(stream=True)[0])
    assert (error.code, error.retryable) == ("upstream_timeout", True)
    assert "within 0.2s" in error.message


async def test_request_timeout_bounds_a_hung_upstream_without_first_byte_setting(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.hang = True
    adapter = make_adapter(upstream.base_url, request_timeout_s=0.2)
    error = await expect_failure(adapter, make_run()[0])
    assert (error.code, error.retryable) == ("upstream_timeout", True)


async def test_stall_after_chunks_is_not_retryable(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    never = trio.Event()

    async def pace(index: int) -> None:
        if index >= 2:
            await never.wait()

    upstream.pace = pace
    # Long enough for the first two chunks on a loaded machine: the stall is what ends it.
    adapter = make_adapter(upstream.base_url, first_byte_timeout_s=5.0, request_timeout_s=2.0)
    error = await expect_failure(adapter, make_run(stream=True)[0])
    assert (error.code, error.retryable) == ("upstream_stream_error", False)
    assert "after 2 chunks" in error.message


@pytest.mark.parametrize(
    ("drop_after", "code", "retryable"),
    [(0, "upstream_error", True), (2, "upstream_stream_error", False)],
)
async def test_stream_cut_by_upstream(
    upstream: FakeUpstream,
    make_adapter: MakeAdapter,
    drop_after: int,
    code: str,
    retryable: bool,
) -> None:
    upstream.drop_after_chunks = drop_after
    adapter = make_adapter(upstream.base_url)
    run, _ = make_run(stream=True)
    collector = Collector()
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await adapter.execute(run, collector)
    assert (info.value.code, info.value.retryable) == (code, retryable)
    assert len(collector.chunks) == drop_after


@pytest.mark.parametrize(
    ("error_after", "code", "retryable"),
    [(0, "upstream_error", True), (2, "upstream_stream_error", False)],
)
async def test_in_band_stream_error(
    upstream: FakeUpstream,
    make_adapter: MakeAdapter,
    error_after: int,
    code: str,
    retryable: bool,
) -> None:
    upstream.error_after_chunks = error_after
    upstream.error_message = "CUDA out of memory"
    adapter = make_adapter(upstream.base_url)
    run, _ = make_run(stream=True)
    collector = Collector()
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await adapter.execute(run, collector)
    assert (info.value.code, info.value.retryable) == (code, retryable)
    assert "CUDA out of memory" in info.value.message
    assert len(collector.chunks) == error_after


async def test_cancel_closes_the_upstream_stream(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    never = trio.Event()

    async def pace(index: int) -> None:
        if index >= 1:
            await never.wait()

    upstream.pace = pace
    adapter = make_adapter(upstream.base_url)
    collector = Collector()
    with trio.fail_after(GUARD_S):
        with trio.CancelScope() as runner_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(adapter.execute, make_run(stream=True)[0], collector)
                await collector.seen[0].wait()
                runner_scope.cancel()
        assert runner_scope.cancelled_caught
        await upstream.wait_for(lambda: upstream.disconnects == 1 and upstream.active == 0)
    assert len(collector.chunks) == 1


async def test_prepared_request_parts_serve_every_run(
    upstream: FakeUpstream, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """URLs, headers and timeouts are built once per adapter; each run still gets its own
    body, its own length and the Accept header of its kind."""
    monkeypatch.setenv(FAKE_KEY_ENV, FAKE_KEY)
    adapter = make_adapter(upstream.base_url + "/", api_key_env=FAKE_KEY_ENV)
    sent: list[bytes] = []
    with trio.fail_after(GUARD_S):
        runs: list[tuple[bool, Operation]] = [
            (False, "chat"),
            (True, "completion"),
            (False, "chat"),
        ]
        for stream, operation in runs:
            run, body = make_run(stream=stream, operation=operation, n=len(sent))
            sent.append(body)
            await adapter.execute(run, Collector())
    requests = list(upstream.requests)[-3:]
    assert [r.path for r in requests] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/chat/completions",
    ]
    assert [r.body for r in requests] == sent
    assert [r.headers["content-length"] for r in requests] == [str(len(b)) for b in sent]
    assert [r.headers["accept"] for r in requests] == [
        "application/json",
        "text/event-stream",
        "application/json",
    ]
    for request in requests:
        assert request.headers["user-agent"] == "iop-node"
        assert request.headers["content-type"] == "application/json"
        assert request.headers["authorization"] == f"Bearer {FAKE_KEY}"


# --- auth ---------------------------------------------------------------------------------


async def test_api_key_env_is_sent_as_bearer(
    upstream: FakeUpstream, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE_KEY_ENV, FAKE_KEY)
    adapter = make_adapter(upstream.base_url, api_key_env=FAKE_KEY_ENV)
    with trio.fail_after(GUARD_S):
        await adapter.execute(make_run()[0], Collector())
        status = await adapter.probe()
    assert status.health == "available"
    # The run, the listing and a vllm's sleep-mode question: each with the key.
    assert [r.path for r in upstream.requests] == [
        "/v1/chat/completions",
        "/v1/models",
        "/is_sleeping",
    ]
    assert {r.headers.get("authorization") for r in upstream.requests} == {f"Bearer {FAKE_KEY}"}


@pytest.mark.parametrize(("value", "why"), [(None, "is not set"), ("", "is empty")])
async def test_missing_api_key_env_is_reported_by_name(
    upstream: FakeUpstream,
    make_adapter: MakeAdapter,
    monkeypatch: pytest.MonkeyPatch,
    value: str | None,
    why: str,
) -> None:
    if value is None:
        monkeypatch.delenv(FAKE_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(FAKE_KEY_ENV, value)
    adapter = make_adapter(upstream.base_url, api_key_env=FAKE_KEY_ENV)
    with trio.fail_after(GUARD_S):
        status = await adapter.probe()
        await adapter.execute(make_run()[0], Collector())
    assert status.health == "unavailable"
    assert status.detail == f"environment variable {FAKE_KEY_ENV} {why}"
    assert "authorization" not in upstream.requests[-1].headers


# --- probe and lifecycle --------------------------------------------------------------------


async def test_probe_lists_models(upstream: FakeUpstream, make_adapter: MakeAdapter) -> None:
    upstream.models = ["a/one", "b/two"]
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        status = await adapter.probe()
    assert (status.id, status.health, status.models) == ("p1", "available", ["a/one", "b/two"])
    assert upstream.requests_total == 0  # a probe is never a completion
    # The listing, then (a vllm may have sleep mode) the question the runtime answers 404.
    assert [r.path for r in upstream.requests] == ["/v1/models", "/is_sleeping"]


async def test_probe_reports_an_error_status(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.models_status = 500
    upstream.error_message = "warming up"
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        status = await adapter.probe()
    assert status.health == "unavailable"
    assert status.detail == "GET /models returned 500: warming up"


async def test_a_probe_the_runtime_does_not_answer_while_generating_is_a_probe_timeout(
    make_adapter: MakeAdapter, nursery: trio.Nursery
) -> None:
    """Not a verdict: the health monitor decides busy or down from the runs in flight."""
    release = trio.Event()

    async def hold(_index: int) -> None:
        await release.wait()

    fake = FakeUpstream(models_blocked_while_generating=True, pace=hold)
    base_url = await nursery.start(fake.serve)
    generating = make_adapter(base_url)
    probing = make_adapter(base_url, request_timeout_s=0.3)  # its read timeout
    nursery.start_soon(generating.execute, make_run(stream=True)[0], Collector())
    with trio.fail_after(GUARD_S):
        await fake.wait_for(lambda: fake.active == 1)
        with pytest.raises(ProbeTimeout, match="timed out"):
            await probing.probe()
    release.set()


async def test_probe_unreachable(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter(f"http://127.0.0.1:{closed_port()}/v1")
    with trio.fail_after(GUARD_S):
        status = await adapter.probe()
    assert status.health == "unavailable"
    assert status.detail is not None and status.detail.startswith("cannot connect")


async def test_closed_adapter_refuses_work(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    adapter = make_adapter(upstream.base_url)
    await adapter.aclose()
    error = await expect_failure(adapter, make_run()[0])
    assert (error.code, error.retryable) == ("adapter_closed", True)
    assert (await adapter.probe()).health == "unavailable"
    assert upstream.requests_total == 0


@pytest.mark.parametrize(
    "base_url", [None, "ftp://host/v1", "http://host:notaport/v1", "http:///v1", "/v1"]
)
def test_base_url_must_be_an_http_url(base_url: str | None) -> None:
    adapter = AdapterSettings(base_url=base_url)
    provider = ProviderConfig(id="p1", type="vllm", models=[MODEL], capacity=1, adapter=adapter)
    with pytest.raises(ValueError, match="base_url"):
        OpenAICompatAdapter(provider)


# --- pure helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "bad model", "type": "x"}}', "bad model"),
        (b'{"object": "error", "message": "too long", "code": 400}', "too long"),
        (b'{"error": "model not found"}', "model not found"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"upstream exploded\n", "upstream exploded"),
        (b"", None),
    ],
)
def test_error_message_dialects(body: bytes, message: str | None) -> None:
    assert error_message(body) == message


def test_status_failure_without_body() -> None:
    error = status_failure(422, b"")
    assert (error.code, error.message, error.retryable) == (
        "upstream_rejected",
        "upstream rejected the request (422)",
        False,
    )


def test_an_upstream_message_is_kept_whole_up_to_the_limit() -> None:
    """llama.cpp's reason for a 500 comes last in a multi-line report: kept, as it was."""
    report = invalid_report()
    assert error_message(error_body(report, 500)) == report
    error = status_failure(500, error_body(report, 500))
    assert (error.code, error.status, error.retryable) == ("upstream_error", 500, True)
    assert error.message == report  # the upstream's words; the Edge says whose fault

    huge = "x" * (MESSAGE_LIMIT * 2)
    bounded = error_message(error_body(huge, 400))
    assert bounded is not None and len(bounded) == MESSAGE_LIMIT
    assert bounded.endswith(f"x... [cut: {MESSAGE_LIMIT * 2} characters in all]")


def test_a_408_is_a_timeout_not_a_refusal() -> None:
    error = status_failure(408, error_body("request timed out", 408))
    assert (error.code, error.retryable, error.status) == ("upstream_timeout", True, 408)


@pytest.mark.parametrize("status", [401, 403, 404])
def test_provider_misconfiguration_is_retryable_elsewhere(status: int) -> None:
    error = status_failure(status, b'{"error": {"message": "bad key"}}')
    assert (error.code, error.retryable, error.capacity) == ("upstream_misconfigured", True, False)
    assert error.status == status and "bad key" in error.message
