"""Falcon-H1's hybrid-head block: attention and Mamba-2 side by side on one input norm, their outputs summed into the
residual stream, then the MLP. Every layer keeps K/V in the paged cache and a Mamba-2 state per running sequence; the
states come after the layers' KV caches in the list the model is handed (`attention_metadata.allocate_kv_cache`,
`ModelConfig.state_beside_attention`). Falcon-H1's multipliers are folded into the weights as they load
(`models.falcon_h1`), so the block itself multiplies nothing."""

from __future__ import annotations

import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.decoder import DecoderLayer, DecoderModel
from engine_server.layers.mamba2 import Mamba2Mixer
from engine_server.lora.slots import LoraBatch
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.step_interrupt import StepInterrupt
from ladle_kernels.kernel_set import KernelOps


class HybridHeadDecoderLayer(DecoderLayer):
    """`h += attn(norm(h)) + mamba(norm(h)); h += mlp(norm(h))` (same interface as `DecoderLayer`). Its Mamba-2 advances
    the states in `state`, which `HybridHeadModel.forward` hands it before the layers run (the same tensor every
    step, so a captured CUDA graph reads it in place)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        self.mamba = Mamba2Mixer(config, dtype, tp)
        self.state: torch.Tensor | None = None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.state is not None, "the model hands each layer its Mamba-2 states before a step"
        layer_lora = None if lora is None else lora.layer(self.index)
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden, ops)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual, ops)
        attended = self.self_attn(positions, normed, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        mixed = attended + self.mamba(positions, normed, self.state, cos_sin_cache, meta, ops)
        hidden, residual = self.post_attention_layernorm.add_and_norm(mixed, residual, ops)
        return self.feed_forward(hidden, ops, layer_lora), residual


class HybridHeadModel(DecoderModel):
    """The decoder of hybrid-head layers: `kv_caches` holds each layer's KV cache, then each layer's Mamba-2 states."""

    layer_class = HybridHeadDecoderLayer

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
        layers = len(self.layers)
        if len(kv_caches) != 2 * layers:
            raise ValueError(f"{layers} hybrid-head layers take {2 * layers} cache tensors, not {len(kv_caches)}")
        for layer, state in zip(self.layers, kv_caches[layers:], strict=True):
            layer.state = state
        return super().forward(input_ids, positions, kv_caches[:layers], meta, ops, interrupt, lora)
