"""A runtime kept busy by a client IOP does not see: its health probe times out on a
connection the runtime accepted. That is not proof of death: the provider stays routable
(`busy`, "probe timed out; upstream accepted the connection") and passive signals decide,
while a runtime that refuses connections is still down within one interval.

Real sockets: the monitor probes a real adapter against the fake upstream, which (as
llama.cpp's servers do) answers no model listing while it generates for someone else."""

from __future__ import annotations

import socket

import httpx2
import trio

from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.health import HealthMonitor
from schemas.config import AdapterSettings, ProviderConfig
from schemas.wire import ProviderStatus
from tests.adapters.fake_upstream import FakeUpstream
from tests.timing import GUARD_S

#: Probes answer at once when the runtime is idle; these bound the ones that do not.
PROBE_TIMEOUT_S = 0.2
INTERVAL_S = 0.3
ACCEPTED = "probe timed out; upstream accepted the connection"


class Statuses:
    """The monitor's reports; `wait_for(health)` returns the first status with it."""

    def __init__(self) -> None:
        self.latest: ProviderStatus | None = None
        self._changed = trio.Event()

    async def __call__(self, statuses: list[ProviderStatus], probed: list[str]) -> None:
        [self.latest] = statuses
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, health: str) -> ProviderStatus:
        with trio.fail_after(GUARD_S):
            while self.latest is None or self.latest.health != health:
                await self._changed.wait()
        return self.latest


def _adapter(base_url: str) -> OpenAICompatAdapter:
    settings = AdapterSettings(base_url=base_url, health_interval_s=INTERVAL_S)
    return OpenAICompatAdapter(
        ProviderConfig(id="llama", type="vllm", models=["fake-model"], capacity=1, adapter=settings)
    )


async def _someone_else_generates(fake: FakeUpstream, release: trio.Event) -> None:
    """Another client of the runtime: a stream it keeps open until `release`."""
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with (
        httpx2.AsyncClient(timeout=None) as client,
        client.stream("POST", fake.base_url + "/chat/completions", json=body) as response,
    ):
        async for _ in response.aiter_bytes():
            pass


async def test_a_probe_the_runtime_accepted_but_did_not_answer_means_busy(
    nursery: trio.Nursery,
) -> None:
    release = trio.Event()

    async def hold(_index: int) -> None:
        await release.wait()

    fake = FakeUpstream(models_blocked_while_generating=True, pace=hold)
    await nursery.start(fake.serve)
    adapter = _adapter(fake.base_url)
    statuses = Statuses()
    monitor = HealthMonitor({"llama": adapter}, statuses, probe_timeout_s=PROBE_TIMEOUT_S)
    try:
        await nursery.start(monitor.run)
        assert (await statuses.wait_for("available")).models == ["fake-model"]

        nursery.start_soon(_someone_else_generates, fake, release)
        busy = await statuses.wait_for("busy")
        assert busy.detail is not None and ACCEPTED in busy.detail, busy.detail
        assert busy.models == ["fake-model"]  # still routable: its models are kept

        release.set()  # the other client is done: the next probe answers
        await statuses.wait_for("available")
    finally:
        release.set()
        await adapter.aclose()


async def test_a_runtime_that_refuses_connections_is_down_within_an_interval(
    nursery: trio.Nursery,
) -> None:
    with socket.socket() as holder:  # a port that is bound but refuses connections
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        adapter = _adapter(f"http://127.0.0.1:{port}/v1")
        statuses = Statuses()
        monitor = HealthMonitor({"llama": adapter}, statuses, probe_timeout_s=PROBE_TIMEOUT_S)
        try:
            await nursery.start(monitor.run)
            down = await statuses.wait_for("unavailable")
            assert down.detail is not None and ACCEPTED not in down.detail
        finally:
            await adapter.aclose()
