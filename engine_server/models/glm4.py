"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Gemma's sandwich-norm block with plain-weight norms, a fused
gate/up MLP, q/k/v biases and rope over the first half of each head, its pairs interleaved."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.layers import CheckpointTensor
from kernels.reference import unpermute_rope_rows

_QUERY_KEY = re.compile(r".+\.self_attn\.[qk]_proj\.(?:weight|bias)")


class Glm4ForCausalLM(CausalLM):
    """GLM-4 (`glm4`): each block `h += post_self_attn(attn(input(h))); h += post_mlp(mlp(post_attention(h)))`, the
    shared `SandwichDecoderLayer` (`ModelConfig.sandwich_norms`) under its own names (read as Gemma's:
    `post_self_attn_layernorm` is the norm after the attention, `post_attention_layernorm` the one before the MLP,
    `post_mlp_layernorm` the one after it). Rope turns interleaved pairs of each head's first `rotary_dim` dims,
    which the shared rotary reads as halves: those rows of q_proj and k_proj (and their biases) are reordered so at
    load, the other rows left where they are (the same order on both sides leaves each score unchanged)."""

    checkpoint_renames = (
        (".post_attention_layernorm.", ".pre_feedforward_layernorm."),
        (".post_self_attn_layernorm.", ".post_attention_layernorm."),
        (".post_mlp_layernorm.", ".post_feedforward_layernorm."),
    )

    def load_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> None:
        """`CausalLM.load_weights` with each head's turned q/k rows in halves order."""
        super().load_weights(self._halves(weights), replaced)

    def _halves(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        head_dim, rotary_dim = self.config.head_dim, self.config.rotary_dim
        for name, tensor in weights:
            if _QUERY_KEY.fullmatch(name):
                heads = tensor.shape[0] // head_dim
                yield name, reordered_tensor(
                    tensor, functools.partial(unpermute_rope_rows, n_head=heads, rotary_dim=rotary_dim)
                )
            else:
                yield name, tensor
