"""Claude Code (`claude -p`) and Codex CLI (`codex exec`) each complete a tool call against
`iop-edge demo`, set up as `docs/agents.md` says.

The Edge runs the demo's own config (`iop_edge/examples/demo.yaml`: its simulated
providers in `model` mode), changed only to listen on free ports and keep its state in
the test's directory, with its Node in-process as `iop-edge demo` runs it. The agents get
the page's settings filled in with the demo's values and run the page's demo commands:
the sim calls the tool the prompt names, the agent runs the command, and the sim's
answer quotes the command's output, which the agent prints. The output can only be in
that answer if the call and its result went through IOP both ways.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import yaml

from iop_edge.core.configuration.tokens import DEMO_NODE_TOKEN
from tests.agents.clis import Outcome, base_environment, require_cli, run_cli
from tests.agents.settings import (
    DEMO_CLAUDE,
    DEMO_CODEX,
    ROOT,
    Target,
    claude_code_env,
    codex_config,
    codex_env,
    command,
)
from tests.e2e.stack import Stack, start_stack

pytestmark = pytest.mark.agents

DEMO_CONFIG: Final = ROOT / "iop_edge" / "examples" / "demo.yaml"
#: The demo's model, and a token (the demo's API is open: any token is accepted).
MODEL: Final = "sim-small"
TOKEN: Final = "sk-demo-anything"
#: A bound for a failure only (a turn takes a second or two), under the test's own hang
#: guard (half the 60 s pytest-timeout), so a stuck CLI fails with what it printed.
CLI_LIMIT_S = 20.0


@dataclass
class Demo:
    stack: Stack
    target: Target
    home: Path
    workdir: Path
    logs: Path

    async def requests(self) -> list[dict[str, Any]]:
        """The ledger's rows by protocol and status, once every finished run is written."""
        with trio.fail_after(5):
            await self.stack.edge.ledger.wait_flushed()
        async with self.stack.admin() as admin:
            response = await admin.get("/usage", params={"group_by": "protocol,status"})
        response.raise_for_status()
        rows: list[dict[str, Any]] = response.json()["rows"]
        return rows


@pytest.fixture
async def demo(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Demo]:
    config = yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8"))
    for section in ("edge", "admin", "openai"):
        config[section]["listen"] = "127.0.0.1:0"
    config["edge"]["state_dir"] = str(tmp_path / "state")
    [node] = config["nodes"]
    stack = await start_stack(
        nursery, yaml.safe_dump(config, sort_keys=False), tmp_path / "demo.yaml", nodes=()
    )
    await stack.start_node(node["id"], token=DEMO_NODE_TOKEN)
    await stack.wait_servable(MODEL)
    dirs = [tmp_path / name for name in ("home", "work", "logs")]
    for directory in dirs:
        await trio.Path(directory).mkdir()
    home, workdir, logs = dirs
    yield Demo(
        stack=stack,
        target=Target(url=stack.addresses.openai_url, token=TOKEN, model=MODEL),
        home=home,
        workdir=workdir,
        logs=logs,
    )
    stack.kill_node(node["id"])  # first, so the Edge does not wait out its close grace


def _printed_command(argv: list[str]) -> str:
    """What the page's command prints: the `printf` argument of its prompt."""
    match = re.search(r"`printf ([^`]+)`", " ".join(argv))
    assert match, f"the demo command's prompt runs no printf: {argv}"
    return match.group(1)


def _check_turn(outcome: Outcome, printed: str) -> None:
    """The agent ended well and showed the sim's answer to the tool's result."""
    assert outcome.returncode == 0, outcome.report()
    answer = re.search(r"The tool returned:[^\n]*", outcome.stdout)
    assert answer, outcome.report()
    assert printed in answer.group(0), outcome.report()


async def _check_metered(demo: Demo, protocol: str) -> None:
    """Every run the agent made was metered as a success, at least the tool call's turn
    and the answer's."""
    rows = await demo.requests()
    assert {(row["protocol"], row["status"]) for row in rows} == {(protocol, 200)}, rows
    assert rows[0]["requests"] >= 2, rows


