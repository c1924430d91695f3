"""The process's allocator settings for the CPU (`engine_server.host_memory`): freed memory kept for reuse between
steps, and given back once at the end of loading."""

from __future__ import annotations

import ctypes.util

import pytest
import torch

from engine_server.host_memory import keep_freed_memory_for_reuse, release_freed_memory


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="needs glibc")
def test_memory_freed_while_loading_is_given_back() -> None:
    assert keep_freed_memory_for_reuse()
    chunks = [torch.ones(1024 * 1024) for _ in range(64)]  # 256 MB in 4 MB blocks: heap, under the mmap threshold
    del chunks
    kept = _rss_bytes()
    assert release_freed_memory()
    assert kept - _rss_bytes() > 128 * 1024 * 1024
