"""How long a tensor-parallel step message takes to reach a worker on the CPU: the step channel's shared-memory
header and semaphore against the gloo broadcast it replaced (`python -m benchmarks.tp_step_channel`).

Two ranks (one thread each) send `--messages` messages; each is followed by the shared-memory all-reduce of a
3.5 KB hidden state, as a forward's first collective follows its FORWARD message, so a message is not done until
the worker has it. Reported per message in µs, alternating the two ways twice; the all-reduce alone is the floor.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp
from engine_server.parallel.group import destroy_tensor_parallel, init_tensor_parallel
from engine_server.parallel.shm_all_reduce import ShmAllReduce, ShmBuffers
from engine_server.parallel.step_channel import StepChannel, StepReceiver, StepSender

HIDDEN = 896  # dummy:qwen2.5-0.5b's hidden size: a decode row's all-reduce


def _rank(rank: int, init: str, shm: ShmBuffers, channel: StepChannel, messages: int, out: Queue[Any]) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, init, torch.device("cpu"), shm_buffers=shm)
    hidden = torch.ones(HIDDEN)
    header = torch.zeros(16, dtype=torch.int64)
    sender = StepSender(channel) if rank == 0 else None
    receiver = StepReceiver(channel, 1, torch.device("cpu")) if rank == 1 else None
    results: dict[str, list[float]] = {"gloo_broadcast": [], "shm_semaphore": [], "all_reduce_only": []}
    for way in ("gloo_broadcast", "shm_semaphore", "gloo_broadcast", "shm_semaphore", "all_reduce_only"):
        tp.all_reduce_sum(hidden)
        start = time.perf_counter()
        for _ in range(messages):
            if way == "gloo_broadcast":
                dist.broadcast(header, src=0, group=tp.control_group)
            elif way == "shm_semaphore":
                if sender is not None:
                    sender.logits(None)
                else:
                    assert receiver is not None
                    receiver.receive()
            tp.all_reduce_sum(hidden)
        results[way].append(round((time.perf_counter() - start) / messages * 1e6, 1))
    if rank == 0:
        out.put(results)
    destroy_tensor_parallel(tp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    context = mp.get_context("spawn")
    rendezvous = Path(tempfile.mkdtemp(prefix="ladle-tp-bench-"))
    init = f"file://{rendezvous}/store"
    shm = ShmAllReduce.allocate(2, 4 * HIDDEN)
    channel = StepChannel.open(1024, 1, context)
    out: Queue[Any] = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, init, shm, channel, args.messages, out)) for r in range(2)]
    for process in ranks:
        process.start()
    results = out.get(timeout=600)
    for process in ranks:
        process.join(timeout=60)
    shutil.rmtree(rendezvous, ignore_errors=True)
    record = {
        "benchmark": "tp_step_channel",
        "time": utc_timestamp(),
        "commit": git_commit(),
        "device": "cpu",
        "cpu": cpu_model_name(),
        "command": "python -m benchmarks.tp_step_channel " + " ".join(argv or []),
        "messages": args.messages,
        "us_per_message_with_all_reduce": results,
    }
    print(record)
    append_result(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
