"""IBM's Granite mixtures of experts (Granite 3.0 MoE, with a shared MLP or without) and Granite 4.0's hybrids of
Mamba-2 (`layers.mamba2`) and attention: Granite's multiplied block under names of their own; Bamba, the hybrid
Granite 4.0 was built from, in the same layout."""

from __future__ import annotations

import torch

from engine_server.config import ModelConfig
from engine_server.models.base import CausalLM
from engine_server.parallel.group import SINGLE, TensorParallel

# The experts' banks and router as Granite's checkpoints hold them (`block_sparse_moe.input_linear` `[E, 2I, H]`, gate
# rows then up rows; `output_linear` `[E, H, I]`; `router.layer`), and as transformers 5 names them.
_EXPERT_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
    (".block_sparse_moe.router.", ".mlp.gate."),
    (".block_sparse_moe.experts.", ".mlp.experts."),
)


class GraniteMoeForCausalLM(CausalLM):
    """Granite MoE (`granitemoe`), Granite MoE with a shared MLP (`granitemoeshared`) and Granite 4.0
    (`granitemoehybrid`): Granite's multipliers (embeddings, attention scale, residuals, logits); each layer's MLP is
    a mixture of experts (`block_sparse_moe`: softmax over the top-k logits) beside the shared MLP (`shared_mlp`, its
    `input_linear` gate rows then up rows: read as an ungated shared expert), or the shared MLP alone where the model
    has no experts (Granite 4.0's dense models). Granite 4.0's Mamba-2 layers (checkpoint `mamba`) take the token
    mixer's place (`ModelConfig.mamba2`); its H models' attention turns no rope. Bamba (`bamba`, read as this layout
    by `hf_config._bamba_config`) names its dense MLP `feed_forward`, the norm before it `pre_ff_layernorm` and the
    final one `final_layernorm`. Granite-MoE SWA (`granitemoe_swa`) is Granite MoE with a shared MLP under Granite
    SWA's attention (windows, sinks, a rope base per layer: `ModelConfig`'s)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        shared = ".mlp.shared_expert." if config.num_experts else ".mlp."
        self.checkpoint_renames = (
            *((f".mamba.{kind}", f".self_attn.{kind}.weight") for kind in ("A_log", "dt_bias", "D")),  # HeadSlices
            (".mamba.", ".self_attn."),
            *_EXPERT_RENAMES,
            (".shared_mlp.input_linear.", f"{shared}gate_up_proj."),
            (".shared_mlp.output_linear.", f"{shared}down_proj."),
            # Bamba's names for what Granite 4.0 calls its dense MLP, the norm before it and the final norm.
            (".feed_forward.", ".mlp."),
            (".pre_ff_layernorm.", ".post_attention_layernorm."),
            ("model.final_layernorm.", "model.norm."),
        )
