"""`python -m bench.shared_runtime URL [--streams N] [--tokens T]`: another application
on the runtime.

The soak's shared-runtime phase needs the runtime IOP relays to kept busy by a client
that is not IOP, the way a second application on the same llama.cpp or vLLM server
keeps it busy: IOP sees neither that client's requests nor their progress, only that
the runtime's model list stops answering. This process keeps `--streams` streaming chat
completions in flight against `URL` (the bench upstream's root), reissuing each one as
soon as it ends, until it is stopped (SIGTERM or SIGINT: it exits 0). With the
upstream's `--slots` below `--streams`, the runtime is saturated for as long as this
runs (`bench.upstream`).

Its generations are long, as such an application's are: stream `i` asks for
`T * (1 + i / N)` tokens (`x-bench-stream-tokens`), so the streams end at different
moments and the runtime never sees them all end at once. Short streams ending together
would let the in-flight count dip below the runtime's slots between two of them, and a
client process that the machine does not schedule for a moment would let it fall.

It prints `READY_PREFIX` and the stream count once every stream has had a 200 response
head (the load is present from then on), then a progress line each second (`Tally`).
A stream that fails is counted and reissued after `FAILURE_PAUSE_S`: the load does not
stop for one error, and a runtime that refuses every request is not hammered in a loop.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import httpx2
import trio

from bench.upstream import MAX_STREAM_TOKENS, SERVED_MODEL

READY_PREFIX: Final = "shared-runtime client: streams in flight: "
PROGRESS_PREFIX: Final = "shared-runtime client so far: "
DEFAULT_STREAMS: Final = 16
#: Tokens of the shortest stream: 5 s at the soak upstream's 400 tokens/s, unsaturated.
DEFAULT_TOKENS: Final = 2000
#: Before a failed stream is reissued.
FAILURE_PAUSE_S: Final = 0.1
_PROGRESS_EVERY_S: Final = 1.0
_TIMEOUT_S: Final = 60.0
_BODY: Final = {
    "model": SERVED_MODEL,
    "messages": [{"role": "user", "content": "another application's prompt"}],
    "stream": True,
}
_STREAM_TOKENS_HEADER: Final = "x-bench-stream-tokens"


@dataclass
class Tally:
    """What the client's streams did so far."""

    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    last_failure: str = ""

    def failure(self, what: str) -> None:
        self.failed += 1
        self.last_failure = what

    def line(self) -> str:
        last = f" (last: {self.last_failure})" if self.last_failure else ""
        return (
            f"{PROGRESS_PREFIX}{self.completed} streams completed, {self.in_flight} in flight, "
            f"{self.failed} failed{last}"
        )


async def _keep_streaming(
    client: httpx2.AsyncClient, tokens: int, tally: Tally, answered: Callable[[], None]
) -> None:
    """One stream of `tokens` after another, forever; `answered()` once, at the first
    200 head."""
    first = True

    def on_head() -> None:
        nonlocal first
        if first:
            first = False
            answered()

    while True:
        tally.in_flight += 1
        try:
            failure = await _stream_once(client, tokens, on_head)
        finally:
            tally.in_flight -= 1
        if failure is None:
            tally.completed += 1
        else:
            tally.failure(failure)
            await trio.sleep(FAILURE_PAUSE_S)


async def _stream_once(
    client: httpx2.AsyncClient, tokens: int, on_head: Callable[[], None]
) -> str | None:
    """One stream, read to its end without parsing it (this client only makes load);
    what went wrong, or None."""
    headers = {_STREAM_TOKENS_HEADER: str(tokens)}
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=_BODY, headers=headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                return f"HTTP {response.status_code}"
            on_head()
            async for _ in response.aiter_raw():
                pass
    except httpx2.TransportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


async def keep_streams(
    url: str,
    streams: int,
    tokens: int,
    tally: Tally,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep `streams` streams in flight against `url`, the shortest of `tokens` (module
    docstring), until cancelled; started once each stream has had a 200 head."""
    waiting = streams
    all_answered = trio.Event()

    def answered() -> None:
        nonlocal waiting
        waiting -= 1
        if waiting == 0:
            all_answered.set()

    limits = httpx2.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with (
        httpx2.AsyncClient(base_url=url, timeout=_TIMEOUT_S, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        for index in range(streams):
            length = tokens + tokens * index // streams
            nursery.start_soon(_keep_streaming, client, length, tally, answered)
        await all_answered.wait()
        task_status.started()


async def keep_busy(url: str, streams: int, tokens: int) -> None:
    """`keep_streams` until SIGTERM or SIGINT, saying when the load is present and how
    it goes each `_PROGRESS_EVERY_S`; the last tally when stopped."""
    tally = Tally()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(keep_streams, url, streams, tokens, tally)
            print(f"{READY_PREFIX}{streams}", flush=True)
            nursery.start_soon(_report, tally)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    print(tally.line(), flush=True)


async def _report(tally: Tally) -> None:
    while True:
        await trio.sleep(_PROGRESS_EVERY_S)
        print(tally.line(), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.shared_runtime",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", help="the runtime's root URL (http://HOST:PORT)")
    parser.add_argument(
        "--streams", type=int, default=DEFAULT_STREAMS, help="streams kept in flight"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help="tokens of the shortest stream (stream i of N asks for T * (1 + i / N))",
    )
    args = parser.parse_args(argv)
    if args.streams < 1:
        parser.error("--streams must be >= 1")
    if not 1 <= args.tokens <= MAX_STREAM_TOKENS // 2:
        parser.error(f"--tokens must be from 1 to {MAX_STREAM_TOKENS // 2}")
    trio.run(keep_busy, args.url, args.streams, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
