"""Host -> device copies of a step's inputs: pinned memory and asynchronous copies on CUDA, plain on the CPU.

Why pinned: a copy from pageable memory makes the host wait while the driver stages the bytes; from pinned
memory it is a DMA queued on the stream, so the host goes on building the step while the GPU works. PyTorch's
pinned allocator keeps a block alive until the copies queued from it have run, so callers may drop the host
tensor as soon as `to_device` returns.
"""

from __future__ import annotations

import itertools
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
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if not pins_for(device):
        # Even a `.to()` that changes nothing releases and retakes the GIL, which a busy event-loop thread
        # then holds for up to a switch interval: a step's host-to-host "copies" are skipped instead.
        return tensor if tensor.device == torch.device(device) else tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def padded_rows(rows: Sequence[Sequence[int]], width: int, fill: int, dtype: Any = np.int64) -> torch.Tensor:
    """`rows` as a `[len(rows), width]` CPU tensor, each row cut to `width` and padded with `fill`.

    Filled through numpy in one masked assignment of the flattened rows, which matters in a step's host time:
    256 block tables of 40-100 blocks take about 0.4 ms, against 0.5-0.8 ms row by row and several ms for
    `torch.tensor` on the nested lists.
    """
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    array: np.ndarray[Any, Any] = np.full((len(rows), width), fill, dtype=dtype)
    if lengths.max(initial=0) > width:
        rows = [row[:width] for row in rows]
        np.minimum(lengths, width, out=lengths)
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lengths.sum()))
    array[np.arange(width) < lengths[:, None]] = flat
    return torch.from_numpy(array)
