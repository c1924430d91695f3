"""Decoders whose checkpoints hold each head's rope pairs interleaved (`(x0, x1), (x2, x3), ...`: GLM-4's, ERNIE
4.5's), where the shared rotary turns halves (`(x0, x2, ...), (x1, x3, ...)`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.layers import CheckpointTensor
from ladle_kernels.reference import unpermute_rope_rows

_QUERY_KEY = re.compile(r".+\.self_attn\.[qk]_proj\.(?:weight|bias)")


class InterleavedRopeCausalLM(CausalLM):
    """A `CausalLM` that reads each head's first `rotary_dim` rows of q_proj and k_proj (and their biases) from
    interleaved pairs into halves order at load, the other rows left where they are: the same order on both sides
    leaves each score unchanged, and the turned dims are then the pairs the checkpoint turned. A GGUF file's blocks
    are read in that order too (`gguf_quant`), and an adapter's q/k updates likewise (`lora.peft_format`)."""

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Each head's turned q/k rows in halves order (as they are where `ModelConfig.rope_halves` says the
        checkpoint already holds them so: Cohere Compass's)."""
        if self.config.rope_halves:
            return super().checkpoint_weights(weights, replaced)
        return super().checkpoint_weights(self._halves(weights), replaced)

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
