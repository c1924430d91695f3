"""Elementwise functions over rows whose bits do not depend on the batch: torch's CPU kernels compute a tensor's
vectors and its scalar tail in different ways, so a row's values could change with how many rows a step holds;
`rowwise` pads each row to whole vectors first (the recurrences of `layers.mlstm` and `layers.rwkv`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LANES = 16  # float32 values in the widest vector a CPU kernel may use (AVX-512)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn` (elementwise) of x `[rows, ...]`, each row padded to a whole number of `LANES` first."""
    flat = x.reshape(x.shape[0], -1)
    width = flat.shape[1]
    return fn(F.pad(flat, (0, -width % LANES)))[:, :width].reshape(x.shape)
