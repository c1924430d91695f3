"""Host-side step inputs: `padded_rows` against a row-by-row reference, and the CPU path of the copies."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from engine_server.transfer import host_tensor, padded_rows, to_device


def _reference(rows: Sequence[Sequence[int]], width: int, fill: int) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.int32)
    for i, row in enumerate(rows):
        cut = list(row[:width])
        out[i, : len(cut)] = torch.tensor(cut, dtype=torch.int32)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_padded_rows_cuts_and_pads_each_row(seed: int) -> None:
    rng = random.Random(seed)
    width = rng.randint(1, 12)
    rows: list[Sequence[int]] = [
        [rng.randrange(1000) for _ in range(rng.randint(0, 15))] for _ in range(rng.randint(0, 20))
    ]
    rows += [(), tuple(range(width))]  # the decode graphs pad with empty tuples
    got = padded_rows(rows, width, -7, np.int32)
    assert got.dtype == torch.int32 and torch.equal(got, _reference(rows, width, -7))


def test_padded_rows_of_nothing() -> None:
    assert padded_rows([], 4, 0).shape == (0, 4)


def test_on_the_cpu_tensors_are_plain_and_copies_are_no_ops() -> None:
    tensor = host_tensor([1, 2, 3], torch.long, "cpu")
    assert not tensor.is_pinned() and to_device(tensor, "cpu") is tensor
    assert to_device(tensor, "cpu", torch.int32).dtype == torch.int32
