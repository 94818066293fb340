"""The admin surface (design §5.1, §6, §10): catalog, metrics, status, and who may call it."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from iop_edge.core.configuration.config import ConfigInvalid, parse_config
from iop_edge.edge import Edge
from tests.e2e.stack import NODE_TOKEN_HASH, Stack, edge_config, sim_provider, start_stack

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
SLOW = {"ttft_ms": 5, "tokens_per_second": 100}

MODEL_FIELDS = {"id", "display_name", "providers", "queued"}
PROVIDER_FIELDS = {
    "id",
    "node_id",
    "type",
    "category",
    "enabled",
    "connected",
    "health",
    "capacity",
    "in_flight",
    "load_ratio",
    "long_context_slots",
    "long_in_flight",
    "models",
    "queued",
    "priority",
    "lifecycle",
}
LIFECYCLE_FLAGS = {"list_models", "load_model", "unload_model", "pull_model", "delete_model"}


def _config(tmp_path: Path) -> str:
    """`m` on a busy-able sim (node-1); `offline` on a node that never connects."""
    return edge_config(
        tmp_path,
        providers=[
            sim_provider(
                "sim-a",
                capacity=1,
                long_context_slots=1,
                priority=7,
                lifecycle=["list_models", "load_model"],
                adapter=SLOW,
            ),
        ],
        models=[
            {"id": "m", "display_name": "Model M", "providers": {"sim-a": "sim-small"}},
            {"id": "offline", "providers": {"sim-z": "sim-small"}},
        ],
        extra_nodes=[
            {
                "id": "node-2",
                "token_hash_sha256": NODE_TOKEN_HASH,
                "providers": [sim_provider("sim-z", capacity=3, category="api", enabled=False)],
            }
        ],
    )


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    return await start_stack(nursery, _config(tmp_path), tmp_path / "edge.yaml", wait_models=("m",))


def _by_id(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["id"]: item for item in items}


async def _get(stack: Stack, path: str, **kwargs: Any) -> httpx2.Response:
    async with stack.admin() as admin:
        return await admin.get(path, **kwargs)


# --- GET /catalog ----------------------------------------------------------------------------


async def test_catalog_has_every_field_with_live_values(stack: Stack) -> None:
    async with stack.client() as client, trio.open_nursery() as group:
        # Far longer than the test: it holds the only slot until the caller hangs up.
        holder = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=30_000, stream=True
        )
        group.start_soon(
            lambda: client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
        )
        await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)

        response = await _get(stack, "/catalog")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/json")
        catalog = response.json()
        assert set(catalog) == {"revision", "models", "providers", "next"}
        assert (catalog["revision"], catalog["next"]) == (1, None)  # not paged
        models = _by_id(catalog["models"])
        providers = _by_id(catalog["providers"])
        assert [m["id"] for m in catalog["models"]] == ["m", "offline"]
        assert [p["id"] for p in catalog["providers"]] == ["sim-a", "sim-z"]
        for model in catalog["models"]:
            assert set(model) >= MODEL_FIELDS
        for provider in catalog["providers"]:
            assert set(provider) >= PROVIDER_FIELDS
            assert set(provider["lifecycle"]) == LIFECYCLE_FLAGS

        assert models["m"] == {
            "id": "m",
            "display_name": "Model M",
            "providers": {"sim-a": "sim-small"},
            "queued": 1,
        }
        assert models["offline"]["display_name"] is None
        busy = providers["sim-a"]
        assert {key: busy[key] for key in PROVIDER_FIELDS - {"lifecycle"}} == {
            "id": "sim-a",
            "node_id": "node-1",
            "type": "sim",
            "category": "local_inference",  # the default for `sim`
            "enabled": True,
            "connected": True,
            "health": "available",
            "capacity": 1,
            "in_flight": 1,
            "load_ratio": 1.0,
            "long_context_slots": 1,
            "long_in_flight": 0,
            "models": ["sim-small"],
            "queued": 1,
            "priority": 7,
        }
        assert busy["lifecycle"] == {
            "list_models": True,
            "load_model": True,
            "unload_model": False,
            "pull_model": False,
            "delete_model": False,
        }
        offline = providers["sim-z"]
        assert (offline["node_id"], offline["category"], offline["enabled"]) == (
            "node-2",
            "api",
            False,
        )
        assert (offline["connected"], offline["health"]) == (False, "unavailable")
        assert (offline["in_flight"], offline["load_ratio"], offline["long_context_slots"]) == (
            0,
            0.0,
            None,
        )
        await holder.close()  # the slot goes to the queued request, which then finishes
    idle = await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 0)
    assert idle["providers"][0]["load_ratio"] == 0.0


# --- GET /metrics ----------------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_are_prometheus_text_with_every_family(stack: Stack) -> None:
    async with stack.client() as client:
        for _ in range(2):
            response = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=3
            )
            assert response.usage is not None
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=3, stream=True
        )
        async for _chunk in stream:
            pass
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(model="offline", messages=MESSAGES)
        assert refused.value.status_code == 503
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 0)

    scrape = await _get(stack, "/metrics")

    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    samples = _samples(scrape.text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    served = {"model": "m", "provider": "sim-a"}
    assert value("iop_requests_total", status="200", code="", **served) == 3
    assert (
        value("iop_requests_total", model="offline", provider="", status="503", code="no_provider")
        == 1
    )
    # Refused before naming a known model: counted by status and code, no model label.
    assert (
        value("iop_requests_total", model="", provider="", status="404", code="model_not_found")
        == 1
    )
    assert value("iop_request_latency_seconds_count", **served) == 3
    assert value("iop_request_latency_seconds_bucket", le="+Inf", **served) == 3
    assert value("iop_time_to_first_token_seconds_count", **served) == 3
    assert value("iop_queue_wait_seconds_count", model="m") == 3
    assert value("iop_provider_capacity", provider="sim-a", node="node-1") == 1
    assert value("iop_provider_capacity", provider="sim-z", node="node-2") == 3
    assert value("iop_provider_in_flight", provider="sim-a", node="node-1") == 0
    assert value("iop_provider_queued", provider="sim-a", node="node-1") == 0
    assert value("iop_provider_available", provider="sim-a", node="node-1") == 1
    assert value("iop_provider_available", provider="sim-z", node="node-2") == 0
    tokens = {"principal_ref": "anonymous", "token_ref": "anonymous", **served}
    assert value("iop_tokens_total", kind="completion", **tokens) == 9
    assert value("iop_tokens_total", kind="prompt", **tokens) > 0
    # The sim reports its usage: none of it is an estimate (the family is there, empty).
    assert "# TYPE iop_estimated_tokens_total counter" in scrape.text
    assert not any(name == "iop_estimated_tokens_total" for name, _ in samples)
    assert "# TYPE iop_busy_answers_total counter" in scrape.text


# --- GET /status, /healthz -------------------------------------------------------------------


async def test_status_names_revision_config_and_nodes(stack: Stack, tmp_path: Path) -> None:
    response = await _get(stack, "/status")

    assert response.status_code == 200
    status = response.json()
    config_text = (tmp_path / "edge.yaml").read_bytes()
    assert status.pop("pid") == os.getpid()  # the Edge runs in this test's process
    [replica] = status.pop("replicas")  # this Edge alone writes to its ledger
    assert replica["current"] and replica["same_config"] and replica["state"] == "serving"
    assert replica["pid"] == os.getpid() and replica["revision"] == 1
    assert status == {
        "revision": 1,
        "config_sha256": hashlib.sha256(config_text).hexdigest(),
        "config_file": str((tmp_path / "edge.yaml").resolve()),
        "pending_restart": [],
        "nodes": [
            {"id": "node-1", "connected": True, "applied_revision": 1},
            {"id": "node-2", "connected": False, "applied_revision": None},
        ],
    }
    health = await _get(stack, "/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok", "revision": 1})


# --- who may call it (design §5.1) ------------------------------------------------------------


#: Requests no browser page may make to the documents the pool page reads.
FOREIGN = (
    {"Origin": "http://127.0.0.1:8080"},
    {"Origin": "null"},
    {"Sec-Fetch-Mode": "cors"},
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"},
    {"Sec-Fetch-Site": "same-site"},
    {"Host": "evil.example"},
    {"Host": "127.0.0.1.evil.example:7701"},
    {"Host": "localhost.evil.example"},
)


def _same_origin(stack: Stack) -> tuple[dict[str, str], ...]:
    """What the pool page's own fetches carry (an Origin only on some requests)."""
    host = stack.addresses.admin_url.removeprefix("http://")
    return (
        {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"},
        {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"},
        {"Origin": f"http://{host}"},
    )


async def test_browser_like_requests_are_refused(stack: Stack) -> None:
    async with stack.admin() as admin:
        for headers in FOREIGN:
            for path in ("/healthz", "/status", "/catalog", "/activity", "/metrics", "/usage"):
                response = await admin.get(path, headers=headers)
                assert response.status_code == 403, (headers, path, response.text)
                assert response.json()["error"]["message"]
        for headers in FOREIGN + _same_origin(stack):
            # Every mutation, and every document the page does not need, even from the page.
            response = await admin.post(
                "/refresh", json={"mode": "apply", "config_yaml": "models: []"}, headers=headers
            )
            assert response.status_code == 403, headers
            for path in ("/metrics", "/usage"):
                response = await admin.get(path, headers=headers)
                assert response.status_code == 403, (headers, path)
    assert stack.edge.snapshot.revision == 1  # a refused refresh does nothing at all
    # The same requests without those headers are served.
    port = stack.addresses.admin_url.rsplit(":", 1)[1]
    async with stack.admin() as admin:
        for host in ("127.0.0.1", "localhost"):
            response = await admin.get("/healthz", headers={"Host": f"{host}:{port}"})
            assert response.status_code == 200, host


async def test_the_pool_page_reads_what_it_needs_from_its_own_origin(stack: Stack) -> None:
    async with stack.admin() as admin:
        for headers in _same_origin(stack):
            for path in ("/", "/pool.js", "/pool.css", "/catalog", "/status", "/activity"):
                response = await admin.get(path, headers=headers)
                assert response.status_code == 200, (headers, path, response.text)
        # The page itself may be opened from a bookmark or a link, never framed.
        for site in ("none", "cross-site"):
            headers = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "navigate"}
            page = await admin.get("/", headers={**headers, "Sec-Fetch-Dest": "document"})
            assert page.status_code == 200, site
            assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
            assert page.headers["x-frame-options"] == "DENY"
            framed = await admin.get("/", headers={**headers, "Sec-Fetch-Dest": "iframe"})
            assert framed.status_code == 403, site
            data = await admin.get("/catalog", headers=headers)
            assert data.status_code == 403, site


async def test_pool_page_is_served_from_the_package(stack: Stack) -> None:
    async with stack.admin() as admin:
        page = await admin.get("/")
        script = await admin.get("/pool.js")
        style = await admin.get("/pool.css")
    assert page.headers["content-type"].startswith("text/html")
    assert '<script src="/pool.js"' in page.text and "<title>IOP pool</title>" in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # nothing from elsewhere
    assert script.headers["content-type"].startswith("text/javascript")
    assert 'fetch(path, { cache: "no-store"' in script.text
    assert style.headers["content-type"].startswith("text/css")


async def test_activity_counts_recent_requests(stack: Stack) -> None:
    async with stack.client() as client:
        await client.chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    async with stack.http() as http:
        refused = await http.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        )
    assert refused.status_code == 404
    response = await _get(stack, "/activity")
    activity = response.json()
    assert activity["bucket_s"] == 10 and len(activity["buckets"]) == 30
    assert sum(b["requests"] for b in activity["buckets"]) == 2
    assert sum(b["ok"] for b in activity["buckets"]) == 1
    assert activity["rejected_last_minute"] == 1 and activity["errors_last_minute"] == 0
    assert activity["requests_per_s"] > 0


