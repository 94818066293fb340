"""Validate the Edge config (design §2): YAML text in, a checked `EdgeConfig` out.

The same pipeline runs at startup, for `iop-edge check-config` and for every refresh
candidate, so a config that loads is a config the Edge can serve. It runs in four steps
here, and a fifth where the Edge meets its machine:

1. **YAML**: text -> plain data. A syntax error stops here and names its line and column.
   A key given twice in one mapping is an error too (PyYAML would silently keep the last),
   and so are aliases that expand too far and nesting too deep (`schemas.runtime.safe_yaml`).
   A refresh candidate is parsed without the Node entries the running config has word
   for word (`core.configuration.config_pieces`); whenever that is not sure to read the
   same, or the rest has an error, the whole text is read, so errors read as they always
   do.
2. **Shape**: `config_shape` walks the schema Structs in `schemas.config` alongside the
   data and lets msgspec judge each leaf against its annotated type, so the `Meta`
   constraints in the schema stay the single source of truth for ranges. msgspec alone
   stops at the first error; the walker collects all of them, each with its path. The
   Edge adds only the wording for two schema aliases (`Sha256Hex`, `EnvVarName`).
3. **Rules** (`core.configuration.config_rules`): what a type cannot say - unique ids,
   cross-references between models and providers, adapter settings per provider type,
   listen addresses, no secret values, and the legacy `openai.model_routes[]` folded into
   models (design §2.4). The rules read the raw data tolerantly, so one mistyped field
   does not hide a broken reference elsewhere.
4. **Build**: only when steps 2 and 3 found nothing, msgspec builds the real Structs;
   derived legacy models are appended and every provider's `category` is resolved.
5. **Host**, outside the core (`runtime.lifecycle.host_checks`, through
   `runtime.refresh.config_file`, which also reads the file): what `serve` needs from
   this machine, read-only: the TLS files load, `state_dir` is writable or creatable.

Every problem is a `ConfigError(path, message)` with a path like
`nodes[0].providers[1].capacity`. Messages never echo a token hash or anything that
looks like a secret.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import yaml

from iop_edge.core.configuration.config_pieces import NODES, ConfigPieces, cut, entries_in_place
from iop_edge.core.configuration.config_proof import ConfigProof, entry_key
from iop_edge.core.configuration.config_rules import ConfigRules, listens_on_loopback
from iop_edge.core.configuration.config_shape import (
    LeafWording,
    ShapeChecker,
    convert,
    error_from_msgspec,
    index_path,
    key_path,
    kind_of,
)
from schemas.config import (
    ConfigError,
    EdgeConfig,
    EnvVarName,
    ModelEntry,
    NodeEntry,
    Sha256Hex,
)
from schemas.runtime.safe_yaml import check_expansion, compose, construct, has_aliases

__all__ = [
    "ConfigInvalid",
    "ParsedConfig",
    "format_errors",
    "parse_config",
    "whole_file_error",
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
    proof: ConfigProof | None = None
    """What this config proved about its node entries: pass it to the next parse."""
    checked_nodes: int = 0
    """Node entries checked here, not taken from the proof it was given."""
    parsed_nodes: int = 0
    """Node entries parsed here, not known by their text to the proof it was given."""


def parse_config(text: str, *, proof: ConfigProof | None = None) -> ParsedConfig:
    """Parse and validate config text; raise `ConfigInvalid` listing every problem.

    `proof` is what an earlier valid config proved (`core.configuration.config_proof`): its node
    entries whose raw data is unchanged are not checked again, and those whose text is
    unchanged are not even parsed (`core.configuration.config_pieces`)."""
    read = _read(text, proof)
    raw, errors = read.data, read.errors
    if not isinstance(raw, dict):
        got = "an empty document" if raw is None else kind_of(raw)
        errors.append(
            ConfigError(
                path="",
                message="the top level must be a mapping of sections (edge, admin, openai, "
                f"dispatch, models, nodes, principals), got {got}",
            )
        )
        raise ConfigInvalid(errors)
    entries = _NodeEntries.read(raw, proof, read.known)
    shape = ShapeChecker(_WORDING)
    if entries.proven:
        errors.extend(shape.check({**raw, "nodes": []}, EdgeConfig))
        for index, entry in entries.to_check():
            errors.extend(shape.check(entry, NodeEntry, path=index_path("nodes", index)))
    else:
        errors.extend(shape.check(raw, EdgeConfig))
    rules = ConfigRules(raw, proven=entries.proven)
    rules.run()
    errors.extend(rules.errors)
    if errors:
        raise ConfigInvalid(errors)
    config = _build(raw, rules.derived_models, entries.proven)
    parsed = ParsedConfig(
        config=config,
        text=text,
        sha256=_sha256(text),
        warnings=rules.warnings,
        proof=entries.proof(config.nodes, read.pieces),
        checked_nodes=len(entries.keys) - len(entries.proven),
        parsed_nodes=len(entries.keys) - len(read.known),
    )
    return parsed


#: Characters of a config's text encoded at a time (`utf8_pieces`).
_PIECE_CHARS: Final = 1 << 20


def utf8_pieces(text: str) -> Iterator[bytes]:
    """`text` as UTF-8, a megabyte at a time."""
    for start in range(0, len(text), _PIECE_CHARS):
        yield text[start : start + _PIECE_CHARS].encode("utf-8")


def _sha256(text: str) -> str:
    """sha256 hex of `text` as UTF-8 (`utf8_pieces`)."""
    digest = hashlib.sha256()
    for piece in utf8_pieces(text):
        digest.update(piece)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class _NodeEntries:
    """A candidate's raw node entries against a proof (`core.configuration.config_proof`)."""

    raw: list[Any]
    """The raw entries; None in place of an entry known by its text (`_Read.known`)."""
    keys: list[bytes | None]
    """Each entry's `entry_key`; None for an entry that is not a mapping."""
    edge_loopback: bool
    proven: dict[int, NodeEntry]
    """By index in `nodes`: the entries the proof already holds."""

    @classmethod
    def read(
        cls, raw: dict[Any, Any], proof: ConfigProof | None, known: Mapping[int, bytes]
    ) -> _NodeEntries:
        """`known`: the keys of the entries that were not parsed, by index."""
        nodes = raw.get("nodes")
        entries = nodes if isinstance(nodes, list) else []
        keys: list[bytes | None] = []
        for index, entry in enumerate(entries):
            if index in known:
                keys.append(known[index])
            else:
                keys.append(entry_key(entry) if isinstance(entry, dict) else None)
        loopback = listens_on_loopback(raw, "edge")
        proven: dict[int, NodeEntry] = {}
        if proof is not None:
            for index, key in enumerate(keys):
                if (
                    key is not None
                    and (entry := proof.entry(key, edge_loopback=loopback)) is not None
                ):
                    proven[index] = entry
        return cls(entries, keys, loopback, proven)

    def to_check(self) -> Iterator[tuple[int, Any]]:
        """The entries the proof does not hold, with their index."""
        for index, entry in enumerate(self.raw):
            if index not in self.proven:
                yield index, entry

    def proof(self, built: list[NodeEntry], pieces: ConfigPieces | None) -> ConfigProof:
        """What this valid config proves: every entry, as built; and with `pieces` (its
        text's, confirmed by the parse), each entry's key by its text."""
        keyed = {key: node for key, node in zip(self.keys, built, strict=True) if key}
        texts: dict[str, bytes] = {}
        if pieces is not None and pieces.entries == len(self.keys):
            texts = {
                pieces.entry(index): key for index, key in enumerate(self.keys) if key is not None
            }
        return ConfigProof(edge_loopback=self.edge_loopback, entries=keyed, texts=texts)


