"""The live pool page in a real browser: headless Chromium (Debian's `chromium` package)
driven by Playwright, against a running Edge with two Nodes under load.

The test waits for live data, checks that the page shows every provider with its load,
health and reason, the model queues and the traffic, and saves a screenshot
(`IOP_POOL_PAGE_SCREENSHOT=docs/pool-page.png` writes the one the README shows). It
skips, saying why, when Chromium or Playwright is missing; `.ci/run` installs both.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

from tests.e2e.stack import NODE_TOKEN_HASH, Stack, edge_config, sim_provider, start_stack

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: Slow enough that the held requests stay in flight for the whole test.
HOLDING = {"ttft_ms": 5, "tokens_per_second": 4}
#: With a screenshot to write: traffic for this long first, a wave every `WAVE_S`.
HISTORY_S = 80.0
WAVE_S = 3.0

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (apt-get install -y chromium); the pool page's "
    "browser test needs it",
)


def _config(tmp_path: Path) -> str:
    return edge_config(
        tmp_path,
        node_id="gpu-a",
        providers=[
            sim_provider("gpu-a-vllm", capacity=4, long_context_slots=1, adapter=HOLDING),
            sim_provider("gpu-a-ollama", capacity=2, priority=50, adapter=HOLDING),
        ],
        extra_nodes=[
            {
                "id": "gpu-b",
                "token_hash_sha256": NODE_TOKEN_HASH,
                "providers": [
                    sim_provider("gpu-b-sglang", capacity=8, adapter=HOLDING),
                    {  # a router runtime holding one of its two models at a time
                        **sim_provider("gpu-b-router", capacity=1, adapter={"max_loaded": 1}),
                        "models": ["smol-a", "smol-b"],
                    },
                ],
            },
            {  # never connects: its provider shows why it is unavailable
                "id": "gpu-c",
                "token_hash_sha256": NODE_TOKEN_HASH,
                "providers": [sim_provider("gpu-c-lemonade", capacity=2)],
            },
        ],
        models=[
            {
                "id": "qwen3.6:35b",
                "display_name": "Qwen 3.6 35B",
                "providers": {"gpu-a-vllm": "sim-small", "gpu-b-sglang": "sim-small"},
            },
            {"id": "llama-3.1-8b", "providers": {"gpu-a-ollama": "sim-small"}},
            {"id": "phi-4", "providers": {"gpu-c-lemonade": "sim-small"}},
            {  # pinned: loaded at start and kept loaded on the router
                "id": "smol",
                "providers": {"gpu-b-router": "smol-a"},
                "lifecycle": {"keep_loaded": True},
            },
            {"id": "smol-b", "providers": {"gpu-b-router": "smol-b"}},
        ],
    )


async def _stream(stack: Stack, model: str) -> None:
    """A short streamed request, read to its end."""
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
        async for _ in stream:
            pass


async def _history(stack: Stack, seconds: float) -> None:
    """Waves of streams of changing size for `seconds`, so the screenshot's charts show
    some history: time to first token rising with the queue, the output rate following
    the load (the sims serve `HOLDING`'s 4 tokens/s per stream)."""
    waves = itertools.cycle([(2, 1), (6, 2), (12, 3), (4, 1), (16, 4), (8, 2), (3, 3)])
    start = trio.current_time()
    for wave in itertools.count():
        if trio.current_time() > start + seconds:
            return
        qwen, llama = next(waves)
        async with trio.open_nursery() as load:
            for _ in range(qwen):
                load.start_soon(_stream, stack, "qwen3.6:35b")
            for _ in range(llama):
                load.start_soon(_stream, stack, "llama-3.1-8b")
        await trio.sleep_until(start + (wave + 1) * WAVE_S)  # the load's shape over time


async def _hold(stack: Stack, model: str) -> None:
    """A streamed request that keeps its slot until the test ends."""
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model=model,
            stream=True,
            max_tokens=30_000,  # under the default max_tokens_limit
            messages=[{"role": "user", "content": "a long answer, please"}],
        )
        async for _ in stream:
            pass


