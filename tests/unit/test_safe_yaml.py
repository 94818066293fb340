"""`schemas.runtime.safe_yaml`: libyaml's parser and the pure-Python fallback hold the same rules.

The fast path composes in libyaml and checks the depth on the composed graph; the
fallback checks it while composing. Every rule is asserted on both, at its boundary, so
the two cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from iop_edge.core.configuration.config import ConfigInvalid, parse_config
from schemas.runtime import safe_yaml

#: Why the libyaml tests skip, and how to get it.
NO_LIBYAML = (
    "PyYAML without libyaml >= 0.2.5: pip install --force-reinstall pyyaml (its wheels "
    "bundle libyaml)"
)

PARSERS = [
    pytest.param(
        True,
        id="libyaml",
        marks=pytest.mark.skipif(not safe_yaml.LIBYAML, reason=NO_LIBYAML),
    ),
    pytest.param(False, id="pure-python"),
]
ROOT = Path(__file__).resolve().parents[2]
#: Every YAML file the repository and the package ship.
SHIPPED_CONFIGS = sorted(
    [
        *(ROOT / "configs").glob("*.yaml"),
        *(ROOT / "iop_edge" / "examples").glob("*.yaml"),
        *(ROOT / "iop_node" / "examples").glob("*.yaml"),
    ]
)


def _nested(levels: int, leaf: str = "x") -> str:
    """A flow document whose deepest node (`leaf`) sits `levels` levels down."""
    return "[" * (levels - 1) + leaf + "]" * (levels - 1)


def _load(text: str, libyaml: bool) -> object:
    node = safe_yaml.compose(text, libyaml=libyaml)
    if node is None:
        return None
    safe_yaml.check_expansion(node)
    return yaml.constructor.SafeConstructor().construct_document(node)


@pytest.mark.parametrize("libyaml", PARSERS)
def test_nesting_up_to_the_limit_loads(libyaml: bool) -> None:
    value = _load(_nested(safe_yaml.MAX_DEPTH), libyaml)
    for _ in range(safe_yaml.MAX_DEPTH - 1):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == "x"


@pytest.mark.parametrize("libyaml", PARSERS)
@pytest.mark.parametrize(
    "text",
    [
        _nested(safe_yaml.MAX_DEPTH + 1),  # a scalar one level too deep
        "a: &a 1\nb: " + _nested(safe_yaml.MAX_DEPTH, "*a"),  # an alias one level too deep
        # a mapping, then 63 block sequences: the last one's null item is 65 levels down
        "k:\n" + "".join("  " * i + "- \n" for i in range(1, safe_yaml.MAX_DEPTH)),
    ],
    ids=["scalar", "alias", "block"],
)
def test_one_level_past_the_limit_is_refused_with_a_position(libyaml: bool, text: str) -> None:
    with pytest.raises(yaml.MarkedYAMLError, match=f"nested deeper than {safe_yaml.MAX_DEPTH}"):
        safe_yaml.compose(text, libyaml=libyaml)


@pytest.mark.parametrize("libyaml", PARSERS)
def test_nesting_far_past_any_stack_is_a_yaml_error(libyaml: bool) -> None:
    with pytest.raises(yaml.YAMLError):
        safe_yaml.compose("[" * 100_000 + "]" * 100_000, libyaml=libyaml)


@pytest.mark.parametrize("libyaml", PARSERS)
def test_an_alias_used_deeper_than_where_it_was_written_counts_where_it_was_written(
    libyaml: bool,
) -> None:
    # The anchored block is 3 levels deep where written; repeated 60 levels down it
    # would reach 63 if it counted again, and it does not.
    text = "a: &a [[1]]\nb: " + _nested(safe_yaml.MAX_DEPTH - 1, "*a")
    assert isinstance(_load(text, libyaml), dict)


@pytest.mark.parametrize("libyaml", PARSERS)
def test_alias_bombs_and_recursive_aliases_are_refused(libyaml: bool) -> None:
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 6)]
    with pytest.raises(yaml.MarkedYAMLError, match="aliases expand this document"):
        _load("\n".join(bomb), libyaml)
    with pytest.raises(yaml.MarkedYAMLError, match="recursive alias"):
        _load("a: &loop [1, *loop]\n", libyaml)


@pytest.mark.parametrize("libyaml", PARSERS)
def test_a_lone_surrogate_is_a_reader_error_with_its_position(libyaml: bool) -> None:
    with pytest.raises(yaml.reader.ReaderError) as error:
        safe_yaml.compose("a: b\nc: \ud800\n", libyaml=libyaml)
    assert error.value.position == 8


def test_a_config_with_a_lone_surrogate_is_refused_with_its_position() -> None:
    with pytest.raises(ConfigInvalid) as invalid:
        parse_config("edge: {id: \ud800}\n")
    assert invalid.value.errors[0].message.startswith("invalid YAML at character 11")


@pytest.mark.skipif(not safe_yaml.LIBYAML, reason=NO_LIBYAML)
@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda path: path.name)
def test_both_parsers_build_the_same_data_from_the_shipped_configs(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    text += "x-shared: &shared {a: 1, b: [1.5, true, null, '2024-01-01']}\n"
    text += "x-merged: {<<: *shared, c: 2024-01-01}\n"  # a merge key and a timestamp
    assert _load(text, True) == _load(text, False)


#: Documents whose every node the direct construction covers, or hands to the constructor.
CONSTRUCTED = [
    "a: 1\nb: [x, 2, 0755, 0x1f, -3, +4, 1_000, 190:20:30]\n",
    "flags: [yes, No, true, ~, null, '', 1.5, .inf, -.nan, 1e3]\n",
    "when: 2024-01-02\nat: 2024-01-02T03:04:05Z\nraw: !!binary aGVsbG8=\n",
    "quoted: ['1', \"2\", !!str 3, !!int '4']\nempty:\n",
    "nested: {a: {b: [{c: d}, [e, [f]]]}}\n1: int key\n2024-01-01: date key\n",
    "set: !!set {a, b}\nomap: !!omap [{a: 1}, {b: 2}]\n",  # tagged collections
    "base: {a: 1}\nmerged: {<<: {b: 2}, c: 3}\n",  # a merge key without an alias
    "- top\n- level\n- [sequence]\n",
    "just a scalar\n",
]


@pytest.mark.parametrize("text", CONSTRUCTED)
def test_the_direct_construction_builds_what_pyyaml_builds(text: str) -> None:
    node = safe_yaml.compose(text)
    assert node is not None and not safe_yaml.has_aliases(text)
    expected = yaml.constructor.SafeConstructor().construct_document(node)
    direct = safe_yaml.construct(node, yaml.constructor.SafeConstructor(), aliases=False)
    assert direct == expected
    assert [type(v) for v in _leaves(direct)] == [type(v) for v in _leaves(expected)]


def _leaves(value: object) -> list[object]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in (*_leaves(k), *_leaves(v))]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("a: !!int abc\n", ValueError),  # a bad scalar: the constructor's own error
        ("? [complex, key]\n: value\n", yaml.constructor.ConstructorError),  # unhashable key
    ],
)
def test_the_direct_construction_fails_as_pyyaml_fails(text: str, error: type[Exception]) -> None:
    node = safe_yaml.compose(text)
    assert node is not None
    with pytest.raises(error):
        yaml.constructor.SafeConstructor().construct_document(node)
    with pytest.raises(error):
        safe_yaml.construct(node, yaml.constructor.SafeConstructor(), aliases=False)


@pytest.mark.parametrize("libyaml", PARSERS)
def test_duplicate_keys_are_reported_in_document_order_with_their_paths(libyaml: bool) -> None:
    text = (
        "edge: {id: a, id: b}\n"
        "nodes:\n"
        "  - id: n1\n"
        "    providers:\n"
        "      - {id: p, id: q}\n"
        "edge: {}\n"
    )
    with pytest.raises(ConfigInvalid) as invalid:
        parse_config(text)
    duplicates = [e for e in invalid.value.errors if e.message.startswith("duplicate key")]
    assert [e.path for e in duplicates] == ["edge.id", "nodes[0].providers[0].id", "edge"]


@pytest.mark.parametrize(
    ("text", "key", "first", "again"),
    [
        ("edge: ws://a\nnode_id: n\nedge: ws://b\n", "edge", 1, 3),
        ("telemetry:\n  traces: {sampler: a, sampler: b}\n", "sampler", 2, 2),
        ("base: &b {k: 1}\nuse: [*b, {k: 1, k: 2}]\n", "k", 2, 2),
    ],
)
def test_load_refuses_a_key_given_twice_with_both_lines(
    text: str, key: str, first: int, again: int
) -> None:
    with pytest.raises(yaml.MarkedYAMLError) as refused:
        safe_yaml.load(text)
    assert f"the key {key!r} is given twice (first at line {first}," in str(refused.value)
    assert refused.value.problem_mark is not None
    assert refused.value.problem_mark.line + 1 == again
    lenient = safe_yaml.load(text, unique_keys=False)  # the last one wins, as in PyYAML
    assert lenient == yaml.safe_load(text)


# --- has_aliases: the tree path is taken only where no alias can be ---------------------------


def _shares_a_node(root: yaml.Node) -> bool:
    """Whether the composed graph reaches one node twice: what an alias makes."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            return True
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(part for pair in node.value for part in pair)
    return False


