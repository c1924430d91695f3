"""How a step's inputs reach the tensor-parallel workers: a shared-memory buffer and one small broadcast.

Rank 0 (the driver) writes a message's payload, int64 values only, into a buffer in shared memory that every rank
maps (a torch tensor moved to shared memory before the workers are spawned, so nothing is pickled per step), then
broadcasts a fixed 16-value header over the group's control group (gloo): the broadcast is both the signal and
what says how to read the buffer. A worker copies what it needs out of the buffer before its first collective of
that message.

That ordering is what makes one buffer enough: every message is followed by at least one collective among all
ranks (a forward's all-reduces, the logits' gather), which the driver cannot finish before each worker joins it,
i.e. before each worker has copied the payload; so the driver never overwrites a payload a worker still reads.

Messages:
- FORWARD: the model's inputs for one step: input ids, positions and the attention metadata.
- LOGITS: which rows of that forward's hidden states sample (or all of them); every rank computes its vocab
  slice of their logits and they are gathered to rank 0.
- STOP: the worker leaves its loop (the engine is shutting down).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine_server.attention_metadata import AttentionMetadata
from engine_server.parallel.group import TensorParallel
from engine_server.transfer import to_device

_HEADER = 16
_ALL_ROWS = -1


class MessageKind(enum.IntEnum):
    FORWARD = 1
    LOGITS = 2
    STOP = 3


def buffer_capacity(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> int:
    """int64 values the buffer must hold for the largest step: 3 per token (ids, positions, slots), 2 per
    sequence and 1 (query starts, lengths), and a full block table per sequence; or one logits row per token."""
    return 3 * max_tokens + 2 * max_seqs + 1 + max_seqs * (max_blocks_per_seq + 1)


def shared_buffer(capacity: int) -> torch.Tensor:
    """The message buffer, in shared memory: hand it to the workers when they are spawned."""
    return torch.zeros(capacity, dtype=torch.int64).share_memory_()


@dataclass(frozen=True)
class ForwardInputs:
    """A FORWARD message as a worker rebuilds it, on its device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass(frozen=True)
class Message:
    """A received message: FORWARD carries `forward`; LOGITS carries `rows` (None: every row)."""

    kind: MessageKind
    forward: ForwardInputs | None = None
    rows: torch.Tensor | None = None


def _control(tp: TensorParallel) -> dist.ProcessGroup:
    group = tp.control_group
    if group is None:
        raise ValueError("a step channel needs a tensor-parallel group of more than one rank")
    return group


class StepSender:
    """Rank 0's end: `forward` before each forward pass, `logits` before each `compute_logits`, `stop` once."""

    def __init__(self, tp: TensorParallel, buffer: torch.Tensor) -> None:
        self._group = _control(tp)
        self._buffer = buffer
        self._header = torch.zeros(_HEADER, dtype=torch.int64)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Send the step's model inputs (any device; copied to the host buffer)."""
        tokens, batch = input_ids.shape[0], meta.seq_lens.shape[0]
        width = meta.block_tables.shape[1]
        parts = (input_ids, positions, meta.query_start_loc, meta.seq_lens, meta.block_tables.reshape(-1),
                 meta.slot_mapping)  # fmt: skip
        total = 3 * tokens + 2 * batch + 1 + batch * width
        self._check_fits(total)
        offset = 0
        for part in parts:
            n = part.numel()
            self._buffer[offset : offset + n].copy_(part)
            offset += n
        self._send(MessageKind.FORWARD, tokens, batch, width, meta.max_query_len, meta.max_seq_len, meta.block_size)

    def logits(self, rows: torch.Tensor | None) -> None:
        """Send which rows of the last forward's hidden states sample: `rows` (int64 indices), None for all."""
        if rows is None:
            self._send(MessageKind.LOGITS, _ALL_ROWS)
            return
        self._check_fits(rows.numel())
        self._buffer[: rows.numel()].copy_(rows)
        self._send(MessageKind.LOGITS, rows.numel())

    def stop(self) -> None:
        self._send(MessageKind.STOP)

    def _check_fits(self, values: int) -> None:
        if values > self._buffer.numel():
            raise RuntimeError(
                f"a tensor-parallel step needs {values} int64 values, more than the step buffer's "
                f"{self._buffer.numel()} (sized from max_num_batched_tokens, max_num_seqs and max_model_len)"
            )

    def _send(self, kind: MessageKind, *fields: int) -> None:
        self._header.zero_()
        self._header[0] = int(kind)
        self._header[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
        dist.broadcast(self._header, src=0, group=self._group)


class StepReceiver:
    """A worker's end: `receive` blocks until rank 0 sends the next message."""

    def __init__(self, tp: TensorParallel, buffer: torch.Tensor, device: torch.device) -> None:
        self._group = _control(tp)
        self._src = dist.get_global_rank(self._group, 0)
        self._buffer = buffer
        self._device = device
        self._header = torch.zeros(_HEADER, dtype=torch.int64)

    def receive(self) -> Message:
        dist.broadcast(self._header, src=self._src, group=self._group)
        kind = MessageKind(int(self._header[0]))
        fields = self._header[1:].tolist()
        if kind is MessageKind.FORWARD:
            return Message(kind, forward=self._forward(*fields[:6]))
        if kind is MessageKind.LOGITS:
            count = fields[0]
            rows = None if count == _ALL_ROWS else to_device(self._buffer[:count].clone(), self._device)
            return Message(kind, rows=rows)
        return Message(kind)

    def _forward(
        self, tokens: int, batch: int, width: int, max_query_len: int, max_seq_len: int, block_size: int
    ) -> ForwardInputs:
        sizes = [tokens, tokens, batch + 1, batch, batch * width, tokens]
        ids, positions, starts, seq_lens, tables, slots = self._buffer[: sum(sizes)].clone().split(sizes)
        device = self._device
        return ForwardInputs(
            input_ids=to_device(ids, device),
            positions=to_device(positions, device),
            meta=AttentionMetadata(
                query_start_loc=to_device(starts, device, torch.int32),
                seq_lens=to_device(seq_lens, device, torch.int32),
                block_tables=to_device(tables.view(batch, width), device, torch.int32),
                slot_mapping=to_device(slots, device),
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                query_lens_cpu=starts.diff().tolist(),
                seq_lens_cpu=seq_lens.tolist(),
                block_size=block_size,
            ),
        )
