"""Llama 4 (Scout, Maverick; text): Llama's block with NoPE every fourth layer, weightless q/k norms and attention
temperature, and a mixture of experts whose router scales each chosen expert's input, beside a shared expert."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

from engine_server.models.base import CausalLM, reordered_tensor, text_model_weights
from engine_server.parallel.layers import CheckpointTensor
from ladle_kernels.reference import unpermute_rope_rows

_SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")  # its vision tower and projection, not read
# The experts as Llama 4 checkpoints store them: `gate_up_proj` `[E, H, 2I]` (the gate's columns first), `down_proj`
# `[E, I, H]`; and q/k projections whose rope pairs are interleaved.
_EXPERTS = re.compile(r".+\.mlp\.experts\.(?:gate_up_proj|down_proj)")
_QUERY_KEY = re.compile(r".+\.self_attn\.[qk]_proj\.(?:weight|bias)")


class Llama4ForCausalLM(CausalLM):
    """Llama 4's text model (`llama4_text`, or a multimodal `llama4` checkpoint's `language_model.`, its vision
    tower not read). Its quirks are `ModelConfig`'s: `nope_layers`, `qk_unit_norm`, the NoPE layers' temperature,
    `moe_input_scaled` (the router is `feed_forward.router`, read as `mlp.gate`; `feed_forward` as `mlp`), ungated
    shared experts, dense layers of `intermediate_size_mlp` between the sparse ones (Maverick). Rope turns
    interleaved pairs of each head's dims, which the shared rotary reads as halves: the rows of q_proj and k_proj
    are reordered so at load (the same order on both sides leaves each score unchanged). A GGUF file's experts come
    one tensor per expert (`loader.gguf_convert`), as the shared loading takes them."""

    checkpoint_renames = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights in the shared layouts."""
        return super().checkpoint_weights(self._shared_layouts(weights), replaced)

    def _shared_layouts(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        for name, tensor in text_model_weights(weights, _SKIPPED_PREFIXES):
            ours = self.checkpoint_name(name)
            if _EXPERTS.fullmatch(ours):  # [E, 2I, H] gate rows first, [E, H, I]
                yield ours, reordered_tensor(tensor, lambda bank: bank.transpose(1, 2), transposed=True)
            elif _QUERY_KEY.fullmatch(ours):  # each head's interleaved rope pairs as halves
                heads = tensor.shape[0] // self.config.head_dim
                yield ours, reordered_tensor(tensor, functools.partial(unpermute_rope_rows, n_head=heads))
            else:
                yield ours, tensor

