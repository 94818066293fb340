"""Tests for `iop_edge.core.configuration.config_shape`: the schema walker that reports every
misfit.

The schemas here are small ones written for the test, so each test shows one habit of the
walker without the Edge's rules in the way (those are covered in `test_config.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import pytest
from msgspec import Meta

from iop_edge.core.configuration.config_shape import (
    LeafWording,
    check_shape,
    error_from_msgspec,
    index_path,
    key_path,
    kind_of,
)
from schemas.config import ConfigError

Port = Annotated[int, Meta(ge=0, le=65535)]
Name = Annotated[str, Meta(min_length=1)]
Code = Annotated[str, Meta(pattern=r"^[A-Z]{3}$")]


class Listener(msgspec.Struct, forbid_unknown_fields=True):
    host: Name
    port: Port


class Service(msgspec.Struct, forbid_unknown_fields=True):
    name: Name
    listeners: list[Listener]
    mode: Literal["fast", "safe"] = "safe"
    tags: Annotated[list[Name], Meta(max_length=2)] = []
    labels: dict[Name, int] = {}
    note: str | None = None
    extra: Any = None


class Loose(msgspec.Struct):
    name: str


def pairs(errors: list[ConfigError]) -> list[tuple[str, str]]:
    return [(error.path, error.message) for error in errors]


def test_a_fitting_value_has_no_errors_and_converts() -> None:
    value = {
        "name": "svc",
        "listeners": [{"host": "h", "port": 80}],
        "mode": "fast",
        "tags": ["a"],
        "labels": {"x": 1},
        "note": None,
        "extra": {"anything": ["goes"]},
    }
    assert check_shape(value, Service) == []
    assert msgspec.convert(value, Service).listeners[0].port == 80


def test_every_error_is_collected_where_msgspec_stops_at_the_first() -> None:
    value = {
        "name": "",
        "listeners": [{"host": "h", "port": 70000}, {"host": 1, "port": "80"}],
        "mode": "slow",
        "nmae": "typo",
    }
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(value, Service)
    assert pairs(check_shape(value, Service)) == [
        ("name", "must not be empty"),
        ("listeners[0].port", "must be <= 65535"),
        ("listeners[1].host", "expected str, got int"),
        ("listeners[1].port", "expected int, got str"),
        ("mode", "must be one of: fast, safe"),
        ("nmae", "unknown field (did you mean 'name'?)"),
    ]


def test_missing_required_fields_are_reported_after_the_given_ones() -> None:
    assert pairs(check_shape({"bogus": 1}, Service)) == [
        ("bogus", "unknown field"),
        ("name", "required field missing"),
        ("listeners", "required field missing"),
    ]


def test_unknown_fields_pass_when_the_struct_allows_them() -> None:
    assert check_shape({"name": "x", "other": 1}, Loose) == []


def test_wrong_container_kinds_are_named_in_yaml_words() -> None:
    value = {"name": "x", "listeners": {"host": "h"}, "labels": ["a"]}
    assert pairs(check_shape(value, Service)) == [
        ("listeners", "expected a list, got mapping"),
        ("labels", "expected a mapping, got list"),
    ]
    assert pairs(check_shape([1], Service)) == [("", "expected a mapping, got list")]


def test_a_container_constraint_is_checked_only_once_its_items_fit() -> None:
    base: dict[str, Any] = {"name": "x", "listeners": []}
    assert pairs(check_shape({**base, "tags": ["a", "b", "c"]}, Service)) == [
        ("tags", "must have at most 2 items")
    ]
    assert pairs(check_shape({**base, "tags": ["a", "", "c"]}, Service)) == [
        ("tags[1]", "must not be empty")
    ]


def test_dict_keys_are_checked_and_odd_keys_are_quoted_in_the_path() -> None:
    value = {"name": "x", "listeners": [], "labels": {"": 1, "qwen3.6:35b": "two"}}
    assert pairs(check_shape(value, Service)) == [
        ('labels[""]', "invalid key: must not be empty"),
        ('labels["qwen3.6:35b"]', "expected int, got str"),
    ]


def test_an_invalid_choice_is_answered_without_echoing_the_value() -> None:
    (error,) = check_shape({"name": "x", "listeners": [], "mode": "sk-secret"}, Service)
    assert error.message == "must be one of: fast, safe"
    assert "sk-secret" not in error.message


def test_leaf_wording_replaces_msgspec_message_for_strings_only() -> None:
    wording = {Code: LeafWording(invalid="must be three capital letters, like ABC")}
    assert pairs(check_shape("abc", Code, wording=wording)) == [
        ("", "must be three capital letters, like ABC")
    ]
    assert pairs(check_shape(7, Code, wording=wording)) == [("", "expected str, got int")]
    assert pairs(check_shape("abc", Code)) == [("", "must match the pattern '^[A-Z]{3}$'")]


def test_leaf_wording_precheck_speaks_first() -> None:
    def no_secrets(value: str) -> str | None:
        return "looks like a secret" if value.startswith("sk-") else None

    wording = {Code: LeafWording(invalid="must be three capital letters", precheck=no_secrets)}
    assert pairs(check_shape(["sk-1", "abc", "ABC"], list[Code], wording=wording)) == [
        ("[0]", "looks like a secret"),
        ("[1]", "must be three capital letters"),
    ]


def test_wording_lookup_tolerates_unhashable_annotated_metadata() -> None:
    odd = Annotated[int, {"unhashable": True}]
    wording = {Code: LeafWording(invalid="never used")}
    assert pairs(check_shape("1", odd, wording=wording)) == [("", "expected int, got str")]


@pytest.mark.parametrize(
    ("path", "key", "expected"),
    [
        ("", "edge", "edge"),
        ("edge", "tls", "edge.tls"),
        ("models[0].providers", "qwen3.6:35b", 'models[0].providers["qwen3.6:35b"]'),
        ("labels", 3, "labels[3]"),
        ("labels", None, "labels[None]"),
    ],
)
def test_key_path(path: str, key: object, expected: str) -> None:
    assert key_path(path, key) == expected


def test_index_path() -> None:
    assert index_path("nodes", 2) == "nodes[2]"


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "null"), ({}, "mapping"), ([], "list"), ("x", "str"), (1.5, "float")],
)
def test_kind_of(value: object, expected: str) -> None:
    assert kind_of(value) == expected


def test_error_from_msgspec_reads_its_path_and_rewords_it() -> None:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.convert({"name": "x", "listeners": [{"host": "h", "port": -1}]}, Service)
    assert error_from_msgspec(caught.value) == ConfigError(
        path="listeners[0].port", message="must be >= 0"
    )


EnvName = Annotated[str, Meta(pattern=r"^[A-Z_]+$")]


class Account(msgspec.Struct, forbid_unknown_fields=True):
    name: Name
    key_env: EnvName | None = None


class Team(msgspec.Struct, forbid_unknown_fields=True):
    accounts: list[Account]
    service: Service | None = None


def _no_long_names(value: str) -> str | None:
    return "looks like a secret" if len(value) > 8 else None


def test_a_value_msgspec_takes_whole_still_runs_the_prechecks_below_it() -> None:
    # Every leaf fits its type, so msgspec converts the whole value at once (Rule 6); the
    # precheck of the one leaf whose wording has one still speaks.
    wording = {EnvName: LeafWording(invalid="never used", precheck=_no_long_names)}
    value = {"accounts": [{"name": "a", "key_env": "SHORT"}, {"name": "b", "key_env": "X" * 9}]}
    msgspec.convert(value, Team)
    assert pairs(check_shape(value, Team, wording=wording)) == [
        ("accounts[1].key_env", "looks like a secret")
    ]


def test_below_a_misfit_the_walk_reports_misfits_and_prechecks_in_document_order() -> None:
    wording = {EnvName: LeafWording(invalid="never used", precheck=_no_long_names)}
    value = {"accounts": [{"name": "", "key_env": "X" * 9}, {"name": "b", "key_env": "X" * 9}]}
    assert pairs(check_shape(value, Team, wording=wording)) == [
        ("accounts[0].name", "must not be empty"),
        ("accounts[0].key_env", "looks like a secret"),
        ("accounts[1].key_env", "looks like a secret"),
    ]
