"""The Node's link against a tiny fake Edge on real loopback sockets (`iop_node.uplink.link`)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import msgspec
import pytest
import trio
import trio.testing
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    wrap_server_stream,
)

from iop_node.adapters.base import Adapter, Emit, RunResult
from iop_node.main import run_node
from iop_node.registry import create_adapter
from iop_node.uplink.backoff import BackoffPolicy
from iop_node.uplink.edges import EdgeLinks
from iop_node.uplink.link import CLOSE_TIMEOUT_S, EdgeRejected
from schemas.config import AdapterSettings, NodeConfig, ProviderConfig
from schemas.wire import (
    FEATURE_PROBE,
    PROTOCOL_VERSION,
    Cancel,
    Hello,
    Message,
    NodeToEdge,
    Probe,
    ProviderStatus,
    Refresh,
    RefreshAck,
    Reject,
    Run,
    RunDone,
    RunEvents,
    RunFailed,
    Status,
    Welcome,
    decode_from_node,
    encode,
)
from tests.timing import GUARD_S

TOKEN = "node-secret-token-value"
T = TypeVar("T")


@dataclass(frozen=True)
class RunChunk:
    """One server-sent event of a run, as the fake Edge unpacks `run_events` batches."""

    run_id: str
    data: bytes
    """The event's JSON payload (without `data: ` and the blank line)."""


Event = NodeToEdge | RunChunk

# Small timings so reconnects and heartbeats happen within a test's time. The deadlines
# that drop a link are generous: a loaded machine can hold an answer back for seconds, and
# a link dropped then is a test failing for nothing. The tests of a silent Edge set their
# own small ones.
FAST: dict[str, Any] = {
    "backoff": BackoffPolicy(
        base_s=0.01, factor=2, cap_s=0.05, stable_after_s=60, reject_delay_s=0.05
    ),
    "rng": random.Random(1),
    "handshake_timeout_s": 20.0,
    "ping_interval_s": 0.05,
    "ping_timeout_s": 20.0,
}
#: The ping timeout of the test that waits for it.
SILENT_EDGE_PING_TIMEOUT_S = 0.5


def _sim(provider_id: str = "sim-a", *, tokens_per_second: float = 1000) -> ProviderConfig:
    return ProviderConfig(
        id=provider_id,
        type="sim",
        models=["sim-small"],
        capacity=4,
        adapter=AdapterSettings(ttft_ms=1, tokens_per_second=tokens_per_second),
    )


CONFIG = NodeConfig(node_id="n1", providers=[_sim()])


def _available(*provider_ids: str) -> Status:
    return Status(
        providers=[
            ProviderStatus(
                id=provider_id, health="available", models=["sim-small"], protocols=["chat"]
            )
            for provider_id in provider_ids
        ]
    )


def _chat_run(run_id: str, provider_id: str = "sim-a", *, stream: bool = True, **body: Any) -> Run:
    request = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], **body}
    return Run(
        run_id=run_id,
        provider_id=provider_id,
        target="sim-small",
        operation="chat",
        body=msgspec.json.encode(request),
        stream=stream,
    )


