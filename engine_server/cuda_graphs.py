"""CUDA graphs for decode steps: static input buffers and one captured forward pass per batch-size bucket.

A decode step launches hundreds of small kernels whose launch cost, not their work, bounds a small model; a
CUDA graph replays them all with one launch. A graph replays fixed kernels on fixed addresses, so:

- The inputs live in static device buffers sized for the largest bucket. `DecodeGraphs.run` pads a batch of
  B decode rows (one new token each) to the smallest bucket >= B, copies it in, replays that bucket's graph and
  returns the hidden states `[B, hidden]`: a view of a static buffer, valid until the next `run`.
- Padding rows are harmless: token 0 at position 0 with seq_len 1, their slot and block table in
  `scratch_block`, a KV block the cache manager never hands out. They never read or write a block that a real
  request owns; their own outputs are garbage and are never returned.
- Everything the captured kernels read from the host (number of sequences, max_query_len == 1, shapes) is fixed
  per bucket; all per-step values (tokens, positions, slots, seq_lens, block tables) are read on the device.
  `ladle_kernels.paged_attention` and `ladle_kernels.kv_cache` satisfy this, so their launches replay correctly. A
  kernel that sized its launch from `max_seq_len` or the host lists would not: the graph keeps their capture values.

- With LoRA adapters (engine_server.lora) every bucket is recorded with the adapters' kernels in it, reading each
  row's slot from a static buffer (-1: none, the padding rows' value): a step mixing adapters replays as any
  other, and a step of the base model alone pays only the kernels' launches over rows with nothing to add.

Capturing is injected (`GraphCapture`): `CudaGraphCapture` records with `torch.cuda.graph`, `EagerCapture`
re-runs the recorded callable on replay, so the CPU can test the padding and static-buffer logic.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from engine_server.attention_metadata import AttentionMetadata, DecodeLayout
from engine_server.lora.slots import LoraBatch, LoraSlots
from engine_server.transfer import pins_for

# hidden `[T, hidden]` of the model for input ids and positions `[T]` under the given metadata and adapters.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, LoraBatch | None], torch.Tensor]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The buckets, ascending: 1, 2, 4, 8, then multiples of 8 below `max_batch`, and `max_batch` itself (as
    vLLM does, so a step pads by at most 7 rows while a few dozen graphs cover every batch up to `max_batch`)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1; got {max_batch}")
    sizes = {s for s in (1, 2, 4) if s < max_batch} | set(range(8, max_batch, 8)) | {max_batch}
    return sorted(sizes)


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending `sizes` that holds `batch` rows; None when `batch` exceeds them all."""
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else None


class GraphCapture(Protocol):
    """How `DecodeGraphs` records a callable that reads and writes only its static buffers."""

    def warmup(self, fn: Callable[[], None]) -> None:
        """Run `fn` eagerly before it is captured (compiles kernels, sets up library workspaces)."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Record `fn`; the returned callable redoes its work on the same buffers with their current contents."""


class CudaGraphCapture:
    """Records with `torch.cuda.graph`, every graph in one shared memory pool.

    Capture the largest batch first: later, smaller graphs then fit in the pool the first one reserved (only
    one graph runs at a time, so sharing it is safe).
    """

    def __init__(self, warmup_runs: int = 2) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup_runs = warmup_runs

    def warmup(self, fn: Callable[[], None]) -> None:
        # PyTorch's recipe: warm up on a side stream, so lazy initialisation is not mixed into the capture stream.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph.replay


class EagerCapture:
    """Records the callable itself and re-runs it on replay: the graph path without graphs, for CPU tests."""

    def __init__(self) -> None:
        self.warmups = 0

    def warmup(self, fn: Callable[[], None]) -> None:
        self.warmups += 1
        fn()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn


