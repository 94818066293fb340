"""Tests for `iop_edge.core.configuration.config` (design §2) and
`iop_edge.core.configuration.tokens`.

Each validation rule has its own test, built from one small valid config (`valid()`) with
exactly one mistake, asserting the exact path and a fragment of the message. Removing a
rule makes its test fail, because the config would then load.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from iop_edge.core.configuration.config import (
    ConfigInvalid,
    ParsedConfig,
    format_errors,
    parse_config,
)
from iop_edge.core.configuration.config_reference import config_key_paths
from iop_edge.core.configuration.listen import ListenAddress, parse_listen_address
from iop_edge.core.configuration.tokens import hash_token, tokens_match
from iop_edge.runtime.refresh.config_file import load_config
from schemas.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "iop_edge" / "examples"
NODE_HASH = hash_token("unit-test-node-token")
OTHER_HASH = hash_token("unit-test-other-token")

Raw = dict[str, Any]


# --------------------------------------------------------------------------- builders


def valid() -> Raw:
    """The smallest useful config: one node, one sim provider, one model on it."""
    return {
        "models": [{"id": "m1", "providers": {"p1": "sim-small"}}],
        "nodes": [
            {
                "id": "n1",
                "token_hash_sha256": NODE_HASH,
                "providers": [provider("p1")],
            }
        ],
    }


def provider(provider_id: str, type_: str = "sim", **fields: Any) -> Raw:
    entry: Raw = {"id": provider_id, "type": type_, "models": ["sim-small"], "capacity": 2}
    if type_ in ("vllm", "sglang", "lemonade", "openai_api", "ollama"):
        entry["adapter"] = {"base_url": "http://127.0.0.1:8000/v1"}
    elif type_ == "cli":
        entry["adapter"] = {"command": ["llm", "--model", "{model}"]}
    entry.update(fields)
    return entry


def first_provider(raw: Raw) -> Raw:
    result: Raw = raw["nodes"][0]["providers"][0]
    return result


def principal(token_ref: str, token_hash: str, principal_ref: str = "team") -> Raw:
    return {"token_ref": token_ref, "token_hash_sha256": token_hash, "principal_ref": principal_ref}


def parse(raw: Raw) -> ParsedConfig:
    return parse_config(yaml.safe_dump(raw, sort_keys=False))


def errors_of(raw: Raw | str) -> list[ConfigError]:
    text = raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False)
    with pytest.raises(ConfigInvalid) as caught:
        parse_config(text)
    assert caught.value.errors, "ConfigInvalid must carry at least one error"
    return caught.value.errors


def only_error(raw: Raw | str) -> ConfigError:
    errors = errors_of(raw)
    assert len(errors) == 1, format_errors(errors)
    return errors[0]


def assert_only_error(raw: Raw | str, path: str, fragment: str) -> ConfigError:
    error = only_error(raw)
    assert error.path == path, str(error)
    assert fragment in error.message, str(error)
    return error


# --------------------------------------------------------------------------- example configs


def test_example_edge_config_loads_with_every_provider_type() -> None:
    parsed = load_config(CONFIGS / "edge.yaml")
    config = parsed.config
    assert parsed.warnings == []
    assert config.edge.listen == "127.0.0.1:7700"
    assert config.admin.listen == "127.0.0.1:7701"
    assert config.openai.listen == "127.0.0.1:8080"
    assert config.edge.tls is None
    types = {p.type for node in config.nodes for p in node.providers}
    assert {"vllm", "ollama", "openai_api", "cli", "sim"} <= types
    assert len(config.nodes) == 2
    api = [p for node in config.nodes for p in node.providers if p.type == "openai_api"]
    assert api[0].adapter.api_key_env == "OPENAI_API_KEY"
    assert all(m.providers for m in config.models)
    assert any(m.queue is not None and m.generation.max_tokens_limit for m in config.models)


def test_example_edge_config_hashes_are_those_of_the_documented_example_tokens() -> None:
    config = load_config(CONFIGS / "edge.yaml").config
    tokens = config.openai.principal_tokens
    assert tokens_match("iop-example-caller-token", tokens[0].token_hash_sha256)
    assert tokens[0].principal_ref == tokens[1].principal_ref  # shared principal is allowed
    node_hashes = {node.id: node.token_hash_sha256 for node in config.nodes}
    assert tokens_match("iop-example-gpu1-token", node_hashes["gpu1"])
    assert tokens_match("iop-example-ws1-token", node_hashes["ws1"])


def test_example_edge_config_commented_model_route_is_valid_when_uncommented() -> None:
    text = (CONFIGS / "edge.yaml").read_text(encoding="utf-8")
    text = text.replace("  model_routes: []", "  # (list moved below)")
    for commented, live in [
        ("  # model_routes:", "  model_routes:"),
        ("  #   - model:", "    - model:"),
        ("  #     provider:", "      provider:"),
        ("  #     target:", "      target:"),
    ]:
        assert commented in text
        text = text.replace(commented, live)
    parsed = parse_config(text)
    assert len(parsed.warnings) == 1
    assert parsed.config.models[-1].id == "sim-legacy"


def test_example_edge_config_shows_every_key() -> None:
    """The example is the commented walkthrough of every field it says it is: each key of
    the schema appears in it, set or commented out."""
    text = (CONFIGS / "edge.yaml").read_text(encoding="utf-8")
    shown = set(re.findall(r"^[ #-]*([a-z_0-9]+):", text, re.MULTILINE))
    missing = [path for path in config_key_paths() if re.findall(r"\w+", path)[-1] not in shown]
    assert missing == []


def test_demo_config_loads() -> None:
    parsed = load_config(CONFIGS / "demo.yaml")
    config = parsed.config
    assert (config.edge.listen, config.admin.listen, config.openai.listen) == (
        "127.0.0.1:7700",
        "127.0.0.1:7701",
        "127.0.0.1:8080",
    )
    assert config.edge.state_dir == "./var/demo"
    assert config.openai.principal_tokens == []
    (node,) = config.nodes
    assert node.id == "demo-node"
    assert tokens_match("iop-demo-node-token", node.token_hash_sha256)
    sim_a, sim_b = node.providers
    assert (sim_a.id, sim_a.type, sim_a.capacity, sim_a.priority) == ("sim-a", "sim", 4, 10)
    assert (sim_b.id, sim_b.type, sim_b.capacity) == ("sim-b", "sim", 4)
    assert sim_a.models == sim_b.models == ["sim-small"]
    assert (sim_a.adapter.ttft_ms, sim_a.adapter.tokens_per_second) == (20, 200)
    models = {model.id: model for model in config.models}
    assert models["sim-small"].display_name == "Simulated small model"
    assert models["sim-small"].providers == {"sim-a": "sim-small", "sim-b": "sim-small"}
    demo_chat = models["demo-chat"]
    assert demo_chat.display_name == "Demo chat (alias of sim)"
    assert demo_chat.providers == {"sim-a": "sim-small"}
    assert demo_chat.generation.max_tokens_limit == 4096
    assert demo_chat.generation.defaults == {"temperature": 0.7}


def test_parsed_config_carries_text_and_its_sha256() -> None:
    text = yaml.safe_dump(valid())
    parsed = parse_config(text)
    assert parsed.text == text
    assert parsed.sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert parsed.warnings == []
    # a text of megabytes, not ASCII, is hashed a piece at a time to the same digest
    large = text + "".join(f"# é{i:07d}\n" for i in range(300_000))
    assert parse_config(large).sha256 == hashlib.sha256(large.encode()).hexdigest()


# --------------------------------------------------------------------------- YAML level


def test_yaml_syntax_error_names_line_and_column() -> None:
    error = only_error("edge:\n  id: a\n    listen: b\n")
    assert error.path == ""
    assert error.message.startswith("invalid YAML at line 3, column 11")


@pytest.mark.parametrize(
    ("text", "got"),
    [("- a\n- b\n", "got list"), ("42\n", "got int"), ("", "empty document")],
    ids=["list", "scalar", "empty"],
)
def test_top_level_must_be_a_mapping(text: str, got: str) -> None:
    error = assert_only_error(text, "", "top level must be a mapping")
    assert got in error.message


def test_duplicate_key_is_an_error() -> None:
    text = yaml.safe_dump(valid(), sort_keys=False).replace(
        "  capacity: 2\n", "  capacity: 2\n    capacity: 3\n"
    )
    assert_only_error(text, "nodes[0].providers[0].capacity", "duplicate key")


def test_recursive_alias_is_an_error() -> None:
    raw = valid()
    text = yaml.safe_dump(raw, sort_keys=False) + "dispatch: &loop\n  cooldown: *loop\n"
    errors = errors_of(text)
    assert any(e.path == "dispatch.cooldown" and "recursive" in e.message for e in errors)


def test_unreadable_value_is_reported_with_its_position() -> None:
    error = only_error("edge:\n  id: 2024-13-45\n")
    assert error.message.startswith("invalid YAML at line 2, column 7")


# --------------------------------------------------------------------------- shape: keys


def test_unknown_field_is_an_error_with_a_suggestion() -> None:
    raw = valid()
    first_provider(raw)["capcity"] = 4
    error = assert_only_error(raw, "nodes[0].providers[0].capcity", "unknown field")
    assert "did you mean 'capacity'" in error.message


def test_unknown_top_level_section_is_an_error() -> None:
    raw = valid()
    raw["routing"] = {}
    assert_only_error(raw, "routing", "unknown field")


def test_unknown_field_deep_inside_adapter() -> None:
    raw = valid()
    first_provider(raw)["adapter"] = {"ttft": 5}
    assert_only_error(raw, "nodes[0].providers[0].adapter.ttft", "unknown field")


def test_required_field_missing() -> None:
    raw = valid()
    del first_provider(raw)["capacity"]
    assert_only_error(raw, "nodes[0].providers[0].capacity", "required field missing")


# --------------------------------------------------------------------------- shape: types, ranges


def test_wrong_type_is_reported_in_words() -> None:
    raw = valid()
    first_provider(raw)["capacity"] = "four"
    assert_only_error(raw, "nodes[0].providers[0].capacity", "expected int, got str")


def test_section_of_wrong_type() -> None:
    raw = valid()
    raw["dispatch"] = [1, 2]
    assert_only_error(raw, "dispatch", "expected a mapping, got list")


def test_list_of_wrong_type() -> None:
    raw = valid()
    first_provider(raw)["lifecycle"] = "list_models"
    assert_only_error(raw, "nodes[0].providers[0].lifecycle", "expected a list, got str")


def set_at(raw: Raw, where: str, value: Any) -> None:
    """Set `value` at a dotted path (`nodes.0.capacity`), creating missing mappings."""
    target: Any = raw
    *parents, last = where.split(".")
    for part in parents:
        target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
    target[last] = value


def config_path(where: str) -> str:
    """`nodes.0.providers.0.capacity` -> `nodes[0].providers[0].capacity`."""
    return re.sub(r"\.(\d+)", r"[\1]", where)


RANGE_AND_TYPE_CASES: list[tuple[str, Any, str]] = [
    ("nodes.0.providers.0.capacity", 0, "must be >= 1"),
    ("openai.long_context_threshold_tokens", 0, "must be >= 1"),
    ("openai.max_request_bytes", 0, "must be >= 1"),
    ("openai.send_timeout_s", 0, "must be > 0"),
    ("dispatch.max_queue", -1, "must be >= 0"),
    ("dispatch.queue_timeout_ms", 0, "must be >= 1"),
    ("dispatch.retries_before_first_byte", -1, "must be >= 0"),
    ("dispatch.cooldown.failures", 0, "must be >= 1"),
    ("dispatch.cooldown.seconds", 0, "must be > 0"),
    ("models.0.queue.max_queue", -1, "must be >= 0"),
    ("models.0.queue.queue_timeout_ms", 0, "must be >= 1"),
    ("models.0.generation.max_tokens_limit", 0, "must be >= 1"),
    ("nodes.0.providers.0.long_context_slots", -1, "must be >= 0"),
    ("nodes.0.providers.0.adapter.ttft_ms", -1, "must be >= 0"),
    ("nodes.0.providers.0.adapter.tokens_per_second", 0, "must be > 0"),
    ("nodes.0.providers.0.adapter.request_timeout_s", -1.5, "must be > 0"),
    ("nodes.0.providers.0.enabled", "yes please", "expected bool, got str"),
    ("nodes.0.providers.0.priority", 1.5, "expected int, got float"),
    ("models.0.display_name", 7, "expected str, got int"),
]


@pytest.mark.parametrize(
    ("where", "value", "fragment"),
    RANGE_AND_TYPE_CASES,
    ids=[where for where, _, _ in RANGE_AND_TYPE_CASES],
)
def test_range_and_type_constraints(where: str, value: Any, fragment: str) -> None:
    raw = valid()
    set_at(raw, where, value)
    assert_only_error(raw, config_path(where), fragment)


def test_empty_string_is_rejected() -> None:
    raw = valid()
    raw["models"][0]["id"] = ""
    assert_only_error(raw, "models[0].id", "must not be empty")


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("type", "gpu", "ollama, vllm, sglang, lemonade, lmstudio, openai_api, cli, sim"),
        ("category", "cloud", "api, cli, local_inference"),
    ],
)
def test_enumerated_fields_list_their_choices(field: str, value: str, allowed: str) -> None:
    raw = valid()
    first_provider(raw)[field] = value
    error = assert_only_error(raw, f"nodes[0].providers[0].{field}", "must be one of")
    assert allowed in error.message


def test_lifecycle_flag_must_be_known() -> None:
    raw = valid()
    first_provider(raw)["lifecycle"] = ["list_models", "reboot"]
    assert_only_error(raw, "nodes[0].providers[0].lifecycle[1]", "must be one of")


def test_non_string_mapping_key_is_an_error() -> None:
    raw = valid()
    raw["models"][0]["generation"] = {"defaults": {1: "x"}}
    assert_only_error(raw, "models[0].generation.defaults[1]", "invalid key: expected str")


@pytest.mark.parametrize(
    ("where", "path"),
    [
        ("nodes.0.token_hash_sha256", "nodes[0].token_hash_sha256"),
        ("openai.principal_tokens", "openai.principal_tokens[0].token_hash_sha256"),
    ],
)
def test_token_hash_must_be_lowercase_sha256_hex(where: str, path: str) -> None:
    raw = valid()
    bad = NODE_HASH.upper()
    set_at(raw, where, bad if where.startswith("nodes") else [principal("app", bad)])
    error = assert_only_error(raw, path, "must be 64 lowercase hex chars (sha256")
    assert bad not in error.message


def test_a_placeholder_token_hash_says_it_is_one_and_how_to_make_the_hash() -> None:
    """The walkthrough's config holds `REPLACE-WITH-HASH-OF-node-a.token` until its sed."""
    raw = valid()
    raw["nodes"][0]["token_hash_sha256"] = "REPLACE-WITH-HASH-OF-node-a.token"
    error = assert_only_error(raw, "nodes[0].token_hash_sha256", "is still the placeholder")
    assert "iop-edge hash-token < TOKEN-FILE" in error.message


