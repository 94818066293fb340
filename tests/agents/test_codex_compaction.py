"""Codex CLI (`codex exec`) compacts its conversation through IOP against `iop-edge demo`
and goes on, with the settings `docs/agents.md` gives for it.

The page's Codex config, its provider named as the page's compaction snippet names it,
makes Codex ask the server to compact (a `compaction_trigger` item ending a streamed
`/v1/responses` request) instead of summarising by itself; IOP makes the compaction with
the demo's sim (`core.responses.compaction`). The test lowers Codex's auto-compaction limit so that
one large tool output crosses it: the turn compacts mid-way and goes on, and a second
`codex exec resume` turn runs on the compacted history (the compaction item sent back,
read by IOP) and completes a tool call.
"""

from __future__ import annotations

import logging
import tomllib

import pytest
import trio

from tests.agents.clis import base_environment, require_cli, run_cli
from tests.agents.settings import CODEX_COMPACTION, codex_config, codex_env, snippet
from tests.agents.test_demo import CLI_LIMIT_S, Demo, _check_metered, _check_turn, demo

__all__ = ["demo"]

pytestmark = pytest.mark.agents

#: Codex compacts once its history passes this many tokens: above the demo turn's first
#: request (Codex's instructions and tools, about 5,500) and below it with the tool's
#: output (`seq 1 2500`, about 2,800 more).
AUTO_COMPACT_LIMIT = 7000


def _with_compaction(config: str, addition: str) -> str:
    """The page's config with the compaction snippet's top-level keys first and its
    `[model_providers.*]` table in place of the config's own."""
    top, _, table = addition.partition("\n[")
    table = "[" + table
    name = table.splitlines()[0]
    start = config.index(name)
    end = config.find("\n[", start + len(name))
    rest = config[:start] + (config[end + 1 :] if end != -1 else "")
    return f"{top.strip()}\n{rest.rstrip()}\n\n{table}"


async def test_codex_compacts_through_iop_and_goes_on(
    demo: Demo, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.http.runs")
    codex = require_cli("codex")
    config = _with_compaction(
        codex_config(demo.target), demo.target.fill(snippet(CODEX_COMPACTION))
    )
    provider = tomllib.loads(config)["model_provider"]
    assert tomllib.loads(config)["model_providers"][provider]["name"] == "OpenAI", config
    config_dir = trio.Path(demo.home / ".codex")
    await config_dir.mkdir()
    await (config_dir / "config.toml").write_text(config)
    env = {**base_environment(demo.home), **codex_env(demo.target)}
    flags = [
        "--strict-config",
        "--skip-git-repo-check",
        "--sandbox",
        "danger-full-access",
        "--color",
        "never",
        "-c",
        f"model_auto_compact_token_limit={AUTO_COMPACT_LIMIT}",
        "-c",
        f"model_providers.{provider}.request_max_retries=0",
        "-c",
        f"model_providers.{provider}.stream_max_retries=0",
    ]
    first = await run_cli(
        [str(codex), "exec", *flags, "Use the exec_command tool to run `seq 1 2500`"],
        cwd=demo.workdir,
        env=env,
        within_s=CLI_LIMIT_S,
        logs=demo.logs / "first",
    )
    assert first.returncode == 0, first.report()
    assert "context compacted" in first.stderr + first.stdout, first.report()
    made = [r for r in caplog.records if "compacted the conversation" in r.getMessage()]
    assert made and "compaction_trigger" in made[0].getMessage(), first.report()

    second = await run_cli(
        [
            str(codex),
            "exec",
            *flags,
            "resume",
            "--last",
            "Use the exec_command tool to run `printf hello-from-iop`",
        ],
        cwd=demo.workdir,
        env=env,
        within_s=CLI_LIMIT_S,
        logs=demo.logs / "second",
    )
    _check_turn(second, "hello-from-iop")
    await _check_metered(demo, "responses")
