"""The many-models bench part (bench/many_models.py), small: its mixes run the Edge's real
scheduler on virtual time, and placement loads far less than load-only routing."""

from __future__ import annotations

from bench.many_models import Mix, run_models, targets


def test_placement_loads_each_model_once_and_far_less_than_load_only() -> None:
    alternating = Mix("alternating", models=2, providers=2, holds=1, requests=60, zipf=None)
    zipf = Mix("zipf", models=6, providers=3, holds=2, requests=150)
    result = run_models((alternating, zipf))
    by_name = {c.mix.name: c for c in result.comparisons}
    assert by_name["alternating"].placement.loads == 2
    assert by_name["alternating"].load_only.loads > 10
    zipfed = by_name["zipf"]
    assert zipfed.placement.loads * 3 <= zipfed.load_only.loads
    assert zipfed.placement.requests == zipfed.load_only.requests == 150
    assert all(line.startswith("PASS") for line in targets(result))
