"""`ReplyShaper` Rule 6: the cached prompt tokens of a run, from the usage's details or,
where a runtime says nothing else, llama.cpp's `timings`."""

from __future__ import annotations

from iop_node.reply import ReplyShaper
from schemas.wire import Run, Usage


def _shaper() -> ReplyShaper:
    run = Run(
        run_id="r1",
        provider_id="p",
        target="served",
        operation="chat",
        body=b"{}",
        stream=True,
        reply_model="alias",
    )
    return ReplyShaper(run)


def test_the_usage_details_say_it() -> None:
    shaper = _shaper()
    shaper.event(
        b'{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":33}}}'
    )
    assert shaper.usage == Usage(
        prompt_tokens=40, completion_tokens=2, total_tokens=42, cached_tokens=33
    )


def test_llama_cpp_timings_say_it_in_the_usage_chunk_or_after_it() -> None:
    together = _shaper()
    together.event(
        b'{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2},'
        b'"timings":{"cache_n":30,"prompt_n":10}}'
    )
    assert together.usage is not None and together.usage.cached_tokens == 30
    after = _shaper()
    after.event(b'{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2}}')
    after.event(b'{"choices":[{"delta":{}}],"timings":{"cache_n":30,"prompt_n":10}}')
    assert after.usage is not None and after.usage.cached_tokens == 30


def test_a_whole_response_with_timings_only() -> None:
    shaper = _shaper()
    shaper.response(
        b'{"model":"served","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":1},'
        b'"timings":{"cache_n":99}}'
    )
    assert shaper.usage == Usage(
        prompt_tokens=8, completion_tokens=1, total_tokens=9, cached_tokens=8
    )  # never more than the prompt


def test_details_or_timings_that_do_not_read_cost_only_the_cached_count() -> None:
    shaper = _shaper()
    shaper.event(
        b'{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
        b'"prompt_tokens_details":"n/a"},"timings":["not", "an", "object"]}'
    )
    assert shaper.usage == Usage(
        prompt_tokens=40, completion_tokens=2, total_tokens=42, cached_tokens=0
    )
