"""BitNet b1.58 (Microsoft's bitnet-b1.58-2B-4T): Llama's layers with an RMSNorm before o_proj and before down_proj,
a gated relu² MLP, and (its checkpoints' `quantization_config` "bitnet") ternary projections whose inputs are rounded
to int8 per token (`ModelConfig.ternary_projections`, `layers.mlp.int8_rows`)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.config import ModelConfig, TernaryForm
from engine_server.loader.lazy_tensor import whole
from engine_server.models.llama import LlamaForCausalLM
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor

# The projections BitNet's quantization replaces (every linear layer but the LM head).
_PROJECTION = re.compile(r"model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)")


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """transformers' packed ternary weight (`BitLinear`: uint8 `[rows / 4, in]`, value i of each byte, bits 2i, the
    row `i * rows / 4 + r` of the weight, stored plus one) as its float32 values in {-1, 0, 1}, `[rows, in]`."""
    bytes_ = packed.to(torch.uint8)
    return torch.cat([((bytes_ >> (2 * i)) & 3).float() - 1 for i in range(4)])


def ternarized(weight: torch.Tensor) -> torch.Tensor:
    """A float weight as BitNet's online quantization serves it (transformers' `WeightQuant`): in float32, `s =
    1 / mean(|w|)` (at least 1e-5 below), `round(w s).clamp(-1, 1) / s`."""
    weight = weight.float()
    scale = 1.0 / weight.abs().mean().clamp(min=1e-5)
    return (weight * scale).round().clamp(-1, 1) / scale


class BitNetForCausalLM(LlamaForCausalLM):
    """BitNet (module doc). Its projections' weights are read as the float values they serve: a packed checkpoint's
    (`linear_class` "bitlinear": uint8, four ternary values a byte) unpacked and divided by its `weight_scale`; an
    offline `autobitlinear` one's ternary weights times theirs; an online one's float weights ternarized at load (a
    scale per tensor, `ternarized`). Tensor parallelism is refused (a token's int8 rounding takes its whole row)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        if tp.size > 1:
            raise ValueError("BitNet is not served under tensor parallelism yet")
        super().__init__(config, dtype, tp)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        form = self.config.ternary_projections
        return super().checkpoint_weights(self._ternary(weights, form) if form else weights, replaced)

    def _ternary(
        self, weights: Iterable[tuple[str, CheckpointTensor]], form: TernaryForm
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        pending: dict[str, dict[str, CheckpointTensor]] = {}
        for name, tensor in weights:
            stem, _, kind = name.rpartition(".")
            if _PROJECTION.fullmatch(stem) is None or kind not in ("weight", "weight_scale"):
                yield name, tensor
                continue
            if form == "online":
                if kind == "weight_scale":
                    raise ValueError(f"weight {name!r}: an online BitNet checkpoint holds no scales")
                yield name, ternarized(whole(tensor))
                continue
            parts = pending.setdefault(stem, {})
            parts[kind] = tensor
            if len(parts) == 2:
                weight, scale = whole(parts["weight"]), whole(parts["weight_scale"]).float().reshape(())
                del pending[stem]
                values = unpack_ternary(weight) / scale if form == "packed" else weight.float() * scale
                yield f"{stem}.weight", values
        if pending:
            stem = sorted(pending)[0]
            raise ValueError(f"BitNet projection {stem!r} has its weight or its weight_scale alone")
