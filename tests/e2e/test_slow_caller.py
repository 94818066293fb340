"""A caller that stops reading must not stall the other runs of its Node (hub Rule 4)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio

from iop_node.adapters.sim.adapter import MAX_TOKENS
from tests.e2e.stack import WAIT_GUARD_S, edge_config, sim_provider, start_stack

MESSAGES = [{"role": "user", "content": "hi"}]
CONNECTION_LOGGER = "iop_edge.http.connection"


def _fast_stream_config(tmp_path: Path, **sections: Any) -> str:
    """One sim provider as fast as it goes, its streams as long as it allows: a caller
    that stops reading fills every buffer on the way at once."""
    fast = {"ttft_ms": 0, "tokens_per_second": 1_000_000}
    return edge_config(
        tmp_path,
        providers=[sim_provider("sim-1", capacity=4, adapter=fast)],
        models=[
            {
                "id": "m",
                "providers": {"sim-1": "sim-small"},
                "generation": {"max_tokens_limit": MAX_TOKENS},
            }
        ],
        **sections,
    )


async def test_stalled_reader_loses_its_run_and_others_flow(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    text = _fast_stream_config(tmp_path)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    body = {"model": "m", "stream": True, "max_tokens": MAX_TOKENS, "messages": MESSAGES}
    async with (
        httpx2.AsyncClient(base_url=stack.addresses.openai_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as stalled,
    ):
        assert stalled.status_code == 200
        # Read nothing. Socket buffers fill, the run's buffer fills, and the Edge
        # cancels that run on the Node (freeing its slot) instead of blocking its reader.
        await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 0)
        async with stack.client() as client:
            reply = await client.chat.completions.create(model="m", max_tokens=5, messages=MESSAGES)
        assert reply.usage is not None and reply.usage.completion_tokens == 5


class LogHeard(logging.Handler):
    """Sets `heard` once a record whose message contains `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text = text
        self.heard = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.heard.set()


async def test_a_caller_that_takes_nothing_is_disconnected_after_the_send_timeout(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`openai.send_timeout_s` bounds how long a reply's write waits on a caller that
    reads nothing: then the Edge closes the connection, and the caller, reading at last,
    finds the stream cut (no last chunk)."""
    text = _fast_stream_config(tmp_path, openai_section={"send_timeout_s": 0.2})
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    body = {"model": "m", "stream": True, "max_tokens": MAX_TOKENS, "messages": MESSAGES}
    caplog.set_level(logging.INFO, logger=CONNECTION_LOGGER)
    disconnected = LogHeard("caller took nothing for 0.2s: disconnected")
    logging.getLogger(CONNECTION_LOGGER).addHandler(disconnected)
    try:
        async with (
            httpx2.AsyncClient(base_url=stack.addresses.openai_url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as stalled,
        ):
            assert stalled.status_code == 200
            await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 0)
            with trio.fail_after(WAIT_GUARD_S):
                await disconnected.heard.wait()
            with pytest.raises(httpx2.RemoteProtocolError):
                async for _ in stalled.aiter_raw():
                    pass
    finally:
        logging.getLogger(CONNECTION_LOGGER).removeHandler(disconnected)
