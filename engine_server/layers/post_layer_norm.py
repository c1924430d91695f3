"""The original Transformer's post-LN block (GPT-1's, OPT-350M's): `h = ln1(h + attn(h)); h = ln2(h + mlp(h))`,
each norm after its residual add, no final norm. OPT-350M's embeddings are narrower than the model
(`ModelConfig.embedding_size`): projected in before its learned positions are added, the final state projected out
to their width for the LM head tied to them."""

from __future__ import annotations

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.decoder import DecoderLayer, DecoderModel
from engine_server.lora.slots import LoraBatch
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import VocabParallelEmbedding
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels.kernel_set import KernelOps


class PostLayerNormDecoderLayer(DecoderLayer):
    """`h = ln1(h + attn(h)); h = ln2(h + mlp(h))`: `input_layernorm` is ln1, `post_attention_layernorm` ln2 (the
    names the checkpoints' `ln_1`/`ln_2` and OPT's `self_attn_layer_norm`/`final_layer_norm` are read as)."""

    def post_ln(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """The layer's output from its input `hidden` `[T, hidden]`."""
        layer_lora = None if lora is None else lora.layer(self.index)
        attended = self.self_attn(positions, hidden, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        hidden, _ = self.input_layernorm.add_and_norm(attended, hidden, ops)
        fed = self.feed_forward(hidden, ops, layer_lora)
        hidden, _ = self.post_attention_layernorm.add_and_norm(fed, hidden, ops)
        return hidden


class PostLayerNormDecoderModel(DecoderModel):
    """The decoder of post-LN layers (`ModelConfig.post_layer_norm`): no final norm; with `embedding_size` (OPT-350M)
    the embeddings that wide, `project_in` to the model's width before the positions are added and `project_out`
    back after the last layer. Runs its layers in Python (no decode stack)."""

    layer_class = PostLayerNormDecoderLayer
    stackable = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp)
        self.register_module("norm", nn.Identity())  # (no final norm)
        width = config.embedding_size
        self.project_in: nn.Linear | None = None
        self.project_out: nn.Linear | None = None
        if width and width != config.hidden_size:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, width, tp, dtype)
            self.project_in = nn.Linear(width, config.hidden_size, bias=False, dtype=dtype)
            self.project_out = nn.Linear(config.hidden_size, width, bias=False, dtype=dtype)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(positions)
        return hidden

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
        hidden = self.embed(input_ids, positions, ops)
        cos_sin = self.get_buffer("cos_sin_cache")
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, PostLayerNormDecoderLayer)
            hidden = layer.post_ln(positions, hidden, kv_cache, cos_sin, meta, ops, lora)
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        return hidden if self.project_out is None else self.project_out(hidden)

