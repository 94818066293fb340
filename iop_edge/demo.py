"""`iop-edge demo`: the embedded default — an Edge, an in-process Node and `sim` providers.

The demo Node's token is made up fresh at every start and only its hash goes into the
Edge's config, so no credential is written anywhere. After the providers report
themselves available, the demo prints the URLs and a ready-to-paste example and (unless
told not to) sends one real streamed request with the official `openai` SDK.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import sys
import time
from pathlib import Path

import msgspec
import trio

from iop_edge.core.config import ParsedConfig, load_config
from iop_edge.core.tokens import hash_token
from iop_edge.edge import Edge, EdgeAddresses
from iop_edge.main import handle_signals
from iop_node.main import run_node

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0


def demo_config_path() -> Path:
    """`configs/demo.yaml` from the working directory, else from the source checkout."""
    local = Path("configs/demo.yaml")
    if local.exists():
        return local
    return Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def with_node_token(parsed: ParsedConfig, token: str) -> ParsedConfig:
    """Every demo node authenticates with `token` (only its hash enters the config)."""
    digest = hash_token(token)
    nodes = [
        msgspec.structs.replace(node, token_hash_sha256=digest) for node in parsed.config.nodes
    ]
    config = msgspec.structs.replace(parsed.config, nodes=nodes)
    return dataclasses.replace(parsed, config=config)


def example_text(addresses: EdgeAddresses, model: str) -> str:
    base = f"{addresses.openai_url}/v1"
    return f"""
IOP demo is up.
  OpenAI API   {base}
  admin API    {addresses.admin_url}   (/catalog, /status, /metrics, POST /refresh)
  node wire    {addresses.node_url}

Try it:
  curl -s {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}", api_key="unused")
for chunk in client.chat.completions.create(
        model="{model}", stream=True, messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
print()
PY

  iop-edge catalog --admin {addresses.admin_url}
"""


async def send_example_request(addresses: EdgeAddresses, model: str) -> None:
    """One real streamed chat completion through the Edge, printed as it arrives."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{addresses.openai_url}/v1", api_key="demo", max_retries=0)
    started = time.perf_counter()
    print(f"> streaming a chat completion from model '{model}' with the openai SDK:")
    stream = await client.chat.completions.create(
        model=model,
        stream=True,
        max_tokens=24,
        messages=[{"role": "user", "content": "Say hello to IOP."}],
    )
    first: float | None = None
    chunks = 0
    served_as = ""
    async for chunk in stream:
        served_as = chunk.model
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            chunks += 1
            print(chunk.choices[0].delta.content, end="", flush=True)
    total = time.perf_counter() - started
    ttft = (first - started) * 1000 if first else float("nan")
    print(
        f"\n< {chunks} chunks, model '{served_as}', "
        f"first token {ttft:.1f} ms, total {total * 1000:.1f} ms"
    )
    await client.close()


def with_ephemeral_ports(parsed: ParsedConfig) -> ParsedConfig:
    """Every listener on a free loopback port (the demo prints the URLs it got)."""
    config = parsed.config
    config = msgspec.structs.replace(
        config,
        edge=msgspec.structs.replace(config.edge, listen="127.0.0.1:0"),
        admin=msgspec.structs.replace(config.admin, listen="127.0.0.1:0"),
        openai=msgspec.structs.replace(config.openai, listen="127.0.0.1:0"),
    )
    return dataclasses.replace(parsed, config=config)


async def run_demo(
    config_path: Path | None,
    once: bool = False,
    no_request: bool = False,
    ephemeral_ports: bool = False,
) -> int:
    path = config_path or demo_config_path()
    token = secrets.token_urlsafe(32)
    parsed = with_node_token(load_config(path), token)
    if ephemeral_ports:
        parsed = with_ephemeral_ports(parsed)
    edge = Edge(parsed)
    model = parsed.config.models[0].id if parsed.config.models else ""
    async with trio.open_nursery() as nursery:

        async def serve_then_stop(*, task_status: trio.TaskStatus[EdgeAddresses]) -> None:
            await edge.serve(task_status=task_status)
            nursery.cancel_scope.cancel()  # the Edge drained: stop the in-process Node too

        addresses: EdgeAddresses = await nursery.start(serve_then_stop)
        for node in parsed.config.nodes:
            nursery.start_soon(run_node, addresses.node_url, node.id, token)
        with trio.move_on_after(READY_TIMEOUT_S) as ready:
            await edge.wait_model_servable(model)
        if ready.cancelled_caught:
            print(
                f"the demo providers did not become available within {READY_TIMEOUT_S:.0f}s",
                file=sys.stderr,
            )
            nursery.cancel_scope.cancel()
            return 1
        print(example_text(addresses, model), flush=True)
        if not no_request:
            await send_example_request(addresses, model)
        if once:
            nursery.cancel_scope.cancel()
            return 0
        print("\nServing; press Ctrl-C to stop.", flush=True)
        nursery.start_soon(handle_signals, edge, nursery.cancel_scope)
    return 0
