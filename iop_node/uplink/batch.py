"""Run events of one writer pass, packed into one `run_events` message (design §3).

A websocket message costs the Edge a parse, a scheduling pass and a wake-up of every
run it touches, whatever its size; so the Node's writer sends everything it finds queued
in one pass as one message instead of one message per token.

Rules:
1. Chunks of one run are joined in the order they were queued; a run appears once in
   `chunks`, in the order of its first chunk.
2. Run ends (`run_done`, `run_failed`) go in `ends`, in order; the Edge applies them after
   the chunks, and a run's end is always queued after its last chunk, so order within a
   run holds.
3. A batch is `full` once it holds `MAX_BATCH_BYTES` of payload: the writer sends it and
   starts another. One item larger than that still travels (alone in its batch).
4. Anything else (status, refresh acks) is not a run event: `add` says so and the
   writer sends it as its own message.
"""

from __future__ import annotations

from typing import Final

from iop_node.runs.runner import Chunk, Outbound
from schemas.wire import RunDone, RunEvents, RunFailed

__all__ = ["MAX_BATCH_BYTES", "RunEventBatch"]

MAX_BATCH_BYTES: Final = 256 * 1024


class RunEventBatch:
    """Collects run events for one `run_events` message (see the module docstring)."""

    __slots__ = ("_chunks", "_ends", "_size")

    def __init__(self) -> None:
        self._chunks: dict[str, list[bytes]] = {}
        self._ends: list[RunDone | RunFailed] = []
        self._size = 0

    def add(self, item: Outbound) -> bool:
        """Take `item` if it is a run event (Rules 1-2); False when it is not (Rule 4)."""
        match item:
            case Chunk(run_id=run_id, data=data):
                parts = self._chunks.get(run_id)
                if parts is None:
                    self._chunks[run_id] = [data]
                else:
                    parts.append(data)
                self._size += len(data)
            case RunDone(response=response, tail=tail):
                self._ends.append(item)
                self._size += len(response or b"") + len(tail or b"")
            case RunFailed():
                self._ends.append(item)
            case _:
                return False
        return True

    @property
    def full(self) -> bool:
        return self._size >= MAX_BATCH_BYTES

    def __bool__(self) -> bool:
        return bool(self._chunks or self._ends)

    def message(self) -> RunEvents:
        chunks = [
            (run_id, parts[0] if len(parts) == 1 else b"".join(parts))
            for run_id, parts in self._chunks.items()
        ]
        return RunEvents(chunks=chunks, ends=self._ends)
