"""Step 3 of loading the Edge config: the rules no type can express (design §2.1, §2.4).

Unique ids, cross-references between models, providers and principals, adapter settings
per provider type, listen addresses, the ledger and telemetry settings, no secret
values, and the legacy `openai.model_routes[]` folded into models. `core.configuration.config` runs
them on the raw data after the shape step (step 2) and before the build (step 4); they
read it tolerantly, so one mistyped field does not hide a broken reference elsewhere.
"""

from __future__ import annotations

import difflib
import importlib.util
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Final
from urllib.parse import urlsplit

from iop_edge.core.configuration.config_shape import index_path, key_path
from iop_edge.core.configuration.ledger_url import parse_ledger_url
from iop_edge.core.configuration.listen import ListenAddress, parse_listen_address
from iop_edge.core.configuration.tokens import DEMO_NODE_TOKEN_SHA256
from iop_edge.core.generation_defaults import defaults_problems
from iop_edge.core.lifecycle import lifecycle_problems
from iop_edge.core.principals import ANONYMOUS_PRINCIPAL
from schemas.config import (
    DEFAULT_MAX_TOKENS_LIMIT,
    EVERY_OTHER_PRINCIPAL,
    OPENAI_COMPATIBLE_TYPES,
    ConfigError,
    NodeEntry,
    ProviderType,
)

__all__ = ["ConfigRules", "listens_on_loopback"]


#: Adapter keys that only some provider types use (design §9), and the types that need them.
_HTTP_TYPES: Final = OPENAI_COMPATIBLE_TYPES | {"ollama"}
_ADAPTER_KEY_TYPES: Final[dict[str, frozenset[str]]] = {
    "base_url": _HTTP_TYPES,
    "api_key_env": _HTTP_TYPES,
    "command": frozenset({"cli"}),
    "max_loaded": frozenset({"sim"}),
    "prefix_cache_tokens": frozenset({"sim"}),
    "prefill_us_per_token": frozenset({"sim"}),
    "cached_prefill_us_per_token": frozenset({"sim"}),
}
#: provider type -> (adapter key it cannot run without, what that key gives it).
_REQUIRED_ADAPTER_KEY: Final[dict[str, tuple[str, str]]] = dict.fromkeys(
    _HTTP_TYPES, ("base_url", "the upstream URL")
) | {"cli": ("command", "the argv to run")}
#: Runtimes that serve their OpenAI-compatible API under `/v1` of their root and their own
#: API beside it (Ollama's `/api`, LM Studio's `/api/v1`): the adapter finds the root by
#: taking `/v1` off `base_url`, so a base URL without it sends every run to a 404.
_OPENAI_API_UNDER_V1: Final = frozenset({"ollama", "lmstudio"})
_ALL_PROVIDER_TYPES: Final = frozenset(typing.get_args(ProviderType))
_SIM_PREFILL_KEYS: Final = ("cached_prefill_us_per_token", "prefill_us_per_token")


@dataclass(frozen=True, slots=True)
class _Provider:
    path: str
    """Where the provider is defined: `nodes[0].providers[1]`."""
    models: list[str] | None
    """Its served model names; None when that field itself is malformed."""


