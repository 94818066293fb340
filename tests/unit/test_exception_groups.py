"""`sole_exception`: what a log line or an exit message names for a failure Trio wrapped."""

from __future__ import annotations

from iop_edge.core.exception_groups import sole_exception


def test_nested_single_exception_groups_give_the_exception_itself() -> None:
    error = OSError("refused")
    wrapped = BaseExceptionGroup("outer", [ExceptionGroup("inner", [error])])
    assert sole_exception(wrapped) is error


def test_a_group_of_several_is_kept_whole() -> None:
    group = ExceptionGroup("two", [ValueError("a"), KeyError("b")])
    assert sole_exception(BaseExceptionGroup("outer", [group])) is group


def test_a_plain_exception_is_itself() -> None:
    error = KeyboardInterrupt()
    assert sole_exception(error) is error
