"""A model's `generation.defaults` are checked when the config is read
(`core.generation_defaults`): a bad default would reach every request of the model."""

from __future__ import annotations

from typing import Any

import pytest

from iop_edge.core.generation_defaults import defaults_problems
from tests.unit.test_config import assert_only_error, parse, valid


def test_good_defaults_and_a_runtimes_own_settings_are_read() -> None:
    raw = valid()
    defaults = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512, "repetition_penalty": 1.1}
    raw["models"][0]["generation"] = {"defaults": defaults}
    assert parse(raw).config.models[0].generation.defaults == defaults


@pytest.mark.parametrize(
    ("defaults", "key", "says"),
    [
        ({"stream": True}, "stream", "part of the request"),
        ({"messages": []}, "messages", "part of the request"),
        ({"model": "other"}, "model", "part of the request"),
        ({"temperature": "hot"}, "temperature", "must be a number from 0 to 2"),
        ({"temperature": 7}, "temperature", "must be from 0 to 2"),
        ({"top_p": True}, "top_p", "must be a number"),
        ({"n": 0}, "n", "must be from 1 to 128"),
        ({"stop": [1]}, "stop", "a string or a list of strings"),
        (
            {"max_tokens": 5000},
            "max_tokens",
            "must be from 1 to 100 (the model's max_tokens_limit)",
        ),
        ({"max_completion_tokens": "lots"}, "max_completion_tokens", "must be an integer"),
    ],
)
def test_a_bad_default_is_an_error_naming_it(defaults: dict[str, Any], key: str, says: str) -> None:
    raw = valid()
    raw["models"][0]["generation"] = {"defaults": defaults, "max_tokens_limit": 100}
    assert_only_error(raw, f"models[0].generation.defaults.{key}", says)


def test_the_limit_without_one_set_is_the_default_limit() -> None:
    assert defaults_problems({"max_tokens": 32_768}, 32_768) == []
    assert defaults_problems({"max_tokens": 32_769}, 32_768) == [
        ("max_tokens", "must be from 1 to 32768 (the model's max_tokens_limit)")
    ]
    raw = valid()
    raw["models"][0]["generation"] = {"defaults": {"max_tokens": 40_000}}
    assert_only_error(raw, "models[0].generation.defaults.max_tokens", "max_tokens_limit")
