"""A stream run whose consumer writes directly (`Run.write_directly`, dispatch Rule 9):
while the consumer waits, the session's reader hands chunks to its `DirectWrite`; what
that write leaves comes back as `Unwritten`, before anything later. The caller's stream
is the same, in order, counted the same, whichever way each chunk went."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import msgspec
import trio

from iop_edge.runtime.runs.dispatch import CALLER_GONE, Outcome, Run, Unwritten
from schemas import wire
from tests.e2e.stack import (
    WAIT_GUARD_S,
    Stack,
    chat_stream_plan,
    edge_config,
    sim_provider,
    start_stack,
)

TOKENS = 40
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": TOKENS,
    "stream": True,
}


class Caller:
    """What reaches the caller, in the order it is written: chunks written directly (in
    full or in part, as `take` says) and the events the consumer writes itself."""

    def __init__(self, leave: int = 0) -> None:
        self.leave = leave
        """Bytes of every direct write the socket "does not take" (0: it takes all)."""
        self.written: list[bytes] = []
        self.direct_writes = 0
        self.unwritten = 0

    def write_now(self, events: bytes) -> bytes | None:
        self.direct_writes += 1
        cut = len(events) - self.leave
        self.written.append(events[:cut])
        return events[cut:]

    async def relay(self, run: Run) -> wire.RunDone | wire.RunFailed:
        """The consumer: wait for events, write what comes to it, until the end."""
        while True:
            event = await run.next_event()
            if isinstance(event, Unwritten):
                self.unwritten += 1
                self.written.append(event.data)
            elif isinstance(event, bytes):
                self.written.append(event)
            else:
                return event

    def contents(self) -> list[str | None]:
        """Each event's text as the caller parses it (ids and times differ per run)."""
        stream = b"".join(self.written)
        assert stream.endswith(b"\n\n")
        contents: list[str | None] = []
        for event in stream.split(b"\n\n")[:-1]:
            assert event.startswith(b"data: ")
            chunk: dict[str, Any] = msgspec.json.decode(event.removeprefix(b"data: "))
            contents.append(chunk["choices"][0]["delta"].get("content"))
        return contents


async def _stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-1", adapter={"ttft_ms": 0, "tokens_per_second": 400})],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


async def _stream(stack: Stack, caller: Caller, *, direct: bool) -> Run:
    plan = chat_stream_plan(f"direct-{direct}-{caller.leave}", dict(BODY))
    run = stack.edge.dispatcher.open(plan)
    try:
        with trio.fail_after(WAIT_GUARD_S):
            await run.start()
            if direct:
                run.write_directly(caller.write_now)
            end = await caller.relay(run)
        assert isinstance(end, wire.RunDone)
        run.end(Outcome(200))
    finally:
        run.end(CALLER_GONE)
    return run


async def test_chunks_written_directly_make_the_same_stream(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    queued, direct = Caller(), Caller()
    await _stream(stack, queued, direct=False)
    run = await _stream(stack, direct, direct=True)
    assert queued.direct_writes == 0
    assert direct.direct_writes > 0  # between tokens, the consumer waits
    assert direct.unwritten == 0
    assert direct.contents() == queued.contents()
    assert len([text for text in direct.contents() if text]) == TOKENS
    assert run.chunks == len(direct.contents())  # counted as if the consumer wrote them


async def test_what_a_direct_write_leaves_comes_first_and_in_order(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    queued, partial = Caller(), Caller(leave=7)
    await _stream(stack, queued, direct=False)
    run = await _stream(stack, partial, direct=True)
    # Every write taken in part comes back as one `Unwritten`, which the consumer writes
    # before any chunk that came after it: the caller's stream is whole and in order.
    assert partial.direct_writes > 0
    assert partial.unwritten == partial.direct_writes
    assert partial.contents() == queued.contents()
    assert run.chunks == len(partial.contents())


async def test_a_finished_run_goes_with_its_last_reference(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """While it runs, a run's attempt (its give-up) and its direct writer point back to
    it; once it ended, nothing does, so reference counting frees it. Left in a cycle it
    would wait for the cyclic collector, and for a thaw when a freeze of the heap caught
    it in flight (`runtime.lifecycle.heap`): megabytes of finished requests."""
    stack = await _stack(nursery, tmp_path)
    enabled = gc.isenabled()
    gc.disable()  # only reference counting frees anything now
    try:
        for direct in (False, True):
            run = await _stream(stack, Caller(), direct=direct)
            gone = weakref.ref(run)
            del run
            assert gone() is None, f"a finished run ({direct=}) is in a reference cycle"
    finally:
        if enabled:
            gc.enable()