async def test_claude_code_completes_a_tool_call_against_the_demo(demo: Demo) -> None:
    claude = require_cli("claude")
    argv = command(DEMO_CLAUDE)
    assert argv[0] == "claude", argv
    env = {
        **base_environment(demo.home),
        **claude_code_env(demo.target),
        # No retries: a failure is a failure, shown at once rather than after back-offs.
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }
    outcome = await run_cli(
        [str(claude), *argv[1:]],
        cwd=demo.workdir,
        env=env,
        within_s=CLI_LIMIT_S,
        logs=demo.logs,
    )

    _check_turn(outcome, _printed_command(argv))
    await _check_metered(demo, "messages")


async def _run_codex_demo_turn(
    demo: Demo, *extra: str, prompt: str | None = None, ephemeral: bool = True
) -> tuple[Outcome, list[str]]:
    """Codex runs the page's command against the demo (with `prompt` for the page's, if
    given), its config as the page writes it and `extra` settings (`key=value`, under the
    page's provider) added: the outcome and the page's command line. `ephemeral`: no
    session files (a thread that is kept is needed by Codex's goal tools)."""
    codex = require_cli("codex")
    argv = command(DEMO_CODEX)
    assert argv[:2] == ["codex", "exec"], argv
    config_dir = trio.Path(demo.home / ".codex")
    await config_dir.mkdir()
    config = codex_config(demo.target)
    await (config_dir / "config.toml").write_text(config)
    provider = tomllib.loads(config)["model_provider"]
    env = {**base_environment(demo.home), **codex_env(demo.target)}
    # What the page's command line leaves out and a test needs: a strict reading of the
    # config, no session files (unless asked), no OS sandbox (`test_codex.py` says why), no
    # retries.
    settings = [*extra, "request_max_retries=0", "stream_max_retries=0"]
    test_flags = ["--strict-config", "--sandbox", "danger-full-access", "--color", "never"]
    if ephemeral:
        test_flags.append("--ephemeral")
    for setting in settings:
        test_flags += ["-c", f"model_providers.{provider}.{setting}"]
    args = argv[2:] if prompt is None else [*argv[2:-1], prompt]
    outcome = await run_cli(
        [str(codex), "exec", *test_flags, *args],
        cwd=demo.workdir,
        env=env,
        within_s=CLI_LIMIT_S,
        logs=demo.logs,
    )
    return outcome, argv


async def test_codex_completes_a_tool_call_against_the_demo(
    demo: Demo, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop_node.runs.protocol_run")
    outcome, argv = await _run_codex_demo_turn(demo)

    _check_turn(outcome, _printed_command(argv))
    await _check_metered(demo, "responses")
    # Codex offers its hosted `web_search` (the page's config leaves it on): the sim's
    # runs are translated, so the Node left it out of each, and said so.
    left_out = [r for r in caplog.records if "left out the hosted tools web_search" in r.message]
    assert left_out, "Codex offered no web_search, or the Node did not say it left it out"


async def test_codex_completes_a_tool_call_over_websocket(
    demo: Demo, caplog: pytest.LogCaptureFixture
) -> None:
    """The same turn with the provider declaring `supports_websockets = true`
    (docs/agents.md): Codex runs it over the Responses WebSocket mode, every request of
    the turn on one connection, and falls back to HTTP for none of them. It opens the
    connection with a warm-up (`generate: false`), which runs and bills nothing."""
    caplog.set_level(logging.DEBUG, logger="iop_edge.http.responses_socket")
    outcome, argv = await _run_codex_demo_turn(demo, "supports_websockets=true")

    _check_turn(outcome, _printed_command(argv))
    await _check_metered(demo, "responses")
    # a turn is logged as it begins, so before its run is metered
    turns = [r for r in caplog.records if re.match(r"Responses WebSocket \S+: turn", r.message)]
    warm_ups = [
        r for r in caplog.records if re.match(r"Responses WebSocket \S+: a warm-up", r.message)
    ]
    [row] = await demo.requests()
    assert warm_ups, outcome.report()
    assert len(turns) - len(warm_ups) == row["requests"] >= 2, (len(turns), row, outcome.report())


async def test_codex_sets_a_thread_goal_against_the_demo(demo: Demo) -> None:
    """Codex's `create_goal` tool: once it ran, Codex hands the model the goal as a tool
    output no call asked for (no `call_id`), which no runtime reads as it is; IOP gives
    it to the sim as a user message and the turn completes."""
    outcome, _ = await _run_codex_demo_turn(
        demo, prompt="Use the create_goal tool to set the goal `count to three`", ephemeral=False
    )

    _check_turn(outcome, "count to three")
    await _check_metered(demo, "responses")
