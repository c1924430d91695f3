"""Which implementation of the primitive ops (norm, rope, activation, KV write, attention) the layers call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels import reference


@dataclass(frozen=True)
class KernelOps:
    """One backend's ops; each field has the signature and contract of the same name in `kernels.reference`."""

    rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


REFERENCE_OPS = KernelOps(
    rms_norm=reference.rms_norm,
    rotary_embedding=reference.rotary_embedding,
    silu_and_mul=reference.silu_and_mul,
    write_kv_cache=reference.write_kv_cache,
    paged_attention=reference.paged_attention,
)


def select_ops(device: torch.device) -> KernelOps:
    """The ops for tensors on `device`: the Triton kernels on CUDA when triton imports; on the CPU the C++
    kernels of `kernels.cpu_ops` when they build; else the torch reference."""
    if device.type == "cuda":
        return _triton_ops() or REFERENCE_OPS
    if device.type == "cpu":
        return _cpu_ops() or REFERENCE_OPS
    return REFERENCE_OPS


def _cpu_ops() -> KernelOps | None:
    """`kernels.cpu_ops.cpu_ops()`: built and cached on first use, None where it cannot be built."""
    from kernels.cpu_ops import cpu_ops

    return cpu_ops()


@functools.cache
def _triton_ops() -> KernelOps | None:
    """`kernels.triton_ops.TRITON_OPS`, imported on first use (never on CPU-only runs), or None without triton."""
    try:
        from kernels.triton_ops import TRITON_OPS
    except ImportError:
        return None
    return TRITON_OPS
