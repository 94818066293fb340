"""Ten thousand caller tokens and their principals' limits stay cheap (design §2, §5, §15).

Reading such a config is linear, and no step of it is one long call into C: that would
hold the GIL, and a refresh reads its candidate in a worker thread beside the event loop.
Each rule is guarded by counting what the code does (conversions and the items each one
takes, pattern matches, hints, the pieces a graph is freed in), not by timing it; the
refresh at the end bounds the event loop's longest step, in CPU time, as
`test_loop_hold` does for a fleet of Nodes.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import yaml

from iop_edge.core.configuration import config as config_module
from iop_edge.core.configuration import config_rules
from iop_edge.core.configuration.config import ConfigInvalid, parse_config
from iop_edge.core.configuration.config_shape import CHUNK_ITEMS, convert
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.refresh.audit import AuditLog
from iop_edge.runtime.refresh.refresh import Refresher
from schemas.refresh import RefreshRequest
from tests.unit.test_loop_hold import LOOP_HOLD_BOUND_S, FleetEdge, LongestStep

MODELS = ["chat-small", "chat-large", "code"]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def config_text(
    tokens: int,
    *,
    limited_every: int = 10,
    rpm: int = 60,
    patterns: tuple[str, ...] = ("chat-*",),
    refs: str = "user",
) -> str:
    """`tokens` caller tokens, one principal each, every `limited_every`-th principal with
    limits of its own (`ref` spelled `{refs}-N`), and a `"*"` entry: a config with a
    `*` in it, as every config with principals' limits has."""
    config = {
        "edge": {"state_dir": "/tmp/iop-test-many-principals"},
        "openai": {
            "principal_tokens": [
                {
                    "token_ref": f"token-{i:05d}",
                    "token_hash_sha256": sha(f"token {i}"),
                    "principal_ref": f"user-{i:05d}",
                }
                for i in range(tokens)
            ]
        },
        "models": [{"id": model, "providers": {"p": "served"}} for model in MODELS],
        "nodes": [
            {
                "id": "n",
                "token_hash_sha256": sha("node"),
                "providers": [{"id": "p", "type": "sim", "models": ["served"], "capacity": 4}],
            }
        ],
        "principals": [
            {
                "ref": f"{refs}-{i:05d}",
                "models": list(patterns),
                "max_concurrent": 2,
                "requests_per_minute": rpm,
                "tokens_per_day": 1_000_000,
            }
            for i in range(0, tokens, limited_every)
        ]
        + [{"ref": "*", "requests_per_minute": 30}],
    }
    text: str = yaml.dump(config, Dumper=yaml.CSafeDumper, sort_keys=False)
    return text


def longest_list(value: object) -> int:
    """The longest list in `value` or in a mapping in it, at any depth (lists are not
    entered: their items are what a conversion of the list takes)."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, dict):
        return max((longest_list(item) for item in value.values()), default=0)
    return 0


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The longest list each `msgspec.convert` call takes, in order."""
    taken: list[int] = []
    real = msgspec.convert

    def counted(value: Any, *args: Any, **kwargs: Any) -> Any:
        taken.append(longest_list(value))
        return real(value, *args, **kwargs)

    monkeypatch.setattr(msgspec, "convert", counted)
    yield taken


# --- reading: one pass, no long conversion ---------------------------------------------


