"""`core.node_input` Rule 1 on a run's usage: a sound report is acted on as it came (the
very object: nothing is built for it), an unsound one is corrected with a note, and the
two agree: a report is left alone exactly when correcting it would change nothing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from iop_edge.core.node_input import MAX_REPORTED_TOKENS, check_node_message
from schemas import wire

_COUNTS = st.one_of(
    st.integers(min_value=-5, max_value=5),
    st.integers(min_value=0, max_value=10_000),
    st.integers(min_value=MAX_REPORTED_TOKENS - 3, max_value=2 * MAX_REPORTED_TOKENS + 3),
)


def _checked(usage: wire.Usage) -> tuple[wire.Usage | None, list[str]]:
    message = wire.RunEvents(ends=[wire.RunDone(run_id="r1", usage=usage)])
    checked, notes = check_node_message(message)
    assert isinstance(checked, wire.RunEvents)
    return checked.ends[0].usage, notes


def _corrected(usage: wire.Usage) -> wire.Usage:
    """Rule 1, written out."""
    prompt = min(max(usage.prompt_tokens, 0), MAX_REPORTED_TOKENS)
    completion = min(max(usage.completion_tokens, 0), MAX_REPORTED_TOKENS)
    total = min(
        max(min(max(usage.total_tokens, 0), MAX_REPORTED_TOKENS), prompt + completion),
        2 * MAX_REPORTED_TOKENS,
    )
    cached = min(max(usage.cached_tokens, 0), prompt)
    return wire.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=total, cached_tokens=cached
    )


def test_a_sound_report_is_the_very_object_that_came() -> None:
    usage = wire.Usage(prompt_tokens=30, completion_tokens=12, total_tokens=42, cached_tokens=16)
    checked, notes = _checked(usage)
    assert checked is usage and notes == []


@given(_COUNTS, _COUNTS, _COUNTS, _COUNTS)
def test_a_report_is_corrected_exactly_when_rule_1_changes_it(
    prompt: int, completion: int, total: int, cached: int
) -> None:
    usage = wire.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=total, cached_tokens=cached
    )
    expected = _corrected(usage)
    checked, notes = _checked(usage)
    assert checked == expected
    assert bool(notes) == (expected != usage)


def test_a_corrected_status_still_answers_the_probes_it_answered() -> None:
    """A status cut to its bounds keeps `probed`: the callers waiting on a probe on
    demand hear their answer rather than waiting out their bound."""
    provider = wire.ProviderStatus(id="p1", health="available", detail="x" * 100_000)
    checked, notes = check_node_message(wire.Status(providers=[provider], probed=["p1"]))
    assert isinstance(checked, wire.Status) and notes
    assert checked.probed == ["p1"] and len(checked.providers[0].detail or "") < 100_000


def test_a_retry_after_that_is_no_number_of_seconds_is_dropped() -> None:
    """Rule 2: NaN, an infinity or a negative `retry_after_s` would reach a caller's
    `Retry-After` header; it is dropped with a note, and a sound one stays."""
    for bad in (float("nan"), float("inf"), float("-inf"), -1.0):
        failed = wire.RunFailed(
            run_id="r1\nFORGED",
            code=wire.FailureCode.UPSTREAM_BUSY,
            message="busy",
            retry_after_s=bad,
        )
        checked, notes = check_node_message(wire.RunEvents(ends=[failed]))
        assert isinstance(checked, wire.RunEvents)
        end = checked.ends[0]
        assert isinstance(end, wire.RunFailed) and end.retry_after_s is None
        assert len(notes) == 1 and "\n" not in notes[0]  # the run id quoted, not a new line
    sound = wire.RunEvents(
        ends=[
            wire.RunFailed(
                run_id="r1", code=wire.FailureCode.UPSTREAM_BUSY, message="busy", retry_after_s=2.5
            )
        ]
    )
    assert check_node_message(sound) == (sound, [])