class EdgeSide:
    """The fake Edge's end of one node connection.

    `receive` hands out one event at a time: `run_events` batches are unpacked into
    their server-sent events (each a `RunChunk`) and run ends, in the order the Edge
    applies them."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.released = trio.Event()
        self.batches = 0
        self._unpacked: deque[Event] = deque()

    async def send(self, message: Message) -> None:
        await self.ws.send_message(encode(message))

    async def receive(self) -> Event:
        while not self._unpacked:
            message = decode_from_node(await self.ws.get_message())
            if not isinstance(message, RunEvents):
                return message
            self.batches += 1
            for run_id, data in message.chunks:
                assert data.startswith(b"data: ") and data.endswith(b"\n\n"), data
                for event in data[len(b"data: ") : -2].split(b"\n\ndata: "):
                    self._unpacked.append(RunChunk(run_id, event))
            self._unpacked.extend(message.ends)
        return self._unpacked.popleft()

    async def expect(self, kind: type[T]) -> T:
        message = await self.receive()
        assert isinstance(message, kind), f"expected {kind.__name__}, got {message!r}"
        return message

    async def welcome(self, config: NodeConfig = CONFIG, *, revision: int = 1) -> Hello:
        hello = await self.expect(Hello)
        await self.send(
            Welcome(
                protocol=PROTOCOL_VERSION,
                edge_id="fake-edge",
                revision=revision,
                node_config=config,
            )
        )
        return hello

    async def run_until_terminal(self, run: Run) -> list[Event]:
        await self.send(run)
        messages = [await self.receive()]
        while not isinstance(messages[-1], RunDone | RunFailed):
            messages.append(await self.receive())
        return messages

    async def close(self, code: int = 1000) -> None:
        """Close as the real Edge does (`iop_edge.runtime.nodes.hub`, `schemas.channel`):
        bounded.
        A Node's ping that crosses our Close makes trio-websocket 0.12's reader fail on
        the pong it may no longer send (trio-websocket#184); the closing handshake then never
        completes, and an unbounded `aclose` would hold the test forever."""
        with trio.move_on_after(0.5):
            await self.ws.aclose(code=code)

    async def wait_closed(self) -> ConnectionClosed:
        with pytest.raises(ConnectionClosed) as info:
            while True:
                await self.ws.get_message()
        return info.value


class FakeEdge:
    """Accepts node websockets on 127.0.0.1 and hands each to the test as an `EdgeSide`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._accepted, self._accepted_out = trio.open_memory_channel[EdgeSide](16)
        self._scope: trio.CancelScope | None = None
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}/"

    async def start(self, nursery: trio.Nursery) -> None:
        self.port = await nursery.start(self._serve, self.port)

    def stop(self) -> None:
        """The Edge process dies: listener and every connection go away."""
        assert self._scope is not None
        self._scope.cancel()

    async def accept(self) -> EdgeSide:
        return await self._accepted_out.receive()

    async def _serve(self, port: int, *, task_status: trio.TaskStatus[int]) -> None:
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                serve = partial(trio.serve_tcp, self._connection, port, host=self.host)
                [listener] = await nursery.start(serve)
                task_status.started(listener.socket.getsockname()[1])

    async def _connection(self, stream: trio.SocketStream) -> None:
        """One node connection, its errors its own, as on the real Edge
        (`iop_edge.runtime.nodes.node_server`): trio-websocket's own server lets a pong it cannot
        send (a Node's ping as we close) end the whole server."""
        with contextlib.suppress(Exception):
            async with trio.open_nursery() as connection:
                request = await wrap_server_stream(connection, stream)
                side = EdgeSide(await request.accept())
                await self._accepted.send(side)
                await side.released.wait()
                connection.cancel_scope.cancel()


