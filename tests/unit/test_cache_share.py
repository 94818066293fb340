"""`core.routing.cache_share`: each provider's recent cached share of its prompt tokens."""

from __future__ import annotations

import pytest

from iop_edge.core.routing.cache_share import DECAY, HALF_LIFE_RUNS, CacheShares


def test_a_provider_never_measured_has_no_share() -> None:
    shares = CacheShares()
    assert shares.share("p") is None
    shares.observe("p", prompt_tokens=0, cached_tokens=0)  # counting consumes no prompt
    assert shares.share("p") is None


def test_the_share_is_cached_over_prompt_tokens() -> None:
    shares = CacheShares()
    shares.observe("p", prompt_tokens=100, cached_tokens=80)
    shares.observe("q", prompt_tokens=100, cached_tokens=0)
    assert shares.share("p") == pytest.approx(0.8)
    assert shares.share("q") == 0.0


def test_a_report_beyond_the_prompt_or_below_zero_is_capped() -> None:
    shares = CacheShares()
    shares.observe("p", prompt_tokens=10, cached_tokens=50)
    assert shares.share("p") == 1.0
    shares.observe("q", prompt_tokens=10, cached_tokens=-5)
    assert shares.share("q") == 0.0


def test_recent_runs_weigh_most() -> None:
    """A provider that missed for long and now hits: after one half-life of hits its share
    is past half, and keeps rising."""
    shares = CacheShares()
    for _ in range(200):
        shares.observe("p", prompt_tokens=100, cached_tokens=0)
    for _ in range(HALF_LIFE_RUNS):
        shares.observe("p", prompt_tokens=100, cached_tokens=100)
    after_half_life = shares.share("p")
    assert after_half_life is not None and 0.5 <= after_half_life < 0.55
    half = DECAY**HALF_LIFE_RUNS
    assert half == pytest.approx(0.5)
    for _ in range(HALF_LIFE_RUNS):
        shares.observe("p", prompt_tokens=100, cached_tokens=100)
    later = shares.share("p")
    assert later is not None and later > 0.74


def test_a_removed_provider_is_forgotten() -> None:
    shares = CacheShares()
    shares.observe("p", prompt_tokens=10, cached_tokens=5)
    shares.forget("p")
    shares.forget("never-seen")
    assert shares.share("p") is None
