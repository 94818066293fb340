"""YAML for config files, bounded: no alias bombs, no nesting past a sane depth.

PyYAML's safe loader builds an alias as a reference to the anchored value, so ten lines
of `&a [*b, *b, ...]` load in microseconds into a value that *means* 10^9 items; the
first thing that walks it (a JSON encoder sending a model's generation defaults with
every request, the refresh diff) stalls or crashes the process. And its composer
recurses once per nesting level, so a deep enough document raises `RecursionError`.
Both Edge config and Node config files are read through `BoundedLoader`, which refuses
such documents as YAML errors with a position, like any syntax error.

Rules:
1. A document nests at most `MAX_DEPTH` levels.
2. Aliases may add at most `max(MIN_ALIAS_BUDGET, written nodes)` nodes to the document
   (counted as if each alias were written out): sharing a common block among providers
   stays free, an exponential expansion is refused, and a document can at most double.
3. An alias that contains itself is refused.
"""

from __future__ import annotations

from typing import Any, Final

import yaml

__all__ = ["MAX_DEPTH", "MIN_ALIAS_BUDGET", "BoundedLoader", "check_expansion", "load"]

MAX_DEPTH: Final = 64
MIN_ALIAS_BUDGET: Final = 10_000


class BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses documents nested deeper than `MAX_DEPTH` (Rule 1).

    Use `load` (or call `check_expansion` on the composed node before constructing it)
    for Rules 2 and 3."""

    def __init__(self, stream: str | bytes) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark,  # type: ignore[no-untyped-call]
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def check_expansion(root: yaml.Node) -> None:
    """Raise a `yaml.MarkedYAMLError` when aliases expand `root` too far (Rules 2, 3)."""
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


def load(text: str) -> Any:
    """`yaml.safe_load` with the rules above; raises `yaml.YAMLError` subclasses."""
    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()