class Partition:
    """A TCP proxy in front of the Edge that can stop forwarding its current connections
    (a network partition: nothing is closed, nothing gets through)."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._pipes: list[_Pipe] = []
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self._handle, listeners)

    def freeze(self) -> _Pipe:
        [pipe] = [pipe for pipe in self._pipes if not pipe.client_gone.is_set()]
        pipe.frozen = True
        return pipe

    async def _handle(self, client: trio.SocketStream) -> None:
        pipe = _Pipe()
        self._pipes.append(pipe)
        edge = await trio.open_tcp_stream("127.0.0.1", self._target_port)
        async with client, edge, trio.open_nursery() as nursery:
            nursery.start_soon(pipe.pump, client, edge, nursery.cancel_scope, True)
            nursery.start_soon(pipe.pump, edge, client, nursery.cancel_scope, False)


class _Pipe:
    def __init__(self) -> None:
        self.frozen = False
        self.client_gone = trio.Event()

    async def pump(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        scope: trio.CancelScope,
        from_client: bool,
    ) -> None:
        try:
            async for data in source:
                if not self.frozen:
                    await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        if from_client:
            self.client_gone.set()
        scope.cancel()


@pytest.fixture
async def edge(nursery: trio.Nursery) -> AsyncIterator[FakeEdge]:
    fake = FakeEdge()
    await fake.start(nursery)
    with trio.fail_after(10):  # no test may hang
        yield fake


def _start_node(nursery: trio.Nursery, url: str, **options: Any) -> None:
    nursery.start_soon(partial(run_node, url, "n1", TOKEN, **{**FAST, **options}))


async def test_handshake_then_status(edge: FakeEdge, nursery: trio.Nursery) -> None:
    _start_node(nursery, edge.url, agent_version="iop-node/test")
    side = await edge.accept()
    hello = await side.welcome()
    assert hello == Hello(
        protocol=PROTOCOL_VERSION,
        node_id="n1",
        token=TOKEN,
        agent_version="iop-node/test",
        features=[FEATURE_PROBE],
    )
    assert await side.receive() == _available("sim-a")


async def test_a_probe_is_answered_with_a_status_naming_what_it_probed(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome()
    assert (await side.expect(Status)).probed == []
    await side.send(Probe(providers=["sim-a", "not-here"]))
    answer = await side.expect(Status)
    assert answer == msgspec.structs.replace(_available("sim-a"), probed=["sim-a"])


async def test_started_after_the_first_welcome(edge: FakeEdge, nursery: trio.Nursery) -> None:
    async def edge_script() -> None:
        await (await edge.accept()).welcome()

    nursery.start_soon(edge_script)
    link = await nursery.start(partial(run_node, edge.url, "n1", TOKEN, **FAST))
    assert isinstance(link, EdgeLinks)
    assert link.connected and link.sessions == 1


async def test_run_streams_chunks_then_done(edge: FakeEdge, nursery: trio.Nursery) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)

    messages = await side.run_until_terminal(_chat_run("r1", max_tokens=3))
    *chunks, done = messages
    assert all(isinstance(chunk, RunChunk) and chunk.run_id == "r1" for chunk in chunks)
    assert len(chunks) == 1 + 3 + 1  # role, three tokens, finish
    assert isinstance(done, RunDone) and done.usage is not None
    assert done.usage.completion_tokens == 3

    [done] = await side.run_until_terminal(_chat_run("r2", stream=False, max_tokens=2))
    assert isinstance(done, RunDone) and done.response is not None
    response = msgspec.json.decode(done.response)
    assert response["object"] == "chat.completion"
    assert response["usage"]["completion_tokens"] == 2


async def test_run_on_unknown_provider(edge: FakeEdge, nursery: trio.Nursery) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)
    [failed] = await side.run_until_terminal(_chat_run("r1", provider_id="nope"))
    assert isinstance(failed, RunFailed) and failed.code == "unknown_provider"


async def test_cancel_stops_the_run(edge: FakeEdge, nursery: trio.Nursery) -> None:
    slow = NodeConfig(node_id="n1", providers=[_sim(tokens_per_second=0.1)])
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome(slow)
    await side.expect(Status)
    await side.send(_chat_run("r1", max_tokens=50))
    await side.expect(RunChunk)  # role
    # The first token; the next one is ten seconds away, so the cancel's answer comes
    # first however slow the machine (`expect` fails on any other message).
    await side.expect(RunChunk)
    await side.send(Cancel(run_id="r1"))
    with trio.fail_after(GUARD_S):
        failed = await side.expect(RunFailed)
    assert (failed.run_id, failed.code) == ("r1", "cancelled")


async def test_refresh_swaps_providers_and_acks(edge: FakeEdge, nursery: trio.Nursery) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)

    refreshed = NodeConfig(node_id="n1", providers=[_sim("sim-a"), _sim("sim-b")])
    await side.send(Refresh(revision=2, node_config=refreshed))
    assert await side.receive() == RefreshAck(revision=2, ok=True)
    assert await side.receive() == _available("sim-a", "sim-b")
    [*_, done] = await side.run_until_terminal(_chat_run("r1", provider_id="sim-b"))
    assert isinstance(done, RunDone)


async def test_failed_refresh_keeps_the_old_registry(edge: FakeEdge, nursery: trio.Nursery) -> None:
    def factory(provider: ProviderConfig) -> Adapter:
        if provider.id == "broken":
            raise ValueError("cannot reach upstream")
        return create_adapter(provider)

    _start_node(nursery, edge.url, adapter_factory=factory)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)

    candidate = NodeConfig(node_id="n1", providers=[_sim("sim-a"), _sim("broken")])
    await side.send(Refresh(revision=2, node_config=candidate))
    ack = await side.expect(RefreshAck)
    assert (ack.revision, ack.ok) == (2, False)
    assert ack.error is not None and "broken" in ack.error and "cannot reach upstream" in ack.error

    other_node = NodeConfig(node_id="n2", providers=[_sim("sim-a")])
    await side.send(Refresh(revision=3, node_config=other_node))
    ack = await side.expect(RefreshAck)
    assert not ack.ok and ack.error is not None and "'n2'" in ack.error

    [*_, done] = await side.run_until_terminal(_chat_run("r1"))
    assert isinstance(done, RunDone)


async def test_welcome_that_cannot_be_built_reports_unavailable(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    def factory(provider: ProviderConfig) -> Adapter:
        raise ValueError("no such binary")

    _start_node(nursery, edge.url, adapter_factory=factory)
    side = await edge.accept()
    await side.welcome()
    status = await side.expect(Status)
    [provider] = status.providers
    assert (provider.id, provider.health) == ("sim-a", "unavailable")
    assert provider.detail is not None and "no such binary" in provider.detail
    [failed] = await side.run_until_terminal(_chat_run("r1"))
    assert isinstance(failed, RunFailed) and failed.code == "unknown_provider"


async def test_reject_is_logged_and_retried_with_backoff(
    edge: FakeEdge, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.expect(Hello)
    await side.send(Reject(code="bad_token", reason="the node token does not match"))
    await side.close(code=1008)
    rejected_at = trio.current_time()

    again = await edge.accept()
    # A rejected node waits at least half the reject delay before it tries again.
    assert trio.current_time() - rejected_at >= FAST["backoff"].reject_delay_s / 2
    await again.welcome()
    assert await again.receive() == _available("sim-a")
    assert "the node token does not match" in caplog.text
    assert TOKEN not in caplog.text


async def test_edge_restart_node_reconnects(edge: FakeEdge, nursery: trio.Nursery) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)

    edge.stop()
    await edge.start(nursery)  # a new Edge process on the same address

    side = await edge.accept()
    await side.welcome(revision=7)
    assert await side.receive() == _available("sim-a")
    [*_, done] = await side.run_until_terminal(_chat_run("r1"))
    assert isinstance(done, RunDone)


async def test_edge_closing_the_connection_makes_the_node_reconnect(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)
    await side.close()
    await (await edge.accept()).welcome()


@pytest.mark.parametrize("frame", [b"\xc1 not msgpack", "a text frame"])
async def test_malformed_frame_rejects_and_reconnects(
    edge: FakeEdge, nursery: trio.Nursery, frame: bytes | str
) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)
    await side.ws.send_message(frame)
    reject = await side.expect(Reject)
    assert reject.code == "bad_frame"
    closed = await side.wait_closed()
    assert closed.reason is not None and closed.reason.code == 1002

    again = await edge.accept()
    await again.welcome()
    assert await again.receive() == _available("sim-a")


async def test_a_ping_that_finds_our_close_begun_does_not_cut_it(
    edge: FakeEdge, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Node's keepalive may ping just as its writer starts the closing handshake: the
    ping is refused (`ConnectionClosed`) while the Close waits its turn to be sent. That
    is no reason to end the session, whose ending would cancel the Close unsent (the Edge
    then saw 1006 instead of 1002). Here every ping of the Node waits for its own close
    to begin; which of the two runs first is Trio's choice, so a few rounds are tried."""
    ping = WebSocketConnection.ping
    pinging = trio.Event()

    async def ping_once_closing(ws: WebSocketConnection, payload: bytes | None = None) -> None:
        pinging.set()
        while ws.closed is None:
            await trio.lowlevel.checkpoint()
        await ping(ws, payload)

    monkeypatch.setattr(WebSocketConnection, "ping", ping_once_closing)
    _start_node(nursery, edge.url)
    for _ in range(6):
        side = await edge.accept()
        await side.welcome()
        await side.expect(Status)
        await pinging.wait()
        pinging = trio.Event()
        await side.ws.send_message(b"\xc1 not msgpack")
        await side.expect(Reject)
        closed = await side.wait_closed()
        assert closed.reason is not None and closed.reason.code == 1002


