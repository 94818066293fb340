"""A real Edge and real Nodes in-process, on 127.0.0.1 port 0, for end-to-end tests.

`Stack` owns nothing itself: the test's nursery (pytest-trio's `nursery` fixture) owns the
Edge and Node tasks, so they are cancelled when the test ends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import openai
import trio
import yaml
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Request

from iop_edge.core.configuration.config import parse_config
from iop_edge.edge import Edge, EdgeAddresses
from iop_edge.runtime.lifecycle import admin_credential
from iop_edge.runtime.runs.dispatch import RunPlan
from iop_node.main import run_node
from schemas import wire
from tests.adapters.fake_upstream import FakeUpstream
from tests.timing import GUARD_S

NODE_TOKEN = "test-node-token-not-a-secret"
#: Upper bound for event-driven waits (the e2e modules' name for `tests.timing.GUARD_S`).
WAIT_GUARD_S = GUARD_S
NODE_TOKEN_HASH = hashlib.sha256(NODE_TOKEN.encode()).hexdigest()
#: The TLS context of the clients `Stack` makes. Their URLs are plain HTTP on loopback,
#: but a client that builds its own context loads the trust store for it: about 30 ms of
#: CPU, hundreds of times a run.
CLIENT_TLS = httpx2.create_ssl_context()


def admin_headers(state_dir: Path) -> dict[str, str]:
    """The `Authorization` an admin change presents: the credential the Edge keeps in
    `state_dir` (made at its first start)."""
    token = admin_credential.read(state_dir / admin_credential.ADMIN_TOKEN_FILE)
    return {"authorization": f"Bearer {token}"}


def edge_config(
    state_dir: Path,
    *,
    providers: list[dict[str, Any]],
    models: list[dict[str, Any]],
    dispatch: dict[str, Any] | None = None,
    openai_section: dict[str, Any] | None = None,
    extra_nodes: list[dict[str, Any]] | None = None,
    node_id: str = "node-1",
    edge_section: dict[str, Any] | None = None,
) -> str:
    """An Edge config (YAML text) with every listener on 127.0.0.1 port 0."""
    config: dict[str, Any] = {
        "edge": {
            "id": "edge-test",
            "listen": "127.0.0.1:0",
            "state_dir": str(state_dir),
            **(edge_section or {}),
        },
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0", **(openai_section or {})},
        "models": models,
        "nodes": [
            {"id": node_id, "token_hash_sha256": NODE_TOKEN_HASH, "providers": providers},
            *(extra_nodes or []),
        ],
    }
    if dispatch is not None:
        config["dispatch"] = dispatch
    return yaml.safe_dump(config, sort_keys=False)


def sim_provider(
    provider_id: str, *, capacity: int = 4, served: str = "sim-small", **extra: Any
) -> dict[str, Any]:
    adapter = extra.pop("adapter", {"ttft_ms": 5, "tokens_per_second": 2000})
    return {
        "id": provider_id,
        "type": "sim",
        "models": [served],
        "capacity": capacity,
        "adapter": adapter,
        **extra,
    }


def principals_section(tokens: Mapping[str, str]) -> dict[str, Any]:
    """An `openai` section giving each principal (by name) its caller token; the name is
    its `token_ref` and its `principal_ref` both."""
    return {
        "principal_tokens": [
            {
                "token_ref": name,
                "principal_ref": name,
                "token_hash_sha256": hashlib.sha256(token.encode()).hexdigest(),
            }
            for name, token in tokens.items()
        ]
    }


async def start_native_upstream(
    nursery: trio.Nursery, protocol: str, provider_type: str = "openai_api", **extra: Any
) -> tuple[FakeUpstream, dict[str, Any]]:
    """A fake upstream that speaks `protocol` natively (`tests.adapters.fake_upstream`),
    owned by `nursery`; and the provider `native` that serves `fake-model` from it."""
    fake = FakeUpstream(native=frozenset({protocol}))
    base_url = await nursery.start(fake.serve)
    provider = {
        "id": "native",
        "type": provider_type,
        "models": ["fake-model"],
        "capacity": 2,
        "adapter": {"base_url": base_url},
        **extra,
    }
    return fake, provider


def one_sim_config(state_dir: Path, **sections: Any) -> str:
    """An Edge config (YAML text) of one `sim` provider, `sim-1`, serving the model `m`;
    `sections` as `edge_config` takes them."""
    return edge_config(
        state_dir,
        providers=[sim_provider("sim-1")],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        **sections,
    )


@dataclass
class Stack:
    edge: Edge
    addresses: EdgeAddresses
    nursery: trio.Nursery
    config_path: Path
    node_scopes: dict[str, trio.CancelScope] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"{self.addresses.openai_url}/v1"

    def client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("http_client", openai.DefaultAsyncHttpxClient(verify=CLIENT_TLS))
        return openai.AsyncOpenAI(base_url=self.base_url, **kwargs)

    def http(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(base_url=self.addresses.openai_url, timeout=30, verify=CLIENT_TLS)

    @property
    def admin_flags(self) -> list[str]:
        """What an `iop-edge` command that changes this Edge is given: its admin URL, and
        its config (whose `edge.state_dir` holds the admin credential)."""
        return ["--admin", self.addresses.admin_url, "--config", str(self.config_path)]

    def admin(self) -> httpx2.AsyncClient:
        """A client of the admin API holding the admin credential, as an operator's."""
        return httpx2.AsyncClient(
            base_url=self.addresses.admin_url,
            timeout=30,
            verify=CLIENT_TLS,
            headers=admin_headers(Path(self.edge.snapshot.config.edge.state_dir)),
        )

    async def start_node(
        self, node_id: str = "node-1", token: str = NODE_TOKEN, **kwargs: Any
    ) -> None:
        """Start an in-process Node; stop it with `kill_node`."""
        scope = trio.CancelScope()
        self.node_scopes[node_id] = scope

        async def node() -> None:
            with scope:
                await run_node(self.addresses.node_url, node_id, token, **kwargs)

        self.nursery.start_soon(node)

    def kill_node(self, node_id: str = "node-1") -> None:
        self.node_scopes.pop(node_id).cancel()

    async def wait_servable(self, *models: str) -> None:
        with trio.fail_after(WAIT_GUARD_S):
            for model in models:
                await self.edge.wait_model_servable(model)

    async def requests_by_protocol(self) -> dict[str, int]:
        """The requests metered per caller protocol, once every finished run's record is
        written (`/usage` grouped by protocol)."""
        await self.edge.ledger.wait_flushed()
        async with self.admin() as admin:
            response = await admin.get("/usage", params={"group_by": "protocol"})
        response.raise_for_status()
        return {row["protocol"]: row["requests"] for row in response.json()["rows"]}

    async def catalog(self) -> dict[str, Any]:
        async with self.admin() as admin:
            response = await admin.get("/catalog")
            response.raise_for_status()
            result: dict[str, Any] = response.json()
            return result

    async def wait_catalog(
        self, predicate: Callable[[dict[str, Any]], bool], *, within_s: float = WAIT_GUARD_S
    ) -> dict[str, Any]:
        """Wait (at most `within_s`) until the catalog satisfies `predicate`.

        Event-driven: the catalog is read in-process (the same records `/catalog` encodes)
        and checked with no await before waiting for the next pool change, so no change
        can slip between the check and the wait.
        """
        with trio.fail_after(within_s):
            while True:
                catalog: dict[str, Any] = msgspec.to_builtins(self.edge.scheduler.catalog())
                if predicate(catalog):
                    return catalog
                await self.edge.wait_pool_change()


