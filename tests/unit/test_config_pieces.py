"""Tests for `iop_edge.core.configuration.config_pieces` and reading a refresh candidate by its
pieces.

A candidate read against the last valid config's proof parses only the Node entries
whose text changed. That must give exactly what reading the whole text gives: the same
raw data, the same config, the same errors (paths, messages, positions), the same
warnings. Where the text's pieces are not sure to read the same, it is read whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_edge.core.configuration import config as config_module
from iop_edge.core.configuration.config import ConfigInvalid, ParsedConfig, parse_config
from iop_edge.core.configuration.config_pieces import cut, entries_in_place
from iop_edge.core.configuration.config_proof import ConfigProof, entry_key
from iop_edge.core.configuration.tokens import DEMO_NODE_TOKEN_SHA256, hash_token
from schemas.config import EdgeConfig

HASH = hash_token("pieces-node-token")
OTHER = hash_token("pieces-other-token")

BASE = f"""\
# A fleet, written by hand.
edge:
  id: edge-a   # a comment after a value
  listen: 127.0.0.1:7700
admin:
  listen: 127.0.0.1:7701
models:
- id: m1
  display_name: >
    Model one,
    folded
  providers:
    n1-p: sim-small
    n2-p: sim-small
    n3-p: sim-small
nodes:   # the fleet
# before the first entry
- id: n1
  alias: |
    rack a
    slot 1
  token_hash_sha256: {HASH}
  providers:
  - id: n1-p
    type: sim
    models: [sim-small]
    capacity: 2
- id: n2
  alias: "two
    lines"
  token_hash_sha256: '{HASH}'
  providers:
    - {{id: n2-p, type: sim, models: [sim-small], capacity: 2}}
# between two entries, in column 0
-   id: n3
    token_hash_sha256: {HASH}
    providers:
    - id: n3-p
      type: sim
      models:
      - sim-small
      capacity: 3
dispatch:
  max_queue: 10
