"""A fleet's JSON made and read a piece at a time (`runtime.refresh.json_pieces`): the
same bytes and text as one call makes, in steps of the loop."""

from __future__ import annotations

import random

import msgspec
import pytest
import trio

from iop_edge.runtime.refresh import json_pieces
from iop_edge.runtime.refresh.json_pieces import decode_string_in_pieces, encode_in_pieces
from schemas.refresh import Change, NodeResult, RefreshError, RefreshReport


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


def _report(nodes: int) -> RefreshReport:
    ids = [f"node-{i:05d}" for i in range(nodes)]
    return RefreshReport(
        mode="apply",
        outcome="applied",
        base_revision=1,
        revision=2,
        changed_nodes=ids,
        changed_providers=[],
        changed_models=["m"],
        changes=[Change(path=f"nodes[{i}].providers[{i}-p].capacity", class_="live") for i in ids],
        live_paths=[],
        restart_required_paths=[],
        pending_restart=[],
        errors=[RefreshError(path="nodes", message='a "nodes":[] in a message')],
        nodes=[NodeResult(id=i, status="applied", revision=2) for i in ids],
    )


@pytest.mark.parametrize("nodes", [0, 1, 1024, 2500])
async def test_a_struct_with_its_lists_in_pieces_is_the_same_json(
    monkeypatch: pytest.MonkeyPatch, nodes: int
) -> None:
    monkeypatch.setattr(json_pieces, "STEP_ITEMS", 1000)
    encoder = msgspec.json.Encoder()
    report = _report(nodes)
    fields = ("changed_nodes", "changes", "changed_providers", "nodes")
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        encoded = await encode_in_pieces(encoder, report, fields)
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert bytes(encoded) == encoder.encode(report)
    # a step for each thousand items of each list (the `class` key is a renamed field's)
    assert steps.steps == 3 * -(-nodes // 1000)


def _escaped_text(rng: random.Random, chars: int) -> str:
    pieces = ["a", "é", "\n", "\\", '"', "\\n", "😀", "\t", "\u2028", "x" * 40]
    return "".join(rng.choice(pieces) for _ in range(chars))


@pytest.mark.parametrize("seed", range(8))
async def test_a_long_json_string_in_pieces_is_the_same_text(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    monkeypatch.setattr(json_pieces, "STEP_BYTES", 64)
    rng = random.Random(seed)
    text = _escaped_text(rng, 400)
    raw = msgspec.json.encode(text)
    assert len(raw) > 64 * 10
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        assert await decode_string_in_pieces(raw) == text
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert steps.steps > 5  # cut in pieces, not decoded whole


async def test_a_string_with_no_newline_to_cut_at_is_decoded_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(json_pieces, "STEP_BYTES", 64)
    text = "\\" * 300 + "é" * 300  # escapes, but no escaped newline anywhere
    assert await decode_string_in_pieces(msgspec.json.encode(text)) == text
    literal = "a\\n" * 200  # a backslash, then `n`: `\\n` on the wire, not a newline
    assert await decode_string_in_pieces(msgspec.json.encode(literal)) == literal


async def test_what_is_not_a_json_string_is_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        await decode_string_in_pieces(b"12")
    with pytest.raises(msgspec.DecodeError):
        await decode_string_in_pieces(b'"unterminated' + b"x" * 300_000)
