"""Whatever it is asked, the sim engine neither blocks the Node's event loop nor grows
without bound: it refuses what exceeds its context, as an engine does.
And the Node's own config file cannot be built to hurt it either."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from iop_node.adapters.base import AdapterError
from iop_node.adapters.sim.adapter import (
    MAX_EMBEDDING_INPUTS,
    MAX_EMBEDDING_VALUES,
    MAX_TOKENS,
    SimAdapter,
)
from iop_node.cli import UsageError, build_parser, resolve_invocation
from iop_node.runs.runner import MAX_FAILURE_TEXT, RunHandle, execute_run
from iop_node.uplink.link_session import _bounded_frame
from schemas.config import AdapterSettings, ProviderConfig
from schemas.limits import MAX_FRAME_BYTES
from schemas.wire import (
    FailureCode,
    Operation,
    ProviderStatus,
    Run,
    RunFailed,
    Status,
    decode_from_node,
)


def _adapter() -> SimAdapter:
    provider = ProviderConfig(
        id="sim", type="sim", models=["s"], capacity=1,
        adapter=AdapterSettings(ttft_ms=0, tokens_per_second=1e9),
    )  # fmt: skip
    return SimAdapter(provider)


def _run(body: dict[str, Any], operation: Operation = "chat", stream: bool = False) -> Run:
    return Run(
        run_id="r", provider_id="sim", target="s", operation=operation,
        body=msgspec.json.encode({"model": "s", **body}), stream=stream,
    )  # fmt: skip


async def _ignore(data: bytes) -> None:
    pass


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_past_the_context_is_refused(key: str, stream: bool) -> None:
    with pytest.raises(AdapterError) as refused:
        await _adapter().execute(_run({"messages": MESSAGES, key: 10**9}, stream=stream), _ignore)
    assert refused.value.code == FailureCode.INVALID_REQUEST and refused.value.status == 400
    assert str(MAX_TOKENS) in refused.value.message


async def test_the_largest_run_yields_while_it_generates() -> None:
    """At the context's full length, a stream still lets other tasks run between tokens."""
    ticks = 0

    async def other_task() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        run = _run({"messages": MESSAGES, "max_tokens": 2000}, stream=True)
        await _adapter().execute(run, _ignore)
        nursery.cancel_scope.cancel()
    assert ticks >= 2000


async def test_embedding_batches_are_bounded() -> None:
    too_many = {"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}
    too_large = {"input": ["x"] * 300, "dimensions": 4096}
    assert MAX_EMBEDDING_VALUES < 300 * 4096
    for body in (too_many, too_large):
        with pytest.raises(AdapterError) as refused:
            await _adapter().execute(_run(body, operation="embedding"), _ignore)
        assert refused.value.code == FailureCode.INVALID_REQUEST


def test_a_node_config_file_built_to_hurt_is_a_usage_error(tmp_path: Path) -> None:
    """The Node's `--config` YAML is read as boundedly as the Edge's."""
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    config = tmp_path / "node.yaml"
    for text in ("\n".join(bomb) + "\nedge: *a8\n", "edge: " + "[" * 5000):
        config.write_text(text)
        with pytest.raises(UsageError, match="not valid YAML"):
            resolve_invocation(build_parser().parse_args(["run", "--config", str(config)]), {})
    config.write_bytes(b"edge: \xff\xfe\n")
    with pytest.raises(UsageError, match="not UTF-8"):
        resolve_invocation(build_parser().parse_args(["run", "--config", str(config)]), {})


def test_the_node_never_sends_a_frame_the_edge_would_drop_the_link_for() -> None:
    """Whatever produced it, a message past the wire's limit leaves as a small one (item 3:
    one message must not cost every run): a status as an empty one; a run's failure text
    is bounded where the run ends, so a batch of run ends stays far below the limit."""
    huge = "x" * (MAX_FRAME_BYTES + 1)
    status = Status(providers=[ProviderStatus(id="p", health="available", detail=huge)])
    assert decode_from_node(_bounded_frame(status)) == Status(providers=[])
    small = Status(providers=[ProviderStatus(id="p", health="available")])
    assert decode_from_node(_bounded_frame(small)) == small


async def test_a_huge_failure_text_is_bounded_where_the_run_ends() -> None:
    async def failing(run: Run, emit: Any) -> Any:
        raise AdapterError(FailureCode.UPSTREAM_ERROR, "x" * (MAX_FRAME_BYTES + 1))

    class Failing:
        provider = _adapter().provider
        execute = staticmethod(failing)

    sent: list[Any] = []

    async def send(item: Any) -> None:
        sent.append(item)

    await execute_run(_run({"messages": MESSAGES}), Failing(), RunHandle("r"), send)  # type: ignore[arg-type]
    [failed] = sent
    assert isinstance(failed, RunFailed) and len(failed.message) <= MAX_FAILURE_TEXT
