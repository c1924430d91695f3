"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Gemma's sandwich-norm block with plain-weight norms, a fused
gate/up MLP, q/k/v biases and rope over the first half of each head, its pairs interleaved."""

from __future__ import annotations

from engine_server.models.interleaved_rope import InterleavedRopeCausalLM

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
    read as halves at load (`InterleavedRopeCausalLM`)."""

    checkpoint_renames = GLM4_SANDWICH_RENAMES
