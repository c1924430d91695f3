"""Gemma 4's text decoder (`ModelConfig.gemma4`): Gemma 3's sandwich block with per-layer inputs and a per-layer
output scale, full-attention layers of their own head shape and proportional rope, and the last layers attending
over earlier layers' K/V (the attention's side: `layers.attention.PagedSelfAttention`)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.decoder import DecoderModel, SandwichDecoderLayer
from engine_server.layers.norm import RMSNorm
from engine_server.lora.slots import LoraBatch
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import ParallelExperts, VocabParallelEmbedding
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels import reference
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import build_cos_sin_cache


class Gemma4Router(nn.Module):
    """Gemma 4's router: logits `proj(rms(x) * scale / sqrt(hidden))` (the norm without a weight), softmaxed in float32,
    the top k kept and renormalised to sum to 1, each then times its expert's `per_expert_scale` (transformers'
    `Gemma4TextRouter`). `proj` stays float (`quantized_experts.ROUTER_SUFFIXES`)."""

    def __init__(self, hidden: int, experts: int, top_k: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = top_k, eps, hidden**-0.5
        self.proj = nn.Linear(hidden, experts, bias=False, dtype=dtype)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(experts, dtype=dtype), requires_grad=False)
        self.register_buffer("ones", torch.ones(hidden, dtype=dtype), persistent=False)

    def route(self, x: torch.Tensor, ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, hidden]` -> (weights `[T, k]` in x's dtype, expert ids `[T, k]`)."""
        normed = ops.rms_norm(x.contiguous(), self.get_buffer("ones"), self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(normed).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[experts]).to(x.dtype), experts


