"""Cache affinity's pure rules: the key (core.routing.affinity), the prefix index
(core.routing.prefix_index) and the load-bounded rendezvous choice (core.routing.pool Rule 7)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from iop_edge.core.responses.response_chain import StoredTurn, continue_body, conversation
from iop_edge.core.routing.affinity import (
    BLOCKS,
    MAX_SESSION_CHARS,
    affinity_of,
    chat_conversation,
    messages_conversation,
    rendezvous_order,
    responses_conversation,
    session_header,
)
from iop_edge.core.routing.pool import Grant, Preference, ProviderView, decide
from iop_edge.core.routing.prefix_index import PrefixIndex

SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def chat_turns(first: str, turns: int) -> list[dict[str, Any]]:
    """The chat bodies of one agent conversation: each turn the last one's messages, its
    answer and a new user message."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first}]
    bodies = []
    for turn in range(turns):
        bodies.append({"model": "m", "tools": TOOLS, "messages": list(messages)})
        messages += [
            {"role": "assistant", "content": f"step {turn} done"},
            {"role": "user", "content": f"now step {turn + 1}"},
        ]
    return bodies


def chat(body: dict[str, Any], principal: str = "alice", **headers: str) -> Any:
    return affinity_of(chat_conversation, body, headers, principal=principal, model="m")


# --- the key (Rules 1-2) -------------------------------------------------------------


def test_session_headers_are_read_in_the_documented_order() -> None:
    every = {
        "x-claude-code-session-id": "claude",
        "session_id": "codex-underscore",
        "session-id": "codex-dash",
        "x-session-id": "generic",
        "x-session-affinity": "affinity",
    }
    body = {"prompt_cache_key": "cache-key"}
    assert session_header(every, body) == "claude"
    del every["x-claude-code-session-id"]
    assert session_header(every, body) == "codex-underscore"
    del every["session_id"]
    assert session_header(every, body) == "codex-dash"
    del every["session-id"]
    assert session_header(every, body) == "cache-key"
    assert session_header(every, {}) == "generic"
    del every["x-session-id"]
    assert session_header(every, {}) == "affinity"
    assert session_header({}, {}) is None
    # an empty or overlong id does not count: the next source decides
    assert session_header({"x-session-id": "", "x-session-affinity": "b"}, {}) == "b"
    assert session_header({"x-session-id": "x" * (MAX_SESSION_CHARS + 1)}, {}) is None


def test_a_session_id_keys_every_turn_alike_whatever_the_prompt() -> None:
    one = chat({"messages": [{"role": "user", "content": "a"}]}, **{"session_id": "s1"})
    two = chat({"messages": [{"role": "user", "content": "b"}]}, **{"session_id": "s1"})
    other = chat({"messages": [{"role": "user", "content": "a"}]}, **{"session_id": "s2"})
    assert one.source == two.source == "session"
    assert one.key == two.key != other.key


def test_a_conversations_turns_share_its_prompt_key_and_prefix() -> None:
    turns = [chat(body) for body in chat_turns("fix the test", 4)]
    assert {turn.source for turn in turns} == {"prefix"}
    assert len({turn.key for turn in turns}) == 1
    for earlier, later in itertools.pairwise(turns):
        # the earlier turn's whole prompt is a prefix of the later one's
        assert earlier.blocks[-1] in later.blocks
        assert later.blocks[-1] not in earlier.blocks
    # another conversation with the same system prompt and tools: another key, no block
    # in common (the shared head alone is no prefix worth following)
    other = chat(chat_turns("write the docs", 1)[0])
    assert other.key != turns[0].key
    assert not set(other.blocks) & {block for turn in turns for block in turn.blocks}


def test_a_long_conversation_costs_a_bounded_number_of_blocks() -> None:
    turns = [chat(body) for body in chat_turns("fix the test", 40)]
    assert len(turns[-1].blocks) == BLOCKS
    assert turns[-2].blocks[-1] in turns[-1].blocks


def test_the_key_ignores_a_changed_system_prompt() -> None:
    body = chat_turns("fix the test", 1)[0]
    changed = {**body, "messages": [{"role": "system", "content": "new"}, *body["messages"][1:]]}
    assert chat(body).key == chat(changed).key
    assert chat(body).blocks[-1] != chat(changed).blocks[-1]  # not the same prefix


def test_another_principals_identical_prompt_has_its_own_key_unless_shared() -> None:
    body = chat_turns("fix the test", 2)[1]
    alice, bob = chat(body, "alice"), chat(body, "bob")
    assert alice.key != bob.key
    assert not set(alice.blocks) & set(bob.blocks)
    shared = [
        affinity_of(chat_conversation, body, {}, principal=p, model="m", shared_prefixes=True)
        for p in ("alice", "bob")
    ]
    assert shared[0].key == shared[1].key and shared[0].blocks == shared[1].blocks
    # a session id is never shared between principals
    sessions = [
        affinity_of(
            chat_conversation,
            body,
            {"x-session-id": "s"},
            principal=p,
            model="m",
            shared_prefixes=True,
        )
        for p in ("alice", "bob")
    ]
    assert sessions[0].key != sessions[1].key


