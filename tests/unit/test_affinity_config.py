"""The config of cache affinity (`models[].routing`) and of the sim's prefix cache:
defaults that keep older configs working, and errors that name the key."""

from __future__ import annotations

from tests.unit.test_config import assert_only_error, first_provider, parse, provider, valid


def test_routing_defaults_to_affinity_within_a_quarter_of_the_idlest() -> None:
    routing = parse(valid()).config.models[0].routing
    assert routing.affinity is True
    assert routing.load_bound == 0.25
    assert routing.shared_prefixes is False


def test_routing_is_read_per_model() -> None:
    raw = valid()
    raw["models"][0]["routing"] = {"affinity": False, "load_bound": 0.5, "shared_prefixes": True}
    routing = parse(raw).config.models[0].routing
    assert (routing.affinity, routing.load_bound, routing.shared_prefixes) == (False, 0.5, True)


def test_a_load_bound_beyond_one_is_an_error_naming_it() -> None:
    raw = valid()
    raw["models"][0]["routing"] = {"load_bound": 1.5}
    assert_only_error(raw, "models[0].routing.load_bound", "<= 1")


def test_an_unknown_routing_key_is_an_error() -> None:
    raw = valid()
    raw["models"][0]["routing"] = {"sticky": True}
    assert_only_error(raw, "models[0].routing.sticky", "unknown")


def test_the_sims_prefix_cache_settings() -> None:
    raw = valid()
    first_provider(raw)["adapter"] = {
        "prefix_cache_tokens": 100_000,
        "prefill_us_per_token": 150.0,
        "cached_prefill_us_per_token": 2.0,
    }
    adapter = parse(raw).config.nodes[0].providers[0].adapter
    assert adapter.prefix_cache_tokens == 100_000
    assert adapter.prefill_us_per_token == 150.0


def test_a_cached_token_costing_more_than_an_uncached_one_is_an_error() -> None:
    raw = valid()
    first_provider(raw)["adapter"] = {"prefill_us_per_token": 1.0, "cached_prefill_us_per_token": 2}
    assert_only_error(
        raw,
        "nodes[0].providers[0].adapter.cached_prefill_us_per_token",
        "at most prefill_us_per_token",
    )


def test_the_prefix_cache_settings_belong_to_the_sim() -> None:
    raw = valid()
    raw["nodes"][0]["providers"] = [provider("p1", "vllm")]
    first_provider(raw)["adapter"]["prefix_cache_tokens"] = 1000
    assert_only_error(
        raw, "nodes[0].providers[0].adapter.prefix_cache_tokens", "not used by type 'vllm'"
    )
