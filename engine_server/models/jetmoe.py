"""JetMoE: a mixture of attention experts (`layers.mixture_of_attention`) and one of MLP experts in every layer."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.layers import CheckpointTensor

# An attention layer's experts' projections, as one bank each: `input_linear` `[E, kv_heads * head_dim, hidden]`
# (queries), `output_linear` `[E, hidden, kv_heads * head_dim]`.
_ATTENTION_BANK = re.compile(r"(?P<layer>.+)\.self_attention\.experts\.(?P<part>input_linear|output_linear)\.weight")


class JetMoeForCausalLM(CausalLM):
    """JetMoE (`jetmoe`), read from transformers' names: each layer's `self_attention` as `self_attn`, its experts'
    banks split into one linear layer per expert (`q_experts.<e>`, `o_experts.<e>`), their router's `layer` as the
    router and their `bias` as `o_bias`; the MLP's experts' `input_linear` / `output_linear` as the experts' gate/up
    and down banks, their router's `layer` as `gate`, their `bias` as `output_bias`."""

    checkpoint_renames = (
        (".self_attention.experts.router.layer.", ".self_attn.router."),
        (".self_attention.experts.bias", ".self_attn.o_bias"),
        (".self_attention.", ".self_attn."),
        (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
        (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
        (".mlp.router.layer.", ".mlp.gate."),
        (".mlp.bias", ".mlp.output_bias"),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        return self._split_banks(weights)

    def _split_banks(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        for name, tensor in weights:
            match = _ATTENTION_BANK.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            part = "q_experts" if match["part"] == "input_linear" else "o_experts"
            for expert in range(int(tensor.shape[0])):
                pick = functools.partial(_expert, expert=expert)
                rows = reordered_tensor(tensor, pick, shape=tuple(tensor.shape[1:]))
                yield f"{match['layer']}.self_attn.{part}.{expert}.weight", rows


def _expert(bank: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert `expert`'s matrix of a bank `[E, out, in]`."""
    return bank[expert].contiguous()
