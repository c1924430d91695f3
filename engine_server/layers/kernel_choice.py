"""Which kernel set (`ladle_kernels.kernel_set.KernelOps`: norm, rope, activation, KV write, attention) the layers call
on a device."""

from __future__ import annotations

import functools

import torch

from ladle_kernels.kernel_set import REFERENCE_OPS, KernelOps


def select_ops(device: torch.device) -> KernelOps:
    """The ops for tensors on `device`: the Triton kernels on CUDA when triton imports; on the CPU the C++
    kernels of `ladle_kernels.cpu_ops` when they build; else the torch reference."""
    if device.type == "cuda":
        return _triton_ops() or REFERENCE_OPS
    if device.type == "cpu":
        return _cpu_ops() or REFERENCE_OPS
    return REFERENCE_OPS


def _cpu_ops() -> KernelOps | None:
    """`ladle_kernels.cpu_ops.cpu_ops()`: built and cached on first use, None where it cannot be built."""
    from ladle_kernels.cpu_ops import cpu_ops

    return cpu_ops()


@functools.cache
def _triton_ops() -> KernelOps | None:
    """`ladle_kernels.triton_ops.TRITON_OPS`, imported on first use (never on CPU-only runs), or None without triton."""
    try:
        from ladle_kernels.triton_ops import TRITON_OPS
    except ImportError:
        return None
    return TRITON_OPS
