"""GPT-J (6B) and the models trained in its shape: the parallel block off one LayerNorm, rope over the first
`rotary_dim` dims of each head with its pairs interleaved, an LM head with a bias."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from engine_server.models.gpt_neox import MASK_BUFFERS
from engine_server.models.interleaved_rope import InterleavedRopeCausalLM
from engine_server.parallel.layers import CheckpointTensor

# GPT-J's checkpoint names and Llama's (its `transformer.h.<n>` layers, `attn`, `fc_in` / `fc_out`).
_LLAMA_NAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".ln_1.", ".input_layernorm."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".attn.", ".self_attn."),
    (".mlp.fc_in.", ".mlp.up_proj."),
    (".mlp.fc_out.", ".mlp.down_proj."),
)


class GPTJForCausalLM(InterleavedRopeCausalLM):
    """GPT-J (`model_type` gptj): its quirks are `ModelConfig` fields the shared layers read
    (`hf_classic.classic_fields`: LayerNorms with biases, `parallel_block`, an ungated GELU (tanh) MLP with biases,
    `lm_head_bias`, rope over `rotary_dim` of each head as `partial_rotary_factor`); q/k/v and o_proj have no biases.
    Its names are read as Llama's first, so that each head's turned q/k rows are then read from interleaved pairs
    into halves (`InterleavedRopeCausalLM`)."""

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Llama's names, the mask buffers left out, then the q/k rows in halves order."""
        return super().checkpoint_weights(_llama_named(weights), replaced)


def _llama_named(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    for name, tensor in weights:
        if name.endswith(MASK_BUFFERS):  # the first checkpoints' causal masks, which transformers reads neither
            continue
        for theirs, ours in _LLAMA_NAMES:
            name = name.replace(theirs, ours)
        yield name, tensor