#: Every place YAML lets an alias stand, each to an anchor written where YAML lets one.
WITH_ALIASES = [
    "a: &x 1\nb: *x\n",
    "- &x [1]\n- *x\n",
    "[&x 1, *x]\n",
    "[&x 1,*x]\n",
    "{a: &x 1, b: *x}\n",
    '{"a":&x 1, "b":*x}\n',
    "a: !!seq &x [1]\nb: *x\n",
    "? &x k\n: v\n? *x\n: w\n",
    "a: &x {b: 1}\nc: {<<: *x}\n",
    "\ufeff&x [a]: *x\n",
    "a:\t&x 1\nb:\t*x\n",
    "a: &x 1\u2028b: *x\n",
]

#: A `*` or `&` that is text: principals' "*", glob patterns, URLs, comments of words.
WITHOUT_ALIASES = [
    "principals:\n  - {ref: '*', models: [qwen3*, \"llama-*\", 'm-?*']}\n",
    'principals:\n  - ref: "*"\n    requests_per_minute: 60\n',
    "url: http://h/v1?a=1&b=2  # one & another*\n",
    "anchor-only: &x [1]\nglob: a*b\n",
    "star-only: [x, '*', b*]\nand: R&D\n",
]


@pytest.mark.parametrize("text", WITH_ALIASES)
def test_every_alias_is_seen_by_has_aliases(text: str) -> None:
    node = safe_yaml.compose(text)
    assert node is not None and _shares_a_node(node), "the case must hold a real alias"
    assert safe_yaml.has_aliases(text)


