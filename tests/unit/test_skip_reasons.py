"""A skipped test says why (`just test -rs` prints it): the reason a Trio test or fixture
gives survives pytest-trio, which re-raises such a skip without it (`tests/conftest.py`).
"""

from __future__ import annotations

import pytest

from tests.conftest import pytest_pyfunc_call

REASON = "no haproxy binary (Debian: apt-get install haproxy)"


def _bare_skip_from_pytest_trio(leaves: list[BaseException]) -> BaseException:
    """What pytest-trio 0.8 raises when a Trio test's run ends with `leaves`."""
    try:
        try:
            raise BaseExceptionGroup("the test's nursery", leaves)
        except BaseExceptionGroup:
            pytest.skip()
    except pytest.skip.Exception as bare:
        return bare
    raise AssertionError("unreachable")


def _through_the_hook(raised: BaseException) -> BaseException:
    hook = pytest_pyfunc_call(None)  # type: ignore[arg-type]  # the item is not looked at
    next(hook)
    try:
        hook.throw(raised)
    except BaseException as out:  # what the hook lets through is the result
        return out
    raise AssertionError("the hook swallowed the exception")


def test_a_skip_inside_a_trio_test_keeps_its_reason() -> None:
    bare = _bare_skip_from_pytest_trio([pytest.skip.Exception(REASON)])
    assert str(bare) == ""  # what pytest-trio leaves: -rs prints "Skipped"
    out = _through_the_hook(bare)
    assert isinstance(out, pytest.skip.Exception) and str(out) == REASON


def test_other_outcomes_pass_through_unchanged() -> None:
    mixed = _bare_skip_from_pytest_trio([pytest.skip.Exception(REASON), ValueError("x")])
    assert _through_the_hook(mixed) is mixed  # not a lone skip: nothing to restore
    failure = AssertionError("a failing test")
    assert _through_the_hook(failure) is failure
