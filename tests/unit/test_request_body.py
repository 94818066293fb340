"""`iop_edge.http.request_body.read_json` over a channel as Hypercorn hands one to an app:
what is queued is taken without waiting, a body framed by its length is whole at its
last byte (its end awaited without the deadline), the rest under the deadline."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from iop_edge.http.errors import ApiError
from iop_edge.http.request_body import BODY_TIMEOUT_S, CallerGone, read_json

BODY = b'{"model":"m","messages":[]}'
LIMIT = 1024


def _channel(*messages: dict[str, Any]) -> tuple[trio.MemorySendChannel[Any], Any]:
    send, receive = trio.open_memory_channel[Any](10)
    for message in messages:
        send.send_nowait(message)
    return send, receive


def _part(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


END = _part(b"", more=False)


async def test_a_queued_body_is_read_without_a_checkpoint() -> None:
    _, receive = _channel(_part(BODY[:10]), _part(BODY[10:]), END)
    with trio.CancelScope() as scope:
        scope.cancel()  # any checkpoint would raise Cancelled here
        body = await read_json(receive.receive, len(BODY), LIMIT)
    assert body == {"model": "m", "messages": []}


async def test_a_whole_body_waits_for_its_end_without_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send, receive = _channel(_part(BODY))
    read: list[dict[str, Any]] = []

    async def reader() -> None:
        read.append(await read_json(receive.receive, len(BODY), LIMIT))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.sleep(BODY_TIMEOUT_S * 2)  # far past the deadline: none applies
        assert not read
        await send.send(END)
    assert read == [{"model": "m", "messages": []}]


async def test_a_body_that_does_not_come_is_a_408(autojump_clock: trio.testing.MockClock) -> None:
    _send, receive = _channel(_part(BODY[:10]))
    with pytest.raises(ApiError) as refused:
        await read_json(receive.receive, len(BODY), LIMIT)
    assert (refused.value.status, refused.value.code) == (408, "request_timeout")


async def test_a_chunked_body_is_read_until_its_end() -> None:
    _, receive = _channel(_part(BODY[:5]), _part(BODY[5:]), END)
    assert await read_json(receive.receive, None, LIMIT) == {"model": "m", "messages": []}


async def test_a_caller_gone_and_a_body_past_the_limit() -> None:
    _, receive = _channel(_part(BODY[:5]), {"type": "http.disconnect"})
    with pytest.raises(CallerGone):
        await read_json(receive.receive, len(BODY), LIMIT)
    _, receive = _channel(_part(b"x" * 600), _part(b"x" * 600), END)
    with pytest.raises(ApiError) as refused:
        await read_json(receive.receive, None, LIMIT)
    assert (refused.value.status, refused.value.code) == (413, "request_too_large")
    with pytest.raises(ApiError) as refused:
        await read_json(receive.receive, LIMIT + 1, LIMIT)
    assert refused.value.status == 413


async def test_another_servers_receive_is_awaited() -> None:
    messages = [_part(BODY[:10]), _part(BODY[10:], more=False)]

    async def receive() -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return messages.pop(0)

    assert await read_json(receive, None, LIMIT) == {"model": "m", "messages": []}
