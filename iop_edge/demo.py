"""`iop-edge demo`: the embedded default — an Edge, an in-process Node and `sim` providers.

The demo's config is the package's own `demo.yaml` (package data, so an installed package
has it: `iop-edge example demo.yaml` prints it), run from memory; or a copy given with
`--config`, run *from that file*, so an operator can edit it and apply the edit with
`iop-edge refresh --apply` while the demo runs, and the diff shows only what they
changed. (The built-in file is never the Edge's config file: a refresh that saves its
candidate would otherwise write into the installed package.)

That is why the demo Node presents a fixed, public token (`DEMO_NODE_TOKEN`) whose hash
is in the file: a token made up at every start would need a hash that is not in the
file, and every refresh would then report a (false) restart-required token change. A
public token is safe only where nobody else can connect: config validation refuses its
hash unless `edge.listen` is a loopback address (`core.configuration.config`), and `iop-edge serve`
applies the same rule. A real deployment makes its own tokens (`iop-edge init`).

`--ephemeral-ports` binds free ports without touching the config
(`lifecycle.listeners.Listeners`), for the same reason. After the providers report
themselves available, the demo prints the URLs and a ready-to-paste example and (unless
told not to) sends one real streamed request.

That request goes through httpx2, the HTTP client the package already depends on, not
the `openai` SDK: the SDK (and the dozen packages under it) would be a runtime dependency
of every Edge and Node install for the sake of one demo request. What the request shows
is the Edge's wire (server-sent chunks as OpenAI sends them), which is what any client
sees; that the official SDKs read it is the test suite's job (`tests/e2e`).
"""

from __future__ import annotations

import importlib.util
import logging
import shlex
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

import httpx2
import msgspec
import trio

from iop_edge.core.configuration.config import ParsedConfig
from iop_edge.core.configuration.tokens import DEMO_NODE_TOKEN, DEMO_NODE_TOKEN_SHA256
from iop_edge.edge import Edge, EdgeAddresses
from iop_edge.main import handle_signals, log_start
from iop_edge.runtime.lifecycle.listeners import Listeners
from iop_edge.runtime.refresh.config_file import check_config, load_config
from iop_node.main import run_node
from schemas.openai import ChunkChoice, ErrorDetail
from schemas.runtime.stop_signal import StopSignal

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
#: How the built-in config is named in messages, and how to get a copy to edit.
BUILT_IN: Final = "the built-in demo config (`iop-edge example demo.yaml` prints it)"
#: The example request's deadline: a stuck Edge fails the demo with a message instead of
#: hanging it; the run itself takes well under a second.
REQUEST_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The config the demo runs, and the file it came from (None: the built-in one)."""

    parsed: ParsedConfig
    path: Path | None

    @property
    def name(self) -> str:
        return BUILT_IN if self.path is None else str(self.path)


def built_in_demo_text() -> str:
    return (resources.files("iop_edge.examples") / "demo.yaml").read_text(encoding="utf-8")


class DemoError(Exception):
    """The demo cannot run this config (the message says what to change)."""


def check_demo_config(parsed: ParsedConfig, name: str) -> None:
    """The in-process Node can only present the public demo token (module docstring)."""
    for node in parsed.config.nodes:
        if node.token_hash_sha256 != DEMO_NODE_TOKEN_SHA256:
            raise DemoError(
                f"{name}: node '{node.id}' has a token_hash_sha256 that is not the demo "
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


def example_text(addresses: EdgeAddresses, model: str, demo: DemoConfig, ephemeral: bool) -> str:
    base = f"{addresses.openai_url}/v1"
    edge_cli = _command("iop-edge")
    # With free ports, or no file, the file's admin.listen does not say where the admin
    # API is: name it. The file also says where the admin credential is (its state_dir).
    if demo.path is None:
        locate = f"--admin {addresses.admin_url}"
    elif ephemeral:
        locate = f"--admin {addresses.admin_url} --config {demo.path}"
    else:
        locate = f"--config {demo.path}"
    if demo.path is None:
        edit = f"""
  # a copy to edit, run, and change while it runs (iop-edge refresh --apply):
  {edge_cli} example demo.yaml > my-demo.yaml
  {edge_cli} demo --config my-demo.yaml"""
    else:
        edit = f"""  {edge_cli} refresh {locate}      # after editing {demo.path}: what would change
  {edge_cli} refresh {locate} --apply"""
    return f"""
IOP demo is up (config: {demo.name}).
  OpenAI API   {base}
  admin API    {addresses.admin_url}   (/catalog, /status, /metrics, POST /refresh)
  pool page    {addresses.admin_url}/   (open it in a browser on this machine)
  node wire    {addresses.node_url}

