"""`python -m bench.kv_deltas` runs, and what it applies is what the Node encoded.

No timing is asserted; the numbers are design §18.3's, measured by hand."""

from __future__ import annotations

from array import array

import pytest

from bench.kv_deltas import KvDelta, _decode, _encode, main, measure


def test_a_delta_decodes_to_the_hashes_it_carries() -> None:
    stored, removed = [1, 2**62, 5], [7]
    frame = _encode(
        KvDelta(
            provider="p",
            seq=3,
            stored=array("q", stored).tobytes(),
            removed=array("q", removed).tobytes(),
        )
    )
    got = _decode(frame)
    assert list(array("q", got.stored)) == stored and list(array("q", got.removed)) == removed
    assert len(frame) < 8 * 4 + 40  # packed: 8 bytes a hash and a few of framing


def test_the_measurement_runs_and_its_deltas_grow_with_their_hashes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    small, large = measure(4, 1_000, 1), measure(64, 1_000, 1)
    assert large["bytes"] - small["bytes"] == 2 * 8 * 60 + 2  # two bin headers grow by a byte
    assert all(value > 0 for value in (*small.values(), *large.values()))
    assert main(["--hashes", "2", "--resident", "500", "--rounds", "1"]) == 0
    assert "edge us/hash" in capsys.readouterr().out
