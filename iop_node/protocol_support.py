"""Which caller protocols a provider's upstream speaks natively, as its Node knows now.

The config says what an upstream speaks (`adapter.protocols`, or a default by provider
type, design §14), but a default is a guess: a `vllm`-type provider may be a server that
speaks chat completions only. So the Node learns, and one `ProtocolSupport` per provider
holds what it knows.

Rules:
1. A protocol is native when the config names it *and* the adapter can relay it (an
   HTTP adapter relays any protocol; the `sim` and `cli` adapters speak chat only, so a
   Messages or Responses run is always translated for them).
2. A native endpoint that answers 404 (its route, not the model, is missing) or 405
   marks the protocol unsupported, when the protocol comes from the type's default. The
   run that found out is translated; so is every later one.
3. An operator's explicit `adapter.protocols` is trusted: such a 404 is the run's
   failure, never a lesson (the operator said the runtime speaks it; the error is theirs
   to see).
4. What is learned lasts as long as the adapter (the registry's life): a config refresh
   that rebuilds the provider starts from the config again, which is how an operator
   who upgraded the runtime gets the native path back without restarting the Node.
5. A provider whose runtime refuses Anthropic's beta extras (`anthropic-beta`,
   `context_management`, `cache_control.ttl`) once gets native Messages runs without
   them from then on (`takes_betas`; `protocols.anthropic_betas` has the rules). Like
   Rule 4, it lasts as long as the adapter.
6. Every change bumps `version`, so the health monitor reports it to the Edge (the
   catalog shows it) without polling, and a watcher that looked at an older version
   never misses one.

No I/O: the adapters and the runner decide what happened, this only keeps the record.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from schemas.config import ProviderConfig
from schemas.protocols import ALL_PROTOCOLS, CallerProtocol

__all__ = ["ProtocolSupport"]

log = logging.getLogger(__name__)


class ProtocolSupport:
    """What one provider speaks natively (see the module rules)."""

    __slots__ = (
        "_changed",
        "_native",
        "counts_tokens",
        "explicit",
        "provider_id",
        "takes_betas",
        "version",
    )

    def __init__(
        self, provider: ProviderConfig, relayable: Iterable[CallerProtocol] = ALL_PROTOCOLS
    ) -> None:
        relay = frozenset(relayable)
        self.provider_id = provider.id
        self.explicit = provider.adapter.protocols is not None
        """The operator listed the protocols (Rule 3): nothing is learned."""
        self._native: tuple[CallerProtocol, ...] = tuple(
            protocol for protocol in provider.native_protocols if protocol in relay
        )
        self.counts_tokens = "messages" in self._native
        """Whether to ask the upstream's own `/messages/count_tokens` (a runtime may speak
        Messages but lack that endpoint; it is then counted another way from then on)."""
        self.takes_betas = True
        """Whether native Messages runs carry Anthropic's beta extras (Rule 5)."""
        self.version = 0
        self._changed = trio.Event()

    def speaks(self, protocol: CallerProtocol) -> bool:
        """Whether runs of `protocol` go to the upstream as they are."""
        return protocol in self._native

    def protocols(self) -> list[CallerProtocol]:
        """The protocols spoken natively now, in the config's order (for `status`)."""
        return list(self._native)

    def learn_unsupported(self, protocol: CallerProtocol, why: str) -> bool:
        """The upstream has no endpoint for `protocol` (Rule 2); False when the operator's
        explicit list says otherwise (Rule 3) and the caller must fail the run instead."""
        if self.explicit:
            return False
        if protocol in self._native:
            self._native = tuple(known for known in self._native if known != protocol)
            if protocol == "messages":
                self.counts_tokens = False
            log.warning(
                "provider %s does not speak %s natively (%s): translating its %s runs from now on",
                self.provider_id,
                protocol,
                why,
                protocol,
            )
            self._bump()
        return True

    def learn_no_token_count(self) -> None:
        """The upstream speaks Messages but has no `count_tokens` endpoint: count another
        way from now on (not reported: it changes no protocol)."""
        self.counts_tokens = False

    def learn_refuses_betas(self, why: str) -> None:
        """The runtime refused Anthropic's beta extras and took the run without them
        (Rule 5): later native Messages runs go without them (logged once)."""
        if self.takes_betas:
            self.takes_betas = False
            log.warning(
                "provider %s refuses Anthropic's beta extras (%s): its native Messages runs "
                "go without anthropic-beta, context_management and cache_control.ttl from now on",
                self.provider_id,
                why,
            )

    async def wait_changed(self, seen: int) -> None:
        """Return once `version` differs from `seen` (at once if it already does)."""
        while self.version == seen:
            await self._changed.wait()

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()
