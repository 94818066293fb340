"""`ReplyShaper`: callers see their alias; everything else passes through byte for byte."""

from __future__ import annotations

import msgspec
import pytest

from iop_node.reply import NotAnObject, ReplyShaper, read_chunk
from schemas.tokens import output_chars
from schemas.wire import Run, Usage


def _shaper(alias: str = "qwen:alias", *, strip_usage: bool = False) -> ReplyShaper:
    run = Run(
        run_id="r1",
        provider_id="p",
        target="Qwen/Served",
        operation="chat",
        body=b"{}",
        stream=True,
        reply_model=alias,
        strip_usage=strip_usage,
    )
    return ReplyShaper(run)


def _data(event: bytes | None) -> bytes:
    assert event is not None and event.startswith(b"data: ") and event.endswith(b"\n\n")
    return event[len(b"data: ") : -2]


def test_model_becomes_the_alias_and_nested_bytes_are_untouched() -> None:
    chunk = b'{"model":"Qwen/Served","choices":[{"delta": {"reasoning_content" : "\\u00e9 x"}}]}'
    assert (
        _data(_shaper().event(chunk))
        == b'{"model":"qwen:alias","choices":[{"delta": {"reasoning_content" : "\\u00e9 x"}}]}'
    )


def test_alias_is_json_escaped() -> None:
    out = _shaper('we"ird').response(b'{"model":"x"}')
    assert msgspec.json.decode(out) == {"model": 'we"ird'}


def test_no_alias_leaves_the_model_alone() -> None:
    assert _shaper("").response(b'{"model":"x"}') == b'{"model":"x"}'


def test_usage_only_chunk_is_dropped_unless_asked_for_and_kept_for_run_done() -> None:
    chunk = b'{"model":"x","choices":[ ],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    stripping = _shaper(strip_usage=True)
    assert stripping.event(chunk) is None
    assert stripping.usage == Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    kept = _data(_shaper(strip_usage=False).event(chunk))
    assert b'"usage":{"prompt_tokens":3,"completion_tokens":2}' in kept


def test_usage_on_a_content_chunk_is_removed_but_the_content_kept() -> None:
    chunk = b'{"model":"x","choices":[{"delta":{"content":"hi"}}],"usage":{"total_tokens":1}}'
    shaper = _shaper("a", strip_usage=True)
    assert _data(shaper.event(chunk)) == b'{"model":"a","choices":[{"delta":{"content":"hi"}}]}'
    assert shaper.usage == Usage(total_tokens=1)


def test_null_usage_is_not_a_usage_chunk() -> None:
    chunk = b'{"model":"x","choices":[{"delta":{}}],"usage":null}'
    shaper = _shaper("a", strip_usage=True)
    assert _data(shaper.event(chunk)) == b'{"model":"a","choices":[{"delta":{}}],"usage":null}'
    assert shaper.usage is None


def test_a_response_keeps_its_usage_and_reports_it() -> None:
    shaper = _shaper("a")
    body = b'{"model":"x","usage":{"prompt_tokens":-4,"completion_tokens":7}}'
    assert (
        shaper.response(body) == b'{"model":"a","usage":{"prompt_tokens":-4,"completion_tokens":7}}'
    )
    assert shaper.usage == Usage(prompt_tokens=0, completion_tokens=7, total_tokens=7)


def test_a_response_whose_usage_the_adapter_read_is_shaped_without_reading_it_again() -> None:
    shaper = _shaper("a")
    body = b'{"model":"x","usage":{"prompt_tokens":4,"completion_tokens":7}}'
    shaped = shaper.response(body, read_usage=False)
    assert shaped == b'{"model":"a","usage":{"prompt_tokens":4,"completion_tokens":7}}'
    assert shaper.usage is None  # the adapter's reading is the run's
    with pytest.raises(NotAnObject):
        shaper.response(b"[1]", read_usage=False)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1, 2]",
        b'"text"',
        b"",
        b'{"choices":[{"delta":{"content":"x\xff\xfe"}}]}',  # a nested value not UTF-8
    ],
)
def test_anything_but_a_json_object_is_refused(data: bytes) -> None:
    with pytest.raises(NotAnObject):
        _shaper().event(data)
    with pytest.raises(NotAnObject):
        _shaper().response(data)


def test_utf8_beyond_ascii_is_taken() -> None:
    chunk = '{"choices":[{"index":0,"delta":{"content":"héllo, 世界"}}]}'.encode()
    assert _shaper().event(chunk) is not None


_CHUNKS = [
    b'{"model":"x","choices":[{"index":0,"delta":{"content":"hello"}}]}',
    b'{"model":"x","choices":[{"delta":{"reasoning_content":"hm"},"finish_reason":"stop"}]}',
    b'{"model":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
    b'{"model":"x","choices":[{"delta":{}}],"usage":null}',
    b'{"model":"x","choices":"not a list"}',
    b'{"model":"x","choices":[1, 2],"usage":{"total_tokens":1}}',
    b'{"model":"x","choices":[{"finish_reason":7,"text":"abc"}],"usage":"odd"}',
    b'{"choices":[{"text":"t"}]}',
]


@pytest.mark.parametrize("chunk", _CHUNKS)
@pytest.mark.parametrize("strip_usage", [True, False])
def test_one_reading_shapes_and_counts_as_the_bytes_would(chunk: bytes, strip_usage: bool) -> None:
    """`read_chunk` serves the shaper and the estimate alike (reply Rule 5)."""
    assert read_chunk(chunk).output_chars() == output_chars(chunk)
    from_bytes, from_reading = _shaper(strip_usage=strip_usage), _shaper(strip_usage=strip_usage)
    try:
        expected = from_bytes.event(chunk)
    except NotAnObject:
        with pytest.raises(NotAnObject):
            from_reading.event(read_chunk(chunk))
        return
    assert from_reading.event(read_chunk(chunk)) == expected
    assert from_reading.usage == from_bytes.usage


@pytest.mark.parametrize(
    ("chunk", "finished", "error"),
    [
        (b'{"choices":[{"delta":{"content":"a"},"finish_reason":null}]}', False, False),
        (b'{"choices":[{"delta":{},"finish_reason":"length"}]}', True, False),
        (b'{"choices":[{"finish_reason":""}]}', False, False),
        (b'{"choices":[{"finish_reason":7}]}', False, False),
        (b'{"error":{"message":"boom"}}', False, True),
        (b'{"error":null,"choices":[]}', False, False),
        (b'{"object":"error","message":"old vLLM"}', False, True),
        (b'{"object":"err\\u006fr"}', False, True),
        (b'{"object":"chat.completion.chunk"}', False, False),
    ],
)
def test_a_reading_tells_a_finished_choice_and_an_in_band_error(
    chunk: bytes, finished: bool, error: bool
) -> None:
    reading = read_chunk(chunk)
    assert (reading.finished, reading.is_error) == (finished, error)


def test_a_chunk_that_is_not_json_is_told_from_json_that_is_not_an_object() -> None:
    with pytest.raises(NotAnObject) as not_json:
        read_chunk(b"{oops")
    with pytest.raises(NotAnObject) as not_object:
        read_chunk(b"[1]")
    assert (not_json.value.malformed, not_object.value.malformed) == (True, False)
