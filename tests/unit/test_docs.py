"""The documentation is part of the product: its links resolve, its config reference matches
the schema, and the repository speaks of the product alone.

A reader follows a link and finds the page; an operator reads a key in the reference and
finds it in the schema (and the reverse); nothing points outside the repository or tells
the story of how the code came to be (git history keeps that).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest

from iop_edge.core.configuration.config_reference import config_key_paths, json_schema
from iop_edge.core.refresh.refresh_diff import class_of

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to dashes."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_anchor(h) for h in _HEADING.findall(text)}


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    return [a or b for a, b in _LINK.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves_inside_the_repository(doc: Path) -> None:
    broken = []
    for link in _links(doc):
        if re.match(r"^[a-z]+://|^mailto:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.is_relative_to(ROOT):
            broken.append(f"{link}: outside the repository")
        elif not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.name}")
    assert broken == [], f"{doc.name}: {broken}"


def test_the_json_schema_in_docs_is_the_generated_one() -> None:
    written = json.loads((ROOT / "docs" / "edge-config.schema.json").read_text())
    assert written == json_schema(), (
        "docs/edge-config.schema.json is stale: run "
        "`iop-edge config-schema > docs/edge-config.schema.json`"
    )


def test_the_configuration_reference_names_exactly_the_schema_keys() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    documented = re.findall(r"^\| `([a-z0-9_\[\].]+)` \|", text, re.MULTILINE)
    schema = config_key_paths()
    assert sorted(set(schema) - set(documented)) == [], "keys missing from the reference"
    assert sorted(set(documented) - set(schema)) == [], "keys the schema does not have"
    assert len(documented) == len(set(documented)), "a key documented twice"


def test_the_configuration_reference_classes_each_key_as_a_refresh_does() -> None:
    """A key's `live` or `restart` in the reference is the class a refresh gives a change
    there: an operator plans a change by that column."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9_\[\].]+)` \| (\w+) \|", text, re.MULTILINE)
    assert rows
    named = {"live": "live", "restart_required": "restart"}
    wrong = [
        f"{key}: {said}, a refresh: {named[class_of(key)]}"
        for key, said in rows
        if said != named[class_of(key)]
    ]
    assert wrong == []


#: A pointer from code or config into the docs: `README.md#anchor` or `docs/page.md#anchor`.
_POINTER = re.compile(r"\b(README(?:\.md)?|docs/[\w.-]+\.md)#([\w-]+)")
#: A pointer by a section's name instead ("the README's "Scaling" section", "(README: tokens)"),
#: which nothing checks and which goes stale when the section moves.
_PROSE_POINTER = re.compile(r"README(?:'s)?,? *[(\"“:]|(?:the|see) README's \w+ section")


def _tracked(*suffixes: str) -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / n for n in names if Path(n).suffix in suffixes and (ROOT / n).exists()]


def test_every_pointer_into_the_docs_names_a_heading_that_exists() -> None:
    """Code, config and units point at a section as `docs/page.md#anchor`, and it exists."""
    this = Path(__file__)
    broken = []
    for path in _tracked(".py", ".yaml", ".toml", ".html", ".js", ".service", ".md"):
        if path == this:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            for page, anchor in _POINTER.findall(line):
                target = ROOT / ("README.md" if page.startswith("README") else page)
                if not target.exists():
                    broken.append(f"{where}: {page} does not exist")
                elif anchor not in _anchors(target):
                    broken.append(f"{where}: no heading #{anchor} in {page}")
            if path.suffix != ".md" and _PROSE_POINTER.search(line):
                broken.append(f"{where}: name the section as docs/page.md#anchor: {line.strip()}")
    assert broken == [], "\n".join(broken)


#: Words that tell the story of the work rather than the product.
_HISTORY = re.compile(
    r"\bSPEC(\.md)? ?§|\.\./shared|\bissue #?\d+|\b(work|field) round\b|\bsession \d+\b"
    r"|\bplanners?\b|\bBaseline before\b|\bbefore this (work|change|fix)\b|^what it took\b"
    r"|^\| (before|after) \|",
    re.IGNORECASE,
)


def test_the_repository_speaks_of_the_product_alone() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    this = Path(__file__).relative_to(ROOT).as_posix()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if name == this or path.suffix not in {".py", ".md", ".yaml", ".toml", ".html", ".js"}:
            continue
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _HISTORY.search(line):
                offenders.append(f"{name}:{number}: {line.strip()[:100]}")
    assert offenders == [], "\n".join(offenders[:40])


def test_the_readme_install_commands_are_the_tested_guides() -> None:
    """The README's install block is a digest of docs/install.md, whose every command the
    install test runs against a built wheel and sdist (`just test-install`): each of its
    commands must be one of the guide's, as written there."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the README's Install section has no sh block"
    commands = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    guide = (ROOT / "docs" / "install.md").read_text()
    guide_lines = {line.strip() for line in guide.splitlines()}
    missing = [command for command in commands if command and command not in guide_lines]
    assert missing == [], f"README install commands not in docs/install.md: {missing}"


def _section(title_prefix: str) -> str:
    design = (ROOT / "docs" / "design.md").read_text()
    start = design.index(f"\n## {title_prefix}")
    return design[start : design.index("\n## ", start + 1)]


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    """argparse keeps a parser's subcommands in its (private) actions, and nowhere else."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [name for action in actions for name in action.choices]


def test_design_section_10_names_every_command_and_admin_route() -> None:
    """§10 is the reference of the command line and the admin API: it names each command
    each CLI has and each route the admin app serves, so adding one without a word fails."""
    from iop_edge.cli import build_parser
    from iop_node.cli import build_parser as build_node_parser

    section = _section("10.")
    commands = [
        f"{program} {command}"
        for program, parser in (("iop-edge", build_parser()), ("iop-node", build_node_parser()))
        for command in _subcommands(parser)
    ]
    admin = "".join(path.read_text() for path in (ROOT / "iop_edge/http/admin_api").glob("*.py"))
    routes = re.findall(r'@app\.(?:get|post)\("([^"]+)"\)', admin)
    assert "/refresh" in routes, "the admin routes are no longer where this test reads them"
    missing = [c for c in commands if c not in section]
    missing += [
        f"admin route {r}"
        for r in routes
        if not re.search(rf"`(GET |POST )?{re.escape(r)}`", section)
    ]
    assert missing == [], f"docs/design.md §10 does not name: {missing}"
