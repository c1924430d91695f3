"""LongCat-Flash (Meituan): each of its layers two blocks of DeepSeek-V3's latent attention and a dense MLP, with a
mixture of experts beside them (ScMoE: read off the first block's normalised MLP input, added to the second's
output), whose router also picks zero-computation experts (`layers.moe.SparseMoE`'s `zero_experts`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.decoder import DecoderLayer, DecoderModel
from engine_server.layers.moe import SparseMoE
from engine_server.lora.slots import LoraBatch
from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels.kernel_set import KernelOps

# A checkpoint layer's two blocks' parts (`self_attn.<i>.`, `mlps.<i>.`, the norms' `.<i>.`) and its experts
# (`mlp.router.classifier`, `mlp.router.e_score_correction_bias`, `mlp.experts.`).
_BLOCK_PART = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<part>self_attn|mlps|input_layernorm|post_attention_layernorm)\.(?P<block>[01])"
    r"\.(?P<rest>.+)"
)
_EXPERTS = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.(?P<rest>router\.classifier\..+|router\.e_score_correction_"
                      r"bias|experts\..+)")  # fmt: skip


class LongcatDecoderLayer(DecoderLayer):
    """One block (module doc): latent attention and a dense MLP; a pair's first (an even layer) also holds the
    pair's experts (`shortcut`)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        self.shortcut = SparseMoE(config, dtype, tp) if index % 2 == 0 else None

    def shortcut_forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        shortcut: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`DecoderLayer.forward`'s (MLP output, residual) pair, and the pair's experts' output: computed here on a
        pair's first block (from its MLP's input) and returned, added to the MLP's output on its second (`shortcut`
        then the first's) and None after it."""
        attended, residual = self.attend(positions, hidden, residual, kv_cache, cos_sin_cache, meta, ops)
        normed, residual = self.post_attention_layernorm.add_and_norm(attended, residual, ops)
        out = self.feed_forward(normed, ops, None)
        if self.shortcut is not None:
            return out, residual, self.shortcut(normed, ops)
        assert shortcut is not None, "a pair's second block adds its first one's experts"
        return out + shortcut, residual, None


class LongcatDecoderModel(DecoderModel):
    """`DecoderModel` of `LongcatDecoderLayer`s, each pair's experts carried from its first block to its second. No
    decode stack runs it (latent attention)."""

    layer_class = LongcatDecoderLayer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
        interrupt: StepInterrupt | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """As `DecoderModel.forward` (no LoRA adapters: the engine refuses them on latent attention)."""
        hidden = self.embed(input_ids, positions, ops)
        residual: torch.Tensor | None = None
        shortcut: torch.Tensor | None = None
        cos_sin = self.get_buffer("cos_sin_cache")
        rope_rows = self.rope_rows(positions, meta)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, LongcatDecoderLayer)
            hidden, residual, shortcut = layer.shortcut_forward(
                rope_rows, hidden, residual, kv_cache, cos_sin, meta, ops, shortcut
            )
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        assert residual is not None, "a model has at least one layer"
        hidden, _ = self.norm.add_and_norm(hidden, residual, ops)
        return hidden


class LongcatFlashForCausalLM(CausalLM):
    """LongCat-Flash (module doc), read from transformers' names (its released checkpoints' too: one tensor per
    expert, as Qwen2-MoE's): a checkpoint layer's blocks as two of this engine's layers, its experts on the first;
    its latent attention's LoRA scales (`sqrt(hidden / q_lora_rank)` on the queries, `sqrt(hidden / kv_lora_rank)`
    on the normalised latent) folded into `q_b_proj` and `kv_a_layernorm` at load. The multi-token-prediction layer
    (`model.mtp.`) is not read."""

    decoder_class = LongcatDecoderModel
    ignored_prefixes = ("model.mtp.",)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        mla = config.latent_attention
        assert mla is not None and mla.q_lora_rank, "LongCat-Flash's attention is latent, its queries low-rank"
        self.query_scale = (config.hidden_size / mla.q_lora_rank) ** 0.5
        self.latent_scale = (config.hidden_size / mla.kv_lora_rank) ** 0.5

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        return super().checkpoint_weights(self._blocks(weights), replaced)

    def _blocks(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        for name, tensor in weights:
            block = _BLOCK_PART.fullmatch(name)
            experts = _EXPERTS.fullmatch(name)
            if block is not None:
                part = "mlp" if block["part"] == "mlps" else block["part"]
                name = f"model.layers.{2 * int(block['layer']) + int(block['block'])}.{part}.{block['rest']}"
            elif experts is not None:
                rest = experts["rest"].replace("router.classifier.", "gate.").replace("router.", "gate.")
                name = f"model.layers.{2 * int(experts['layer'])}.shortcut.{rest}"
            if name.endswith(".self_attn.q_b_proj.weight"):
                tensor = reordered_tensor(tensor, functools.partial(torch.mul, other=self.query_scale))
            elif name.endswith(".self_attn.kv_a_layernorm.weight"):
                tensor = reordered_tensor(tensor, functools.partial(torch.mul, other=self.latent_scale))
            yield name, tensor
