"""The step channel between two processes: each message rank 0 sends is what a worker receives, woken by its
semaphore (no process group needed), and the worker waits blocked, not spinning, between messages."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.queues import Queue
from typing import Any

import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.parallel.step_channel import MessageKind, StepChannel, StepReceiver, StepSender


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
        elif message.kind is MessageKind.LOGITS:
            results.put(("logits", None if message.rows is None else message.rows.tolist()))
        else:
            results.put(("stop", time.process_time() - started))
            return


def test_messages_arrive_as_sent_and_the_worker_waits_without_spinning() -> None:
    context = mp.get_context("spawn")
    channel = StepChannel.open(capacity=256, num_workers=1, context=context)
    results: Queue[Any] = context.Queue()
    worker = context.Process(target=_worker, args=(channel, results), daemon=True)
    worker.start()
    sender = StepSender(channel)
    try:
        meta = AttentionMetadata.build([3, 1], [3, 7], [[4], [0, 2]], block_size=4, device="cpu")
        sender.forward(torch.tensor([11, 12, 13, 14]), torch.tensor([0, 1, 2, 6]), meta)
        assert results.get(timeout=60) == (
            "forward", [11, 12, 13, 14], [0, 1, 2, 6], [3, 1], [3, 7], [[4, 0], [0, 2]], [16, 17, 18, 10]
        )  # fmt: skip
        sender.logits(torch.tensor([2, 3]))
        assert results.get(timeout=10) == ("logits", [2, 3])
        time.sleep(1.0)  # the worker waits here for the next message
        sender.logits(None)
        assert results.get(timeout=10) == ("logits", None)
        sender.stop()
        kind, cpu_seconds = results.get(timeout=10)
        assert kind == "stop" and cpu_seconds < 0.5  # blocked on its semaphore for the second above, not spinning
    finally:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0
