"""Every Edge a Node serves: URLs and the addresses of a DNS name (`iop_node.uplink.edges`)."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from iop_node.main import run_node
from schemas.wire import Hello, Reject, RunDone, Status
from tests.node.test_link import FAST, TOKEN, FakeEdge, _chat_run


class Resolver:
    """A DNS name whose addresses the test changes; a lookup may fail."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.fail = False
        self.looked_up = trio.Event()

    async def __call__(self, host: str, port: int) -> list[str]:
        assert host == "edges.test"
        self.looked_up.set()
        self.looked_up = trio.Event()
        if self.fail:
            raise OSError("temporary failure in name resolution")
        return list(self.addresses)


async def test_the_node_links_to_every_address_of_a_name(nursery: trio.Nursery) -> None:
    first = FakeEdge("127.0.0.1")
    await first.start(nursery)
    second = FakeEdge("127.0.0.2", first.port)  # the same port on another loopback address
    await second.start(nursery)
    resolver = Resolver("127.0.0.1")
    url = f"ws://edges.test:{first.port}/"
    with trio.fail_after(10):
        nursery.start_soon(
            partial(
                run_node,
                [],
                "n1",
                TOKEN,
                edge_dns=[url],
                resolver=resolver,
                dns_interval_s=0.02,
                **FAST,
            )
        )
        a = await first.accept()
        await a.welcome()
        await a.expect(Status)

        resolver.addresses.append("127.0.0.2")  # a replica joins
        b = await second.accept()
        await b.welcome()
        await b.expect(Status)

        resolver.fail = True  # a failed lookup changes nothing
        for _ in range(2):
            await resolver.looked_up.wait()
        resolver.fail = False

        resolver.addresses.remove("127.0.0.1")  # a replica leaves: its link is retired
        closed = await a.wait_closed()
        assert closed.reason is not None and closed.reason.code == 1001
        a.released.set()
        assert not b.ws.closed  # b stays linked


def test_a_dns_url_needs_a_host_name() -> None:
    with pytest.raises(ValueError, match="ws://"):
        trio.run(partial(run_node, [], "n1", TOKEN, edge_dns=["http://edges.test/"]))


async def test_an_edge_that_refuses_the_node_for_good_loses_its_link_alone(
    nursery: trio.Nursery,
) -> None:
    """Losing one Edge loses only its runs (design §13): a replica that refuses this Node
    (its token not rolled out there yet, say) is given up, and the other Edge is served on."""
    serving = FakeEdge("127.0.0.1")
    await serving.start(nursery)
    refusing = FakeEdge("127.0.0.2")
    await refusing.start(nursery)
    with trio.fail_after(10):
        nursery.start_soon(partial(run_node, [serving.url, refusing.url], "n1", TOKEN, **FAST))
        side = await serving.accept()
        await side.welcome()
        await side.expect(Status)
        for _ in range(FAST["backoff"].max_rejections):
            refused = await refusing.accept()
            await refused.expect(Hello)
            await refused.send(Reject(code="bad_token", reason="the node token does not match"))
            await refused.close(code=1008)
        [done] = await side.run_until_terminal(_chat_run("r1", stream=False, max_tokens=2))
        assert isinstance(done, RunDone)
