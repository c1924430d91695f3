"""Self-attention layer over the paged KV cache: fused QKV projection, optional q/k norm, rope, output proj.

Under tensor parallelism a rank holds its query heads and the KV heads they read (`parallel.sharding`), attends
over them alone (its KV cache holds only those heads) and all-reduces the output projection's partial sums."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.alibi import alibi_slopes
from engine_server.layers.image_blocks import attend_image_blocks
from engine_server.layers.mlp import int8_rows
from engine_server.layers.norm import HeadLayerNorm, RMSNorm, ShardedRMSNorm
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import (
    PartSlice,
    heads_per_rank,
    kv_head_replicas,
    kv_heads_of_rank,
    kv_heads_per_rank,
    qkv_slices,
    query_heads_of_rank,
)
from ladle_kernels.kernel_set import KernelOps


def load_head_sinks(sinks: torch.Tensor | None, tensor: CheckpointTensor, tp: TensorParallel) -> None:
    """Copy a checkpoint's sink logits (`[num_attention_heads]`, any float dtype) into `sinks`, this rank's heads'
    (float32); ValueError where the attention has none (`sinks` None) or the shape is not every head's."""
    if sinks is None:
        raise ValueError("this model's attention has no sinks")
    whole, heads = read_whole(tensor), sinks.shape[0] * tp.size
    if whole.shape != (heads,):
        raise ValueError(f"has shape {tuple(whole.shape)}, expected ({heads},)")
    kept = query_heads_of_rank(heads, tp.size, tp.rank)
    with torch.no_grad():
        sinks.copy_(whole[kept.start : kept.stop].float())


