"""Tensor parallelism's processes: rank 0 (this engine) starts the N-1 workers, which load their shards and then
run every forward pass rank 0 runs, in step, until told to stop.

Start-up (`start_tensor_parallel`): rank 0 opens the step channel (shared memory, a semaphore per worker), starts
the workers (one device each on CUDA, an even share of the cores each on the CPU, rank 0 included), joins the
process group with them through a rendezvous file, and every rank runs `load_model` with its `TensorParallel`.
Workers are forks of a forkserver that has imported torch and this module once (`worker_context`), not fresh
interpreters that import them again (~3 s of CPU each), and never forks of rank 0, which runs threads by then;
each takes rank 0's environment as of its start, as a spawned one would.

A worker's loop (`_worker_main`) takes one `step_channel` message at a time: FORWARD runs the model over its
own KV cache and keeps the hidden states, DECODE_GRAPH does the same by replaying its own decode graph of the
bucket rank 0 replays (every rank captured the same buckets at load, their all-reduces inside), LOGITS computes
its vocab rows' logits for the rows asked and gathers them to rank 0, CAPTURE records the graphs again (tests:
the eager stand-in), STOP ends it. It never samples, schedules or sees a request.

Failure: every process of the group goes when one goes. A worker exits when rank 0 does (its lifeline, a pipe
only rank 0 writes to, reads end-of-file the moment rank 0 is gone, whatever killed it; and a collective with a
dead peer fails at once). Rank 0 watches its workers: when one exits
without being told to stop, `on_lost` runs. By default (the offline `LLM`) it logs and exits the process with
status 1; `ladle engine` replaces it (`WorkerGroup.on_lost`) to turn health NOT_SERVING and end every call in
flight UNAVAILABLE first (engine_server.server.server), so a supervisor restarts the engine and the gateway fails
over.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

import structlog
import torch
import torch.multiprocessing as mp

from engine_server.config import EngineConfig
from engine_server.cuda_graphs import CudaGraphCapture, EagerCapture
from engine_server.loader import ModelSource
from engine_server.model_loading import (
    LoadedModel,
    capture_decode_graphs,
    load_model,
    refuse_unserved,
    resolve_device,
)
from engine_server.models import CausalLM
from engine_server.parallel.group import TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from engine_server.parallel.sharding import check_shardable
from engine_server.parallel.shm_all_reduce import ShmAllReduce, ShmBuffers, reduce_capacity, supported
from engine_server.parallel.step_channel import (
    MessageKind,
    StepChannel,
    StepReceiver,
    StepSender,
    buffer_capacity,
)

log = structlog.get_logger(__name__)

# On the CPU the all-reduces go through shared memory (parallel/shm_all_reduce.py) unless this is "gloo" (A/B runs).
CPU_ALL_REDUCE_ENV = "LADLE_CPU_ALL_REDUCE"
# "1": on CUDA every rank shares GPU 0 and the group runs on gloo (NCCL refuses two ranks on one GPU): a test of
# the CUDA path on a one-GPU host, slow (collectives copy through the host) and without decode graphs. Give the
# KV cache a size (`--kv-cache-memory`): each rank allocates what rank 0 sizes for itself.
SHARED_DEVICE_ENV = "LADLE_TP_SHARED_DEVICE"
STOP_WAIT_S = 5.0  # how long `stop` waits for the workers to leave before killing them
JOIN_TIMEOUT = timedelta(minutes=10)  # ranks that do not all arrive (or load) within this fail instead of hanging


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (pickled once, at spawn)."""

    rank: int
    size: int
    init_method: str
    source: ModelSource
    config: EngineConfig
    max_model_len: int
    channel: StepChannel  # the step buffer, in shared memory, and the workers' semaphores
    threads: int  # torch intra-op threads on the CPU
    shm_buffers: ShmBuffers | None = None  # the CPU's shared-memory all-reduce, when used
    shared_device: bool = False  # every rank on GPU 0, over gloo (SHARED_DEVICE_ENV)
    environ: dict[str, str] | None = None  # rank 0's environment at the start (the forkserver's may be older)
    lifeline: Connection | None = None  # the read end of a pipe only rank 0 holds open for writing


