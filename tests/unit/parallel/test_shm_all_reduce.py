"""The CPU's shared-memory all-reduce, on 2 and 3 real processes: the rank-order sum, bitwise, on every rank.

Each rank can recompute every rank's input (one seeded generator per call and rank), so it checks its result
against `x_0 + x_1 + ...` added in rank order, which is exactly what the reduce computes: equal bits, not just
close. Hundreds of calls of changing shapes run back to back (the two banks alternate; a rank that ran ahead
must never overwrite a bank another still reads), a non-contiguous tensor is reduced in place, and what does
not fit a slot (too big, another dtype) goes through gloo with the same result.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from engine_server.parallel.group import destroy_tensor_parallel, init_tensor_parallel
from engine_server.parallel.shm_all_reduce import ShmAllReduce, ShmBuffers, supported
from tests.unit.parallel.ranks import run_ranks

CAPACITY = 64 * 48
SHAPES = [(1, 48), (7, 48), (64, 48), (3, 5), (48,)]


def _input(call: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(call * 1000 + rank), dtype=dtype)


def _expected(call: int, size: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    total = _input(call, 0, shape, dtype)
    for rank in range(1, size):
        total = total + _input(call, rank, shape, dtype)
    return total


def _rank_main(rank: int, size: int, init_method: str, buffers: ShmBuffers) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method, torch.device("cpu"), timedelta(seconds=60), buffers)
    try:
        assert tp.shm_reduce is not None
        for call in range(300):
            shape = SHAPES[call % len(SHAPES)]
            x = _input(call, rank, shape)
            assert tp.all_reduce_sum(x) is x
            assert torch.equal(x, _expected(call, size, shape)), f"call {call} on rank {rank}"
        # In place through a strided view: only the view's elements change.
        base = torch.zeros(8, 12)
        view = base[:, ::2]
        view.copy_(_input(1000, rank, (8, 6)))
        tp.all_reduce_sum(view)
        assert torch.equal(view, _expected(1000, size, (8, 6))) and not base[:, 1::2].any()
        # What does not fit a slot: gloo, the same sum (to float32 rounding: gloo adds in its own order).
        big, wide = _input(2000, rank, (CAPACITY + 1,)), _input(2001, rank, (5,), torch.float64)
        assert not tp.shm_reduce.fits(big) and not tp.shm_reduce.fits(wide)
        torch.testing.assert_close(tp.all_reduce_sum(big), _expected(2000, size, (CAPACITY + 1,)))
        torch.testing.assert_close(tp.all_reduce_sum(wide), _expected(2001, size, (5,), torch.float64))
        assert tp.stats.calls == 303
    finally:
        destroy_tensor_parallel(tp)


@pytest.mark.skipif(not supported(), reason="the shared-memory all-reduce needs x86-64's store order")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_the_shared_memory_all_reduce_is_the_rank_order_sum_on_every_rank(size: int, tmp_path: Path) -> None:
    buffers = ShmAllReduce.allocate(size, CAPACITY)
    run_ranks(_rank_main, (size, f"file://{tmp_path / 'rendezvous'}", buffers), size)
