"""A model's `generation.defaults`: request fields the Edge sets where a caller set none
(design §2), checked when the config is read rather than when a request meets them.

A default is applied after the caller's request was checked, into a body that goes to
the runtime as it is. So a bad default would reach every request of the model: a
`temperature` of `"hot"` sent upstream, a `max_tokens` past the model's own limit refused
as if the caller had asked for it, a `stream: true` the Edge does not relay as a stream.
Rules:

1. A default is a generation setting, never a part of the request: `model`, the
   conversation (`messages`, `prompt`, `input`), `stream` and `stream_options` (the Edge
   decides how it relays and meters a run), tools and stored-response fields have none.
2. The settings every runtime shares have their types and ranges (`temperature` 0-2,
   `top_p` 0-1, `max_tokens` at most the model's `max_tokens_limit`, `n` 1-128...). Any
   other key is a runtime's own setting (vLLM's `repetition_penalty`, llama.cpp's
   `min_p`) and goes as it is: only its runtime knows what it takes.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Final

__all__ = ["MAX_CHOICES", "defaults_problems"]

#: The most choices (`n`) one request may ask for: OpenAI's own bound.
MAX_CHOICES: Final = 128

#: Rule 1: request fields no default sets.
_REQUEST_FIELDS: Final = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "input",
        "instructions",
        "system",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "store",
        "previous_response_id",
        "conversation",
    }
)


def _number(low: float, high: float) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number from {low:g} to {high:g}"
        if not (math.isfinite(value) and low <= value <= high):
            return f"must be from {low:g} to {high:g}"
        return None

    return check


def _integer(low: int, high: int | None = None) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        if value < low or (high is not None and value > high):
            return f"must be from {low} to {high}" if high is not None else f"must be >= {low}"
        return None

    return check


def _stop(value: object) -> str | None:
    if isinstance(value, str):
        return None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return None
    return "must be a string or a list of strings"


def _flag(value: object) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


#: Rule 2: the shared settings' checks (a message, or None when the value is fine).
_CHECKS: Final[Mapping[str, Callable[[object], str | None]]] = {
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "top_k": _integer(0),
    "min_p": _number(0, 1),
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "n": _integer(1, MAX_CHOICES),
    "seed": _integer(-(2**63), 2**63 - 1),
    "stop": _stop,
    "logprobs": _flag,
    "top_logprobs": _integer(0, 20),
    "parallel_tool_calls": _flag,
}
_OUTPUT_LIMITS: Final = ("max_tokens", "max_completion_tokens")


def defaults_problems(raw: object, max_tokens_limit: int) -> list[tuple[str, str]]:
    """What is wrong with a model's `generation.defaults` (`raw`, as read): (key,
    message) for each bad default; `max_tokens_limit` is the model's."""
    if not isinstance(raw, dict):
        return []  # missing or mistyped: the shape step says so
    problems: list[tuple[str, str]] = []
    for key, value in raw.items():
        if not isinstance(key, str):
            continue
        if key in _REQUEST_FIELDS:
            problems.append(
                (key, "is part of the request, not a generation setting: no default sets it")
            )
        elif key in _OUTPUT_LIMITS:
            problem = _integer(1, max_tokens_limit)(value)
            if problem is not None:
                problems.append((key, f"{problem} (the model's max_tokens_limit)"))
        elif (check := _CHECKS.get(key)) is not None and (problem := check(value)) is not None:
            problems.append((key, problem))
    return problems
