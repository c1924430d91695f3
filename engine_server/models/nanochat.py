"""NanoChat (Karpathy's nanochat, as transformers builds it): Llama's block with RMSNorms that have no weight (one over
the embeddings too), per-head q/k norms after a rope turned the other way, an ungated relu² MLP and soft-capped
logits."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.layers import CheckpointTensor
from ladle_kernels.reference import swapped_rope_halves

_QUERY_KEY = re.compile(r".+\.self_attn\.[qk]_proj\.(?:weight|bias)")


class NanoChatForCausalLM(CausalLM):
    """NanoChat: its quirks are `ModelConfig`'s (`embedding_norm`, `qk_norm_after_rope`, `hidden_act` relu²,
    `final_logit_softcap`) and three at load. Its MLP's `fc1` / `fc2` read as the ungated MLP's `up_proj` /
    `down_proj`. Each head's q/k rows come with their halves swapped (`ladle_kernels.reference.swapped_rope_halves`: its
    rope turns each pair by minus its angle, the shared rotary by plus; LoRA updates likewise, `lora.peft_format`). Its
    norms have no weight: the checkpoint holds none, and each norm reads ones."""

    checkpoint_renames = ((".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj."))

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The checkpoint's tensors, q/k rows reordered, then a weight of ones for each norm."""
        return super().checkpoint_weights(self._with_unit_norms(self._swapped(weights)), replaced)

    def _swapped(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        head_dim = self.config.head_dim
        for name, tensor in weights:
            if _QUERY_KEY.fullmatch(name):
                heads = tensor.shape[0] // head_dim
                yield name, reordered_tensor(tensor, functools.partial(swapped_rope_halves, n_head=heads))
            else:
                yield name, tensor

    def _with_unit_norms(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        yield from weights
        config = self.config
        hidden, head = torch.ones(config.hidden_size), torch.ones(config.head_dim)
        yield "model.norm.weight", hidden
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            yield f"{prefix}.input_layernorm.weight", hidden
            yield f"{prefix}.post_attention_layernorm.weight", hidden
            yield f"{prefix}.self_attn.q_norm.weight", head
            yield f"{prefix}.self_attn.k_norm.weight", head
