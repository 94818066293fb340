"""The Edge's pins and preloads (`runtime.models.keeper`): which commands reach the Nodes,
and when, against a fake pool; trio's autojump clock stands in for time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio
import trio.testing

from iop_edge.core.routing.affinity import placement_key, rendezvous_order
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.models.commands import ModelCommands
from iop_edge.runtime.models.keeper import MOVE_AFTER_S, RETRY_S, ModelKeeper
from iop_edge.runtime.nodes.session import SessionClosed
from schemas import wire
from schemas.catalog import (
    CatalogProvider,
    ModelCommandAction,
    ModelCommandRequest,
    ModelCommandResult,
)
from schemas.config import (
    EdgeConfig,
    ModelEntry,
    ModelLifecycle,
    NodeEntry,
    ProviderConfig,
)
from tests.unit.test_placement import _provider

PROVIDERS = ("p1", "p2", "p3")


def _snapshot(lifecycle: ModelLifecycle) -> Snapshot:
    providers = [
        ProviderConfig(id=p, type="openai_api", models=["m-served"], capacity=1) for p in PROVIDERS
    ]
    config = EdgeConfig(
        models=[
            ModelEntry(id="m", providers=dict.fromkeys(PROVIDERS, "m-served"), lifecycle=lifecycle)
        ],
        nodes=[NodeEntry(id="n1", token_hash_sha256="0" * 64, providers=providers)],
    )
    return Snapshot.build(config, revision=1, config_sha256="0" * 64)


class Session:
    """One connection of the Node `n1`: its commands go to the pool's runtimes."""

    def __init__(self, pool: Pool, features: frozenset[str]) -> None:
        self.pool = pool
        self.features = features

    async def request_model_command(self, command: wire.ModelCommand) -> wire.ModelCommandDone:
        return await self.pool.request_model_command(command)


class Pool:
    """The providers' runtimes and their Node, as the keeper sees them."""

    def __init__(self, features: frozenset[str] = frozenset({wire.FEATURE_PINS})) -> None:
        self.held: dict[str, bool] = dict.fromkeys(PROVIDERS, False)
        self.down: set[str] = set()
        """Providers whose last probe failed."""
        self.commands: list[tuple[str, str]] = []
        self.refuse: str | None = None
        self.features = features
        self.session: Session | None = Session(self, features)
        self.ends_session = False
        """The session ends before the Node answers the next command."""
        self.pins: dict[str, frozenset[str]] = {}
        self.audited: list[tuple[str, str, str]] = []
        self.changed: Callable[[], None] = lambda: None
        """A Node's report: the keeper looks again (`ModelKeeper.look`)."""

    def providers(self, ids: object) -> list[CatalogProvider]:
        return [
            _provider(
                p,
                {"m-served": "loaded" if self.held[p] else "unloaded"},
                max_loaded=None,
                health="unavailable" if p in self.down else "available",
            )
            for p in PROVIDERS
        ]

    def session_of(self, node_id: str) -> Session | None:
        return self.session if node_id == "n1" else None

    def connect(self) -> None:
        """The Node dials again: a new session, and the keeper looks."""
        self.session = Session(self, self.features)
        self.changed()

    async def request_model_command(self, command: wire.ModelCommand) -> wire.ModelCommandDone:
        self.commands.append((command.action, command.provider_id))
        if self.ends_session:
            self.ends_session = False
            self.session = None
            raise SessionClosed("n1")
        if self.refuse is not None:
            return wire.ModelCommandDone(command_id=command.command_id, ok=False, error=self.refuse)
        if command.action in ("load", "pin"):
            self.held[command.provider_id] = True
            self.changed()
        return wire.ModelCommandDone(command_id=command.command_id, ok=True)

    def pin_models(self, pins: dict[str, frozenset[str]]) -> None:
        self.pins = dict(pins)


class Commands(ModelCommands):
    """The real commands, audited in memory: the audit file's thread would let the
    autojump clock run while a command is only half done."""

    audited: list[tuple[str, str, str]]

    async def _audit(
        self, source: str, action: ModelCommandAction, model: str, results: list[ModelCommandResult]
    ) -> None:
        self.audited += [(action, result.provider, source) for result in results]


def _keeper(pool: Pool, snapshot: Callable[[], Snapshot], tmp_path: Path) -> ModelKeeper:
    commands = Commands(
        snapshot=snapshot, providers=pool.providers, session_of=pool.session_of, state_dir=tmp_path
    )
    commands.audited = pool.audited
    keeper = ModelKeeper(
        snapshot=snapshot,
        providers=pool.providers,
        session_of=pool.session_of,
        commands=commands,
        pin_models=pool.pin_models,
    )
    pool.changed = keeper.look
    return keeper


