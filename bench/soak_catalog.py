"""The soak's looks at the Edge's catalog during its shared-runtime phase (`bench.soak`).

Across the process boundary the admin catalog is the only place a provider's health is
visible, and there is nothing to wait on but the next look, so these read it again every
`HEALTH_SAMPLE_S`; their callers bound the waits. Each look at a provider is labelled
(`state`): `available`, one of the two kinds of busy (`BUSY_ACCEPTED`: a probe timed out
on a connection the runtime accepted; `BUSY_GENERATING`: runs in flight produce output),
or its health and reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Final

import httpx2
import trio

from bench.shared_runtime import READY_PREFIX as SHARED_RUNTIME_READY
from iop_node.health import ACCEPTED_BUT_SILENT

__all__ = [
    "BUSY_ACCEPTED",
    "BUSY_GENERATING",
    "HEALTH_SAMPLE_S",
    "all_answered",
    "routable",
    "runtime_health",
    "state",
    "until_available",
    "watch_runtime_health",
]

HEALTH_SAMPLE_S: Final = 0.5
BUSY_ACCEPTED: Final = f"busy: {ACCEPTED_BUT_SILENT}"
BUSY_GENERATING: Final = "busy: runs in flight producing output"


def all_answered(line: str) -> int | None:
    """The shared-runtime client's ready line: how many of its streams are in flight."""
    if not line.startswith(SHARED_RUNTIME_READY):
        return None
    return int(line.removeprefix(SHARED_RUNTIME_READY))


async def until_available(admin: httpx2.AsyncClient, provider: str) -> None:
    """Return once the catalog shows `provider` available."""
    while True:
        if (await runtime_health(admin, (provider,))).get(provider) == "available":
            return
        await trio.sleep(HEALTH_SAMPLE_S)


async def watch_runtime_health(
    admin: httpx2.AsyncClient, providers: Collection[str], health: dict[str, Counter[str]]
) -> None:
    """Count in `health` what each look at the catalog says of each of `providers`."""
    while True:
        for provider, label in (await runtime_health(admin, providers)).items():
            health.setdefault(provider, Counter())[label] += 1
        await trio.sleep(HEALTH_SAMPLE_S)


async def runtime_health(admin: httpx2.AsyncClient, providers: Collection[str]) -> dict[str, str]:
    """Each of `providers`' state in the catalog now (`state`)."""
    response = await admin.get("/catalog")
    response.raise_for_status()
    states = {}
    for entry in response.json()["providers"]:
        if entry["id"] in providers:
            states[entry["id"]] = state(entry["health"], entry.get("health_reason") or "")
    return states


def state(health: str, reason: str) -> str:
    """A label for one look at a provider; it starts with the provider's health."""
    if health == "busy" and ACCEPTED_BUT_SILENT in reason:
        return BUSY_ACCEPTED
    if health == "busy" and any(s in reason for s in ("producing output", "produced output")):
        return BUSY_GENERATING
    return f"{health}: {reason}" if reason else health


def routable(state: str) -> bool:
    """Whether a look's state (`state`) keeps the provider in the pool: available or
    busy, whatever the reason."""
    return state.partition(":")[0] in ("available", "busy")
