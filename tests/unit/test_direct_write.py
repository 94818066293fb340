"""Dispatch Rule 9, step by step: how an attempt hands chunks to its consumer's
`DirectWrite` while the consumer waits, and what it buffers instead.

The session's reader is played by the test task: it pushes events with no await in
between, so nothing else runs meanwhile; `wait_all_tasks_blocked` lets the consumer
run until it waits again."""

from __future__ import annotations

from typing import Any, cast

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from iop_edge.runtime.nodes.session import NodeSession
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.relay import RUN_BUFFER_BYTES, Attempt, RelayEvent, Unwritten
from schemas import wire

DONE = wire.RunDone(run_id="r")


class Socket:
    """A caller's socket that takes `room` more bytes at once (None: nothing at all)."""

    def __init__(self, room: int | None = 1 << 20) -> None:
        self.room = room
        self.written: list[bytes] = []

    def write_now(self, events: bytes) -> bytes | None:
        if self.room is None:
            return None
        taken = events[: self.room]
        self.room -= len(taken)
        self.written.append(taken)
        return events[len(taken) :]


class BrokenSocket(Socket):
    """A writer with a bug: it raises."""

    def write_now(self, events: bytes) -> bytes | None:
        self.written.append(events)
        raise RuntimeError("a bug")


class Consumer:
    """Waits for the attempt's events the way a run's relay does."""

    def __init__(self, attempt: Attempt, socket: Socket) -> None:
        self.attempt = attempt
        self.socket = socket
        self.heard: list[RelayEvent] = []

    async def run(self) -> None:
        while True:
            event = await self.attempt.receive(self.socket.write_now)
            self.heard.append(event)
            if isinstance(event, wire.RunDone):
                return


async def _waiting_consumer(nursery: trio.Nursery, socket: Socket) -> tuple[Attempt, Consumer]:
    """A new attempt, and its consumer waiting for the first event, writing to `socket`."""
    attempt = _attempt()
    consumer = Consumer(attempt, socket)
    nursery.start_soon(consumer.run)
    await wait_all_tasks_blocked()
    return attempt, consumer


def _attempt() -> Attempt:
    lease = Lease(
        run_id="r",
        provider_id="p",
        node_id="n",
        target="t",
        long=False,
        queued_s=0.0,
        limiters=(),
        on_release=lambda _lease: None,
    )
    session = cast(NodeSession, cast(Any, object()))  # push and receive never touch it
    return Attempt("r", lease, session, give_up=lambda: None, on_busy=lambda _p: None)


async def test_chunks_for_a_waiting_consumer_are_written_without_waking_it(
    nursery: trio.Nursery,
) -> None:
    socket = Socket()
    attempt, consumer = await _waiting_consumer(nursery, socket)
    assert attempt.push(b"data: 1\n\n") and attempt.push(b"data: 2\n\n")
    await wait_all_tasks_blocked()
    assert socket.written == [b"data: 1\n\n", b"data: 2\n\n"]
    assert consumer.heard == []  # still waiting: nothing came its way
    assert attempt.buffered == 0
    attempt.push(DONE)
    await wait_all_tasks_blocked()
    assert consumer.heard == [DONE]


async def test_the_rest_of_a_partial_write_comes_before_later_chunks(
    nursery: trio.Nursery,
) -> None:
    socket = Socket(room=4)
    attempt, consumer = await _waiting_consumer(nursery, socket)
    attempt.push(b"data: 1\n\n")  # the socket takes "data"
    socket.room = 1 << 20  # ... and then would take more: it must not get the next one
    attempt.push(b"data: 2\n\n")
    attempt.push(DONE)
    await wait_all_tasks_blocked()
    assert socket.written == [b"data"]
    assert consumer.heard == [Unwritten(b": 1\n\n"), b"data: 2\n\n", DONE]


async def test_the_consumer_gets_direct_writes_again_once_it_waits_again(
    nursery: trio.Nursery,
) -> None:
    socket = Socket(room=4)
    attempt, consumer = await _waiting_consumer(nursery, socket)
    attempt.push(b"data: 1\n\n")
    await wait_all_tasks_blocked()  # it heard the rest and waits again
    socket.room = 1 << 20
    attempt.push(b"data: 2\n\n")
    await wait_all_tasks_blocked()
    assert socket.written == [b"data", b"data: 2\n\n"]
    assert consumer.heard == [Unwritten(b": 1\n\n")]


async def test_a_chunk_the_socket_cannot_take_now_is_buffered(nursery: trio.Nursery) -> None:
    socket = Socket(room=None)
    attempt, consumer = await _waiting_consumer(nursery, socket)
    attempt.push(b"data: 1\n\n")
    assert attempt.buffered == len(b"data: 1\n\n")
    attempt.push(DONE)
    await wait_all_tasks_blocked()
    assert socket.written == []
    assert consumer.heard == [b"data: 1\n\n", DONE]


async def test_nothing_is_written_directly_while_events_wait_for_the_consumer() -> None:
    attempt, socket = _attempt(), Socket()
    attempt.push(b"data: 1\n\n")  # nobody waits yet: buffered
    attempt.direct = socket.write_now  # as if a consumer were waiting, the queue not empty
    attempt.push(b"data: 2\n\n")
    assert socket.written == []
    assert attempt.take() == b"data: 1\n\n" and attempt.take() == b"data: 2\n\n"


async def test_a_direct_write_that_raises_is_not_used_again(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the caller's writer stays with its run: the session's reader (the test
    task here) is not hurt, the chunk is buffered, and nothing more is written directly."""
    socket = BrokenSocket()
    attempt, consumer = await _waiting_consumer(nursery, socket)
    assert attempt.push(b"data: 1\n\n")
    await wait_all_tasks_blocked()  # the consumer heard it, and waits again
    assert attempt.push(b"data: 2\n\n")
    attempt.push(DONE)
    await wait_all_tasks_blocked()
    assert socket.written == [b"data: 1\n\n"]  # offered once, never again
    assert consumer.heard == [b"data: 1\n\n", b"data: 2\n\n", DONE]
    assert "writing to its caller directly failed" in caplog.text


def test_one_event_larger_than_the_buffer_is_not_a_caller_behind() -> None:
    """Dispatch Rule 5: a caller is behind when a whole buffer waits; a first event
    larger than the buffer alone is the provider's size, not the caller's pace."""
    attempt = _attempt()  # no consumer waiting: every event is buffered
    giant = b"data: " + b"x" * (RUN_BUFFER_BYTES + 1) + b"\n\n"
    assert attempt.push(giant) and attempt.end_reason is None
    assert not attempt.push(b"data: 2\n\n")  # now a whole buffer waits before it
    assert attempt.end_reason is not None
    assert attempt.end_reason.code == wire.FailureCode.CALLER_TOO_SLOW
