"""What one link to an Edge is configured with (`LinkSettings`) and the defaults it
falls back on: frame and queue sizes, heartbeat misses, how often `load` is reported, how
long an old link lingers after `goaway`."""

from __future__ import annotations

from dataclasses import dataclass, field

from iop_node.uplink.backoff import BackoffPolicy
from schemas import limits

#: Runs carry whole request bodies; the library default (1 MiB) is too small for them.
MAX_FRAME_BYTES = limits.MAX_FRAME_BYTES
#: Messages the connection's reader may parse ahead of ours. The library default (1) makes
#: its reader wait for ours after every message; with room, the messages of one socket
#: read are parsed in one go. (The Edge keeps the default: before a peer has
#: authenticated, every queued message may be up to MAX_FRAME_BYTES.)
MESSAGE_QUEUE_SIZE = 64
#: Heartbeat timeout when not given: about three missed pings, as the Edge does.
HEARTBEAT_MISSES = 3
#: Fewest seconds between two `load` reports on one link: a burst of run starts and ends
#: on other links costs this link one message, not one per run. (Capacity never depends
#: on it: a run that finds no slot is answered `busy`.)
LOAD_REPORT_INTERVAL_S = 0.01
#: Fewest seconds between two `load` reports while no provider is under pressure (less
#: than half its slots held): the others' runs then only shape ranking.
LOAD_REPORT_RELAXED_S = 0.25
#: After `goaway`, how long the Node waits for the Edge to close the old link before it
#: closes it itself (once that link's runs are done).
GOAWAY_LINGER_S = 30.0


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Everything one link needs; the token is kept out of `repr` (and so out of logs)."""

    edge_url: str
    node_id: str
    token: str = field(repr=False)
    agent_version: str = ""
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    handshake_timeout_s: float = 10.0
    ping_interval_s: float | None = None
    """None: use the `heartbeat_s` the Edge announces in `welcome`."""
    ping_timeout_s: float | None = None
    """None: `HEARTBEAT_MISSES` ping intervals."""
    address: str | None = None
    """Dial this IP address instead of the URL's host (one address of a named Edge)."""
    load_report_interval_s: float = LOAD_REPORT_INTERVAL_S
    load_report_relaxed_s: float = LOAD_REPORT_RELAXED_S
    goaway_linger_s: float = GOAWAY_LINGER_S

    def __post_init__(self) -> None:
        if not self.edge_url.startswith(("ws://", "wss://")):
            raise ValueError(f"edge url must start with ws:// or wss://, got {self.edge_url!r}")

    @property
    def label(self) -> str:
        """How logs name this link: the URL, and the address when dialled by address."""
        return self.edge_url if self.address is None else f"{self.edge_url} ({self.address})"
