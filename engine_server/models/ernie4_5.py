"""ERNIE 4.5 (dense: ERNIE-4.5-0.3B; experts: ERNIE-4.5-21B-A3B, 300B-A47B): Llama's block with rope over each whole
head, its pairs interleaved; the mixtures of experts route by softmax scores plus a load-balancing bias."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator

from engine_server.loader.lazy_tensor import LazyTensor, derived
from engine_server.models.interleaved_rope import InterleavedRopeCausalLM
from engine_server.parallel.layers import CheckpointTensor, read_whole


class Ernie4_5ForCausalLM(InterleavedRopeCausalLM):
    """ERNIE 4.5 (`ernie4_5`): Llama's pre-norm block without biases (`use_bias`, unset in every release, is refused),
    tied embeddings; rope turns interleaved pairs of each head, read as halves at load (`InterleavedRopeCausalLM`)."""


class Ernie4_5MoeForCausalLM(Ernie4_5ForCausalLM):
    """ERNIE 4.5's mixtures of experts (`ernie4_5_moe`): ERNIE 4.5's attention, then on the layers
    `ModelConfig.dense_layers` leaves out a `layers.moe.GroupedTopkRouter` over softmax scores whose choice adds the
    checkpoint's `mlp.moe_statics.e_score_correction_bias` (`[1, experts]`, read flat as the router's own), beside
    ungated shared experts (`mlp.shared_experts`, read as `mlp.shared_expert`)."""

    checkpoint_renames = (
        (".mlp.shared_experts.", ".mlp.shared_expert."),
        (".mlp.gate.moe_statics.", ".mlp.gate."),  # transformers 5's in-memory name
        (".mlp.moe_statics.", ".mlp.gate."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """`Ernie4_5ForCausalLM.checkpoint_weights` with each routing bias flattened."""
        return super().checkpoint_weights(_flat_routing_biases(weights), replaced)


def _flat_routing_biases(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` with each `moe_statics.e_score_correction_bias` (`[1, experts]`) flat (`[experts]`), unread if it
    came unread."""
    for name, tensor in weights:
        if name.endswith(".moe_statics.e_score_correction_bias"):
            flat = (math.prod(tensor.shape),)
            tensor = derived(tensor, flat, lambda bias: bias.reshape(-1)) if isinstance(tensor, LazyTensor) \
                else read_whole(tensor).reshape(-1)  # fmt: skip
        yield name, tensor
