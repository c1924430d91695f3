"""The CPU's all-reduce through shared memory: what gloo over loopback TCP does in ~1.4 ms, in microseconds.

A decoder layer all-reduces twice per step (and the embedding once), so on the CPU the collective's latency, not
its bytes, is what tensor parallelism pays: gloo measured 1.4 ms for a 3.5 KB sum between two processes on this
project's 2-core box, ~50 % of a single-stream step of a 0.5B model at TP=2. vLLM's CPU backend and SGLang's
replace it with a shared-memory reduce the same way; this is ours.

Layout (one `ShmAllReduce` per rank, over tensors made by `ShmAllReduce.allocate` before the workers are spawned):
two banks of `size` slots of `capacity` float32 values each, and one arrival counter per rank. Call number `s`
(the same on every rank: collectives run in the same order everywhere) uses bank `s % 2`:
1. write this rank's tensor into its slot of the bank;
2. publish `s` as its arrival counter;
3. wait until every rank's counter is >= `s`;
4. sum the slots in rank order into the tensor (every rank adds the same values in the same order: the same bits).
A bank is written again two calls later, by a rank that has passed the next call's step 3, i.e. once every rank
has arrived at that next call and so has finished reading this one: no second barrier is needed.

The counters are plain stores and loads: this relies on the stores of one process becoming visible to the others
in program order (x86-64's total store order), so `supported()` says yes only there; elsewhere gloo is used.
Waiting ranks spin with `sched_yield` for up to `SPIN_BEFORE_NAPPING_S`, then nap `NAP_S` between looks: with a
core per rank the others arrive within the spin and a step pays nothing; with more ranks than cores (or other work
on them) a rank that spun on would hold a core the rank it waits for needs (on 2 cores at TP=3, about half of
every rank's CPU went to spinning). A rank that dies while the others wait leaves them waiting: the engine's
watchers end every process then (engine_server.workers).
Tensors larger than a slot, or of another dtype, go through gloo.

The C++ decode stack (ladle_kernels/cpu/decoder.cpp) runs the same steps between its layers, on the same buffers and
the same call count (`counters[0]`, shared with it), so a quantized model's steps keep to one C++ call under
tensor parallelism too; it adds its calls, bytes and nanoseconds to `counters[1:]`.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

# The C++ decode stack's wait (ladle_kernels/cpu/decoder.cpp) uses the same two values.
SPIN_BEFORE_NAPPING_S = 50e-6
NAP_S = 50e-6


def supported() -> bool:
    """Whether this machine orders one process's stores for the others as the barrier needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@dataclass(frozen=True)
class ShmBuffers:
    """The shared tensors of one group's all-reduce (pickled to the workers at spawn, mapped by all ranks)."""

    slots: torch.Tensor  # [2, size, capacity] float32
    arrivals: torch.Tensor  # [size] int64


class ShmAllReduce:
    """Rank `rank`'s end of the shared-memory all-reduce (module doc). Not thread-safe: one caller per rank."""

    def __init__(self, buffers: ShmBuffers, rank: int) -> None:
        self.rank = rank
        self.buffers = buffers
        self.size = buffers.slots.shape[1]
        self.capacity = buffers.slots.shape[2]
        self._slots = buffers.slots
        self._arrivals = buffers.arrivals.numpy()
        # This rank's [call count, the C++ stack's calls, its bytes, its nanoseconds]; the count is the sequence
        # number of the last call, by this end or the stack's (the two take turns, never at once).
        self.counters = torch.zeros(4, dtype=torch.int64)
        self._counters = self.counters.numpy()

    @staticmethod
    def allocate(size: int, capacity: int) -> ShmBuffers:
        """Zeroed shared buffers for `size` ranks and tensors of up to `capacity` float32 values."""
        slots = torch.zeros(2, size, capacity, dtype=torch.float32).share_memory_()
        return ShmBuffers(slots, torch.zeros(size, dtype=torch.int64).share_memory_())

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.numel() <= self.capacity

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (which `fits`) over the ranks, in place, and return it; every rank gets the same bits."""
        self._counters[0] += 1
        call = int(self._counters[0])
        n = tensor.numel()
        bank = self._slots[call % 2]
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        bank[self.rank, :n].copy_(flat)
        self._arrivals[self.rank] = call
        arrivals = self._arrivals
        if arrivals.min() < call:
            nap_from = time.monotonic() + SPIN_BEFORE_NAPPING_S
            while arrivals.min() < call:
                if time.monotonic() < nap_from:
                    os.sched_yield()
                else:
                    time.sleep(NAP_S)
        tensor.copy_(bank[0, :n].view(tensor.shape))
        for rank in range(1, self.size):
            tensor.add_(bank[rank, :n].view(tensor.shape))
        return tensor


def reduce_capacity(max_tokens: int, hidden_size: int) -> int:
    """Values a slot holds: the largest tensor a step all-reduces, `[tokens, hidden]`."""
    return max_tokens * hidden_size