class ConfigRules:
    """The rules no type can express (design §2.1, §2.4), read tolerantly from raw data.

    A field of the wrong type is skipped here (the shape step already reported it), so a
    rule only ever reports its own kind of problem.
    """

    def __init__(
        self, raw: dict[Any, Any], *, proven: Mapping[int, NodeEntry] | None = None
    ) -> None:
        self.raw = raw
        self.proven: Mapping[int, NodeEntry] = proven or {}
        """By index in `nodes`, the entries a proof holds: only the rules that span
        entries run on them (`core.configuration.config_proof` Rule 3)."""
        self.openai = _as_dict(raw.get("openai"))
        self.errors: list[ConfigError] = []
        self.warnings: list[str] = []
        self.derived_models: dict[str, dict[str, str]] = {}
        """Models built from legacy routes: id -> {provider id: served name}."""

    def run(self) -> None:
        self._listen_addresses()
        self._ledger()
        self._telemetry()
        self._principal_tokens()
        providers = self._providers()
        explicit_models = self._models(providers)
        self._legacy_routes(explicit_models, providers)
        self._principals(explicit_models | set(self.derived_models))

    def _error(self, path: str, message: str) -> None:
        self.errors.append(ConfigError(path=path, message=message))

    def _listen_addresses(self) -> None:
        bound: dict[str, ListenAddress] = {}
        for section in ("edge", "admin", "openai"):
            listen = _text(_as_dict(self.raw.get(section)).get("listen"))
            if listen is None:
                continue
            try:
                address = parse_listen_address(listen)
            except ValueError as exc:
                self._error(f"{section}.listen", str(exc))
                continue
            for other, taken in bound.items():
                if address.clashes_with(taken):
                    self._error(
                        f"{section}.listen",
                        f"{listen} is also {other}.listen: each listener needs its own port",
                    )
            bound[section] = address
            if section == "admin" and not address.is_loopback:
                # design §5.1: the admin API never listens beyond this machine.
                self._error(
                    "admin.listen",
                    f"{listen} is not a loopback address; the admin API only listens on "
                    "127.0.0.1, ::1 or localhost",
                )

    def _loopback(self, section: str) -> bool:
        return listens_on_loopback(self.raw, section)

    def _ledger(self) -> None:
        ledger = _text(_as_dict(self.raw.get("edge")).get("ledger"))
        if ledger is not None:
            try:
                parse_ledger_url(ledger)
            except ValueError as exc:
                self._error("edge.ledger", str(exc))

    def _telemetry(self) -> None:
        """`edge.telemetry.endpoint` (design §16): an OTLP/HTTP URL, and the SDK that
        exports to it installed (else `serve` would refuse to start)."""
        endpoint = _text(_as_dict(_as_dict(self.raw.get("edge")).get("telemetry")).get("endpoint"))
        if endpoint is None:
            return
        if not _is_http_url(endpoint):
            self._error(
                "edge.telemetry.endpoint",
                f"{endpoint!r} is not an http:// or https:// URL; OTLP/HTTP receivers "
                "listen on e.g. http://collector:4318",
            )
        elif not _installed("opentelemetry.sdk"):
            self._error(
                "edge.telemetry.endpoint",
                "tracing is configured but the OpenTelemetry SDK is not installed: "
                "pip install 'iop-gateway[otel]'",
            )

    def _principal_tokens(self) -> None:
        refs = _FirstSeen()
        hashes = _FirstSeen()
        tokens = self.openai.get("principal_tokens")
        for path, token in _entries(tokens, "openai.principal_tokens"):
            token_ref = _text(token.get("token_ref"))
            if first := refs.repeat(token_ref, path):
                self._error(f"{path}.token_ref", f"duplicate token_ref '{token_ref}' ({first})")
            if first := hashes.repeat(_text(token.get("token_hash_sha256")), path):
                # Never echo the hash: say where the twin is, not what it is.
                self._error(f"{path}.token_hash_sha256", f"duplicate token hash ({first})")

    def _principals(self, model_ids: set[str]) -> None:
        """`principals[]` (design §15): each ref names a principal callers can be, once.

        A model pattern that matches no model is only a warning: models come and go with
        refreshes, and an allow-list may name one before it exists. It is one warning per
        pattern, however many entries repeat it: a list of ten thousand principals
        written from one template must not flood the log with identical lines.

        Linear in the entries: each distinct pattern is matched against the models once,
        and the "did you mean" hints of unknown refs share a bounded budget
        (`_HINT_BUDGET`)."""
        tokens = self.openai.get("principal_tokens")
        known = {
            ref
            for _, token in _entries(tokens, "openai.principal_tokens")
            if (ref := _text(token.get("principal_ref"))) is not None
        }
        if not (isinstance(tokens, list) and tokens):
            known.add(ANONYMOUS_PRINCIPAL)  # an open API: every caller is anonymous
        where = (
            "a principal_ref of openai.principal_tokens"
            if ANONYMOUS_PRINCIPAL not in known
            else "'anonymous' (no openai.principal_tokens are configured)"
        )
        hints = _Hints(known)
        refs = _FirstSeen()
        matches: dict[str, bool] = {}  # pattern -> matches a model (configs repeat them)
        unmatched: dict[str, list[str]] = {}  # pattern -> where it is named, in order
        for path, entry in _entries(self.raw.get("principals"), "principals"):
            ref = _text(entry.get("ref"))
            if first := refs.repeat(ref, path):
                self._error(f"{path}.ref", f"duplicate ref '{ref}' ({first})")
            elif ref is not None and ref != EVERY_OTHER_PRINCIPAL and ref not in known:
                self._error(
                    f"{path}.ref",
                    f"unknown principal '{ref}'{hints.did_you_mean(ref)}: a ref is {where}, "
                    "or '*' for every principal not listed",
                )
            for index, pattern in enumerate(_text_list(entry.get("models")) or []):
                matched = matches.get(pattern)
                if matched is None:
                    matched = any(fnmatchcase(model, pattern) for model in model_ids)
                    matches[pattern] = matched
                if pattern and not matched:
                    unmatched.setdefault(pattern, []).append(f"{path}.models[{index}]")
        for pattern, places in unmatched.items():
            others = len(places) - 1
            also = f"; {others:,} more entries name it too" if others else ""
            self.warnings.append(
                f"{places[0]}: '{pattern}' matches no model in models[] (yet); this "
                f"principal cannot use it until one is added{also}"
            )

    def _providers(self) -> dict[str, _Provider]:
        """Check nodes and their providers; return every provider by id (first wins).

        An entry a proof holds is read from its Structs (its raw data may not even have
        been parsed, `_Read.known`), and only the rules that span entries run on it."""
        node_ids = _FirstSeen()
        provider_ids = _FirstSeen()
        providers: dict[str, _Provider] = {}
        nodes = self.raw.get("nodes")
        for index, node in enumerate(nodes if isinstance(nodes, list) else []):
            node_path = index_path("nodes", index)
            proven = self.proven.get(index)
            if proven is not None:
                self._node_id(node_ids, proven.id, node_path)
                for number, built in enumerate(proven.providers):
                    path = index_path(f"{node_path}.providers", number)
                    self._provider_id(provider_ids, providers, built.id, built.models, path)
                continue
            if not isinstance(node, dict):
                continue
            self._node_id(node_ids, _text(node.get("id")), node_path)
            if node.get("token_hash_sha256") == DEMO_NODE_TOKEN_SHA256 and not self._loopback(
                "edge"
            ):
                self._error(
                    f"{node_path}.token_hash_sha256",
                    "is the hash of the public demo token, which anyone can present; it is "
                    "allowed only while edge.listen is a loopback address. Make a token "
                    "(docs/configuration.md#tokens) and put its hash here",
                )
            for path, provider in _entries(node.get("providers"), f"{node_path}.providers"):
                provider_id = _text(provider.get("id"))
                models = _text_list(provider.get("models"))
                self._provider_id(provider_ids, providers, provider_id, models, path)
                self._long_context_slots(path, provider)
                self._adapter(path, provider)
        return providers

    def _node_id(self, node_ids: _FirstSeen, node_id: str | None, node_path: str) -> None:
        if first := node_ids.repeat(node_id, node_path):
            self._error(f"{node_path}.id", f"duplicate node id '{node_id}' ({first})")

    def _provider_id(
        self,
        provider_ids: _FirstSeen,
        providers: dict[str, _Provider],
        provider_id: str | None,
        models: list[str] | None,
        path: str,
    ) -> None:
        """Provider ids are unique across all nodes; the first of each is kept."""
        if first := provider_ids.repeat(provider_id, path):
            self._error(
                f"{path}.id",
                f"duplicate provider id '{provider_id}' ({first}); provider ids "
                "are unique across all nodes",
            )
        elif provider_id is not None:
            providers[provider_id] = _Provider(path, models)

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
        if provider_type in _REQUIRED_ADAPTER_KEY:
            required, what = _REQUIRED_ADAPTER_KEY[provider_type]
            if adapter.get(required) is None:
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
        elif (
            provider_type in _OPENAI_API_UNDER_V1
            and base_url is not None
            and not base_url.rstrip("/").endswith("/v1")
        ):
            self._error(
                f"{adapter_path}.base_url",
                f"{provider_type}'s OpenAI-compatible API is under /v1 (runs go to "
                f"BASE_URL/chat/completions): {base_url.rstrip('/')}/v1",
            )
        if provider_type == "cli" and adapter.get("command") == []:
            self._error(
                f"{adapter_path}.command", "must not be empty: give the argv to run, as a list"
            )
        cached, uncached = (adapter.get(k) for k in _SIM_PREFILL_KEYS)
        if isinstance(cached, int | float) and cached > (uncached or 0):
            self._error(
                f"{adapter_path}.cached_prefill_us_per_token",
                f"must be at most prefill_us_per_token ({uncached or 0}): reading a cached "
                "token costs no more than computing it",
            )

    def _models(self, providers: dict[str, _Provider]) -> set[str]:
        """Check `models[]`; return the ids defined there."""
        model_ids = _FirstSeen()
        for path, model in _entries(self.raw.get("models"), "models"):
            model_id = _text(model.get("id"))
            if first := model_ids.repeat(model_id, path):
                self._error(f"{path}.id", f"duplicate model id '{model_id}' ({first})")
            targets = model.get("providers")
            if not isinstance(targets, dict):
                continue  # missing or mistyped: the shape step said so
            if not targets:
                self._error(
                    f"{path}.providers",
                    "a model needs at least one provider (provider id -> served model name)",
                )
            for provider_id, target in targets.items():
                if isinstance(provider_id, str) and isinstance(target, str):
                    entry_path = key_path(f"{path}.providers", provider_id)
                    self._target(providers, provider_id, target, entry_path, entry_path)
            for name, message in lifecycle_problems(model.get("lifecycle"), len(targets)):
                self._error(f"{path}.lifecycle.{name}", message)
            generation = _as_dict(model.get("generation"))
            limit = _integer(generation.get("max_tokens_limit")) or DEFAULT_MAX_TOKENS_LIMIT
            for name, message in defaults_problems(generation.get("defaults"), limit):
                self._error(key_path(f"{path}.generation.defaults", name), message)
        return set(model_ids.first)

    def _legacy_routes(self, explicit_models: set[str], providers: dict[str, _Provider]) -> None:
        """Fold `openai.model_routes[]` into derived models (design §2.4)."""
        route_of: dict[tuple[str, str], str] = {}
        routes = self.openai.get("model_routes")
        for path, route in _entries(routes, "openai.model_routes"):
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
            earlier = route_of.setdefault((model_id, provider_id), path)
            if earlier != path and derived[provider_id] != target:
                self._error(
                    f"{path}.target",
                    f"model '{model_id}' is already routed to provider '{provider_id}' with "
                    f"another target ({earlier})",
                )
                continue
            derived[provider_id] = target
            self._target(providers, provider_id, target, f"{path}.provider", f"{path}.target")

    def _target(
        self,
        providers: dict[str, _Provider],
        provider_id: str,
        target: str,
        provider_path: str,
        target_path: str,
    ) -> None:
        """A model's provider must exist and must serve the target name.

        An unknown provider is blamed at `provider_path`, an unserved name at `target_path`
        (one and the same in `models[]`, two fields in a legacy route).
        """
        provider = providers.get(provider_id)
        if provider is None:
            close = difflib.get_close_matches(provider_id, list(providers), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            self._error(provider_path, f"unknown provider '{provider_id}'{hint}")
        elif provider.models is not None and target not in provider.models:
            self._error(
                target_path,
                f"provider '{provider_id}' does not serve '{target}' (its models: "
                f"{', '.join(provider.models) or 'none'}); add it to {provider.path}.models",
            )


def listens_on_loopback(raw: dict[Any, Any], section: str) -> bool:
    """Whether `<section>.listen` is a loopback address (True when malformed: that
    problem is reported on its own)."""
    listen = _text(_as_dict(raw.get(section)).get("listen"))
    if listen is None:
        return False  # the default, 0.0.0.0
    try:
        return parse_listen_address(listen).is_loopback
    except ValueError:
        return True


class _FirstSeen:
    """Remembers where each value was first seen, to name it in a "duplicate" error."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}

    def repeat(self, value: str | None, path: str) -> str:
        """`first at <path>` when `value` was seen before, else ''. None is never a repeat."""
        if value is None:
            return ""
        first = self.first.setdefault(value, path)
        return "" if first == path else f"first at {first}"


#: Candidate comparisons all "did you mean" hints of one check may make together. A hint
#: compares the unknown name with every known one (`difflib`, tens of microseconds
#: each): with a dozen principals every unknown ref gets one, with ten thousand only the
#: first does, so a list of ten thousand unknown refs is not a quadratic wait.
_HINT_BUDGET: Final = 10_000


class _Hints:
    """The "did you mean" of names that are not among `known`, within `_HINT_BUDGET`."""

    def __init__(self, known: set[str]) -> None:
        self.known = known
        self._sorted: list[str] | None = None
        """`known` in order, sorted only once a hint is asked for."""
        self.budget = _HINT_BUDGET

    def did_you_mean(self, name: str) -> str:
        """` (did you mean 'x'?)`, or '' when nothing is close or the budget is spent."""
        if len(self.known) > self.budget:
            return ""
        self.budget -= len(self.known)
        if self._sorted is None:
            self._sorted = sorted(self.known)
        close = difflib.get_close_matches(name, self._sorted, n=1)
        return f" (did you mean '{close[0]}'?)" if close else ""


def _as_dict(value: object) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _entries(value: object, path: str) -> Iterator[tuple[str, dict[Any, Any]]]:
    """`(path[i], item)` for the mapping items of a list; anything else is skipped."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, dict):
                yield index_path(path, index), item


def _text(value: object) -> str | None:
    """A non-empty string, else None (absent, empty or mistyped: nothing to check)."""
    return value if isinstance(value, str) and value else None


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_list(value: object) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(entry, str) for entry in value):
        return value
    return None


def _installed(module: str) -> bool:
    """Whether `module` could be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)