@pytest.mark.parametrize("text", WITHOUT_ALIASES)
def test_a_star_or_ampersand_that_is_text_keeps_the_tree_path(text: str) -> None:
    node = safe_yaml.compose(text)
    assert node is not None and not _shares_a_node(node)
    assert not safe_yaml.has_aliases(text)
    expected = yaml.constructor.SafeConstructor().construct_document(node)
    assert safe_yaml.construct(node, yaml.constructor.SafeConstructor(), aliases=False) == expected


_SPACE = st.sampled_from(["", " ", "  ", "\t"])
_ANCHOR_GAP = st.sampled_from([" ", "\t", " !!str "])


def _flow_node(node: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """One more level of flow YAML around `node`: a sequence or a mapping (plain or quoted
    keys, the latter allowing `"k":value`), maybe anchored (`%`, see `_anchor_first`);
    each with or without the optional white space."""
    items = st.lists(st.tuples(_SPACE, node), max_size=3)
    sequence = items.map(lambda xs: "[" + ",".join(sp + x for sp, x in xs) + "]")
    key = st.sampled_from(["k", '"k"', "'k'", "k2", '"k2"'])
    pairs = st.lists(st.tuples(_SPACE, key, st.sampled_from([": ", ":"]), node), max_size=3)
    mapping = pairs.map(lambda ps: "{" + ",".join(sp + k + c + v for sp, k, c, v in ps) + "}")
    return (sequence | mapping).flatmap(lambda text: st.sampled_from([text, "%" + text]))


def _anchor_first(text: str, gap: str) -> str:
    """The first placeholder becomes the anchor `&a`; every later `@` an alias `*a`."""
    anchored = False

    def fill(placeholder: re.Match[str]) -> str:
        nonlocal anchored
        if not anchored:
            anchored = True
            return f"&a{gap}" + ("x" if placeholder[0] == "@" else "")
        return "*a" if placeholder[0] == "@" else ""

    return re.sub("[@%]", fill, text)


#: Documents built from YAML's grammar: an anchor, then aliases, at every place a node
#: can stand, in flow and block collections, with every optional white space, beside
#: a `*` and an `&` that are text. Some are invalid (a repeated flow key): skipped.
_FLOW = st.recursive(
    st.sampled_from(["x", "'*'", '"&"', "a*b", "@", "@"]), _flow_node, max_leaves=8
)
_BLOCK = st.tuples(
    st.sampled_from(["- ", "k: ", "k:\t", "? ", '"k":']), st.lists(_FLOW, min_size=1, max_size=4)
).map(lambda block: "\n".join(block[0] + node for node in block[1]))
_YAMLISH = st.builds(
    lambda start, body, gap: start + _anchor_first(body, gap),
    st.sampled_from(["", "\ufeff", "---\n"]),
    _FLOW | _BLOCK,
    _ANCHOR_GAP,
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
@given(_YAMLISH)
@example("- &a x\n- *a\n")
@example("[&a x,*a]")
def test_has_aliases_never_misses_an_alias(text: str) -> None:
    """Soundness: a document that composes into a graph with a shared node (an alias) is
    always one `has_aliases` says may hold aliases, on both parsers."""
    for libyaml in (True, False) if safe_yaml.LIBYAML else (False,):
        try:
            node = safe_yaml.compose(text, libyaml=libyaml)
        except yaml.YAMLError:
            continue
        if node is not None and _shares_a_node(node):
            assert safe_yaml.has_aliases(text)
