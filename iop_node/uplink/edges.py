"""Every Edge this Node serves: one link per Edge address, one set of providers for all.

A Node may serve several Edges at once (design §3 "Several Edges", §13): Edge replicas
with the same config behind a balancer, or the old and the new process of an Edge during
a zero-downtime restart. It is told where they are in two ways, which may be combined:

- Edge URLs (`--edge`, repeatable): one link each.
- A DNS name (`--edge-dns ws://edges.example:7700`): one link per address the name
  resolves to, re-resolved every `dns_interval_s`. An address that appears gets a link;
  one that disappears is retired (no more dials; its sessions close once their runs
  are done). A failed lookup changes nothing (the links keep their addresses).

Callers never reach an Edge through the Node, so a balancer in front of the Edges is for
callers only: Nodes must reach every replica's own node listener (each replica needs its
own node address; docs/operations.md#replicas).

An Edge that refuses this Node for good (a bad token, an unknown node id: `EdgeRejected`)
loses its link alone, with an error logged, while another link serves; only when no
other is left does the rejection end the Node (losing one Edge loses only its runs,
design §13).

`EdgeLinks.run` owns the `ProviderHost` and every link; it is startable and reports
started once the first link is live. `stop()` drains gracefully: the host reports every
provider unavailable to every Edge and lets the active runs finish, then every link closes.
"""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import trio

from iop_node.host import HostStatistics, ProviderHost
from iop_node.uplink.link import EdgeRejected, NodeLink, wait_first
from iop_node.uplink.link_settings import LinkSettings

__all__ = ["DEFAULT_DNS_INTERVAL_S", "EdgeLinks", "Resolver", "resolve_addresses"]

log = logging.getLogger(__name__)

DEFAULT_DNS_INTERVAL_S = 30.0

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""`(host, port) -> addresses`: every IP address `host` resolves to, in a stable order."""


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address of `host` (IPv4 and IPv6), deduplicated, in resolver order."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, slots=True)
class _DnsTarget:
    url: str
    host: str
    port: int


@dataclass
class EdgeLinks:
    """The Node's links to its Edges and the providers they share (module docstring)."""

    template: LinkSettings
    """Settings every link shares; each link gets its own `edge_url` (and `address`)."""
    host_factory: Callable[[trio.Nursery], ProviderHost]
    urls: Sequence[str] = ()
    dns_urls: Sequence[str] = ()
    dns_interval_s: float = DEFAULT_DNS_INTERVAL_S
    resolver: Resolver = resolve_addresses
    rng: random.Random | None = None
    host: ProviderHost | None = None
    links: dict[tuple[str, str | None], NodeLink] = field(default_factory=dict)
    """Every link by (URL, address), retired ones until they closed."""

    def __post_init__(self) -> None:
        if not self.urls and not self.dns_urls:
            raise ValueError("a node needs at least one edge url or edge dns name")
        self._stop_requested = trio.Event()
        self._ready = trio.Event()
        self._nursery: trio.Nursery | None = None

    # --- observation -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether at least one link has a session taking new runs."""
        return any(link.connected for link in self.links.values())

    @property
    def sessions(self) -> int:
        """Sessions welcomed so far, over every link."""
        return sum(link.sessions for link in self.links.values())

    def statistics(self) -> HostStatistics:
        assert self.host is not None, "not running"
        return self.host.statistics()

    # --- lifecycle ---------------------------------------------------------------------

    def stop(self) -> None:
        """Drain and stop (see the module docstring); `run` returns when done."""
        self._stop_requested.set()

    async def run(
        self, *, task_status: trio.TaskStatus[EdgeLinks] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as host_nursery:
            host = self.host = self.host_factory(host_nursery)
            async with trio.open_nursery() as links:
                self._nursery = links
                for url in self.urls:
                    self._start_link(url, None)
                for url in self.dns_urls:
                    links.start_soon(self._follow_dns, _dns_target(url), name=f"dns {url}")
                await wait_first(self._ready.wait, self._stop_requested.wait)
                if self._ready.is_set():
                    task_status.started(self)
                await self._stop_requested.wait()
                for link in self.links.values():
                    link.stop()
                await host.aclose()
                links.cancel_scope.deadline = trio.current_time() + _CLOSE_GRACE_S
            host_nursery.cancel_scope.cancel()
        log.info("node stopped")

    def _start_link(self, url: str, address: str | None) -> NodeLink:
        assert self._nursery is not None
        settings = replace(self.template, edge_url=url, address=address)
        link = NodeLink(
            settings,
            self._host(),
            rng=random.Random(self.rng.random()) if self.rng is not None else None,
            on_ready=self._ready.set,
        )
        key = (url, address)
        self.links[key] = link

        async def run_link() -> None:
            try:
                await link.run()
            except* EdgeRejected as refused:
                if not any(other is not link for other in self.links.values()):
                    raise  # the only Edge there is refused this Node: nothing to serve
                log.error(
                    "edge %s refused this node for good (%s); serving the other edge(s) without it",
                    settings.label,
                    refused.exceptions[0],
                )
            finally:
                if self.links.get(key) is link:
                    del self.links[key]

        self._nursery.start_soon(run_link, name=f"link {settings.label}")
        return link

    def _host(self) -> ProviderHost:
        assert self.host is not None
        return self.host

    async def _follow_dns(self, target: _DnsTarget) -> None:
        """Keep one link per address of `target.host` (module docstring)."""
        current: dict[str, NodeLink] = {}
        while not self._stop_requested.is_set():
            try:
                addresses = await self.resolver(target.host, target.port)
            except OSError as exc:
                log.warning("cannot resolve edge name %s: %s", target.host, exc)
            else:
                if not addresses:
                    log.warning("edge name %s resolves to no address", target.host)
                for address in addresses:
                    if address not in current:
                        log.info("edge %s: linking to address %s", target.url, address)
                        current[address] = self._start_link(target.url, address)
                for address in [a for a in current if a not in addresses]:
                    log.info("edge %s: address %s is gone; retiring its link", target.url, address)
                    current.pop(address).retire()
            with trio.move_on_after(self.dns_interval_s):
                await self._stop_requested.wait()


#: How long links may take to close after the host drained (bounded close handshakes).
_CLOSE_GRACE_S = 10.0


def _dns_target(url: str) -> _DnsTarget:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"edge dns url must be ws:// or wss:// with a host name, got {url!r}")
    port = parts.port or (443 if parts.scheme == "wss" else 80)
    return _DnsTarget(url=url, host=parts.hostname, port=port)