def format_errors(errors: list[ConfigError]) -> str:
    """One `path: message` line per error, in the order they were found."""
    return "\n".join(str(error) for error in errors)


def whole_file_error(message: str) -> ConfigInvalid:
    """A problem that stops everything and belongs to no path (unreadable file, bad YAML)."""
    return ConfigInvalid([ConfigError(path="", message=message)])


# --------------------------------------------------------------------------- step 1: YAML


class _Constructor(yaml.constructor.SafeConstructor):
    """PyYAML's safe constructor, with value-construction failures turned into marked errors.

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


@dataclass(frozen=True, slots=True)
class _Read:
    """A config text as plain data (step 1)."""

    data: object
    errors: list[ConfigError]
    """Duplicate keys and recursive aliases, each with its path."""
    pieces: ConfigPieces | None = None
    """The text's pieces, when the parse confirmed where its Node entries are: a valid
    config's proof then knows each entry by its text (`core.configuration.config_pieces`)."""
    known: Mapping[int, bytes] = field(default_factory=dict)
    """The Node entries not parsed because a proof knew their text: by index in
    `nodes`, their `entry_key`. `data` holds None in their place."""


def _read(text: str, proof: ConfigProof | None) -> _Read:
    """Read `text`, parsing only its Node entries that `proof` does not know word for
    word (`core.configuration.config_pieces`); when its pieces cannot be confirmed, or anything in
    the
    rest is wrong, the whole text is read instead, so every error is found and worded
    (positions included) as in a text read whole. Raises `ConfigInvalid` on a syntax
    error."""
    pieces = cut(text)
    if pieces is not None and not pieces.entries:
        pieces = None  # nothing to know an entry by
    if pieces is not None and proof is not None:
        known = proof.known(pieces)
        if known:
            read = _read_without(pieces, known, proof)
            if read is not None:
                return read
    data, errors, starts = _read_yaml(text)
    if pieces is not None and (errors or not _in_place(data, pieces, starts)):
        pieces = None
    return _Read(data, errors, pieces)


