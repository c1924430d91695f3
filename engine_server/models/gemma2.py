"""Gemma 2: Gemma 3's block without q/k norms or a local rope base, with its attention scores and final logits
soft-capped (`c * tanh(x / c)`); sliding windows on every other layer. VaultGemma: the same without the norms after
the attention and the MLP."""

from __future__ import annotations

import torch

from engine_server.config import ModelConfig
from engine_server.models.base import CausalLM
from engine_server.parallel.group import SINGLE, TensorParallel


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 (`model_type` gemma2): its quirks are `ModelConfig` fields the shared layers read (`norm_offset`,
    `embedding_multiplier`, `hidden_act`, `sandwich_norms`, `attention_scale`, `attention_softcap`,
    `final_logit_softcap`, `layer_windows`); the LM head is tied to the embeddings. VaultGemma (`vaultgemma`):
    `sandwich_norms` off, a pre-norm block whose MLP's input norm its checkpoints call `pre_feedforward_layernorm`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        if not config.sandwich_norms:
            self.checkpoint_renames = ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),)
