"""OLMo Hybrid (AI2): Gated DeltaNet linear attention in pre-norm blocks, three layers in four, between OLMo 3's
post-norm attention layers (q/k norms over the whole projection; no rope in its released checkpoints)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from engine_server.models.base import CausalLM, joined_convolutions
from engine_server.parallel.layers import CheckpointTensor

# A linear layer's convolution of q, k or v, as its checkpoints store them (transformers joins them at load).
_CONV_PART = re.compile(r"(?P<layer>.+\.linear_attn)\.(?P<part>[qkv])_conv1d\.weight")


class OlmoHybridForCausalLM(CausalLM):
    """OLMo Hybrid: its quirks are `ModelConfig`'s (`linear_attention` with the doubled write strength and FLA's norm
    epsilon, `post_norms` on the attention layers alone: `layers.decoder.DecoderModel`, `qk_norm_whole`). A linear
    layer's own projections read as `GatedDeltaNet.in_proj`'s parts (q, k, v; `g_proj` the gate z, `a_proj`,
    `b_proj`), its `o_proj` as `out_proj`, `o_norm` as the gated norm, its q/k/v convolutions (`q_conv1d`, ...)
    as the one convolution over them, and its block's norms (`attention_layer_norm`, `feedforward_layer_norm`) as a
    pre-norm block's; the layer itself as `self_attn`."""

    checkpoint_renames = (
        (".linear_attn.q_proj.", ".self_attn.in_proj_q."),
        (".linear_attn.k_proj.", ".self_attn.in_proj_k."),
        (".linear_attn.v_proj.", ".self_attn.in_proj_v."),
        (".linear_attn.g_proj.", ".self_attn.in_proj_z."),
        (".linear_attn.b_proj.", ".self_attn.in_proj_b."),
        (".linear_attn.a_proj.", ".self_attn.in_proj_a."),
        (".linear_attn.o_proj.", ".self_attn.out_proj."),
        (".linear_attn.o_norm.", ".self_attn.norm."),
        (".linear_attn.", ".self_attn."),
        (".attention_layer_norm.", ".input_layernorm."),
        (".feedforward_layer_norm.", ".post_attention_layernorm."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Each linear layer's q, k and v convolutions as its one `conv1d` (their channels in that order)."""
        return super().checkpoint_weights(joined_convolutions(weights, _CONV_PART), replaced)
