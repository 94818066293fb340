"""`python -m bench.kv_deltas`: what relaying runtimes' KV-cache events would cost.

vLLM (`--kv-events-config`) and SGLang publish, over ZeroMQ, batches of `BlockStored`
(the hashes of the blocks a request filled, `block_size` tokens each, with their token
ids) and `BlockRemoved` (the hashes evicted) and `AllBlocksCleared`. A Node next to such
a runtime could relay them up its link as compact deltas: per provider, the stored and
the removed hashes since the last delta, each cut to 8 bytes, packed. This measures the
two halves of that on this machine, one core, in-process:

- the Node's side: building one delta (`--hashes` stored and as many removed, packed as
  8-byte integers) and encoding it as a wire message (msgpack, as `schemas.wire`);
- the Edge's side: decoding it and applying it to the provider's set of resident
  hashes (a Python `set` of ints holding `--resident` blocks, as a routing index would).

It prints microseconds per delta and per hash, and bytes per delta; design §18 turns
them into a fleet's cost. The framing and the websocket (the Edge's cost per message,
whatever it says) are the fleet bench's (`bench/many_nodes.py`), not measured here.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from array import array
from typing import Final

import msgspec


class KvDelta(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="kv_delta"):
    """One provider's change of resident blocks since its previous delta (an array on the
    wire, as vLLM's own events: no field names)."""

    provider: str
    seq: int
    stored: bytes
    """8-byte little-endian block hashes, packed."""
    removed: bytes
    cleared: bool = False


_encode: Final = msgspec.msgpack.Encoder().encode
_decode: Final = msgspec.msgpack.Decoder(KvDelta).decode


def _hashes(rng: random.Random, count: int) -> list[int]:
    return [rng.getrandbits(63) for _ in range(count)]


def measure(hashes: int, resident: int, rounds: int) -> dict[str, float]:
    """Per-delta microseconds (build + encode on the Node; decode + apply on the Edge)
    and bytes, the best of `rounds` passes of 200 deltas each."""
    rng = random.Random(7)
    index: set[int] = set(_hashes(rng, resident))
    batches = [(_hashes(rng, hashes), rng.sample(sorted(index), hashes)) for _ in range(200)]
    node_best = edge_best = float("inf")
    size = 0
    for _ in range(rounds):
        started = time.perf_counter()
        frames = []
        for seq, (stored, removed) in enumerate(batches):
            delta = KvDelta(
                provider="gpu-0007-vllm",
                seq=seq,
                stored=array("q", stored).tobytes(),
                removed=array("q", removed).tobytes(),
            )
            frames.append(_encode(delta))
        node_best = min(node_best, (time.perf_counter() - started) / len(batches))
        size = len(frames[0])
        resident_now = set(index)
        started = time.perf_counter()
        for frame in frames:
            got = _decode(frame)
            if got.cleared:
                resident_now.clear()
            resident_now.difference_update(array("q", got.removed))
            resident_now.update(array("q", got.stored))
        edge_best = min(edge_best, (time.perf_counter() - started) / len(frames))
    return {"node_us": node_best * 1e6, "edge_us": edge_best * 1e6, "bytes": float(size)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hashes", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--resident", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"resident blocks per provider: {args.resident:,}; best of {args.rounds}")
    print(f"{'hashes':>8} {'bytes':>8} {'node us':>9} {'edge us':>9} {'edge us/hash':>13}")
    for count in args.hashes:
        got = measure(count, args.resident, args.rounds)
        per_hash = got["edge_us"] / (2 * count)
        print(
            f"{count:>8} {int(got['bytes']):>8} {got['node_us']:>9.2f} {got['edge_us']:>9.2f}"
            f" {per_hash:>13.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
