"""The step channel between two processes: each message rank 0 sends is what a worker receives, woken by its
semaphore (no process group needed), and the worker waits blocked, not spinning, between messages. A step's
pending input tokens (sampled by the last launch, not on the host yet) reach the worker through the buffer, or,
where the model is on a device, through the group's broadcast (run here on gloo with host tensors: the same
messages and collective order as NCCL's device-to-device broadcast on CUDA). A step's images travel as integers (their
rows, M-RoPE's positions, two-way image blocks, decode rows' position shifts) and, through the broadcast, as floats
(the encoder's rows)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_server.attention_metadata import AttentionMetadata, DecodeLayout
from engine_server.layers.image_blocks import ImageBlock
from engine_server.parallel.group import destroy_tensor_parallel, init_tensor_parallel
from engine_server.parallel.step_channel import (
    SLOTS,
    MessageKind,
    PendingTokens,
    StepChannel,
    StepReceiver,
    StepSender,
)
from engine_server.workers import worker_context


def _worker(channel: StepChannel, results: Queue[Any]) -> None:
    receiver = StepReceiver(channel, 1, torch.device("cpu"))
    started = time.process_time()
    while True:
        message = receiver.receive()
        if message.kind is MessageKind.FORWARD:
            assert message.forward is not None
            inputs = message.forward
            meta = inputs.meta
            results.put(("forward", inputs.input_ids.tolist(), inputs.positions.tolist(), meta.query_lens_cpu,
                         meta.seq_lens_cpu, meta.block_tables.tolist(), meta.slot_mapping.tolist()))  # fmt: skip
            if meta.mrope_positions is not None or meta.image_blocks:
                mrope = None if meta.mrope_positions is None else meta.mrope_positions.tolist()
                results.put(("images", mrope, meta.image_blocks))
        elif message.kind is MessageKind.DECODE_GRAPH:
            assert message.decode is not None
            step = message.decode
            layout = step.layout
            results.put(("decode_graph", step.input_ids.tolist(), layout.seq_lens.tolist(),
                         layout.block_tables.tolist(), str(layout.block_tables.dtype), layout.slots.tolist(),
                         step.bucket))  # fmt: skip
            if step.position_shifts is not None:
                results.put(("shifts", step.position_shifts.tolist()))
        elif message.kind is MessageKind.LOGITS:
            results.put(("logits", None if message.rows is None else message.rows.tolist()))
        elif message.kind is MessageKind.CAPTURE:
            results.put(("capture", message.eager))
        else:
            results.put(("stop", time.process_time() - started))
            return


@contextlib.contextmanager
def _forked(
    target: Callable[[StepChannel, Queue[Any]], None], capacity: int
) -> Iterator[tuple[StepChannel, Queue[Any], BaseProcess]]:
    """A channel to one worker running `target(channel, results)`, forked as the engine's workers are; joined (or
    killed) on the way out."""
    context = worker_context()
    channel = StepChannel.open(capacity=capacity, num_workers=1, context=context)
    results: Queue[Any] = context.Queue()
    worker = context.Process(target=target, args=(channel, results), daemon=True)
    worker.start()
    try:
        yield channel, results, worker
    finally:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()


def test_messages_arrive_as_sent_and_the_worker_waits_without_spinning() -> None:
    with _forked(_worker, capacity=256) as (channel, results, worker):
        sender = StepSender(channel)
        meta = AttentionMetadata.build([3, 1], [3, 7], [[4], [0, 2]], block_size=4, device="cpu")
        sender.forward(torch.tensor([11, 12, 13, 14]), torch.tensor([0, 1, 2, 6]), meta)
        assert results.get(timeout=60) == (
            "forward", [11, 12, 13, 14], [0, 1, 2, 6], [3, 1], [3, 7], [[4, 0], [0, 2]], [16, 17, 18, 10]
        )  # fmt: skip
        decode = AttentionMetadata.build([1, 1], [4, 8], [[4], [0, 2]], block_size=4, device="cpu")
        pending = PendingTokens(torch.tensor([1]), torch.tensor([99]))  # row 1's token is the last launch's
        sender.forward(torch.tensor([21, 0]), torch.tensor([3, 7]), decode, pending)
        assert results.get(timeout=10) == ("forward", [21, 99], [3, 7], [1, 1], [4, 8], [[4, 0], [0, 2]], [19, 11])
        # A decode step replayed from the graphs of 4 rows: the layout as the host built it (tables padded with -1).
        layout = DecodeLayout.build([4, 8, 2], [[4], [0, 2], [5]], block_size=4)
        row_1 = PendingTokens(torch.tensor([1]), torch.tensor([98]))
        sender.decode_graph(torch.tensor([31, 0, 33]), layout, 4, row_1)
        assert results.get(timeout=10) == (
            "decode_graph", [31, 98, 33], [4, 8, 2], [[4, -1], [0, 2], [5, -1]], "int32", [19, 11, 21], 4
        )  # fmt: skip
        # Images' integers: M-RoPE's positions, an image whose tokens attend both ways; decode rows' shifts.
        images = AttentionMetadata.build([3, 1], [3, 7], [[4], [0, 2]], block_size=4, device="cpu")
        images.mrope_positions = torch.tensor([[0, 1, 1, 6], [0, 1, 2, 6], [0, 2, 1, 6]])
        images.image_blocks = [ImageBlock(0, 1, 1, 2, 3)]
        sender.forward(torch.tensor([11, 12, 13, 14]), torch.tensor([0, 1, 2, 6]), images)
        assert results.get(timeout=10)[0] == "forward"
        assert results.get(timeout=10) == ("images", images.mrope_positions.tolist(), images.image_blocks)
        sender.decode_graph(torch.tensor([31, 32, 33]), layout, 4, position_shifts=np.array([-5, 0, 2]))
        assert results.get(timeout=10)[0] == "decode_graph"
        assert results.get(timeout=10) == ("shifts", [-5, 0, 2])
        sender.capture(eager=True)
        assert results.get(timeout=10) == ("capture", True)
        sender.logits(torch.tensor([2, 3]))
        assert results.get(timeout=10) == ("logits", [2, 3])
        time.sleep(1.0)  # the worker waits here for the next message
        sender.logits(None)
        assert results.get(timeout=10) == ("logits", None)
        sender.stop()
        kind, cpu_seconds = results.get(timeout=10)
        assert kind == "stop" and cpu_seconds < 0.5  # blocked on its semaphore for the second above, not spinning
    assert worker.exitcode == 0


def _slow_reader(channel: StepChannel, results: Queue[Any]) -> None:
    time.sleep(1.0)  # rank 0 sends on meanwhile, as NCCL lets it (its collectives do not wait for this rank)
    receiver = StepReceiver(channel, 1, torch.device("cpu"))
    while (message := receiver.receive()).kind is MessageKind.LOGITS:
        results.put(None if message.rows is None else message.rows.tolist())
    results.put("stop")


def test_rank_0_writes_a_slot_again_only_once_the_worker_has_read_it() -> None:
    with _forked(_slow_reader, capacity=64) as (channel, results, _):
        sender = StepSender(channel)
        waits = []
        for i in range(2 * SLOTS + 1):
            started = time.monotonic()
            sender.logits(torch.tensor([i, i + 100]))
            waits.append(time.monotonic() - started)
        sender.stop()
        assert [results.get(timeout=60) for _ in range(2 * SLOTS + 2)] == [
            *([i, i + 100] for i in range(2 * SLOTS + 1)),
            "stop",
        ]  # every message as sent, none overwritten before it was read
        assert max(waits[:SLOTS]) < 0.5 <= waits[SLOTS]  # the first messages fill the slots; the next one waits


def _broadcast_rank(rank: int, channel: StepChannel, init_method: str, results: Queue[Any]) -> None:
    """Rank `rank` of a 2-rank gloo group: rank 0 sends two steps with pending tokens through the broadcast."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, init_method, torch.device("cpu"))
    try:
        meta = AttentionMetadata.build([1, 1, 1], [2, 5, 9], [[3], [1, 6], [2, 4, 7]], block_size=4, device="cpu")
        if rank == 0:
            sender = StepSender(channel, tp.broadcast_from_driver_tensor)
            sender.forward(torch.zeros(3, dtype=torch.int64), torch.tensor([1, 4, 8]), meta,
                           PendingTokens(torch.tensor([0, 1, 2]), torch.tensor([70, 71, 72])))  # fmt: skip
            sender.forward(torch.tensor([5, 0, 6]), torch.tensor([1, 4, 8]), meta,
                           PendingTokens(torch.tensor([1]), torch.tensor([80])))  # fmt: skip
            layout = DecodeLayout.build([2, 5, 9], [[3], [1, 6], [2, 4, 7]], block_size=4)
            sender.decode_graph(torch.zeros(3, dtype=torch.int64), layout, 4,
                                PendingTokens(torch.tensor([0, 1, 2]), torch.tensor([90, 91, 92])))  # fmt: skip
            # A step with images: their rows' embeddings after the pending values, both by the broadcast.
            meta.image_embeds = (torch.tensor([0, 2]), torch.tensor([[0.5, -1.0, 2.0], [3.0, 4.5, -6.0]]))
            sender.forward(torch.zeros(3, dtype=torch.int64), torch.tensor([1, 4, 8]), meta,
                           PendingTokens(torch.tensor([2]), torch.tensor([60])))  # fmt: skip
            sender.stop()
            return
        receiver = StepReceiver(channel, 1, torch.device("cpu"), tp.broadcast_from_driver_tensor)
        while (message := receiver.receive()).kind is not MessageKind.STOP:
            if message.decode is not None:
                results.put((message.decode.input_ids.tolist(), message.decode.layout.slots.tolist()))
            else:
                assert message.forward is not None
                results.put((message.forward.input_ids.tolist(), message.forward.meta.slot_mapping.tolist()))
                if message.forward.meta.image_embeds is not None:
                    results.put(tuple(part.tolist() for part in message.forward.meta.image_embeds))
    finally:
        destroy_tensor_parallel(tp)


def test_pending_tokens_go_through_the_groups_broadcast_where_the_model_is_on_a_device(tmp_path: Path) -> None:
    context = worker_context()
    channel = StepChannel.open(capacity=256, num_workers=1, context=context)
    results: Queue[Any] = context.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    ranks = [context.Process(target=_broadcast_rank, args=(rank, channel, init_method, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        assert results.get(timeout=60) == ([70, 71, 72], [13, 24, 28])
        assert results.get(timeout=10) == ([5, 80, 6], [13, 24, 28])
        assert results.get(timeout=10) == ([90, 91, 92], [13, 24, 28])
        assert results.get(timeout=10) == ([0, 0, 60], [13, 24, 28])
        assert results.get(timeout=10) == ([0, 2], [[0.5, -1.0, 2.0], [3.0, 4.5, -6.0]])
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
