"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Gemma's sandwich-norm block with plain-weight norms, a fused
gate/up MLP, q/k/v biases and rope over the first half of each head, its pairs interleaved. GLM-4-9B (`glm`, the
first GLM-4's transformers port): the same attention and MLP in a plain pre-norm block."""

from __future__ import annotations

import torch

from engine_server.config import ModelConfig
from engine_server.models.interleaved_rope import InterleavedRopeCausalLM
from engine_server.parallel.group import SINGLE, TensorParallel

# GLM-4's norms as Gemma's sandwich names them (in this order: the first frees the name the second takes).
GLM4_SANDWICH_RENAMES = (
    (".post_attention_layernorm.", ".pre_feedforward_layernorm."),
    (".post_self_attn_layernorm.", ".post_attention_layernorm."),
    (".post_mlp_layernorm.", ".post_feedforward_layernorm."),
)


class Glm4ForCausalLM(InterleavedRopeCausalLM):
    """GLM-4 (`glm4`): each block `h += post_self_attn(attn(input(h))); h += post_mlp(mlp(post_attention(h)))`, the
    shared `SandwichDecoderLayer` (`ModelConfig.sandwich_norms`) under its own names (read as Gemma's:
    `post_self_attn_layernorm` is the norm after the attention, `post_attention_layernorm` the one before the MLP,
    `post_mlp_layernorm` the one after it). Rope turns interleaved pairs of each head's first `rotary_dim` dims,
    read as halves at load (`InterleavedRopeCausalLM`). GLM-4-9B's (`glm`; no `sandwich_norms`): Llama's two norms
    under Llama's names."""

    checkpoint_renames: tuple[tuple[str, str], ...] = GLM4_SANDWICH_RENAMES

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        if not config.sandwich_norms:
            self.checkpoint_renames = ()
