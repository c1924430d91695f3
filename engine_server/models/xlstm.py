"""xLSTM (NX-AI's xLSTM 7B): mLSTM layers (`layers.mlstm`) before SwiGLU MLPs, each Llama's pre-norm block, no
attention, its logits soft-capped (`hf_xlstm`)."""

from __future__ import annotations

from engine_server.models.base import CausalLM


class XLstmForCausalLM(CausalLM):
    """xLSTM (`xlstm`), read from transformers' names: `backbone.embeddings`, each block's `norm_mlstm` (the input
    norm), `mlstm_layer` (the token mixer), `norm_ffn` and `ffn` (`proj_up_gate`, `proj_up`, `proj_down`), and
    `backbone.out_norm`."""

    checkpoint_renames = (
        ("backbone.embeddings.", "model.embed_tokens."),
        ("backbone.blocks.", "model.layers."),
        ("backbone.out_norm.", "model.norm."),
        (".norm_mlstm.", ".input_layernorm."),
        (".mlstm_layer.", ".self_attn."),
        (".norm_ffn.", ".post_attention_layernorm."),
        (".ffn.proj_up_gate.", ".mlp.gate_proj."),
        (".ffn.proj_up.", ".mlp.up_proj."),
        (".ffn.proj_down.", ".mlp.down_proj."),
    )