class PagedSelfAttention(nn.Module):
    """Grouped-query attention; `qkv_proj` rows are `cat(q_proj, k_proj, v_proj)` (weights and biases), of this
    rank's heads under tensor parallelism (`num_heads` and `num_kv_heads` count this rank's). `window`: the layer's
    sliding window (`ModelConfig.attention_window`; 0: it attends to every earlier position); its scores are
    soft-capped with `ModelConfig.attention_softcap` (Gemma 2); without `rope` (SmolLM3's NoPE layers) q and k are
    not turned by their positions. With `ModelConfig.attention_sinks` (gpt-oss) each query head has a learned sink
    logit (`sinks`, float32 whatever the model's dtype, this rank's heads), one more term of its softmax's
    denominator (`ladle_kernels.reference.paged_attention`). With `ModelConfig.attention_output_gate` (Qwen3-Next,
    Qwen3.5) q_proj gives each head its query and then as many gate values, and the attention's output is multiplied by
    their sigmoid before `o_proj`. Llama 4: each head of q and k RMS-normalised without a weight on its rope layers
    (`ModelConfig.qk_unit_norm`), its NoPE layers' queries scaled by their position's attention temperature
    (`ModelConfig.nope_temperature_scale`), and its rope layers attending within chunks (`ModelConfig.attention_chunk`:
    `AttentionMetadata.chunked`). StableLM 2 12B: each head of q and k LayerNorm'd with a weight of its own
    (`ModelConfig.qk_layer_norm`, `layers.norm.HeadLayerNorm`). Laguna: each head's output times the softplus of its
    own `g_proj` row (`ModelConfig.attention_softplus_gate`: one value a head, or one a dim), its windowed layers'
    rope over a share of each head of their own (`ModelConfig.local_rotary_dim`). Beam: each head's output times the
    sigmoid of its own biased `g_proj` rows (`ModelConfig.attention_sigmoid_gate`), its NoPE layers' queries scaled
    by position (`ModelConfig.nope_query_power`). Ergo: its full layers' scores times
    `ModelConfig.full_attention_scale`.

    Gemma 4 (`ModelConfig.gemma4`, layer `index`): the layer's own head shape (`layer_head_dim`, `layer_kv_heads`),
    rope over the whole head (its table zero past the angles that turn), each head's values RMS-normalised without a
    weight, on a full-attention layer with `keys_as_values` no v_proj (values are the key projection, before its
    norm and rope), and on a layer that attends over an earlier layer's K/V (`kv_source`) no K/V projection at all:
    `qkv_proj` holds the queries alone and the step's K/V are already in the shared cache."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        o_proj_bias: bool = False,
        tp: TensorParallel = SINGLE,
        window: int = 0,
        rope: bool = True,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.window = window
        self.rope = rope
        self.chunk = config.attention_chunk if rope else 0  # Llama 4: its NoPE layers attend to every position
        kv_heads = config.layer_kv_heads(index)
        q_heads = config.layer_q_heads(index)  # (Laguna's differ between layers)
        self.num_heads = heads_per_rank(q_heads, tp.size)
        self.num_kv_heads = kv_heads_per_rank(kv_heads, tp.size)
        self.head_dim = config.layer_head_dim(index)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Laguna's windowed layers read the local table, which turns a share of each head of its own.
        local = bool(config.local_rope_theta) and window > 0
        self.rotary_dim = (
            self.head_dim if config.gemma4 is not None else config.local_rotary_dim if local else config.rotary_dim
        )
        self.scale = config.attention_scale or self.head_dim**-0.5
        if not window:  # (Ergo's full layers scale their scores)
            self.scale *= config.full_attention_scale
        self.softcap = config.attention_softcap
        self.shares_kv = config.kv_source(index) != index
        layout = config.gemma4
        self.keys_as_values = layout is not None and layout.keys_as_values and config.is_global_layer(index)
        parts: tuple[PartSlice, ...] = qkv_slices(q_heads, kv_heads, self.head_dim, tp.size,
                                                  tp.rank)  # fmt: skip
        parts = parts[: config.qkv_parts(index)]  # the queries alone, or the queries and keys, or all three
        self.output_gate = config.attention_output_gate
        if self.output_gate:  # each head's rows are its query's, then its gate's: twice the rows, head for head
            q_part = parts[0]
            parts = (PartSlice(2 * q_part.full, range(2 * q_part.rows.start, 2 * q_part.rows.stop)), *parts[1:])
        self.q_width = len(parts[0].rows)
        self.qkv_proj: nn.Module = ColumnParallelLinear(config.hidden_size, parts, config.attention_bias, dtype)
        full_q = q_heads * self.head_dim
        self.o_proj: nn.Module = RowParallelLinear(full_q, config.hidden_size, o_proj_bias, tp, dtype)
        # BitNet: the heads' outputs RMS-normalised before o_proj (one rank), each projection's input rounded to int8
        # per token with its ternary weights (`layers.mlp.int8_rows`)
        self.attn_sub_norm = RMSNorm(full_q, config.rms_norm_eps, dtype) if config.sub_norms else None
        self.int8_inputs = bool(config.ternary_projections)
        # Qwen3 normalises each head of q and k (over head_dim) before rope; OLMoE all of q and all of k at once,
        # which a rank holding some of the heads does with the other ranks' squares summed in (`ShardedRMSNorm`).
        self.qk_norm_whole = config.qk_norm_whole
        self.qk_norm_after_rope = config.qk_norm_after_rope  # Hunyuan: per head, after rope
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm and self.qk_norm_whole and tp.size > 1:  # each rank its heads' columns (`ShardedRMSNorm`)
            q_part, k_part = parts[0], parts[1]
            self.q_norm = ShardedRMSNorm(q_part.full, q_part.rows, 1, config.rms_norm_eps, dtype, tp)
            replicas = kv_head_replicas(kv_heads, tp.size)
            self.k_norm = ShardedRMSNorm(k_part.full, k_part.rows, replicas, config.rms_norm_eps, dtype, tp)
        elif config.qk_layer_norm:  # StableLM 2's: a LayerNorm of each head's own, this rank's heads
            heads, eps = q_heads, config.rms_norm_eps
            kept_q = list(query_heads_of_rank(heads, tp.size, tp.rank))
            kept_k = list(kv_heads_of_rank(kv_heads, tp.size, tp.rank))
            bias = config.qk_layer_norm_bias  # (Persimmon's)
            self.q_norm = HeadLayerNorm(heads, kept_q, self.head_dim, eps, dtype, bias)
            self.k_norm = HeadLayerNorm(kv_heads, kept_k, self.head_dim, eps, dtype, bias)
        elif config.qk_norm:
            q_width, k_width = (self.q_size, self.kv_size) if self.qk_norm_whole else (self.head_dim, self.head_dim)
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps, dtype) if not self.shares_kv else None
        # Gemma 4's value norm and Llama 4's q/k norms have no weight to load: a buffer of ones, so `ops.rms_norm`
        # takes it as a norm's.
        self.value_norm = config.gemma4 is not None
        self.qk_unit_norm = config.qk_unit_norm and rope
        if self.value_norm or self.qk_unit_norm:
            self.register_buffer("unit_norm_weight", torch.ones(self.head_dim, dtype=dtype), persistent=False)
        # A query temperature by position, `1 + scale * ln(1 + floor((p + offset) / floor))`: Llama 4's on its NoPE
        # layers (offset 1), Ministral 3's on every layer (offset 0, `ModelConfig.query_scale_beta`).
        if config.query_scale_beta > 0:
            scale, self.temperature_offset = config.query_scale_beta, 0
            self.temperature_floor = config.query_scale_positions
        else:
            scale = 0.0 if rope else config.nope_temperature_scale
            self.temperature_floor, self.temperature_offset = config.nope_temperature_floor, 1
        self.temperature = scale > 0
        if self.temperature:  # one table, so a position's scale never depends on the batch
            steps = torch.arange(config.max_position_embeddings // self.temperature_floor + 2, dtype=torch.float32)
            self.register_buffer("temperatures", torch.log1p(steps) * scale + 1.0, persistent=False)
        elif config.nope_query_power > 0 and not rope:  # Beam's: `(1 + (p + 1) / positions) ** power`, a row each
            self.temperature, self.temperature_floor, self.temperature_offset = True, 1, 0
            steps = torch.arange(config.max_position_embeddings + 2, dtype=torch.float32)
            scales = torch.exp(config.nope_query_power * torch.log1p((steps + 1) / config.nope_query_positions))
            self.register_buffer("temperatures", scales, persistent=False)
        self.norm_eps = config.rms_norm_eps
        self.clip_qkv = config.clip_qkv
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if config.attention_sinks else None
        # BLOOM's, MPT's and Falcon-RW's ALiBi: this rank's heads' slopes (`layers.alibi`)
        self.alibi, self.falcon_alibi = bool(config.alibi), config.alibi == "falcon"
        if self.alibi:
            kept = query_heads_of_rank(q_heads, tp.size, tp.rank)
            slopes = alibi_slopes(config.alibi, q_heads, config.alibi_bias_max)
            self.register_buffer("alibi_slopes", slopes[kept.start : kept.stop], persistent=False)
        # Laguna: `g_proj` gives each of this rank's heads one gate value, or one per dim of the head (`gate_width`),
        # through softplus; Beam: one per dim, with a bias, through a sigmoid (`sigmoid_gate`).
        self.gate_width = 1 if config.attention_softplus_gate == "head" else self.head_dim
        self.sigmoid_gate = config.attention_sigmoid_gate
        self.g_proj: nn.Module | None = None
        if config.attention_softplus_gate or self.sigmoid_gate:
            per = self.gate_width
            gated = query_heads_of_rank(q_heads, tp.size, tp.rank)
            gate_rows = PartSlice(q_heads * per, range(gated.start * per, gated.stop * per))
            self.g_proj = ColumnParallelLinear(config.hidden_size, [gate_rows], self.sigmoid_gate, dtype)

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
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's K/V into `kv_cache` before attending.
        `positions` are the tokens' rows of `cos_sin_cache` (`DecoderModel.rope_rows`). `lora`: the step's LoRA
        adapters, added to the q/k/v and output projections."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(int8_rows(hidden) if self.int8_inputs else hidden)
        if lora is not None:
            qkv = lora.add("qkv_proj", hidden, qkv, ops)
        if self.shares_kv:
            return self._attend_shared(positions, qkv, kv_cache, cos_sin_cache, meta, ops, lora)
        q, k, v, gate = self.queries_keys_values(positions, qkv, cos_sin_cache, ops)
        ops.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        attend = meta.chunked(self.chunk) if self.chunk else meta
        out = (
            ops.alibi_attention(q, kv_cache, meta, self.scale, self.get_buffer("alibi_slopes"), self.falcon_alibi)
            if self.alibi
            else ops.paged_attention(q, kv_cache, attend, self.scale, self.window, self.softcap, self.sinks)
        )  # fmt: skip
        if meta.image_blocks:  # (Gemma 3's images: their tokens attend to each other both ways)
            heads = out.reshape(tokens, self.num_heads, self.head_dim)
            out = attend_image_blocks(
                q, heads, kv_cache, meta.image_blocks, meta.block_tables, self.scale, self.window, self.softcap
            )
        out = out.reshape(tokens, self.q_size)
        if gate is not None:
            out = ops.sigmoid_mul(out, gate.reshape(tokens, self.q_size))
        if self.g_proj is not None and self.sigmoid_gate:  # Beam's
            out = ops.sigmoid_mul(out, self.g_proj(hidden))
        elif self.g_proj is not None:  # Laguna's: softplus in float32, as transformers computes it
            scale = F.softplus(self.g_proj(hidden).float()).to(out.dtype).view(tokens, self.num_heads, self.gate_width)
            out = (out.view(tokens, self.num_heads, self.head_dim) * scale).reshape(tokens, self.q_size)
        return self._project(out, ops, lora)

    def queries_keys_values(
        self, positions: torch.Tensor, qkv: torch.Tensor, cos_sin_cache: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's queries `[T, heads, head_dim]`, keys and values `[T, kv_heads, head_dim]` (normed, clipped,
        scaled, turned by position as the family does) and the output gate (None without one) from `qkv_proj`'s
        output `[T, q_width + 2 * kv_size]`."""
        tokens = qkv.shape[0]
        if self.keys_as_values:
            q, k = qkv.split([self.q_width, self.kv_size], dim=-1)
            v = k
        else:
            q, k, v = qkv.split([self.q_width, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            query_and_gate = q.reshape(tokens, self.num_heads, 2 * self.head_dim)
            q, gate = query_and_gate[..., : self.head_dim].contiguous(), query_and_gate[..., self.head_dim :]
        if self.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        if self.clip_qkv:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        norm_heads_now = not self.qk_norm_whole and not self.qk_norm_after_rope
        if norm_heads_now and self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q, ops)
            k = self.k_norm(k, ops)
        if self.value_norm:
            v = ops.rms_norm(v.contiguous(), self.get_buffer("unit_norm_weight"), self.norm_eps)
        if self.qk_unit_norm:  # before rope, which keeps each head's norm: transformers norms after it
            q = ops.rms_norm(q.contiguous(), self.get_buffer("unit_norm_weight"), self.norm_eps)
            k = ops.rms_norm(k.contiguous(), self.get_buffer("unit_norm_weight"), self.norm_eps)
        if self.temperature:
            q = q * self._temperature(positions, q.dtype)
        if self.rope and self.rotary_dim == self.head_dim:
            q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache)
        elif self.rope:  # partial rotary (Phi-3 style): the leading rotary_dim dims turn, the rest pass as they are
            dim = self.rotary_dim
            q_turned, k_turned = ops.rotary_embedding(
                positions, q[..., :dim].contiguous(), k[..., :dim].contiguous(), cos_sin_cache
            )
            q = torch.cat((q_turned, q[..., dim:]), dim=-1)
            k = torch.cat((k_turned, k[..., dim:]), dim=-1)
        if self.qk_norm_after_rope and self.q_norm is not None and self.k_norm is not None:  # Hunyuan's, per head
            q = self.q_norm(q, ops)
            k = self.k_norm(k, ops)
        return q, k, v, gate

    def _attend_shared(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LayerLora | None,
    ) -> torch.Tensor:
        """A layer over an earlier layer's K/V (Gemma 4): its queries (normed, turned) attend over the shared cache,
        which that layer has written this step's K/V into already; nothing is written. `lora`: the step's adapters
        on o_proj (the queries have theirs already)."""
        tokens = q.shape[0]
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q, ops)
        if self.rope:  # rotary_embedding takes a k too (and leaves its inputs as they are): q's own
            q, _ = ops.rotary_embedding(positions, q, q, cos_sin_cache)
        out = ops.paged_attention(q, kv_cache, meta, self.scale, self.window, self.softcap, self.sinks)
        return self._project(out.reshape(tokens, self.q_size), ops, lora)

    def _temperature(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The query scale of each position, `[T, 1, 1]`: `1 + scale * ln(1 + floor((p + offset) / floor))`, read
        from the table computed once (torch's log1p over a step's column would give a position other bits where
        it falls in the column's scalar tail, which depends on the batch)."""
        steps = torch.div(positions + self.temperature_offset, self.temperature_floor, rounding_mode="floor")
        return self.get_buffer("temperatures")[steps].to(dtype)[:, None, None]

    def _project(self, out: torch.Tensor, ops: KernelOps, lora: LayerLora | None) -> torch.Tensor:
        if self.attn_sub_norm is not None:  # BitNet's norm of the heads' outputs, before o_proj
            out = self.attn_sub_norm(out, ops)
        projected = self.o_proj(int8_rows(out) if self.int8_inputs else out)
        if lora is not None:
            projected = lora.add("o_proj", out, projected, ops)
        return self.tp.all_reduce_sum(projected)
