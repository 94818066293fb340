"""YAML for config files, bounded: no alias bombs, no nesting past a sane depth; and fast.

PyYAML's safe loader builds an alias as a reference to the anchored value, so ten lines
of `&a [*b, *b, ...]` load in microseconds into a value that *means* 10^9 items; the
first thing that walks it (a JSON encoder sending a model's generation defaults with
every request, the refresh diff) stalls or crashes the process. And its composer
recurses once per nesting level, so a deep enough document raises `RecursionError`.
Both Edge config and Node config files are read through `compose` (then `check_expansion`
and a constructor, or all three at once: `load`), which refuses such documents as YAML
errors with a position, like any syntax error.

Parsing and composing run in libyaml (PyYAML's `CSafeLoader`) when PyYAML was built with
a libyaml that bounds nesting itself (0.2.5 and later: 1000 levels, so its recursive
composer cannot exhaust the C stack), about six times faster than the pure-Python parser
on a config of a thousand Nodes; otherwise in the pure-Python parser, which enforces Rule
1 while it composes. Values are always constructed by PyYAML's Python `SafeConstructor`,
so both paths give the same data.

Rules:
1. A document nests at most `MAX_DEPTH` levels (a scalar or an alias counts as a level
   of its own, as a collection does).
2. Aliases may add at most `max(MIN_ALIAS_BUDGET, written nodes)` nodes to the document
   (counted as if each alias were written out): sharing a common block among providers
   stays free, an exponential expansion is refused, and a document can at most double.
3. An alias that contains itself is refused.
4. Text the parser cannot take (a lone surrogate, which only a string built in memory can
   hold) is a `yaml.reader.ReaderError` with its position, as on the pure-Python path.
5. `construct` builds the same data as PyYAML's `SafeConstructor` (the one it is given),
   faster: plain strings, maps and sequences are built directly, other scalars through
   that constructor, and any document the direct path does not cover (an alias, a merge
   key, a non-scalar key, an explicitly tagged collection) wholly by that constructor.
6. `load` refuses a key given twice in one mapping (`check_unique_keys`), with both
   positions: PyYAML would keep the last one without a word. (The Edge's config reader
   reports every such key with its config path instead: `core.configuration.config`.)

A document without an alias has a graph that is a tree, so the checks of Rules 1-3 and
the construction skip the bookkeeping that shared nodes need. A fleet's config is half a
million YAML nodes; that bookkeeping was a third of its reading. An alias (`*name`) needs
an anchor (`&name`) before it, and both stand where a node starts: `has_aliases` looks
for the two indicators there, not for the characters anywhere, since a `*` is everyday
text in a config that has none (the `"*"` entry of `principals:`, glob patterns).
"""

from __future__ import annotations

from typing import Any, Final

import yaml

__all__ = [
    "LIBYAML",
    "MAX_DEPTH",
    "MIN_ALIAS_BUDGET",
    "check_expansion",
    "check_unique_keys",
    "compose",
    "construct",
    "has_aliases",
    "load",
]

MAX_DEPTH: Final = 64
MIN_ALIAS_BUDGET: Final = 10_000


def _libyaml_bounds_nesting() -> bool:
    try:
        from yaml import _yaml
    except ImportError:  # PyYAML built without libyaml
        return False
    version: tuple[int, int, int] = _yaml.get_version()
    return version >= (0, 2, 5) and hasattr(yaml, "CSafeLoader")


LIBYAML: Final = _libyaml_bounds_nesting()
"""Whether `compose` parses with libyaml (see the module docstring)."""