def _read_without(
    pieces: ConfigPieces, known: Mapping[int, bytes], proof: ConfigProof
) -> _Read | None:
    """`pieces` read with the entries in `known` cut out and taken from `proof`; None
    when the cut is not confirmed, the rest has an error, or the proof does not hold
    for this config's `edge.listen` (`core.configuration.config_proof` Rule 2)."""
    text, spans = pieces.without(known)
    try:
        data, errors, starts = _read_yaml(text)
    except ConfigInvalid:
        return None
    if errors or not isinstance(data, dict) or not _in_place(data, pieces, starts, spans):
        return None
    loopback = listens_on_loopback(data, "edge")
    if any(proof.entry(key, edge_loopback=loopback) is None for key in known.values()):
        return None
    parsed = iter(data.get(NODES) or ())
    data[NODES] = [None if index in known else next(parsed) for index in range(pieces.entries)]
    return _Read(data, [], pieces, known)


def _in_place(
    data: object,
    pieces: ConfigPieces,
    starts: list[int] | None,
    spans: list[tuple[int, int]] | None = None,
) -> bool:
    """Whether a parse (of all of `pieces`, or of the text with its entries at `spans`)
    confirms the cut: the top-level keys it found, and each entry inside its
    own piece (`config_pieces.entries_in_place`)."""
    if not isinstance(data, dict) or list(data) != list(pieces.keys):
        return False
    if spans is None:
        spans = pieces.without(())[1]
    return entries_in_place(starts, spans)


