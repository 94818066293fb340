"""`iop-edge demo`: the embedded default — an Edge, an in-process Node and `sim` providers.

The demo runs its config file exactly as written (`configs/demo.yaml`, or a copy given
with `--config`): the Edge is started *from that file*, so an operator can edit it and
apply the edit with `iop-edge refresh --apply` while the demo runs, and the diff shows
only what they changed.

That is why the demo Node presents a fixed, public token (`DEMO_NODE_TOKEN`) whose hash
is in the file: a token made up at every start would need a hash that is not in the
file, and every refresh would then report a (false) restart-required token change. A
public token is safe only where nobody else can connect: config validation refuses its
hash unless `edge.listen` is a loopback address (`core.config`), and `iop-edge serve`
applies the same rule. A real deployment makes its own tokens (README: tokens).

`--ephemeral-ports` binds free ports without touching the config (`edge.Listeners`),
for the same reason. After the providers report themselves available, the demo prints
the URLs and a ready-to-paste example and (unless told not to) sends one real streamed
request with the official `openai` SDK.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from pathlib import Path

import trio

from iop_edge.core.config import ParsedConfig, load_config
from iop_edge.core.tokens import DEMO_NODE_TOKEN, DEMO_NODE_TOKEN_SHA256
from iop_edge.edge import Edge, EdgeAddresses, Listeners
from iop_edge.main import handle_signals, log_start
from iop_node.main import run_node

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0


def demo_config_path() -> Path:
    """`configs/demo.yaml` from the working directory, else from the source checkout."""
    local = Path("configs/demo.yaml")
    if local.exists():
        return local
    return Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


class DemoError(Exception):
    """The demo cannot run this config (the message says what to change)."""


def check_demo_config(parsed: ParsedConfig, path: Path) -> None:
    """The in-process Node can only present the public demo token (module docstring)."""
    for node in parsed.config.nodes:
        if node.token_hash_sha256 != DEMO_NODE_TOKEN_SHA256:
            raise DemoError(
                f"{path}: node '{node.id}' has a token_hash_sha256 that is not the demo "
                f"token's; the demo's in-process Node presents only the public demo token "
                f"({DEMO_NODE_TOKEN!r}, hash {DEMO_NODE_TOKEN_SHA256}). Use that hash in a "
                "demo config, or run `iop-edge serve` with your own Nodes"
            )


def _command(name: str) -> str:
    """How to run one of IOP's commands from this shell: the script beside the Python that
    runs the demo (`.venv/bin/iop-edge`), relative to the current directory when under it."""
    script = Path(sys.executable).parent / name
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m {name.replace('-', '_')}"
    try:
        shown = str(script.relative_to(Path.cwd()))
    except ValueError:
        shown = str(script)
    return shlex.quote(shown)


def example_text(addresses: EdgeAddresses, model: str, config_path: Path, ephemeral: bool) -> str:
    base = f"{addresses.openai_url}/v1"
    python = shlex.quote(_relative(Path(sys.executable)))
    edge_cli = _command("iop-edge")
    # With free ports the file's admin.listen is not where the admin API is: name it.
    locate = f"--admin {addresses.admin_url}" if ephemeral else f"--config {config_path}"
    return f"""
IOP demo is up (config: {config_path}).
  OpenAI API   {base}
  admin API    {addresses.admin_url}   (/catalog, /status, /metrics, POST /refresh)
  pool page    {addresses.admin_url}/   (open it in a browser on this machine)
  node wire    {addresses.node_url}

Try it:
  curl -s {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  {python} - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}", api_key="unused")
for chunk in client.chat.completions.create(
        model="{model}", stream=True, messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
print()
PY

  {edge_cli} catalog {locate}
  {edge_cli} refresh {locate}      # after editing {config_path}: what would change
  {edge_cli} refresh {locate} --apply
"""


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


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


#: Every listener on a free loopback port (the demo prints the URLs it got).
EPHEMERAL = Listeners(node="127.0.0.1:0", openai="127.0.0.1:0", admin="127.0.0.1:0")


def load_demo_config(config_path: Path | None) -> tuple[Path, ParsedConfig]:
    """The demo's config file and its contents, checked as `serve` checks a config, plus
    the demo's own rule; raises `ConfigInvalid` or `DemoError`."""
    path = Path(_relative((config_path or demo_config_path()).absolute()))
    parsed = load_config(path)
    check_demo_config(parsed, path)
    return path, parsed


async def run_demo(
    path: Path,
    parsed: ParsedConfig,
    *,
    once: bool = False,
    no_request: bool = False,
    ephemeral_ports: bool = False,
) -> int:
    """Run the demo from `load_demo_config`'s answer; raises `ListenerUnavailable` when a
    port is taken."""
    log_start(parsed, path)
    edge = Edge(parsed, config_path=path, listeners=EPHEMERAL if ephemeral_ports else None)
    model = parsed.config.models[0].id if parsed.config.models else ""
    async with trio.open_nursery() as nursery:

        async def serve_then_stop(*, task_status: trio.TaskStatus[EdgeAddresses]) -> None:
            await edge.serve(task_status=task_status)
            nursery.cancel_scope.cancel()  # the Edge drained: stop the in-process Node too

        addresses: EdgeAddresses = await nursery.start(serve_then_stop)
        for node in parsed.config.nodes:
            nursery.start_soon(run_node, addresses.node_url, node.id, DEMO_NODE_TOKEN)
        with trio.move_on_after(READY_TIMEOUT_S) as ready:
            await edge.wait_model_servable(model)
        if ready.cancelled_caught:
            print(
                f"the demo providers did not become available within {READY_TIMEOUT_S:.0f}s",
                file=sys.stderr,
            )
            nursery.cancel_scope.cancel()
            return 1
        print(example_text(addresses, model, path, ephemeral_ports), flush=True)
        if not no_request:
            await send_example_request(addresses, model)
        if once:
            nursery.cancel_scope.cancel()
            return 0
        print("\nServing; press Ctrl-C to stop.", flush=True)
        nursery.start_soon(handle_signals, edge, nursery.cancel_scope)
    return 0
