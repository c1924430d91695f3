"""Argument checks shared by the Triton launchers: they raise ValueError before a kernel reads bad memory."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    """`tensor.dtype` must be one of `allowed` (the kernels cast through float32 and know no other types)."""
    if tensor.dtype not in allowed:
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of {', '.join(map(str, allowed))}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """All tensors on one device: a kernel takes raw pointers and cannot follow a tensor to another device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {shape}")


def unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when its last dim is contiguous (what the kernels index), else a contiguous copy."""
    return tensor if tensor.dim() == 0 or tensor.stride(-1) == 1 else tensor.contiguous()
