"""A config's text cut at its Node entries, so a refresh candidate is parsed only where it
differs, word for word, from the last valid config.

A fleet's config is mostly `nodes:`, ten thousand entries of a few lines each, and a
refresh usually edits a few of them. Parsing the YAML of the others again is most of
what reading such a candidate costs. Here the text is cut, by a scan of its lines, into
its top-level sections and the entries of `nodes`; `core.configuration.config` then parses the text
with the entries it already knows cut out (`ConfigPieces.without`) and takes those
entries from what the last valid config proved (`core.configuration.config_proof`).

Why the cut is safe. In a block-style document every line that starts in column 0 with
a key is, for the YAML parser, either a key of the top-level mapping, or text inside a
quoted scalar or a flow collection that started on an earlier line: block scalars, plain
scalars and comments all end before such a line (their continuation lines are indented).
Likewise a line that starts with `-` in the column of the first entry of `nodes` is
either the next entry, or inside a quoted scalar or a flow collection. At a true cut the
parser holds nothing open: what follows is parsed the same whatever came before, so an
entry's text means the same wherever it stands, and taking whole entries out leaves the
rest meaning what it did. A false cut (a cut inside a quoted scalar or a flow
collection) is caught after the parse: the top-level keys parsed must be the ones the
scan found, the entries parsed as many as the pieces kept, each starting inside its own
piece (`entries_in_place`). A text whose cut is not confirmed is read whole.

Rules (`cut` returns None, and the text is read whole, unless all of them hold):

1. Lines end in `\\n` only, no line is indented with a tab, and there is no byte order
   mark: YAML has other line breaks, and they would move what a line is.
2. The document has no alias (`schemas.runtime.safe_yaml.has_aliases`): an alias can refer to an
   anchor in another piece. An anchor alone refers to nothing and changes no value.
3. Every line that starts in column 0 is blank, a comment, a sequence entry (`-` and a
   space, a tab or the line's end) or a key: a plain word and `:` (then a space, a tab or
   the line's end). That rules out document markers (`---`, `...`), directives (`%`),
   explicit keys (`?`), quoted keys and flow collections at the top level.
4. Before the first key there are only blank lines and comments; no key appears twice.
5. The entries of `nodes` are cut only when its line is `nodes:` (a comment may follow)
   and the first line after it that is neither blank nor a comment starts an entry, at
   some indentation `d`. The entries start at the lines that begin with `d` spaces and
   `-`; no line of the section other than blank ones and comments is indented less.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final

from schemas.runtime.safe_yaml import has_aliases

__all__ = ["NODES", "ConfigPieces", "cut", "entries_in_place"]

NODES: Final = "nodes"
"""The top-level key whose entries are cut apart."""

#: Characters that break a line or start a document in YAML besides `\n` (Rule 1).
_OTHER_BREAKS: Final = ("\r", "\x85", "\u2028", "\u2029", "\ufeff")
# The line scans below look for a line break and what follows it, not for `^` in
# multi-line mode: the regex engine finds a pattern that starts with a literal character
# by a fast search for that character, while `^` is tried at every position of a
# megabytes-long text. The first line of the text, which no break precedes, is looked at
# apart.
_TAB_INDENT: Final = re.compile(r"\n *\t")
#: Lines that start in column 0 with something other than a space, a comment, an entry.
_COLUMN_ZERO: Final = re.compile(r"\n[^ \n#-]")
#: Lines that start in column 0 with `-` that is not an entry's (`---`, `-x`).
_NOT_AN_ENTRY: Final = re.compile(r"\n-(?![ \t\n]|\Z)")
_KEY: Final = re.compile(r"([A-Za-z_][A-Za-z0-9_]*):(?=[ \t\n]|\Z)")
_BLANK_OR_COMMENTS: Final = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\n)*")
_NODES_LINE: Final = re.compile(r"nodes:[ \t]*(?:#[^\n]*)?(?:\n|\Z)")
_ENTRY_LINE: Final = re.compile(r"( *)-(?=[ \t\n]|\Z)")


@functools.cache
def _entries_at(indent: int) -> re.Pattern[str]:
    """Line breaks followed by an entry at `indent` (Rule 5)."""
    return re.compile(rf"\n {{{indent}}}-(?=[ \t\n]|\Z)")


@functools.cache
def _outdented(indent: int) -> re.Pattern[str]:
    """Line breaks followed by content indented less than `indent` (Rule 5); `indent` >
    0."""
    return re.compile(rf"\n {{0,{indent - 1}}}[^ \n#]")


@dataclass(frozen=True, slots=True)
class ConfigPieces:
    """Where a config text's top-level keys and Node entries are (see the module's rules)."""

    text: str
    keys: tuple[str, ...]
    """The top-level keys, in order."""
    bounds: tuple[int, ...]
    """Where each entry of `nodes` starts in `text`, then where the last one ends; empty
    when the entries are not cut apart."""

    @property
    def entries(self) -> int:
        """How many entries `nodes` was cut into."""
        return max(len(self.bounds) - 1, 0)

    def entry(self, index: int) -> str:
        """The text of entry `index`, from its `-` to the next entry (or the section's
        end), comments and blank lines included."""
        return self.text[self.bounds[index] : self.bounds[index + 1]]

    def without(self, skipped: Collection[int]) -> tuple[str, list[tuple[int, int]]]:
        """The text with the entries at indexes `skipped` taken out, and where each
        remaining entry is in it, in order (`start`, `end`)."""
        spans: list[tuple[int, int]] = []
        if not skipped:
            spans.extend(zip(self.bounds, self.bounds[1:], strict=False))
            return self.text, spans
        parts: list[str] = []
        taken = 0  # text up to here is in `parts`
        length = 0  # the length of `parts`
        for index in range(self.entries):
            start, end = self.bounds[index], self.bounds[index + 1]
            if index in skipped:
                parts.append(self.text[taken:start])
                length += start - taken
                taken = end
            else:
                head = start - taken  # what lies between the last cut and this entry
                spans.append((length + head, length + head + end - start))
        parts.append(self.text[taken:])
        return "".join(parts), spans


def cut(text: str) -> ConfigPieces | None:
    """The pieces of `text`, or None when it is not plain block style (Rules 1-5)."""
    if not text or any(mark in text for mark in _OTHER_BREAKS) or has_aliases(text):
        return None
    if "\t" in text and (text.lstrip(" ").startswith("\t") or _TAB_INDENT.search(text)):
        return None
    if _NOT_AN_ENTRY.search(text):  # the first line is held to Rule 4 below
        return None
    starts = [line.start() + 1 for line in _COLUMN_ZERO.finditer(text)]
    if text[0] not in " \n#-":
        starts.insert(0, 0)
    keys: list[str] = []
    for start in starts:
        key = _KEY.match(text, start)
        if key is None:
            return None
        keys.append(key.group(1))
    if not keys or len(set(keys)) != len(keys):
        return None
    if _BLANK_OR_COMMENTS.match(text, 0, starts[0]).end() != starts[0]:  # type: ignore[union-attr]
        return None
    bounds: tuple[int, ...] = ()
    if NODES in keys:
        at = keys.index(NODES)
        end = starts[at + 1] if at + 1 < len(keys) else len(text)
        bounds = _entry_bounds(text, starts[at], end)
    return ConfigPieces(text=text, keys=tuple(keys), bounds=bounds)


def _entry_bounds(text: str, start: int, end: int) -> tuple[int, ...]:
    """Where the entries of the `nodes` section `text[start:end]` start, then `end`; empty
    when they are not cut apart (Rule 5)."""
    line = _NODES_LINE.match(text, start, end)
    if line is None or line.end() == end:
        return ()
    # `first` starts a line, after the `nodes:` line: the break before it is `first - 1`.
    first = _BLANK_OR_COMMENTS.match(text, line.end(), end).end()  # type: ignore[union-attr]
    entry = _ENTRY_LINE.match(text, first, end)
    if entry is None:
        return ()
    indent = len(entry.group(1))
    if indent and _outdented(indent).search(text, first - 1, end):
        return ()
    starts = [match.start() + 1 for match in _entries_at(indent).finditer(text, first - 1, end)]
    return (*starts, end)


def entries_in_place(starts: Sequence[int] | None, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether the entries a parse found (`starts`: where each begins in the parsed text;
    None when `nodes` was not a list) are the pieces the text was cut into (`spans`),
    one each, in order: what confirms the cut."""
    if starts is None:
        return not spans
    return len(starts) == len(spans) and all(
        begin <= at < end for at, (begin, end) in zip(starts, spans, strict=True)
    )