# --------------------------------------------------------------------------- listen addresses


@pytest.mark.parametrize("section", ["edge", "admin", "openai"])
@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("7700", "must be HOST:PORT"),
        (":7700", "must be HOST:PORT"),
        ("127.0.0.1:70000", "0 to 65535"),
        ("127.0.0.1:http", "0 to 65535"),
        ("::1:8080", "in brackets"),
        ("[zz]:8080", "not an IPv6 address"),
        ("300.1.1.1:8080", "not an IPv4 address"),
        ("bad_host!:8080", "not a valid host"),
    ],
)
def test_bad_listen_address(section: str, value: str, fragment: str) -> None:
    raw = valid()
    raw[section] = {"listen": value}
    assert_only_error(raw, f"{section}.listen", fragment)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:0", ListenAddress("127.0.0.1", 0)),
        ("0.0.0.0:65535", ListenAddress("0.0.0.0", 65535)),
        ("[::1]:8080", ListenAddress("::1", 8080)),
        ("localhost:7701", ListenAddress("localhost", 7701)),
        ("edge.internal.example:7700", ListenAddress("edge.internal.example", 7700)),
    ],
)
def test_good_listen_address(value: str, expected: ListenAddress) -> None:
    assert parse_listen_address(value) == expected
    assert str(expected) == value
    raw = valid()
    raw["openai"] = {"listen": value}
    assert parse(raw).config.openai.listen == value


