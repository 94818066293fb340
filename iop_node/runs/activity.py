"""What each provider's runs are doing, so a health probe can tell busy from down
(design §4 item 11).

Real runtimes stop answering their model list while they generate (llama.cpp's Python
server holds one lock for both), so a probe that times out does not by itself mean the
runtime is down. The health monitor asks this record whether the provider's runs are
making progress. Rules:

1. A run's *last sign of life* is its start, then the moment each chunk of its output was
   emitted (a non-stream run's only output is its whole response, at the end).
2. A run is *progressing* while its last sign of life is within its *stall window*: the
   first-byte budget of a stream (`first_byte_timeout_s`, else `request_timeout_s`, the
   adapter's own bound on a silent stream), `request_timeout_s` for a non-stream run (it
   shows nothing until it is done).
3. A provider is `alive` when at least one of its runs is progressing, `stalled` when it
   has runs and none is, `idle` when it has none.
4. Cost on the hot path: a clock read and an attribute store per emitted chunk; the
   scan over runs happens only when a probe has timed out.

Runs are tracked by provider id across registries: a run still draining in a retired
registry talks to the same runtime as the current registry's probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import trio

from schemas.config import ProviderConfig

Progress = Literal["alive", "stalled", "idle"]


def stall_window_s(provider: ProviderConfig, *, stream: bool) -> float:
    """How long a run of `provider` may show no output before it counts as stalled."""
    settings = provider.adapter
    if not stream:
        return settings.request_timeout_s
    return min(
        settings.first_byte_timeout_s or settings.request_timeout_s, settings.request_timeout_s
    )


@dataclass(eq=False, slots=True)
class RunActivity:
    """One run's signs of life; the runner calls `output()` for every chunk it emits."""

    stall_window_s: float
    last_sign_of_life: float = field(default_factory=trio.current_time)

    def output(self) -> None:
        self.last_sign_of_life = trio.current_time()

    def progressing(self, now: float) -> bool:
        return now - self.last_sign_of_life <= self.stall_window_s


@dataclass(frozen=True, slots=True)
class ProviderProgress:
    """The answer to "are this provider's runs moving?" at one instant."""

    state: Progress
    runs: int
    """Runs in flight on the provider."""
    silent_s: float = 0.0
    """For `stalled`: how long the most recently active run has shown nothing."""


class ProviderActivity:
    """The runs in flight per provider id (one per Node session, shared by its registries)."""

    def __init__(self) -> None:
        self._runs: dict[str, set[RunActivity]] = {}

    def start(self, provider: ProviderConfig, *, stream: bool) -> RunActivity:
        """Track a run that starts now; `finish` it whatever happens."""
        activity = RunActivity(stall_window_s(provider, stream=stream))
        self._runs.setdefault(provider.id, set()).add(activity)
        return activity

    def finish(self, provider_id: str, activity: RunActivity) -> None:
        runs = self._runs.get(provider_id)
        if runs is None:
            return
        runs.discard(activity)
        if not runs:
            del self._runs[provider_id]

    def in_flight(self, provider_id: str) -> int:
        return len(self._runs.get(provider_id, ()))

    def progress(self, provider_id: str) -> ProviderProgress:
        """Rule 3, now."""
        runs = self._runs.get(provider_id)
        if not runs:
            return ProviderProgress("idle", 0)
        now = trio.current_time()
        if any(run.progressing(now) for run in runs):
            return ProviderProgress("alive", len(runs))
        latest = max(run.last_sign_of_life for run in runs)
        return ProviderProgress("stalled", len(runs), silent_s=now - latest)
