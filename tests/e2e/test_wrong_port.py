"""A Node pointed at the wrong port of an Edge (the caller port is one digit away from the
node listener in most configs): the Edge answers the websocket upgrade with a 4xx whose
body says where Nodes connect, logs one line, and the Node's log says what to fix."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from iop_edge.http.server import WRONG_PORT_CODE
from iop_node.main import run_node
from iop_node.uplink.backoff import BackoffPolicy
from tests.e2e.stack import NODE_TOKEN, WAIT_GUARD_S, Stack


class RecordWaiter(logging.Handler):
    """Sets `seen` once a record that `matches` is logged (emitted on Trio's thread)."""

    def __init__(self, matches: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__(logging.DEBUG)
        self.matches = matches
        self.seen = trio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.matches(record):
            self.records.append(record)
            self.seen.set()


async def _refused_upgrade(http_url: str, path: str = "/") -> ConnectionRejected:
    with pytest.raises(ConnectionRejected) as refused:
        async with open_websocket_url(http_url.replace("http://", "ws://") + path):
            pass
    return refused.value


@pytest.mark.parametrize("port", ["openai", "admin"])
async def test_a_websocket_upgrade_is_told_where_nodes_connect(
    stack_one: Stack, caplog: pytest.LogCaptureFixture, port: str
) -> None:
    caplog.set_level(logging.INFO)
    url = stack_one.addresses.openai_url if port == "openai" else stack_one.addresses.admin_url
    what = "caller port (OpenAI API)" if port == "openai" else "admin port"
    for _ in range(2):  # and again: nothing is left broken by the first
        refused = await _refused_upgrade(url)
        assert refused.status_code == 400
        assert refused.body is not None
        error = json.loads(refused.body)["error"]
        assert error["code"] == WRONG_PORT_CODE
        assert what in error["message"]
        assert f"edge.listen, {stack_one.addresses.node_url}" in error["message"]
    lines = [r for r in caplog.records if "websocket" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.WARNING for r in lines), lines
    assert all(r.name == "iop_edge.http.server" for r in lines)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    async with stack_one.http() as http:  # the port still serves its own requests
        assert (await http.get("/healthz")).status_code == 200


async def test_the_responses_websocket_mode_is_the_callers_not_the_node_listeners(
    stack_one: Stack,
) -> None:
    """An upgrade on `/v1/responses` of the caller port is the Responses API's WebSocket
    mode (`tests/e2e/test_responses_socket.py`), served (this stack's API is open); the
    admin port's `/v1/responses` is still the wrong-port answer."""
    for path in ("/v1/responses", "/responses"):
        url = stack_one.addresses.openai_url.replace("http://", "ws://") + path
        async with open_websocket_url(url) as socket:
            await socket.send_message(
                json.dumps({"type": "response.create", "model": "m", "input": "x"})
            )
            with trio.fail_after(WAIT_GUARD_S):
                assert json.loads(await socket.get_message())["type"] == "response.created"
    refused = await _refused_upgrade(stack_one.addresses.admin_url, "/v1/responses")
    assert json.loads(refused.body or b"{}")["error"]["code"] == WRONG_PORT_CODE


async def test_a_node_pointed_at_the_caller_port_says_what_to_fix(
    stack_one: Stack, nursery: trio.Nursery
) -> None:
    caller_port = stack_one.addresses.openai_url.replace("http://", "ws://")
    waiter = RecordWaiter(
        lambda r: r.name == "iop_node.uplink.link" and "reconnecting" in r.getMessage()
    )
    logger = logging.getLogger("iop_node.uplink.link")
    logger.addHandler(waiter)
    scope = trio.CancelScope()

    async def wrong_node() -> None:
        with scope:
            await run_node(
                caller_port, "node-2", NODE_TOKEN, backoff=BackoffPolicy(base_s=0.01, cap_s=0.05)
            )

    try:
        nursery.start_soon(wrong_node)
        with trio.fail_after(WAIT_GUARD_S):
            await waiter.seen.wait()
    finally:
        scope.cancel()
        logger.removeHandler(waiter)
    said = waiter.records[0].getMessage()
    assert "caller port (OpenAI API)" in said
    assert stack_one.addresses.node_url in said
    assert (
        "--edge should point at the Edge's node listener, edge.listen, e.g. ws://HOST:7700" in said
    )
