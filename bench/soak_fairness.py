"""The soak's fair-queueing phase: slot time follows work, not request counts (design
§15, `core.routing.run_work`).

One Edge, one Node, one `sim` provider with `CAPACITY` slots whose runs take time in
proportion to their tokens (`TOKENS_PER_S`). Two principals at equal weights keep
their requests outstanding (each worker sends its next request as soon as one ends):
`huge` with `HUGE_WORKERS` requests of `HUGE_TOKENS` output tokens, `small` with
`SMALL_WORKERS` of `SMALL_TOKENS`. Every request streams; for each, the caller books its
wait (from sending it to its first token) and the time it held a slot (from its first
token to its end, plus the provider's time to first token). Over `WINDOW_S` after a
`WARM_UP_S` start, the phase holds when the two principals' slot times are within
`MAX_RATIO` of each other, and reports the small requests' median and longest wait.
A scheduler that counted requests gives `huge` most of the slot time (each of its turns
lasts `HUGE_TOKENS / SMALL_TOKENS` times longer) and the small requests wait seconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx2
import trio

from bench.soak_stack import (
    Verdict,
    caller_token,
    principal_tokens,
    sim_provider,
    start_phase_stack,
)

__all__ = ["fairness_phase"]

CAPACITY: Final = 2
TOKENS_PER_S: Final = 250.0
TTFT_MS: Final = 5
HUGE_WORKERS: Final = 2
HUGE_TOKENS: Final = 1_000
SMALL_WORKERS: Final = 24
SMALL_TOKENS: Final = 60
WARM_UP_S: Final = 4.0
WINDOW_S: Final = 30.0
MAX_RATIO: Final = 1.5


@dataclass
class _Books:
    window: tuple[float, float]
    held: dict[str, float] = field(default_factory=lambda: {"huge": 0.0, "small": 0.0})
    runs: dict[str, int] = field(default_factory=lambda: {"huge": 0, "small": 0})
    small_waits: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def book(self, principal: str, sent: float, first: float, ended: float) -> None:
        start, end = self.window
        began = first - TTFT_MS / 1000
        overlap = min(ended, end) - max(began, start)
        if overlap > 0:
            self.held[principal] += overlap
            self.runs[principal] += 1
        if principal == "small" and start <= sent < end:
            self.small_waits.append(first - sent)


async def _worker(http: httpx2.AsyncClient, principal: str, tokens: int, books: _Books) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"{principal} work"}],
        "max_tokens": tokens,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {caller_token(principal)}"}
    while True:
        sent = time.monotonic()
        first = None
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                books.failures.append(f"{principal}: {r.status_code}")
                continue
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: "):
                    first = time.monotonic()
        if first is not None:
            books.book(principal, sent, first, time.monotonic())


async def fairness_phase(folder: Path) -> Verdict:
    """Run the phase (module docstring) in `folder`; print its books; its verdict."""
    print("\nfair queueing by work:")
    pace = {"ttft_ms": TTFT_MS, "tokens_per_second": TOKENS_PER_S}
    config = {
        "openai": principal_tokens(["huge", "small"]),
        "dispatch": {"max_queue": 256, "queue_timeout_ms": 120_000},
        "models": [{"id": "m", "providers": {"sim-1": "sim-small"}}],
        "providers": [sim_provider("sim-1", CAPACITY, **pace)],
    }
    async with trio.open_nursery() as nursery:
        stack = await start_phase_stack(nursery, folder, [config])
        now = time.monotonic()
        books = _Books(window=(now + WARM_UP_S, now + WARM_UP_S + WINDOW_S))
        limits = httpx2.Limits(max_connections=HUGE_WORKERS + SMALL_WORKERS)
        async with (
            httpx2.AsyncClient(base_url=stack.urls.openai, timeout=120, limits=limits) as http,
            trio.open_nursery() as workers,
        ):
            for principal, count, tokens in (
                ("huge", HUGE_WORKERS, HUGE_TOKENS),
                ("small", SMALL_WORKERS, SMALL_TOKENS),
            ):
                for _ in range(count):
                    workers.start_soon(_worker, http, principal, tokens, books)
            await trio.sleep(books.window[1] - time.monotonic())
            workers.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    return _report(books)


def _report(books: _Books) -> Verdict:
    huge, small = books.held["huge"], books.held["small"]
    ratio = max(huge, small) / min(huge, small) if min(huge, small) > 0 else float("inf")
    waits = books.small_waits
    print(
        f"  capacity {CAPACITY}, weights 1:1, {TOKENS_PER_S:g} tokens/s a slot: "
        f"{HUGE_WORKERS} huge requests ({HUGE_TOKENS} tokens) against {SMALL_WORKERS} small "
        f"({SMALL_TOKENS} tokens) kept outstanding, over {WINDOW_S:g}s"
    )
    print(
        f"  slot time: huge {huge:.1f}s ({books.runs['huge']} runs), small {small:.1f}s "
        f"({books.runs['small']} runs); share {huge / max(huge + small, 1e-9):.0%} : "
        f"{small / max(huge + small, 1e-9):.0%}, ratio {ratio:.2f}"
    )
    if waits:
        print(
            f"  small requests' wait to first token: median {statistics.median(waits):.2f}s, "
            f"max {max(waits):.2f}s ({len(waits)} requests)"
        )
    if books.failures:
        print(f"  failed requests: {len(books.failures)} (first: {books.failures[0]})")
    verdict = Verdict.of(ratio <= MAX_RATIO and not books.failures and bool(waits))
    print(f"  {verdict.state}: slot time ratio {ratio:.2f} <= {MAX_RATIO:g}")
    return verdict
