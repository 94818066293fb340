"""A caller that stops reading must not stall the other runs of its Node (hub Rule 4)."""

from __future__ import annotations

from pathlib import Path

import httpx2
import trio

from iop_node.adapters.sim import MAX_TOKENS
from tests.e2e.stack import edge_config, sim_provider, start_stack

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_stalled_reader_loses_its_run_and_others_flow(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fast = {"ttft_ms": 0, "tokens_per_second": 1_000_000}
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-1", capacity=4, adapter=fast)],
        models=[
            {
                "id": "m",
                "providers": {"sim-1": "sim-small"},
                "generation": {"max_tokens_limit": MAX_TOKENS},
            }
        ],
    )
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
