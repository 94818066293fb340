"""The soak's shared-runtime phase: a runtime that another application saturates, the
client that saturates it, and how the soak judges the phase.

The upstream and the other application run in-process on real sockets. Waits are
event-driven (`wait_all_tasks_blocked` for "the model list is still waiting"); the one
time bound asserted is a lower one (a saturated runtime's stream takes at least its
slowed-down schedule), which a slow machine cannot break.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Final

import httpx2
import pytest
import trio
import trio.testing

from bench.shared_runtime import Tally, keep_streams
from bench.soak import (
    BUSY_ACCEPTED,
    BUSY_GENERATING,
    SHARED_MODEL,
    SHARED_PROVIDER,
    Books,
    _config,
    _report_shared_runtime,
    _routable,
    _state,
    main,
)
from bench.upstream import MAX_STREAM_TOKENS, STREAM_TOKENS, BenchUpstream
from iop_edge.core.configuration.config import parse_config
from iop_node.health import ACCEPTED_BUT_SILENT
from tests.timing import GUARD_S

#: Slow enough that the in-process tasks are all idle between two tokens.
RATE: Final = 5.0
#: The pacer may send a token this much before it is due (`_Pacer.TICK_S`).
TICK_S: Final = 0.002
TOKEN: Final = b'"content":"tok'


async def test_a_saturated_runtime_serves_slower_and_holds_its_model_list() -> None:
    upstream = BenchUpstream(tokens_per_second=RATE, slots=2)
    async with trio.open_nursery() as nursery:
        root = await nursery.start(upstream.serve)
        async with httpx2.AsyncClient(base_url=root, timeout=GUARD_S * 2) as runtime:
            with trio.fail_after(GUARD_S):
                assert (await runtime.get("/v1/models")).status_code == 200  # idle: at once
            listed = trio.Event()

            async def list_models() -> None:
                response = await runtime.get("/v1/models")
                assert response.status_code == 200
                listed.set()

            async with trio.open_nursery() as other_application:
                with trio.fail_after(GUARD_S):
                    await other_application.start(keep_streams, root, 3, 100, Tally())
                assert (upstream.in_flight, upstream.saturated) == (3, True)
                nursery.start_soon(list_models)
                await trio.testing.wait_all_tasks_blocked(cushion=0.02)
                assert not listed.is_set()  # the model list waits for a slot

                # A completion is still served, its tokens twice as far apart (4 in flight
                # for 2 slots).
                started = trio.current_time()
                with trio.fail_after(GUARD_S):
                    response = await runtime.post(
                        "/v1/chat/completions",
                        json={"stream": True},
                        headers={"x-bench-stream-tokens": "3"},
                    )
                assert response.status_code == 200
                assert response.content.count(b"tok@") == 3
                assert trio.current_time() - started >= 2 * 2 / RATE - TICK_S
                assert not listed.is_set()
                other_application.cancel_scope.cancel()
            with trio.fail_after(GUARD_S):
                await listed.wait()  # its streams going, the runtime answers the listing
            assert not upstream.saturated
        nursery.cancel_scope.cancel()


async def test_a_runtime_without_slots_never_saturates() -> None:
    upstream = BenchUpstream(tokens_per_second=RATE)
    async with trio.open_nursery() as nursery:
        root = await nursery.start(upstream.serve)
        async with trio.open_nursery() as other_application:
            with trio.fail_after(GUARD_S):
                await other_application.start(keep_streams, root, 3, 100, Tally())
            assert (upstream.in_flight, upstream.saturated) == (3, False)
            async with httpx2.AsyncClient(base_url=root) as runtime:
                with trio.fail_after(GUARD_S):
                    assert (await runtime.get("/v1/models")).status_code == 200
            other_application.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_a_stream_is_as_long_as_its_request_asks() -> None:
    async with trio.open_nursery() as nursery:
        root = await nursery.start(BenchUpstream().serve)
        async with httpx2.AsyncClient(base_url=root, timeout=GUARD_S) as runtime:
            body = {"stream": True}
            default = await runtime.post("/v1/chat/completions", json=body)
            assert default.content.count(TOKEN) == STREAM_TOKENS
            for tokens in (1, 3, 500, 3):  # the second 3 is built once, kept
                asked = await runtime.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"x-bench-stream-tokens": str(tokens)},
                )
                assert asked.content.count(TOKEN) == tokens
                assert asked.content.endswith(b"data: [DONE]\n\n")
            for wrong in ("0", "x", "-3", str(MAX_STREAM_TOKENS + 1)):
                refused = await runtime.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"x-bench-stream-tokens": wrong},
                )
                assert refused.status_code == 400
                assert "x-bench-stream-tokens" in refused.json()["error"]["message"]
        nursery.cancel_scope.cancel()


def test_upstream_slots_are_checked() -> None:
    with pytest.raises(ValueError, match="slots must be >= 1"):
        BenchUpstream(slots=0)


# --- how the soak judges the phase ---------------------------------------------------------


def test_the_soak_config_serves_the_shared_model_from_one_provider() -> None:
    config = parse_config(_config(Path("/tmp/state"), 8, "http://127.0.0.1:9")).config
    shared = next(model for model in config.models if model.id == SHARED_MODEL)
    assert list(shared.providers) == [SHARED_PROVIDER]
    node = next(node for node in config.nodes if node.id == "node-2")
    provider = next(p for p in node.providers if p.id == SHARED_PROVIDER)
    vllm = next(p for p in node.providers if p.id == "vllm-2")
    assert provider.adapter.base_url == vllm.adapter.base_url  # one runtime, shared


def test_catalog_looks_are_labelled_by_health_first() -> None:
    accepted = f"{ACCEPTED_BUT_SILENT} (health probe timed out after 2s); no run from IOP"
    generating = "1 run from IOP producing output at the runtime (health probe deferred)"
    timed_out = "health probe timed out after 2s while 1 run from IOP produced output"
    assert _state("busy", accepted) == BUSY_ACCEPTED
    assert _state("busy", generating) == _state("busy", timed_out) == BUSY_GENERATING
    assert _state("available", "") == "available"
    down = _state("unavailable", "health probe timed out after 2s with no run in flight")
    assert down.startswith("unavailable: ")
    assert [_routable(s) for s in (BUSY_ACCEPTED, BUSY_GENERATING, "available", "busy: x")] == [
        True
    ] * 4
    assert not any(_routable(s) for s in (down, "unknown", "unavailable: node disconnected"))


def _books(looks: dict[str, int], ends: list[tuple[float, str]]) -> Books:
    """The books of a window from 60 s to 75 s into the run."""
    return Books(window=(60.0, 75.0), shared_ends=ends, health={SHARED_PROVIDER: Counter(looks)})


SERVED: Final = [(61.0, "200"), (70.0, "200 stream"), (72.0, "caller hung up")]
#: The Node's SIGKILL, outside the window: not the phase's business.
KILL: Final = [(40.5, "503 no_provider")]


@pytest.mark.parametrize(
    ("looks", "ends", "held", "said"),
    [
        ({BUSY_ACCEPTED: 20, "available": 6}, SERVED + KILL, True, "held: 0 look(s)"),
        (
            {BUSY_ACCEPTED: 20, "unavailable: health probe timed out": 6},
            SERVED,
            False,
            "FAILED: 6 look(s)",
        ),
        (
            {BUSY_ACCEPTED: 26},
            [*SERVED, (74.9, "503 no_provider")],
            False,
            "1 503 no_provider, 1 failed",
        ),
        ({BUSY_ACCEPTED: 26}, [(62.0, "502 upstream_timeout")], False, "0 served"),
        ({BUSY_ACCEPTED: 26}, [(62.0, "caller hung up")], False, "0 served"),
    ],
)
def test_the_phase_holds_only_when_the_provider_stayed_routable_and_callers_were_served(
    looks: dict[str, int],
    ends: list[tuple[float, str]],
    held: bool,
    said: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _report_shared_runtime(_books(looks, ends)) is held
    assert said in capsys.readouterr().out


def test_a_soak_without_the_phase_has_nothing_to_hold(capsys: pytest.CaptureFixture[str]) -> None:
    assert _report_shared_runtime(Books()) is True
    assert "no phase" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--minutes", "1"], "does not end 5s before the full-disk window"),
        (["--minutes", "0.5", "--full-disk-s", "0"], "does not end 5s before the run"),
        (["--shared-runtime-s", "-1"], "must be >= 0"),
    ],
)
def test_a_phase_that_would_overlap_another_is_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
