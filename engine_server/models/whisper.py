"""Whisper's decoder (`WhisperForConditionalGeneration`'s `model.decoder`) over the shared layers: the GPT/OPT
lineage's block (LayerNorms with biases, learned positions from position 0, an ungated GELU MLP, q/v/o biases), its LM
head the token embeddings (transformers ties `proj_out` to them). Each layer's cross-attention over the clip's encoder
states (`encoder_attn`, its LayerNorm) and the encoder itself are `multimodal.whisper`'s: they run inside the layers
(`layers.cross_attention.CrossAttention.inside`) on steps that carry them, in float beside a quantized decoder."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.models.base import CausalLM
from engine_server.parallel.layers import CheckpointTensor

# A decoder layer's key projection, which has no bias in Whisper (`WhisperAttention.k_proj`): a zero bias is loaded
# (the shared attention's q/k/v biases come together; a constant added to every key moves no softmax anyway).
_KEY_WEIGHT = re.compile(r"model\.decoder\.layers\.(?P<layer>\d+)\.self_attn\.k_proj\.weight")
# What the decoder does not read: the encoder, the layers' cross-attention, the tied head.
_NOT_DECODER = re.compile(
    r"model\.encoder\..+|model\.decoder\.layers\.\d+\.encoder_attn(?:_layer_norm)?\..+|proj_out\..+"
)


class WhisperForConditionalGeneration(CausalLM):
    """Whisper's decoder: its checkpoint names read as the shared layers' (`checkpoint_renames`), its encoder and
    cross-attention tensors passed over (`multimodal.whisper.WhisperAudioEncoder` loads them), a zero key bias."""

    checkpoint_renames = (
        ("model.decoder.embed_tokens.", "model.embed_tokens."),
        ("model.decoder.embed_positions.", "model.embed_positions."),
        ("model.decoder.layer_norm.", "model.norm."),
        ("model.decoder.layers.", "model.layers."),
        (".self_attn_layer_norm.", ".input_layernorm."),
        (".final_layer_norm.", ".post_attention_layernorm."),
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".fc1.", ".mlp.up_proj."),
        (".fc2.", ".mlp.down_proj."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """The decoder's tensors, each key projection followed by its zero bias; the rest passed over."""
        for name, tensor in weights:
            if _NOT_DECODER.fullmatch(name):
                continue
            yield name, tensor
            key = _KEY_WEIGHT.fullmatch(name)
            if key is not None:
                yield f"model.decoder.layers.{key['layer']}.self_attn.k_proj.bias", torch.zeros(tensor.shape[0])