async def test_a_pin_is_loaded_told_once_reloaded_when_dropped_and_retried_after_a_failure(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    pool = Pool()
    snapshot = _snapshot(ModelLifecycle(keep_loaded=True))
    await nursery.start(_keeper(pool, lambda: snapshot, tmp_path).run)
    await trio.testing.wait_all_tasks_blocked()
    [home] = rendezvous_order(placement_key("m"), PROVIDERS)[:1]
    assert pool.commands == [("pin", home)]
    assert pool.pins == {home: frozenset({"m-served"})}

    pool.changed()  # any change of the pool: nothing more is owed
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands == [("pin", home)]

    pool.held[home] = False  # the runtime dropped it, and cannot load it now
    pool.refuse = "out of memory"
    pool.changed()
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands[1:] == [("pin", home)]
    pool.refuse = None
    pool.changed()
    await trio.sleep(RETRY_S - 1)
    assert len(pool.commands) == 2  # not asked again before its time
    await trio.sleep(2)
    assert pool.commands[2:] == [("pin", home)]
    assert pool.held[home]
    assert pool.audited == [("pin", home, "lifecycle")] * 3


async def test_a_pin_lost_with_the_nodes_session_is_told_to_its_next_session_at_once(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A command that failed because its Node went away says nothing of the runtime: the
    Node's next session is asked at once, not `RETRY_S` later. While the Node is away, no
    look asks again."""
    pool = Pool()
    pool.ends_session = True
    snapshot = _snapshot(ModelLifecycle(keep_loaded=True))
    await nursery.start(_keeper(pool, lambda: snapshot, tmp_path).run)
    await trio.testing.wait_all_tasks_blocked()
    [home] = rendezvous_order(placement_key("m"), PROVIDERS)[:1]
    assert pool.commands == [("pin", home)]
    assert pool.audited == [("pin", home, "lifecycle")]  # the failure is audited
    assert not pool.held[home]

    pool.changed()  # a look while the Node is away: no command can reach it
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands == [("pin", home)]

    start = trio.current_time()
    pool.connect()
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands == [("pin", home)] * 2
    assert pool.held[home]
    assert trio.current_time() == start  # at once


async def test_a_pin_stays_through_a_short_outage_of_its_provider_and_moves_after_a_long_one(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A probe that fails once does not move a `keep_loaded` copy (moving it loads the
    model elsewhere and unloads it here): it stays pinned, with nothing sent, for
    `MOVE_AFTER_S`; a provider down longer loses the pin to the next choice."""
    pool = Pool()
    snapshot = _snapshot(ModelLifecycle(keep_loaded=True))
    await nursery.start(_keeper(pool, lambda: snapshot, tmp_path).run)
    await trio.testing.wait_all_tasks_blocked()
    home, second, _ = rendezvous_order(placement_key("m"), PROVIDERS)
    assert pool.commands == [("pin", home)]

    pool.down.add(home)  # one failed probe
    pool.changed()
    await trio.sleep(MOVE_AFTER_S - 1)
    assert pool.commands == [("pin", home)]
    assert pool.pins == {home: frozenset({"m-served"})}  # placement still spares it
    pool.down.discard(home)  # the next probe answers
    pool.changed()
    await trio.sleep(MOVE_AFTER_S)
    assert pool.commands == [("pin", home)]

    pool.down.add(home)  # down for good
    pool.changed()
    await trio.sleep(MOVE_AFTER_S - 1)
    assert pool.commands == [("pin", home)]
    await trio.sleep(2)
    assert sorted(pool.commands[1:]) == [("pin", second), ("unpin", home)]
    assert pool.pins == {second: frozenset({"m-served"})}


async def test_a_preload_asks_each_provider_once_and_a_refresh_that_drops_a_pin_unpins(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    pool = Pool()
    snapshot = _snapshot(ModelLifecycle(preload=2))
    await nursery.start(_keeper(pool, lambda: snapshot, tmp_path).run)
    await trio.testing.wait_all_tasks_blocked()
    first_two = rendezvous_order(placement_key("m"), PROVIDERS)[:2]
    assert sorted(pool.commands) == sorted(("load", p) for p in first_two)
    assert pool.pins == {}  # a preload pins nothing

    for provider in first_two:  # they go again: a preload is not redone
        pool.held[provider] = False
    pool.changed()
    await trio.testing.wait_all_tasks_blocked()
    assert len(pool.commands) == 2

    snapshot = _snapshot(ModelLifecycle(keep_loaded=True))  # a refresh: now a pin
    pool.changed()
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands[2:] == [("pin", first_two[0])]
    snapshot = _snapshot(ModelLifecycle())  # and no more
    pool.changed()
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands[3:] == [("unpin", first_two[0])]
    assert pool.pins == {}


async def test_a_failed_preload_tries_another_provider_then_the_first_after_its_wait(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    pool = Pool()
    pool.refuse = "out of memory"  # every runtime, for now
    snapshot = _snapshot(ModelLifecycle(preload=1))
    await nursery.start(_keeper(pool, lambda: snapshot, tmp_path).run)
    await trio.testing.wait_all_tasks_blocked()
    order = rendezvous_order(placement_key("m"), PROVIDERS)
    assert pool.commands == [("load", p) for p in order]  # each one, once, then a wait
    pool.refuse = None
    await trio.sleep(RETRY_S - 1)
    assert len(pool.commands) == 3  # none asked again before its time
    await trio.sleep(2)
    assert pool.commands[3:] == [("load", order[0])]  # the first choice again
    assert pool.held[order[0]]
    pool.changed()
    await trio.testing.wait_all_tasks_blocked()
    assert len(pool.commands) == 4  # the preload is made: nothing more


async def test_an_older_node_gets_a_load_for_a_pin_and_no_unpin(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    pool = Pool(features=frozenset())
    snapshot = _snapshot(ModelLifecycle(keep_loaded=True))
    keeper = _keeper(pool, lambda: snapshot, tmp_path)
    await nursery.start(keeper.run)
    await trio.testing.wait_all_tasks_blocked()
    [home] = rendezvous_order(placement_key("m"), PROVIDERS)[:1]
    assert pool.commands == [("load", home)]
    snapshot = _snapshot(ModelLifecycle())
    pool.changed()
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands == [("load", home)]
    assert pool.pins == {}


async def test_an_operator_pin_whose_load_fails_is_not_kept(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    pool = Pool()
    snapshot = _snapshot(ModelLifecycle())
    keeper = _keeper(pool, lambda: snapshot, tmp_path)
    await nursery.start(keeper.run)
    pool.refuse = "no such file"
    report = await keeper.command(
        "pin", ModelCommandRequest(model="m", provider="p3"), source="admin API"
    )
    assert report.outcome == "failed"
    assert report.results[0].error == "no such file"
    await trio.testing.wait_all_tasks_blocked()
    # told the Node, which may hold the pin: it is taken back
    assert pool.commands == [("pin", "p3"), ("unpin", "p3")]
    assert pool.pins == {}
    unpinned = await keeper.command("unpin", ModelCommandRequest(model="m"), source="admin API")
    assert unpinned.outcome == "no_provider"
    assert (
        unpinned.error
        == "'m' has no pin set by the operator (a keep_loaded pin lasts while the config says so)"
    )
    pool.refuse = None
    pinned = await keeper.command("pin", ModelCommandRequest(model="m"), source="admin API")
    [home] = rendezvous_order(placement_key("m"), PROVIDERS)[:1]
    assert pinned.outcome == "done" and pinned.results[0].provider == home
    await trio.testing.wait_all_tasks_blocked()
    assert pool.pins == {home: frozenset({"m-served"})}
    assert pool.audited[-1] == ("pin", home, "admin API")


async def test_a_report_on_a_provider_of_no_kept_model_does_not_wake_the_keeper(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A fleet's statuses about providers serving only models without a lifecycle to keep
    change nothing the keeper does: only a report on a kept model's provider is looked at."""
    providers = [
        ProviderConfig(id=p, type="openai_api", models=["m-served"], capacity=1) for p in PROVIDERS
    ]
    other = ProviderConfig(id="q", type="openai_api", models=["o-served"], capacity=1)
    config = EdgeConfig(
        models=[
            ModelEntry(
                id="m",
                providers=dict.fromkeys(PROVIDERS, "m-served"),
                lifecycle=ModelLifecycle(keep_loaded=True),
            ),
            ModelEntry(id="o", providers={"q": "o-served"}),
        ],
        nodes=[NodeEntry(id="n1", token_hash_sha256="0" * 64, providers=[*providers, other])],
    )
    snapshot = Snapshot.build(config, revision=1, config_sha256="0" * 64)
    pool = Pool()
    keeper = _keeper(pool, lambda: snapshot, tmp_path)
    await nursery.start(keeper.run)
    await trio.testing.wait_all_tasks_blocked()
    [home] = rendezvous_order(placement_key("m"), PROVIDERS)[:1]
    assert pool.commands == [("pin", home)]

    pool.held[home] = False  # the runtime dropped the pinned copy
    keeper.reported(["q"])  # a report on the other model's provider only: no look
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands == [("pin", home)]
    keeper.reported(["q", home])  # one on the kept model's: looked at, the copy reloaded
    await trio.testing.wait_all_tasks_blocked()
    assert pool.commands == [("pin", home), ("pin", home)]
