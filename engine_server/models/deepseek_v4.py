"""DeepSeek-V4 (V4-Flash, V4-Pro): sliding-window attention with compressed entries of earlier positions
(`layers.compressed_attention`), over mHC residual streams (`layers.hyper_connections`), every layer's MLP a mixture
of experts with a shared one, the first layers' experts chosen by token id."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.config import ModelConfig
from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor

# DeepSeek's names (its released checkpoints; transformers saves them too, under `model.`): `attn` / `ffn` blocks,
# Mixtral-style `w1` / `w2` / `w3`, as transformers names them, in the order its conversion applies them: (pattern,
# replacement) over a name without its `model.` prefix. Each leaves transformers' own names as they are.
_DEEPSEEK_NAMES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.indexer\.compressor\.", ".compressor.indexer."),
        (r"^embed\.weight$", "embed_tokens.weight"),
        (r"^head\.weight$", "lm_head.weight"),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
        (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
        (r"\.attn_sink$", ".sinks"),
        (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
        (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape$", ".position_bias"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.wq_b\.", ".q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.(experts\.\d+|shared_experts)\.w1\.", r".\1.gate_proj."),
        (r"\.(experts\.\d+|shared_experts)\.w2\.", r".\1.down_proj."),
        (r"\.(experts\.\d+|shared_experts)\.w3\.", r".\1.up_proj."),
    )
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def transformers_name(name: str) -> str:
    """A DeepSeek-V4 checkpoint tensor's name as transformers names it in memory: DeepSeek's names (a released
    checkpoint's, or transformers' saved files') renamed, transformers' own unchanged."""
    name = name.removeprefix("model.")
    for pattern, replacement in _DEEPSEEK_NAMES:
        name = pattern.sub(replacement, name)
    return name if name.startswith("lm_head.") else f"model.{name}"


class DeepseekV4ForCausalLM(CausalLM):
    """DeepSeek-V4 (module doc; `ModelConfig.compressed_attention`), read from transformers' files or DeepSeek's
    released ones (`transformers_name`); the multi-token-prediction layers (`mtp.`) are not read. Its layers run in
    torch on one rank: tensor parallelism is refused (ValueError)."""

    checkpoint_renames = ((".mlp.shared_experts.", ".mlp.shared_expert."),)
    ignored_prefixes = ("mtp.", "model.mtp.")

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        if tp.size > 1:
            raise ValueError("DeepSeek-V4 is not served under tensor parallelism yet")
        assert config.compressed_attention is not None, "DeepSeek-V4's config has its attention's layout"
        super().__init__(config, dtype, tp)
        self.groups = config.compressed_attention.o_groups

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Transformers' names for each tensor, the layers past `num_hidden_layers` (prediction layers) left out."""
        return super().checkpoint_weights(self._named(weights), replaced)

    def _named(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        for name, tensor in weights:
            if name.startswith(self.ignored_prefixes):
                continue
            name = transformers_name(name)
            layer = _LAYER.match(name)
            if layer is not None and int(layer.group(1)) >= self.config.num_hidden_layers:
                continue
            if name.endswith(".self_attn.o_a_proj.weight"):  # one projection a group of heads (`GroupedLinear`)
                yield from _groups(name, tensor, self.groups)
                continue
            yield name, tensor


def _groups(name: str, tensor: CheckpointTensor, groups: int) -> Iterator[tuple[str, CheckpointTensor]]:
    """`o_a_proj.weight` `[groups * rank, in]` as its groups' `o_a_proj.parts.<g>.weight` `[rank, in]` (unread while
    it is)."""
    rank, columns = int(tensor.shape[0]) // groups, int(tensor.shape[1])
    stem = name.removesuffix(".weight")
    for group in range(groups):
        part = functools.partial(_rows, start=group * rank, count=rank)
        yield f"{stem}.parts.{group}.weight", reordered_tensor(tensor, part, shape=(rank, columns))


def _rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return weight[start : start + count].contiguous()