def _read_yaml(text: str) -> tuple[object, list[ConfigError], list[int] | None]:
    """Plain data from YAML text, plus an error per duplicate key or recursive alias, and
    where each entry of the top-level `nodes` starts in `text` (None when there is no
    such list), for `config_pieces.entries_in_place`.

    Aliases that expand too far and nesting too deep are refused like syntax errors
    (`schemas.runtime.safe_yaml`): the document is never built.

    Raises `ConfigInvalid` on a syntax error. The message is built from the parser's
    problem and position only, never `str(exc)`, which quotes the offending source line
    (and that line may hold a token hash).
    """
    try:
        node = compose(text)
        if node is None:
            return None, [], None
        starts = _entry_starts(node)
        errors: list[ConfigError] = []
        aliases = has_aliases(text)
        if aliases:
            _scan_nodes(node, "", errors, set(), set())
            if not errors:  # a recursive alias is reported with its path instead
                check_expansion(node)
        else:
            _scan_tree(node, errors)
        data = construct(node, _Constructor(), aliases=aliases)
        return data, errors, starts
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at {_position(mark)}" if mark else ""
        problem = ", ".join(part for part in (exc.context, exc.problem) if part) or "cannot parse"
        raise whole_file_error(f"invalid YAML{where}: {problem}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        reason = str(exc).splitlines()[0]
        raise whole_file_error(f"invalid YAML at character {exc.position}: {reason}") from None


def _entry_starts(root: yaml.Node) -> list[int] | None:
    """Where each item of the root mapping's `nodes` sequence starts (character index)."""
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            if isinstance(key, yaml.ScalarNode) and key.value == NODES:
                if isinstance(value, yaml.SequenceNode):
                    return [item.start_mark.index for item in value.value]
                return None
    return None


def _position(mark: yaml.Mark) -> str:
    """A parser mark as an editor shows it: 1-based `line L, column C`."""
    return f"line {mark.line + 1}, column {mark.column + 1}"


_MERGE_TAG: Final = "tag:yaml.org,2002:merge"


#: A collection's place in the document, built only when an error names it: the parent's
#: place and the step (an index or a key) from there, or None for the root.
_Place = tuple["_Place", int | str] | None


def _render_place(place: _Place) -> str:
    steps: list[int | str] = []
    while place is not None:
        place, step = place
        steps.append(step)
    path = ""
    for step in reversed(steps):
        path = index_path(path, step) if isinstance(step, int) else key_path(path, step)
    return path


def _scan_tree(root: yaml.Node, errors: list[ConfigError]) -> None:
    """`_scan_nodes` for a document without aliases (a tree, nothing recursive): the
    duplicate keys only, each mapping's keys compared at once, paths built only for a
    mapping that repeats a key. Iterative: the depth is bounded, but this is cheaper."""
    stack: list[tuple[yaml.Node, _Place]] = [(root, None)]
    while stack:
        node, place = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            for index in range(len(node.value) - 1, -1, -1):
                item = node.value[index]
                if not isinstance(item, yaml.ScalarNode):
                    stack.append((item, (place, index)))
        elif isinstance(node, yaml.MappingNode):
            pairs = node.value
            signatures = [
                (key.tag, key.value)
                for key, _ in pairs
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG
            ]
            if len(set(signatures)) != len(signatures):
                # Rare: the full scan words the errors, in document order, for this subtree.
                _scan_nodes(node, _render_place(place), errors, set(), set())
                continue
            for key, value in reversed(pairs):
                # As `_scan_nodes`: the value of a merge key or a complex key is not scanned.
                if (
                    isinstance(key, yaml.ScalarNode)
                    and key.tag != _MERGE_TAG
                    and not isinstance(value, yaml.ScalarNode)
                ):
                    stack.append((value, (place, key.value)))


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
            _scan_nodes(item, index_path(path, index), errors, seen, parents)
    elif isinstance(node, yaml.MappingNode):
        first_seen: dict[tuple[str, str], str] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            value_path = key_path(path, key_node.value)
            where = _position(key_node.start_mark)
            signature = (key_node.tag, key_node.value)
            if signature in first_seen:
                errors.append(
                    ConfigError(
                        path=value_path,
                        message=f"duplicate key at {where} (first at {first_seen[signature]})",
                    )
                )
            else:
                first_seen[signature] = where
            _scan_nodes(value_node, value_path, errors, seen, parents)
    parents.discard(id(node))


# --------------------------------------------------------------------------- step 2: shape


def _secret_like_env_var(value: str) -> str | None:
    if value.startswith(("sk-", "Bearer ")) or len(value) > 128:
        return (
            "looks like a secret value, not an environment variable name: keep the secret in "
            "an environment variable on the Node and give that variable's NAME here "
            "(like OPENAI_API_KEY)"
        )
    return None


def _placeholder_hash(value: str) -> str | None:
    if "REPLACE" in value.upper():
        return (
            "is still the placeholder: put the token's sha256 here "
            "(`iop-edge hash-token < TOKEN-FILE` prints it)"
        )
    return None


#: Keyed by the schema's own aliases, so every field declared with one gets its wording.
_WORDING: Final[dict[object, LeafWording]] = {
    Sha256Hex: LeafWording(
        invalid="must be 64 lowercase hex chars (sha256; `iop-edge hash-token` makes one)",
        precheck=_placeholder_hash,
    ),
    EnvVarName: LeafWording(
        invalid="must be the NAME of an environment variable (letters, digits and _, not "
        "starting with a digit), like VLLM_API_KEY - never the secret itself",
        precheck=_secret_like_env_var,
    ),
}


# --------------------------------------------------------------------------- step 3: rules
# in `core.configuration.config_rules`


# --------------------------------------------------------------------------- step 4: build


def _build(
    raw: dict[Any, Any],
    derived_models: dict[str, dict[str, str]],
    proven: Mapping[int, NodeEntry],
) -> EdgeConfig:
    """The real Structs, with legacy models appended and provider categories resolved;
    the node entries a proof holds are taken from it as built then."""
    nodes = raw.get("nodes")
    try:
        config = convert({**raw, "nodes": []}, EdgeConfig)  # long lists a chunk at a time
        built: list[NodeEntry] = []
        for index, entry in enumerate(nodes if isinstance(nodes, list) else []):
            built.append(proven[index] if index in proven else _node(entry))
    except msgspec.ValidationError as exc:  # the shape step should have caught it: report it
        raise ConfigInvalid([error_from_msgspec(exc)]) from None
    legacy = [
        ModelEntry(id=model_id, providers=providers)
        for model_id, providers in derived_models.items()
    ]
    return msgspec.structs.replace(config, nodes=built, models=[*config.models, *legacy])


def _node(entry: object) -> NodeEntry:
    """One node entry's Structs, every provider's `category` resolved."""
    node = msgspec.convert(entry, NodeEntry)
    return msgspec.structs.replace(
        node,
        providers=[
            msgspec.structs.replace(provider, category=provider.effective_category)
            for provider in node.providers
        ],
    )