@pytest.mark.parametrize("tokens", [1_000, 4_000])
def test_no_conversion_takes_more_than_a_chunk_of_a_long_list(
    tokens: int, conversions: list[int]
) -> None:
    parsed = parse_config(config_text(tokens))

    assert len(parsed.config.openai.principal_tokens) == tokens
    assert len(parsed.config.principals) == tokens // 10 + 1
    assert conversions and max(conversions) <= CHUNK_ITEMS
    # Checked and built a chunk at a time: a few conversions per chunk, none per entry.
    chunks = math.ceil(tokens / CHUNK_ITEMS) + math.ceil((tokens // 10 + 1) / CHUNK_ITEMS)
    assert len(conversions) <= 2 * chunks + 20


def test_the_work_of_reading_grows_with_the_chunks_not_the_entries(
    conversions: list[int],
) -> None:
    parse_config(config_text(CHUNK_ITEMS * 4))
    small = len(conversions)
    conversions.clear()
    parse_config(config_text(CHUNK_ITEMS * 16))
    # 12 more chunks of tokens and a few of principals, each checked once and built once.
    assert len(conversions) - small <= 2 * (12 + 2)


def test_every_misfit_in_a_long_list_is_named_by_its_path() -> None:
    text = config_text(1_000)
    raw = yaml.safe_load(text)
    tokens = raw["openai"]["principal_tokens"]
    tokens[0]["token_hash_sha256"] = "not a hash"
    tokens[700]["colour"] = "red"
    del tokens[999]["principal_ref"]
    raw["principals"][42]["requests_per_minute"] = -1
    with pytest.raises(ConfigInvalid) as invalid:
        parse_config(yaml.safe_dump(raw))
    assert [str(error) for error in invalid.value.errors] == [
        "openai.principal_tokens[0].token_hash_sha256: must be 64 lowercase hex chars (sha256; "
        "`iop-edge hash-token` makes one)",
        "openai.principal_tokens[700].colour: unknown field",
        "openai.principal_tokens[999].principal_ref: required field missing",
        "principals[42].requests_per_minute: must be >= 0",
    ]


def test_a_config_with_star_and_glob_patterns_is_read_as_a_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`"*"` and `chat-*` are no YAML aliases: the document takes the tree path, without
    the bookkeeping aliases need."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the alias path was taken")

    monkeypatch.setattr(config_module, "_scan_nodes", refused)
    monkeypatch.setattr(config_module, "check_expansion", refused)
    text = config_text(500, patterns=("chat-*", "code"))
    assert '"*"' in text or "'*'" in text
    parse_config(text)


def test_each_model_pattern_is_matched_against_the_models_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real = fnmatch.fnmatchcase

    def counted(name: str, pattern: str) -> bool:
        calls.append(pattern)
        return real(name, pattern)

    monkeypatch.setattr(config_rules, "fnmatchcase", counted)
    parse_config(config_text(3_000, limited_every=1, patterns=("chat-*", "code")))
    assert len(calls) <= 2 * len(MODELS)


def test_a_pattern_no_model_matches_is_one_warning_however_many_entries_name_it() -> None:
    parsed = parse_config(config_text(3_000, limited_every=1, patterns=("chat-*", "llama-*")))
    assert parsed.warnings == [
        "principals[0].models[1]: 'llama-*' matches no model in models[] (yet); this "
        "principal cannot use it until one is added; 2,999 more entries name it too"
    ]


def test_unknown_refs_are_each_reported_and_the_hints_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hints: list[str] = []
    real = difflib.get_close_matches

    def counted(word: str, possibilities: list[str], *args: Any, **kwargs: Any) -> list[str]:
        hints.append(word)
        return real(word, possibilities, *args, **kwargs)

    monkeypatch.setattr(difflib, "get_close_matches", counted)
    with pytest.raises(ConfigInvalid) as invalid:
        parse_config(config_text(3_000, limited_every=1, refs="usr"))
    errors = [str(error) for error in invalid.value.errors]

    assert len(errors) == 3_000  # every unknown ref, each with its path
    assert errors[0].startswith(
        "principals[0].ref: unknown principal 'usr-00000' (did you mean 'user-00000'?)"
    )
    assert errors[2_999].startswith("principals[2999].ref: unknown principal 'usr-02999': ")
    assert len(hints) == config_rules._HINT_BUDGET // 3_000


# --- letting go: in pieces -----------------------------------------------------------------


class Item(msgspec.Struct):
    name: str


class Document(msgspec.Struct):
    items: list[Item]
    extra: Any = None
    section: dict[str, list[Item]] = {}


def test_convert_builds_what_msgspec_builds() -> None:
    value = {"items": [{"name": f"i{i}"} for i in range(700)], "extra": {"k": [1]}}
    assert convert(value, Document) == msgspec.convert(value, Document)
    with pytest.raises(msgspec.ValidationError):
        convert({"items": [*value["items"], {"name": 1}]}, Document)


# --- a refresh: off the event loop -----------------------------------------------------------


async def test_a_refresh_of_ten_thousand_tokens_holds_the_loop_no_step_longer_than_the_bound(
    tmp_path: Path, settled_heap: None
) -> None:
    running = config_text(10_000, rpm=60)
    candidate = config_text(10_000, rpm=61)  # every listed principal's limit: live
    parsed = await trio.to_thread.run_sync(parse_config, running)
    edge = FleetEdge(Snapshot.build(parsed.config, revision=1, config_sha256=parsed.sha256))
    refresher = Refresher(edge, config_path=None, audit=AuditLog(tmp_path))
    steps = LongestStep()
    trio.lowlevel.add_instrument(steps)
    try:
        dry = await refresher.refresh(RefreshRequest(mode="dry_run", config_yaml=candidate))
        applied = await refresher.refresh(RefreshRequest(mode="apply", config_yaml=candidate))
    finally:
        trio.lowlevel.remove_instrument(steps)

    assert dry.report.outcome == "dry_run" and len(dry.report.changes) == 1_000
    assert all(change.class_ == "live" for change in dry.report.changes)
    assert applied.report.outcome == "applied"
    assert edge.snapshot.policies.of("user-00010").requests_per_minute == 61
    assert steps.longest <= LOOP_HOLD_BOUND_S, (steps.task, steps.longest)