"""

Outcome = tuple[EdgeConfig | None, list[tuple[str, str]], list[str]]


def outcome(text: str, proof: ConfigProof | None = None) -> Outcome:
    """What reading `text` gives: the config and warnings, or every error."""
    try:
        parsed = parse_config(text, proof=proof)
    except ConfigInvalid as invalid:
        return None, [(error.path, error.message) for error in invalid.errors], []
    return parsed.config, [], parsed.warnings


def read_after(base: str, candidate: str) -> ParsedConfig | None:
    """`candidate` read against `base`'s proof, asserted to read as the text read whole
    (the outcome, and the raw data of the read step); the parse, when valid."""
    proof = parse_config(base).proof
    assert proof is not None
    assert outcome(candidate, proof) == outcome(candidate)
    assert_same_data(candidate, proof)
    try:
        return parse_config(candidate, proof=proof)
    except ConfigInvalid:
        return None


def assert_same_data(text: str, proof: ConfigProof) -> None:
    """The read step itself: every entry not parsed is, by its key, the raw data that
    reading the whole text gives at its place (`config_proof` Rule 1), and the rest is
    equal."""
    try:
        whole, errors, _ = config_module._read_yaml(text)
    except ConfigInvalid as invalid:
        with pytest.raises(ConfigInvalid) as again:
            config_module._read(text, proof)
        assert again.value.errors == invalid.errors
        return
    read = config_module._read(text, proof)
    assert read.errors == errors
    if not read.known:
        assert read.data == whole
        return
    assert isinstance(read.data, dict) and isinstance(whole, dict)
    assert list(read.data) == list(whole)
    assert {k: v for k, v in read.data.items() if k != "nodes"} == {
        k: v for k, v in whole.items() if k != "nodes"
    }
    assert len(read.data["nodes"]) == len(whole["nodes"])
    for index, (entry, whole_entry) in enumerate(
        zip(read.data["nodes"], whole["nodes"], strict=True)
    ):
        if index in read.known:
            assert entry is None
            assert read.known[index] == entry_key(whole_entry)
        else:
            assert entry == whole_entry


def entry_of(text: str, node_id: str) -> str:
    """The text of the entry of `node_id` in `text`, as `cut` finds it."""
    pieces = cut(text)
    assert pieces is not None
    found = [
        pieces.entry(i) for i in range(pieces.entries) if f"id: {node_id}\n" in pieces.entry(i)
    ]
    assert len(found) == 1, found
    return found[0]


# --------------------------------------------------------------------------- the cut


def test_a_plain_config_is_cut_at_its_keys_and_node_entries() -> None:
    pieces = cut(BASE)
    assert pieces is not None
    assert pieces.keys == ("edge", "admin", "models", "nodes", "dispatch")
    assert pieces.entries == 3
    assert pieces.entry(0).startswith("- id: n1\n  alias: |\n")
    assert pieces.entry(1).endswith("# between two entries, in column 0\n")
    assert pieces.entry(2).startswith("-   id: n3\n") and pieces.entry(2).endswith("capacity: 3\n")


def test_taking_entries_out_keeps_the_rest_and_says_where_the_others_are() -> None:
    pieces = cut(BASE)
    assert pieces is not None
    text, spans = pieces.without({1})
    assert text == BASE.replace(pieces.entry(1), "")
    assert [text[start:end] for start, end in spans] == [pieces.entry(0), pieces.entry(2)]
    whole, spans = pieces.without(())
    assert whole == BASE and len(spans) == 3


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (BASE.replace("\n", "\r\n"), "CRLF line ends"),
        ("\ufeff" + BASE, "a byte order mark"),
        (BASE.replace("  listen: 127.0.0.1:7701", "\tlisten: 127.0.0.1:7701"), "a tab indent"),
        (
            BASE.replace("edge:\n", "edge: &e\n").replace("dispatch:\n", "extra: *e\ndispatch:\n"),
            "an alias",
        ),
        ("---\n" + BASE, "a document marker"),
        ("%YAML 1.1\n---\n" + BASE, "a directive"),
        (BASE.replace("admin:\n", '"admin":\n'), "a quoted key"),
        (
            BASE.replace("admin:\n  listen: 127.0.0.1:7701\n", "{admin: {listen: x}}\n"),
            "flow at the top",
        ),
        (BASE.replace("admin:\n", "? admin\n:\n"), "an explicit key"),
        (BASE + "edge:\n  id: twice\n", "a key given twice"),
        ("  indented: 1\n" + BASE, "content before the first key"),
        (BASE.replace("admin:", "admin:x"), "a key without a space after its colon"),
        ("", "an empty text"),
        ("# only a comment\n", "no key"),
    ],
)
def test_text_that_is_not_plain_block_style_is_not_cut(text: str, why: str) -> None:
    assert cut(text) is None, why


@pytest.mark.parametrize(
    "nodes",
    [
        "nodes: []\n",
        "nodes: !!seq\n- id: n1\n",
        "nodes:\n  id: n1\n",
        "nodes:\n",
        "nodes:\n  - id: n1\n - id: n2\n",  # a line indented less than the first entry
    ],
)
def test_nodes_that_are_not_a_block_list_are_not_cut_apart(nodes: str) -> None:
    pieces = cut("edge:\n  id: e\n" + nodes)
    assert pieces is not None
    assert pieces.entries == 0


def test_entries_in_place_wants_one_entry_starting_in_each_piece() -> None:
    spans = [(10, 20), (20, 35)]
    assert entries_in_place([12, 22], spans)
    assert not entries_in_place([12], spans)
    assert not entries_in_place([12, 36], spans)
    assert not entries_in_place(None, spans)
    assert entries_in_place(None, [])


# --------------------------------------------------------------------------- reading by pieces


def test_a_change_to_one_entry_parses_that_entry_only() -> None:
    candidate = BASE.replace("capacity: 3", "capacity: 5")
    parsed = read_after(BASE, candidate)
    assert parsed is not None
    assert (parsed.parsed_nodes, parsed.checked_nodes) == (1, 1)
    assert parsed.config.nodes[2].providers[0].capacity == 5


def test_reordered_entries_are_all_known() -> None:
    pieces = cut(BASE)
    assert pieces is not None
    head = BASE[: pieces.bounds[0]]
    tail = BASE[pieces.bounds[-1] :]
    candidate = head + pieces.entry(2) + pieces.entry(0) + pieces.entry(1) + tail
    parsed = read_after(BASE, candidate)
    assert parsed is not None
    assert parsed.parsed_nodes == 0
    assert [node.id for node in parsed.config.nodes] == ["n3", "n1", "n2"]


def test_added_and_removed_entries() -> None:
    added = BASE.replace(
        "dispatch:\n",
        f"- id: n4\n  token_hash_sha256: {OTHER}\n  providers: []\ndispatch:\n",
    )
    parsed = read_after(BASE, added)
    assert parsed is not None and parsed.parsed_nodes == 1
    removed = BASE.replace(entry_of(BASE, "n1"), "").replace("    n1-p: sim-small\n", "")
    parsed = read_after(BASE, removed)
    assert parsed is not None and parsed.parsed_nodes == 0
    assert [node.id for node in parsed.config.nodes] == ["n2", "n3"]


def test_a_top_level_change_reads_the_entries_from_the_proof() -> None:
    candidate = BASE.replace("id: edge-a", "id: edge-b").replace("max_queue: 10", "max_queue: 11")
    parsed = read_after(BASE, candidate)
    assert parsed is not None
    assert parsed.parsed_nodes == 0 and parsed.config.edge.id == "edge-b"


INDENTED = f"""\
models:
  - id: m1
    providers: {{n1-p: sim-small, n2-p: sim-small}}