class _PureLoader(yaml.SafeLoader):
    """The pure-Python parser, refusing documents nested deeper than `MAX_DEPTH` as it
    composes them (Rule 1)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _too_deep(self.peek_event().start_mark)  # type: ignore[no-untyped-call]
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def compose(text: str, *, libyaml: bool = LIBYAML) -> yaml.Node | None:
    """The document's node graph (None for an empty document), Rule 1 checked.

    Raises `yaml.YAMLError` subclasses: `MarkedYAMLError` for syntax and for Rule 1,
    `ReaderError` for characters YAML does not allow (Rule 4). `libyaml=False` forces the
    pure-Python parser (the fallback; tests compare the two)."""
    if not libyaml:
        pure = _PureLoader(text)
        try:
            return pure.get_single_node()
        finally:
            pure.dispose()
    try:
        parser = yaml.CSafeLoader(text)
    except UnicodeEncodeError as exc:  # libyaml reads UTF-8; a lone surrogate has none
        raise yaml.reader.ReaderError(
            "<unicode string>", exc.start, ord(text[exc.start]), "utf-8", "not encodable"
        ) from None
    try:
        node = parser.get_single_node()
    finally:
        parser.dispose()
    if node is not None:
        if has_aliases(text):
            _check_depth(node)
        else:
            _check_tree_depth(node)
    return node


#: What may stand right before a node's first indicator: white space and line breaks
#: (after a block entry `- `, a value `: `, a tag, an indentation), a flow collection's
#: `[`, `{` or `,`, the `:` right after a quoted flow key (`{"a":*x}`), a byte order mark.
_BEFORE_NODE: Final = frozenset(" \t\r\n\x0b\x0c\x85\u2028\u2029\ufeff[{,:")


def has_aliases(text: str) -> bool:
    """Whether the document may hold an alias (else its graph is a tree).

    Conservative, never wrong the other way: an alias is an `*` where a node starts and
    refers to an anchor, an `&` where a node starts, so a document with only one of the
    two has none (an alias to no anchor is a syntax error of its own). Text that merely
    looks like them (`a &b` in a quoted string or a comment) only costs the slower path.
    A `*` inside a word (`qwen3*`) or quoted (`"*"`) is no alias."""
    return _at_node_start(text, "&") and _at_node_start(text, "*")


def _at_node_start(text: str, indicator: str) -> bool:
    """Whether `indicator` occurs where a node may start. `str.find` scans in C: a config
    of ten thousand tokens is 1.5 MB, and a regex that cannot start from a literal takes
    tens of milliseconds over it."""
    index = text.find(indicator)
    while index != -1:
        if index == 0 or text[index - 1] in _BEFORE_NODE:
            return True
        index = text.find(indicator, index + 1)
    return False


def _check_tree_depth(root: yaml.Node) -> None:
    """Rule 1 on a graph without aliases: `_check_depth` without its seen-set, visiting
    collections only (a scalar is too deep exactly when its parent sits at the limit)."""
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    collections = (yaml.SequenceNode, yaml.MappingNode)
    while stack:
        node, depth = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            continue
        if depth >= MAX_DEPTH and children:
            raise _too_deep(children[0].start_mark)
        stack.extend(
            (child, depth + 1) for child in reversed(children) if isinstance(child, collections)
        )


def _check_depth(root: yaml.Node) -> None:
    """Rule 1 on a composed graph, as the pure-Python composer applies it while composing.

    Walks in document order without recursion (libyaml allows 1000 levels), descending
    into each node once: where it was written, not where an alias repeats it."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep(node.start_mark)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, depth + 1) for item in reversed(node.value))
        elif isinstance(node, yaml.MappingNode):
            for key, value in reversed(node.value):
                stack.append((value, depth + 1))
                stack.append((key, depth + 1))


def _too_deep(mark: Any) -> yaml.composer.ComposerError:
    return yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)