def _browse(admin_url: str, profile: Path, screenshot: Path) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{admin_url}/")
            # Live data: the held runs' load, and the queue behind the full provider.
            page.wait_for_selector(
                'tr[data-provider="gpu-a-ollama"] .bar[data-load="2/2"]', timeout=15_000
            )
            page.wait_for_selector('td[data-queue="1"]', timeout=15_000)
            # Each provider's recent cached share has its cell ("-" before any report).
            page.wait_for_selector(
                'tr[data-provider="gpu-a-ollama"] td[data-cached-share]', timeout=15_000
            )
            page.wait_for_function(
                "document.getElementById('rps').textContent !== '0.00'", timeout=15_000
            )
            # What the router holds, and its pin.
            page.wait_for_selector(
                'tr[data-provider="gpu-b-router"] [data-model-state="smol-a=loaded"]'
                '[data-pinned="yes"]',
                timeout=15_000,
            )
            # The per-model charts: the finished streams' time to first token and output
            # rate, the queue behind the full provider.
            page.wait_for_selector(
                'tr[data-model-chart="qwen3.6:35b"] td[data-ttft-p50]:not([data-ttft-p50=""])',
                timeout=15_000,
            )
            page.wait_for_selector(
                'tr[data-model-chart="llama-3.1-8b"] td[data-queue-now="1"]', timeout=15_000
            )
            result = {
                "providers": page.eval_on_selector_all(
                    "tr[data-provider]",
                    "rows => rows.map(r => [r.dataset.provider, "
                    "r.querySelector('.bar').dataset.load, "
                    "r.querySelector('.health').dataset.health, r.innerText])",
                ),
                "ready": page.inner_text("#ready"),
                "revision": page.inner_text("#revision"),
                "models": page.eval_on_selector_all(
                    "tr[data-model]", "rows => rows.map(r => r.innerText)"
                ),
                "nodes": page.eval_on_selector_all(
                    "tr[data-node]", "rows => rows.map(r => r.innerText)"
                ),
                "charts": page.eval_on_selector_all(
                    "tr[data-model-chart]",
                    "rows => rows.map(r => [r.dataset.modelChart, "
                    "Number(r.querySelector('[data-ttft-p50]').dataset.ttftP50), "
                    "Number(r.querySelector('[data-tokens-per-s]').dataset.tokensPerS), "
                    "Number(r.querySelector('[data-queue-now]').dataset.queueNow), "
                    "r.querySelectorAll('svg path, svg rect').length])",
                ),
                "errors": errors,
            }
            page.screenshot(path=str(screenshot), full_page=True)
            return result
        finally:
            context.close()


@pytest.mark.timeout(2 * HISTORY_S + 60)
async def test_the_pool_page_shows_providers_and_their_load_live(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
    )
    stack = await start_stack(
        nursery,
        _config(tmp_path),
        tmp_path / "edge.yaml",
        nodes=("gpu-a", "gpu-b"),
        wait_models=("qwen3.6:35b", "llama-3.1-8b"),
    )
    # A refresh gives the Node that never linked a model: not applied there yet.
    config = yaml.safe_load(stack.config_path.read_text(encoding="utf-8"))
    config["nodes"][2]["providers"][0]["models"].append("sim-large")
    config["models"].append({"id": "phi-4-large", "providers": {"gpu-c-lemonade": "sim-large"}})
    async with stack.admin() as admin:
        refreshed = await admin.post(
            "/refresh", json={"mode": "apply", "config_yaml": yaml.safe_dump(config)}
        )
    assert refreshed.status_code == 200, refreshed.text
    async with stack.client() as client:  # a little finished traffic for the activity chart
        for _ in range(3):
            await client.chat.completions.create(
                model="qwen3.6:35b", max_tokens=1, messages=[{"role": "user", "content": "x"}]
            )
    screenshot = Path(os.environ.get("IOP_POOL_PAGE_SCREENSHOT", tmp_path / "pool.png"))
    if "IOP_POOL_PAGE_SCREENSHOT" in os.environ:
        await _history(stack, HISTORY_S)  # minutes of traffic for the picture
    async with trio.open_nursery() as streams:  # finished streams for the model charts
        for _ in range(4):
            streams.start_soon(_stream, stack, "qwen3.6:35b")
    async with trio.open_nursery() as load:
        for model in ["qwen3.6:35b"] * 3 + ["llama-3.1-8b"] * 3:  # the last one queues
            load.start_soon(_hold, stack, model)
        await stack.wait_catalog(
            lambda c: (
                sum(p["in_flight"] for p in c["providers"]) == 5
                and any(m["queued"] == 1 for m in c["models"])
            )
        )
        seen = await trio.to_thread.run_sync(
            _browse, stack.addresses.admin_url, tmp_path / "profile", screenshot
        )
        load.cancel_scope.cancel()

    providers = {row[0]: row for row in seen["providers"]}
    assert sorted(providers) == [
        "gpu-a-ollama",
        "gpu-a-vllm",
        "gpu-b-router",
        "gpu-b-sglang",
        "gpu-c-lemonade",
    ]
    assert "smol-a loaded, pinned" in providers["gpu-b-router"][3]
    assert "smol-b" in providers["gpu-b-router"][3]
    assert "smol-b loaded, pinned" not in providers["gpu-b-router"][3]
    assert providers["gpu-a-ollama"][1:3] == ["2/2", "available"]
    in_flight = sum(int(providers[p][1].split("/")[0]) for p in ("gpu-a-vllm", "gpu-b-sglang"))
    assert in_flight == 3
    assert providers["gpu-c-lemonade"][1:3] == ["0/2", "unavailable"]
    assert "node disconnected" in providers["gpu-c-lemonade"][3]
    assert "sim-large not applied yet" in providers["gpu-c-lemonade"][3]
    assert seen["ready"] == "ready" and seen["revision"].startswith("revision 2")
    llama = next(row for row in seen["models"] if row.startswith("llama-3.1-8b"))
    assert "\t1\t" in llama  # its queue depth
    assert any(row.startswith("gpu-c") and "no" in row for row in seen["nodes"])
    charts = {row[0]: row[1:] for row in seen["charts"]}
    ttft_p50, tokens_per_s, _, shapes = charts["qwen3.6:35b"]
    assert 0 < ttft_p50 < 5 and tokens_per_s > 0 and shapes >= 3  # p50, p95, rate
    assert charts["llama-3.1-8b"][2] == 1  # its queue now, as sampled
    assert seen["errors"] == []  # no CSP violation, no script error
    assert (await trio.Path(screenshot).stat()).st_size > 10_000
