"""`RunConnections`, rule by rule, on stand-in connections and a mock clock: which
connection a run gets, which are kept, which are closed and when."""

from __future__ import annotations

from typing import Any, cast

import httpcore2
import pytest
import trio
from trio.testing import MockClock

from iop_node.adapters.run_connections import RunConnections

ORIGIN = httpcore2.Origin(b"http", b"upstream", 80)
REQUEST = httpcore2.Request(b"POST", "http://upstream/v1/chat/completions")
EXPIRY_S = 4.0


class Connection:
    """A stand-in httpcore2 connection: answers every request and records what it saw."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.sent = 0
        self.idle_after_exchange = True
        self.server_closed = False
        self.probed = 0
        self.closed = False
        self.fail: Exception | None = None
        self.hang = False

    async def handle_async_request(self, request: httpcore2.Request) -> httpcore2.Response:
        assert not self.closed
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await trio.sleep_forever()
        self.sent += 1
        return httpcore2.Response(200)

    def is_idle(self) -> bool:
        return self.idle_after_exchange and not self.closed

    def is_available(self) -> bool:
        return self.is_idle()

    def has_expired(self) -> bool:
        self.probed += 1
        return self.server_closed

    async def aclose(self) -> None:
        self.closed = True


class Pool:
    """Makes the connections, as the client's pool does."""

    def __init__(self) -> None:
        self.made: list[Connection] = []
        self.fail_new: Exception | None = None
        """What each connection made from now on raises when sent a request."""

    def create_connection(self, origin: httpcore2.Origin) -> Connection:
        assert origin == ORIGIN
        self.made.append(Connection(len(self.made)))
        self.made[-1].fail = self.fail_new
        return self.made[-1]


def _connections(pool: Pool, keep: int = 4) -> RunConnections:
    return RunConnections(cast(httpcore2.AsyncConnectionPool, pool), keep=keep, expiry_s=EXPIRY_S)


async def _exchange(connections: RunConnections) -> Connection:
    """One run's exchange: send, then give the connection back."""
    connection, _response = await connections.send(REQUEST)
    await connections.give_back(connection)
    return cast(Connection, connection)


@pytest.fixture
def pool() -> Pool:
    return Pool()


async def test_runs_one_after_another_reuse_one_connection(pool: Pool) -> None:
    connections = _connections(pool)
    used = [await _exchange(connections) for _ in range(3)]
    assert len(pool.made) == 1 and used == [pool.made[0]] * 3
    assert pool.made[0].sent == 3
    assert pool.made[0].probed == 2  # checked once each time it was taken again


async def test_the_connection_used_last_is_taken_first(pool: Pool) -> None:
    connections = _connections(pool)
    first, _ = await connections.send(REQUEST)
    second, _ = await connections.send(REQUEST)  # the first is busy: a new one
    await connections.give_back(first)
    await connections.give_back(second)
    assert await _exchange(connections) is second
    assert cast(Connection, first).probed == 0  # only the one taken is checked


async def test_a_connection_idle_past_the_expiry_is_closed_without_a_probe(
    pool: Pool, mock_clock: MockClock
) -> None:
    connections = _connections(pool)
    old = await _exchange(connections)
    mock_clock.jump(EXPIRY_S + 0.1)
    assert await _exchange(connections) is pool.made[1]
    assert old.closed and old.probed == 0


async def test_a_connection_the_server_closed_is_not_reused(pool: Pool) -> None:
    connections = _connections(pool)
    old = await _exchange(connections)
    old.server_closed = True
    assert await _exchange(connections) is pool.made[1]
    assert old.closed


async def test_a_connection_left_not_idle_is_closed(pool: Pool) -> None:
    connections = _connections(pool)
    connection, _ = await connections.send(REQUEST)
    cast(Connection, connection).idle_after_exchange = False  # e.g. `Connection: close`
    await connections.give_back(connection)
    assert cast(Connection, connection).closed and connections.idle == 0