# --------------------------------------------------------------------------- long context slots


def test_long_context_slots_above_capacity_is_an_error() -> None:
    raw = valid()
    first_provider(raw).update(capacity=2, long_context_slots=3)
    assert_only_error(raw, "nodes[0].providers[0].long_context_slots", "0..capacity")


@pytest.mark.parametrize("slots", [None, 0, 2])
def test_long_context_slots_null_or_within_capacity(slots: int | None) -> None:
    raw = valid()
    first_provider(raw).update(capacity=2, long_context_slots=slots)
    assert parse(raw).config.nodes[0].providers[0].long_context_slots == slots


# --------------------------------------------------------------------------- uniqueness


def test_provider_ids_are_unique_across_nodes() -> None:
    raw = valid()
    raw["nodes"].append(
        {"id": "n2", "token_hash_sha256": OTHER_HASH, "providers": [provider("p1")]}
    )
    error = assert_only_error(raw, "nodes[1].providers[0].id", "duplicate provider id 'p1'")
    assert "nodes[0].providers[0]" in error.message


def test_node_ids_are_unique() -> None:
    raw = valid()
    raw["nodes"].append({"id": "n1", "token_hash_sha256": OTHER_HASH})
    assert_only_error(raw, "nodes[1].id", "duplicate node id 'n1'")


