"""RWKV-4 (`rwkv`: the RWKV-4 Pile and Raven releases): blocks of a time mix and a channel mix over a state per
sequence (`layers.rwkv`), no attention, no KV cache; read from transformers' names (`hf_rwkv`)."""

from __future__ import annotations

import functools
from typing import cast

import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.decoder import DecoderModel
from engine_server.layers.gated_deltanet import advance_states
from engine_server.layers.norm import BiasedLayerNorm
from engine_server.layers.rwkv import RwkvLayer
from engine_server.lora.slots import LoraBatch
from engine_server.models.base import CausalLM
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.step_interrupt import StepInterrupt
from ladle_kernels.kernel_set import KernelOps

# transformers' LayerNorm after the last block takes torch's default epsilon, whatever the config says.
_OUT_NORM_EPS = 1e-5


class RwkvDecoderModel(DecoderModel):
    """Token ids -> `ln_out` of the last block's output: `RwkvLayer`s in turn, each inside `advance_states` (its
    state tensor in place of a KV cache), the hidden state halved after every `rescale_every`-th."""

    layer_class = RwkvLayer  # type: ignore[assignment]  # (its own call: `advance_block`)
    stackable = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp)
        assert config.rwkv is not None
        self.rescale_every = config.rwkv.rescale_every
        self.norm = BiasedLayerNorm(config.hidden_size, _OUT_NORM_EPS, dtype)

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
        """As `DecoderModel.forward` (no LoRA adapters: refused at load; a step is never stopped half way)."""
        hidden = self.embed(input_ids, positions, ops)
        for index, (layer, state) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = advance_states(meta, state, "RWKV", functools.partial(
                cast(RwkvLayer, layer).advance_block, hidden, state, meta=meta, ops=ops))  # fmt: skip
            if self.rescale_every > 0 and (index + 1) % self.rescale_every == 0:
                hidden = hidden / 2
        return self.norm(hidden, ops)


class RwkvForCausalLM(CausalLM):
    """RWKV-4 (`rwkv`), read from transformers' names: `rwkv.embeddings`, `rwkv.blocks.<i>` (its mixes' per-channel
    weights and decays read into the mixes' `mixes`), `rwkv.ln_out`, `head`."""

    decoder_class = RwkvDecoderModel
    checkpoint_renames = (
        ("rwkv.embeddings.", "model.embed_tokens."),
        ("rwkv.blocks.", "model.layers."),
        ("rwkv.ln_out.", "model.norm."),
        (".attention.time_", ".attention.mixes.time_"),
        (".feed_forward.time_", ".feed_forward.mixes.time_"),
    )

    def checkpoint_name(self, name: str) -> str:
        """`head.weight` as the LM head; the rest by `checkpoint_renames`."""
        return "lm_head.weight" if name == "head.weight" else super().checkpoint_name(name)
