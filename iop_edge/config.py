"""Load and validate the Edge config (SPEC §2): YAML text in, a checked `EdgeConfig` out.

The same pipeline runs at startup, for `iop-edge check-config` and for every refresh
candidate, so a config that loads is a config the Edge can serve. It runs in four steps:

1. **YAML**: text -> plain data. A syntax error stops here and names its line and column.
   A key given twice in one mapping is an error too (PyYAML would silently keep the last).
2. **Shape**: a walker descends the schema Structs in `schemas.config` alongside the data,
   and asks msgspec to check each leaf against its annotated type (so the `Meta`
   constraints written in the schema are the single source of truth for ranges). msgspec
   alone stops at the first error; the walker collects all of them, each with its path.
3. **Rules**: what a type cannot say - unique ids, cross-references between models and
   providers, adapter settings per provider type, listen addresses, no secret values, and
   the legacy `openai.model_routes[]` folded into models (SPEC §2.4). The rules read the
   raw data tolerantly, so one mistyped field does not hide a broken reference elsewhere.
4. **Build**: only when steps 2 and 3 found nothing, msgspec builds the real Structs;
   derived legacy models are appended and every provider's `category` is resolved.

Every problem is a `ConfigError(path, message)` with a path like
`nodes[0].providers[1].capacity`. Messages never echo a token hash or anything that
looks like a secret.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import json
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec
import yaml

from schemas.config import (
    OPENAI_COMPATIBLE_TYPES,
    ConfigError,
    EdgeConfig,
    EnvVarName,
    ModelEntry,
    ProviderType,
    Sha256Hex,
)

__all__ = [
    "ConfigInvalid",
    "ListenAddress",
    "ParsedConfig",
    "format_errors",
    "load_config",
    "parse_config",
    "parse_listen_address",
]


class ConfigInvalid(Exception):
    """The config cannot be used. `errors` lists every problem found, each with its path."""

    errors: list[ConfigError]

    def __init__(self, errors: list[ConfigError]) -> None:
        super().__init__(format_errors(errors))
        self.errors = errors


@dataclass(frozen=True, slots=True)
class ParsedConfig:
    """A config that passed every check, with the text it came from (for audit and diff)."""

    config: EdgeConfig
    """Validated; legacy routes folded into `models`; every provider's `category` set."""
    text: str
    sha256: str
    """sha256 hex of `text` (UTF-8): the config's identity in `/status` and the audit log."""
    warnings: list[str] = field(default_factory=list)
    """Non-fatal notes, e.g. one deprecation warning per legacy `openai.model_routes[]`."""


def parse_config(text: str) -> ParsedConfig:
    """Parse and validate config text; raise `ConfigInvalid` listing every problem."""
    raw, errors = _read_yaml(text)
    if not isinstance(raw, dict):
        got = "an empty document" if raw is None else _kind(raw)
        errors.append(
            ConfigError(
                path="",
                message="the top level must be a mapping of sections (edge, admin, openai, "
                f"dispatch, models, nodes), got {got}",
            )
        )
        raise ConfigInvalid(errors)
    _check_shape(raw, EdgeConfig, "", errors)
    rules = _Rules(raw)
    rules.run()
    errors.extend(rules.errors)
    if errors:
        raise ConfigInvalid(errors)
    return ParsedConfig(
        config=_build(raw, rules.derived_models),
        text=text,
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        warnings=rules.warnings,
    )


def load_config(path: str | os.PathLike[str]) -> ParsedConfig:
    """Read and validate the config file at `path`. An unreadable file is `ConfigInvalid` too.

    The file is decoded as UTF-8 without newline translation, so `sha256` is the digest of
    the file's bytes exactly as they sit on disk.
    """
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigInvalid(
            [ConfigError(path="", message=f"cannot read config file {os.fspath(path)}: {reason}")]
        ) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigInvalid(
            [
                ConfigError(
                    path="",
                    message=f"config file {os.fspath(path)} is not valid UTF-8 "
                    f"(byte offset {exc.start})",
                )
            ]
        ) from exc
    return parse_config(text)