class Gemma4DecoderLayer(SandwichDecoderLayer):
    """Gemma 3's block; with experts (`Gemma4Layout.experts`) a mixture of them beside the dense MLP: the MLP's output
    and the experts' (chosen from the residual stream, run on its own norm of it) each normalised, summed, and
    normalised again before the residual add. Then (with per-layer inputs) `h += norm(proj(gelu(gate(h)) *
    per_layer_input))`, and `h *= layer_scalar`. It hands the next layer its whole output and no residual stream
    (`(h, None)`: the next layer's input norm then starts the stream afresh, as the first layer's does)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        layout = config.gemma4
        assert layout is not None
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        self.per_layer_input_size = layout.per_layer_input_size
        if self.per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(config.hidden_size, self.per_layer_input_size, bias=False,
                                                  dtype=dtype)  # fmt: skip
            self.per_layer_projection = nn.Linear(self.per_layer_input_size, config.hidden_size, bias=False,
                                                  dtype=dtype)  # fmt: skip
            self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tp = tp
        self.has_experts = layout.experts > 0
        if self.has_experts:
            hidden, eps = config.hidden_size, config.rms_norm_eps
            self.router = Gemma4Router(hidden, layout.experts, layout.experts_per_token, eps, dtype)
            self.experts = ParallelExperts(layout.experts, hidden, layout.expert_intermediate_size, tp, dtype,
                                           gated_silu=False)  # fmt: skip
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, dtype)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, dtype)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, dtype)

    def forward(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """`per_layer_input` `[T, per_layer_input_size]`: this layer's slice of the decoder's per-layer inputs."""
        layer_lora = None if lora is None else lora.layer(self.index)
        attended, residual = self.attend(positions, hidden, residual, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        normed = self.post_attention_layernorm(attended, ops)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(normed, residual, ops)
        out = self.feed_forward(hidden, ops, layer_lora)
        if self.has_experts:
            weights, chosen = self.router.route(residual, ops)
            experts_in = self.pre_feedforward_layernorm_2(residual, ops)
            mixed = self.tp.all_reduce_sum(self.experts(experts_in, weights, chosen, reference.gelu_tanh_and_mul))
            out = self.post_feedforward_layernorm_1(out, ops) + self.post_feedforward_layernorm_2(mixed, ops)
        hidden = residual + self.post_feedforward_layernorm(out, ops)
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated), ops)
        return hidden * self.layer_scalar, None


class Gemma4DecoderModel(DecoderModel):
    """`DecoderModel` with Gemma 4's layers, their per-layer inputs, and the full-attention layers' proportional
    rope (`global_rope_angles` of `global_head_dim / 2` angles turning; the windowed layers' table is the local
    one). Runs its layers in Python (no decode stack): K/V shared between layers are the same cache tensor
    (`attention_metadata.allocate_kv_cache`), written by the first layer to reach it in the step. Where the step
    reads each sequence's last token alone (`AttentionMetadata.last_rows_only`), the layers that share K/V run for
    those tokens only (as transformers' prefill does); the other rows it returns hold their states from before those
    layers."""

    layer_class = Gemma4DecoderLayer

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp)
        layout = config.gemma4
        assert layout is not None
        self.hidden_size = config.hidden_size
        table = build_cos_sin_cache(layout.global_head_dim, config.max_position_embeddings, config.rope_theta,
                                    None, dtype, rotated_angles=layout.global_rope_angles)  # fmt: skip
        self.register_buffer("cos_sin_cache", table, persistent=False)
        # The first layer that attends over another's K/V (none: past the last layer).
        sharing = [i for i in range(config.num_hidden_layers) if config.kv_source(i) != i]
        self.first_sharing_layer = sharing[0] if sharing else config.num_hidden_layers
        self.per_layer_width = layout.per_layer_input_size
        # Gemma 3n's table is shorter than its vocabulary: the ids past it read row 0 (None: every id has a row)
        self.per_layer_id_limit = layout.per_layer_vocab_size if layout.per_layer_vocab_size < config.vocab_size \
            else None  # fmt: skip
        if self.per_layer_width:
            packed = config.num_hidden_layers * self.per_layer_width
            self.embed_tokens_per_layer = VocabParallelEmbedding(layout.per_layer_vocab_size, packed, tp, dtype)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, packed, bias=False, dtype=dtype)
            self.per_layer_projection_norm = RMSNorm(self.per_layer_width, config.rms_norm_eps, dtype)
            # Rounded to the weights' dtype, as transformers' scaled embedding rounds its scale.
            table_scale = torch.tensor(self.per_layer_width**0.5).to(dtype)
            self.register_buffer("per_layer_table_scale", table_scale, persistent=False)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """Each token's input to every layer, `[T, layers, width]`: `(norm(proj(e) / sqrt(hidden)) + table[id] *
        sqrt(width)) / sqrt(2)`, `e` its scaled embedding, `table` the `embed_tokens_per_layer` rows (row 0 for an id
        past them: Gemma 3n's table is shorter than its vocabulary)."""
        tokens, layers = input_ids.shape[0], len(self.layers)
        if self.per_layer_id_limit is not None:
            input_ids = torch.where(input_ids < self.per_layer_id_limit, input_ids, 0)
        looked_up = self.embed_tokens_per_layer(input_ids) * self.get_buffer("per_layer_table_scale")
        projected = self.per_layer_model_projection(embeddings) * self.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(tokens, layers, self.per_layer_width), ops)
        return (projected + looked_up.reshape(tokens, layers, self.per_layer_width)) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
        interrupt: StepInterrupt | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.get_buffer("embedding_multiplier")
        per_layer = self.per_layer_inputs(input_ids, hidden, ops) if self.per_layer_width else None
        cos_sin, local = self.get_buffer("cos_sin_cache"), self.get_buffer("local_cos_sin_cache")
        residual: torch.Tensor | None = None
        full: tuple[torch.Tensor, torch.Tensor] | None = None  # (all rows' hidden states, the rows kept)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if index == self.first_sharing_layer and meta.last_rows_only and meta.max_query_len > 1:
                # The sharing layers write no K/V: where the step reads each sequence's last token alone, the
                # other tokens' states past here are never read, so these layers run for the last tokens only.
                rows, meta = meta.last_rows
                full = (hidden, rows)
                hidden, positions = hidden.index_select(0, rows), positions.index_select(0, rows)
                per_layer = None if per_layer is None else per_layer.index_select(0, rows)
                lora = None if lora is None else replace(lora, slots=lora.slots.index_select(0, rows))
            table = local if self.local_rope_layers[index] else cos_sin
            layer_input = None if per_layer is None else per_layer[:, index]
            hidden, residual = layer(positions, hidden, residual, kv_cache, table, meta, ops, lora, layer_input)
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        hidden = self.norm(hidden, ops)
        if full is not None:  # the rows skipped keep their states from before the sharing layers (unread)
            hidden = full[0].index_copy(0, full[1], hidden)
        return hidden
