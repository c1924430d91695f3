"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Mistral 4) over a paged cache of the latent itself.

The queries come from a low-rank projection (`q_a_proj`, its norm, `q_b_proj`; or one `q_proj`); the keys and
values from one compressed latent per token (`kv_a_proj_with_mqa`: `kv_lora_rank` latent dims and one rope key of
`qk_rope_head_dim` shared by every head), normalised and expanded per head by `kv_b_proj` into a key part without
positions (`qk_nope_head_dim`) and a value (`v_head_dim`). Each head's key is its nope part beside the shared rope
key; only the rope dims turn by position. Ling 3 gates each head's output by the sigmoid of its own `g_proj` value
(`LatentAttention.head_gate`); HY-V4 each value dim of it by its own `gate_proj` value (`value_gate`), and gives
each head a learned sink logit (`ModelConfig.attention_sinks`, as gpt-oss's), one more term of its softmax. A.X K2
computes its queries and that gate from the query latent beside its norm (`query_latent_pair`).

The cache holds each token's normalised latent and its turned rope key, `kv_lora_rank + qk_rope_head_dim` values
(576 for V3) under one KV head, not every head's expanded key and value: `kv_b_proj` is absorbed instead (the
peers' decode form). Head h's nope score `q_nope . (W_uk[h] c)` is `(W_uk[h]^T q_nope) . c`, so its query becomes
`cat(W_uk[h]^T q_nope, q_rope)` over keys `cat(c, k_rope)`: multi-query attention with a head dim of 576. The
values are those same rows; the first `kv_lora_rank` dims of each head's output are the latent its scores weight,
which `W_uv[h]` then expands to the head's value. So the attention kernels (and their FP8 rows and prefix caching)
are the ones every other family uses; the cache row is written as the key and again as the value.

`kv_b_proj` stays float under every quantization (`LatentExpansion`: not an `nn.Linear`, which is what the
quantizers swap), as in vLLM, which dequantizes it for the same absorption; an FP8 checkpoint's is read
dequantized. DeepSeek-V3's interleaved rope pairs (`rope_interleave`) are first laid out as halves, which is what
transformers' interleaved rotation computes.

Under tensor parallelism a rank holds its block of the heads (`parallel.sharding.query_heads_of_rank`): their rows of
`q_b_proj` (or `q_proj`) and of `kv_b_proj`, their columns of `o_proj`, whose partial sums it all-reduces. The
latent is every head's, so `q_a_proj`, `kv_a_proj_with_mqa`, their norms and the indexer are whole on every rank,
and so is the cache: each rank writes and reads the same rows (one KV head, replicated, as vLLM keeps it).

DeepSeek-V3.2 and GLM-5 (`ModelConfig.sparse_indexer`) attend over the positions a lightning indexer picks
(`layers.sparse_indexer`, which also says how the cache's rows hold its keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.attention import load_head_sinks
from engine_server.layers.norm import RMSNorm
from engine_server.layers.sparse_indexer import LightningIndexer, attend_positions, select_positions
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, copy_kept_rows
from engine_server.parallel.sharding import PartSlice, heads_rows, query_heads_of_rank
from ladle_kernels.kernel_set import KernelOps


class LatentExpansion(nn.Module):
    """`kv_b_proj`'s weight `[heads * (nope + value), kv_lora_rank]` as the checkpoint stores it, read by
    `MultiLatentAttention` as each head's two halves (`key_half`, `value_half`) and never run as a linear layer.
    It holds the rows of `heads` (this rank's, of the checkpoint's `total_heads`), which `load_tensor` keeps."""

    own_tensors = ("weight",)  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def __init__(
        self, heads: range, total_heads: int, nope_dim: int, value_dim: int, kv_lora_rank: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.heads, self.nope_dim, self.value_dim = len(heads), nope_dim, value_dim
        self.rows = heads_rows(heads, total_heads, nope_dim + value_dim)
        self.weight = nn.Parameter(torch.empty(len(self.rows.rows), kv_lora_rank, dtype=dtype))

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy the checkpoint's weight, whole or as exactly this rank's rows; ValueError on another shape."""
        with torch.no_grad():
            copy_kept_rows(self.weight.data, tensor, self.rows, kind)

    def key_half(self) -> torch.Tensor:
        """W_uk `[heads, nope, kv_lora_rank]`: the latent to each head's key part without positions (a view)."""
        return self.weight.view(self.heads, self.nope_dim + self.value_dim, -1)[:, : self.nope_dim]

    def value_half(self) -> torch.Tensor:
        """W_uv `[heads, value, kv_lora_rank]`: the latent to each head's value (a view)."""
        return self.weight.view(self.heads, self.nope_dim + self.value_dim, -1)[:, self.nope_dim :]


class MultiLatentAttention(nn.Module):
    """One layer's latent attention (module doc); parameters named as DeepSeek's checkpoints name them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE, index: int = 0) -> None:
        super().__init__()
        self.tp = tp
        mla = config.latent_attention
        assert mla is not None
        heads = query_heads_of_rank(config.num_attention_heads, tp.size, tp.rank)
        self.num_heads = len(heads)
        self.nope_dim, self.rope_dim, self.value_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.query_dim = self.nope_dim + self.rope_dim  # each head's query and key as the checkpoint computes them
        self.kv_lora_rank = mla.kv_lora_rank
        self.interleaved = mla.rope_interleave
        self.rope = mla.rope
        self.scale = config.attention_scale or self.query_dim**-0.5
        self.query_scale_beta, self.query_scale_positions = config.query_scale_beta, config.query_scale_positions
        hidden, total, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        queries = heads_rows(heads, total, self.query_dim)  # each head's nope and rope dims together
        latent_eps = mla.latent_norm_eps or config.rms_norm_eps
        # A.X K2: the queries (and their gate) read the query latent beside its norm (`query_latent_pair`)
        self.latent_pair = mla.query_latent_pair
        query_input = 2 * mla.q_lora_rank if self.latent_pair else mla.q_lora_rank
        if mla.q_lora_rank:
            self.q_a_proj: nn.Module | None = nn.Linear(hidden, mla.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm: RMSNorm | None = RMSNorm(mla.q_lora_rank, latent_eps, dtype)
            self.q_b_proj: nn.Module = ColumnParallelLinear(query_input, [queries], bias=False, dtype=dtype)
        else:
            self.q_a_proj = self.q_a_layernorm = None
            self.q_proj = ColumnParallelLinear(hidden, [queries], bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, latent_eps, dtype)
        self.kv_b_proj = LatentExpansion(heads, total, self.nope_dim, self.value_dim, self.kv_lora_rank, dtype)
        self.o_proj = RowParallelLinear(total * self.value_dim, hidden, bias, tp, dtype)
        # Ling 3: a gate per head (`LatentAttention.head_gate`), this rank's heads; HY-V4: one per value dim of each
        # head (`value_gate`, its `gate_proj`), their rows
        self.g_proj: nn.Module | None = None
        if mla.head_gate:
            self.g_proj = ColumnParallelLinear(hidden, [PartSlice(total, heads)], bias=False, dtype=dtype)
        self.gate_proj: nn.Module | None = None
        if mla.value_gate:
            self.gate_proj = ColumnParallelLinear(
                query_input if self.latent_pair else hidden, [heads_rows(heads, total, self.value_dim)], bias=False,
                dtype=dtype,
            )
        # HY-V4 (`ModelConfig.attention_sinks`): a learned sink logit per head (float32), this rank's heads
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if config.attention_sinks else None
        # Sparse attention (`layers.sparse_indexer`): the cache's row (`head_dim`), the positions each query may
        # attend to, and this layer's indexer (None on a layer that reuses the last one's choice).
        sparse = config.sparse_indexer
        self.row, self.topk = config.head_dim, 0 if sparse is None else sparse.topk
        self.indexer = (
            LightningIndexer(config, dtype) if sparse is not None and index not in sparse.shared_layers else None
        )

    own_tensors = ("sinks",)  # loaded by `load_tensor` (`CausalLM.load_weights`)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy a checkpoint's `sinks` (`[num_attention_heads]`, any float dtype), keeping this rank's heads."""
        load_head_sinks(self.sinks, tensor, self.tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's latent rows (`[T, 1, kv_lora_rank + rope]`,
        as key and as value) into `kv_cache` before attending. `lora` must be None: adapters are not applied to
        latent attention."""
        if lora is not None:
            raise ValueError("LoRA adapters are not applied to multi-head latent attention")
        tokens, heads = hidden.shape[0], self.num_heads
        q_resid = None
        gate_input = hidden
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            compressed = self.q_a_proj(hidden)
            q_resid = self.q_a_layernorm(compressed, ops)
            query_input = torch.cat((q_resid, compressed), dim=-1) if self.latent_pair else q_resid
            gate_input = query_input if self.latent_pair else hidden
            q = self.q_b_proj(query_input)
        else:
            q = self.q_proj(hidden)
        q_nope, q_rope = q.view(tokens, heads, self.query_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent, ops)
        k_rope = k_rope.reshape(tokens, 1, self.rope_dim)
        if self.rope:  # (Kimi Linear's layers turn nothing: its shared key dims go in as they are)
            q_rope, k_rope = self._halves(q_rope), self._halves(k_rope)
            q_rope, k_rope = ops.rotary_embedding(positions, q_rope.contiguous(), k_rope.contiguous(), cos_sin_cache)
        # [heads, T, nope] @ [heads, nope, rank]: each head's query in the latent's space
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.kv_b_proj.key_half()).transpose(0, 1)
        q = torch.cat((q_latent, q_rope), dim=-1)
        if self.query_scale_beta:  # Mistral 4: Llama 4's temperature, by position (`ModelConfig.query_scale_beta`)
            steps = torch.floor(positions.to(torch.float32) / self.query_scale_positions)
            q = q * (1 + self.query_scale_beta * torch.log(1 + steps)).to(q.dtype)[:, None, None]
        rows = torch.cat((latent.view(tokens, 1, self.kv_lora_rank), k_rope), dim=-1)
        if self.topk:
            out = self._attend_sparse(positions, hidden, q_resid, q, rows, kv_cache, cos_sin_cache, meta, ops)
        else:
            ops.write_kv_cache(rows, rows, kv_cache, meta.slot_mapping)
            out = ops.paged_attention(q, kv_cache, meta, self.scale, 0, 0.0, self.sinks)[..., : self.kv_lora_rank]
        # [heads, T, rank] @ [heads, rank, value]: each head's weighted latent expanded to its value
        values = torch.bmm(out.transpose(0, 1), self.kv_b_proj.value_half().transpose(1, 2)).transpose(0, 1)
        if self.g_proj is not None:
            values = values * torch.sigmoid(self.g_proj(hidden))[..., None]
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(gate_input).float()).to(values.dtype)
            values = values * gate.view(tokens, heads, self.value_dim)
        return self.tp.all_reduce_sum(self.o_proj(values.reshape(tokens, heads * self.value_dim)))

    def _attend_sparse(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        q_resid: torch.Tensor | None,
        q: torch.Tensor,
        rows: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """Write this step's rows with their index keys, then attend over what the indexer picks (`[T, heads,
        kv_lora_rank]`): through the paged kernels while every sequence is at most `topk` long, else over the rows
        `layers.sparse_indexer` gathers (module doc there)."""
        values = rows[..., : self.kv_lora_rank]
        if self.indexer is not None:
            values = torch.cat((values, self.indexer.keys(positions, hidden, cos_sin_cache, ops)[:, None]), dim=-1)
        pad = self.row - rows.shape[-1], self.row - values.shape[-1]
        ops.write_kv_cache(F.pad(rows, (0, pad[0])), F.pad(values, (0, pad[1])), kv_cache, meta.slot_mapping)
        if meta.max_seq_len <= self.topk:
            out = ops.paged_attention(F.pad(q, (0, pad[0])), kv_cache, meta, self.scale, 0, 0.0, self.sinks)
            return out[..., : self.kv_lora_rank]
        if self.indexer is not None:
            assert q_resid is not None
            queries, weights = self.indexer.queries(positions, hidden, q_resid, cos_sin_cache, ops)
            meta.sparse_choice = select_positions(
                queries, weights, positions, kv_cache, meta, self.kv_lora_rank, self.topk
            )
        if meta.sparse_choice is None:
            raise RuntimeError("a layer sharing its indexer's choice ran before any layer with an indexer")
        return attend_positions(q, kv_cache, meta, meta.sparse_choice, self.scale, self.kv_lora_rank, self.sinks)

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """Rope dims in interleaved pairs `(x0, x1), (x2, x3), ...` laid out as halves `(x0, x2, ..., x1, x3, ...)`,
        as the shared rotary reads them (`rope_interleave`); as they are otherwise."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x
