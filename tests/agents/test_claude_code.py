"""Claude Code (`claude -p`) completes a scripted tool-use loop through IOP, natively and
translated, with the settings of `docs/agents.md` as written there.

The runtime behind IOP is scripted (`script.py`): asked the probe prompt, it calls Claude
Code's `Bash` tool with a `printf` that prints the marker; handed the tool's result, it
answers `DONE: <marker>`. Claude Code may run exactly that command (`--allowedTools
Bash(printf:*)`) and nothing else.
"""

from __future__ import annotations

import pytest

from tests.agents.agent_stack import AgentStack
from tests.agents.clis import base_environment, require_cli, run_cli
from tests.agents.loop_checks import check_metering, check_output, check_upstream, watch_access_log
from tests.agents.script import PROMPT
from tests.agents.settings import claude_code_env

pytestmark = pytest.mark.agents

#: A bound for a failure only (the loop takes a second or two, ten times that on a loaded
#: machine), under the test's own hang guard (half the 120 s pytest-timeout), so a stuck
#: CLI fails with what it printed.
CLI_LIMIT_S = 45.0


async def test_claude_code_runs_a_tool_and_answers_with_its_output(
    agent_stack: AgentStack, caplog: pytest.LogCaptureFixture
) -> None:
    claude = require_cli("claude")
    watch_access_log(caplog)
    env = {
        **base_environment(agent_stack.home),
        **claude_code_env(agent_stack.target),
        # No retries: a failure is a failure, shown at once rather than after back-offs.
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }
    argv = [str(claude), "-p", PROMPT, "--allowedTools", "Bash(printf:*)"]
    outcome = await run_cli(
        argv, cwd=agent_stack.workdir, env=env, within_s=CLI_LIMIT_S, logs=agent_stack.logs
    )

    check_output(outcome)
    check_upstream(agent_stack, "messages", outcome)
    await check_metering(agent_stack, "messages", caplog)
