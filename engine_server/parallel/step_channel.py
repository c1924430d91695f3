"""How a step's inputs reach the tensor-parallel workers: shared-memory slots and two semaphores per worker.

Rank 0 (the driver) writes a message, int64 values only, into a slot of a buffer in shared memory that every
rank maps (a torch tensor moved to shared memory before the workers are spawned, so nothing is pickled per step):
a fixed 16-value header (what the message is and how to read it) and its payload. Then it releases each worker's
signal semaphore: a worker waits on its own (blocked in the kernel, not spinning, so it leaves its cores to the
ranks that compute), reads the header, copies what it needs out of the slot and releases its ack semaphore. A
semaphore's release and acquire order the memory writes before them for the other process: a message reaches a
worker in ~20-30 µs where the gloo broadcast of its header took ~550 µs, twice a step (2-core CPU, `python -m
benchmarks.tp_step_channel`, benchmarks/results/tp_step_channel_cpu.jsonl).

Messages take the SLOTS slots in turn, and rank 0 writes into a slot only once every worker has acknowledged the
message that was there. On the CPU a collective blocks the host until every rank joins it, so the acks are always
there already; NCCL's do not (they are queued on the device), and rank 0's host may run a step or more ahead of
a worker's: without the acks it could overwrite a message the worker has not read yet.

Messages:
- FORWARD: the model's inputs for one step: input ids, positions and the attention metadata (a hybrid's state
  slots included: -1 for a model without them), all as the host built them (the metadata's host copies: nothing is
  copied back from the device, which on CUDA would wait for the steps queued before). Input ids that the previous
  launch sampled and the host does not have yet (async scheduling: `PendingTokens`) travel as their rows, and their
  values go device to device, broadcast from rank 0 over the model's group (NCCL on CUDA) right after the message,
  so neither side waits for them on the host; values already on the host (the CPU) go in the buffer. A step that
  computes prompt tokens of images (`engine_server.multimodal`) carries their metadata too: the rows that take an
  image's embeddings, M-RoPE's 3-D positions, the images whose tokens attend both ways (`ImageBlock`'s integers);
  the embeddings themselves (floats) follow by the group's broadcast, after the pending values.
- DECODE_GRAPH: a decode step (one new token per row) that every rank runs by replaying its own captured graph
  of the bucket named (engine_server.cuda_graphs): the rows' input ids, sequence lengths, block tables and slots,
  as the host built them, and their rope positions' shifts where rows have them (M-RoPE's delta after images);
  pending tokens as for FORWARD. The graphs' all-reduces are inside them, so each rank's
  replay meets the others' as an eager forward's collectives do.
- LOGITS: which rows of that forward's hidden states sample (or all of them); every rank computes its vocab
  slice of their logits and they are gathered to rank 0.
- CAPTURE: record the decode graphs now (with the eager stand-in where the header says so), as rank 0 does beside
  them: every rank warms up and records the same buckets in the same order, so their collectives match.
- STOP: the worker leaves its loop (the engine is shutting down).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.synchronize import Semaphore
from typing import Any

import numpy as np
import torch

from engine_server.attention_metadata import AttentionMetadata, DecodeLayout
from engine_server.core.scheduler_output import StateCopies
from engine_server.layers.image_blocks import ImageBlock
from engine_server.transfer import to_device

_HEADER = 16
_ALL_ROWS = -1
SLOTS = 2  # messages in flight: one a worker may still be reading while rank 0 writes the next
ACK_TIMEOUT_S = 300.0  # a worker that has not read a message for this long has stopped (the step fails)

Broadcast = Callable[[torch.Tensor], torch.Tensor]
"""Rank 0's tensor into every rank's tensor of the same shape, in place, over the model's group (a collective)."""


class MessageKind(enum.IntEnum):
    FORWARD = 1
    LOGITS = 2
    STOP = 3
    DECODE_GRAPH = 4
    CAPTURE = 5


_IMAGE_BLOCK = 5  # an `ImageBlock`'s integers


