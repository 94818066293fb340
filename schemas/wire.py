"""The runtime wire between Edge and Node (SPEC §3).

One websocket per Node, one msgpack-encoded message per websocket message. Every message
is a tagged Struct (`type` field); tags are explicit so renaming a class never changes
the wire. There is one union per direction, and one encoder/decoder pair built once and
reused by everyone. Unknown fields are ignored (an older peer skips what a newer one
adds); an unknown `type` or a malformed frame raises `WireError`, which the receiver turns
into a `reject`/close with the reason instead of crashing.

Payloads that are OpenAI JSON (`run.body`, `run_chunk.data`, `run_done.response`) travel
as raw JSON bytes: the Node hands them to the upstream as they are, and nobody re-encodes
JSON in between.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.config import LifecycleFlag, NodeConfig

#: Bumped on any incompatible change; travels in `hello` and `welcome`.
PROTOCOL_VERSION = 1

Operation = Literal["chat", "completion", "embedding"]
Health = Literal["available", "unavailable", "unknown"]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire message."""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# --- handshake -----------------------------------------------------------------------


class Hello(Message, tag="hello", frozen=True, kw_only=True):
    protocol: int
    node_id: str
    token: str
    agent_version: str = ""


class Welcome(Message, tag="welcome", frozen=True, kw_only=True):
    protocol: int
    edge_id: str
    revision: int
    node_config: NodeConfig
    heartbeat_s: float = 5.0


class Reject(Message, tag="reject", frozen=True, kw_only=True):
    """Sent before the Edge closes a connection it will not serve (or by either side on a
    malformed frame). `code` is machine-readable, `reason` is for humans."""

    code: str
    reason: str


# --- runs ------------------------------------------------------------------------------


class Run(Message, tag="run", frozen=True, kw_only=True):
    run_id: str
    provider_id: str
    target: str
    operation: Operation
    body: bytes
    stream: bool = False
    deadline_s: float | None = None
    """Seconds the run may still take, measured when the Edge sent it."""


class Cancel(Message, tag="cancel", frozen=True, kw_only=True):
    run_id: str


class RunChunk(Message, tag="run_chunk", frozen=True, kw_only=True):
    run_id: str
    data: bytes


class RunDone(Message, tag="run_done", frozen=True, kw_only=True):
    run_id: str
    usage: Usage | None = None
    response: bytes | None = None


class RunFailed(Message, tag="run_failed", frozen=True, kw_only=True):
    """A run ended without success.

    `retryable` tells the Edge the failure happened before the upstream produced
    anything and another provider may succeed (connect refused, upstream 5xx, 429/503).
    `capacity` marks a 429/503 from the upstream: a load signal, not a health failure.
    """

    run_id: str
    code: str
    message: str
    retryable: bool = False
    capacity: bool = False
    status: int | None = None


# --- config and health -----------------------------------------------------------------


class Refresh(Message, tag="refresh", frozen=True, kw_only=True):
    revision: int
    node_config: NodeConfig


class RefreshAck(Message, tag="refresh_ack", frozen=True, kw_only=True):
    revision: int
    ok: bool
    error: str | None = None


class ProviderStatus(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    health: Health
    models: list[str] = []
    detail: str | None = None
    lifecycle: list[LifecycleFlag] | None = None
    """The lifecycle operations the provider's runtime API offers, as the adapter found
    them (e.g. Ollama's native API); None when the adapter cannot tell."""


class Status(Message, tag="status", frozen=True, kw_only=True):
    providers: list[ProviderStatus]


EdgeToNode = Welcome | Reject | Run | Cancel | Refresh
NodeToEdge = Hello | Reject | RunChunk | RunDone | RunFailed | RefreshAck | Status


class WireError(Exception):
    """A frame that is not a valid message for this direction."""


_encoder = msgspec.msgpack.Encoder()
_from_node = msgspec.msgpack.Decoder(NodeToEdge)
_from_edge = msgspec.msgpack.Decoder(EdgeToNode)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode_from_node(frame: bytes | str) -> NodeToEdge:
    """Decode a frame the Edge received; raises `WireError` naming what is wrong."""
    if isinstance(frame, str):
        raise WireError("text frame: the runtime wire is binary msgpack")
    try:
        return _from_node.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad frame: {exc}") from None


def decode_from_edge(frame: bytes | str) -> EdgeToNode:
    """Decode a frame the Node received; raises `WireError` naming what is wrong."""
    if isinstance(frame, str):
        raise WireError("text frame: the runtime wire is binary msgpack")
    try:
        return _from_edge.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad frame: {exc}") from None