async def test_welcome_with_another_protocol_is_rejected(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    _start_node(nursery, edge.url)
    side = await edge.accept()
    await side.expect(Hello)
    await side.send(
        Welcome(protocol=PROTOCOL_VERSION + 1, edge_id="e", revision=1, node_config=CONFIG)
    )
    reject = await side.expect(Reject)
    assert reject.code == "protocol_version"
    await (await edge.accept()).welcome()


async def test_silent_edge_is_dropped_and_the_node_reconnects(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    partition = Partition(edge.port)
    await partition.start(nursery)
    _start_node(
        nursery,
        f"ws://127.0.0.1:{partition.port}/",
        ping_timeout_s=SILENT_EDGE_PING_TIMEOUT_S,
    )
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)

    pipe = partition.freeze()
    frozen_at = trio.current_time()
    await pipe.client_gone.wait()
    # Dropped after the ping timeout (counted from a ping that may have left just before
    # the freeze), without waiting for a closing handshake the Edge cannot answer (that
    # would take CLOSE_TIMEOUT_S more).
    silent_for = trio.current_time() - frozen_at
    assert SILENT_EDGE_PING_TIMEOUT_S - 0.05 <= silent_for < 0.5 + CLOSE_TIMEOUT_S

    again = await edge.accept()
    await again.welcome()
    assert await again.receive() == _available("sim-a")


async def test_an_edge_that_sends_no_welcome_is_named_so_and_dropped(
    edge: FakeEdge, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that takes the websocket and the hello but answers nothing is reported as
    such (not as an unreachable address), and dropped without waiting for a Close it
    will not answer either (`CLOSE_TIMEOUT_S`)."""
    partition = Partition(edge.port)
    await partition.start(nursery)
    url = f"ws://127.0.0.1:{partition.port}/"
    _start_node(nursery, url, handshake_timeout_s=0.2)
    silent = await edge.accept()
    await silent.expect(Hello)
    partition.freeze()  # nothing more gets through: no welcome, no answer to a Close
    heard_at = trio.current_time()
    again = await edge.accept()
    assert trio.current_time() - heard_at < 0.2 + CLOSE_TIMEOUT_S  # no Close waited for
    await again.welcome()
    assert await again.receive() == _available("sim-a")
    assert f"edge {url} took the connection but sent no welcome within 0.2s" in caplog.text
    assert "unreachable" not in caplog.text


async def test_graceful_stop_drains_then_closes(edge: FakeEdge, nursery: trio.Nursery) -> None:
    stop = trio.Event()
    finished = trio.Event()
    config = NodeConfig(node_id="n1", providers=[_sim(tokens_per_second=50)])

    async def node() -> None:
        await run_node(edge.url, "n1", TOKEN, shutdown_trigger=stop.wait, **FAST)
        finished.set()

    nursery.start_soon(node)
    side = await edge.accept()
    await side.welcome(config)
    await side.expect(Status)
    await side.send(_chat_run("r1", max_tokens=10))
    await side.expect(RunChunk)

    stop.set()
    messages: list[NodeToEdge] = []
    refused_sent = False
    with pytest.raises(ConnectionClosed) as info:
        while True:
            message = await side.receive()
            messages.append(message)
            if isinstance(message, Status) and not refused_sent:
                await side.send(_chat_run("r2"))
                refused_sent = True
    assert info.value.reason is not None and info.value.reason.code == 1001
    await finished.wait()

    [status] = [message for message in messages if isinstance(message, Status)]
    assert [(p.id, p.health, p.detail) for p in status.providers] == [
        ("sim-a", "draining", "node is shutting down: finishing its runs, taking no new ones")
    ]
    [refused] = [m for m in messages if isinstance(m, RunFailed)]
    assert (refused.run_id, refused.code, refused.retryable) == ("r2", "node_stopping", True)
    [done] = [m for m in messages if isinstance(m, RunDone)]
    assert done.run_id == "r1" and done.usage is not None and done.usage.completion_tokens == 10
    assert isinstance(messages[-1], RunDone)  # the drained run is the last thing sent


async def test_cli_process_stops_gracefully_on_sigterm(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    """The real `iop-node run` process: connects, serves, drains on SIGTERM, exits 0."""
    command = [
        sys.executable,
        "-m",
        "iop_node",
        "run",
        "--edge",
        edge.url,
        "--node-id",
        "n1",
        "--log-level",
        "debug",
    ]
    environment = {**os.environ, "IOP_NODE_TOKEN": TOKEN}
    process = await trio.lowlevel.open_process(
        command, env=environment, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert process.stderr is not None
    stderr = bytearray()

    async def collect_stderr(stream: trio.abc.ReceiveStream) -> None:
        async for data in stream:
            stderr.extend(data)

    try:
        async with trio.open_nursery() as collector:
            collector.start_soon(collect_stderr, process.stderr)
            side = await edge.accept()
            hello = await side.welcome(
                NodeConfig(node_id="n1", providers=[_sim(tokens_per_second=50)])
            )
            assert hello.token == TOKEN
            await side.expect(Status)
            await side.send(_chat_run("r1", max_tokens=10))
            await side.expect(RunChunk)

            process.send_signal(signal.SIGTERM)
            messages: list[NodeToEdge] = []
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    messages.append(await side.receive())
            assert info.value.reason is not None and info.value.reason.code == 1001
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(5, shield=True):
                await process.wait()
    assert isinstance(messages[-1], RunDone)
    assert any(isinstance(message, Status) for message in messages)
    log_text = stderr.decode()
    assert "SIGTERM: draining active runs" in log_text
    assert TOKEN not in log_text


# --- batched writes ------------------------------------------------------------------------


class _BurstAdapter:
    """Emits `chunks` chunks back to back, as a fast upstream's stream does."""

    def __init__(self, provider: ProviderConfig, chunks: int = 200) -> None:
        self.provider = provider
        self._chunks = chunks

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        for index in range(self._chunks):
            await emit(b'{"run": "%s", "index": %d}' % (run.run_id.encode(), index))
        return RunResult()

    async def probe(self) -> ProviderStatus:
        return ProviderStatus(id=self.provider.id, health="available", models=["sim-small"])

    async def aclose(self) -> None:
        pass


async def test_bursts_of_chunks_arrive_whole_and_in_order(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    """Chunks that queue up faster than the socket takes them travel together in
    `run_events` batches (chunks of several runs in one message), every run's in order."""
    _start_node(nursery, edge.url, adapter_factory=_BurstAdapter)
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)

    run_ids = [f"r{i}" for i in range(3)]
    for run_id in run_ids:
        await side.send(_chat_run(run_id))
    chunks: dict[str, list[bytes]] = {run_id: [] for run_id in run_ids}
    done: set[str] = set()
    while done != set(run_ids):
        message = await side.receive()
        if isinstance(message, RunChunk):
            chunks[message.run_id].append(message.data)
        else:
            assert isinstance(message, RunDone)
            done.add(message.run_id)
    for run_id in run_ids:
        assert [msgspec.json.decode(c)["index"] for c in chunks[run_id]] == list(range(200))
    assert side.batches < 3 * 200 // 2  # batched: far fewer messages than chunks


@pytest.mark.parametrize("code", ["bad_token", "unknown_node", "unsupported_protocol"])
async def test_permanent_rejection_gives_up_after_a_few_tries(
    edge: FakeEdge, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Node the Edge keeps refusing for good stops with `EdgeRejected` (the CLI exits 3),
    and the message says what to fix."""
    tries = FAST["backoff"].max_rejections

    async def edge_script() -> None:
        for _ in range(tries):
            side = await edge.accept()
            await side.expect(Hello)
            await side.send(Reject(code=code, reason=f"refused: {code}"))
            await side.close(code=1008)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(edge_script)
            with pytest.raises(EdgeRejected) as rejected:
                await run_node(edge.url, "n1", TOKEN, **FAST)
    assert rejected.value.code == code
    message = str(rejected.value)
    assert f"refused node 'n1' {tries} time(s): refused: {code} ({code})" in message
    assert edge.url in message and "To fix:" in message
    assert TOKEN not in message + caplog.text


async def test_transient_rejection_keeps_retrying(edge: FakeEdge, nursery: trio.Nursery) -> None:
    _start_node(nursery, edge.url)
    for _ in range(FAST["backoff"].max_rejections + 1):
        side = await edge.accept()
        await side.expect(Hello)
        await side.send(Reject(code="handshake_timeout", reason="too slow"))
        await side.close(code=1008)
    await (await edge.accept()).welcome()


async def test_replaced_session_is_a_permanent_rejection(
    edge: FakeEdge, caplog: pytest.LogCaptureFixture
) -> None:
    """The Edge ends a session with `reject{node_replaced}` when another connection took
    the node id: the Node says so, backs off, and stops fighting after a few rounds."""
    tries = FAST["backoff"].max_rejections
    reason = "a new connection for node id 'n1' replaced this one"

    async def edge_script() -> None:
        for _ in range(tries):
            side = await edge.accept()
            await side.welcome()
            await side.expect(Status)
            await side.send(Reject(code="node_replaced", reason=reason))
            await side.close(code=1008)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(edge_script)
            with pytest.raises(EdgeRejected) as rejected:
                await run_node(edge.url, "n1", TOKEN, **FAST)
    assert rejected.value.code == "node_replaced"
    assert "another Node connected with the same node id" in str(rejected.value)
    assert "edge ended the session: a new connection for node id 'n1'" in caplog.text


async def test_backoff_is_fast_after_a_healthy_session(
    edge: FakeEdge, nursery: trio.Nursery
) -> None:
    """A Node that started before its Edge (failures grew the backoff to the cap) comes
    back within the fast retries after its healthy link drops (the Edge restarted)."""
    # Without the fast retries, one failed attempt during the restart would mean 10 s.
    policy = BackoffPolicy(base_s=0.01, factor=1000, cap_s=60, stable_after_s=0, fast_retries=50)
    _start_node(nursery, edge.url, backoff=policy, rng=random.Random(3))
    side = await edge.accept()
    await side.welcome()
    await side.expect(Status)
    edge.stop()
    lost_at = trio.current_time()
    await edge.start(nursery)
    with trio.fail_after(GUARD_S):
        again = await edge.accept()
    assert trio.current_time() - lost_at < 5.0  # the backoff's next step would be 10 s
    await again.welcome()
