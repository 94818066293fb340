"""The old Edge's side of a restart (`iop_edge.procedures.restart`) when the handover does
not finish: whatever stops it before the successor is ready, this Edge accepts Nodes again
and the successor is killed. The whole handover, with real processes, is
`tests/e2e/test_restart.py`'s."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from iop_edge.procedures import restart
from iop_edge.procedures.restart import Restarter


class _Successor:
    """A successor that listens, then never says it is ready (or breaks, when told)."""

    broken: BaseException | None = None
    moved: tuple[str, str] | None = None

    def __init__(self, calls: list[str]) -> None:
        self.handoff = None
        self._calls = calls

    async def start(self) -> None:
        self._calls.append("start")

    async def wait_listening(self) -> tuple[str, str] | None:
        return self.moved

    async def expect_nodes(self, nodes: list[str]) -> None:
        pass

    async def wait_ready(self) -> int:
        if self.broken is not None:
            raise self.broken
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    def abort(self) -> None:
        self._calls.append("abort")

    async def close(self) -> None:
        self._calls.append("close")


class _NodeServer:
    def __init__(self, calls: list[str]) -> None:
        self._calls = calls

    def stop_accepting(self) -> None:
        self._calls.append("stop_accepting")

    def resume_accepting(self) -> None:
        self._calls.append("resume_accepting")


def _restarter(
    monkeypatch: pytest.MonkeyPatch,
    calls: list[str],
    broken: Any = None,
    moved: tuple[str, str] | None = None,
) -> Restarter:
    def successor(*args: Any, **kwargs: Any) -> _Successor:
        made = _Successor(calls)
        made.broken = broken
        made.moved = moved
        return made

    monkeypatch.setattr(restart, "Successor", successor)

    async def goaway_all(reason: str) -> None:
        calls.append("goaway")

    return Restarter(["iop-edge", "serve"], goaway_all=goaway_all, connected_nodes=lambda: ["n1"])


async def _restart(restarter: Restarter, calls: list[str]) -> Any:
    return await restarter.restart(
        node_server=_NodeServer(calls),  # type: ignore[arg-type]
        listeners=[],
        revision=2,
        instance="host/1",
        stopping=False,
        stop=lambda *_: calls.append("stop"),
    )


async def test_a_restart_cut_before_the_successor_is_ready_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The admin caller of `POST /restart` leaving cancels the handler: this Edge takes its
    Nodes back (they were sent `goaway`) and the successor does not live on beside it."""
    calls: list[str] = []
    restarter = _restarter(monkeypatch, calls)
    with trio.CancelScope() as caller:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_restart, restarter, calls)
            await trio.testing.wait_all_tasks_blocked()
            caller.cancel()
    assert calls == ["start", "stop_accepting", "goaway", "resume_accepting", "abort", "close"]
    # ... and it may restart again: the cut one is over
    _restarter(monkeypatch, calls, broken=trio.BrokenResourceError("pipe"))
    report = await _restart(restarter, calls)
    assert report.outcome == "failed" and "the handover broke" in (report.detail or "")


async def test_a_handover_that_breaks_is_a_failed_restart_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any error of the handover (the successor's control pipe reset, say) is a failed
    restart, as a timeout is: reported, rolled back, and the Edge serves on (a SIGUSR2
    restart that raised would take the Edge down)."""
    calls: list[str] = []
    restarter = _restarter(monkeypatch, calls, broken=trio.BrokenResourceError("reset"))
    report = await _restart(restarter, calls)
    assert report.outcome == "failed"
    assert calls == ["start", "stop_accepting", "goaway", "resume_accepting", "abort", "close"]


async def test_a_successor_that_moved_the_node_listener_away_from_linked_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sent `goaway`, the Nodes would dial the old address, where nobody listens: the
    restart fails before they are sent away, and this Edge serves on with them."""
    calls: list[str] = []
    moved = ("127.0.0.1:7700", "127.0.0.1:7800")
    restarter = _restarter(monkeypatch, calls, moved=moved)
    report = await _restart(restarter, calls)
    assert report.outcome == "failed"
    assert "listens for Nodes on 127.0.0.1:7800, not on 127.0.0.1:7700" in (report.detail or "")
    assert "node(s) n1 dial" in (report.detail or "")
    assert calls == ["start", "resume_accepting", "abort", "close"]  # no goaway


async def test_no_restart_while_a_config_refresh_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its successor would read the file the refresh is about to write."""
    calls: list[str] = []
    _restarter(monkeypatch, calls)

    async def goaway_all(reason: str) -> None:
        raise AssertionError("no Node is sent away")

    restarter = Restarter(
        ["iop-edge", "serve"], goaway_all=goaway_all, connected_nodes=list, refreshing=lambda: True
    )
    report = await _restart(restarter, calls)
    assert report.outcome == "refused" and "refresh" in (report.detail or "")
    assert calls == []  # no successor started
