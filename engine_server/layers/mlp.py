"""Feed-forward blocks: gated (SwiGLU, or Gemma's GELU-tanh GeGLU) with the gate and up projections fused into one
matmul, or ungated: Nemotron-H's, Arcee's and Jais 2's relu², Apertus's xIELU (learned per layer), the GPT-NeoX
lineage's GELU, OPT's ReLU."""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.config import ModelConfig
from engine_server.layers.norm import RMSNorm
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine_server.parallel.sharding import even_slice, gate_up_slices
from ladle_kernels import reference
from ladle_kernels.kernel_set import KernelOps


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`, act silu or GELU (tanh); `gate_up_proj.weight` is `cat(gate.weight, up.weight)`
    along rows.

    Under tensor parallelism a rank holds the same block of gate and up rows (so SwiGLU applies locally) and the
    matching columns of down, whose partial sums it all-reduces."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        activation: str = "silu",
        limit: float = 0.0,
        sub_norm_eps: float = 0.0,
        int8_inputs: bool = False,
        alpha: float = 1.0,
        up_offset: float = 0.0,
        bias: bool = False,
    ) -> None:
        """`limit` > 0: gpt-oss's clamped SwiGLU (`reference.clamped_swiglu` with `alpha` and `up_offset`);
        `sub_norm_eps` > 0: BitNet's RMSNorm before down_proj (`ffn_sub_norm`, one rank); `int8_inputs`: each
        projection's input rounded to int8 per token first (`int8_rows`); `bias`: every projection has one
        (RecurrentGemma's)."""
        super().__init__()
        self.tp = tp
        # "silu" (SwiGLU, on the kernel set's op), "gelu_tanh" (Gemma's GeGLU) or "relu2" (BitNet's gated relu²)
        self.activation = activation
        self.int8_inputs = int8_inputs
        self.ffn_sub_norm = RMSNorm(intermediate_size, sub_norm_eps, dtype) if sub_norm_eps else None
        # DeepSeek-V4's shared experts (alpha 1, no offset) and MiniMax-M3's MLPs: the gate clamped to at most
        # `limit`, the up to [-limit, limit], then `gate * sigmoid(alpha * gate) * (up + up_offset)`
        self.limit, self.alpha, self.up_offset = limit, alpha, up_offset
        parts = gate_up_slices(intermediate_size, tp.size, tp.rank)
        self.gate_up_proj: nn.Module = ColumnParallelLinear(hidden_size, parts, bias, dtype)
        self.down_proj: nn.Module = RowParallelLinear(intermediate_size, hidden_size, bias, tp, dtype)

    def forward(self, x: torch.Tensor, ops: KernelOps, lora: LayerLora | None = None) -> torch.Tensor:
        """`lora`: the step's LoRA adapters, added to the gate/up and down projections."""
        return self.tp.all_reduce_sum(self.partial(x, ops, lora))

    def partial(self, x: torch.Tensor, ops: KernelOps, lora: LayerLora | None = None) -> torch.Tensor:
        """This rank's partial sum of the output (the whole output at size 1), before the all-reduce."""
        gate_up = self.gate_up_proj(int8_rows(x) if self.int8_inputs else x)
        if lora is not None:
            gate_up = lora.add("gate_up_proj", x, gate_up, ops)
        gated = (
            reference.clamped_swiglu(gate_up, self.alpha, self.limit, self.up_offset) if self.limit > 0
            else ops.silu_and_mul(gate_up) if self.activation == "silu"
            else _relu2_and_mul(gate_up) if self.activation == "relu2"
            else reference.gelu_tanh_and_mul(gate_up)
        )  # fmt: skip
        if self.ffn_sub_norm is not None:
            gated = self.ffn_sub_norm(gated, ops)
        result: torch.Tensor = self.down_proj(int8_rows(gated) if self.int8_inputs else gated)
        if lora is not None:
            result = lora.add("down_proj", gated, result, ops)
        return result


class ClampedSwigluArgs(TypedDict, total=False):
    """`GatedMLP`'s clamped SwiGLU arguments (none: a plain SwiGLU)."""

    limit: float
    alpha: float
    up_offset: float


def clamped_swiglu_args(config: ModelConfig) -> ClampedSwigluArgs:
    """`GatedMLP`'s clamped SwiGLU arguments for a dense MLP or shared expert of `config`: the experts' (`limit`,
    `alpha`, `up_offset`) where `ModelConfig.clamped_mlps` says they share it, else none (a plain SwiGLU)."""
    if not config.clamped_mlps:
        return {}
    return {"limit": config.swiglu_limit, "alpha": config.swiglu_alpha, "up_offset": config.swiglu_up_offset}


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of x rounded to int8 by its largest magnitude and back, `round(x * 127 / m).clamp(-128, 127) * m /
    127` (m at least 1e-5), in x's dtype: BitNet's per-token activation quantization (transformers' `BitLinear`)."""
    scale = 127 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127) / scale


def _relu2_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`relu(x[..., :d])² * x[..., d:]` (BitNet's gated MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.relu(gate).square() * up


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """`relu(x)²`, Nemotron-H's activation (transformers' `relu2`), of its MLPs and its experts."""
    return torch.relu(x).square()


class XIELU(nn.Module):
    """xIELU (Apertus's activation, arXiv 2411.13010) with its four learned scalars as checkpoints store them
    (`mlp.act_fn.alpha_p`, `alpha_n`, `beta`, `eps`): with `a_p = softplus(alpha_p)` and `a_n = beta +
    softplus(alpha_n)`, `a_p x² + beta x` for x > 0, else `a_n (expm1(min(x, eps)) - x) + beta x` (transformers'
    `XIELUActivation`, in the input's dtype)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)
        self.beta = nn.Parameter(torch.zeros((), dtype=dtype), requires_grad=False)
        self.eps = nn.Parameter(torch.zeros((), dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = nn.functional.softplus(self.alpha_p)
        alpha_n = self.beta + nn.functional.softplus(self.alpha_n)
        positive = alpha_p * x * x + self.beta * x
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, positive, negative)


class UngatedMLP(nn.Module):
    """`down(act(up(x)))`, no gate: act `relu(x)²` (Nemotron-H's, Arcee's and Jais 2's, transformers' `relu2`), xIELU
    (Apertus's, `XIELU`, whose scalars load as `act_fn.*`), GELU's tanh approximation ("gelu_tanh": StarCoder2's,
    Phi's), exact GELU ("gelu": GPT-NeoX's) or ReLU ("relu": OPT's); with `bias`, up and down have biases (Jais 2's,
    the GPT-NeoX lineage's; down's added on rank 0 alone under tensor parallelism).

    Under tensor parallelism a rank holds a block of up's rows and the matching columns of down, whose partial sums
    it all-reduces, as `GatedMLP` does (the activation is elementwise: every rank holds xIELU's scalars whole)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        activation: str = "relu2",
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        part = even_slice(intermediate_size, tp.size, tp.rank, "intermediate_size")
        self.up_proj: nn.Module = ColumnParallelLinear(hidden_size, [part], bias, dtype)
        self.down_proj: nn.Module = RowParallelLinear(intermediate_size, hidden_size, bias, tp, dtype)
        self.act_fn: nn.Module | None = XIELU(dtype) if activation == "xielu" else None
        self.activation = activation

    def forward(self, x: torch.Tensor, ops: KernelOps, lora: LayerLora | None = None) -> torch.Tensor:
        """`lora`: the step's LoRA adapters, added to the up projection (`gate_up_proj`'s one segment) and down's."""
        return self.tp.all_reduce_sum(self.partial(x, ops, lora))

    def partial(self, x: torch.Tensor, ops: KernelOps, lora: LayerLora | None = None) -> torch.Tensor:
        """This rank's partial sum of the output (the whole output at size 1), before the all-reduce."""
        up = self.up_proj(x)
        if lora is not None:
            up = lora.add("gate_up_proj", x, up, ops)
        activated = self._activate(up)
        result: torch.Tensor = self.down_proj(activated)
        if lora is not None:
            result = lora.add("down_proj", activated, result, ops)
        return result

    def _activate(self, up: torch.Tensor) -> torch.Tensor:
        if self.act_fn is not None:
            activated: torch.Tensor = self.act_fn(up)
            return activated
        if self.activation == "relu2":
            return relu_squared(up)
        if self.activation == "relu":
            return torch.relu(up)
        return F.gelu(up, approximate="tanh" if self.activation == "gelu_tanh" else "none")
