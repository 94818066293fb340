"""Only a replica of the same config may share the caller port (port_claim's Rules)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from iop_edge.runtime.lifecycle.port_claim import (
    RETAKE_INTERVAL_S,
    CallerPortClaim,
    ClaimIdentity,
    PortShared,
)

SHA_A = "a" * 64
SHA_B = "b" * 64


def _identity(sha: str, pid: int = 111) -> ClaimIdentity:
    return ClaimIdentity(pid=pid, instance=f"host/{pid}", config_sha256=sha, config_path="/e.yaml")


def _reuseport(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.fixture
def caller_sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two Edges' caller sockets sharing one port, as SO_REUSEPORT lets them."""
    first = _reuseport()
    second = _reuseport(first.getsockname()[1])
    with first, second:
        yield first, second


async def test_the_first_edge_holds_the_claim_and_a_same_config_replica_shares(
    caller_sockets: tuple[socket.socket, socket.socket],
) -> None:
    first, second = caller_sockets
    holder = CallerPortClaim.claim(first, _identity(SHA_A))
    assert holder.holder is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder.serve)
        replica = await trio.to_thread.run_sync(
            lambda: CallerPortClaim.claim(second, _identity(SHA_A, pid=222))
        )
        assert replica.holder is None
        nursery.cancel_scope.cancel()
    assert holder.holder is None  # serve closes the name on the way out


async def test_an_edge_with_another_config_is_refused_naming_the_other(
    caller_sockets: tuple[socket.socket, socket.socket],
) -> None:
    first, second = caller_sockets
    holder = CallerPortClaim.claim(first, _identity(SHA_A))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder.serve)
        with pytest.raises(PortShared) as refused:
            await trio.to_thread.run_sync(
                lambda: CallerPortClaim.claim(second, _identity(SHA_B, pid=222))
            )
        nursery.cancel_scope.cancel()
    message = str(refused.value)
    port = first.getsockname()[1]
    assert f"127.0.0.1:{port}" in message
    assert "pid 111" in message and "different config" in message
    assert SHA_A[:12] in message and SHA_B[:12] in message


def test_a_restart_successor_does_not_ask(
    caller_sockets: tuple[socket.socket, socket.socket],
) -> None:
    first, second = caller_sockets
    holder = CallerPortClaim.claim(first, _identity(SHA_A))
    try:
        successor = CallerPortClaim.claim(second, _identity(SHA_B, pid=222), inherited=True)
        assert successor.holder is None
    finally:
        holder.close()


def test_a_holder_that_does_not_answer_is_not_shared_with(
    caller_sockets: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = caller_sockets
    monkeypatch.setattr("iop_edge.runtime.lifecycle.port_claim.ASK_TIMEOUT_S", 0.05)
    holder = CallerPortClaim.claim(first, _identity(SHA_A))  # holds, never serves
    try:
        with pytest.raises(PortShared, match="did not say which config"):
            CallerPortClaim.claim(second, _identity(SHA_A, pid=222))
    finally:
        holder.close()


async def test_a_replica_takes_the_claim_over_when_its_holder_exits(
    caller_sockets: tuple[socket.socket, socket.socket],
    autojump_clock: trio.testing.MockClock,
) -> None:
    first, second = caller_sockets
    holder = CallerPortClaim.claim(first, _identity(SHA_A))
    async with trio.open_nursery() as nursery:
        holder_scope = trio.CancelScope()

        async def first_edge() -> None:
            with holder_scope:
                await holder.serve()

        nursery.start_soon(first_edge)
        replica = await trio.to_thread.run_sync(
            lambda: CallerPortClaim.claim(second, _identity(SHA_A, pid=222))
        )
        nursery.start_soon(replica.serve)
        holder_scope.cancel()  # the first Edge exits
        await trio.sleep(2 * RETAKE_INTERVAL_S)  # virtual time: two retries of the replica
        assert replica.holder is not None
        nursery.cancel_scope.cancel()
