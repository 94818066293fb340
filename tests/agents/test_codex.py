"""Codex CLI (`codex exec`) completes a scripted tool-use loop through IOP, natively and
translated, with the `config.toml` and environment of `docs/agents.md` as written there.

The runtime behind IOP is scripted (`script.py`): asked the probe prompt, it calls Codex's
`exec_command` tool with a `printf` that prints the marker; handed the tool's result, it
answers `DONE: <marker>`.

`--strict-config` makes Codex refuse a key it does not know, so the documented config is
checked against the pinned Codex too. `--sandbox danger-full-access` runs the command
outside Codex's OS sandbox: the command is the script's fixed `printf` in a throwaway
directory, and the sandbox (bubblewrap, user namespaces) is what CI machines often forbid,
not what is under test.
"""

from __future__ import annotations

import tomllib

import pytest
import trio

from tests.agents.agent_stack import AgentStack
from tests.agents.clis import base_environment, require_cli, run_cli
from tests.agents.loop_checks import check_metering, check_output, check_upstream, watch_access_log
from tests.agents.script import PROMPT
from tests.agents.settings import codex_config, codex_env

pytestmark = pytest.mark.agents

#: A bound for a failure only (the loop takes a second or two, ten times that on a loaded
#: machine), under the test's own hang guard (half the 120 s pytest-timeout), so a stuck
#: CLI fails with what it printed.
CLI_LIMIT_S = 45.0


async def test_codex_runs_a_tool_and_answers_with_its_output(
    agent_stack: AgentStack, caplog: pytest.LogCaptureFixture
) -> None:
    codex = require_cli("codex")
    watch_access_log(caplog)
    config_dir = trio.Path(agent_stack.home / ".codex")
    await config_dir.mkdir()
    config = codex_config(agent_stack.target)
    await (config_dir / "config.toml").write_text(config)
    provider = tomllib.loads(config)["model_provider"]
    env = {**base_environment(agent_stack.home), **codex_env(agent_stack.target)}
    argv = [
        str(codex),
        "exec",
        "--strict-config",
        "--skip-git-repo-check",
        "--ephemeral",
        "--sandbox",
        "danger-full-access",
        "--color",
        "never",
        # No retries: a failure is a failure, shown at once rather than after back-offs.
        "-c",
        f"model_providers.{provider}.request_max_retries=0",
        "-c",
        f"model_providers.{provider}.stream_max_retries=0",
        PROMPT,
    ]
    outcome = await run_cli(
        argv, cwd=agent_stack.workdir, env=env, within_s=CLI_LIMIT_S, logs=agent_stack.logs
    )

    check_output(outcome)
    check_upstream(agent_stack, "responses", outcome)
    await check_metering(agent_stack, "responses", caplog)
