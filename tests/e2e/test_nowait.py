"""The Edge's `*_nowait` methods behave as trio's do: when they cannot act at once they
raise `trio.WouldBlock`, never return a "nothing" value.

Each test reads or writes in a loop with no await in it, so nothing else runs meanwhile:
no event can arrive and no frame can leave while the loop runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from trio.testing import wait_all_tasks_blocked
from trio_websocket import open_websocket_url

from iop_edge.runtime.nodes.session import OUTBOX_SIZE
from iop_edge.runtime.runs.dispatch import CALLER_GONE
from schemas import wire
from tests.e2e.stack import (
    NODE_TOKEN,
    WAIT_GUARD_S,
    chat_stream_plan,
    edge_config,
    sim_provider,
    start_stack,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def _text(tmp_path: Path, adapter: dict[str, float]) -> str:
    return edge_config(
        tmp_path,
        providers=[sim_provider("sim-1", adapter=adapter)],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
    )


async def test_run_next_event_nowait_raises_would_block_when_no_event_is_here(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # 20 tokens a second for a thousand tokens: the run cannot end during the test.
    text = _text(tmp_path, {"ttft_ms": 0, "tokens_per_second": 20})
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1000, "stream": True}
    run = stack.edge.dispatcher.open(chat_stream_plan("nowait-1", body))
    try:
        with trio.fail_after(WAIT_GUARD_S):
            await run.start()
        events: list[bytes | wire.RunDone | wire.RunFailed] = []
        with pytest.raises(trio.WouldBlock):
            for _ in range(1000):
                events.append(run.next_event_nowait())
        assert events, "the first event is here once start() returns"
        assert all(isinstance(event, bytes) for event in events)
        with trio.fail_after(WAIT_GUARD_S):
            assert isinstance(await run.next_event(), bytes)  # the next one comes
    finally:
        run.end(CALLER_GONE)


async def test_session_send_nowait_raises_would_block_when_the_outbox_is_full(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    text = _text(tmp_path, {"ttft_ms": 5, "tokens_per_second": 2000})
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    async with open_websocket_url(stack.addresses.node_url) as node:  # reads nothing more
        hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token=NODE_TOKEN)
        await node.send_message(wire.encode(hello))
        with trio.fail_after(WAIT_GUARD_S):
            assert isinstance(wire.decode_from_edge(await node.get_message()), wire.Welcome)
        session = stack.edge.hub.session("node-1")
        assert session is not None
        await wait_all_tasks_blocked()  # the session's writer waits for its next frame

        queued = 0
        with pytest.raises(trio.WouldBlock):
            for index in range(OUTBOX_SIZE + 2):
                session.send_nowait(
                    wire.Run(
                        run_id=f"r{index}",
                        provider_id="sim-1",
                        target="sim-small",
                        operation="chat",
                        body=b"{}",
                        stream=False,
                    )
                )
                queued += 1
        assert queued == 1 + OUTBOX_SIZE  # one handed to the waiting writer, a full outbox
        # A `cancel` is the one frame that never waits: it is kept aside and sent after
        # the frames ahead of it.
        session.send_nowait(wire.Cancel(run_id="r0"))
        assert session.statistics().pending_cancels == 1
