"""`iop_edge.http.request_body.read_json` over a channel as Hypercorn hands one to an app:
what is queued is taken without waiting, a body framed by its length is whole at its
last byte (its end awaited without the deadline), the rest under the deadline."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from iop_edge.http import request_body
from iop_edge.http.errors import ApiError
from iop_edge.http.request_body import (
    BODY_TIMEOUT_S,
    MAX_JSON_DEPTH,
    WALK_BUDGET,
    CallerGone,
    _nests_deeper,
    _text_nests_deeper,
    decode_body,
    read_json,
)

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


# --- depth --------------------------------------------------------------------------------

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
#: Text made of what could fool a reading of the JSON text: brackets, quotes, escapes.
_TRICKY_TEXT = st.text(alphabet='[]{}"\\/ab\n\u00e9\U0001f600', max_size=12)
_JSON = st.recursive(
    _SCALARS | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY_TEXT, inner, max_size=4),
    max_leaves=60,
)


def _depth(value: object) -> int:
    """Arrays/objects nested in `value`, the plain recursive way."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@given(value=_JSON, limit=st.integers(min_value=1, max_value=8))
def test_the_text_and_the_walk_measure_the_same_depth(value: object, limit: int) -> None:
    data = msgspec.json.encode(value)
    expected = _depth(value) > limit
    assert _text_nests_deeper(data, limit) is expected
    if data.count(b"[") + data.count(b"{") > limit:  # below that, no walk is needed
        assert _nests_deeper(data, msgspec.json.decode(data), limit) is expected


def test_a_body_too_wide_to_walk_is_measured_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[int] = []

    def text_nests_deeper(data: bytes, limit: int) -> bool:
        measured.append(len(data))
        return _text_nests_deeper(data, limit)

    monkeypatch.setattr(request_body, "_text_nests_deeper", text_nests_deeper)
    narrow = msgspec.json.encode({"messages": [[{"a": [1]}]] * 100})
    wide = msgspec.json.encode({"x": [[]] * WALK_BUDGET, "y": [[[[]]]]})
    # Walked last: the wide part (the last value, the walk's first) spends the budget.
    deep_and_wide = msgspec.json.encode({"y": [[[[[[]]]]]], "x": [[]] * WALK_BUDGET})
    assert not _nests_deeper(narrow, msgspec.json.decode(narrow), 5) and measured == []
    assert not _nests_deeper(wide, msgspec.json.decode(wide), 5)
    assert _nests_deeper(deep_and_wide, msgspec.json.decode(deep_and_wide), 5)
    assert measured == [len(wide), len(deep_and_wide)]
    too_deep = {"z": _nested_list(MAX_JSON_DEPTH), "x": [[]] * WALK_BUDGET}
    with pytest.raises(ApiError) as refused:
        decode_body(msgspec.json.encode(too_deep))
    assert refused.value.code == "invalid_json" and "nests deeper" in refused.value.message
    assert len(measured) == 3


def _nested_list(levels: int) -> object:
    value: list[object] = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("body", [b"null", b"[]", b'"x"', b"1", b"true"])
def test_a_body_that_is_not_an_object_is_named_so(body: bytes) -> None:
    with pytest.raises(ApiError) as refused:
        decode_body(body)
    assert refused.value.code == "invalid_json"
    assert refused.value.message == "The request body must be a JSON object"
