"""`relabel`: callers see their alias; everything else passes through byte for byte."""

from __future__ import annotations

import msgspec
import pytest

from iop_edge.http.relabel import BadPayload, relabel


def test_model_becomes_the_alias_and_nested_bytes_are_untouched() -> None:
    chunk = b'{"model":"Qwen/Served","choices":[{"delta": {"reasoning_content" : "\\u00e9 x"}}]}'
    out = relabel(chunk, "qwen:alias", strip_usage=False)
    assert (
        out == b'{"model":"qwen:alias","choices":[{"delta": {"reasoning_content" : "\\u00e9 x"}}]}'
    )


def test_alias_is_json_escaped() -> None:
    out = relabel(b'{"model":"x"}', 'we"ird', strip_usage=False)
    assert out is not None and msgspec.json.decode(out) == {"model": 'we"ird'}


def test_usage_only_chunk_is_dropped_unless_asked_for() -> None:
    chunk = b'{"model":"x","choices":[ ],"usage":{"prompt_tokens":3}}'
    assert relabel(chunk, "a", strip_usage=True) is None
    kept = relabel(chunk, "a", strip_usage=False)
    assert kept is not None and b'"usage":{"prompt_tokens":3}' in kept


def test_usage_on_a_content_chunk_is_removed_but_the_content_kept() -> None:
    chunk = b'{"model":"x","choices":[{"delta":{"content":"hi"}}],"usage":{"total_tokens":1}}'
    out = relabel(chunk, "a", strip_usage=True)
    assert out == b'{"model":"a","choices":[{"delta":{"content":"hi"}}]}'


def test_null_usage_is_not_a_usage_chunk() -> None:
    chunk = b'{"model":"x","choices":[{"delta":{}}],"usage":null}'
    assert (
        relabel(chunk, "a", strip_usage=True)
        == b'{"model":"a","choices":[{"delta":{}}],"usage":null}'
    )


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b'"text"', b""])
def test_anything_but_a_json_object_is_a_bad_payload(data: bytes) -> None:
    with pytest.raises(BadPayload):
        relabel(data, "a", strip_usage=False)
