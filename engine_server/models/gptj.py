"""GPT-J (6B) and the models trained in its shape: the parallel block off one LayerNorm, rope over the first
`rotary_dim` dims of each head with its pairs interleaved, an LM head with a bias."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.models.base import reordered_tensor
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


# CodeGen's q/k/v in one projection (`attn.qkv_proj`), its rows laid out by the 4 shards it was trained in: each
# shard's block holds its heads' query rows, then their value rows, then their key rows.
_CODEGEN_QKV = re.compile(r"(?P<layer>transformer\.h\.\d+)\.attn\.qkv_proj\.weight")
_CODEGEN_SHARDS = 4
_CODEGEN_PARTS = {"q_proj": 0, "v_proj": 1, "k_proj": 2}


class GPTJForCausalLM(InterleavedRopeCausalLM):
    """GPT-J (`model_type` gptj): its quirks are `ModelConfig` fields the shared layers read
    (`hf_classic.classic_fields`: LayerNorms with biases, `parallel_block`, an ungated GELU (tanh) MLP with biases,
    `lm_head_bias`, rope over `rotary_dim` of each head as `partial_rotary_factor`); q/k/v and o_proj have no biases.
    Its names are read as Llama's first, so that each head's turned q/k rows are then read from interleaved pairs
    into halves (`InterleavedRopeCausalLM`). CodeGen (`codegen`) is this block with q/k/v in one projection
    (`codegen_projections`) and an LM head with a bias."""

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Llama's names (CodeGen's q/k/v apart, `codegen_projections`), the mask buffers left out, then the q/k rows
        in halves order."""
        return super().checkpoint_weights(_llama_named(codegen_projections(weights)), replaced)


def codegen_projections(
    weights: Iterable[tuple[str, CheckpointTensor]],
) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` with each of CodeGen's `attn.qkv_proj.weight` (`[3 * hidden, hidden]`: per training shard, its heads'
    query, value and key rows) given as GPT-J's `attn.q_proj`, `k_proj` and `v_proj` weights, each `[hidden,
    hidden]` with its heads in order (shard by shard, as CodeGen reshapes them); unread while it is. Every other
    tensor passes unchanged."""
    for name, tensor in weights:
        match = _CODEGEN_QKV.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        hidden = int(tensor.shape[1])
        for projection, index in _CODEGEN_PARTS.items():
            part = functools.partial(_codegen_part, index=index)
            yield f"{match['layer']}.attn.{projection}.weight", reordered_tensor(tensor, part, shape=(hidden, hidden))


def _codegen_part(qkv: torch.Tensor, index: int) -> torch.Tensor:
    """Rows `index` (0 query, 1 value, 2 key) of every shard's block of CodeGen's fused `qkv`, in shard order."""
    hidden = qkv.shape[1]
    return qkv.reshape(_CODEGEN_SHARDS, 3, -1, hidden)[:, index].reshape(-1, hidden).contiguous()


def _llama_named(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    for name, tensor in weights:
        if name.endswith(MASK_BUFFERS):  # the first checkpoints' causal masks, which transformers reads neither
            continue
        for theirs, ours in _LLAMA_NAMES:
            name = name.replace(theirs, ours)
        yield name, tensor
