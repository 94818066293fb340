"""The work a run is expected to take, the fair queue's unit of service (design §15).

Fair queueing that counted requests would give a principal with two huge requests the
same number of turns as one with many small ones, and so most of the slot time. A run's
service is counted in tokens instead, known before it runs:

1. Its input tokens: the Edge's estimate (`RunPlan.prompt_tokens`, the one long-context
   admission uses; a continued Responses conversation counts whole).
2. Plus its expected output: the output tokens the request allows itself (chat's
   `max_completion_tokens` or `max_tokens`, Messages' `max_tokens`, Responses'
   `max_output_tokens`, after the model's `generation.defaults`: the bound the
   principal's token limits read too; 0 for embeddings), capped at
   `EXPECTED_OUTPUT_CAP`; a request that names none counts the cap. A bound is a
   ceiling, not a forecast: most replies stop well short of a large one, and the cap
   keeps one request that allows itself 32k tokens from counting as thirty small ones.
3. At least 1: every run is some service.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXPECTED_OUTPUT_CAP", "run_work"]

#: The output tokens a run is expected to produce at most (Rule 2).
EXPECTED_OUTPUT_CAP: Final = 1024


def run_work(prompt_tokens: int, max_output: int | None) -> int:
    """The run's expected service in tokens (module rules); `max_output` is the output
    bound the request sets (None: none)."""
    expected = EXPECTED_OUTPUT_CAP if max_output is None else min(max_output, EXPECTED_OUTPUT_CAP)
    return max(1, prompt_tokens + expected)
