"""Exception groups as the Edge reports them.

Trio's nurseries wrap whatever escapes them in an `ExceptionGroup`, one per nursery, so
one failure deep in a task tree arrives wrapped once per level. A log line or a command's
exit message should name the failure itself, not its wrapping."""

from __future__ import annotations

__all__ = ["sole_exception"]


def sole_exception(error: BaseException) -> BaseException:
    """The one exception inside nested single-exception groups, else `error` itself."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
