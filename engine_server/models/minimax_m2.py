"""MiniMax-M2 (and M2.1, M2.5): many small experts chosen by sigmoid scores with a load-balancing bias, under
grouped-query attention with q/k norms over the whole projection and rope over part of each head."""

from __future__ import annotations

from engine_server.models.deepseek_v3 import DeepseekV3ForCausalLM


class MiniMaxM2ForCausalLM(DeepseekV3ForCausalLM):
    """MiniMax-M2 (`minimax_m2`): attention with OLMoE's q/k norms (over every head at once, `qk_norm_whole`) and rope
    over `rotary_dim` of each head; every layer's MLP Mixtral's `block_sparse_moe` (experts `w1` / `w3` / `w2`)
    routed as DeepSeek-V3 routes in one group (`layers.moe.GroupedTopkRouter`: sigmoid scores, the block's
    `e_score_correction_bias` added for the choice only, the chosen scores renormalised; no shared expert). Its
    multi-token-prediction modules after the last layer (`model.layers.<n>` from `num_hidden_layers` on) are not
    read, as DeepSeek-V3's."""

    checkpoint_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )
