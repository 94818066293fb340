"""Claude Code and Codex CLI through IOP to a real llama.cpp server, translated.

Opt-in (`just test-runtimes`, see `conftest.py`). llama-cpp-python's server speaks chat
completions only, yet the provider is a `vllm`-type one, which IOP assumes speaks
Messages and Responses too (design §14): the first native attempt meets the server's 404,
the Node marks the protocol as not spoken and translates, and no agent ever sees that
404.

The scripted tool-use loop is `tests/agents`' (a 135M model cannot be scripted). Here the
point is that each CLI parses, to the end, IOP's translation of what a real runtime
streams: exit 0, an answer printed, the run metered in the agent's protocol. The agents'
full requests (Claude Code's ~20K tokens with its 24 tools, Codex's ~10K) do not fit the
server's 2048-token context, so each CLI runs with the settings of `docs/agents.md` as
written there plus flags that trim its request: Claude Code `--bare` with a one-line
system prompt and no tools, Codex with its optional tools off and one-line instructions.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.agents.clis import Outcome, base_environment, require_cli, run_cli
from tests.agents.settings import Target, claude_code_env, codex_config, codex_env
from tests.e2e.stack import Stack, edge_config, start_stack
from tests.e2e.upstreams import upstream_provider
from tests.runtimes.conftest import SERVED

#: A 135M model on two busy cores: a run can take a minute or more.
pytestmark = [pytest.mark.runtime, pytest.mark.agents, pytest.mark.timeout(600)]

MODEL = "smol"
TOKEN = "sk-runtime-agents"
#: Bound on one CLI run, under the test's hang guard (half its timeout).
CLI_LIMIT_S = 240.0
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
PROMPT = "Say hello."


async def _stack(llama_server: str, nursery: trio.Nursery, tmp_path: Path) -> Stack:
    provider = upstream_provider(
        "llama",
        llama_server,
        served=SERVED,
        capacity=1,
        request_timeout_s=300.0,
        first_byte_timeout_s=120.0,
    )
    principal = {
        "token_ref": "runtime-agents",
        "principal_ref": "agents",
        "token_hash_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
    }
    text = edge_config(
        tmp_path / "state",
        providers=[provider],
        models=[{"id": MODEL, "providers": {"llama": SERVED}}],
        openai_section={"principal_tokens": [principal]},
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=(MODEL,))


async def _metered(stack: Stack) -> list[dict[str, Any]]:
    with trio.fail_after(5):
        await stack.edge.ledger.wait_flushed()
    async with stack.admin() as admin:
        response = await admin.get("/usage", params={"group_by": "protocol,status"})
    response.raise_for_status()
    rows: list[dict[str, Any]] = response.json()["rows"]
    return rows


def _answered(outcome: Outcome) -> None:
    assert outcome.returncode == 0, outcome.report()
    assert outcome.stdout.strip(), outcome.report()


async def _dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    made = [tmp_path / name for name in ("home", "work", "logs")]
    for directory in made:
        await trio.Path(directory).mkdir()
    return made[0], made[1], made[2]


async def test_claude_code_answers_from_llama_cpp(
    llama_server: str, nursery: trio.Nursery, tmp_path: Path
) -> None:
    claude = require_cli("claude")
    stack = await _stack(llama_server, nursery, tmp_path)
    home, work, logs = await _dirs(tmp_path)
    target = Target(url=stack.addresses.openai_url, token=TOKEN, model=MODEL)
    env = {
        **base_environment(home),
        **claude_code_env(target),
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "48",
    }
    argv = [str(claude), "-p", PROMPT, "--bare", "--system-prompt", INSTRUCTIONS, "--tools", ""]
    outcome = await run_cli(argv, cwd=work, env=env, within_s=CLI_LIMIT_S, logs=logs)

    _answered(outcome)
    rows = await _metered(stack)
    assert [(row["protocol"], row["status"]) for row in rows] == [("messages", 200)], rows


async def test_codex_answers_from_llama_cpp(
    llama_server: str, nursery: trio.Nursery, tmp_path: Path
) -> None:
    codex = require_cli("codex")
    stack = await _stack(llama_server, nursery, tmp_path)
    home, work, logs = await _dirs(tmp_path)
    target = Target(url=stack.addresses.openai_url, token=TOKEN, model=MODEL)
    config = codex_config(target)
    await trio.Path(home / ".codex").mkdir()
    await trio.Path(home / ".codex" / "config.toml").write_text(config)
    await trio.Path(home / "instructions.md").write_text(INSTRUCTIONS)
    provider = tomllib.loads(config)["model_provider"]
    env = {**base_environment(home), **codex_env(target)}
    trim = ["goals", "multi_agent", "shell_tool", "apps", "skill_search", "tool_suggest"]
    argv = [
        str(codex),
        "exec",
        "--strict-config",
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        *(arg for feature in trim for arg in ("--disable", feature)),
        "-c",
        f'model_instructions_file="{home / "instructions.md"}"',
        "-c",
        f"model_providers.{provider}.request_max_retries=0",
        "-c",
        f"model_providers.{provider}.stream_max_retries=0",
        PROMPT,
    ]
    outcome = await run_cli(argv, cwd=work, env=env, within_s=CLI_LIMIT_S, logs=logs)

    _answered(outcome)
    rows = await _metered(stack)
    assert [(row["protocol"], row["status"]) for row in rows] == [("responses", 200)], rows
