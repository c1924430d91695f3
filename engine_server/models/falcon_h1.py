"""TII's Falcon-H1 (0.5B to 34B, Falcon-H1R): attention and Mamba-2 side by side in every layer
(`layers.hybrid_head`), a SwiGLU MLP after them, and µP multipliers throughout, folded into the weights here."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.config import FalconH1Scales, ModelConfig
from engine_server.layers.hybrid_head import HybridHeadModel
from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor

# A layer's tensor that one of Falcon-H1's multipliers scales: (module, kind) after `model.layers.N.`.
_LAYER_TENSOR = re.compile(r"model\.layers\.\d+\.(?P<module>[a-z_]+\.[a-z_]+)\.(?P<kind>weight|bias)")


class FalconH1ForCausalLM(CausalLM):
    """Falcon-H1 (`falcon_h1`): each layer is `h += attn(norm(h)) * m_attn_out + mamba(norm(h)) * m_ssm_out;
    h += mlp(norm(h))`, attention reading `norm(h) * m_attn_in` and keys times `m_key`, Mamba-2 reading `norm(h) *
    m_ssm_in` and its input projection's five parts each times its own multiplier, the MLP's gate and output times
    theirs (`ModelConfig.falcon_h1`). Each multiplier is folded into the weights (and biases) it multiplies as they
    load, so the layers compute plainly; the embeddings' and the logits' are `embedding_multiplier` and
    `logit_scale`. Checkpoint names: `feed_forward` is the MLP, `pre_ff_layernorm` the norm before it,
    `final_layernorm` the model's; Mamba-2's `A_log`, `dt_bias` and `D` are `HeadSlice`s."""

    decoder_class = HybridHeadModel
    checkpoint_renames = (
        *((f".mamba.{kind}", f".mamba.{kind}.weight") for kind in ("A_log", "dt_bias", "D")),
        (".feed_forward.", ".mlp."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        ("model.final_layernorm.", "model.norm."),
    )

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        if config.falcon_h1 is None or config.mamba2 is None:
            raise ValueError("Falcon-H1 needs its multipliers and its Mamba-2 shape (ModelConfig.falcon_h1, mamba2)")
        super().__init__(config, dtype, tp)
        self.scales = _scales(config.falcon_h1, config)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Each tensor a multiplier scales, scaled (unread until loading reads it); the rest as they are."""
        return super().checkpoint_weights(self._scaled(weights), replaced)

    def _scaled(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        for name, tensor in weights:
            match = _LAYER_TENSOR.fullmatch(name)
            scale = None if match is None else self.scales.get((match["module"], match["kind"]))
            if scale is None:
                yield name, tensor
            else:
                yield name, reordered_tensor(tensor, functools.partial(_times, factor=scale))


def _scales(scales: FalconH1Scales, config: ModelConfig) -> dict[tuple[str, str], torch.Tensor]:
    """What multiplies each scaled tensor, by (module, kind): a scalar, or for Mamba-2's input projection one factor
    per output row (z, x, B, C, dt). Multipliers of 1 are left out, so their tensors pass through unchanged."""
    assert config.mamba2 is not None
    mamba = config.mamba2
    widths = (mamba.inner, mamba.inner, mamba.groups * mamba.state_dim, mamba.groups * mamba.state_dim,
              mamba.num_heads)  # fmt: skip
    rows = torch.cat([torch.full((width,), factor, dtype=torch.float64) for width, factor in zip(
        widths, scales.ssm, strict=True)]) * scales.ssm_in  # fmt: skip
    scalars = {
        ("self_attn.q_proj", "weight"): scales.attention_in,
        ("self_attn.k_proj", "weight"): scales.attention_in * scales.key,
        ("self_attn.k_proj", "bias"): scales.key,
        ("self_attn.v_proj", "weight"): scales.attention_in,
        ("self_attn.o_proj", "weight"): scales.attention_out,
        ("self_attn.o_proj", "bias"): scales.attention_out,
        ("mamba.out_proj", "weight"): scales.ssm_out,
        ("feed_forward.gate_proj", "weight"): scales.mlp_gate,
        ("feed_forward.down_proj", "weight"): scales.mlp_down,
    }
    found = {key: torch.tensor(factor, dtype=torch.float64) for key, factor in scalars.items() if factor != 1.0}
    if bool((rows != 1.0).any()):
        found[("mamba.in_proj", "weight")] = rows[:, None]
    return found


def _times(tensor: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """`tensor * factor` (a scalar, or a column of row factors), computed in float32 and kept in `tensor`'s dtype."""
    if factor.dim() and factor.shape[0] != tensor.shape[0]:
        raise ValueError(f"has {tensor.shape[0]} rows; Mamba-2's input projection has {factor.shape[0]}")
    return (tensor.float() * factor.float()).to(tensor.dtype)