def test_model_ids_are_unique() -> None:
    raw = valid()
    raw["models"].append({"id": "m1", "providers": {"p1": "sim-small"}})
    assert_only_error(raw, "models[1].id", "duplicate model id 'm1'")


def test_principal_token_refs_are_unique() -> None:
    raw = valid()
    raw["openai"] = {
        "principal_tokens": [principal("app", NODE_HASH), principal("app", OTHER_HASH)]
    }
    assert_only_error(raw, "openai.principal_tokens[1].token_ref", "duplicate token_ref 'app'")


def test_principal_token_hashes_are_unique_and_not_echoed() -> None:
    raw = valid()
    raw["openai"] = {"principal_tokens": [principal("a", OTHER_HASH), principal("b", OTHER_HASH)]}
    error = assert_only_error(
        raw, "openai.principal_tokens[1].token_hash_sha256", "duplicate token hash"
    )
    assert OTHER_HASH not in error.message


def test_several_tokens_may_share_one_principal() -> None:
    raw = valid()
    raw["openai"] = {
        "principal_tokens": [principal("a", NODE_HASH, "team"), principal("b", OTHER_HASH, "team")]
    }
    tokens = parse(raw).config.openai.principal_tokens
    assert [t.principal_ref for t in tokens] == ["team", "team"]


