"""The config of a model's lifecycle (`models[].lifecycle`): defaults that keep older
configs working, and errors that name the key."""

from __future__ import annotations

from tests.unit.test_config import assert_only_error, parse, valid


def test_a_model_without_a_lifecycle_leaves_its_runtimes_alone() -> None:
    lifecycle = parse(valid()).config.models[0].lifecycle
    assert (lifecycle.idle_unload_s, lifecycle.keep_loaded, lifecycle.preload) == (None, False, 0)


def test_the_lifecycle_is_read_per_model() -> None:
    raw = valid()
    raw["models"][0]["lifecycle"] = {"idle_unload_s": 600, "keep_loaded": True, "preload": 1}
    lifecycle = parse(raw).config.models[0].lifecycle
    assert (lifecycle.idle_unload_s, lifecycle.keep_loaded, lifecycle.preload) == (600, True, 1)


def test_an_idle_time_of_zero_is_an_error_naming_it() -> None:
    raw = valid()
    raw["models"][0]["lifecycle"] = {"idle_unload_s": 0}
    assert_only_error(raw, "models[0].lifecycle.idle_unload_s", "> 0")


def test_a_preload_beyond_the_model_s_providers_is_an_error_naming_it() -> None:
    raw = valid()
    providers = len(raw["models"][0]["providers"])
    raw["models"][0]["lifecycle"] = {"preload": providers + 1}
    assert_only_error(
        raw,
        "models[0].lifecycle.preload",
        f"asks for {providers + 1} copies but the model has {providers} provider(s)",
    )


def test_an_unknown_lifecycle_key_is_an_error() -> None:
    raw = valid()
    raw["models"][0]["lifecycle"] = {"keep_alive": -1}
    assert_only_error(raw, "models[0].lifecycle.keep_alive", "unknown")
