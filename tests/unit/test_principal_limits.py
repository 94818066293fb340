"""Principals' limits (design §15): the config rules, the refresh classification, the pure
policy (`core.principals`) and the limiter's admission and budgets
(`runtime.runs.limits`), on fake clocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import pytest
import trio
import yaml
from rich.console import Console
from trio.testing import MockClock, wait_all_tasks_blocked

from iop_edge.cli.console import render_usage
from iop_edge.core.configuration.config import ConfigInvalid, parse_config
from iop_edge.core.principals import (
    SECONDS_PER_DAY,
    Bucket,
    PrincipalPolicies,
    concurrency_share,
    describe_limits,
    format_reset,
    minute_share,
)
from iop_edge.core.refresh.refresh_diff import compare_configs, live_subset, live_subset_errors
from iop_edge.core.refresh.refresh_plan import plan_apply
from iop_edge.http.protocols.caller_protocol import CallerProtocol
from iop_edge.http.protocols.chat import CHAT
from iop_edge.http.protocols.messages import MESSAGES
from iop_edge.http.protocols.responses import RESPONSES
from iop_edge.http.rate_limit_headers import (
    anthropic_rate_limit_headers,
    openai_rate_limit_headers,
)
from iop_edge.runtime.runs.limits import (
    BUDGET_SYNC_S,
    DEFAULT_OUTPUT_ESTIMATE,
    LimitExceeded,
    PrincipalLimiter,
    RateLimits,
    output_bound,
)
from schemas.config import PrincipalLimits

HASH_A = "a" * 64
HASH_B = "b" * 64


def config_text(principals: list[dict[str, object]], *, tokens: bool = True) -> str:
    config: dict[str, object] = {
        "edge": {"state_dir": "/tmp/iop-test-principals"},
        "openai": {
            "principal_tokens": [
                {"token_ref": "a-key", "principal_ref": "alice", "token_hash_sha256": HASH_A},
                {"token_ref": "b-key", "principal_ref": "bob", "token_hash_sha256": HASH_B},
            ]
            if tokens
            else []
        },
        "models": [
            {"id": "chat-small", "providers": {"p": "small"}},
            {"id": "chat-large", "providers": {"p": "large"}},
        ],
        "nodes": [
            {
                "id": "n",
                "token_hash_sha256": "c" * 64,
                "providers": [
                    {"id": "p", "type": "sim", "models": ["small", "large"], "capacity": 2}
                ],
            }
        ],
        "principals": principals,
    }
    return yaml.safe_dump(config)


def errors_of(principals: list[dict[str, object]], *, tokens: bool = True) -> list[str]:
    with pytest.raises(ConfigInvalid) as caught:
        parse_config(config_text(principals, tokens=tokens))
    return [str(error) for error in caught.value.errors]


# --- config ------------------------------------------------------------------------------


def test_a_valid_principals_section_loads() -> None:
    parsed = parse_config(
        config_text(
            [
                {"ref": "alice", "models": ["chat-*"], "max_concurrent": 2, "weight": 3},
                {"ref": "*", "models": ["chat-small"], "tokens_per_day": 100_000},
            ]
        )
    )
    alice, rest = parsed.config.principals
    assert alice == PrincipalLimits(ref="alice", models=["chat-*"], max_concurrent=2, weight=3)
    assert rest.tokens_per_day == 100_000
    assert parsed.warnings == []


def test_every_principals_problem_is_named_by_its_path() -> None:
    assert errors_of(
        [
            {"ref": "alice", "models": [], "max_concurrent": 0, "weight": 0},
            {"ref": "alicia", "requests_per_minute": -1, "tokens_per_minute": -5},
            {"ref": "bob"},
            {"ref": "bob", "tokens_per_day": -1},
        ]
    ) == [
        "principals[0].max_concurrent: must be >= 1",
        "principals[0].models: must have at least 1 items",
        "principals[0].weight: must be >= 0.001",
        "principals[1].requests_per_minute: must be >= 0",
        "principals[1].tokens_per_minute: must be >= 0",
        "principals[3].tokens_per_day: must be >= 0",
        "principals[1].ref: unknown principal 'alicia' (did you mean 'alice'?): a ref is a "
        "principal_ref of openai.principal_tokens, or '*' for every principal not listed",
        "principals[3].ref: duplicate ref 'bob' (first at principals[2])",
    ]


def test_a_limit_no_one_means_is_refused_before_it_reaches_a_refresh() -> None:
    """Past 2^53 a count is no limit anyone means (and the refresh worker's wire would not
    carry it); an infinite or vanishing weight would make every charge 0 or infinite."""
    assert errors_of(
        [
            {"ref": "alice", "requests_per_minute": 2**64, "weight": float("inf")},
            {"ref": "bob", "tokens_per_day": 2**53 + 1, "weight": 5e-324},
        ]
    ) == [
        "principals[0].requests_per_minute: must be <= 9007199254740992",
        "principals[0].weight: must be <= 1000",
        "principals[1].tokens_per_day: must be <= 9007199254740992",
        "principals[1].weight: must be >= 0.001",
    ]


def test_an_open_api_has_one_principal_anonymous() -> None:
    parse_config(config_text([{"ref": "anonymous", "max_concurrent": 1}], tokens=False))
    assert errors_of([{"ref": "alice"}], tokens=False) == [
        "principals[0].ref: unknown principal 'alice': a ref is 'anonymous' (no "
        "openai.principal_tokens are configured), or '*' for every principal not listed"
    ]


def test_a_pattern_that_matches_no_model_is_a_warning() -> None:
    parsed = parse_config(config_text([{"ref": "alice", "models": ["chat-*", "code-*"]}]))
    assert parsed.warnings == [
        "principals[0].models[1]: 'code-*' matches no model in models[] (yet); this "
        "principal cannot use it until one is added"
    ]


def test_check_config_describes_each_principal() -> None:
    limits = PrincipalLimits(
        ref="alice",
        models=["chat-*"],
        max_concurrent=2,
        requests_per_minute=60,
        tokens_per_minute=10_000,
        tokens_per_day=1_000_000,
        weight=2,
    )
    assert describe_limits(limits) == (
        "models chat-*, max_concurrent 2, 60 requests/min, 10000 tokens/min, "
        "1000000 tokens/day (UTC), weight 2"
    )
    assert describe_limits(PrincipalLimits(ref="*")) == "no limits"


# --- refresh -----------------------------------------------------------------------------


def test_a_limits_change_is_live_and_named_by_principal() -> None:
    old = parse_config(config_text([{"ref": "alice", "max_concurrent": 2}])).config
    new = parse_config(
        config_text(
            [{"ref": "bob", "weight": 2}, {"ref": "alice", "max_concurrent": 4, "weight": 2}]
        )
    ).config
    diff = compare_configs(old, new)
    assert [(c.path, c.class_) for c in diff.changes] == [
        ("principals[alice].max_concurrent", "live"),
        ("principals[alice].weight", "live"),
        ("principals[bob]", "live"),
    ]
    assert plan_apply(old, new).errors == ()


def test_limits_for_a_principal_whose_token_waits_for_a_restart_cannot_go_live() -> None:
    old = parse_config(config_text([])).config
    text = config_text([{"ref": "carol", "max_concurrent": 1}])
    data = yaml.safe_load(text)
    data["openai"]["principal_tokens"].append(
        {"token_ref": "c-key", "principal_ref": "carol", "token_hash_sha256": "d" * 64}
    )
    new = parse_config(yaml.safe_dump(data)).config
    diff = compare_configs(old, new)
    assert "openai.principal_tokens[c-key]" in diff.restart_required_paths
    errors = live_subset_errors(live_subset(old, new, diff))
    assert [error.path for error in errors] == ["principals[carol]"]
    plan = plan_apply(old, new, allow_restart_required=True)
    assert [error.path for error in plan.errors] == ["principals[carol]"]
    # asked without the flag, the plan names both reasons, and does not advise the flag
    plan = plan_apply(old, new)
    paths = [error.path for error in plan.errors]
    assert paths == ["openai.principal_tokens[c-key]", "principals[carol]"]
    assert "allow_restart_required" not in plan.errors[0].message


# --- policy ------------------------------------------------------------------------------


def test_the_named_entry_wins_then_star_then_nothing() -> None:
    policies = PrincipalPolicies(
        [
            PrincipalLimits(ref="alice", models=["chat-*"]),
            PrincipalLimits(ref="*", models=["chat-small"]),
        ]
    )
    assert policies.allows("alice", "chat-large")
    assert not policies.allows("alice", "code")
    assert policies.allows("bob", "chat-small")
    assert not policies.allows("bob", "chat-large")
    assert (policies.entry_of("alice"), policies.entry_of("bob")) == ("alice", "*")
    unlimited = PrincipalPolicies([PrincipalLimits(ref="alice", max_concurrent=1)])
    assert unlimited.allows("bob", "anything")
    assert unlimited.entry_of("bob") is None


@pytest.mark.parametrize(
    ("pattern", "model", "allowed"),
    [
        ("qwen3*", "qwen3.6:35b", True),
        ("qwen3*", "Qwen3", False),  # case-sensitive
        ("*/llama-?b", "meta/llama-8b", True),
        ("llama-[78]b", "llama-9b", False),
        ("exact", "exact", True),
        ("exact", "exactly", False),
    ],
)
def test_allow_list_patterns_are_globs(pattern: str, model: str, allowed: bool) -> None:
    assert PrincipalPolicies([PrincipalLimits(ref="*", models=[pattern])]).allows("x", model) is (
        allowed
    )


def test_a_bucket_holds_a_minute_and_refills_at_its_rate() -> None:
    bucket = Bucket.full(60, now=0.0)
    for _ in range(60):
        assert bucket.wait_for(1, 0.0) == 0
        bucket.take(1, 0.0)
    assert bucket.wait_for(1, 0.0) == pytest.approx(1.0)
    assert bucket.level_at(30.0) == pytest.approx(30)
    assert bucket.until_full(30.0) == pytest.approx(30)


def test_a_request_larger_than_the_bucket_passes_once_it_is_full() -> None:
    bucket = Bucket.full(100, now=0.0)
    bucket.take(50, 0.0)
    assert bucket.cost(500) == 100
    assert bucket.wait_for(500, 0.0) == pytest.approx(30.0)
    assert bucket.wait_for(500, 30.0) == 0


def test_a_resized_bucket_keeps_what_was_used() -> None:
    bucket = Bucket.full(100, now=0.0)
    bucket.take(90, 0.0)
    bucket.resize(1000, 0.0)
    assert bucket.level_at(0.0) == pytest.approx(910)  # 90 used, neither forgotten nor new
    bucket.resize(50, 0.0)
    assert bucket.level_at(0.0) == pytest.approx(-40)  # a debt the next requests wait out
    assert bucket.wait_for(1, 0.0) == pytest.approx(41 / (50 / 60))


def test_a_zero_limit_admits_nothing() -> None:
    assert Bucket.full(0, now=0.0).wait_for(1, 0.0) == float("inf")


def test_limits_are_split_between_replicas() -> None:
    assert minute_share(600, 3) == 200
    assert minute_share(600, 0) == 600
    assert concurrency_share(4, 2) == 2
    assert concurrency_share(2, 3) == 1  # each replica may run at least one


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.25, "250ms"),
        (0.0001, "1ms"),
        (6.5, "6.5s"),
        (59.9999, "60s"),
        (90, "1m30s"),
        (7200, "2h0m0s"),
        (float("inf"), "24h0m0s"),
    ],
)
def test_reset_durations_read_like_openais(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


# --- the limiter ---------------------------------------------------------------------------


@dataclass
class Clocks:
    now: float = 0.0
    wall: float = 10 * SECONDS_PER_DAY + 3600.0  # 01:00 UTC

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds


@dataclass
class FakeLedger:
    totals: dict[str, int] = field(default_factory=dict)
    asked: list[float] = field(default_factory=list)

    async def day_totals(self, since: float) -> dict[str, int]:
        self.asked.append(since)
        return dict(self.totals)


def limiter_for(*entries: PrincipalLimits, clocks: Clocks) -> PrincipalLimiter:
    policies = PrincipalPolicies(list(entries))
    return PrincipalLimiter(lambda: policies, clock=lambda: clocks.now, wall=lambda: clocks.wall)


def test_requests_per_minute_refuses_with_the_time_to_retry() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", requests_per_minute=2), clocks=clocks)
    first = limiter.admit("alice", prompt_tokens=10, max_output=10)
    assert first.rate_limits == RateLimits(
        limit_requests=2, remaining_requests=1, reset_requests_s=30.0
    )
    limiter.admit("alice", prompt_tokens=10, max_output=10)
    with pytest.raises(LimitExceeded) as caught:
        limiter.admit("alice", prompt_tokens=10, max_output=10)
    refusal = caught.value
    assert (refusal.limit, refusal.code) == ("requests_per_minute", "rate_limit_requests")
    assert refusal.retry_after_s == pytest.approx(30.0)
    assert refusal.rate_limits.remaining_requests == 0
    assert dict(openai_rate_limit_headers(refusal.rate_limits)) == {
        b"x-ratelimit-limit-requests": b"2",
        b"x-ratelimit-remaining-requests": b"0",
        b"x-ratelimit-reset-requests": b"1m0s",
    }
    assert dict(anthropic_rate_limit_headers(refusal.rate_limits, wall=clocks.wall)) == {
        b"anthropic-ratelimit-requests-limit": b"2",
        b"anthropic-ratelimit-requests-remaining": b"0",
        b"anthropic-ratelimit-requests-reset": b"1970-01-11T01:01:00Z",
    }
    clocks.tick(30)
    limiter.admit("alice", prompt_tokens=10, max_output=10)
    limiter.admit("bob", prompt_tokens=10, max_output=10)  # unlisted: no limits


def test_tokens_per_minute_reserves_an_estimate_and_settles_to_the_usage() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", tokens_per_minute=1000), clocks=clocks)
    ticket = limiter.admit("alice", prompt_tokens=100, max_output=500)
    assert ticket.reserved == 600
    assert ticket.rate_limits.remaining_tokens == 400
    with pytest.raises(LimitExceeded) as caught:
        limiter.admit("alice", prompt_tokens=100, max_output=500)
    assert (caught.value.code, caught.value.type) == ("rate_limit_tokens", "rate_limit_error")
    assert caught.value.retry_after_s == pytest.approx(12.0)  # 200 tokens at 1000/min
    limiter.settle(ticket, 150)  # it used far less than it reserved: the rest comes back
    limiter.settle(ticket, 150)  # once only
    again = limiter.admit("alice", prompt_tokens=100, max_output=500)
    assert again.rate_limits.remaining_tokens == 1000 - 150 - 600


def test_no_limits_no_headers() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", max_concurrent=1), clocks=clocks)
    ticket = limiter.admit("alice", prompt_tokens=1, max_output=1)
    assert openai_rate_limit_headers(ticket.rate_limits) == []


@pytest.mark.parametrize(
    ("protocol", "operation", "body", "bound"),
    [
        (CHAT, "chat", {"max_tokens": 50}, 50),
        (CHAT, "chat", {"max_completion_tokens": 20, "max_tokens": 50}, 20),
        (CHAT, "chat", {}, None),
        (MESSAGES, "messages", {"max_tokens": 300}, 300),
        (RESPONSES, "responses", {"max_output_tokens": 7}, 7),
        (CHAT, "embedding", {"max_tokens": 99}, 0),
        (MESSAGES, "count_tokens", {"max_tokens": 99}, 0),
        (CHAT, "chat", {"max_tokens": True}, None),
    ],
)
def test_the_output_bound_comes_from_the_protocols_own_field(
    protocol: CallerProtocol, operation: str, body: dict[str, object], bound: int | None
) -> None:
    assert output_bound(protocol.output_fields.get(operation), body) == bound


def test_a_request_without_an_output_bound_reserves_the_default() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="*", tokens_per_minute=100_000), clocks=clocks)
    ticket = limiter.admit("anyone", prompt_tokens=10, max_output=None)
    assert ticket.reserved == 10 + DEFAULT_OUTPUT_ESTIMATE


def test_a_run_that_used_more_than_it_reserved_leaves_a_debt() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", tokens_per_minute=600), clocks=clocks)
    ticket = limiter.admit("alice", prompt_tokens=50, max_output=50)
    limiter.settle(ticket, 900)
    with pytest.raises(LimitExceeded) as caught:
        limiter.admit("alice", prompt_tokens=1, max_output=1)
    # 600 - 900 = -300: 302 tokens to wait for at 10 tokens/s.
    assert caught.value.retry_after_s == pytest.approx(30.2)


def test_a_refused_request_costs_nothing() -> None:
    clocks = Clocks()
    limiter = limiter_for(
        PrincipalLimits(ref="alice", requests_per_minute=10, tokens_per_minute=100),
        clocks=clocks,
    )
    limiter.admit("alice", prompt_tokens=90, max_output=10)
    for _ in range(5):
        with pytest.raises(LimitExceeded):
            limiter.admit("alice", prompt_tokens=90, max_output=10)
    standing = limiter.report({}).principals[0]
    assert standing.requests_remaining == 9  # only the admitted one was counted
    assert standing.rejected == {"tokens_per_minute": 5}


def test_a_request_that_failed_upstream_is_given_back() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", requests_per_minute=2), clocks=clocks)
    for _ in range(5):  # a caller retrying a provider's 500: none of the tries counts
        ticket = limiter.admit("alice", prompt_tokens=10, max_output=10)
        limiter.settle(ticket, 0, refund_request=True)
        limiter.settle(ticket, 0, refund_request=True)  # once only: never above full
    served = limiter.admit("alice", prompt_tokens=10, max_output=10)
    limiter.settle(served, 20)
    assert limiter.report({}).principals[0].requests_remaining == 1
    limiter.admit("alice", prompt_tokens=10, max_output=10)
    with pytest.raises(LimitExceeded):
        limiter.admit("alice", prompt_tokens=10, max_output=10)


async def test_the_daily_budget_counts_the_ledger_and_local_runs() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", tokens_per_day=1000), clocks=clocks)
    ledger = FakeLedger({"alice": 700, "bob": 5})
    await limiter.read_ledger(ledger)
    assert ledger.asked == [10 * SECONDS_PER_DAY]
    ticket = limiter.admit("alice", prompt_tokens=100, max_output=100)
    assert ticket.rate_limits.limit_tokens == 1000  # the token headers describe the budget
    assert ticket.rate_limits.remaining_tokens == 100  # 700 used, 200 reserved in flight
    second = limiter.admit("alice", prompt_tokens=100, max_output=100)  # 900 < 1000
    with pytest.raises(LimitExceeded) as caught:  # 700 + 400 in flight
        limiter.admit("alice", prompt_tokens=1, max_output=1)
    limiter.settle(ticket, 250)
    limiter.settle(second, 0)  # refused upstream: it used nothing
    assert limiter.tokens_today("alice") == 950
    limiter.admit("alice", prompt_tokens=30, max_output=30)  # 50 left: admitted
    with pytest.raises(LimitExceeded) as caught:  # 950 + 60 in flight
        limiter.admit("alice", prompt_tokens=10, max_output=10)
    refusal = caught.value
    assert (refusal.code, refusal.type) == ("budget_exceeded", "insufficient_quota")
    assert refusal.retry_after_s == pytest.approx(23 * 3600.0)  # until 00:00 UTC


async def test_a_ledger_read_replaces_what_it_now_holds() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", tokens_per_day=10_000), clocks=clocks)
    ledger = FakeLedger({"alice": 100})
    await limiter.read_ledger(ledger)
    limiter.settle(limiter.admit("alice", prompt_tokens=1, max_output=1), 40)
    assert limiter.tokens_today("alice") == 140
    ledger.totals = {"alice": 100 + 40 + 500}  # our run, and another replica's 500
    await limiter.read_ledger(ledger)
    assert limiter.tokens_today("alice") == 640


async def test_a_new_utc_day_renews_the_budget() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", tokens_per_day=100), clocks=clocks)
    await limiter.read_ledger(FakeLedger({"alice": 100}))
    with pytest.raises(LimitExceeded):
        limiter.admit("alice", prompt_tokens=1, max_output=1)
    clocks.tick(23 * 3600.0)
    limiter.admit("alice", prompt_tokens=1, max_output=1)


def test_per_minute_limits_are_split_between_replicas() -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", requests_per_minute=60), clocks=clocks)
    limiter.replicas = 3
    ticket = limiter.admit("alice", prompt_tokens=1, max_output=1)
    assert ticket.rate_limits.limit_requests == 20
    assert ticket.rate_limits.remaining_requests == 19


def test_a_refreshed_limit_keeps_the_count_so_far() -> None:
    clocks = Clocks()
    entries = [PrincipalLimits(ref="alice", requests_per_minute=10)]
    policies = {"now": PrincipalPolicies(entries)}
    limiter = PrincipalLimiter(
        lambda: policies["now"], clock=lambda: clocks.now, wall=lambda: clocks.wall
    )
    for _ in range(8):
        limiter.admit("alice", prompt_tokens=1, max_output=1)
    policies["now"] = PrincipalPolicies([PrincipalLimits(ref="alice", requests_per_minute=20)])
    ticket = limiter.admit("alice", prompt_tokens=1, max_output=1)
    assert (ticket.rate_limits.limit_requests, ticket.rate_limits.remaining_requests) == (20, 11)


def test_the_report_shows_each_principal_against_its_limits() -> None:
    clocks = Clocks()
    limiter = limiter_for(
        PrincipalLimits(ref="alice", max_concurrent=4, requests_per_minute=60),
        PrincipalLimits(ref="*", models=["chat-*"], tokens_per_day=500),
        clocks=clocks,
    )
    limiter.admit("bob", prompt_tokens=50, max_output=50)
    report = limiter.report({})
    alice, bob = report.principals
    assert (alice.principal_ref, alice.limited_by, alice.max_concurrent) == ("alice", "alice", 4)
    assert alice.requests_remaining == 60
    assert (bob.limited_by, bob.models, bob.budget_remaining) == ("*", ["chat-*"], 400)


def test_iop_edge_usage_shows_each_principal_against_its_limits() -> None:
    clocks = Clocks()
    limiter = limiter_for(
        PrincipalLimits(ref="alice", max_concurrent=2, requests_per_minute=60),
        PrincipalLimits(ref="*", models=["chat-*"], tokens_per_day=500),
        clocks=clocks,
    )
    limiter.settle(limiter.admit("bob", prompt_tokens=50, max_output=50), 120)
    report: dict[str, Any] = {"since": None, "until": None, "group_by": [], "rows": []}
    report["principals"] = msgspec.to_builtins(limiter.report({}))
    console = Console(width=200, record=True)
    render_usage(console, report)
    text = console.export_text()
    assert "Principals against their limits" in text
    assert "60 left of 60" in text
    assert "120 of 500" in text
    assert "chat-*" in text


async def test_the_limiter_reads_the_ledger_before_it_starts_and_again_when_shared(
    autojump_clock: MockClock,
) -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", tokens_per_day=1000), clocks=clocks)
    ledger = FakeLedger({"alice": 300})
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(limiter.run, ledger, shared=lambda: True))
        assert limiter.tokens_today("alice") == 300  # before anything is served
        ledger.totals = {"alice": 900}  # another replica's runs
        await trio.sleep(BUDGET_SYNC_S)
        await wait_all_tasks_blocked()
        assert limiter.tokens_today("alice") == 900
        nursery.cancel_scope.cancel()
    assert len(ledger.asked) == 2


async def test_an_unreadable_ledger_is_retried_not_fatal(autojump_clock: MockClock) -> None:
    clocks = Clocks()
    limiter = limiter_for(PrincipalLimits(ref="alice", tokens_per_day=1000), clocks=clocks)

    class Flaky(FakeLedger):
        async def day_totals(self, since: float) -> dict[str, int]:
            self.asked.append(since)
            if len(self.asked) == 1:
                raise OSError("the ledger is unreachable")
            return dict(self.totals)

    ledger = Flaky({"alice": 400})
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(limiter.run, ledger, shared=lambda: False))
        assert limiter.tokens_today("alice") == 0
        await trio.sleep(BUDGET_SYNC_S)
        await wait_all_tasks_blocked()
        assert limiter.tokens_today("alice") == 400
        nursery.cancel_scope.cancel()
