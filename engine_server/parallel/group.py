"""The tensor-parallel group of one engine: who this rank is, how to join and leave, and the two collectives.

A `TensorParallel` is built once per process (by `init_tensor_parallel`) and passed down to every sharded layer.
`size == 1` means no process group at all: the collectives return their input untouched, so a TP=1 engine runs
exactly the code and the numbers it runs without this package. Rank 0 is the driver: it alone schedules, samples
and receives the gathered logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from engine_server.parallel.shm_all_reduce import ShmAllReduce, ShmBuffers, supported


@dataclass
class CollectiveStats:
    """What this rank's all-reduces cost since start (or `reset`): calls, bytes reduced, seconds inside them
    (waiting for the slowest rank included; on CUDA only the time to queue them). Benchmarks read it; two clock
    reads per call."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    # The C++ decode stack's own all-reduces: [_, calls, bytes, nanoseconds] (`ShmAllReduce.counters`), if any.
    native: torch.Tensor | None = None

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0
        if self.native is not None:
            self.native[1:].zero_()

    def total(self) -> tuple[int, int, float]:
        """(calls, bytes, seconds) of every all-reduce since the last reset, the decode stack's included."""
        if self.native is None:
            return self.calls, self.bytes, self.seconds
        calls, nbytes, nanoseconds = self.native[1:].tolist()
        return self.calls + calls, self.bytes + nbytes, self.seconds + nanoseconds / 1e9


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group.

    Invariants: `0 <= rank < size`; `group` and `control_group` are None exactly when `size == 1`. Every rank of a
    group must call each collective in the same order with tensors of the same shape and dtype (torch.distributed's
    own contract). `group` carries the model's collectives on its device (NCCL on CUDA); `control_group` is a
    gloo group over the same ranks for host values (the step channel, start-up numbers): the same group on the CPU.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)
    # The CPU's shared-memory all-reduce (shm_all_reduce.py), used for every tensor it fits; None: gloo / NCCL.
    shm_reduce: ShmAllReduce | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in a group of size {self.size}")
        if (self.group is None) != (self.size == 1) or (self.control_group is None) != (self.size == 1):
            raise ValueError(f"a tensor-parallel group of size {self.size} needs a process group exactly when size > 1")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that schedules, samples and receives gathered results."""
        return self.rank == 0

    @property
    def capturable(self) -> bool:
        """Whether the model's collectives can be recorded in a CUDA graph (NCCL's can; gloo's copy through the
        host and cannot). True at size 1, which has none."""
        return self.group is None or dist.get_backend(self.group) == "nccl"

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place, and return it (every rank gets the sum); a no-op at size 1."""
        if self.group is not None:
            started = time.perf_counter()
            if self.shm_reduce is not None and self.shm_reduce.fits(tensor):
                self.shm_reduce.all_reduce_sum(tensor)
            else:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            stats = self.stats
            stats.seconds += time.perf_counter() - started
            stats.calls += 1
            stats.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def broadcast_from_driver(self, value: int) -> int:
        """Rank 0's `value` on every rank (a host int, over the control group); `value` itself at size 1."""
        if self.control_group is None:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(box, src=dist.get_global_rank(self.control_group, 0), group=self.control_group)
        return int(box.item())

    def broadcast_from_driver_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's `tensor` (same shape, dtype and device kind), in place, over the
        model's group: on CUDA an NCCL broadcast queued on the stream, device to device. `tensor` at size 1."""
        if self.group is not None:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`cat` of every rank's `tensor` along the last dim, in rank order, on rank 0; None on the other ranks.

        Every rank's tensor has the same shape. At size 1 it returns `tensor` itself.
        """
        if self.group is None:
            return tensor
        device = tensor.device
        # gloo gathers host tensors only (a group of ranks sharing one GPU, `init_tensor_parallel`'s `backend`).
        tensor = tensor.cpu() if device.type == "cuda" and not self.capturable else tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_driver else None
        dist.gather(tensor, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.cat(parts, dim=-1).to(device) if parts is not None else None


SINGLE = TensorParallel()
"""The group of one: no process group, every collective a no-op."""


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    timeout: timedelta = timedelta(minutes=5),
    shm_buffers: ShmBuffers | None = None,
    backend: str | None = None,
) -> TensorParallel:
    """Join the group of `size` ranks as `rank` and return it; at size 1, `SINGLE` without touching torch.distributed.

    With `shm_buffers` (made by `ShmAllReduce.allocate` before the ranks started) on a CPU that `supported()`,
    all-reduces go through shared memory instead of gloo.

    `init_method` is the rendezvous every rank is given by the caller: `tcp://127.0.0.1:PORT` or `file:///path`
    (a file that does not exist yet). The backend follows `device` unless `backend` names one: NCCL on CUDA (the
    rank's device becomes the current one), gloo on the CPU; gloo on CUDA serves ranks that share one GPU, which
    NCCL refuses (a test of the CUDA path on a one-GPU host: its collectives copy through the host, and no graphs
    record them). The group is torch.distributed's default group, one per process; a rank that does not arrive
    within `timeout` makes the others' calls fail instead of hanging forever.
    """
    if size == 1:
        return SINGLE
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    except BaseException:
        _forget_failed_join()
        raise
    group = dist.group.WORLD
    try:
        if not isinstance(group, dist.ProcessGroup):  # only None before init; narrows the type for mypy
            raise RuntimeError("torch.distributed has no default process group after init_process_group")
        control = group if backend == "gloo" else dist.new_group(backend="gloo")
        shm = ShmAllReduce(shm_buffers, rank) if shm_buffers is not None and backend == "gloo" and supported() else None
    except BaseException:
        dist.destroy_process_group()
        raise
    stats = CollectiveStats(native=None if shm is None else shm.counters)
    return TensorParallel(rank=rank, size=size, group=group, control_group=control, stats=stats, shm_reduce=shm)


def _forget_failed_join() -> None:
    """Leave torch.distributed as a join that failed found it. `init_process_group` names the default group (and
    prefixes its store keys) by a process-wide count it raises before joining and resets only when a default group
    is destroyed; after a failed join nothing is, so this process's next group would look for its peers under
    `/default_pg/1/` while fresh workers write under `/default_pg/0/`, and wait for them until its timeout."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    """Leave and tear down `tp`'s process group (nothing to do at size 1, or if it is already gone)."""
    if tp.group is not None and dist.is_initialized():
        dist.destroy_process_group()
