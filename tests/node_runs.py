"""One run through the Node's runner (`iop_node.runs.runner.execute_run`), as the link runs it,
and what the Edge gets back: the caller-ready chunks and the terminal message; and the
server-sent events those chunks carry, for the caller protocols' streams."""

from __future__ import annotations

import json
from typing import Any

import trio

from iop_node.adapters.base import Adapter
from iop_node.runs.runner import Chunk, Outbound, RunHandle, execute_run
from schemas.wire import Run, RunDone, RunFailed
from tests.timing import GUARD_S

__all__ = ["run_to_end", "sse_events"]


async def run_to_end(adapter: Adapter, run: Run) -> tuple[list[bytes], RunDone | RunFailed]:
    """Run `run` through `adapter` to its end: the chunks' payloads, and the terminal
    message (the last thing sent, and the only one that is not a chunk)."""
    sent: list[Outbound] = []

    async def send(message: Outbound) -> None:
        sent.append(message)

    with trio.fail_after(GUARD_S):
        await execute_run(run, adapter, RunHandle(run.run_id), send)
    *chunks, end = sent
    assert all(isinstance(chunk, Chunk) for chunk in chunks)
    assert isinstance(end, RunDone | RunFailed)
    return [chunk.data for chunk in chunks if isinstance(chunk, Chunk)], end


def sse_events(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """The server-sent events in `chunks`, each `event: NAME` and one `data:` line."""
    found = []
    for block in b"".join(chunks).split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            assert name.startswith(b"event: ") and data.startswith(b"data: "), block
            found.append((name[7:].decode(), json.loads(data[6:])))
    return found
