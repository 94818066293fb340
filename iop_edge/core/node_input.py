"""What a Node says is input, not truth: the checks the Edge applies before acting on it.

A Node is authenticated, not trusted: a buggy adapter, an upstream that reports nonsense
or a compromised host must not be able to turn a success into a 500, poison the usage
ledger or bloat what the Edge holds and shows. Every run end and status a Node sends
goes through `check_node_message`, which returns the message the Edge acts on and what
it had to correct (the session logs that, naming the node). Chunks pass untouched: the
Edge relays them and checks only their framing (`http.runs`).

Rules:
1. Token counts are integers in `0..MAX_REPORTED_TOKENS`; a negative count becomes 0 and
   an absurd one the maximum. `total_tokens` is at least the sum of the other two;
   `cached_tokens` is at most `prompt_tokens` (cached tokens are part of the prompt).
2. A failure's `message` is at most `MAX_TEXT_CHARS` characters (it reaches callers and
   logs); its `status` is an HTTP status (100..599) or nothing; its `retry_after_s` a
   finite number of seconds, at least 0, or nothing.
3. A provider status carries at most `MAX_REPORTED_MODELS` model names of at most
   `MAX_NAME_CHARS` characters each, and a `detail` of at most `MAX_TEXT_CHARS`.
4. Nothing here raises: the worst a Node's numbers can do is be corrected. A note names
   what the Node sent only through `peer_text.logged` (the session logs the notes).
5. Models' load states follow Rule 3 (at most `MAX_REPORTED_MODELS`, names of at most
   `MAX_NAME_CHARS`, a `reason` of at most `MAX_TEXT_CHARS`); `max_loaded` is positive or
   nothing; a `model_command_done` error is at most `MAX_TEXT_CHARS`.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from iop_edge.core.peer_text import logged
from schemas import wire
from schemas.limits import MAX_REPORTED_TOKENS

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_REPORTED_MODELS",
    "MAX_REPORTED_TOKENS",
    "MAX_TEXT_CHARS",
    "check_node_message",
]

MAX_TEXT_CHARS: Final = 8192
MAX_REPORTED_MODELS: Final = 4096
MAX_NAME_CHARS: Final = 512


def check_node_message(message: wire.NodeToEdge) -> tuple[wire.NodeToEdge, list[str]]:
    """The message to act on, and a note per correction (empty when it was sound)."""
    match message:
        case wire.RunEvents(ends=ends) if ends:
            checked: list[wire.RunDone | wire.RunFailed] = []
            notes: list[str] = []
            for end in ends:
                sound, corrections = _check_end(end)
                checked.append(sound)
                notes += corrections
            if notes:
                return msgspec.structs.replace(message, ends=checked), notes
        case wire.Status():
            return _check_status(message)
        case wire.ModelCommandDone(error=error) if error and len(error) > MAX_TEXT_CHARS:
            cut = msgspec.structs.replace(message, error=error[:MAX_TEXT_CHARS] + "…")
            return cut, [f"model command {logged(message.command_id)}: error cut"]
    return message, []


def _check_end(
    end: wire.RunDone | wire.RunFailed,
) -> tuple[wire.RunDone | wire.RunFailed, list[str]]:
    notes: list[str] = []
    changes: dict[str, object] = {}
    if end.usage is not None:
        usage, corrections = _check_usage(end.usage)
        if corrections:
            changes["usage"] = usage
            notes += corrections
    if isinstance(end, wire.RunFailed):
        if len(end.message) > MAX_TEXT_CHARS:
            changes["message"] = end.message[:MAX_TEXT_CHARS] + "…"
            notes.append(
                f"run {logged(end.run_id)}: failure message of {len(end.message)} chars cut"
            )
        if end.status is not None and not 100 <= end.status <= 599:
            changes["status"] = None
            notes.append(f"run {logged(end.run_id)}: status {end.status} is not an HTTP status")
        retry_after_s = end.retry_after_s
        if retry_after_s is not None and not (math.isfinite(retry_after_s) and retry_after_s >= 0):
            changes["retry_after_s"] = None
            notes.append(
                f"run {logged(end.run_id)}: retry_after_s {retry_after_s!r} is no number of seconds"
            )
    if not changes:
        return end, []
    return msgspec.structs.replace(end, **changes), notes


def _check_usage(usage: wire.Usage) -> tuple[wire.Usage, list[str]]:
    checked = usage.bounded()  # Rule 1: the very object when it is sound
    if checked is usage:
        return usage, []

    def counts(of: wire.Usage) -> tuple[int, int, int, int]:
        return (of.prompt_tokens, of.completion_tokens, of.total_tokens, of.cached_tokens)

    return checked, [
        f"usage out of range (prompt/completion/total/cached tokens {counts(usage)}); "
        f"metered as {counts(checked)}"
    ]


def _check_status(status: wire.Status) -> tuple[wire.NodeToEdge, list[str]]:
    notes: list[str] = []
    providers = []
    for provider in status.providers:
        changes: dict[str, object] = {}
        models = provider.models
        if len(models) > MAX_REPORTED_MODELS or any(len(m) > MAX_NAME_CHARS for m in models):
            changes["models"] = [m for m in models if len(m) <= MAX_NAME_CHARS][
                :MAX_REPORTED_MODELS
            ]
            notes.append(f"provider {logged(provider.id)}: model list cut")
        if provider.detail is not None and len(provider.detail) > MAX_TEXT_CHARS:
            changes["detail"] = provider.detail[:MAX_TEXT_CHARS] + "…"
            notes.append(f"provider {logged(provider.id)}: detail cut")
        if provider.model_states is not None:
            states = _check_states(provider.model_states)
            if states != provider.model_states:
                changes["model_states"] = states
                notes.append(f"provider {logged(provider.id)}: model states cut")
        if provider.max_loaded is not None and provider.max_loaded < 1:
            changes["max_loaded"] = None
            notes.append(f"provider {logged(provider.id)}: max_loaded not positive")
        providers.append(msgspec.structs.replace(provider, **changes) if changes else provider)
    if not notes:
        return status, []
    # The corrected report still answers the probes it answered (`probed`): a caller
    # waiting on a probe on demand hears it.
    return msgspec.structs.replace(status, providers=providers), notes


def _check_states(states: list[wire.ModelState]) -> list[wire.ModelState]:
    """Rule 5: the states kept (the same list when all are sound)."""
    if len(states) <= MAX_REPORTED_MODELS and all(
        len(s.name) <= MAX_NAME_CHARS and len(s.reason or "") <= MAX_TEXT_CHARS for s in states
    ):
        return states
    return [
        msgspec.structs.replace(s, reason=s.reason[:MAX_TEXT_CHARS]) if s.reason else s
        for s in states
        if len(s.name) <= MAX_NAME_CHARS
    ][:MAX_REPORTED_MODELS]
