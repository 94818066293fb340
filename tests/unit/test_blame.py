"""`iop_edge.core.routing.blame`: what a failure says about its provider, and what the request
does next, rule by rule (the dispatcher's end-to-end behaviour is pinned in
tests/e2e/test_upstream_failures.py and test_runtime_realism.py)."""

from __future__ import annotations

from typing import Any

import pytest

from iop_edge.core.routing.blame import (
    MAX_REMEMBERED_REQUESTS,
    Attempts,
    Next,
    ReplyFaults,
    Verdict,
    verdict,
)
from schemas.wire import FailureCode, RunFailed


def _failed(code: FailureCode, **fields: Any) -> RunFailed:
    return RunFailed(run_id="r", code=code, message="m", **fields)


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (_failed(FailureCode.UPSTREAM_BUSY, capacity=True, status=429), Verdict.CAPACITY),
        (_failed(FailureCode.UPSTREAM_ERROR, capacity=True, status=503), Verdict.CAPACITY),
        (_failed(FailureCode.UPSTREAM_TIMEOUT), Verdict.HEALTH),
        (_failed(FailureCode.UPSTREAM_UNREACHABLE), Verdict.HEALTH),
        (_failed(FailureCode.UPSTREAM_ERROR), Verdict.HEALTH),  # a broken connection
        (_failed(FailureCode.UPSTREAM_MISCONFIGURED, status=401), Verdict.HEALTH),
        (_failed(FailureCode.BAD_CHUNK), Verdict.HEALTH),
        (_failed(FailureCode.UPSTREAM_ERROR, status=500), Verdict.PENDING),
        (_failed(FailureCode.UPSTREAM_ERROR, reply_fault=True), Verdict.SUSPECT),  # empty 200
        (_failed(FailureCode.UPSTREAM_STREAM_ERROR, reply_fault=True), Verdict.SUSPECT),
        (_failed(FailureCode.UPSTREAM_BUSY, capacity=True, reply_fault=True), Verdict.CAPACITY),
        (_failed(FailureCode.UPSTREAM_REJECTED, status=400), Verdict.NONE),
        (_failed(FailureCode.NODE_LOST), Verdict.NONE),
        # A Node whose config is behind a refresh: nobody's fault.
        (_failed(FailureCode.UNKNOWN_PROVIDER, retryable=True), Verdict.NONE),
        (_failed(FailureCode.MODEL_NOT_FOUND, retryable=True, status=404), Verdict.NONE),
        (_failed(FailureCode.CALLER_TOO_SLOW), Verdict.NONE),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_each_failure_says_what_it_says_about_its_provider(
    failure: RunFailed, expected: Verdict
) -> None:
    assert verdict(failure) == expected


def test_busy_answers_requeue_up_to_the_bound_then_count_as_a_failure() -> None:
    attempts = Attempts(retries=1, max_busy=2)
    busy = _failed(FailureCode.BUSY, retryable=True, capacity=True)
    assert [attempts.after(busy, "p") for _ in range(2)] == [Next.REQUEUE, Next.REQUEUE]
    assert attempts.tried == frozenset()  # a full provider is asked again
    assert attempts.after(busy, "p") == Next.FAILOVER
    assert attempts.tried == {"p"}


def test_a_retryable_failure_fails_over_while_retries_are_left() -> None:
    attempts = Attempts(retries=2, max_busy=0)
    refused = _failed(FailureCode.UPSTREAM_UNREACHABLE, retryable=True)
    assert attempts.after(refused, "a") == Next.FAILOVER
    assert attempts.after(refused, "b") == Next.FAILOVER
    assert attempts.after(refused, "c") == Next.GIVE_UP
    assert attempts.tried == {"a", "b", "c"}
    assert not attempts.request_fault and attempts.blamed() == []


def test_a_node_behind_a_refresh_sends_the_run_to_another_provider() -> None:
    attempts = Attempts(retries=1, max_busy=0)
    stale = _failed(FailureCode.MODEL_NOT_FOUND, retryable=True, status=404)
    assert attempts.after(stale, "a") == Next.FAILOVER
    assert attempts.tried == {"a"} and attempts.blamed() == []


def test_a_failure_that_is_not_retryable_ends_the_request() -> None:
    attempts = Attempts(retries=3, max_busy=0)
    rejected = _failed(FailureCode.UPSTREAM_REJECTED, status=400)
    assert attempts.after(rejected, "a") == Next.GIVE_UP
    assert not attempts.request_fault


def test_the_same_5xx_from_two_providers_is_the_requests_fault_and_blames_nobody() -> None:
    attempts = Attempts(retries=3, max_busy=0)
    answer = _failed(FailureCode.UPSTREAM_ERROR, status=500, retryable=True)
    assert attempts.after(answer, "a") == Next.FAILOVER
    assert attempts.after(answer, "b") == Next.GIVE_UP
    assert attempts.request_fault


def test_a_5xx_is_its_providers_fault_once_another_provider_succeeds() -> None:
    attempts = Attempts(retries=3, max_busy=0)
    attempts.after(_failed(FailureCode.UPSTREAM_ERROR, status=500, retryable=True), "a")
    attempts.after(_failed(FailureCode.UPSTREAM_ERROR, status=502, retryable=True), "b")
    assert not attempts.request_fault  # two different answers say nothing of the request
    assert attempts.blamed() == ["a", "b"]


# --- Rule 4: empty or malformed replies ---------------------------------------------------


def test_one_request_retried_never_counts_against_its_provider() -> None:
    faults = ReplyFaults()
    assert [faults.failed("p", 7) for _ in range(10)] == [0] * 10


def test_other_requests_failing_too_count_the_first_as_well() -> None:
    faults = ReplyFaults()
    assert faults.failed("p", 1) == 0
    assert faults.failed("p", 1) == 0
    assert faults.failed("p", 2) == 2  # corroborated: both count now
    assert faults.failed("p", 2) == 0
    assert faults.failed("p", 3) == 1
    assert faults.failed("q", 1) == 0  # per provider


def test_a_success_forgets_the_failed_requests() -> None:
    faults = ReplyFaults()
    faults.failed("p", 1)
    faults.succeeded("p")
    assert faults.failed("p", 2) == 0  # alone again


def test_remembered_requests_are_bounded_and_past_the_bound_each_counts() -> None:
    faults = ReplyFaults()
    counted = sum(faults.failed("p", key) for key in range(MAX_REMEMBERED_REQUESTS))
    assert counted == MAX_REMEMBERED_REQUESTS
    assert faults.failed("p", -1) == 1 and faults.failed("p", -1) == 1
