"""Host allocator settings of a worker process: glibc malloc keeps freed tensor memory for reuse.

PyTorch's CPU allocator is the C library's ``malloc``. With glibc's defaults a block above the
dynamic mmap threshold (128 KiB at start, at most 32 MiB) is ``mmap``-ed and given back to the
kernel when freed, and the top of the heap is trimmed above 128 KiB free: every training step then
allocates its activations afresh and the kernel zero-fills each 4 KiB page on first touch.
``python scripts/bench_prefix.py --prompts 8 --image-side 56 --response-length 128 --malloc default``
against ``--malloc workers`` (small checkpoint, 8 prompts x G=8, 2 threads; docs/benchmarks.md):
a shared-prefix reference pass took 136k minor page faults and 2.58 s, and none and 1.71 s with
these settings. The arithmetic is unchanged: only where the bytes live.

:func:`keep_freed_memory` sets, through ``mallopt`` (glibc ``malloc.h``; ``mallopt(3)``):
``M_MMAP_MAX = 0`` (no block is mmap-ed: all come from the heaps, reused after ``free``),
``M_TRIM_THRESHOLD`` = 2 GiB, the largest ``int`` (the heap is trimmed only with more than that free) and ``M_TOP_PAD`` = 256 MiB (the heap
grows in large steps). A process's resident memory then stays at its peak, as with jemalloc's or
tcmalloc's caches, and the CUDA caching allocator on GPUs. Under another C library (musl, macOS)
there is no ``mallopt`` of these semantics and nothing is changed.

The same setting is the environment ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=... MALLOC_TOP_PAD_=...``
(glibc tunables read at the first ``malloc``); ``mallopt`` takes effect in a process that is already
running, so the workers apply it at start-up whatever launched them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# malloc.h (glibc): parameter numbers of mallopt
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
SETTINGS = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 256 << 20}


def keep_freed_memory() -> bool:
    """Apply :data:`SETTINGS` to this process's glibc malloc.

    Returns:
        True if every ``mallopt`` call succeeded; False where the C library is not glibc (nothing
        changed) or refused a value (logged at debug level).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except (OSError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt numbers mean other things
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for param, value in SETTINGS.items():
        if mallopt(param, value) != 1:
            log.debug("mallopt(%d, %d) refused", param, value)
            ok = False
    return ok
