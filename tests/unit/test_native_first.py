"""Native first (design §14): a Messages or Responses run goes to a provider that speaks its
protocol natively, and to one whose Node would translate it only when no native provider
can take it now. The pure rule (`core.routing.pool` Rule 4) and the scheduler's side of it: what
a provider speaks (the Node's report, else its config), queued waiters per protocol, and
the catalog."""

from __future__ import annotations

import trio
from trio.testing import wait_all_tasks_blocked

from iop_edge.core.routing.pool import Grant, ProviderView, decide
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import AdapterSettings, EdgeConfig, ModelEntry, NodeEntry, ProviderConfig
from schemas.protocols import CallerProtocol

HASH = "0" * 64


def _chosen(*views: ProviderView) -> str:
    decision = decide("m", tuple(v.id for v in views), {v.id: v for v in views}, long=False)
    assert isinstance(decision, Grant), decision
    return decision.provider.id


# --- the rule -------------------------------------------------------------------------


def test_a_native_provider_wins_over_an_idler_or_better_ranked_translating_one() -> None:
    translating = ProviderView(id="t", capacity=4, in_flight=0, priority=1, native=False)
    native = ProviderView(id="n", capacity=4, in_flight=3, priority=100, native=True)
    assert _chosen(translating, native) == "n"


def test_a_translating_provider_takes_the_run_when_every_native_one_is_full() -> None:
    translating = ProviderView(id="t", capacity=4, in_flight=3, native=False)
    full = ProviderView(id="n", capacity=2, in_flight=2, native=True)
    assert _chosen(full, translating) == "t"


def test_among_native_providers_load_ratio_then_priority_decide_as_for_chat() -> None:
    busy = ProviderView(id="a", capacity=3, in_flight=2, priority=1)
    light = ProviderView(id="b", capacity=3, in_flight=1, priority=100)
    tied = ProviderView(id="c", capacity=6, in_flight=2, priority=50)
    assert _chosen(busy, light) == "b"
    assert _chosen(light, tied) == "c"  # 1/3 ties 2/6: the lower priority wins
    assert (
        _chosen(
            ProviderView(id="x", capacity=2, in_flight=1, native=False),
            ProviderView(id="y", capacity=2, in_flight=0, native=False),
        )
        == "y"
    )


# --- the scheduler --------------------------------------------------------------------


def _provider(pid: str, kind: str, protocols: list[CallerProtocol] | None = None) -> ProviderConfig:
    return ProviderConfig(
        id=pid,
        type=kind,  # type: ignore[arg-type]
        models=["served"],
        capacity=1,
        adapter=AdapterSettings(base_url="http://127.0.0.1:1/v1", protocols=protocols),
    )


def _online(*providers: ProviderConfig) -> Scheduler:
    config = EdgeConfig(
        models=[ModelEntry(id="m", providers={p.id: "served" for p in providers})],
        nodes=[NodeEntry(id="n1", token_hash_sha256=HASH, providers=list(providers))],
    )
    scheduler = Scheduler(Snapshot.build(config, revision=1, config_sha256=HASH))
    scheduler.node_connected("n1")
    for provider in providers:
        scheduler.provider_status(provider.id, "available", ["served"])
    return scheduler


async def test_the_configured_protocols_route_until_the_node_reports_its_own() -> None:
    # lemonade speaks chat only by default; vllm speaks all three. Config order puts
    # the translating one first, so only the protocol can explain the choice.
    scheduler = _online(_provider("lemon", "lemonade"), _provider("vllm", "vllm"))
    with await scheduler.acquire("m", "r1", long=False, protocol="messages") as lease:
        assert lease.provider_id == "vllm"
    # the Node learned that this "vllm" answers 404 on /v1/messages: it translates now
    scheduler.provider_status("vllm", "available", ["served"], protocols=["chat", "responses"])
    with await scheduler.acquire("m", "r2", long=False, protocol="messages") as lease:
        assert lease.provider_id == "lemon"  # round-robin among equals again
    with await scheduler.acquire("m", "r3", long=False, protocol="responses") as lease:
        assert lease.provider_id == "vllm"
    providers = {p.id: p.protocols for p in scheduler.catalog().providers}
    assert providers == {"lemon": ["chat"], "vllm": ["chat", "responses"]}


async def test_an_operators_list_is_what_the_catalog_shows_before_any_report() -> None:
    scheduler = _online(_provider("a", "openai_api", ["chat", "messages"]))
    [provider] = scheduler.catalog().providers
    assert provider.protocols == ["chat", "messages"]
    scheduler.node_disconnected("n1")
    scheduler.node_connected("n1")
    scheduler.provider_status("a", "available", ["served"], protocols=["chat"])
    [provider] = scheduler.catalog().providers
    assert provider.protocols == ["chat"]
    scheduler.node_disconnected("n1")  # what a gone Node said is forgotten
    [provider] = scheduler.catalog().providers
    assert provider.protocols == ["chat", "messages"]


async def test_chat_runs_ignore_protocols_and_translation_never_waits_for_native() -> None:
    scheduler = _online(_provider("sim", "sim"), _provider("vllm", "vllm"))
    native = await scheduler.acquire("m", "r1", long=False, protocol="responses")
    assert native.provider_id == "vllm"
    # the native provider is full: the translating one takes the next run at once
    translated = await scheduler.acquire("m", "r2", long=False, protocol="responses")
    assert translated.provider_id == "sim"
    got: list[str] = []
    held: list[Lease] = []

    async def wait_for_a_slot(protocol: CallerProtocol) -> None:
        lease = await scheduler.acquire("m", f"w-{protocol}", long=False, protocol=protocol)
        got.append(f"{protocol}:{lease.provider_id}")
        held.append(lease)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_a_slot, "messages")
        await wait_all_tasks_blocked()
        nursery.start_soon(wait_for_a_slot, "chat")
        await wait_all_tasks_blocked()
        translated.release()  # the first waiter (messages) takes what is free: sim
        await wait_all_tasks_blocked()
        assert got == ["messages:sim"]
        native.release()  # then the chat waiter, which any provider serves alike
    assert got == ["messages:sim", "chat:vllm"]
    for lease in held:
        lease.release()
