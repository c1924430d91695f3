"""DBRX (Databricks' DBRX Base and Instruct, 132B with 36B active): Mixtral's shape under other names, with
bias-free LayerNorms, q/k/v in one clamped projection and every expert's projection in one tensor per layer."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.loader.lazy_tensor import ComputedSlice, LazyTensor
from engine_server.models.base import CausalLM
from engine_server.parallel.layers import CheckpointTensor

# A layer's experts as DBRX stores them: `w1` (gate) and `v1` (up) `[experts * ffn_hidden_size, d_model]`, the
# experts' rows one after another; `w2` (down) the same shape, each expert's block the transpose of its `down_proj`.
_EXPERT_TENSOR = re.compile(r"(?P<layer>.+)\.ffn\.experts\.mlp\.(?P<proj>w1|v1|w2)")
_EXPERT_PROJECTIONS = {"w1": "gate_proj", "v1": "up_proj", "w2": "down_proj"}


class DbrxForCausalLM(CausalLM):
    """DBRX (`model_type` dbrx): its quirks are `ModelConfig` fields the shared layers read (`hf_dbrx.dbrx_config`:
    LayerNorms without a bias as `layer_norm`, q/k/v clamped to `clip_qkv`, the softmax's top-k renormalised as
    `norm_topk_prob`). Its checkpoint's `transformer.blocks.<n>` layers are read under Llama's names: `norm_attn_norm`
    holds `norm_1`, the attention (`Wqkv`, read as a fused `qkv_proj` of q, k and v rows as Phi-3's is, and
    `out_proj`) and `norm_2`; `ffn` the router (`router.layer`) and the experts (`experts.mlp.w1`, `v1`, `w2`), split
    into one tensor per expert and projection (`dbrx_experts`)."""

    checkpoint_renames = (
        ("transformer.wte.", "model.embed_tokens."),
        ("transformer.blocks.", "model.layers."),
        ("transformer.norm_f.", "model.norm."),
        (".norm_attn_norm.norm_1.", ".input_layernorm."),
        (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
        (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
        (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
        (".ffn.router.layer.", ".mlp.gate."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The checkpoint's tensors with each layer's experts split (`dbrx_experts`)."""
        return dbrx_experts(weights, self.config.num_experts)


def dbrx_experts(
    weights: Iterable[tuple[str, CheckpointTensor]], experts: int
) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` with each `<layer>.ffn.experts.mlp.{w1,v1,w2}` (all `experts` experts' rows in one tensor) given as
    `<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`, each expert's `w2` block transposed. An unread tensor
    (`LazyTensor`) gives unread parts, each reading its own rows alone when asked (a layer a GGUF file's blocks
    replace: none); every other tensor passes unchanged. ValueError where the rows do not split into `experts`."""
    for name, tensor in weights:
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        rows = int(tensor.shape[0])
        if experts < 1 or rows % experts:
            raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)} does not split into {experts} experts")
        width, down = rows // experts, match["proj"] == "w2"
        projection = f"{match['layer']}.mlp.experts.{{}}.{_EXPERT_PROJECTIONS[match['proj']]}.weight"
        for expert in range(experts):
            yield projection.format(expert), _expert_rows(tensor, expert, width, down)


def _expert_rows(tensor: CheckpointTensor, expert: int, width: int, transposed: bool) -> CheckpointTensor:
    """Expert `expert`'s `width` rows of `tensor` (transposed where `transposed`), unread while `tensor` is."""

    def rows() -> torch.Tensor:
        block = tensor.narrow(0, expert * width, width)
        return block.T if transposed else block

    if not isinstance(tensor, LazyTensor):
        return rows()
    columns = int(tensor.shape[1])
    return LazyTensor(ComputedSlice((columns, width) if transposed else (width, columns), rows))