# --------------------------------------------------------------------------- model references


def test_model_provider_must_exist() -> None:
    raw = valid()
    raw["models"][0]["providers"] = {"p11": "sim-small"}
    error = assert_only_error(raw, "models[0].providers.p11", "unknown provider 'p11'")
    assert "did you mean 'p1'" in error.message


def test_model_target_must_be_served_by_the_provider() -> None:
    raw = valid()
    raw["models"][0]["providers"] = {"p1": "sim-large"}
    error = assert_only_error(raw, "models[0].providers.p1", "does not serve 'sim-large'")
    assert "nodes[0].providers[0].models" in error.message


def test_provider_id_that_is_not_a_plain_word_is_quoted_in_the_path() -> None:
    raw = valid()
    raw["models"][0]["providers"] = {"gpu1.vllm": "x"}
    assert_only_error(raw, 'models[0].providers["gpu1.vllm"]', "unknown provider")


def test_model_without_providers_is_an_error() -> None:
    raw = valid()
    raw["models"][0]["providers"] = {}
    assert_only_error(raw, "models[0].providers", "at least one provider")


# --------------------------------------------------------------------------- adapter settings


@pytest.mark.parametrize("type_", ["vllm", "sglang", "lemonade", "openai_api", "ollama"])
def test_http_provider_requires_base_url(type_: str) -> None:
    raw = valid()
    first_provider(raw).update(type=type_, adapter={})
    assert_only_error(raw, "nodes[0].providers[0].adapter.base_url", f"required for type '{type_}'")


