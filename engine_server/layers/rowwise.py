"""What the token-by-token recurrences of `layers.mlstm` and `layers.rwkv` share: `recurrence_steps` walks a step's
sequences a token at a time, all sequences with a token there together; `rowwise` runs an elementwise function whose
bits do not depend on the batch (torch's CPU kernels compute a tensor's vectors and its scalar tail in different
ways, so a row's values could change with how many rows a step holds: each row is padded to whole vectors first)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

LANES = 16  # float32 values in the widest vector a CPU kernel may use (AVX-512)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn` (elementwise) of x `[rows, ...]`, each row padded to a whole number of `LANES` first."""
    flat = x.reshape(x.shape[0], -1)
    width = flat.shape[1]
    return fn(F.pad(flat, (0, -width % LANES)))[:, :width].reshape(x.shape)


def recurrence_steps(
    slots: list[int], query_lens: list[int], device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each position j of the step's chunks in turn: (the state rows `slots[i]`, the step's token rows) of every
    sequence i whose chunk (`query_lens[i]` tokens, one after another) has a j-th token."""
    starts = list(itertools.accumulate(query_lens, initial=0))
    for step in range(max(query_lens)):
        active = [i for i, count in enumerate(query_lens) if count > step]
        yield (torch.tensor([slots[i] for i in active], device=device),
               torch.tensor([starts[i] + step for i in active], device=device))  # fmt: skip