def test_a_responses_continuation_keeps_its_chains_key() -> None:
    first = {"model": "m", "instructions": "be brief", "input": "hello", "store": True}
    turn_one = affinity_of(responses_conversation, first, {}, principal="alice", model="m")
    # the Edge stores the request's items and the output as JSON, and rebuilds the
    # conversation from them (core.responses.response_chain)
    encode = msgspec.json.encode
    stored = StoredTurn(
        id="resp_1",
        previous_id=None,
        input_items=[msgspec.Raw(encode({"type": "message", "role": "user", "content": "hello"}))],
        output_items=[
            msgspec.Raw(encode({"type": "message", "role": "assistant", "content": "hi"}))
        ],
    )
    # (instructions are not carried over: a client sends them again, as Codex does)
    second: dict[str, Any] = {
        "model": "m",
        "instructions": "be brief",
        "input": [{"role": "user", "content": "more"}],
    }
    continue_body(second, conversation([stored], second["input"]))
    turn_two = affinity_of(
        responses_conversation, second, {}, principal="alice", model="m", chained=True
    )
    assert turn_two.source == "chain"
    assert turn_two.key == turn_one.key
    assert turn_one.blocks[-1] in turn_two.blocks


def test_messages_lay_out_system_tools_then_messages() -> None:
    body = {
        "system": [{"type": "text", "text": "sys"}],
        "tools": [{"name": "read", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    }
    affinity = affinity_of(messages_conversation, body, {}, principal="p", model="m")
    assert len(affinity.blocks) == 2  # one per message; the head is in each
    without_tools = affinity_of(
        messages_conversation, {**body, "tools": []}, {}, principal="p", model="m"
    )
    assert not set(affinity.blocks) & set(without_tools.blocks)


# --- the prefix index ------------------------------------------------------------------


def test_the_index_answers_the_holder_of_the_longest_prefix() -> None:
    index = PrefixIndex()
    turns = [chat(body) for body in chat_turns("fix the test", 3)]
    index.record("p1", turns[0].blocks, now=0.0)
    index.record("p2", turns[1].blocks, now=1.0)
    # two messages back from the third turn's end: the second turn's whole prompt
    assert index.lookup(turns[2].blocks, now=2.0) == (2, frozenset({"p2"}))
    assert index.lookup(turns[1].blocks, now=2.0) == (0, frozenset({"p2"}))
    assert index.lookup(turns[0].blocks, now=2.0) == (0, frozenset({"p1"}))
    # only the shared system prompt and tools in common: no match
    stranger = chat(chat_turns("write the docs", 1)[0])
    assert index.lookup(stranger.blocks, now=2.0) == (-1, frozenset())


def test_the_index_ages_and_is_bounded() -> None:
    index = PrefixIndex(max_entries=2, ttl_s=10.0)
    conversations = [chat(chat_turns(f"task {n}", 1)[0]) for n in range(3)]
    for n, affinity in enumerate(conversations):
        index.record(f"p{n}", affinity.blocks, now=float(n))
    assert len(index) == 2
    first = conversations[0]
    assert index.lookup(first.blocks, now=3.0)[1] == frozenset()  # evicted
    last = conversations[2]
    assert index.lookup(last.blocks, now=3.0)[1] == {"p2"}
    assert index.lookup(last.blocks, now=12.5)[1] == frozenset()  # too old
    index.record("p9", last.blocks, now=13.0)
    assert len(index) == 1  # the aged entry went


# --- the choice (pool Rule 7) ----------------------------------------------------------

IDS = ("p0", "p1", "p2", "p3")


def views(**in_flight: int) -> dict[str, ProviderView]:
    return {pid: ProviderView(id=pid, capacity=4, in_flight=in_flight.get(pid, 0)) for pid in IDS}


def pick(pool: dict[str, ProviderView], preference: Preference) -> str:
    decision = decide("m", IDS, pool, long=False, preference=preference)
    assert isinstance(decision, Grant)
    return decision.provider.id


def test_a_key_goes_to_its_rendezvous_choice_while_within_the_bound() -> None:
    key = 12345
    first, second = rendezvous_order(key, IDS)[:2]
    assert pick(views(), Preference(key=key)) == first
    assert pick(views(**{first: 1}), Preference(key=key)) == first  # 1/4 ahead: within
    # two ahead of the idlest, beyond the 0.25 bound: its next choice, not the queue
    assert pick(views(**{first: 2}), Preference(key=key)) == second
    assert pick(views(**{first: 2}), Preference(key=key, bound=0.5)) == first
    # full: never waited for
    full = {pid: 3 for pid in IDS} | {first: 4}
    assert pick(views(**full), Preference(key=key)) != first


def test_the_holder_of_the_longest_prefix_wins_within_the_bound() -> None:
    key = 777
    order = rendezvous_order(key, IDS)
    holder = order[-1]
    assert pick(views(), Preference(key=key, holders=frozenset({holder}))) == holder
    busy = views(**{holder: 2})
    assert pick(busy, Preference(key=key, holders=frozenset({holder}))) == order[0]


def test_a_holder_counts_only_among_rule_4s_equals() -> None:
    """A holder that translates while others speak the run's protocol, or that ranks
    behind on priority, is passed over; several holders within the bound: Rule 4 among
    them (the idlest)."""
    key = 777
    order = rendezvous_order(key, IDS)
    holder = order[-1]
    holders = frozenset({holder})
    translated = {pid: ProviderView(id=pid, capacity=4, native=pid != holder) for pid in IDS}
    assert pick(translated, Preference(key=key, holders=holders)) == order[0]
    behind = {
        pid: ProviderView(id=pid, capacity=4, priority=200 if pid == holder else 100) for pid in IDS
    }
    assert pick(behind, Preference(key=key, holders=holders)) == order[0]
    both = frozenset(order[2:])
    busier = views(**{order[2]: 1})
    assert pick(busier, Preference(key=key, holders=both)) == order[3]


def test_one_hot_key_spreads_over_every_provider() -> None:
    """Runs of one key, none ending: the key's provider takes a run only while at most
    the bound (one run in four) ahead of the idlest, and every provider takes its share."""
    load = dict.fromkeys(IDS, 0)
    for _ in range(16):
        load[pick(views(**load), Preference(key=99))] += 1
        assert max(load.values()) - min(load.values()) <= 2
    assert set(load.values()) == {4}


def test_native_providers_come_first_with_a_preference_too() -> None:
    key = 5
    first = rendezvous_order(key, IDS)[0]
    pool = {pid: ProviderView(id=pid, capacity=4, native=pid != first) for pid in IDS}
    assert pick(pool, Preference(key=key)) != first


def test_a_provider_that_leaves_hands_only_its_keys_on() -> None:
    keys = range(400)
    before = {key: rendezvous_order(key, IDS)[0] for key in keys}
    remaining = IDS[:3]
    pool = {pid: view for pid, view in views().items() if pid in remaining}
    for key in keys:
        decision = decide("m", remaining, pool, long=False, preference=Preference(key=key))
        assert isinstance(decision, Grant)
        if before[key] != "p3":
            assert decision.provider.id == before[key]
        else:
            assert decision.provider.id == rendezvous_order(key, IDS)[1]


@pytest.mark.parametrize("bound", [0.0, 0.25, 1.0])
def test_the_choice_is_always_admissible(bound: float) -> None:
    pool = views(p0=4, p1=4, p2=3)
    assert pick(pool, Preference(key=1, bound=bound)) in {"p2", "p3"}


def test_codex_and_claude_code_requests_as_recorded() -> None:
    """The bodies the agents really send (tests/protocols/fixtures): Codex's Responses
    request carries `prompt_cache_key`; Claude Code's turns, with its session header,
    keep one key, and its tool-result turn continues its first turn's prompt."""
    fixtures = Path(__file__).parent.parent / "protocols" / "fixtures"

    def load(name: str) -> dict[str, Any]:
        body: dict[str, Any] = json.loads((fixtures / name).read_text())
        return body

    codex = affinity_of(
        responses_conversation, load("codex_first_turn.json"), {}, principal="p", model="m"
    )
    assert codex.source == "session"
    tool_output = load("codex_tool_output.json")
    assert (
        affinity_of(responses_conversation, tool_output, {}, principal="p", model="m").key
        == codex.key
    )
    headers = {"x-claude-code-session-id": "0b6c5f0e"}
    first = affinity_of(
        messages_conversation,
        load("claude_code_first_turn.json"),
        headers,
        principal="p",
        model="m",
    )
    later = affinity_of(
        messages_conversation,
        load("claude_code_tool_result.json"),
        headers,
        principal="p",
        model="m",
    )
    assert first.source == later.source == "session" and first.key == later.key
    assert len(later.blocks) > len(first.blocks) or later.blocks[-1] != first.blocks[-1]


def test_claude_codes_moving_cache_marks_do_not_change_the_conversation() -> None:
    """Claude Code marks the newest message `cache_control` every turn: the mark moves,
    the prompt does not."""

    def user(text: str, marked: bool) -> dict[str, Any]:
        block: dict[str, Any] = {"type": "text", "text": text}
        if marked:
            block["cache_control"] = {"type": "ephemeral"}
        return {"role": "user", "content": [block]}

    system = [
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
    ]
    one = {"system": system, "messages": [user("hi", marked=True)]}
    two = {
        "system": system,
        "messages": [
            user("hi", marked=False),
            {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            user("run the tests", marked=True),
        ],
    }
    first = affinity_of(messages_conversation, one, {}, principal="p", model="m")
    second = affinity_of(messages_conversation, two, {}, principal="p", model="m")
    assert first.key == second.key
    assert first.blocks[-1] in second.blocks
