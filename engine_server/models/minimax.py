"""MiniMax-01 (MiniMax-Text-01, MiniMax-M1): lightning attention (`layers.lightning_attention`) between grouped-query
softmax attention layers, Mixtral's experts on every layer, each block's residuals its normalised inputs, scaled
(`layers.decoder.NormedResidualDecoderLayer`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine_server.models.mixtral import MixtralForCausalLM
from engine_server.parallel.layers import CheckpointTensor

# The decay tables transformers keeps (and saves) beside a lightning layer's weights: derived from the config here.
_DECAY_TABLES = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")


class MiniMaxForCausalLM(MixtralForCausalLM):
    """MiniMax-01, read from transformers' names or its released ones (Mixtral's `block_sparse_moe` with `w1` / `w3` /
    `w2`); a lightning layer's `self_attn` holds `qkv_proj` (each head's q, k and v rows together), `output_gate`,
    `norm` and `out_proj`, its decay tables (`slope_rate`, ...) not read: `config.Lightning.slopes` gives them."""

    # (a lightning layer's `qkv_proj` holds each head's q, k and v together: not the fused q/k/v the loader splits)
    checkpoint_renames = (*MixtralForCausalLM.checkpoint_renames, (".self_attn.qkv_proj.", ".self_attn.qkv_heads."))

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        kept = ((name, tensor) for name, tensor in weights if not name.endswith(_DECAY_TABLES))
        return super().checkpoint_weights(kept, replaced)
