"""What a provider speaks natively as the Node knows it (`iop_node.protocol_support`)."""

from __future__ import annotations

import trio
import trio.testing

from iop_node.protocol_support import ProtocolSupport
from schemas.config import AdapterSettings, ProviderConfig, ProviderType
from schemas.protocols import CallerProtocol
from tests.timing import GUARD_S


def provider(
    type_: ProviderType = "vllm", protocols: list[CallerProtocol] | None = None
) -> ProviderConfig:
    return ProviderConfig(
        id="p1",
        type=type_,
        models=["m"],
        capacity=1,
        adapter=AdapterSettings(base_url="http://127.0.0.1:1/v1", protocols=protocols),
    )


def test_the_type_default_is_the_starting_point() -> None:
    support = ProtocolSupport(provider("vllm"))
    assert support.protocols() == ["chat", "messages", "responses"]
    assert support.counts_tokens
    assert not support.explicit


def test_only_what_the_adapter_can_relay_is_native() -> None:
    support = ProtocolSupport(provider("sim", ["chat", "messages"]), relayable=("chat",))
    assert support.protocols() == ["chat"]
    assert not support.speaks("messages")
    assert not support.counts_tokens


def test_a_missing_endpoint_is_learnt_once_and_reported() -> None:
    support = ProtocolSupport(provider("ollama"))
    assert support.learn_unsupported("messages", "404 Not Found")
    assert support.protocols() == ["chat", "responses"]
    assert not support.counts_tokens  # no Messages, no Messages count endpoint
    assert support.version == 1
    assert support.learn_unsupported("messages", "404 again")  # translated, nothing new
    assert support.version == 1


def test_an_explicit_list_is_never_second_guessed() -> None:
    support = ProtocolSupport(provider("vllm", ["chat", "messages"]))
    assert support.explicit
    assert not support.learn_unsupported("messages", "404 Not Found")
    assert support.speaks("messages")
    assert support.version == 0


def test_a_missing_count_endpoint_leaves_the_protocol_alone() -> None:
    support = ProtocolSupport(provider("vllm", ["chat", "messages"]))
    support.learn_no_token_count()
    assert not support.counts_tokens
    assert support.speaks("messages")
    assert support.version == 0  # nothing the Edge needs to hear


async def test_a_watcher_wakes_on_a_change_and_never_misses_one() -> None:
    support = ProtocolSupport(provider("vllm"))
    woken = trio.Event()

    async def watch() -> None:
        await support.wait_changed(0)
        woken.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await trio.testing.wait_all_tasks_blocked()
        assert not woken.is_set()
        support.learn_unsupported("responses", "405 Method Not Allowed")
        await woken.wait()
    # A watcher that looked before the change returns at once.
    with trio.fail_after(GUARD_S):
        await support.wait_changed(0)