def worker_context() -> ForkServerContext:
    """The workers' start method: forkserver, its server started with torch and this module imported (once per
    rank-0 process, at its first group), so a worker starts as a fork of it in milliseconds instead of a spawned
    interpreter importing them again. The server imports nothing that starts a thread or touches CUDA."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def cpu_threads_per_rank(size: int, total: int | None = None) -> int:
    """Each rank's even share of the CPU threads (at least one)."""
    return max(1, (total or torch.get_num_threads()) // size)


def start_tensor_parallel(
    source: ModelSource,
    config: EngineConfig,
    max_model_len: int,
    on_lost: Callable[[int, int | None], None] | None = None,
) -> tuple[LoadedModel, WorkerGroup]:
    """Spawn the workers of a `config.tensor_parallel_size` group, load rank 0's shards beside theirs and return
    rank 0's model with the running group. A worker that fails to start or load makes this raise (and stops the
    others); so does a tensor-parallel engine already running in this process (torch.distributed's one default
    group). `on_lost(rank, exit status)` replaces the default reaction to a worker lost later (module doc)."""
    size = config.tensor_parallel_size
    model = source.config
    if model.encoder:
        raise ValueError(f"--tensor-parallel-size {size}: an encoder model runs on one device (it is small and pools)")
    attending = [i for i in range(model.num_hidden_layers) if not model.is_recurrent_layer(i)]
    query_heads = sorted({model.layer_q_heads(i) for i in attending})  # (Laguna's differ by layer)
    check_shardable(query_heads, model.num_key_value_heads, model.mlp_widths, size)
    refuse_unserved(source, config)  # here, not in each rank: a worker that refuses mid-join fails rank 0's join
    if model.recurrent is not None:
        model.recurrent.sharded(size)  # its heads (or channels) split too
    device = resolve_device(config.device)
    shared = device.type == "cuda" and os.environ.get(SHARED_DEVICE_ENV) == "1"
    if device.type == "cuda" and not shared and torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; this host has {torch.cuda.device_count()}")
    if torch.distributed.is_initialized():
        raise ValueError(
            f"--tensor-parallel-size {size}: this process already runs a tensor-parallel engine (one process group "
            "per process): close it first"
        )
    threads = cpu_threads_per_rank(size)
    process_threads = torch.get_num_threads()  # this process's own, given back when the group stops
    if device.type == "cpu":
        torch.set_num_threads(threads)
    sched = config.scheduler
    blocks_per_seq = -(-max_model_len // config.cache.block_size) + 1
    shm_buffers = None
    if device.type == "cpu" and supported() and os.environ.get(CPU_ALL_REDUCE_ENV, "shm") != "gloo":
        capacity = reduce_capacity(sched.max_num_batched_tokens, source.config.hidden_size)
        shm_buffers = ShmAllReduce.allocate(size, capacity)
    rendezvous = Path(tempfile.mkdtemp(prefix="ladle-tp-"))
    init_method = f"file://{rendezvous / 'store'}"
    context = worker_context()
    step_capacity = buffer_capacity(sched.max_num_batched_tokens, sched.max_num_seqs, blocks_per_seq)
    channel = StepChannel.open(step_capacity, size - 1, context)
    processes: list[BaseProcess] = []
    lifeline, lifeline_end = context.Pipe(duplex=False)
    for rank in range(1, size):
        spec = WorkerSpec(rank, size, init_method, source, config, max_model_len, channel, threads, shm_buffers, shared,
                          dict(os.environ), lifeline)  # fmt: skip
        process = context.Process(target=_worker_main, args=(spec,), name=f"ladle-tp-worker-{rank}", daemon=True)
        process.start()
        processes.append(process)
    lifeline.close()  # the workers have their copies; rank 0 keeps the writing end until the group stops
    group = WorkerGroup(processes, rendezvous, process_threads, lifeline_end)
    # From now on: a worker that dies (while loading, too) stops the engine rather than leaving rank 0 waiting.
    group.watch(on_lost or _exit_on_loss)
    try:
        tp = init_tensor_parallel(
            0, size, init_method, _rank_device(device, 0, shared), JOIN_TIMEOUT, shm_buffers, _backend(shared)
        )
        group.tp = tp
        loaded = load_model(source, config, max_model_len, tp)
    except BaseException:
        group.stop()
        raise
    # On CUDA a step's pending token ids go device to device (NCCL); on the CPU through the step buffer. Images'
    # embeddings always go by the broadcast.
    group.sender = StepSender(channel, tp.broadcast_from_driver_tensor, pending_on_device=device.type == "cuda")
    all_reduce = "shared memory" if tp.shm_reduce is not None else ("nccl" if tp.capturable else "gloo")
    log.info("tensor parallelism ready", size=size, device=device.type, threads=threads, all_reduce=all_reduce)
    return loaded, group


class WorkerGroup:
    """Rank 0's handle on its workers: `sender` feeds them steps; `stop` ends them (idempotent) and gives this
    process back the CPU threads it had before the group took its share."""

    def __init__(
        self, processes: list[BaseProcess], rendezvous: Path, process_threads: int, lifeline: Connection | None = None
    ) -> None:
        self.processes = processes
        self._lifeline = lifeline
        self._process_threads = process_threads
        self.sender: StepSender | None = None
        self.tp: TensorParallel | None = None
        self._rendezvous = rendezvous
        self._stopping = threading.Event()
        self._on_lost: Callable[[int, int | None], None] | None = None

    def watch(self, on_lost: Callable[[int, int | None], None]) -> None:
        """Call `on_lost(rank, exit status)` (on a watcher thread) if a worker exits before `stop`."""
        self._on_lost = on_lost

        def run() -> None:
            wait([process.sentinel for process in self.processes])
            self.check()

        threading.Thread(target=run, name="tp-worker-watch", daemon=True).start()

    def check(self) -> None:
        """Run `on_lost` now if a worker has exited before `stop` (the engine core calls it when a step fails: a
        collective with a dead rank fails, and that is the loss, not a failed step).

        A worker counts as gone once its sentinel is ready (the process has closed it: it is exiting), and it is
        then reaped: `is_alive` alone can still say True in the moment between the two."""
        if self._stopping.is_set() or self._on_lost is None:
            return
        ready = set(wait([process.sentinel for process in self.processes], timeout=0))
        for rank, process in enumerate(self.processes, start=1):
            if process.sentinel in ready:
                process.join(1.0)
                shutil.rmtree(self._rendezvous, ignore_errors=True)  # on_lost ends the process: nothing else will
                self._on_lost(rank, process.exitcode)
                return

    def on_lost(self, callback: Callable[[int, int | None], None]) -> None:
        """Replace what happens when a worker is lost (the server's: report, fail the calls, then exit). The
        callback runs on the watcher thread (or the core thread) and must end the process itself."""
        self._on_lost = callback

    def stop(self) -> None:
        """Tell the workers to stop (when the group is up), wait up to STOP_WAIT_S, kill what is left, leave the
        group and remove the rendezvous."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.sender is not None and all(process.is_alive() for process in self.processes):
            try:
                self.sender.stop(timeout=STOP_WAIT_S)
            except RuntimeError as exc:  # a worker went meanwhile
                log.warning("tensor-parallel stop message failed", error=str(exc))
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()
        if self._lifeline is not None:
            self._lifeline.close()
        if self.tp is not None:
            destroy_tensor_parallel(self.tp)
        shutil.rmtree(self._rendezvous, ignore_errors=True)
        torch.set_num_threads(self._process_threads)  # rank 0 ran on its share of them (an offline LLM lives on)

    def kill(self) -> None:
        """SIGKILL every worker still running and reap it."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(1.0)


def _exit_on_loss(rank: int, exitcode: int | None) -> None:
    log.error("a tensor-parallel worker is gone: the engine stops", rank=rank, exit_status=exitcode)
    os._exit(1)  # the other workers see rank 0 go and leave too


def _rank_device(device: torch.device, rank: int, shared: bool) -> torch.device:
    """Rank `rank`'s device: GPU `rank` on CUDA (GPU 0 for every rank when they share it), else `device`."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", 0 if shared else rank)


def _backend(shared: bool) -> str | None:
    """The group's backend: gloo for ranks sharing a GPU; else None, the device's own (NCCL on CUDA)."""
    return "gloo" if shared else None


def _watch_rank0(lifeline: Connection, rendezvous: Path) -> None:
    """Leave (exit status 1) as soon as rank 0 is gone: the lifeline reads end-of-file when its only writer, rank 0,
    closes it or dies (a worker's parent is the forkserver, which outlives rank 0 while workers live). The first
    worker to notice removes the rendezvous folder, which rank 0 no longer can."""
    try:
        while True:
            lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    shutil.rmtree(rendezvous, ignore_errors=True)
    os._exit(1)


@torch.inference_mode()
def _worker_main(spec: WorkerSpec) -> None:
    """A worker process: join, load this rank's shards, then run rank 0's steps until STOP (module doc)."""
    if spec.environ is not None:
        os.environ.clear()
        os.environ.update(spec.environ)
    rendezvous = Path(spec.init_method.removeprefix("file://")).parent
    if spec.lifeline is not None:
        args = (spec.lifeline, rendezvous)
        threading.Thread(target=_watch_rank0, args=args, name="tp-rank0-watch", daemon=True).start()
    device = _rank_device(resolve_device(spec.config.device), spec.rank, spec.shared_device)
    if device.type == "cpu":
        torch.set_num_threads(spec.threads)
    tp = init_tensor_parallel(
        spec.rank, spec.size, spec.init_method, device, JOIN_TIMEOUT, spec.shm_buffers, _backend(spec.shared_device)
    )
    try:
        loaded = load_model(spec.source, spec.config, spec.max_model_len, tp)
        receiver = StepReceiver(spec.channel, spec.rank, loaded.device, tp.broadcast_from_driver_tensor, loaded.dtype)
        _serve_steps(loaded, receiver)
    finally:
        destroy_tensor_parallel(tp)


def _serve_steps(loaded: LoadedModel, receiver: StepReceiver) -> None:
    """The worker's loop: rank 0's forwards over this rank's KV cache (eager, or replaying this rank's decode
    graph of the bucket rank 0 replays), and its share of their logits."""
    model, kv_caches, graphs = loaded.model, loaded.kv_caches, loaded.decode_graphs
    assert isinstance(model, CausalLM)  # encoders are refused before any worker starts
    hidden: torch.Tensor | None = None
    while True:
        message = receiver.receive()
        if message.kind is MessageKind.FORWARD:
            inputs = message.forward
            assert inputs is not None
            hidden = model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)
        elif message.kind is MessageKind.DECODE_GRAPH:
            step = message.decode
            assert step is not None
            if graphs is None or graphs.bucket_for(len(step.layout.seq_lens)) != step.bucket:
                raise RuntimeError(f"rank 0 replays its decode graph of {step.bucket} rows, which this rank lacks")
            hidden = graphs.run_layout(step.input_ids, step.layout, position_shifts=step.position_shifts)
        elif message.kind is MessageKind.LOGITS:
            if hidden is None:
                raise RuntimeError("rank 0 asked for logits before any forward pass")
            rows = hidden if message.rows is None else hidden.index_select(0, message.rows)
            model.sharded_logits(rows)
        elif message.kind is MessageKind.CAPTURE:
            graphs = capture_decode_graphs(loaded, EagerCapture() if message.eager else CudaGraphCapture())
        else:
            return