def buffer_capacity(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> int:
    """int64 values the buffer must hold for the largest step: 5 per token (ids, positions, slots, and a pending
    token's row and value), 2 per sequence and 1 (query starts, lengths), a full block table and a state slot per
    sequence, and 4 per sequence for a hybrid's state copies (a restore's rows and a save's); for images 4 more per
    token (an image row, M-RoPE's 3 positions) and an image block's 5 (an image takes at least a token); or one
    logits row per token."""
    images = (4 + _IMAGE_BLOCK) * max_tokens
    return 5 * max_tokens + 2 * max_seqs + 1 + max_seqs * (max_blocks_per_seq + 1) + 4 * max_seqs + images


@dataclass(frozen=True)
class StepChannel:
    """The channel's shared parts, handed to the workers when they are spawned: the buffer (in shared memory;
    `[SLOTS, header + payload]`), and per worker a semaphore that signals a message (`signals[rank - 1]`) and one
    that acknowledges it (`acks[rank - 1]`)."""

    buffer: torch.Tensor
    signals: Sequence[Semaphore]
    acks: Sequence[Semaphore]

    @classmethod
    def open(cls, capacity: int, num_workers: int, context: SpawnContext | ForkServerContext) -> StepChannel:
        """A channel for payloads of up to `capacity` int64 values, to `num_workers` workers spawned by `context`."""
        buffer = torch.zeros(SLOTS, _HEADER + capacity, dtype=torch.int64).share_memory_()
        signals = [context.Semaphore(0) for _ in range(num_workers)]
        return cls(buffer, signals, [context.Semaphore(0) for _ in range(num_workers)])


@dataclass(frozen=True)
class PendingTokens:
    """A step's input tokens that the previous launch sampled and the host does not have yet: `rows` (a host
    int64 tensor) of the step's input ids, and `values`, their ids where they are (that launch's device tensor)."""

    rows: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class ForwardInputs:
    """A FORWARD message as a worker rebuilds it, on its device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass(frozen=True)
class DecodeGraphInputs:
    """A DECODE_GRAPH message as a worker rebuilds it: the rows' input ids on its device (pending ones in place),
    their layout on the host, the bucket rank 0 replays, and each row's rope position shift (None: none)."""

    input_ids: torch.Tensor
    layout: DecodeLayout
    bucket: int
    position_shifts: np.ndarray[Any, np.dtype[np.int64]] | None = None


@dataclass(frozen=True)
class Message:
    """A received message: FORWARD carries `forward`; DECODE_GRAPH `decode`; LOGITS `rows` (None: every row);
    CAPTURE `eager` (record with the eager stand-in, not CUDA graphs)."""

    kind: MessageKind
    forward: ForwardInputs | None = None
    decode: DecodeGraphInputs | None = None
    rows: torch.Tensor | None = None
    eager: bool = False


class StepSender:
    """Rank 0's end: `forward` before each forward pass, `logits` before each `compute_logits`, `stop` once.

    `broadcast` is rank 0's end of the model group's broadcast; the workers' `StepReceiver`s must be given the same
    collective. Images' embeddings always go through it. Pending token values go through it, device to device, where
    `pending_on_device` (by default: where a broadcast is given; the engine's: where the model is on a device, not the
    host); else through the buffer (copied to the host)."""

    def __init__(
        self, channel: StepChannel, broadcast: Broadcast | None = None, pending_on_device: bool | None = None
    ) -> None:
        self._slots = channel.buffer
        self._signals = list(channel.signals)
        self._acks = list(channel.acks)
        self._broadcast = broadcast
        self._pending_on_device = broadcast is not None if pending_on_device is None else pending_on_device
        if self._pending_on_device and broadcast is None:
            raise ValueError("pending token values go by broadcast only where the sender has one")
        self._sent = 0
        # The slot the next message goes to (`_claim`).
        self._header = self._slots[0, :_HEADER]
        self._buffer = self._slots[0, _HEADER:]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        pending: PendingTokens | None = None,
    ) -> None:
        """Send the step's model inputs: `input_ids` and `positions` as host tensors (the rows in `pending` may
        hold anything: the workers take those from `pending.values`), `meta` with its host copies where it has
        them (else its tensors are copied back from their device), its images' too (`image_embeds`' rows and
        embeddings, `mrope_positions`, `image_blocks`)."""
        self._claim()
        tokens, batch = input_ids.shape[0], len(meta.seq_lens_cpu)
        tables = meta.host_block_tables if meta.host_block_tables is not None else meta.block_tables
        slots = meta.host_slot_mapping if meta.host_slot_mapping is not None else meta.slot_mapping
        width = tables.shape[1]
        starts = torch.zeros(batch + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(meta.query_lens_cpu, dtype=torch.int64), 0, out=starts[1:])
        state_slots = (
            torch.full((batch,), -1, dtype=torch.int64) if meta.state_slots_cpu is None
            else torch.tensor(meta.state_slots_cpu, dtype=torch.int64)
        )  # fmt: skip
        copies = meta.state_copies
        restores, saves = (([], []), ([], [])) if copies is None else (copies.restores, copies.saves)
        copied = torch.tensor([*restores[0], *restores[1], *saves[0], *saves[1]], dtype=torch.int64)
        image_rows, embeds = (None, None) if meta.image_embeds is None else meta.image_embeds
        image_rows = meta.host_image_rows if meta.host_image_rows is not None else image_rows
        mrope = meta.host_mrope_positions if meta.host_mrope_positions is not None else meta.mrope_positions
        blocks = meta.image_blocks or []
        image_parts = [part for part in (image_rows, None if mrope is None else mrope.reshape(-1)) if part is not None]
        if blocks:
            image_parts.append(torch.tensor([[b.sequence, b.first_row, b.first_position, b.count, b.end]
                                             for b in blocks], dtype=torch.int64).reshape(-1))  # fmt: skip
        if embeds is not None and self._broadcast is None:
            raise RuntimeError("a step with images' embeddings needs the sender's broadcast to reach the workers")
        parts = [input_ids, positions, starts, torch.tensor(meta.seq_lens_cpu, dtype=torch.int64),
                 tables.reshape(-1), slots, state_slots, copied, *image_parts]  # (absent ones: their sizes are 0)
        num_pending, on_device = self._write(parts, pending)
        self._send(MessageKind.FORWARD, tokens, batch, width, meta.max_query_len, meta.max_seq_len, meta.block_size,
                   num_pending, int(on_device), int(meta.last_rows_only), len(restores[0]), len(saves[0]),
                   0 if image_rows is None else image_rows.numel(), 0 if embeds is None else embeds.shape[1],
                   int(mrope is not None), len(blocks))  # fmt: skip
        self._send_pending(pending, on_device)
        if embeds is not None:
            assert self._broadcast is not None
            self._broadcast(embeds.contiguous())

    def decode_graph(
        self,
        input_ids: torch.Tensor,
        layout: DecodeLayout,
        bucket: int,
        pending: PendingTokens | None = None,
        position_shifts: np.ndarray[Any, np.dtype[np.int64]] | None = None,
    ) -> None:
        """Send a decode step that every rank runs by replaying its graph of `bucket`: `input_ids` a host tensor
        `[B]` (the rows in `pending` may hold anything), `layout` the rows' host layout (block tables padded with
        -1), `position_shifts` each row's rope position past its token's index (None: none)."""
        self._claim()
        batch, width = len(layout.seq_lens), layout.block_tables.shape[1]
        parts = [input_ids, torch.from_numpy(layout.seq_lens), torch.from_numpy(layout.block_tables).reshape(-1),
                 torch.from_numpy(layout.slots)]  # fmt: skip
        if position_shifts is not None:
            parts.append(torch.from_numpy(position_shifts))
        num_pending, on_device = self._write(parts, pending)
        self._send(MessageKind.DECODE_GRAPH, batch, width, bucket, num_pending, int(on_device),
                   int(position_shifts is not None))  # fmt: skip
        self._send_pending(pending, on_device)

    def logits(self, rows: torch.Tensor | None) -> None:
        """Send which rows of the last forward's hidden states sample: `rows` (int64 indices), None for all."""
        self._claim()
        if rows is None:
            self._send(MessageKind.LOGITS, _ALL_ROWS)
            return
        self._check_fits(rows.numel())
        self._buffer[: rows.numel()].copy_(rows)
        self._send(MessageKind.LOGITS, rows.numel())

    def capture(self, eager: bool) -> None:
        """Have the workers record their decode graphs now (`eager`: with the eager stand-in), as rank 0 does next."""
        self._claim()
        self._send(MessageKind.CAPTURE, int(eager))

    def stop(self, timeout: float = ACK_TIMEOUT_S) -> None:
        """Tell the workers to leave; RuntimeError if one has not read its last message within `timeout` seconds."""
        self._claim(timeout)
        self._send(MessageKind.STOP)

    def _claim(self, timeout: float = ACK_TIMEOUT_S) -> None:
        """Point at the next message's slot, once every worker has acknowledged the message last written there.
        RuntimeError if one has not within `timeout` seconds."""
        if self._sent >= SLOTS:
            for rank, ack in enumerate(self._acks, start=1):
                if not ack.acquire(timeout=timeout):
                    raise RuntimeError(f"tensor-parallel worker {rank} has not read a step message in {timeout:.0f} s")
        slot = self._slots[self._sent % SLOTS]
        self._header, self._buffer = slot[:_HEADER], slot[_HEADER:]

    def _write(self, parts: list[torch.Tensor], pending: PendingTokens | None) -> tuple[int, bool]:
        """Write `parts` and `pending`'s rows (and its values, where they do not go by broadcast) into the buffer,
        one after the other; return (pending rows, whether their values go by broadcast)."""
        num_pending, on_device = 0, False
        if pending is not None:
            num_pending, on_device = pending.rows.numel(), self._pending_on_device
            parts = [*parts, pending.rows] if on_device else [*parts, pending.rows, pending.values]
        self._check_fits(sum(part.numel() for part in parts))
        offset = 0
        for part in parts:
            n = part.numel()
            self._buffer[offset : offset + n].copy_(part)
            offset += n
        return num_pending, on_device

    def _send_pending(self, pending: PendingTokens | None, on_device: bool) -> None:
        """After the message: the pending values by the model group's broadcast, when they go that way."""
        if on_device:
            assert pending is not None and self._broadcast is not None
            self._broadcast(pending.values.contiguous())

    def _check_fits(self, values: int) -> None:
        if values > self._buffer.numel():
            raise RuntimeError(
                f"a tensor-parallel step needs {values} int64 values, more than the step buffer's "
                f"{self._buffer.numel()} (sized from max_num_batched_tokens, max_num_seqs and max_model_len)"
            )

    def _send(self, kind: MessageKind, *fields: int) -> None:
        header = [int(kind), *fields]
        self._header.copy_(torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64))
        self._sent += 1
        for signal in self._signals:
            signal.release()