@pytest.mark.parametrize("url", ["127.0.0.1:8000/v1", "ftp://host/v1", "http://"])
def test_base_url_must_be_http_or_https(url: str) -> None:
    raw = valid()
    first_provider(raw).update(type="vllm", adapter={"base_url": url})
    assert_only_error(raw, "nodes[0].providers[0].adapter.base_url", "http:// or https://")


@pytest.mark.parametrize("type_", ["ollama", "lmstudio"])
def test_a_runtime_with_its_openai_api_under_v1_needs_a_base_url_ending_in_it(type_: str) -> None:
    raw = valid()
    first_provider(raw).update(type=type_, adapter={"base_url": "http://127.0.0.1:11434/"})
    error = assert_only_error(raw, "nodes[0].providers[0].adapter.base_url", "under /v1")
    assert "http://127.0.0.1:11434/v1" in error.message
    first_provider(raw).update(adapter={"base_url": "https://proxy.example/ollama/v1/"})
    assert parse(raw).config.nodes[0].providers[0].adapter.base_url


def test_https_base_url_is_accepted() -> None:
    raw = valid()
    first_provider(raw).update(type="openai_api", adapter={"base_url": "https://api.example/v1"})
    assert parse(raw).config.nodes[0].providers[0].adapter.base_url == "https://api.example/v1"


def test_cli_provider_requires_command() -> None:
    raw = valid()
    first_provider(raw).update(type="cli", adapter={})
    assert_only_error(raw, "nodes[0].providers[0].adapter.command", "required for type 'cli'")


def test_cli_command_must_not_be_empty() -> None:
    raw = valid()
    first_provider(raw).update(type="cli", adapter={"command": []})
    assert_only_error(raw, "nodes[0].providers[0].adapter.command", "must not be empty")


@pytest.mark.parametrize(
    ("type_", "key", "value"),
    [
        ("sim", "base_url", "http://127.0.0.1:8000/v1"),
        ("sim", "command", ["llm"]),
        ("sim", "api_key_env", "SIM_KEY"),
        ("cli", "base_url", "http://127.0.0.1:8000/v1"),
        ("cli", "api_key_env", "CLI_KEY"),
        ("vllm", "command", ["llm"]),
        ("ollama", "command", ["llm"]),
    ],
)
def test_adapter_key_not_used_by_type_is_an_error(type_: str, key: str, value: Any) -> None:
    raw = valid()
    entry = provider("p1", type_)
    entry.setdefault("adapter", {})[key] = value
    raw["nodes"][0]["providers"] = [entry]
    assert_only_error(raw, f"nodes[0].providers[0].adapter.{key}", f"not used by type '{type_}'")


@pytest.mark.parametrize("secret", ["sk-proj-abcdef0123456789", "A" * 129])
def test_api_key_env_rejects_secret_values_without_echoing_them(secret: str) -> None:
    raw = valid()
    first_provider(raw).update(
        type="openai_api", adapter={"base_url": "https://api.example/v1", "api_key_env": secret}
    )
    error = assert_only_error(raw, "nodes[0].providers[0].adapter.api_key_env", "secret")
    assert "NAME" in error.message
    assert secret not in error.message


