"""The agent settings of `docs/agents.md`, read from the page so the tests run them verbatim.

Each tested snippet on the page follows a marker line `<!-- tested: NAME -->` and is one
fenced block. A test takes a snippet as written and replaces only the page's three
placeholders (`PLACEHOLDERS`) with the test's Edge URL, token and model; a placeholder the
page no longer uses fails the test, so page and tests cannot drift apart. Any copy of a
snippet elsewhere (the README) must carry the same marker and be identical
(`tests/agents/test_settings_doc.py`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
PAGE: Final = ROOT / "docs" / "agents.md"

#: The page's example values, which a reader (and a test) replaces with their own.
URL_PLACEHOLDER: Final = "http://iop.example:8080"
TOKEN_PLACEHOLDER: Final = "sk-iop-example"
MODEL_PLACEHOLDER: Final = "qwen3-coder"
PLACEHOLDERS: Final = (URL_PLACEHOLDER, TOKEN_PLACEHOLDER, MODEL_PLACEHOLDER)

CLAUDE_ENV: Final = "claude-code-env"
CODEX_CONFIG: Final = "codex-config"
CODEX_ENV: Final = "codex-env"
#: The lines that make Codex ask IOP to compact (`test_codex_compaction.py`).
CODEX_COMPACTION: Final = "codex-compaction"
#: The command lines the page runs against `iop-edge demo`.
DEMO_CLAUDE: Final = "demo-claude"
DEMO_CODEX: Final = "demo-codex"

_SNIPPET = re.compile(
    r"^<!-- tested: (?P<name>[a-z0-9-]+) -->\n```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class SettingsError(Exception):
    """A tested snippet is missing, duplicated or not in the form the tests read."""


@dataclass(frozen=True, slots=True)
class Snippet:
    name: str
    lang: str
    body: str


def snippets(path: Path) -> list[Snippet]:
    """Every marked snippet of the Markdown file at `path`, in order."""
    text = path.read_text(encoding="utf-8")
    return [Snippet(m["name"], m["lang"], m["body"]) for m in _SNIPPET.finditer(text)]


def snippet(name: str, path: Path = PAGE) -> Snippet:
    """The one snippet marked `name` in `path`."""
    found = [s for s in snippets(path) if s.name == name]
    if len(found) != 1:
        raise SettingsError(
            f"{path.relative_to(ROOT)}: expected one snippet marked "
            f"'<!-- tested: {name} -->', found {len(found)}"
        )
    return found[0]


@dataclass(frozen=True, slots=True)
class Target:
    """What a test substitutes for the page's placeholders."""

    url: str
    """The Edge's caller listener, `http://127.0.0.1:PORT` (no `/v1`)."""
    token: str
    model: str

    def fill(self, snippet: Snippet) -> str:
        """`snippet`'s text with the placeholders it uses replaced; it must use one."""
        text = snippet.body
        used = [p for p in PLACEHOLDERS if p in text]
        if not used:
            raise SettingsError(f"snippet {snippet.name!r} uses none of {PLACEHOLDERS}")
        for placeholder, value in zip(
            PLACEHOLDERS, (self.url, self.token, self.model), strict=True
        ):
            text = text.replace(placeholder, value)
        return text


def exports(text: str, *, name: str) -> dict[str, str]:
    """The variables a snippet of `export NAME=value` lines sets (comments and blank lines
    allowed; anything else is an error naming the line)."""
    variables: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if len(words) != 2 or words[0] != "export" or "=" not in words[1]:
            raise SettingsError(f"snippet {name!r} line {number}: not `export NAME=value`")
        key, _, value = words[1].partition("=")
        if not _NAME.match(key):
            raise SettingsError(f"snippet {name!r} line {number}: {key!r} is not a variable")
        variables[key] = value
    return variables


def claude_code_env(target: Target) -> dict[str, str]:
    """The environment the page sets for Claude Code, filled in for `target`."""
    return exports(target.fill(snippet(CLAUDE_ENV)), name=CLAUDE_ENV)


def codex_config(target: Target) -> str:
    """The page's Codex `config.toml`, filled in for `target`."""
    return target.fill(snippet(CODEX_CONFIG))


def codex_env(target: Target) -> dict[str, str]:
    """The environment the page sets for Codex, filled in for `target`."""
    return exports(target.fill(snippet(CODEX_ENV)), name=CODEX_ENV)


def command(name: str) -> list[str]:
    """The argv of the page's one-line command snippet `name` (its first word is the
    CLI, which a test replaces with the installed one)."""
    lines = [line for line in snippet(name).body.splitlines() if line.strip()]
    if len(lines) != 1:
        raise SettingsError(f"snippet {name!r} must be one command line, not {len(lines)}")
    return shlex.split(lines[0])