class StepReceiver:
    """A worker's end: `receive` blocks until rank 0 sends the next message. `broadcast` is the worker's end of
    the collective rank 0's `StepSender` was given; images' embeddings arrive through it in `image_dtype` (the
    model's: `multimodal.features.ImageFeatures` makes them so)."""

    def __init__(
        self, channel: StepChannel, rank: int, device: torch.device, broadcast: Broadcast | None = None,
        image_dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        self._slots = channel.buffer
        self._signal = channel.signals[rank - 1]
        self._ack = channel.acks[rank - 1]
        self._device = device
        self._broadcast = broadcast
        self._image_dtype = image_dtype
        self._received = 0
        self._buffer = self._slots[0, _HEADER:]  # the payload of the message being read

    def receive(self) -> Message:
        """The next message, copied out of its slot (which is acknowledged, so rank 0 may write there again)."""
        self._signal.acquire()
        slot = self._slots[self._received % SLOTS]
        self._received += 1
        header = slot[:_HEADER].tolist()
        self._buffer = slot[_HEADER:]
        message = self._parse(MessageKind(header[0]), header[1:])
        self._ack.release()
        return message

    def _parse(self, kind: MessageKind, fields: list[int]) -> Message:
        if kind is MessageKind.FORWARD:
            return Message(kind, forward=self._forward(*fields[:15]))
        if kind is MessageKind.DECODE_GRAPH:
            return Message(kind, decode=self._decode_graph(*fields[:6]))
        if kind is MessageKind.CAPTURE:
            return Message(kind, eager=bool(fields[0]))
        if kind is MessageKind.LOGITS:
            count = fields[0]
            rows = None if count == _ALL_ROWS else to_device(self._buffer[:count].clone(), self._device)
            return Message(kind, rows=rows)
        return Message(kind)

    def _forward(
        self,
        tokens: int,
        batch: int,
        width: int,
        max_query_len: int,
        max_seq_len: int,
        block_size: int,
        num_pending: int,
        pending_on_device: int,
        last_rows_only: int,
        num_restores: int,
        num_saves: int,
        num_image_rows: int,
        image_width: int,
        mrope: int,
        num_image_blocks: int,
    ) -> ForwardInputs:
        sizes = [tokens, tokens, batch + 1, batch, batch * width, tokens, batch, 2 * (num_restores + num_saves),
                 num_image_rows, 3 * tokens * mrope, _IMAGE_BLOCK * num_image_blocks]  # fmt: skip
        ids, positions, starts, seq_lens, tables, slots, states, copied, image_rows, mrope_rows, blocks, *pending = (
            self._read(sizes, num_pending, pending_on_device)
        )
        rows = copied.tolist()
        restores, saves = rows[: 2 * num_restores], rows[2 * num_restores :]
        copies = StateCopies((restores[:num_restores], restores[num_restores:]), (saves[:num_saves], saves[num_saves:]))
        device = self._device
        input_ids = self._input_ids(ids, pending, pending_on_device)
        image_embeds = None
        if num_image_rows:  # their embeddings by rank 0's broadcast, after the pending values'
            if self._broadcast is None:
                raise RuntimeError("rank 0 broadcasts images' embeddings, but this worker has no broadcast")
            embeds = torch.empty(num_image_rows, image_width, dtype=self._image_dtype, device=device)
            image_embeds = (to_device(image_rows, device), self._broadcast(embeds))
        image_blocks = [ImageBlock(*block) for block in blocks.view(-1, _IMAGE_BLOCK).tolist()]
        state_slots = states.tolist() if batch and int(states[0]) >= 0 else None  # a hybrid's (layers.gated_deltanet)
        return ForwardInputs(
            input_ids=input_ids,
            positions=to_device(positions, device),
            meta=AttentionMetadata(
                state_slots=None if state_slots is None else to_device(states, device),
                state_slots_cpu=state_slots,
                state_copies=copies if rows else None,
                query_start_loc=to_device(starts, device, torch.int32),
                seq_lens=to_device(seq_lens, device, torch.int32),
                block_tables=to_device(tables.view(batch, width), device, torch.int32),
                slot_mapping=to_device(slots, device),
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                query_lens_cpu=starts.diff().tolist(),
                seq_lens_cpu=seq_lens.tolist(),
                block_size=block_size,
                last_rows_only=bool(last_rows_only),
                image_embeds=image_embeds,
                mrope_positions=to_device(mrope_rows.view(3, tokens), device) if mrope else None,
                image_blocks=image_blocks or None,
            ),
        )

    def _decode_graph(
        self, batch: int, width: int, bucket: int, num_pending: int, pending_on_device: int, shifted: int
    ) -> DecodeGraphInputs:
        sizes = [batch, batch, batch * width, batch, batch * shifted]
        ids, seq_lens, tables, slots, shifts, *pending = self._read(sizes, num_pending, pending_on_device)
        layout = DecodeLayout(seq_lens.numpy(), tables.view(batch, width).numpy().astype(np.int32), slots.numpy())
        position_shifts = shifts.numpy() if shifted else None
        return DecodeGraphInputs(self._input_ids(ids, pending, pending_on_device), layout, bucket, position_shifts)

    def _read(self, sizes: list[int], num_pending: int, pending_on_device: int) -> list[torch.Tensor]:
        """The payload's parts of `sizes` values each (a copy: the buffer is rank 0's again after the first
        collective), then the pending rows and, where they came through the buffer, their values."""
        if num_pending:
            sizes = [*sizes, num_pending] if pending_on_device else [*sizes, num_pending, num_pending]
        return list(self._buffer[: sum(sizes)].clone().split(sizes))

    def _input_ids(self, ids: torch.Tensor, pending: list[torch.Tensor], pending_on_device: int) -> torch.Tensor:
        """The step's input ids on this rank's device, the pending rows' values (`pending`: rows, and values when
        they came in the buffer; else from rank 0's broadcast, which this call joins) in place."""
        input_ids = to_device(ids, self._device)
        if pending:
            rows = to_device(pending[0], self._device)
            if pending_on_device:
                if self._broadcast is None:
                    raise RuntimeError("rank 0 broadcasts pending token values, but this worker has no broadcast")
                values = self._broadcast(torch.empty(rows.numel(), dtype=torch.int64, device=self._device))
            else:
                values = to_device(pending[1], self._device)
            input_ids.index_copy_(0, rows, values)
        return input_ids
