"""Process-wide allocator settings for running the model on the CPU.

A CPU step allocates and frees activations of several MB (a 2048-token prefill chunk's gate/up output is 25
MB). glibc serves blocks above its mmap threshold with fresh `mmap`s and returns freed heap tops to the system
past its trim threshold, so each such tensor is paid for again in page faults: element-wise ops measured 2-7x
slower inside the engine than alone, and a 64 x 128-token prefill 20% slower in all. Raising both thresholds
keeps those pages in the process for reuse, as tcmalloc or jemalloc would.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

import structlog

log = structlog.get_logger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems; blocks above it are still mmapped.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


@functools.cache
def keep_freed_memory_for_reuse() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where libc is not glibc.

    Effects: blocks up to 32 MiB come from the heap and up to 1 GiB of freed heap stays mapped, so the
    process's resident size stays near its peak working set instead of shrinking between steps.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    log.debug("malloc thresholds raised", applied=applied)
    return applied


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system now (glibc's `malloc_trim(0)`); False where libc is not glibc.

    For the end of loading: a model's load frees far more than a step's working set (a GGUF file's blocks decoded
    and repacked, tensor by tensor), which the raised trim threshold would otherwise keep resident for good."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    gc.collect()
    return bool(trim(0))


# Objects the young generation holds before a collection: a decode step of a few hundred requests allocates a
# few objects per request, so Python's default (700) would collect several times a step.
YOUNG_GENERATION_THRESHOLD = 50_000


def freeze_startup_heap() -> None:
    """After start-up: move every object alive now into the collector's permanent generation and raise the
    young generation's threshold, so collections during steps neither scan start-up objects nor run every step.

    Start-up leaves hundreds of thousands of long-lived objects (modules, the tokenizer, torch's own state); a
    full collection scanned them all, and how often one ran grew with the batch, so host time per step grew
    faster than the batch. Cycles still get collected: collections only run less often.

    (The permanent generation's size is not logged: `gc.get_freeze_count` walks it, ~50 ms for 400,000 objects, an
    eighth of an offline engine's start on a small model.)
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)
    log.debug("start-up heap frozen")