async def start_stack(
    nursery: trio.Nursery,
    config_text: str,
    config_path: Path,
    *,
    nodes: tuple[str, ...] = ("node-1",),
    wait_models: tuple[str, ...] = (),
    node_kwargs: dict[str, Any] | None = None,
    edge_kwargs: dict[str, Any] | None = None,
) -> Stack:
    await trio.Path(config_path).write_text(config_text, encoding="utf-8")
    edge = Edge(parse_config(config_text), config_path=config_path, **(edge_kwargs or {}))
    addresses = await nursery.start(edge.serve)
    stack = Stack(edge=edge, addresses=addresses, nursery=nursery, config_path=config_path)
    for node_id in nodes:
        await stack.start_node(node_id, **(node_kwargs or {}))
    await stack.wait_servable(*wait_models)
    return stack


async def start_slow_stack(nursery: trio.Nursery, folder: Path) -> Stack:
    """A stack whose one model, `m`, streams two tokens a second: time for a test to act
    in the middle of a stream (kill the Node, hang up)."""
    slow = sim_provider("sim-1", adapter={"ttft_ms": 1, "tokens_per_second": 2})
    text = edge_config(
        folder / "state",
        providers=[slow],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
    )
    return await start_stack(nursery, text, folder / "edge.yaml", wait_models=("m",))


def chat_stream_plan(run_id: str, body: dict[str, Any]) -> RunPlan:
    """The plan of a chat stream with `body` (its `model` is the run's), for tests that
    open and drive a run through the dispatcher themselves."""
    return RunPlan(
        run_id=run_id,
        model_id=body["model"],
        operation="chat",
        body=body,
        stream=True,
        long=False,
        caller_wants_usage=False,
    )


async def open_silent_node(stack: Stack, node_id: str = "node-1") -> trio.SocketStream:
    """A Node that opens its link and says `hello`, then reads nothing: the Edge's pings
    go unanswered. The caller closes the returned stream."""
    host, port = stack.addresses.node_url.removeprefix("ws://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host=host, target="/")))
    while not any(isinstance(e, AcceptConnection) for e in ws.events()):
        ws.receive_data(await stream.receive_some())
    hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id=node_id, token=NODE_TOKEN)
    await stream.send_all(ws.send(BytesMessage(data=wire.encode(hello))))
    return stream


async def hang_up_after(stream: openai.AsyncStream[Any], chunks: int) -> None:
    """Read `chunks` events of `stream`, then hang up as a caller who has seen enough."""
    received = 0
    async for _chunk in stream:
        received += 1
        if received == chunks:
            break
    await stream.close()