Try it:
  curl -s {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

{_sdk_example(base, model)}
  {edge_cli} catalog {locate}
{edit}
"""


def _sdk_example(base: str, model: str) -> str:
    """The same request with the official SDK: through this Python when it has the SDK
    (a development install), else through `python3` after installing it."""
    if importlib.util.find_spec("openai") is not None:
        python, note = shlex.quote(_relative(Path(sys.executable))), ""
    else:
        python, note = "python3", "  # with the openai SDK (pip install openai):\n"
    return f"""{note}  {python} - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}", api_key="unused")
for chunk in client.chat.completions.create(
        model="{model}", stream=True, messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
print()
PY
"""


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class _StreamEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One `data:` event of a chat completion stream: a chunk, or an error the Edge sends
    in place of the rest of the stream."""

    model: str = ""
    choices: list[ChunkChoice] = []
    error: ErrorDetail | None = None


_decode_event = msgspec.json.Decoder(_StreamEvent).decode


async def send_example_request(addresses: EdgeAddresses, model: str) -> None:
    """One real streamed chat completion through the Edge, printed as it arrives; raises
    `DemoError` saying what went wrong when it does not complete."""
    url = f"{addresses.openai_url}/v1/chat/completions"
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Say hello to IOP."}],
    }
    print(f"> streaming a chat completion from model '{model}' (POST {url}):")
    started = time.perf_counter()
    first: float | None = None
    chunks = 0
    served_as = ""
    try:
        async with (
            httpx2.AsyncClient(timeout=None) as client,  # the caller's deadline rules
            client.stream("POST", url, json=body) as response,
        ):
            if response.status_code != 200:
                await response.aread()
                raise DemoError(
                    f"the example request failed: HTTP {response.status_code}: "
                    f"{_error_message(response.content)}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = _decode_event(line.removeprefix("data: "))
                if event.error is not None:
                    raise DemoError(f"the example request failed: {event.error.message}")
                served_as = event.model or served_as
                if event.choices and event.choices[0].delta.content:
                    first = first or time.perf_counter()
                    chunks += 1
                    print(event.choices[0].delta.content, end="", flush=True)
    except httpx2.HTTPError as exc:
        raise DemoError(f"the example request to {url} failed: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DemoError(f"the example request got a chunk that is not JSON: {exc}") from None
    total = time.perf_counter() - started
    ttft = (first - started) * 1000 if first else float("nan")
    print(
        f"\n< {chunks} chunks, model '{served_as}', "
        f"first token {ttft:.1f} ms, total {total * 1000:.1f} ms"
    )


def _error_message(body: bytes) -> str:
    """An OpenAI-style error body's message, else the body's start."""
    try:
        error = msgspec.json.decode(body, type=_StreamEvent).error
    except msgspec.DecodeError:
        error = None
    return body[:300].decode("utf-8", "replace") if error is None else error.message


#: Every listener on a free loopback port (the demo prints the URLs it got).
EPHEMERAL = Listeners(node="127.0.0.1:0", openai="127.0.0.1:0", admin="127.0.0.1:0")


def load_demo_config(config_path: Path | None) -> DemoConfig:
    """The demo's config, checked as `serve` checks a config, plus the demo's own rule:
    the file given, else the built-in one; raises `ConfigInvalid` or `DemoError`."""
    if config_path is None:
        parsed = check_config(built_in_demo_text())
        check_demo_config(parsed, BUILT_IN)
        return DemoConfig(parsed=parsed, path=None)
    path = Path(_relative(config_path.absolute()))
    parsed = load_config(path)
    check_demo_config(parsed, str(path))
    return DemoConfig(parsed=parsed, path=path)


async def run_demo(
    demo: DemoConfig,
    *,
    once: bool = False,
    no_request: bool = False,
    ephemeral_ports: bool = False,
) -> int:
    """Run the demo from `load_demo_config`'s answer; raises `ListenerUnavailable` when a
    port is taken, `DemoError` when the example request fails."""
    parsed = demo.parsed
    log_start(parsed, demo.path)
    edge = Edge(parsed, config_path=demo.path, listeners=EPHEMERAL if ephemeral_ports else None)
    model = parsed.config.models[0].id if parsed.config.models else ""
    stopped_by = StopSignal()
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
        print(example_text(addresses, model, demo, ephemeral_ports), flush=True)
        if not no_request:
            with trio.move_on_after(REQUEST_TIMEOUT_S) as request:
                await send_example_request(addresses, model)
            if request.cancelled_caught:
                raise DemoError(
                    f"the example request did not finish within {REQUEST_TIMEOUT_S:.0f}s"
                )
        if once:
            nursery.cancel_scope.cancel()
            return 0
        # Ctrl-C is caught before the demo says to press it.
        await nursery.start(handle_signals, edge, nursery.cancel_scope, stopped_by)
        print("\nServing; press Ctrl-C to stop.", flush=True)
    return stopped_by.exit_status