def test_api_key_env_must_be_an_env_var_name() -> None:
    raw = valid()
    first_provider(raw).update(
        type="vllm", adapter={"base_url": "http://h:1/v1", "api_key_env": "my key"}
    )
    assert_only_error(
        raw, "nodes[0].providers[0].adapter.api_key_env", "NAME of an environment variable"
    )


# --------------------------------------------------------------------------- category


@pytest.mark.parametrize(
    ("type_", "category"),
    [
        ("openai_api", "api"),
        ("cli", "cli"),
        ("vllm", "local_inference"),
        ("sglang", "local_inference"),
        ("lemonade", "local_inference"),
        ("ollama", "local_inference"),
        ("sim", "local_inference"),
    ],
)
def test_category_defaults_by_type(type_: str, category: str) -> None:
    raw = valid()
    raw["nodes"][0]["providers"] = [provider("p1", type_)]
    assert parse(raw).config.nodes[0].providers[0].category == category


def test_explicit_category_is_kept() -> None:
    raw = valid()
    raw["nodes"][0]["providers"] = [provider("p1", "vllm", category="api")]
    assert parse(raw).config.nodes[0].providers[0].category == "api"


# --------------------------------------------------------------------------- legacy model_routes


def route(model: str, provider_id: str = "p1", target: str = "sim-small") -> Raw:
    return {"model": model, "provider": provider_id, "target": target}


def test_legacy_route_becomes_a_model_with_a_warning() -> None:
    raw = valid()
    raw["openai"] = {"model_routes": [route("legacy")]}
    parsed = parse(raw)
    models = {model.id: model for model in parsed.config.models}
    assert models["legacy"].providers == {"p1": "sim-small"}
    assert models["m1"].providers == {"p1": "sim-small"}
    assert len(parsed.warnings) == 1
    assert "openai.model_routes[0]" in parsed.warnings[0]
    assert "deprecated" in parsed.warnings[0]
    routes = parsed.config.openai.model_routes
    assert [(r.model, r.provider, r.target) for r in routes] == [("legacy", "p1", "sim-small")]


def test_legacy_routes_for_one_model_merge() -> None:
    raw = valid()
    raw["nodes"][0]["providers"].append(provider("p2", models=["small-2"]))
    raw["openai"] = {"model_routes": [route("legacy"), route("legacy", "p2", "small-2")]}
    parsed = parse(raw)
    legacy = [model for model in parsed.config.models if model.id == "legacy"]
    assert len(legacy) == 1
    assert legacy[0].providers == {"p1": "sim-small", "p2": "small-2"}
    assert len(parsed.warnings) == 2


def test_legacy_route_for_a_model_in_models_is_an_error() -> None:
    raw = valid()
    raw["openai"] = {"model_routes": [route("m1")]}
    assert_only_error(raw, "openai.model_routes[0].model", "also defined in models[]")


def test_legacy_route_provider_must_exist() -> None:
    raw = valid()
    raw["openai"] = {"model_routes": [route("legacy", "p9")]}
    assert_only_error(raw, "openai.model_routes[0].provider", "unknown provider 'p9'")


def test_legacy_route_target_must_be_served() -> None:
    raw = valid()
    raw["openai"] = {"model_routes": [route("legacy", "p1", "nope")]}
    assert_only_error(raw, "openai.model_routes[0].target", "does not serve 'nope'")


def test_legacy_routes_with_conflicting_targets_are_an_error() -> None:
    raw = valid()
    first_provider(raw)["models"] = ["sim-small", "sim-large"]
    raw["openai"] = {"model_routes": [route("legacy"), route("legacy", "p1", "sim-large")]}
    error = assert_only_error(raw, "openai.model_routes[1].target", "already routed")
    assert "openai.model_routes[0]" in error.message


def test_legacy_route_with_unknown_field_is_an_error() -> None:
    raw = valid()
    raw["openai"] = {"model_routes": [{**route("legacy"), "weight": 2}]}
    assert_only_error(raw, "openai.model_routes[0].weight", "unknown field")


