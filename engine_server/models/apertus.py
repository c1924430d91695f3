"""Apertus (the Swiss AI Initiative's 8B and 70B): Llama's block with per-head q/k norms before rope (Qwen3's) and an
ungated MLP whose activation, xIELU, is learned per layer."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class ApertusForCausalLM(CausalLM):
    """Apertus: its quirks are `ModelConfig`'s (`qk_norm`, `hidden_act` "xielu": `layers.mlp.XIELU` reads each
    layer's `mlp.act_fn.alpha_p` / `alpha_n` / `beta` / `eps`). Its norms read as the shared layers':
    `attention_layernorm` as `input_layernorm`, `feedforward_layernorm` as `post_attention_layernorm`."""

    checkpoint_renames = (
        (".attention_layernorm.", ".input_layernorm."),
        (".feedforward_layernorm.", ".post_attention_layernorm."),
    )
