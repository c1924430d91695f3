"""Granite (IBM Granite 3.x dense): Llama's block with multipliers on the embeddings, scores, residuals and logits;
HyperCLOVA X SEED (Naver), Granite's block with a norm after each sub-layer's output too."""

from __future__ import annotations

import torch

from engine_server.config import ModelConfig
from engine_server.models.base import CausalLM
from engine_server.parallel.group import SINGLE, TensorParallel

# HyperCLOVA X SEED's norms, as Gemma 2's sandwich names them: its `post_attention_layernorm` is the MLP's input
# norm (Gemma's `pre_feedforward_layernorm`), and `post_norm1` / `post_norm2` normalise the attention's and the
# MLP's outputs. In that order: the first rename frees the name the second takes.
_SANDWICH_RENAMES = (
    (".post_attention_layernorm.", ".pre_feedforward_layernorm."),
    (".post_norm1.", ".post_attention_layernorm."),
    (".post_norm2.", ".post_feedforward_layernorm."),
)


class GraniteForCausalLM(CausalLM):
    """Granite: Llama's layers and names; embeddings times `embedding_multiplier`, attention scores scaled by
    `attention_multiplier` (not head_dim ** -0.5), each block's outputs times `residual_multiplier` before their
    residual adds, logits divided by `logits_scaling` (`ModelConfig`). HyperCLOVA X SEED (`hyperclovax`, read by
    `hf_config._granite_fields`): the same multipliers but its logits multiplied (`logit_scale`), and with
    `use_post_norm` Gemma 2's sandwich (`ModelConfig.sandwich_norms`) under its own norm names."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        if config.sandwich_norms:
            self.checkpoint_renames = _SANDWICH_RENAMES
