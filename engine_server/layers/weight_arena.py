"""The CPU's quantized weights in one buffer backed by transparent huge pages.

A decode step on the CPU streams every packed weight once. Packed one by one, the ~120 projections of a small
model are ~120 separate allocations of 4 KiB pages: every page of them is a TLB miss on the way through, and
inside a virtual machine each miss is a two-level page walk. `gather_packed_weights` moves the packed blocks of
every quantized layer (`QuantizedLinear` with all its shards, `QuantizedExperts`, and a tied `QuantizedEmbedding`'s
view of its LM head) into one buffer, in the model's order, each tensor set to its view of it (`Tensor.set_`: every
layer holding the tensor reads the copy, and the old storage goes at once, so a 14 GB model never takes twice
that, as copying all before letting any go would: gpt-oss-20b's file, benchmarks/gpt_oss_gguf.py); the buffer is
an anonymous mapping advised `MADV_HUGEPAGE`, so where the kernel's transparent huge pages are `madvise` or
`always` it is backed by 2 MiB pages (measured on the Q4_K_M file of SmolLM2-135M, 2 cores: a single-stream
decode step 5.38 -> 5.04 ms, docs/performance.md). The values are the same bytes: every product gives the same bits.
Where huge pages are off (`never`, or a platform without `MADV_HUGEPAGE`) the buffer is plain memory.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

from engine_server.host_memory import release_freed_memory
from engine_server.layers.quantized_experts import QuantizedExperts
from engine_server.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear

HUGE_PAGE_BYTES = 2 << 20
# While gathering, the heap's freed pages are given back this often (the old storages under glibc's raised mmap
# threshold, `host_memory`: ~2 GB of gpt-oss-20b's 15 GB would otherwise stay resident beside their copies).
TRIM_EVERY_BYTES = 512 << 20
TENSOR_ALIGNMENT = 64  # a cache line: where every packed tensor starts in the buffer


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `nbytes`, starting on a 2 MiB boundary of an anonymous mapping advised
    `MADV_HUGEPAGE` (where the platform has it). The mapping lives as long as the tensor (or a view of it)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: faults then take whole 2 MiB pages
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start : start + nbytes]


def _packed_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The packed CPU tensors `module` reads (some shared with another module: a tied embedding's are its head's)."""
    if isinstance(module, QuantizedLinear):
        return [tensor for part in module.parts for tensor in part[:3]]
    if isinstance(module, QuantizedEmbedding):
        return list(module.packed) if module.packed is not None else []
    if isinstance(module, QuantizedExperts):
        return [tensor for name, tensor in module.named_buffers(recurse=False) if tensor is not None]
    return []


def gather_packed_weights(model: nn.Module) -> int:
    """Moves the packed blocks of `model`'s CPU quantized layers into one `huge_page_buffer`, each tensor once
    (64-byte aligned, in module order), setting each tensor to its copy (module doc); returns the buffer's bytes (0
    when nothing is packed on the CPU). Call it before anything else (the C++ decode stack) takes references to the
    tensors' data: those would keep reading the old storage."""
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in _packed_tensors(module):
            tensors.setdefault(id(tensor), tensor)
    if not tensors or any(tensor.device.type != "cpu" for tensor in tensors.values()):
        return 0
    spans = {key: -(-tensor.numel() * tensor.element_size() // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
             for key, tensor in tensors.items()}  # fmt: skip
    buffer = huge_page_buffer(sum(spans.values()))
    offset = trimmed = 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        copy = buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        tensor.set_(copy)  # type: ignore[call-overload]  # the layers' tensor now reads the buffer
        offset += spans[key]
        if offset - trimmed >= TRIM_EVERY_BYTES:  # storages freed inside the heap stay mapped until trimmed
            release_freed_memory()
            trimmed = offset
    return offset
