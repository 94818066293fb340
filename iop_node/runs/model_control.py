"""A provider's model loads and unloads, one at a time, whoever asks (design §18).

Several Edges may share a Node, and each may decide that a model should be loaded. The
runtime is the truth of what it holds and the Node is the one place that talks to it, so
the Node serialises the commands:

1. One command runs on a provider at a time; the others wait their turn in arrival order
   (a runtime asked to load two models at once may thrash, or fail both).
2. A command equal to one waiting or running (same provider, action and model: another
   Edge asking for the same load) joins it: one load, both answered with its outcome.
3. A command is bounded by its provider's `adapter.load_timeout_s`; one that runs out
   fails with that reason. Its provider's next command then runs. Whatever the adapter
   raises fails the command with what it said: the Node runs on.
4. An adapter whose runtime cannot load on request (`base.ModelLifecycle` not
   implemented) fails every command at once, naming the provider's type.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from iop_node.adapters.base import Adapter, ModelCommandFailed, ModelLifecycle
from schemas.wire import ModelAction

__all__ = ["ModelControl"]

log = logging.getLogger(__name__)


@dataclass
class _Command:
    """One command in progress, and what those that joined it wait for."""

    done: trio.Event = field(default_factory=trio.Event)
    error: str | None = "the command was cancelled before the runtime answered"


class ModelControl:
    """Runs load and unload commands on the providers of one Node (see the module rules)."""

    def __init__(self) -> None:
        self._turns: dict[str, trio.Lock] = {}
        self._in_progress: dict[tuple[str, ModelAction, str], _Command] = {}

    async def run(
        self,
        adapter: Adapter,
        action: ModelAction,
        model: str,
        *,
        after: Callable[[], Awaitable[None]] | None = None,
    ) -> str | None:
        """Load or unload `model` on `adapter`'s provider; None when done, else why not.
        `after` runs once the runtime did it (or failed), before anyone is answered: the
        health probe that reports the new states."""
        provider = adapter.provider
        if not isinstance(adapter, ModelLifecycle):
            return f"provider {provider.id!r} ({provider.type}) cannot load models on request"
        key = (provider.id, action, model)
        joined = self._in_progress.get(key)
        if joined is not None:  # Rule 2
            await joined.done.wait()
            return joined.error
        command = self._in_progress[key] = _Command()
        try:
            async with self._turns.setdefault(provider.id, trio.Lock()):  # Rule 1
                command.error = await _bounded(
                    adapter, action, model, provider.adapter.load_timeout_s
                )
                if after is not None:
                    await after()
        finally:
            del self._in_progress[key]
            command.done.set()
        return command.error


async def _bounded(
    adapter: ModelLifecycle, action: ModelAction, model: str, timeout_s: float
) -> str | None:
    """Rule 3: the runtime's answer within `timeout_s`."""
    with trio.move_on_after(timeout_s) as waited:
        try:
            if action == "load":
                await adapter.load_model(model)
            else:
                await adapter.unload_model(model)
        except ModelCommandFailed as exc:
            return str(exc)
        except Exception as exc:  # an adapter's bug fails the command, never the Node
            log.exception("%s of %s raised", action, model)
            return f"{action} of {model} failed: {type(exc).__name__}: {exc}"
    if waited.cancelled_caught:
        return f"{action} of {model} did not finish within {timeout_s:g}s (adapter.load_timeout_s)"
    return None