nodes:
  - id: n1
    token_hash_sha256: {HASH}
    providers:
      - id: n1-p
        type: sim
        models: [sim-small]
        capacity: 2
  # a comment indented like the entries
  - id: n2
    token_hash_sha256: {HASH}
    providers:
      - id: n2-p
        type: sim
        models: [sim-small]
        capacity: 2"""  # no line break after the last line


def test_indented_entries_and_a_last_line_without_a_break() -> None:
    pieces = cut(INDENTED)
    assert pieces is not None and pieces.entries == 2
    assert pieces.entry(1).startswith("  - id: n2\n") and pieces.entry(1).endswith("capacity: 2")
    candidate = INDENTED.replace("capacity: 2\n  #", "capacity: 4\n  #")
    parsed = read_after(INDENTED, candidate)
    assert parsed is not None and parsed.parsed_nodes == 1
    assert parsed.config.nodes[0].providers[0].capacity == 4
    added = INDENTED + f"\n  - id: n3\n    token_hash_sha256: {OTHER}\n"
    parsed = read_after(INDENTED, added)
    assert parsed is not None
    assert parsed.parsed_nodes == 2  # n2's text gained a line break: it is parsed again


def test_an_entry_with_an_anchor_elsewhere_is_read_whole() -> None:
    candidate = BASE.replace("  display_name: >", "  display_name: &name >")
    candidate = candidate.replace("-   id: n3\n", "-   id: n3\n    alias: *name\n")
    parsed = read_after(BASE, candidate)
    assert parsed is not None and parsed.parsed_nodes == 3


def test_a_quoted_string_across_a_would_be_cut_is_read_whole() -> None:
    """A multi-line quoted alias whose second line looks like the next entry: the cut
    is false, the parse finds fewer entries than pieces, and the text is read whole."""
    candidate = BASE.replace('  alias: "two\n    lines"\n', '  alias: "two\n- id: n1\n  x"\n')
    pieces = cut(candidate)
    assert pieces is not None and pieces.entries == 4  # one piece too many: a false cut
    parsed = read_after(BASE, candidate)
    assert parsed is not None
    assert parsed.parsed_nodes == 3
    assert parsed.config.nodes[1].alias == "two - id: n1 x"


def test_a_quoted_string_across_a_top_level_key_is_read_whole() -> None:
    candidate = BASE.replace("id: edge-a   # a comment after a value", 'id: "edge\nnodes: x"')
    assert outcome(candidate) == outcome(candidate, parse_config(BASE).proof)
    read_after(BASE, candidate)


def test_errors_in_a_changed_entry_read_as_in_the_whole_text() -> None:
    bad_value = BASE.replace("capacity: 3", "capacity: 0")
    assert read_after(BASE, bad_value) is None
    assert outcome(bad_value)[1] == [("nodes[2].providers[0].capacity", "must be >= 1")]
    duplicate_key = BASE.replace("capacity: 3", "capacity: 3\n      capacity: 4")
    assert read_after(BASE, duplicate_key) is None
    assert outcome(duplicate_key)[1] == [
        (
            "nodes[2].providers[0].capacity",
            "duplicate key at line 43, column 7 (first at line 42, column 7)",
        )
    ]
    syntax = BASE.replace("capacity: 3", "capacity: [3")
    assert read_after(BASE, syntax) is None
    (error,) = outcome(syntax)[1]
    assert error == (
        "",
        "invalid YAML at line 43, column 9: while parsing a flow sequence, did not find "
        "expected ',' or ']'",
    )


def test_a_changed_entry_that_repeats_a_known_id_is_named_as_in_the_whole_text() -> None:
    candidate = BASE.replace("id: n3\n", "id: n1\n")
    assert read_after(BASE, candidate) is None
    assert ("nodes[2].id", "duplicate node id 'n1' (first at nodes[0])") in outcome(candidate)[1]


def test_another_edge_listen_loopback_reads_the_entries_again() -> None:
    """A proof holds only for an `edge.listen` as loopback as its own (`config_proof`
    Rule 2): with the demo token hash, an entry valid before is invalid now."""
    base = BASE.replace(
        f"token_hash_sha256: {HASH}", f"token_hash_sha256: {DEMO_NODE_TOKEN_SHA256}", 1
    )
    assert base != BASE
    candidate = base.replace("listen: 127.0.0.1:7700", "listen: 0.0.0.0:7700")
    assert read_after(base, candidate) is None
    assert outcome(candidate)[1][0][0] == "nodes[0].token_hash_sha256"


def test_the_proof_of_a_text_read_by_pieces_knows_its_entries_too() -> None:
    first = BASE.replace("capacity: 3", "capacity: 5")
    proof = parse_config(BASE).proof
    parsed = parse_config(first, proof=proof)
    second = first.replace("id: edge-a", "id: edge-c")
    assert parse_config(second, proof=parsed.proof).parsed_nodes == 0


# --------------------------------------------------------------------------- property


@dataclass(frozen=True)
class _Node:
    """One Node entry, and how it is written."""

    number: int
    capacity: int
    alias: str
    comment: str
    flow: bool


_ALIASES = st.sampled_from(
    [
        "",
        "  alias: plain words\n",
        '  alias: "quoted\n    across lines"\n',
        "  alias: |\n    literal\n      indented more\n",
        "  alias: >-\n    folded\n    text\n",
        "  alias: |+\n    kept\n\n",
        "  alias: 'single # not a comment'\n",
        '  alias: "a false\n- id: cut"\n',
        "  alias: [not, a, string]\n",
    ]
)
_COMMENTS = st.sampled_from(["", "# col 0\n", "  # indented\n", "\n", "#\n\n"])


def _nodes(*, valid: bool = False) -> st.SearchStrategy[_Node]:
    aliases = _ALIASES.filter(lambda alias: "[" not in alias) if valid else _ALIASES
    return st.builds(
        _Node,
        number=st.integers(0, 7),
        capacity=st.integers(1 if valid else 0, 3),
        alias=aliases,
        comment=_COMMENTS,
        flow=st.booleans(),
    )


def _render(nodes: list[_Node], *, indent: int, edge_id: str, tail: bool) -> str:
    """A config with these nodes, each provider mapped by one model."""
    pad = " " * indent
    lines = [f"edge:\n  id: {edge_id}\n  listen: 127.0.0.1:7700\n"]
    lines.append("models:\n- id: m\n  providers:\n")
    lines.extend(f"    p{node.number}: sim-small\n" for node in dict.fromkeys(nodes))
    if not nodes:
        lines.append("    p0: sim-small\n")
    lines.append("nodes:\n")
    for node in nodes:
        body = f"- id: n{node.number}\n{node.alias}  token_hash_sha256: {HASH}\n"
        if node.flow:
            body += (
                f"  providers: [{{id: p{node.number}, type: sim, models: [sim-small], "
                f"capacity: {node.capacity}}}]\n"
            )
        else:
            body += (
                f"  providers:\n  - id: p{node.number}\n    type: sim\n"
                f"    models: [sim-small]\n    capacity: {node.capacity}\n"
            )
        body += node.comment
        lines.append(
            "".join(pad + line if line.strip() else line for line in body.splitlines(keepends=True))
        )
    if tail:
        lines.append("dispatch:\n  max_queue: 5\n")
    return "".join(lines)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base_nodes=st.lists(_nodes(valid=True), min_size=1, max_size=6, unique_by=lambda n: n.number),
    kept=st.lists(st.booleans(), min_size=6, max_size=6),
    edits=st.lists(_nodes(), max_size=3),
    order=st.randoms(use_true_random=False),
    shuffle=st.booleans(),
    indent=st.sampled_from([0, 2]),
    edge_id=st.sampled_from(["e1", "e2"]),
    tail=st.booleans(),
)
def test_reading_by_pieces_reads_as_the_whole_text(
    *,
    base_nodes: list[_Node],
    kept: list[bool],
    edits: list[_Node],
    order: Any,
    shuffle: bool,
    indent: int,
    edge_id: str,
    tail: bool,
) -> None:
    """Whatever the base and the candidate (entries kept, changed, added, repeated,
    removed, reordered; comments, block scalars, quoted lines, flow, a quoted line that
    looks like an entry; valid or not), the candidate read against the base's proof
    reads exactly as the candidate read whole."""
    base = _render(base_nodes, indent=indent, edge_id="e1", tail=True)
    proof = parse_config(base).proof
    assert proof is not None
    candidate_nodes = [node for node, keep in zip(base_nodes, kept, strict=False) if keep]
    for edit in edits:
        candidate_nodes.insert(order.randrange(len(candidate_nodes) + 1), edit)
    if shuffle:
        order.shuffle(candidate_nodes)
    candidate = _render(candidate_nodes, indent=indent, edge_id=edge_id, tail=tail)
    assert outcome(candidate, proof) == outcome(candidate)
    assert_same_data(candidate, proof)


def test_a_false_cut_beside_known_entries_is_read_whole() -> None:
    """Known entries around a new one whose quoted alias holds a line like an entry's
    start: the parse finds one entry fewer than the pieces, and the text is read
    whole."""
    base_nodes = [_Node(0, 1, "", "", False), _Node(1, 1, "", "", False)]
    base = _render(base_nodes, indent=0, edge_id="e1", tail=True)
    false_cut = _Node(2, 1, '  alias: "a false\n- id: cut"\n', "", False)
    candidate = _render(
        [base_nodes[0], false_cut, base_nodes[1]], indent=0, edge_id="e1", tail=True
    )
    proof = parse_config(base).proof
    assert proof is not None
    pieces = cut(candidate)
    assert pieces is not None and pieces.entries == 4 and set(proof.known(pieces)) == {0, 3}
    parsed = read_after(base, candidate)
    assert parsed is not None and parsed.parsed_nodes == 3
    assert parsed.config.nodes[1].alias == "a false - id: cut"