def check_expansion(root: yaml.Node) -> None:
    """Raise a `yaml.MarkedYAMLError` when aliases expand `root` too far (Rules 2, 3).

    `root` must have passed Rule 1 (`compose` checks it): the walk recurses per level."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def size(node: yaml.Node) -> int:
        """Nodes under `node` with every alias written out (the depth is bounded)."""
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in in_progress:
            raise yaml.composer.ComposerError(
                None, None, "recursive alias (refers to itself)", node.start_mark
            )
        in_progress.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        in_progress.discard(key)
        sizes[key] = total
        return total

    expanded = size(root)
    written = len(sizes)
    budget = max(MIN_ALIAS_BUDGET, written)
    if expanded - written > budget:
        raise yaml.composer.ComposerError(
            None,
            None,
            f"aliases expand this document from {written} to {expanded} nodes; at most "
            f"{budget} more are allowed (write the repeated parts out, or share less)",
            root.start_mark,
        )


def load(text: str, *, unique_keys: bool = True) -> Any:
    """`yaml.safe_load` with the rules above; raises `yaml.YAMLError` subclasses.
    `unique_keys=False` keeps a repeated key's last value, as PyYAML does (a lenient
    read of a file that is refused elsewhere)."""
    node = compose(text)
    if node is None:
        return None
    aliases = has_aliases(text)
    if aliases:
        check_expansion(node)
    if unique_keys:
        check_unique_keys(node)
    data = construct(node, yaml.constructor.SafeConstructor(), aliases=aliases)
    return data


def check_unique_keys(root: yaml.Node) -> None:
    """Raise a `yaml.MarkedYAMLError` at the first key given twice in one mapping (Rule 6).
    Iterative, and each node once (an aliased one is shared)."""
    stack = [root]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Mark] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    at = first.get((key.tag, key.value))
                    if at is None:
                        first[key.tag, key.value] = key.start_mark
                    else:
                        raise yaml.constructor.ConstructorError(
                            "while reading a mapping",
                            node.start_mark,
                            f"the key {key.value!r} is given twice (first at line "
                            f"{at.line + 1}, column {at.column + 1})",
                            key.start_mark,
                        )
                stack.append(value)


# --- construction (Rule 5) ---------------------------------------------------------------

_STR_TAG: Final = "tag:yaml.org,2002:str"
_MAP_TAG: Final = "tag:yaml.org,2002:map"
_SEQ_TAG: Final = "tag:yaml.org,2002:seq"
_INT_TAG: Final = "tag:yaml.org,2002:int"
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"


class _NotDirect(Exception):
    """The document needs PyYAML's constructor: the direct path stops at once."""


def construct(
    root: yaml.Node, constructor: yaml.constructor.SafeConstructor, *, aliases: bool = True
) -> Any:
    """The plain data `constructor.construct_document(root)` builds (Rule 5).

    `aliases=False` promises the graph is a tree (`has_aliases` said no); with aliases
    the document always goes to `constructor`, which shares what an alias repeats."""
    if not aliases:
        try:
            return _direct(root, constructor)
        except _NotDirect:
            pass
    return constructor.construct_document(root)


def _direct(node: yaml.Node, constructor: yaml.constructor.SafeConstructor) -> Any:
    """One node's data; raises `_NotDirect` where `constructor` must build the document.

    Recursion is bounded: `compose` refused documents deeper than `MAX_DEPTH`."""
    tag = node.tag
    if isinstance(node, yaml.ScalarNode):
        value: str = node.value
        if tag == _STR_TAG:
            return value
        if tag == _INT_TAG and value.isascii() and value.isdigit() and value[0] != "0":
            return int(value)  # YAML 1.1 reads a leading 0 as octal: the constructor's job
        return constructor.construct_object(node, deep=True)
    if isinstance(node, yaml.MappingNode) and tag == _MAP_TAG:
        data: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                raise _NotDirect  # a merge key, or a key that may not be hashable
            data[_direct(key_node, constructor)] = _direct(value_node, constructor)
        return data
    if isinstance(node, yaml.SequenceNode) and tag == _SEQ_TAG:
        return [_direct(item, constructor) for item in node.value]
    raise _NotDirect  # an explicitly tagged collection (!!set, !!omap, ...)