# --------------------------------------------------------------------------- all errors at once


def test_every_mistake_is_reported_at_once() -> None:
    raw = valid()
    first_provider(raw).update(capacity=0, capcity=1)
    raw["nodes"].append(
        {"id": "n1", "token_hash_sha256": "nope", "providers": [provider("p1", "vllm", adapter={})]}
    )
    raw["models"].append({"id": "m2", "providers": {"ghost": "x"}})
    raw["edge"] = {"listen": "nowhere"}
    raw["dispatch"] = {"max_queue": -5}
    errors = errors_of(raw)
    assert sorted(e.path for e in errors) == sorted(
        [
            "edge.listen",
            "dispatch.max_queue",
            "nodes[0].providers[0].capacity",
            "nodes[0].providers[0].capcity",
            "nodes[1].id",
            "nodes[1].token_hash_sha256",
            "nodes[1].providers[0].id",
            "nodes[1].providers[0].adapter.base_url",
            "models[1].providers.ghost",
        ]
    )


def test_format_errors_prints_one_path_and_message_per_line() -> None:
    errors = [
        ConfigError(path="nodes[0].id", message="duplicate node id 'n1'"),
        ConfigError(path="", message="invalid YAML at line 1, column 1: oops"),
    ]
    assert format_errors(errors) == (
        "nodes[0].id: duplicate node id 'n1'\ninvalid YAML at line 1, column 1: oops"
    )
    assert str(ConfigInvalid(errors)) == format_errors(errors)


def test_no_message_ever_contains_a_token_hash() -> None:
    secret_hash = hash_token("do-not-leak")
    text = (
        yaml.safe_dump(valid(), sort_keys=False)
        + f"openai:\n  principal_tokens:\n  - {{token_ref: a, token_hash_sha256: {secret_hash},"
        + f" principal_ref: p}}\n  - {{token_ref: b, token_hash_sha256: {secret_hash},"
        + " principal_ref: p, bogus: 1}\n"
    )
    shape_and_rules = errors_of(text)
    assert len(shape_and_rules) == 2
    syntax = errors_of(text.replace(f"{secret_hash},", f"{secret_hash}: :", 1))
    for caught in (shape_and_rules, syntax):
        assert secret_hash not in format_errors(caught)


# --------------------------------------------------------------------------- load_config


def test_load_config_missing_file_is_config_invalid(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigInvalid) as caught:
        load_config(missing)
    (error,) = caught.value.errors
    assert error.path == ""
    assert str(missing) in error.message
    assert "cannot read config file" in error.message


def test_load_config_non_utf8_file_is_config_invalid(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("edge: {id: caf\u00e9}\n".encode("latin-1"))
    with pytest.raises(ConfigInvalid) as caught:
        load_config(path)
    assert "not valid UTF-8" in caught.value.errors[0].message


def test_load_config_hashes_the_file_bytes_exactly(tmp_path: Path) -> None:
    data = yaml.safe_dump(valid()).replace("\n", "\r\n").encode()
    path = tmp_path / "crlf.yaml"
    path.write_bytes(data)
    parsed = load_config(str(path))
    assert parsed.sha256 == hashlib.sha256(data).hexdigest()
    assert parsed.config.nodes[0].id == "n1"


# --------------------------------------------------------------------------- tokens


def test_hash_token_is_sha256_hex_of_the_stripped_token() -> None:
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert hash_token("abc") == abc
    assert hash_token("  abc\n") == abc


def test_tokens_match() -> None:
    expected = hash_token("s3cret")
    assert tokens_match("s3cret", expected)
    assert tokens_match("s3cret\n", expected)
    assert not tokens_match("s3cret2", expected)
    assert not tokens_match("s3cret", expected.upper())
    assert not tokens_match("s3cret", "not-a-hash-\u00e9")


def test_empty_token_never_matches() -> None:
    assert not tokens_match("", hash_token(""))
    assert not tokens_match("  \n", hash_token(""))
