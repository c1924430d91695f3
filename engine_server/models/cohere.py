"""Cohere's Command models (Command R / R+ as `cohere`; Command R7B and Command A as `cohere2`): the attention and
the MLP in parallel off one LayerNorm, rope over interleaved pairs, the logits scaled."""

from __future__ import annotations

from engine_server.models.interleaved_rope import InterleavedRopeCausalLM


class CohereForCausalLM(InterleavedRopeCausalLM):
    """Cohere (`cohere`, `cohere2`): each block `h += attn(ln(h)) + mlp(ln(h))` (`layers.decoder.ParallelDecoderLayer`)
    with mean-centred LayerNorms without biases (`layers.norm.LayerNorm`), tied embeddings, the logits times
    `logit_scale`; rope turns interleaved pairs of each head, read as halves at load (`InterleavedRopeCausalLM`).
    Command R7B and Command A (`cohere2`) window three layers in four and turn no rope on the others
    (`ModelConfig.nope_layers`)."""
