"""What the attention kernels read of a step, as kernels' own types: the engine's `AttentionMetadata`
(engine_server.attention_metadata) is built by the engine and satisfies `AttentionInputs`; the reference kernel's
plan of a step (`ReferencePlan`) is data the kernels define and the metadata builds. So nothing in `ladle_kernels`
imports the engine (the layer order: kernels below engine_server; tests/unit/test_layers.py).

The layout contract of the inputs (flattened tokens, block tables, the paged KV cache) is stated in
engine_server.attention_metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence that has several new tokens this step (a prompt chunk), for per-sequence kernels."""

    seq_index: int  # row in the batch
    query_start: int  # first of its tokens in the flattened batch
    query_len: int
    seq_len: int  # context length including the new tokens
    num_blocks: int  # blocks of its block table that hold [0, seq_len)


@dataclass(frozen=True)
class ReferencePlan:
    """Host-derived views of one step, built once and reused by every layer of the reference attention.

    Decode rows (query_len == 1) are gathered together; the other rows are listed as prefill spans.
    """

    decode_token_index: torch.Tensor  # [Bd] int64 index of each decode row's token in the flat batch
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int32 block tables of the decode rows
    decode_seq_lens: torch.Tensor  # [Bd] int32 context lengths of the decode rows
    decode_block_ids: torch.Tensor  # [Bd * decode_blocks] int64 block ids, row-major, padded with 0
    decode_blocks: int  # blocks gathered per decode row (enough for the longest decode context)
    decode_mask: torch.Tensor  # [Bd, 1, 1, decode_blocks * block_size] float32 additive (0 or -inf)
    prefills: tuple[PrefillSpan, ...]
    all_decode: bool  # every token is a decode row, in order: decode_token_index == arange(T)


class AttentionInputs(Protocol):
    """A step's attention metadata as the kernels read it (engine_server.attention_metadata.AttentionMetadata)."""

    @property
    def query_start_loc(self) -> torch.Tensor:
        """[B+1] int32 cumulative query lengths (query_start_loc[0] == 0)."""
        ...

    @property
    def seq_lens(self) -> torch.Tensor:
        """[B] int32 context length including the new tokens."""
        ...

    @property
    def block_tables(self) -> torch.Tensor:
        """[B, max_blocks] int32 block ids, padded with 0."""
        ...

    @property
    def max_query_len(self) -> int: ...

    @property
    def query_lens_cpu(self) -> list[int]: ...

    @property
    def seq_lens_cpu(self) -> list[int]: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as a decode row of its own: (block tables `[T, max_blocks]` int32, context lengths
        `[T]` int32: its position + 1)."""
        ...

    @property
    def reference_plan(self) -> ReferencePlan: ...


class RopeScalingParams(Protocol):
    """Llama-3 style rope frequency scaling, as `ladle_kernels.reference.rope_inv_freq` reads it
    (engine_server.config.RopeScaling)."""

    @property
    def factor(self) -> float: ...

    @property
    def low_freq_factor(self) -> float: ...

    @property
    def high_freq_factor(self) -> float: ...

    @property
    def original_max_position_embeddings(self) -> int: ...


class YarnParams(Protocol):
    """YaRN rope scaling, as `ladle_kernels.reference.yarn_inv_freq` reads it (engine_server.config.Yarn)."""

    @property
    def factor(self) -> float: ...

    @property
    def original_max_position_embeddings(self) -> int: ...

    @property
    def beta_fast(self) -> float: ...

    @property
    def beta_slow(self) -> float: ...

    @property
    def attention_factor(self) -> float: ...

    @property
    def truncate(self) -> bool: ...
