"""The affinity bench part (bench/affinity.py), small: its replay runs the Edge's real
scheduler on virtual time, and affinity keeps more of the ideal cache than load-only."""

from __future__ import annotations

from bench.affinity import Replay, run_affinity, targets


def test_a_small_replay_keeps_the_cache_and_the_load_spread() -> None:
    replay = Replay("replay (moderate load)", sessions=8, turns=4, think_s=4.0)
    hot = Replay("hot prefix", sessions=16, turns=4, hot=True)
    result = run_affinity((replay, hot), decision_rounds=1)
    measured, spread = result.comparisons
    assert measured.affinity.runs == measured.load_only.runs == 32
    assert measured.affinity.cached_share > measured.load_only.cached_share
    assert measured.affinity.prefilled_tokens < measured.load_only.prefilled_tokens
    assert measured.affinity.ttft_p50_s < measured.load_only.ttft_p50_s
    assert spread.affinity.max_load <= 1.25
    lines = targets(result)
    assert all(line.startswith(("PASS", "MISS")) for line in lines)
    assert result.decision_us_load > 0 and result.decision_us_affinity > 0
