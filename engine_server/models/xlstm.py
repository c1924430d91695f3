"""xLSTM (NX-AI's xLSTM 7B): mLSTM layers (`layers.mlstm`) before SwiGLU MLPs, each Llama's pre-norm block, no
attention, its logits soft-capped (`hf_xlstm`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from engine_server.models.base import CausalLM
from engine_server.parallel.layers import CheckpointTensor, read_whole


class XLstmForCausalLM(CausalLM):
    """xLSTM (`xlstm`), read from transformers' names: `backbone.embeddings`, each block's `norm_mlstm` (the input
    norm), `mlstm_layer` (the token mixer), `norm_ffn` and `ffn` (`proj_up_gate`, `proj_up`, `proj_down`), and
    `backbone.out_norm`; a `weight_mode` "fused" checkpoint's joined projections (`qkv_opreact`, `ifgate_preact`,
    `proj_up_gate_z`) split into those parts as they load."""

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

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The checkpoint's tensors, fused projections split (class doc)."""
        return self._split_fused(weights)

    def _split_fused(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        spec = self.config.mlstm
        assert spec is not None
        qk, v = spec.heads * spec.qk_head_dim, spec.heads * spec.v_head_dim
        parts = {
            ".mlstm_layer.qkv_opreact.": ((".mlstm_layer.q.", qk), (".mlstm_layer.k.", qk), (".mlstm_layer.v.", v),
                                          (".mlstm_layer.ogate_preact.", v)),
            ".mlstm_layer.ifgate_preact.": ((".mlstm_layer.igate_preact.", spec.heads),
                                            (".mlstm_layer.fgate_preact.", spec.heads)),
            ".ffn.proj_up_gate_z.": ((".ffn.proj_up_gate.", self.config.intermediate_size),
                                     (".ffn.proj_up.", self.config.intermediate_size)),
        }  # fmt: skip
        for name, tensor in weights:
            fused = next((key for key in parts if key in name), None)
            if fused is None:
                yield name, tensor
                continue
            whole, start = read_whole(tensor), 0
            if whole.shape[0] != sum(rows for _, rows in parts[fused]):
                raise ValueError(f"weight {name!r} of shape {tuple(whole.shape)}: its parts do not add up")
            for part, rows in parts[fused]:
                yield name.replace(fused, part), whole[start : start + rows]
                start += rows
