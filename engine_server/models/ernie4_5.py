"""ERNIE 4.5's dense models (ERNIE-4.5-0.3B): Llama's block with rope over each whole head, its pairs interleaved."""

from __future__ import annotations

from engine_server.models.interleaved_rope import InterleavedRopeCausalLM


class Ernie4_5ForCausalLM(InterleavedRopeCausalLM):
    """ERNIE 4.5 (`ernie4_5`): Llama's pre-norm block without biases (`use_bias`, unset in every release, is refused),
    tied embeddings; rope turns interleaved pairs of each head, read as halves at load (`InterleavedRopeCausalLM`)."""
