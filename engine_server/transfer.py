"""Host -> device copies of a step's inputs: pinned memory and asynchronous copies on CUDA, plain on the CPU.

Why pinned: a copy from pageable memory makes the host wait while the driver stages the bytes; from pinned
memory it is a DMA queued on the stream, so the host goes on building the step while the GPU works. PyTorch's
pinned allocator keeps a block alive until the copies queued from it have run, so callers may drop the host
tensor as soon as `to_device` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def pins_for(device: torch.device | str) -> bool:
    """Whether host tensors bound for `device` are worth pinning: only for CUDA devices."""
    return torch.device(device).type == "cuda"


def host_tensor(
    data: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """`data` as a host tensor of `dtype`, built in pinned memory when it is bound for a CUDA `device`."""
    return torch.tensor(data, dtype=dtype, pin_memory=pins_for(device))


def to_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor on `device`, cast to `dtype` first when given.

    On CUDA the copy is non-blocking from pinned memory (pinning a copy first if `tensor` is not pinned); on
    any other device it is a plain `.to()`, which returns `tensor` itself when nothing changes.
    """
    if dtype is not None:
        tensor = tensor.to(dtype)
    if not pins_for(device):
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def padded_rows(rows: Sequence[Sequence[int]], width: int, fill: int, dtype: Any = np.int64) -> torch.Tensor:
    """`rows` as a `[len(rows), width]` CPU tensor, each row cut to `width` and padded with `fill`.

    Filled through numpy: about 5x faster than `torch.tensor` on nested lists (0.26 vs 1.3 ms for 256 block
    tables of 64), which matters in a step's host time.
    """
    array: np.ndarray[Any, Any] = np.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        n = min(len(row), width)
        if n:
            array[i, :n] = row[:n]
    return torch.from_numpy(array)
