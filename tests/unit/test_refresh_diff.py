"""The pure refresh diff: changed paths, their class (design §5 step 2), and the live subset."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from iop_edge.core.refresh.refresh_diff import (
    compare_configs,
    live_subset,
    live_subset_errors,
)
from schemas.config import EdgeConfig, EdgeSection, OpenAISection, ProviderConfig
from schemas.refresh import Change, RefreshReport

HASH_1 = "1" * 64
HASH_2 = "2" * 64
SECRET_HASH = "c0ffee" + "e" * 58

Mutation = Callable[[dict[str, Any]], None]


def base_dict() -> dict[str, Any]:
    return {
        "openai": {
            "principal_tokens": [
                {"token_ref": "chat-app", "token_hash_sha256": HASH_1, "principal_ref": "team"},
                {"token_ref": "batch", "token_hash_sha256": HASH_2, "principal_ref": "team"},
            ],
        },
        "models": [
            {
                "id": "qwen3.6:35b",
                "display_name": "Qwen",
                "providers": {"gpu1-vllm": "Qwen/Qwen3.6", "gpu2-sim": "sim-small"},
            },
            {"id": "small", "providers": {"gpu2-sim": "sim-small"}},
        ],
        "nodes": [
            {
                "id": "gpu1",
                "token_hash_sha256": HASH_1,
                "providers": [
                    {
                        "id": "gpu1-vllm",
                        "type": "vllm",
                        "models": ["Qwen/Qwen3.6"],
                        "capacity": 8,
                        "adapter": {"base_url": "http://127.0.0.1:8000/v1"},
                    },
                    {"id": "gpu1-sim", "type": "sim", "models": ["sim-small"], "capacity": 4},
                ],
            },
            {
                "id": "gpu2",
                "token_hash_sha256": HASH_2,
                "providers": [
                    {"id": "gpu2-sim", "type": "sim", "models": ["sim-small"], "capacity": 2}
                ],
            },
        ],
    }


def build(data: dict[str, Any]) -> EdgeConfig:
    return msgspec.convert(data, EdgeConfig)


def diff_configs(old: EdgeConfig, new: EdgeConfig) -> list[Change]:
    return list(compare_configs(old, new).changes)


def mutated(mutation: Mutation) -> EdgeConfig:
    data = copy.deepcopy(base_dict())
    mutation(data)
    return build(data)


def model(data: dict[str, Any], model_id: str = "qwen3.6:35b") -> dict[str, Any]:
    return next(m for m in data["models"] if m["id"] == model_id)


def node(data: dict[str, Any], node_id: str = "gpu1") -> dict[str, Any]:
    return next(n for n in data["nodes"] if n["id"] == node_id)


def provider(data: dict[str, Any], provider_id: str = "gpu1-vllm") -> dict[str, Any]:
    return next(p for n in data["nodes"] for p in n["providers"] if p["id"] == provider_id)


def adapter(data: dict[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = provider(data).setdefault("adapter", {})
    return settings


def set_in(getter: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Mutation:
    def mutation(data: dict[str, Any]) -> None:
        getter(data)[key] = value

    return mutation


def section(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda data: data.setdefault(name, {})


def sub(name: str, inner: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda data: data.setdefault(name, {}).setdefault(inner, {})


def remove_model(data: dict[str, Any]) -> None:
    data["models"] = [m for m in data["models"] if m["id"] != "small"]


def add_model(data: dict[str, Any]) -> None:
    data["models"].append({"id": "new-model", "providers": {"gpu1-sim": "sim-small"}})


def add_route(data: dict[str, Any]) -> None:
    data["openai"]["model_routes"] = [
        {"model": "legacy", "provider": "gpu1-sim", "target": "sim-small"}
    ]


def add_node(data: dict[str, Any]) -> None:
    data["nodes"].append({"id": "gpu3", "token_hash_sha256": "3" * 64})


def remove_node(data: dict[str, Any]) -> None:
    data["nodes"] = [n for n in data["nodes"] if n["id"] != "gpu2"]


def add_provider(data: dict[str, Any]) -> None:
    node(data)["providers"].append(
        {"id": "gpu1-extra", "type": "sim", "models": ["x"], "capacity": 1}
    )


def remove_provider(data: dict[str, Any]) -> None:
    node(data)["providers"] = [p for p in node(data)["providers"] if p["id"] != "gpu1-sim"]


def add_token(data: dict[str, Any]) -> None:
    data["openai"]["principal_tokens"].append(
        {"token_ref": "new", "token_hash_sha256": "4" * 64, "principal_ref": "other"}
    )


LIVE_ROWS: list[tuple[str, Mutation, str]] = [
    ("model added", add_model, "models[new-model]"),
    ("model removed", remove_model, "models[small]"),
    (
        "model mapping added",
        lambda d: model(d)["providers"].update({"gpu1-sim": "sim-small"}),
        "models[qwen3.6:35b].providers[gpu1-sim]",
    ),
    (
        "model mapping target",
        lambda d: model(d)["providers"].update({"gpu2-sim": "other"}),
        "models[qwen3.6:35b].providers[gpu2-sim]",
    ),
    (
        "model display_name",
        set_in(model, "display_name", "Qwen 3.6"),
        "models[qwen3.6:35b].display_name",
    ),
    (
        "model generation",
        set_in(model, "generation", {"max_tokens_limit": 4096}),
        "models[qwen3.6:35b].generation.max_tokens_limit",
    ),
    (
        "model generation defaults",
        set_in(model, "generation", {"defaults": {"temperature": 0.2}}),
        "models[qwen3.6:35b].generation.defaults[temperature]",
    ),
    ("model queue", set_in(model, "queue", {"max_queue": 4}), "models[qwen3.6:35b].queue"),
    ("capacity", set_in(provider, "capacity", 9), "nodes[gpu1].providers[gpu1-vllm].capacity"),
    (
        "long_context_slots",
        set_in(provider, "long_context_slots", 2),
        "nodes[gpu1].providers[gpu1-vllm].long_context_slots",
    ),
    ("priority", set_in(provider, "priority", 5), "nodes[gpu1].providers[gpu1-vllm].priority"),
    ("enabled", set_in(provider, "enabled", False), "nodes[gpu1].providers[gpu1-vllm].enabled"),
    (
        "provider models",
        set_in(provider, "models", ["Qwen/Qwen3.6", "b"]),
        "nodes[gpu1].providers[gpu1-vllm].models",
    ),
    (
        "lifecycle",
        set_in(provider, "lifecycle", ["list_models"]),
        "nodes[gpu1].providers[gpu1-vllm].lifecycle",
    ),
    ("category", set_in(provider, "category", "api"), "nodes[gpu1].providers[gpu1-vllm].category"),
    ("dispatch", set_in(section("dispatch"), "max_queue", 1), "dispatch.max_queue"),
    (
        "dispatch nested",
        set_in(sub("dispatch", "cooldown"), "failures", 9),
        "dispatch.cooldown.failures",
    ),
    (
        "long context threshold",
        set_in(section("openai"), "long_context_threshold_tokens", 5),
        "openai.long_context_threshold_tokens",
    ),
    ("model_routes", add_route, "openai.model_routes[legacy,gpu1-sim]"),
]

RESTART_ROWS: list[tuple[str, Mutation, str]] = [
    ("edge id", set_in(section("edge"), "id", "edge-2"), "edge.id"),
    ("edge listen", set_in(section("edge"), "listen", "0.0.0.0:1"), "edge.listen"),
    ("edge state_dir", set_in(section("edge"), "state_dir", "/srv"), "edge.state_dir"),
    ("edge tls", set_in(section("edge"), "tls", {"cert_file": "c", "key_file": "k"}), "edge.tls"),
    ("admin listen", set_in(section("admin"), "listen", "127.0.0.1:1"), "admin.listen"),
    ("openai listen", set_in(section("openai"), "listen", "0.0.0.0:1"), "openai.listen"),
    (
        "max_request_bytes",
        set_in(section("openai"), "max_request_bytes", 10),
        "openai.max_request_bytes",
    ),
    ("principal token added", add_token, "openai.principal_tokens[new]"),
    (
        "principal token ref",
        lambda d: d["openai"]["principal_tokens"][0].update(principal_ref="x"),
        "openai.principal_tokens[chat-app].principal_ref",
    ),
    ("node added", add_node, "nodes[gpu3]"),
    ("node removed", remove_node, "nodes[gpu2]"),
    ("node token", set_in(node, "token_hash_sha256", "5" * 64), "nodes[gpu1].token_hash_sha256"),
    ("node alias", set_in(node, "alias", "rack-a/gpu1"), "nodes[gpu1].alias"),
    ("provider added", add_provider, "nodes[gpu1].providers[gpu1-extra]"),
    ("provider removed", remove_provider, "nodes[gpu1].providers[gpu1-sim]"),
    ("provider type", set_in(provider, "type", "sglang"), "nodes[gpu1].providers[gpu1-vllm].type"),
    (
        "adapter base_url",
        set_in(adapter, "base_url", "http://h/v1"),
        "nodes[gpu1].providers[gpu1-vllm].adapter.base_url",
    ),
    (
        "adapter timeout",
        set_in(adapter, "request_timeout_s", 5.0),
        "nodes[gpu1].providers[gpu1-vllm].adapter.request_timeout_s",
    ),
]


def row_ids(rows: list[tuple[str, Mutation, str]]) -> list[str]:
    return [name for name, _, _ in rows]


@pytest.mark.parametrize(("name", "mutation", "path"), LIVE_ROWS, ids=row_ids(LIVE_ROWS))
def test_live_change(name: str, mutation: Mutation, path: str) -> None:
    changes = diff_configs(build(base_dict()), mutated(mutation))
    assert changes == [Change(path=path, class_="live")], name


@pytest.mark.parametrize(("name", "mutation", "path"), RESTART_ROWS, ids=row_ids(RESTART_ROWS))
def test_restart_required_change(name: str, mutation: Mutation, path: str) -> None:
    changes = diff_configs(build(base_dict()), mutated(mutation))
    assert changes == [Change(path=path, class_="restart_required")], name


# A field this module has never heard of: config sections as a later release might have them.


class _FutureConfig(EdgeConfig, frozen=True, kw_only=True):
    something_new: int = 0


class _FutureEdge(EdgeSection, frozen=True, kw_only=True):
    some_future_field: int = 0


class _FutureOpenAI(OpenAISection, frozen=True, kw_only=True):
    some_future_field: int = 0


class _FutureProvider(ProviderConfig, frozen=True, kw_only=True):
    some_future_field: int = 0


def _with_future_field(config: EdgeConfig, where: str, value: int) -> EdgeConfig:
    fields = msgspec.structs.asdict
    replace = msgspec.structs.replace
    if where == "something_new":
        return _FutureConfig(**fields(config), something_new=value)
    if where == "edge.some_future_field":
        return replace(config, edge=_FutureEdge(**fields(config.edge), some_future_field=value))
    if where == "openai.some_future_field":
        section = _FutureOpenAI(**fields(config.openai), some_future_field=value)
        return replace(config, openai=section)
    [first, *others] = config.nodes
    [provider_, *siblings] = first.providers
    future = _FutureProvider(**fields(provider_), some_future_field=value)
    node_ = replace(first, providers=[future, *siblings])
    return replace(config, nodes=[node_, *others])


@pytest.mark.parametrize(
    "path",
    [
        "edge.some_future_field",
        "nodes[gpu1].providers[gpu1-vllm].some_future_field",
        "openai.some_future_field",
        "something_new",
    ],
)
def test_unknown_paths_are_restart_required(path: str) -> None:
    base = build(base_dict())
    old, new = _with_future_field(base, path, 0), _with_future_field(base, path, 1)
    assert diff_configs(old, new) == [Change(path=path, class_="restart_required")]


def test_dots_and_colons_inside_keys_do_not_confuse_the_class() -> None:
    def dotted(data: dict[str, Any]) -> None:
        node(data)["id"] = "rack.a"
        provider(data, "gpu1-sim")["id"] = "p.v1:x"
        node(data, "gpu2")["id"] = "gpu.1"

    def changed(data: dict[str, Any]) -> None:
        dotted(data)
        provider(data, "p.v1:x")["capacity"] = 7
        model(data)["providers"]["p.v1:x"] = "sim-small"
        node(data, "gpu.1")["alias"] = "moved"

    assert diff_configs(mutated(dotted), mutated(changed)) == [
        Change(path="models[qwen3.6:35b].providers[p.v1:x]", class_="live"),
        Change(path="nodes[gpu.1].alias", class_="restart_required"),
        Change(path="nodes[rack.a].providers[p.v1:x].capacity", class_="live"),
    ]


def test_identical_configs_have_no_changes() -> None:
    diff = compare_configs(build(base_dict()), build(base_dict()))
    assert not diff
    assert diff.changes == ()
    assert (diff.changed_nodes, diff.changed_providers, diff.changed_models) == ((), (), ())


def test_reordering_keyed_lists_is_not_a_change() -> None:
    def reorder(data: dict[str, Any]) -> None:
        data["models"].reverse()
        data["nodes"].reverse()
        node(data)["providers"].reverse()
        data["openai"]["principal_tokens"].reverse()

    assert diff_configs(build(base_dict()), mutated(reorder)) == []


def test_insert_does_not_shift_later_paths() -> None:
    def insert_first_and_change_later(data: dict[str, Any]) -> None:
        node(data)["providers"].insert(
            0, {"id": "gpu1-new", "type": "sim", "models": ["x"], "capacity": 1}
        )
        provider(data, "gpu1-sim")["capacity"] = 5

    changes = diff_configs(build(base_dict()), mutated(insert_first_and_change_later))
    assert [c.path for c in changes] == [
        "nodes[gpu1].providers[gpu1-new]",
        "nodes[gpu1].providers[gpu1-sim].capacity",
    ]


def test_changes_are_sorted_and_touched_ids_derived() -> None:
    def many(data: dict[str, Any]) -> None:
        add_model(data)
        remove_node(data)
        provider(data, "gpu1-sim")["priority"] = 1
        node(data)["alias"] = "renamed"
        data["edge"] = {"listen": "0.0.0.0:9"}
        model(data, "small")["display_name"] = "Small"

    diff = compare_configs(build(base_dict()), mutated(many))
    paths = [c.path for c in diff.changes]
    assert paths == sorted(paths)
    assert paths == [
        "edge.listen",
        "models[new-model]",
        "models[small].display_name",
        "nodes[gpu1].alias",
        "nodes[gpu1].providers[gpu1-sim].priority",
        "nodes[gpu2]",
    ]
    assert diff.live_paths == (
        "models[new-model]",
        "models[small].display_name",
        "nodes[gpu1].providers[gpu1-sim].priority",
    )
    assert diff.restart_required_paths == ("edge.listen", "nodes[gpu1].alias", "nodes[gpu2]")
    # gpu1's alias alone would not need a push; its provider change does.
    assert diff.changed_nodes == ("gpu1", "gpu2")
    assert diff.changed_providers == ("gpu1-sim",)
    assert diff.changed_models == ("new-model", "small")


def test_alias_or_token_change_alone_does_not_mark_the_node_changed() -> None:
    def credentials(data: dict[str, Any]) -> None:
        node(data)["alias"] = "a"
        node(data)["token_hash_sha256"] = "6" * 64

    diff = compare_configs(build(base_dict()), mutated(credentials))
    assert len(diff.changes) == 2
    assert diff.changed_nodes == ()


def test_legacy_route_change_marks_its_model() -> None:
    diff = compare_configs(build(base_dict()), mutated(add_route))
    assert diff.changed_models == ("legacy",)


def test_token_hash_change_shows_the_path_only() -> None:
    def rotate(data: dict[str, Any]) -> None:
        data["openai"]["principal_tokens"][0]["token_hash_sha256"] = SECRET_HASH
        node(data)["token_hash_sha256"] = SECRET_HASH

    diff = compare_configs(build(base_dict()), mutated(rotate))
    report = RefreshReport(
        mode="dry_run",
        outcome="dry_run",
        base_revision=1,
        revision=1,
        changes=list(diff.changes),
        restart_required_paths=list(diff.restart_required_paths),
    )
    encoded = msgspec.json.encode(report).decode()
    assert [c.path for c in diff.changes] == [
        "nodes[gpu1].token_hash_sha256",
        "openai.principal_tokens[chat-app].token_hash_sha256",
    ]
    assert SECRET_HASH not in encoded
    assert HASH_1 not in encoded


def test_change_encodes_its_class_as_class() -> None:
    change = Change(path="dispatch.max_queue", class_="live")
    assert msgspec.json.decode(msgspec.json.encode(change)) == {
        "path": "dispatch.max_queue",
        "class": "live",
    }


def test_report_lists_are_present_and_never_null() -> None:
    report = RefreshReport(mode="apply", outcome="no_change", base_revision=1, revision=2)
    encoded = msgspec.json.decode(msgspec.json.encode(report))
    lists = [
        "changed_nodes",
        "changed_providers",
        "changed_models",
        "changes",
        "live_paths",
        "restart_required_paths",
        "pending_restart",
        "errors",
        "nodes",
    ]
    assert all(encoded[name] == [] for name in lists)


# --- the live subset ----------------------------------------------------------------------


def mixed(data: dict[str, Any]) -> None:
    """Live and restart-required changes together, nested in the same node."""
    data["edge"] = {"listen": "0.0.0.0:9"}
    add_token(data)
    provider(data)["capacity"] = 16
    provider(data)["type"] = "sglang"
    provider(data)["adapter"]["base_url"] = "http://other:1/v1"
    remove_provider(data)
    add_node(data)
    remove_node(data)
    add_model(data)
    model(data)["providers"].pop("gpu2-sim")
    data["dispatch"] = {"max_queue": 7}


def test_live_subset_differs_from_running_in_live_paths_only() -> None:
    old, new = build(base_dict()), mutated(mixed)
    diff = compare_configs(old, new)
    effective = live_subset(old, new, diff)

    assert all(c.class_ == "live" for c in diff_configs(old, effective))
    assert [c.path for c in diff_configs(old, effective)] == list(diff.live_paths)
    assert [c.path for c in diff_configs(effective, new)] == list(diff.restart_required_paths)


def test_live_subset_keeps_running_structure() -> None:
    old, new = build(base_dict()), mutated(mixed)
    effective = live_subset(old, new, compare_configs(old, new))

    assert effective.edge == old.edge
    assert effective.openai.principal_tokens == old.openai.principal_tokens
    assert sorted(n.id for n in effective.nodes) == ["gpu1", "gpu2"]  # gpu3 not added yet
    gpu1 = next(n for n in effective.nodes if n.id == "gpu1")
    vllm = next(p for p in gpu1.providers if p.id == "gpu1-vllm")
    assert (vllm.type, vllm.adapter.base_url) == ("vllm", "http://127.0.0.1:8000/v1")
    assert vllm.capacity == 16  # the live part of the same provider went through
    assert sorted(p.id for p in gpu1.providers) == ["gpu1-sim", "gpu1-vllm"]  # removal waits
    assert effective.dispatch.max_queue == 7
    assert sorted(m.id for m in effective.models) == ["new-model", "qwen3.6:35b", "small"]
    assert live_subset_errors(effective) == []


def test_live_subset_without_restart_changes_is_the_candidate() -> None:
    old = build(base_dict())
    new = mutated(set_in(provider, "capacity", 3))
    assert live_subset(old, new, compare_configs(old, new)) == new


def test_live_subset_cannot_use_a_provider_that_waits_for_a_restart() -> None:
    def add_and_route(data: dict[str, Any]) -> None:
        add_provider(data)
        model(data)["providers"]["gpu1-extra"] = "x"

    old, new = build(base_dict()), mutated(add_and_route)
    effective = live_subset(old, new, compare_configs(old, new))
    errors = live_subset_errors(effective)
    assert [e.path for e in errors] == ["models[qwen3.6:35b].providers[gpu1-extra]"]
    assert "restart" in errors[0].message
