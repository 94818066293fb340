"""Memory a large buffer will take is written first where the GIL is released.

A fleet's refresh makes buffers of megabytes in single C calls that keep the GIL: its body
joined, its JSON string unescaped, its text encoded for the YAML reader. Memory the process
has not used before costs a page fault per page when it is first written, and on a virtual
machine whose host takes back the guest's free memory that is 10 µs a page or more: 30-50
ms for the first refresh's few buffers of 6 MB, spent inside those calls while the event
loop waits for the GIL (measured with ten thousand Nodes). So before such work its worker
thread writes as much memory as the work will take, in a call that releases the GIL
(`touch`: glibc's `malloc` and `memset` through ctypes, which lets the GIL go for the call),
and frees it; the allocator, told to keep what is freed, then hands those pages, resident
now, to the buffers that follow. Those calls then cost what copying and decoding cost, a
few milliseconds.

Rules:
1. The first `touch` of `LEAST_BYTES` or more (less is not worth it) sets glibc's
   thresholds for the rest of the process: blocks up to `MMAP_THRESHOLD` come from the
   heap rather than mappings of their own (unmapped, and gone, when freed), and a heap's
   free top goes back to the system only past `TRIM_THRESHOLD`. The Edge then keeps up to
   that much free memory resident between refreshes; one that never does work this
   large (no fleet) keeps glibc's defaults and their smaller footprint (about 20 MB less
   after a few minutes of mixed traffic).
2. `touch(n)` writes n bytes in blocks of `BLOCK` (under the mapping threshold, so each
   comes from the heap of the calling thread's arena), allocated together and freed
   together: free neighbours merge, and the next buffers are cut from them. It costs the
   calling thread, not the GIL. Call it in the thread that does the work: glibc gives
   each thread its own arena.
3. Without glibc (musl, macOS) `touch` does nothing: the costs it avoids are glibc's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Final

__all__ = ["BLOCK", "LEAST_BYTES", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "touch"]

log = logging.getLogger(__name__)

#: Blocks up to this size come from the heap (glibc's largest allowed on 64 bits).
MMAP_THRESHOLD: Final = 32 << 20
#: A heap's free top beyond this goes back to the system: a fleet's refresh takes a few
#: dozen megabytes in large buffers at once.
TRIM_THRESHOLD: Final = 64 << 20
#: The block `touch` allocates at a time (Rule 2).
BLOCK: Final = 8 << 20
#: Less than this is not touched (Rule 1): fresh, it costs a few milliseconds at most.
LEAST_BYTES: Final = 4 << 20

_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3


class _Glibc:
    """The C library's allocator, once it keeps what is freed (Rule 1)."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self.malloc = libc.malloc
        self.malloc.argtypes = [ctypes.c_size_t]
        self.malloc.restype = ctypes.c_void_p
        self.memset = libc.memset
        self.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self.memset.restype = ctypes.c_void_p
        self.free = libc.free
        self.free.argtypes = [ctypes.c_void_p]
        self.free.restype = None


@functools.cache
def _allocator() -> _Glibc | None:
    """glibc's allocator, told to keep what is freed (Rule 1), the first time it is asked
    for; None without glibc (Rule 3)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):  # no such name: not glibc
        return None
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        log.warning("glibc refused the allocator's thresholds: fresh memory is not touched first")
        return None
    return _Glibc(libc)


def touch(nbytes: int) -> None:
    """Write `nbytes` of heap and free it, the GIL released (Rule 2); the first call sets
    the allocator's thresholds (Rule 1); nothing for less than `LEAST_BYTES`, or without
    glibc (Rule 3)."""
    if nbytes < LEAST_BYTES:
        return
    glibc = _allocator()
    if glibc is None:
        return
    blocks: list[int] = []
    try:
        for _ in range(-(-nbytes // BLOCK)):
            block = glibc.malloc(BLOCK)
            if not block:
                break
            blocks.append(block)
            glibc.memset(block, 0, BLOCK)
    finally:
        for block in reversed(blocks):
            glibc.free(block)