def format_errors(errors: list[ConfigError]) -> str:
    """One `path: message` line per error, in the order they were found."""
    return "\n".join(str(error) for error in errors)


# --------------------------------------------------------------------------- listen addresses


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed `HOST:PORT`; `host` carries no brackets (`::1`, not `[::1]`)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


_PORT_TEXT: Final = re.compile(r"[0-9]{1,5}")
_HOST_LABEL: Final = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME: Final = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")
_DOTTED_NUMBERS: Final = re.compile(r"[0-9.]+")


def parse_listen_address(text: str) -> ListenAddress:
    """Split `HOST:PORT` (an IPv6 host in brackets: `[::1]:8080`). Port 0 means "any free".

    Raises `ValueError` with a message that says what is wrong and what is expected.
    """
    host, colon, port_text = text.rpartition(":")
    if not colon or not host:
        raise ValueError("must be HOST:PORT, like 127.0.0.1:7700 or [::1]:7700")
    if not _PORT_TEXT.fullmatch(port_text) or int(port_text) > 65535:
        raise ValueError("port must be a number from 0 to 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"'{host}' in brackets is not an IPv6 address") from None
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError("an IPv6 host must be in brackets, like [::1]:7700")
    elif _DOTTED_NUMBERS.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"'{host}' is not an IPv4 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"'{host}' is not a valid host name or IP address")
    return ListenAddress(host=host, port=int(port_text))


# --------------------------------------------------------------------------- step 1: YAML


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, with value-construction failures turned into marked errors.

    A plain `SafeLoader` raises a bare `ValueError` (no position, the offending text in its
    message) for things like `2024-13-45` or `!!int abc`, and even an `AttributeError` for
    `!!timestamp abc`.
    """

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, AttributeError) as exc:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                "cannot read this value as its YAML type (an impossible date? an explicit tag "
                "on text?); quote it if it is meant as text",
                node.start_mark,
            ) from exc


def _read_yaml(text: str) -> tuple[object, list[ConfigError]]:
    """Plain data from YAML text, plus an error per duplicate key or recursive alias.

    Raises `ConfigInvalid` on a syntax error. The message is built from the parser's
    problem and position only, never `str(exc)`, which quotes the offending source line
    (and that line may hold a token hash).
    """
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None, []
            errors: list[ConfigError] = []
            _scan_nodes(node, "", errors, set(), set())
            return loader.construct_document(node), errors
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = ", ".join(part for part in (exc.context, exc.problem) if part) or "cannot parse"
        raise ConfigInvalid(
            [ConfigError(path="", message=f"invalid YAML{where}: {problem}")]
        ) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        reason = str(exc).splitlines()[0]
        raise ConfigInvalid(
            [ConfigError(path="", message=f"invalid YAML at character {exc.position}: {reason}")]
        ) from None


_MERGE_TAG: Final = "tag:yaml.org,2002:merge"


def _scan_nodes(
    node: yaml.Node, path: str, errors: list[ConfigError], seen: set[int], parents: set[int]
) -> None:
    """Report keys given twice in one mapping, and aliases that contain themselves.

    A recursive alias (`a: &x [*x]`) would make a value that no JSON encoder can send.
    """
    if id(node) in parents:
        errors.append(ConfigError(path=path, message="recursive YAML alias (refers to itself)"))
        return
    if id(node) in seen:  # an alias to a node checked already
        return
    seen.add(id(node))
    parents.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _scan_nodes(item, _index_path(path, index), errors, seen, parents)
    elif isinstance(node, yaml.MappingNode):
        first_seen: dict[tuple[str, str], str] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key_path = _key_path(path, key_node.value)
            mark = key_node.start_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}"
            signature = (key_node.tag, key_node.value)
            if signature in first_seen:
                errors.append(
                    ConfigError(
                        path=key_path,
                        message=f"duplicate key at {where} (first at {first_seen[signature]})",
                    )
                )
            else:
                first_seen[signature] = where
            _scan_nodes(value_node, key_path, errors, seen, parents)
    parents.discard(id(node))


# --------------------------------------------------------------------------- step 2: shape


@dataclass(frozen=True, slots=True)
class _LeafRule:
    """Human wording for one schema alias, where msgspec's own message would not help."""

    invalid: str
    """Said instead of msgspec's message when a string value is rejected."""
    precheck: Callable[[str], str | None] | None = None
    """Runs first on string values; a message returned here is the error."""


def _secret_like_env_var(value: str) -> str | None:
    if value.startswith(("sk-", "Bearer ")) or len(value) > 128:
        return (
            "looks like a secret value, not an environment variable name: keep the secret in "
            "an environment variable on the Node and give that variable's NAME here "
            "(like OPENAI_API_KEY)"
        )
    return None


#: Keyed by the schema's own aliases, so every field declared with one gets its wording.
_LEAF_RULES: Final[tuple[tuple[object, _LeafRule], ...]] = (
    (Sha256Hex, _LeafRule(invalid="must be 64 lowercase hex chars (sha256)")),
    (
        EnvVarName,
        _LeafRule(
            invalid="must be the NAME of an environment variable (letters, digits and _, not "
            "starting with a digit), like VLLM_API_KEY - never the secret itself",
            precheck=_secret_like_env_var,
        ),
    ),
)


def _check_shape(value: object, tp: Any, path: str, errors: list[ConfigError]) -> None:
    """Append one error per place where `value` does not fit schema type `tp`."""
    if tp is Any:
        return
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        members = typing.get_args(tp)
        present = [member for member in members if member is not type(None)]
        if value is None and len(present) < len(members):
            return
        if len(present) == 1:  # `X | None` holding an X: descend into X
            _check_shape(value, present[0], path, errors)
        else:
            _check_leaf(value, tp, path, errors)
    elif origin is typing.Annotated:
        inner = typing.get_args(tp)[0]
        if _is_struct(inner) or typing.get_origin(inner) in (list, dict):
            before = len(errors)
            _check_shape(value, inner, path, errors)
            if len(errors) == before:  # items are fine; now the container's own constraints
                _check_leaf(value, tp, path, errors)
        else:
            _check_leaf(value, tp, path, errors)
    elif _is_struct(tp):
        _check_struct(value, tp, path, errors)
    elif origin is list:
        if not isinstance(value, list):
            errors.append(ConfigError(path=path, message=f"expected a list, got {_kind(value)}"))
            return
        (item_type,) = typing.get_args(tp)
        for index, item in enumerate(value):
            _check_shape(item, item_type, _index_path(path, index), errors)
    elif origin is dict:
        if not isinstance(value, dict):
            errors.append(ConfigError(path=path, message=f"expected a mapping, got {_kind(value)}"))
            return
        key_type, value_type = typing.get_args(tp)
        for key, item in value.items():
            item_path = _key_path(path, key)
            problem = _leaf_problem(key, key_type)
            if problem is not None:
                errors.append(ConfigError(path=item_path, message=f"invalid key: {problem}"))
            _check_shape(item, value_type, item_path, errors)
    else:
        _check_leaf(value, tp, path, errors)


def _check_struct(
    value: object, cls: type[msgspec.Struct], path: str, errors: list[ConfigError]
) -> None:
    if not isinstance(value, dict):
        errors.append(ConfigError(path=path, message=f"expected a mapping, got {_kind(value)}"))
        return
    fields = {info.encode_name: info for info in msgspec.structs.fields(cls)}
    forbid_unknown = cls.__struct_config__.forbid_unknown_fields
    for key, item in value.items():
        info = fields.get(key) if isinstance(key, str) else None
        if info is not None:
            _check_shape(item, info.type, _key_path(path, key), errors)
        elif forbid_unknown:
            errors.append(
                ConfigError(path=_key_path(path, key), message=_unknown_field(key, fields))
            )
    for name, info in fields.items():
        if info.required and name not in value:
            errors.append(ConfigError(path=_key_path(path, name), message="required field missing"))


def _unknown_field(key: object, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f"unknown field (did you mean '{close[0]}'?)" if close else "unknown field"


def _check_leaf(value: object, tp: Any, path: str, errors: list[ConfigError]) -> None:
    problem = _leaf_problem(value, tp)
    if problem is not None:
        errors.append(ConfigError(path=path, message=problem))


def _leaf_problem(value: object, tp: Any) -> str | None:
    """msgspec's verdict on one value, in human words; None when the value fits."""
    rule = next((candidate for alias, candidate in _LEAF_RULES if alias == tp), None)
    if rule is not None and rule.precheck is not None and isinstance(value, str):
        problem = rule.precheck(value)
        if problem is not None:
            return problem
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError as exc:
        if rule is not None and isinstance(value, str):
            return rule.invalid
        return _humanize(str(exc), tp)
    return None


_MSGSPEC_WHERE: Final = " - at `"
_EXPECTED_GOT: Final = re.compile(r"Expected `(?P<expected>[^`]+)`, got `(?P<got>[^`]+)`")
_BOUND: Final = re.compile(r"Expected `\w+` (?P<op>>=|>|<=|<) (?P<bound>\S+)")
_LENGTH: Final = re.compile(r"Expected `(?P<kind>\w+)` of length (?P<op>>=|<=) (?P<n>\d+)")
_PATTERN: Final = re.compile(r"Expected `str` matching regex (?P<pattern>'.*')")
_TYPE_WORDS: Final = {"object": "mapping", "array": "list"}


def _humanize(message: str, tp: Any) -> str:
    """Reword a msgspec message ("Expected `int` >= 1") for a human ("must be >= 1").

    msgspec quotes the rejected value only for an invalid enum value; that one is answered
    with the allowed choices instead, so no message here repeats what was given.
    """
    message = message.split(_MSGSPEC_WHERE, 1)[0]
    if match := _EXPECTED_GOT.fullmatch(message):
        return f"expected {_type_words(match['expected'])}, got {_type_words(match['got'])}"
    if match := _BOUND.fullmatch(message):
        bound = match["bound"].removesuffix(".0")
        return f"must be {match['op']} {bound}"
    if match := _LENGTH.fullmatch(message):
        size = int(match["n"])
        if match["kind"] == "str" and match["op"] == ">=" and size == 1:
            return "must not be empty"
        unit = "characters" if match["kind"] == "str" else "items"
        least = "at least" if match["op"] == ">=" else "at most"
        return f"must have {least} {size} {unit}"
    if match := _PATTERN.fullmatch(message):
        return f"must match the pattern {match['pattern']}"
    if message.startswith("Invalid enum value"):
        choices = ", ".join(_literal_choices(tp))
        return f"must be one of: {choices}" if choices else "not an allowed value"
    return message[:1].lower() + message[1:]


def _type_words(msgspec_types: str) -> str:
    names = [_TYPE_WORDS.get(name, name) for name in msgspec_types.split(" | ")]
    return " or ".join(names)


def _literal_choices(tp: Any) -> list[str]:
    if typing.get_origin(tp) is typing.Literal:
        return [str(choice) for choice in typing.get_args(tp)]
    return [choice for member in typing.get_args(tp) for choice in _literal_choices(member)]


def _is_struct(tp: object) -> typing.TypeGuard[type[msgspec.Struct]]:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _kind(value: object) -> str:
    """A value's type in YAML words, for "expected X, got Y"."""
    match value:
        case None:
            return "null"
        case dict():
            return "mapping"
        case list():
            return "list"
        case _:
            return type(value).__name__


# --------------------------------------------------------------------------- paths


_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


def _key_path(path: str, key: object) -> str:
    """`path.key`; a key that is not a plain word is quoted: `providers["qwen3.6:35b"]`."""
    if isinstance(key, str) and _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    quoted = json.dumps(key) if isinstance(key, str) else repr(key)
    return f"{path}[{quoted}]"


def _index_path(path: str, index: int) -> str:
    return f"{path}[{index}]"


def _from_msgspec(exc: msgspec.ValidationError) -> ConfigError:
    """A msgspec error as a ConfigError: `$.nodes[0].id` becomes `nodes[0].id`."""
    message, _, where = str(exc).partition(_MSGSPEC_WHERE)
    path = where.rstrip("`").removeprefix("$").removeprefix(".")
    return ConfigError(path=path, message=_humanize(message, None))


# --------------------------------------------------------------------------- step 3: rules


#: Adapter keys that only some provider types use (SPEC §9), and the types that need them.
_HTTP_TYPES: Final = OPENAI_COMPATIBLE_TYPES | {"ollama"}
_ADAPTER_KEY_TYPES: Final[dict[str, frozenset[str]]] = {
    "base_url": _HTTP_TYPES,
    "api_key_env": _HTTP_TYPES,
    "command": frozenset({"cli"}),
}
_ALL_PROVIDER_TYPES: Final = frozenset(typing.get_args(ProviderType))
_REQUIRED_ADAPTER_KEY: Final[dict[str, str]] = dict.fromkeys(_HTTP_TYPES, "base_url") | {
    "cli": "command"
}


@dataclass(frozen=True, slots=True)
class _Provider:
    path: str
    """Where the provider is defined: `nodes[0].providers[1]`."""
    models: list[str] | None
    """Its served model names; None when that field itself is malformed."""


@dataclass(frozen=True, slots=True)
class _Mapping:
    """One `provider -> served name` entry of a model, with the paths to blame."""

    provider: str
    target: str
    provider_path: str
    target_path: str


class _Rules:
    """The rules no type can express (SPEC §2.1, §2.4), read tolerantly from raw data.

    A field of the wrong type is skipped here (the shape step already reported it), so a
    rule only ever reports its own kind of problem.
    """

    def __init__(self, raw: dict[Any, Any]) -> None:
        self.raw = raw
        self.errors: list[ConfigError] = []
        self.warnings: list[str] = []
        self.derived_models: dict[str, dict[str, str]] = {}
        """Models built from legacy routes: id -> {provider id: served name}."""

    def run(self) -> None:
        self._listen_addresses()
        self._principal_tokens()
        providers = self._providers()
        explicit_models = self._models(providers)
        self._legacy_routes(explicit_models, providers)

    def _error(self, path: str, message: str) -> None:
        self.errors.append(ConfigError(path=path, message=message))

    def _listen_addresses(self) -> None:
        for section in ("edge", "admin", "openai"):
            listen = _mapping(self.raw.get(section)).get("listen")
            if isinstance(listen, str) and listen:
                try:
                    parse_listen_address(listen)
                except ValueError as exc:
                    self._error(f"{section}.listen", str(exc))

    def _principal_tokens(self) -> None:
        openai = _mapping(self.raw.get("openai"))
        refs = _FirstSeen()
        hashes = _FirstSeen()
        for path, token in _entries(openai.get("principal_tokens"), "openai.principal_tokens"):
            token_ref = _text(token.get("token_ref"))
            if token_ref is not None and (first := refs.repeat(token_ref, path)):
                self._error(f"{path}.token_ref", f"duplicate token_ref '{token_ref}' ({first})")
            token_hash = _text(token.get("token_hash_sha256"))
            if token_hash is not None and (first := hashes.repeat(token_hash, path)):
                # Never echo the hash: say where the twin is, not what it is.
                self._error(f"{path}.token_hash_sha256", f"duplicate token hash ({first})")

    def _providers(self) -> dict[str, _Provider]:
        """Check nodes and their providers; return every provider by id (first wins)."""
        node_ids = _FirstSeen()
        provider_ids = _FirstSeen()
        providers: dict[str, _Provider] = {}
        for node_path, node in _entries(self.raw.get("nodes"), "nodes"):
            node_id = _text(node.get("id"))
            if node_id is not None and (first := node_ids.repeat(node_id, node_path)):
                self._error(f"{node_path}.id", f"duplicate node id '{node_id}' ({first})")
            for path, provider in _entries(node.get("providers"), f"{node_path}.providers"):
                provider_id = _text(provider.get("id"))
                if provider_id is not None:
                    if first := provider_ids.repeat(provider_id, path):
                        self._error(
                            f"{path}.id",
                            f"duplicate provider id '{provider_id}' ({first}); provider ids "
                            "are unique across all nodes",
                        )
                    else:
                        providers[provider_id] = _Provider(path, _text_list(provider, "models"))
                self._long_context_slots(path, provider)
                self._adapter(path, provider)
        return providers

    def _long_context_slots(self, path: str, provider: dict[Any, Any]) -> None:
        slots = _integer(provider.get("long_context_slots"))
        capacity = _integer(provider.get("capacity"))
        if slots is not None and capacity is not None and capacity >= 1 and slots > capacity:
            self._error(
                f"{path}.long_context_slots",
                f"must be null or 0..capacity (capacity is {capacity})",
            )

    def _adapter(self, path: str, provider: dict[Any, Any]) -> None:
        provider_type = provider.get("type")
        if not isinstance(provider_type, str) or provider_type not in _ALL_PROVIDER_TYPES:
            return  # unknown or missing type: already reported by the shape step
        adapter = provider.get("adapter", {})
        if not isinstance(adapter, dict):
            return  # mistyped: the shape step said so
        adapter_path = f"{path}.adapter"
        for key, types_using in _ADAPTER_KEY_TYPES.items():
            if adapter.get(key) is not None and provider_type not in types_using:
                users = ", ".join(sorted(types_using))
                self._error(
                    f"{adapter_path}.{key}",
                    f"not used by type '{provider_type}' (only by: {users})",
                )
        required = _REQUIRED_ADAPTER_KEY.get(provider_type)
        if required is not None and adapter.get(required) is None:
            what = "the upstream URL" if required == "base_url" else "the argv to run"
            self._error(
                f"{adapter_path}.{required}",
                f"required for type '{provider_type}' ({what})",
            )
        base_url = _text(adapter.get("base_url"))
        if provider_type in _HTTP_TYPES and base_url is not None and not _is_http_url(base_url):
            self._error(
                f"{adapter_path}.base_url",
                "must be an http:// or https:// URL with a host, like http://127.0.0.1:8000/v1",
            )
        command = adapter.get("command")
        if provider_type == "cli" and command == []:
            self._error(
                f"{adapter_path}.command", "must not be empty: give the argv to run, as a list"
            )

    def _models(self, providers: dict[str, _Provider]) -> set[str]:
        """Check `models[]`; return the ids defined there."""
        model_ids = _FirstSeen()
        for path, model in _entries(self.raw.get("models"), "models"):
            model_id = _text(model.get("id"))
            if model_id is not None and (first := model_ids.repeat(model_id, path)):
                self._error(f"{path}.id", f"duplicate model id '{model_id}' ({first})")
            mapping = model.get("providers")
            if not isinstance(mapping, dict):
                continue  # missing or mistyped: the shape step said so
            if not mapping:
                self._error(
                    f"{path}.providers",
                    "a model needs at least one provider (provider id -> served model name)",
                )
            for provider_id, target in mapping.items():
                if isinstance(provider_id, str) and isinstance(target, str):
                    entry_path = _key_path(f"{path}.providers", provider_id)
                    self._mapping(
                        _Mapping(provider_id, target, entry_path, entry_path),
                        providers,
                    )
        return set(model_ids.first)

    def _legacy_routes(self, explicit_models: set[str], providers: dict[str, _Provider]) -> None:
        """Fold `openai.model_routes[]` into derived models (SPEC §2.4)."""
        openai = _mapping(self.raw.get("openai"))
        route_of: dict[tuple[str, str], str] = {}
        for path, route in _entries(openai.get("model_routes"), "openai.model_routes"):
            model_id = _text(route.get("model"))
            provider_id = _text(route.get("provider"))
            target = _text(route.get("target"))
            if model_id is None or provider_id is None or target is None:
                continue  # incomplete: the shape step said so
            if model_id in explicit_models:
                self._error(
                    f"{path}.model",
                    f"model '{model_id}' is also defined in models[]; move this route into "
                    "that entry's providers map",
                )
                continue
            self.warnings.append(
                f"{path}: openai.model_routes is deprecated; read as models[] entry "
                f"{{id: {model_id}, providers: {{{provider_id}: {target}}}}} - move it to "
                "models[]"
            )
            derived = self.derived_models.setdefault(model_id, {})
            earlier = route_of.get((model_id, provider_id))
            if earlier is not None and derived[provider_id] != target:
                self._error(
                    f"{path}.target",
                    f"model '{model_id}' is already routed to provider '{provider_id}' with "
                    f"another target ({earlier})",
                )
                continue
            route_of.setdefault((model_id, provider_id), path)
            derived[provider_id] = target
            self._mapping(
                _Mapping(provider_id, target, f"{path}.provider", f"{path}.target"),
                providers,
            )

    def _mapping(self, mapping: _Mapping, providers: dict[str, _Provider]) -> None:
        """A model's provider must exist and must serve the target name."""
        provider = providers.get(mapping.provider)
        if provider is None:
            close = difflib.get_close_matches(mapping.provider, list(providers), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            self._error(mapping.provider_path, f"unknown provider '{mapping.provider}'{hint}")
        elif provider.models is not None and mapping.target not in provider.models:
            self._error(
                mapping.target_path,
                f"provider '{mapping.provider}' does not serve '{mapping.target}' (its models: "
                f"{', '.join(provider.models) or 'none'}); add it to {provider.path}.models",
            )


class _FirstSeen:
    """Remembers where each value was first seen, to name it in a "duplicate" error."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}

    def repeat(self, value: str, path: str) -> str:
        """'' the first time `value` is seen; afterwards "first at <path>"."""
        first = self.first.setdefault(value, path)
        return "" if first == path else f"first at {first}"


def _mapping(value: object) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _entries(value: object, path: str) -> Iterator[tuple[str, dict[Any, Any]]]:
    """`(path[i], item)` for the mapping items of a list; anything else is skipped."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, dict):
                yield _index_path(path, index), item


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_list(item: dict[Any, Any], key: str) -> list[str] | None:
    value = item.get(key)
    if isinstance(value, list) and all(isinstance(entry, str) for entry in value):
        return value
    return None


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


# --------------------------------------------------------------------------- step 4: build


def _build(raw: dict[Any, Any], derived_models: dict[str, dict[str, str]]) -> EdgeConfig:
    """The real Structs, with legacy models appended and provider categories resolved."""
    try:
        config = msgspec.convert(raw, EdgeConfig)
    except msgspec.ValidationError as exc:  # the shape step should have caught it: report it
        raise ConfigInvalid([_from_msgspec(exc)]) from None
    nodes = [
        msgspec.structs.replace(
            node,
            providers=[
                msgspec.structs.replace(provider, category=provider.effective_category)
                for provider in node.providers
            ],
        )
        for node in config.nodes
    ]
    legacy = [
        ModelEntry(id=model_id, providers=providers)
        for model_id, providers in derived_models.items()
    ]
    return msgspec.structs.replace(config, nodes=nodes, models=[*config.models, *legacy])