async def test_mutations_are_post_only(stack: Stack) -> None:
    async with stack.admin() as admin:
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            response = await admin.request(method, "/refresh")
            assert response.status_code == 405, method
        for path in ("/catalog", "/status", "/metrics"):
            response = await admin.post(path, json={})
            assert response.status_code == 405, path
    assert stack.edge.snapshot.revision == 1


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_candidate_over_the_body_limit_is_told_the_limit_and_the_way_round(
    stack: Stack, chunked: bool
) -> None:
    """However the body is framed: a chunked one has no length to refuse it by, and is
    counted as it arrives."""
    candidate = "# " + "x" * (17 << 20)
    body = json.dumps({"mode": "apply", "config_yaml": candidate}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    async with stack.admin() as admin:
        response = await admin.post(
            "/refresh",
            content=pieces() if chunked else body,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 413
    message = response.json()["error"]["message"]
    assert "16 MiB" in message and "iop-edge refresh --apply" in message
    assert stack.edge.snapshot.revision == 1


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.10:7701", "admin.example:7701"])
async def test_non_loopback_admin_listener_refuses_to_start(tmp_path: Path, listen: str) -> None:
    text = _config(tmp_path).replace(
        "admin:\n  listen: 127.0.0.1:0", f"admin:\n  listen: '{listen}'"
    )
    with pytest.raises(ConfigInvalid) as invalid:
        parse_config(text)
    [error] = invalid.value.errors
    assert error.path == "admin.listen"
    assert "not a loopback address" in error.message


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:0", "[::1]:0"])
async def test_loopback_admin_listeners_are_accepted(tmp_path: Path, listen: str) -> None:
    text = _config(tmp_path).replace(
        "admin:\n  listen: 127.0.0.1:0", f"admin:\n  listen: '{listen}'"
    )
    assert Edge(parse_config(text)).snapshot.config.admin.listen == listen


# --- GET /readyz (design §12) ------------------------------------------------------------------


async def test_readyz_follows_whether_any_model_can_be_served(stack: Stack) -> None:
    """200 while some model has a provider that can take runs; 503 once none has, on both
    listeners. `/healthz` stays liveness: 200 throughout."""
    ready = await _get(stack, "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ready",
        "revision": 1,
        "servable_models": ["m"],  # `offline`'s only provider is disabled, its node away
        "models": 2,
    }
    async with stack.http() as http:
        public = await http.get("/readyz")
    assert (public.status_code, public.json()) == (200, {"status": "ready"})

    stack.kill_node("node-1")
    await stack.wait_catalog(lambda c: not _by_id(c["providers"])["sim-a"]["connected"])

    not_ready = await _get(stack, "/readyz")
    assert not_ready.status_code == 503
    body = not_ready.json()
    assert body["status"] == "not_ready" and body["servable_models"] == []
    assert "no model has a provider that can take runs now" in body["reason"]
    async with stack.http() as http:
        public = await http.get("/readyz")
        alive = await http.get("/healthz")
    assert public.status_code == 503 and public.json()["status"] == "not_ready"
    assert alive.status_code == 200
    assert (await _get(stack, "/healthz")).status_code == 200
