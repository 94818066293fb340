"""Web pages and an open caller API (`iop_edge.http.browser_guard`), through a real Edge
and Node over real sockets: another origin's page is refused on every kind of request
(a run, a read, a WebSocket upgrade), a rebound domain is refused on a loopback
listener, and with principal tokens a page is judged by its token alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.e2e.stack import Stack, edge_config, principals_section, sim_provider, start_stack

TOKEN = "sk-browser-guard-not-a-secret"
CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}


async def _stack(nursery: trio.Nursery, tmp_path: Path, **openai: Any) -> Stack:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1")],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        openai_section=openai or None,
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


def _host(stack: Stack) -> str:
    return stack.addresses.openai_url.split("://", 1)[1]


async def _upgrade_status(stack: Stack, headers: dict[str, str]) -> int:
    """The Responses WebSocket upgrade's answer: 101 when accepted, else its status."""
    url = stack.addresses.openai_url.replace("http://", "ws://") + "/v1/responses"
    extra = [(name.encode(), value.encode()) for name, value in headers.items()]
    try:
        async with open_websocket_url(url, extra_headers=extra):
            return 101
    except ConnectionRejected as rejected:
        assert rejected.body is not None
        assert json.loads(rejected.body)["error"]["code"] == "cross_origin"
        return rejected.status_code


async def test_an_open_api_refuses_a_page_of_another_origin(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    evil = {"Origin": "http://evil.example"}
    own = {"Origin": f"http://{_host(stack)}"}
    async with stack.http() as http:
        run = await http.post("/v1/chat/completions", json=CHAT, headers=evil)
        listing = await http.get("/v1/models", headers=evil)
        sandboxed = await http.post("/v1/chat/completions", json=CHAT, headers={"Origin": "null"})
        same_origin = await http.post("/v1/chat/completions", json=CHAT, headers=own)
        no_origin = await http.get("/v1/models")  # a program, not a page
    assert run.status_code == 403
    assert run.json()["error"] == {
        "message": "Origin 'http://evil.example' is refused: this caller API is open (no "
        "openai.principal_tokens), and it serves no page of another origin",
        "type": "permission_error",
        "param": None,
        "code": "cross_origin",
    }
    assert run.headers["x-request-id"]
    assert (listing.status_code, listing.json()["error"]["code"]) == (403, "cross_origin")
    assert sandboxed.status_code == 403
    assert (same_origin.status_code, no_origin.status_code) == (200, 200)
    # Browsers apply no same-origin rule to WebSockets: the upgrade itself is refused.
    assert await _upgrade_status(stack, evil) == 403
    assert await _upgrade_status(stack, own) == 101
    assert await _upgrade_status(stack, {}) == 101


async def test_an_open_loopback_api_answers_only_loopback_names(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A page whose domain was rebound to 127.0.0.1 is same-origin with itself; its Host
    gives it away."""
    stack = await _stack(nursery, tmp_path)
    port = _host(stack).rsplit(":", 1)[1]
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    async with stack.http() as http:
        refused = await http.post("/v1/chat/completions", json=CHAT, headers=rebound)
        by_name = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"Host": f"localhost:{port}"}
        )
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "untrusted_host")
    assert "Host 'evil.example:" in refused.json()["error"]["message"]
    assert by_name.status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None)],
)
async def test_with_tokens_a_page_is_judged_by_its_token(
    nursery: trio.Nursery, tmp_path: Path, method: str, path: str, body: dict[str, Any] | None
) -> None:
    stack = await _stack(nursery, tmp_path, **principals_section({"alice": TOKEN}))
    port = _host(stack).rsplit(":", 1)[1]
    page = {"Origin": "http://app.example", "Host": f"gateway.example:{port}"}
    async with stack.http() as http:
        with_token = await http.request(
            method, path, json=body, headers={**page, "Authorization": f"Bearer {TOKEN}"}
        )
        without = await http.request(method, path, json=body, headers=page)
    assert (with_token.status_code, without.status_code) == (200, 401)


async def test_a_wildcard_listener_judges_no_host(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Listening on every address, the API is reached by names the Edge cannot know, over
    loopback too (a proxy on this machine that keeps the caller's Host): the listener's
    configured address decides, not the one a connection came in on."""
    stack = await _stack(nursery, tmp_path, listen="0.0.0.0:0")
    port = _host(stack).rsplit(":", 1)[1]
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        proxied = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"Host": f"gpu-box:{port}"}
        )
        page = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example"}
        )
    assert proxied.status_code == 200
    assert (page.status_code, page.json()["error"]["code"]) == (403, "cross_origin")
