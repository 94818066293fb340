"""A hung test fails on its own, saying where every task waits, and the suite goes on.

pytest-timeout (`timeout` in pyproject.toml, or `@pytest.mark.timeout(S)`) is the
backstop for every test: after `S` seconds it prints every thread's stack and ends the
run. Its stacks say little about a Trio test, though: a hung Trio test is one whose tasks
all wait, and the only thread's stack is Trio's scheduler waiting for I/O. (Its `signal`
method, which fails just the one test, raises inside that scheduler and leaves the next
test to find a broken Trio run.)

So each Trio test also runs under a guard of half that time, measured on the wall clock
(a test's autojump clock can race through hours): the guard cancels the test and fails it
with the await stack of every Trio task (`trio.lowlevel.Task.iter_await_frames`): which
task waits for what, where. Only a test that blocks the event loop itself (a busy loop,
blocking I/O) is left to the backstop. Hypothesis tests keep their own per-example
deadline and only the backstop.

A test process's heap is settled as an Edge's is once built (`runtime.lifecycle.heap`
Rule 1): what collection imported (the SDKs' models, Hypothesis) is collected once and
frozen, and the collector runs at the Edge's and Node's thresholds. The Edges and Nodes
the tests run in this process meet the collector as they meet it in their own, and the
fleets of objects the scale tests build are not walked again every few thousand
allocations. A test that needs the collector
otherwise sets it and restores it (tests/unit/conftest.py).

And a skipped Trio test says why: pytest-trio (0.8) turns a skip raised inside a Trio test
or fixture into a bare `pytest.skip()`, so `-rs` printed only "Skipped" where the test had
said what to install. `pytest_pyfunc_call` raises the test's own skip again.
"""

from __future__ import annotations

import functools
import os
import threading
import traceback
from collections.abc import Awaitable, Callable, Generator, Iterator
from inspect import iscoroutinefunction
from typing import Any

import pytest
import trio

from iop_edge.runtime.lifecycle import heap

#: Where Trio's own source files are: their frames say nothing about a test.
_TRIO_SOURCES = os.path.dirname(trio.__file__) + os.sep


def pytest_collection_finish(session: pytest.Session) -> None:
    heap.settle()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function) or item.get_closest_marker("trio") is None:
            continue
        if hasattr(item.obj, "hypothesis") or not iscoroutinefunction(item.obj):
            continue
        item.obj = _guarded(item.obj, _guard_s(item, config))


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """A skip that pytest-trio re-raised without its reason gets it back: the one skip in
    the exception group pytest-trio was handling (the bare skip's context)."""
    try:
        return (yield)
    except pytest.skip.Exception as bare:
        own = _sole_skip(bare.__context__)
        if own is None:
            raise
        raise own from None


def _sole_skip(raised: BaseException | None) -> BaseException | None:
    """The skip of a group whose only leaf is a skip, else None."""
    leaves: list[BaseException] = []
    pending = [raised] if raised is not None else []
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if len(leaves) == 1 and isinstance(leaves[0], pytest.skip.Exception):
        return leaves[0]
    return None


def _guard_s(item: pytest.Item, config: pytest.Config) -> float:
    """Half the test's pytest-timeout (its marker's, else the configured one)."""
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker is not None and marker.args else config.getini("timeout")
    return float(timeout) / 2


def _guarded(test: Callable[..., Awaitable[None]], guard_s: float) -> Callable[..., Any]:
    """`test`, cancelled and failed with every task's await stack after `guard_s` seconds
    of wall-clock time."""

    @functools.wraps(test)
    async def guarded(**kwargs: Any) -> None:
        token = trio.lowlevel.current_trio_token()
        stacks: list[str] = []
        with trio.CancelScope() as scope:

            def hung() -> None:  # in the Trio thread, between two scheduling passes
                stacks.append(_await_stacks())
                scope.cancel()

            def fire() -> None:  # in the timer's thread
                try:
                    token.run_sync_soon(hung)
                except trio.RunFinishedError:
                    pass

            timer = threading.Timer(guard_s, fire)
            timer.daemon = True
            timer.start()
            try:
                await test(**kwargs)
            finally:
                timer.cancel()
        if stacks:
            pytest.fail(
                f"the test hung: not done after {guard_s:g}s; where each task waits:\n" + stacks[0],
                pytrace=False,
            )

    return guarded


def _await_stacks() -> str:
    """Every task of the current Trio run with its await stack (Trio's own frames left
    out), as a tree."""
    lines: list[str] = []
    for depth, task in _tasks(trio.lowlevel.current_root_task(), 0):
        indent = "  " * depth
        lines.append(f"{indent}task {task.name}")
        frames = [
            (frame, line)
            for frame, line in task.iter_await_frames()
            if not frame.f_code.co_filename.startswith(_TRIO_SOURCES)
        ]
        for entry in traceback.StackSummary.extract(frames).format():
            lines.extend(indent + "  " + text for text in entry.rstrip("\n").split("\n"))
    return "\n".join(lines)


def _tasks(task: trio.lowlevel.Task | None, depth: int) -> Iterator[tuple[int, trio.lowlevel.Task]]:
    if task is None:
        return
    yield depth, task
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            yield from _tasks(child, depth + 1)
