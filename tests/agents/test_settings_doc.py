"""The agent settings page is what the agent tests run, and every copy of it agrees.

The CLI tests read their settings from `docs/agents.md` (`settings.py`); these checks keep
the page readable by them (one snippet per name, each in its form, each using the page's
placeholders) and keep copies elsewhere (the README's section) identical to it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.agents.settings import (
    CLAUDE_ENV,
    CODEX_COMPACTION,
    CODEX_CONFIG,
    CODEX_ENV,
    DEMO_CLAUDE,
    DEMO_CODEX,
    PAGE,
    PLACEHOLDERS,
    ROOT,
    SettingsError,
    Target,
    claude_code_env,
    codex_config,
    codex_env,
    exports,
    snippet,
    snippets,
)

TARGET = Target(url="http://127.0.0.1:9", token="sk-test", model="m-test")


def test_the_page_has_each_tested_snippet_once_and_nothing_else_marked() -> None:
    names = [found.name for found in snippets(PAGE)]
    expected = [CLAUDE_ENV, CODEX_CONFIG, CODEX_COMPACTION, CODEX_ENV, DEMO_CLAUDE, DEMO_CODEX]
    assert sorted(names) == sorted(expected)
    assert (snippet(CLAUDE_ENV).lang, snippet(CODEX_CONFIG).lang) == ("sh", "toml")
    text = PAGE.read_text()
    for placeholder in PLACEHOLDERS:
        assert f"`{placeholder}`" in text, f"the page does not say what {placeholder} stands for"


def test_claude_code_gets_the_edge_the_token_and_telemetry_off() -> None:
    env = claude_code_env(TARGET)
    assert env["ANTHROPIC_BASE_URL"] == TARGET.url
    assert env["ANTHROPIC_API_KEY"] == TARGET.token
    assert env["ANTHROPIC_MODEL"] == TARGET.model
    for switch in ("DISABLE_TELEMETRY", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"):
        assert env[switch] == "1"


def test_codex_gets_a_responses_provider_at_the_edge() -> None:
    config = tomllib.loads(codex_config(TARGET))
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == f"{TARGET.url}/v1"
    assert provider["wire_api"] == "responses"
    assert config["model"] == TARGET.model
    assert config["analytics"] == {"enabled": False}
    assert codex_env(TARGET) == {provider["env_key"]: TARGET.token}


def test_a_snippet_not_in_the_tested_form_is_refused_naming_the_line() -> None:
    with pytest.raises(SettingsError, match="line 2: not `export NAME=value`"):
        exports("export A=1\nA=2\n", name="x")
    with pytest.raises(SettingsError, match="'a-b' is not a variable"):
        exports("export a-b=1\n", name="x")
    assert exports("# a comment\n\nexport A='x y'\n", name="x") == {"A": "x y"}


@pytest.mark.parametrize(
    "doc",
    sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]),
    ids=lambda path: path.relative_to(ROOT).as_posix(),
)
def test_every_copy_of_a_tested_snippet_is_the_tested_one(doc: Path) -> None:
    for copy in snippets(doc):
        try:
            original = snippet(copy.name)
        except SettingsError as exc:
            pytest.fail(f"{doc}: a snippet marked {copy.name!r}, which the page lacks: {exc}")
        assert copy == original, f"{doc}: snippet {copy.name!r} differs from docs/agents.md"
