"""Batch metadata for paged attention, and the layout and size of the paged KV cache.

Contract shared by the runner, the model and every attention kernel:

- A step's tokens are flattened into one batch of T tokens. Sequence i contributes `query_lens[i]` new tokens
  at positions `[seq_lens[i] - query_lens[i], seq_lens[i])`; its earlier tokens are already in the cache.
- The KV cache is one tensor per layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 = K,
  1 = V); an FP8 cache (`--kv-cache-dtype fp8`) is uint8 `[..., head_dim + 4]`, each row a token's key or value of
  one KV head in e4m3 followed by its float32 scale (`ladle_kernels.reference.fp8_kv_rows`). Token p of sequence i
  lives in slot `block_tables[i][p // block_size] * block_size + p % block_size`.
- Each layer writes the K/V of all T new tokens before computing attention, so a sequence may read blocks that
  another sequence of the same step writes (shared prefix blocks).
- A recurrent layer (Qwen3-Next's and Qwen3.5's linear attention, `layers.gated_deltanet`; LFM2's short convolution,
  `layers.short_conv`) has no KV cache: its entry in the list of
  caches is a float32 `[state_slots, state_size]` tensor, sequence i's state in row `state_slots[i]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_server.config import KVCacheDType, ModelConfig
from engine_server.parallel.sharding import kv_heads_per_rank
from engine_server.transfer import padded_rows, to_device
from ladle_kernels.attention_inputs import PrefillSpan, ReferencePlan
from ladle_kernels.reference import FP8_KV_DTYPE, FP8_KV_SCALE_BYTES

if TYPE_CHECKING:
    from engine_server.core.scheduler_output import StateCopies
    from engine_server.layers.cross_attention import CrossAttention
    from engine_server.layers.image_blocks import ImageBlock


@dataclass(frozen=True)
class DecodeLayout:
    """A decode step's rows as host arrays: one new token per row, at position `seq_lens[i] - 1`."""

    seq_lens: np.ndarray[Any, np.dtype[np.int64]]  # [B]
    block_tables: np.ndarray[Any, np.dtype[np.int32]]  # [B, W] W = blocks of the longest row; padded with -1
    slots: np.ndarray[Any, np.dtype[np.int64]]  # [B] the flat slot of each row's new token

    @classmethod
    def build(
        cls, seq_lens: Sequence[int] | np.ndarray[Any, Any], block_tables: Sequence[Sequence[int]], block_size: int
    ) -> DecodeLayout:
        """Whole-array numpy arithmetic over the padded tables: a few array operations whatever the batch size
        (this runs every decode step). ValueError when a row has no token or its table is too short for it."""
        lens = np.fromiter(seq_lens, dtype=np.int64, count=len(seq_lens))
        width = max(-(-int(lens.max(initial=0)) // block_size), 1)
        tables = padded_rows(block_tables, width, -1, np.int32).numpy()
        positions = lens - 1
        blocks = tables[np.arange(len(lens)), positions // block_size]
        bad = (lens < 1) | (blocks < 0)  # no token, or a table too short for it (its padding read -1)
        if bad.any():
            short = int(np.argmax(bad))
            raise ValueError(f"block table of sequence {short} is too short for {int(lens[short])} tokens")
        slots = blocks.astype(np.int64) * block_size + positions % block_size
        return cls(lens, tables, slots)


@dataclass
class AttentionMetadata:
    """Flattened batch: sequence i contributes query_lens[i] new tokens at positions
    [seq_lens[i]-query_lens[i], seq_lens[i]). Tensors live on the model's device."""

    query_start_loc: torch.Tensor  # [B+1] int32 cumulative query lengths (query_start_loc[0] == 0)
    seq_lens: torch.Tensor  # [B] int32 context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32 block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 flat slot (block * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, so the reference path never syncs with the device
    seq_lens_cpu: list[int]
    block_size: int = 16
    # The block tables and slot mapping as the host built them (CPU tensors), for whoever passes a step on (the
    # tensor-parallel step channel) without copying them back from the device; None where not built here.
    host_block_tables: torch.Tensor | None = None
    host_slot_mapping: torch.Tensor | None = None
    # Models with recurrent layers (`ModelConfig.recurrent`): each sequence's row of the layers' state tensors
    # (`[B]` int64 on the device, and the host's copy), set by the runner from its requests' slots; else None.
    state_slots: torch.Tensor | None = None
    state_slots_cpu: list[int] | None = None
    # Rows of those state tensors the step copies (`core.scheduler_output.StateCopies`: prefix snapshots restored
    # before the layers' update, saved after it); None: none.
    state_copies: StateCopies | None = None
    # Set by the runner for a step whose caller reads each sequence's last token's final hidden state alone (no
    # prompt logprobs, pooling or drafts): layers that write no K/V (Gemma 4's sharing ones) may skip the others.
    last_rows_only: bool = False
    # DeepSeek Sparse Attention (`layers.sparse_indexer`): the positions the step's last layer with an indexer chose
    # for each token (`[T, topk]`, -1 past its own), which GLM-5's layers without one reuse; None until one chose.
    sparse_choice: torch.Tensor | None = None
    # Its groups of token rows (`layers.sparse_indexer._row_groups`), built by the first layer that asks for them and
    # read by the others: keyed by the work a row costs.
    sparse_groups: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    # Kolibri-1.1 (`layers.kolibri_attention`): each sequence's pool of keys (`[query_len, seq_len]` bool, None: every
    # key) chosen by the step's latest pool layer, which its later indexed layers choose from; keyed by that layer.
    index_pools: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    # Prompts with images (`engine_server.multimodal`): the step's rows that take an image's embeddings instead of
    # their token's (`[R]` int64) and those embeddings (`[R, hidden]`), set by the runner; None: no such row.
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # ... and with M-RoPE (the Qwen-VL text models), a step that computes such a prompt's tokens: every token's
    # (temporal, height, width) rope positions `[3, T]` int64 (`multimodal.features.step_mrope_positions`); else None.
    mrope_positions: torch.Tensor | None = None
    # ... and images whose tokens attend both ways (Gemma 3's), the step's (`layers.image_blocks`); None: none.
    image_blocks: list[ImageBlock] | None = None
    # ... and Llama 3.2 Vision's cross-attention layers over its images, the step's rows of requests with images
    # (`multimodal.mllama.CrossStep`), run between the text model's layers; None: none (rank 0 alone: its images are
    # not served under tensor parallelism).
    cross_attention: CrossAttention | None = None
    # The image rows and M-RoPE positions as the host built them, as `host_block_tables` (the step channel's).
    host_image_rows: torch.Tensor | None = None
    host_mrope_positions: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Build the metadata (slot mapping included) on the host and move it to `device` in one go each.

        `block_tables[i]` must cover at least `ceil(seq_lens[i] / block_size)` blocks.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        if all(q == 1 for q in query_lens):
            return cls.build_decode(seq_lens, block_tables, block_size, device)
        batch = len(query_lens)
        width = max(max((len(bt) for bt in block_tables), default=0), 1)
        for i, bt in enumerate(block_tables):
            if len(bt) * block_size < seq_lens[i]:
                raise ValueError(f"block table of sequence {i} is too short for {seq_lens[i]} tokens")
        tables = padded_rows(block_tables, width, 0)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.zeros(batch + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=starts[1:])
        # Position of every new token: its sequence's first new position plus its offset within the chunk.
        rows = torch.repeat_interleave(torch.arange(batch), q_lens)
        positions = (s_lens - q_lens)[rows] + torch.arange(int(starts[-1])) - starts[:-1][rows]
        slots = tables[rows, positions // block_size] * block_size + positions % block_size
        return cls(
            query_start_loc=to_device(starts, device, torch.int32),
            seq_lens=to_device(s_lens, device, torch.int32),
            block_tables=to_device(tables, device, torch.int32),
            slot_mapping=to_device(slots, device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_size=block_size,
            host_block_tables=tables,
            host_slot_mapping=slots,
        )

    @classmethod
    def build_decode(
        cls, seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device | str
    ) -> AttentionMetadata:
        """`build` for a step of decode rows only (one new token each, at position seq_len - 1).

        Every per-row value comes from whole-array numpy arithmetic over the padded block tables, so the host
        time is a few array operations whatever the batch size (this runs every decode step).
        """
        return cls.from_decode_layout(DecodeLayout.build(seq_lens, block_tables, block_size), block_size, device)

    @classmethod
    def from_decode_layout(cls, layout: DecodeLayout, block_size: int, device: torch.device | str) -> AttentionMetadata:
        """`build_decode` from a decode step's layout (which it does not modify)."""
        lens, batch = layout.seq_lens, len(layout.seq_lens)
        tables = torch.from_numpy(np.maximum(layout.block_tables, 0))  # padding columns hold 0, as `build` pads
        slots = layout.slots
        seq_lens_cpu = lens.tolist()
        return cls(
            query_start_loc=to_device(torch.arange(batch + 1, dtype=torch.int32), device),
            seq_lens=to_device(torch.from_numpy(lens.astype(np.int32)), device),
            block_tables=to_device(tables, device),
            slot_mapping=to_device(torch.from_numpy(slots), device),
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu, default=0),
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=seq_lens_cpu,
            block_size=block_size,
            host_block_tables=tables,
            host_slot_mapping=torch.from_numpy(slots),
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @cached_property
    def last_rows(self) -> tuple[torch.Tensor, AttentionMetadata]:
        """Each sequence's last new token: (its row `[B]` int64 on the device, this step's metadata for those rows
        alone: one query each over the same context). Computed on first use, then cached."""
        device = self.block_tables.device
        rows = torch.tensor(self.query_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        batch = len(self.query_lens_cpu)
        rows_on_device = to_device(rows, device)
        meta = AttentionMetadata(
            query_start_loc=to_device(torch.arange(batch + 1, dtype=torch.int32), device),
            seq_lens=self.seq_lens, block_tables=self.block_tables,
            slot_mapping=self.slot_mapping.index_select(0, rows_on_device), max_query_len=1,
            max_seq_len=self.max_seq_len, query_lens_cpu=[1] * batch, seq_lens_cpu=self.seq_lens_cpu,
            block_size=self.block_size, host_block_tables=self.host_block_tables,
            state_slots=self.state_slots, state_slots_cpu=self.state_slots_cpu,
        )  # fmt: skip
        return rows_on_device, meta

    def chunked(self, chunk: int) -> AttentionMetadata:
        """This step's metadata for a layer whose token at position p attends to the positions of its own chunk
        only, `[p - p % chunk, p]` (Llama 4's rope layers: `ModelConfig.attention_chunk`). Each sequence becomes one
        sequence per chunk its new tokens fall in: those tokens as its queries, its block table from the chunk's
        first block on, its length counted from the chunk's start. So every attention kernel serves it as plain
        causal attention, and the new tokens keep their rows. Itself when no sequence reaches past its first
        chunk; computed once per step and chunk. `chunk` must be a multiple of the block size (ValueError)."""
        if self.max_seq_len <= chunk:
            return self
        if chunk % self.block_size:
            raise ValueError(f"an attention chunk of {chunk} positions is not a multiple of the block size "
                             f"{self.block_size}")  # fmt: skip
        cached = self.__dict__.setdefault("_chunked", {})
        if chunk not in cached:
            cached[chunk] = self._split_at_chunks(chunk)
        result: AttentionMetadata = cached[chunk]
        return result

    def _split_at_chunks(self, chunk: int) -> AttentionMetadata:
        """`chunked`'s metadata, built on the host and moved to the device."""
        tables = self.host_block_tables if self.host_block_tables is not None else self.block_tables.cpu()
        rows: list[int] = []  # the sequence of each part
        firsts: list[int] = []  # the block each part's table starts from
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for i, (query_len, seq_len) in enumerate(zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True)):
            first = seq_len - query_len
            for start in range(first - first % chunk, seq_len, chunk):
                end = min(seq_len, start + chunk)
                rows.append(i)
                firsts.append(start // self.block_size)
                query_lens.append(end - max(first, start))
                seq_lens.append(end - start)
        width = tables.shape[1] - min(firsts)
        parts = torch.zeros(len(rows), width, dtype=tables.dtype)
        for part, (row, block) in enumerate(zip(rows, firsts, strict=True)):
            parts[part, : tables.shape[1] - block] = tables[row, block:]
        starts = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(query_lens, dtype=torch.int64), 0, out=starts[1:])
        device = self.block_tables.device
        return AttentionMetadata(
            query_start_loc=to_device(starts, device, torch.int32),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
            block_tables=to_device(parts.to(torch.int32), device),
            slot_mapping=self.slot_mapping, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=self.block_size, host_block_tables=parts,
            host_slot_mapping=self.host_slot_mapping,
        )  # fmt: skip

    @cached_property
    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as a decode row of its own: (block tables `[T, max_blocks]` int32, its sequence's
        row; context lengths `[T]` int32, its position + 1). Computed on first use, then cached."""
        device = self.block_tables.device
        counts = torch.tensor(self.query_lens_cpu, dtype=torch.int64)
        sequence = torch.repeat_interleave(torch.arange(len(counts)), counts)
        first = torch.tensor(self.seq_lens_cpu, dtype=torch.int64) - counts  # position of each sequence's first
        starts = torch.cumsum(counts, 0) - counts
        lens = first[sequence] + torch.arange(int(counts.sum())) - starts[sequence] + 1
        tables = self.block_tables.index_select(0, sequence.to(device))
        return tables, lens.to(device=device, dtype=torch.int32)

    @cached_property
    def reference_plan(self) -> ReferencePlan:
        """Split the batch into decode rows and prefill spans (computed on first use, then cached)."""
        bs = self.block_size
        device = self.block_tables.device
        decode_rows = [i for i, q in enumerate(self.query_lens_cpu) if q == 1]
        starts: list[int] = [0]
        for q in self.query_lens_cpu:
            starts.append(starts[-1] + q)
        prefills = tuple(
            PrefillSpan(i, starts[i], q, self.seq_lens_cpu[i], -(-self.seq_lens_cpu[i] // bs))
            for i, q in enumerate(self.query_lens_cpu)
            if q > 1
        )
        lens = [self.seq_lens_cpu[i] for i in decode_rows]
        nblocks = -(-max(lens, default=0) // bs)
        rows = torch.tensor(decode_rows, dtype=torch.int64, device=device)
        tables = self.block_tables.index_select(0, rows)
        block_ids = tables[:, :nblocks].to(torch.int64).reshape(-1)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        keys = torch.arange(nblocks * bs, device=device)
        visible = keys[None, :] < lens_t[:, None]
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill_(~visible, -torch.inf)
        return ReferencePlan(
            decode_token_index=torch.tensor([starts[i] for i in decode_rows], dtype=torch.int64, device=device),
            decode_block_tables=tables,
            decode_seq_lens=lens_t.to(torch.int32),
            decode_block_ids=block_ids,
            decode_blocks=nblocks,
            decode_mask=mask[:, None, None, :],
            prefills=prefills,
            all_decode=len(decode_rows) == len(self.query_lens_cpu),
        )


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1, cache_dtype: KVCacheDType = "auto"
) -> int:
    """Bytes one block id costs across all layers (K and V) on one rank of a tensor-parallel group of `tp_size`
    (which holds its share of the KV heads), for a model of `dtype` and a cache of `cache_dtype`: the unit for
    sizing the pool from memory."""
    total = 0
    for index in _cache_layers(config):
        storage, row = kv_cache_layout(config, dtype, cache_dtype, config.layer_head_dim(index))
        itemsize = torch.empty((), dtype=storage).element_size()
        total += 2 * block_size * cache_heads_per_rank(config, index, tp_size) * row * itemsize
    return total


def _cache_layers(config: ModelConfig) -> list[int]:
    """The layers that keep K/V of their own in the paged cache (not recurrent ones, not sharing another's)."""
    return [i for i in range(config.num_hidden_layers) if not config.is_recurrent_layer(i) and config.kv_source(i) == i]


def cache_heads_per_rank(config: ModelConfig, index: int, tp_size: int) -> int:
    """The heads of layer `index`'s cache rows on one rank of a tensor-parallel group of `tp_size`: its share of the
    layer's KV heads (`parallel.sharding.kv_heads_per_rank`) and the heads every rank keeps beside them
    (`ModelConfig.layer_index_heads`: MiniMax-M3's index keys)."""
    return kv_heads_per_rank(config.layer_kv_heads(index), tp_size) + config.layer_index_heads(index)


def recurrent_state_bytes(config: ModelConfig, slots: int, tp_size: int = 1) -> int:
    """Bytes the recurrent layers' states (`ModelConfig.recurrent`) of `slots` sequences take on one rank of a
    tensor-parallel group of `tp_size` (its heads' or channels' share); 0 for a model without such layers."""
    recurrent = config.recurrent
    return 0 if recurrent is None else 4 * recurrent.sharded(tp_size).state_size * len(recurrent.layers) * slots


def kv_cache_layout(
    config: ModelConfig, dtype: torch.dtype, cache_dtype: KVCacheDType, head_dim: int | None = None
) -> tuple[torch.dtype, int]:
    """(element dtype, row length) of a cache of `cache_dtype` for a model of `dtype` whose layer has heads
    `head_dim` wide (`config.head_dim` when None): (dtype, head_dim), or for "fp8" (uint8, head_dim + 4). Raises
    ValueError for another `cache_dtype`, or an FP8 cache of a head dim that is not a multiple of 4 (the kernels read
    each row's scale as an aligned float32)."""
    head_dim = config.head_dim if head_dim is None else head_dim
    if cache_dtype == "auto":
        return dtype, head_dim
    if cache_dtype != "fp8":
        raise ValueError(f"KV cache dtype {cache_dtype!r}: expected auto or fp8")
    if head_dim % FP8_KV_SCALE_BYTES:
        raise ValueError(f"--kv-cache-dtype fp8 needs a head dim that is a multiple of 4; this model's is "
                         f"{head_dim}")  # fmt: skip
    return FP8_KV_DTYPE, head_dim + FP8_KV_SCALE_BYTES


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int = 1,
    cache_dtype: KVCacheDType = "auto",
    state_slots: int = 0,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, `[2, num_blocks, block_size, num_kv_heads, row]` (`kv_cache_layout`'s dtype
    and row, the layer's own head shape and its heads in the cache, `cache_heads_per_rank`), of one rank's
    KV heads in a tensor-parallel group of `tp_size` (`parallel.sharding.kv_heads_per_rank`); a recurrent layer's
    is its float32 states, `[state_slots, state_size]` (of this rank's heads); a layer that attends over another's
    K/V (`ModelConfig.kv_source`) gets that layer's very tensor. After the layers' tensors come the states of the
    layers that keep one beside their K/V (`ModelConfig.state_beside_attention`: Falcon-H1's), one per such layer in
    its order."""
    recurrent = None if config.recurrent is None else config.recurrent.sharded(tp_size)
    caches: list[torch.Tensor] = []
    for index in range(config.num_hidden_layers):
        if recurrent is not None and config.is_recurrent_layer(index):
            caches.append(torch.zeros(state_slots, recurrent.state_size, dtype=torch.float32, device=device))
        elif config.kv_source(index) != index:
            caches.append(caches[config.kv_source(index)])
        else:
            storage, row = kv_cache_layout(config, dtype, cache_dtype, config.layer_head_dim(index))
            kv_heads = cache_heads_per_rank(config, index, tp_size)
            caches.append(torch.zeros(2, num_blocks, block_size, kv_heads, row, dtype=storage, device=device))
    for _ in config.state_beside_attention:
        assert recurrent is not None
        caches.append(torch.zeros(state_slots, recurrent.state_size, dtype=torch.float32, device=device))
    return caches
