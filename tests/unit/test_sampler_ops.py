"""Torch ops per sampling step: a fixed, small number whatever the batch size, seeds included.

On a GPU each eager op outside the CUDA graph is a kernel launch costing ~5-20 us of host time, which no CPU
timing shows; their number is counted here with a dispatch mode. Views (slices, unsqueeze, dtype views) launch
nothing and are not counted; `Tensor.to` is, as the host-to-device copy it is on CUDA (a no-op on the CPU).
The vocabulary stays under 2 * NUCLEUS_CANDIDATES so top-p takes the sort path of CUDA, not the CPU-only one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_server.sampling import Sampler, SamplingRow
from engine_server.sampling_params import SamplingParams

V = 1000
BATCH_SIZES = (1, 8, 256)
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
# The most ops a step may take (what it takes today, with the metadata's one host-to-device copy):
# greedy = argmax; sampled = copy, temperature, top-p (sort, softmax, cumsum, compare, keep the top token, mask,
# scatter back), softmax, the shared generator's race (noise, clamp, divide, argmax); seeded = the same with the
# counter-based noise (13 int64/float ops on the CPU, one Triton kernel on CUDA) and a race without the clamp;
# mixed = both races, the seeded rows' noise copied into the shared one, and the greedy rows' argmax.
MAX_OPS = {"greedy": 1, "sampled": 15, "seeded": 25, "mixed": 32}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view or func.overloadpacket is torch.ops.aten.to:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def make_rows(kind: str, batch: int) -> list[SamplingRow]:
    def row(i: int, params: SamplingParams, seed: int | None) -> SamplingRow:
        return SamplingRow(params, [1, 2, 3], [4] * (i % 5), frozenset({0}), position=3 + i % 5, seed=seed)

    if kind == "mixed":  # a greedy, a sampled and a seeded row in every three
        return [row(i, GREEDY if i % 3 == 0 else SAMPLED, 1000 + i if i % 3 == 2 else None) for i in range(batch)]
    params = GREEDY if kind == "greedy" else SAMPLED
    return [row(i, params, 7 + i if kind == "seeded" else None) for i in range(batch)]


def count_ops(kind: str, batch: int) -> Counter[str]:
    sampler = Sampler(V, "cpu", seed=0)
    logits = torch.randn(batch, V, generator=torch.Generator().manual_seed(batch))
    rows = make_rows(kind, batch)
    sampler(logits, rows)  # warm: first calls may dispatch one-off ops
    with OpCounter() as counter:
        sampler(logits, rows)
    return counter.ops


@pytest.mark.parametrize("kind", list(MAX_OPS))
def test_ops_per_step_do_not_grow_with_the_batch(kind: str) -> None:
    batch_sizes = BATCH_SIZES if kind != "mixed" else (3, 9, 255)  # every batch holds all three kinds
    counts = {batch: count_ops(kind, batch) for batch in batch_sizes}
    totals = {batch: sum(ops.values()) for batch, ops in counts.items()}
    assert len(set(totals.values())) == 1, counts
    assert totals[batch_sizes[0]] <= MAX_OPS[kind], counts[batch_sizes[0]]