class DecodeGraphs:
    """Static buffers and one recorded forward per bucket. Not thread-safe: the runner owns it.

    `forward` must be the model step over the runner's KV cache; `scratch_block` a block id of that cache that
    no request is ever given; `max_blocks_per_seq` the block-table width a `max_model_len` sequence needs.
    """

    def __init__(
        self,
        forward: DecodeForward,
        *,
        sizes: Sequence[int],
        hidden_size: int,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        dtype: torch.dtype,
        device: torch.device,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        """`lora_slots`: the adapters' slots, when the engine serves adapters (the graphs then apply them)."""
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self._forward = forward
        largest = self.sizes[-1]
        # Input ids, positions and slots of bucket b are the 3 rows of `_tokens[:3 * b].view(3, b)`: contiguous
        # (as the kernels read them), and a step's per-token inputs arrive in one copy.
        self._tokens = torch.zeros(3 * largest, dtype=torch.long, device=device)
        self._seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self._block_tables = torch.full((largest, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._hidden = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        self.lora_slots = lora_slots
        self._adapter_slots = torch.full((largest,), -1, dtype=torch.long, device=device)  # each row's LoRA slot
        self._replays: dict[int, Callable[[], None]] = {}
        # The metadata the recorded callable reads, per bucket. A CUDA graph keeps what it saw at capture; the
        # eager stand-in reads the current one, whose host lists must then describe the padded batch.
        self._metas: dict[int, AttentionMetadata] = {}
        self.replays: Counter[int] = Counter()  # runs per bucket, for logs and tests

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(batch, self.sizes)

    def capture_all(self, capture: GraphCapture) -> None:
        """Warm up and record every bucket, largest first. Padding rows only: the KV writes hit the scratch block."""
        self._seq_lens.fill_(1)
        self._block_tables.fill_(self.scratch_block)
        self._adapter_slots.fill_(-1)
        for bucket in reversed(self.sizes):
            ids, positions, slots = self._token_rows(bucket)
            ids.zero_()
            positions.zero_()
            slots.fill_(self.scratch_block * self.block_size)
            self._metas[bucket] = self._metadata(bucket, [1] * bucket)
            step = self._step_fn(bucket)
            capture.warmup(step)
            self._replays[bucket] = capture.capture(step)

    def run(
        self,
        token_ids: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[list[int]],
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states `[B, hidden]` of B decode rows: row i is token `token_ids[i]` at position
        `seq_lens[i] - 1` of a sequence whose blocks are `block_tables[i]` (covering `seq_lens[i]` tokens).

        `pending`, (rows, ids) as device int64 tensors, overrides those rows' tokens with ids that are only on
        the device (async scheduling: sampled by the step before). B must be between 1 and `max_batch`. The
        result is a view of a static buffer, overwritten by the next run.
        """
        batch = len(token_ids)
        if batch == 0 or self.bucket_for(batch) is None or not len(seq_lens) == len(block_tables) == batch:
            raise ValueError(f"a decode graph runs 1..{self.max_batch} rows with one seq_len and table each")
        return self.run_layout(token_ids, DecodeLayout.build(seq_lens, block_tables, self.block_size), pending)

    def run_layout(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        layout: DecodeLayout,
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,
        adapter_slots: Sequence[int] | None = None,
        position_shifts: np.ndarray[Any, np.dtype[np.int64]] | None = None,
    ) -> torch.Tensor:
        """`run` with the rows' layout already built (not modified here). `token_ids` may be a device tensor
        `[B]` int64 (the tokens the previous step sampled, never on the host), copied in on the device.
        `adapter_slots`: each row's LoRA slot (None: no row has an adapter); only for graphs with `lora_slots`.
        `position_shifts`: each row's rope position past its token's index (M-RoPE's delta after images; None: 0)."""
        batch = len(layout.seq_lens)
        bucket = self.bucket_for(batch)
        if batch == 0 or bucket is None:
            raise ValueError(f"a decode graph runs 1..{self.max_batch} rows")
        width = layout.block_tables.shape[1]
        if width > self._block_tables.shape[1]:
            raise ValueError(f"a sequence of {int(layout.seq_lens.max())} tokens exceeds the graphs' block-table width")
        # Padding rows: token 0 at position 0, seq_len 1, slot and tables in the scratch block.
        tokens = np.zeros((3, bucket), dtype=np.int64)
        on_device = token_ids if isinstance(token_ids, torch.Tensor) else None
        if on_device is None:
            tokens[0, :batch] = token_ids
        tokens[1, :batch] = layout.seq_lens - 1 if position_shifts is None else layout.seq_lens - 1 + position_shifts
        tokens[2, :batch] = layout.slots
        tokens[2, batch:] = self.scratch_block * self.block_size
        lens = np.ones(bucket, dtype=np.int32)
        lens[:batch] = layout.seq_lens
        tables = np.full((bucket, width), self.scratch_block, dtype=np.int32)
        tables[:batch] = np.where(layout.block_tables < 0, self.scratch_block, layout.block_tables)
        # Non-blocking from pinned memory on CUDA; stale table columns beyond `width` are never read.
        self._tokens[: 3 * bucket].copy_(self._staged(tokens.reshape(-1)), non_blocking=True)
        self._seq_lens[:bucket].copy_(self._staged(lens), non_blocking=True)
        self._block_tables[:bucket, :width].copy_(self._staged(tables), non_blocking=True)
        if self.lora_slots is not None:
            slots = np.full(bucket, -1, dtype=np.int64)
            if adapter_slots is not None:
                slots[:batch] = adapter_slots
            self._adapter_slots[:bucket].copy_(self._staged(slots), non_blocking=True)
        elif adapter_slots is not None:
            raise ValueError("these decode graphs were recorded without LoRA slots")
        padded_lens = lens.tolist()
        if on_device is not None:
            self._token_rows(bucket)[0][:batch].copy_(on_device)
        if pending is not None:
            self._token_rows(bucket)[0].index_copy_(0, *pending)
        self._metas[bucket] = self._metadata(bucket, padded_lens)
        self._replays[bucket]()
        self.replays[bucket] += 1
        return self._hidden[:batch]

    def _staged(self, array: np.ndarray[Any, Any]) -> torch.Tensor:
        """A host array as a tensor to copy from: pinned on CUDA, so the copy does not hold the host up."""
        tensor = torch.from_numpy(array)
        return tensor.pin_memory() if pins_for(self.device) else tensor

    def _step_fn(self, bucket: int) -> Callable[[], None]:
        ids, positions, _ = self._token_rows(bucket)
        lora = None if self.lora_slots is None else LoraBatch(self.lora_slots, self._adapter_slots[:bucket])

        def step() -> None:
            self._hidden[:bucket].copy_(self._forward(ids, positions, self._metas[bucket], lora))

        return step

    def _token_rows(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids, positions, slots) `[bucket]` each, contiguous views of the static token buffer."""
        ids, positions, slots = self._tokens[: 3 * bucket].view(3, bucket)
        return ids, positions, slots

    def _metadata(self, bucket: int, seq_lens: list[int]) -> AttentionMetadata:
        """Metadata over the static buffers for `bucket` rows whose (padded) lengths are `seq_lens`."""
        return AttentionMetadata(
            query_start_loc=self._query_start_loc[: bucket + 1],
            seq_lens=self._seq_lens[:bucket],
            block_tables=self._block_tables[:bucket],
            slot_mapping=self._token_rows(bucket)[2],
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