async def test_at_most_keep_idle_connections_are_kept(pool: Pool) -> None:
    connections = _connections(pool, keep=2)
    busy = [(await connections.send(REQUEST))[0] for _ in range(3)]
    for connection in busy:
        await connections.give_back(connection)
    assert connections.idle == 2
    assert [c.closed for c in pool.made] == [False, False, True]


async def test_a_failed_send_closes_its_connection(pool: Pool) -> None:
    connections = _connections(pool)
    await _exchange(connections)
    pool.made[0].fail = OSError("reset")
    with pytest.raises(OSError, match="reset"):
        await connections.send(REQUEST)
    assert pool.made[0].closed and connections.idle == 0


@pytest.mark.parametrize(
    "lost",
    [
        httpcore2.RemoteProtocolError("Server disconnected without sending a response."),
        httpcore2.ReadError("[Errno 104] Connection reset by peer"),
        httpcore2.WriteError("[Errno 32] Broken pipe"),
    ],
)
async def test_a_reused_connection_lost_before_the_response_is_sent_again_on_a_new_one(
    pool: Pool, lost: Exception
) -> None:
    """The server dropped the idle connection as the request went out (keep-alive
    timeouts racing): the run does not fail, it goes once more on a new connection."""
    connections = _connections(pool)
    await _exchange(connections)
    pool.made[0].fail = lost
    assert await _exchange(connections) is pool.made[1]
    assert pool.made[0].closed and pool.made[1].sent == 1


async def test_a_new_connection_lost_before_the_response_raises(pool: Pool) -> None:
    """Only a reused connection is retried, and only once: a server that drops new
    connections fails the run."""
    connections = _connections(pool)
    await _exchange(connections)
    pool.made[0].fail = pool.fail_new = httpcore2.RemoteProtocolError("Server disconnected")
    with pytest.raises(httpcore2.RemoteProtocolError):
        await connections.send(REQUEST)
    assert len(pool.made) == 2 and all(c.closed for c in pool.made)
    with pytest.raises(httpcore2.RemoteProtocolError):  # a first connection: no retry
        await _connections(pool).send(REQUEST)
    assert len(pool.made) == 3


async def test_a_timeout_on_a_reused_connection_is_not_retried(pool: Pool) -> None:
    """A slow server got the request: sending it again would run it twice."""
    connections = _connections(pool)
    await _exchange(connections)
    pool.made[0].fail = httpcore2.ReadTimeout("timed out")
    with pytest.raises(httpcore2.ReadTimeout):
        await connections.send(REQUEST)
    assert len(pool.made) == 1


async def test_a_cancelled_send_closes_its_connection(pool: Pool) -> None:
    connections = _connections(pool)
    await _exchange(connections)
    pool.made[0].hang = True
    with trio.CancelScope() as scope:
        scope.cancel()  # the run's caller left while the request was on its way
        await connections.send(REQUEST)
    assert scope.cancelled_caught
    assert pool.made[0].closed and connections.idle == 0


async def test_after_aclose_nothing_is_kept(pool: Pool) -> None:
    connections = _connections(pool)
    idle, _ = await connections.send(REQUEST)
    busy, _ = await connections.send(REQUEST)
    await connections.give_back(idle)
    await connections.aclose()
    assert cast(Connection, idle).closed
    await connections.give_back(busy)
    assert cast(Connection, busy).closed and connections.idle == 0


def test_the_stand_ins_have_what_run_connections_uses() -> None:
    """The stand-in covers every connection method `RunConnections` calls, with the
    signatures httpcore2's own connections have."""
    used = {"handle_async_request", "is_idle", "is_available", "has_expired", "aclose"}
    interface: Any = httpcore2.AsyncConnectionInterface
    assert used <= set(dir(interface))
    assert callable(httpcore2.AsyncConnectionPool.create_connection)
