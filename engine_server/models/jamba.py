"""AI21's Jamba (Jamba 1.5 / 1.6 / 1.7 Mini and Large, Jamba Reasoning 3B): Mamba-1 layers (`layers.mamba1`) with
an attention layer every few (no rope), each followed by a dense MLP or, every other layer, a mixture of experts."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class JambaForCausalLM(CausalLM):
    """Jamba (`jamba`): pre-norm layers whose token mixer is Mamba-1 (checkpoint `mamba`, `ModelConfig.mamba1`) or
    attention without positions (`ModelConfig.nope_layers`: all of them), whose MLP (`feed_forward`) is a SwiGLU or,
    on the expert layers, a mixture of experts (`feed_forward.router`: the top-k of the softmax, not renormalised).
    The norm before the MLP is `pre_ff_layernorm`, the final one `final_layernorm`; Mamba-1's `A_log` and `D` are
    read as its `ChannelRows` and `HeadSlice`."""

    checkpoint_renames = (
        *((f".mamba.{kind}", f".self_attn.{kind}.weight") for kind in ("A_log", "D")),
        (".mamba.", ".self_attn."),
        (".feed_forward.router.", ".mlp.gate."),
        (".feed_forward.", ".mlp."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        ("model.final_layernorm.", "model.norm."),
    )
