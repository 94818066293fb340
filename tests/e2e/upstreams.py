"""Stacks whose Node relays to a fake OpenAI-compatible upstream, for the end-to-end tests of
upstream adapters (`test_upstream*.py`, `test_runtime_realism.py`): provider settings with
small timeouts, a factory of stacks (the `make_stack` fixture of `conftest.py`), an
upstream that can be stopped and restarted on its port, and catalog and metrics readers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import trio
from openai.types.chat import ChatCompletionMessageParam

from iop_node.registry import create_adapter
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack, edge_config, start_stack
from tests.timing import GUARD_S

ALIAS = "qwen-alias"
SERVED = "fake-model"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def fast_adapter(base_url: str, **overrides: Any) -> dict[str, Any]:
    """Adapter settings for a fake upstream on this machine. Its timeouts only end what
    hangs: a loaded machine may take seconds for a first byte, and a run cut then is a
    test failing for nothing. A test of a timeout sets its own (small) one."""
    return {
        "base_url": base_url,
        "request_timeout_s": 60.0,
        "first_byte_timeout_s": 30.0,
        "connect_timeout_s": 10.0,
        "health_interval_s": 30.0,
        **overrides,
    }


def upstream_provider(
    provider_id: str,
    base_url: str,
    *,
    type: str = "vllm",
    served: str = SERVED,
    capacity: int = 4,
    priority: int = 100,
    **adapter: Any,
) -> dict[str, Any]:
    """A provider of an OpenAI-compatible `type` relaying to `base_url`."""
    return {
        "id": provider_id,
        "type": type,
        "models": [served],
        "capacity": capacity,
        "priority": priority,
        "adapter": fast_adapter(base_url, **adapter),
    }


class MakeStack(Protocol):
    """Starts an Edge and one Node with `providers` (see `upstream_stacks`)."""

    async def __call__(
        self,
        providers: list[dict[str, Any]],
        *,
        models: list[dict[str, Any]] | None = None,
        dispatch: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> Stack: ...


@asynccontextmanager
async def upstream_stacks(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[MakeStack]:
    """A factory of stacks, for a fixture: `models` default to `ALIAS` served by every
    provider (its first model); `wait`: return once every model is servable. The Node
    allows the commands of its `cli` providers, as their operator would.

    On exit the Nodes are stopped first, so the Edge does not spend its websocket close
    grace waiting for Nodes that are being cancelled along with it.
    """
    made: list[Stack] = []

    async def make(
        providers: list[dict[str, Any]],
        *,
        models: list[dict[str, Any]] | None = None,
        dispatch: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> Stack:
        if models is None:
            models = [{"id": ALIAS, "providers": {p["id"]: p["models"][0] for p in providers}}]
        text = edge_config(
            tmp_path / f"state-{len(made)}", providers=providers, models=models, dispatch=dispatch
        )
        commands = frozenset(
            tuple(p["adapter"]["command"]) for p in providers if p["type"] == "cli"
        )
        stack = await start_stack(
            nursery,
            text,
            tmp_path / f"edge-{len(made)}.yaml",
            wait_models=tuple(m["id"] for m in models) if wait else (),
            node_kwargs={"adapter_factory": partial(create_adapter, allowed_commands=commands)},
        )
        made.append(stack)
        return stack

    yield make
    for stack in made:
        for node_id in list(stack.node_scopes):
            stack.kill_node(node_id)
        await stack.wait_catalog(lambda c: not any(p["connected"] for p in c["providers"]))


@dataclass
class RunningUpstream:
    """A fake upstream served by a task the test can stop (and restart on the same port)."""

    fake: FakeUpstream
    nursery: trio.Nursery
    base_url: str = ""
    port: int = 0
    _scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    _stopped: trio.Event = field(default_factory=trio.Event)

    async def start(self) -> str:
        """Listen on `port` (0 = any free one, the first time); returns the `/v1` base URL."""
        self._scope, self._stopped = trio.CancelScope(), trio.Event()
        self.base_url = await self.nursery.start(self._serve)
        self.port = int(self.fake.root_url.rsplit(":", 1)[1])
        return self.base_url

    async def stop(self) -> None:
        """Close the listener and every open connection, as a crashed server would."""
        self._scope.cancel()
        await self._stopped.wait()

    async def _serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        try:
            with self._scope:
                if not self.port:
                    await self.fake.serve(task_status=task_status)
                    return
                # Same port again: the fake's `serve` always picks a new one.
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                self.fake.root_url = f"http://127.0.0.1:{self.port}"
                task_status.started(self.fake.base_url)
                await trio.serve_listeners(self.fake._serve_connection, listeners)
        finally:
            self._stopped.set()


def posts(fake: FakeUpstream) -> list[dict[str, Any]]:
    """The JSON bodies of the inference requests the upstream received, oldest first."""
    return [json.loads(r.body) for r in fake.requests if r.method == "POST"]


def provider_of(catalog: dict[str, Any], provider_id: str) -> dict[str, Any]:
    return next(p for p in catalog["providers"] if p["id"] == provider_id)


def all_idle(catalog: dict[str, Any]) -> bool:
    return all(p["in_flight"] == 0 and p["long_in_flight"] == 0 for p in catalog["providers"])


async def wait_idle(stack: Stack, within_s: float = GUARD_S) -> None:
    """Every slot is back (design §4 item 7: released exactly once, promptly: on the run's
    end, which is what this waits for; `within_s` only bounds a hang)."""
    with trio.fail_after(within_s):
        await stack.wait_catalog(all_idle)


def metered(stack: Stack, provider_id: str, kind: str, model: str = ALIAS) -> float:
    """Tokens of `kind` (prompt/completion) the Edge metered for anonymous callers."""
    labels = {
        "principal_ref": "anonymous",
        "token_ref": "anonymous",
        "model": model,
        "provider": provider_id,
        "kind": kind,
    }
    stack.edge.books.settle()  # the metrics of runs that ended are entered in batches
    value = stack.edge.metrics.registry.get_sample_value("iop_tokens_total", labels)
    return value or 0.0


def extra(model: Any) -> dict[str, Any]:
    """The fields an SDK object carries beyond OpenAI's schema (provider extensions)."""
    return dict(model.model_extra or {})
