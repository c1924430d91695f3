"""A mixture of experts' banks in FP8 (`--quantization fp8`): every expert's weights e4m3 with float32 scales.

`Fp8ExpertWeights` is a bank as this rank keeps it: every expert's gate and up rows (`gate_up`, `[E, 2 * I_r, H]`)
and its down projection (`down`, `[E, H, I_r]`), each an `Fp8Bank` of e4m3 values with one scale per output
channel, or per block of an FP8 checkpoint's `weight_block_size` (the layouts of `layers.fp8_linear`, one per
expert). A float bank is quantized per channel at load (`quantize_fp8_experts`); an FP8 checkpoint's experts are
taken as stored (`engine_server.quantization.stored_fp8_weights`).

`Fp8Experts` takes a `ParallelExperts`' place and computes what `ladle_kernels.reference.fp8_fused_moe` says: x rounded
to e4m3 per token before gate/up, the activation's rows rounded per (token, expert) pair before down; a bank with
biases (gpt-oss) keeps them in its float dtype, added to each product.
- On CUDA the banks stay e4m3 (one byte per weight) and `ladle_kernels.fused_moe.fp8_fused_moe` runs them.
- On the CPU, which has no e4m3 arithmetic, each bank is dequantized once to a float bank of the model's dtype
  (the e4m3 values times their scales, exactly) and the rows are rounded in torch before each product, as
  `Fp8Linear` does: the same arithmetic up to the order of the float32 sums, so FP8 mixtures of experts load and
  are measured without a GPU. It saves no memory and runs no faster than float.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.layers.fp8_linear import Fp8Weight, fp8_rounded_rows, gpu_takes, quantize_fp8
from engine_server.layers.quantized_experts import swap_experts
from engine_server.parallel.layers import Activation, ParallelExperts, grouped_experts
from ladle_kernels.reference import fp8_quantize_per_channel


@dataclass(frozen=True)
class Fp8Bank:
    """One projection of every expert: `qs` `[E, N, K]` e4m3, `scales` float32 `[E, N, 1]` (per channel, `block`
    None) or `[E, ceil(N/bn), ceil(K/bk)]` (per block of `block` = (bn, bk))."""

    qs: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int] | None = None

    @classmethod
    def stack(cls, weights: Sequence[Fp8Weight]) -> Fp8Bank:
        """Experts' weights of one projection, in expert order, as one bank. Raises ValueError when they differ in
        shape or layout."""
        layouts = {(w.shape, w.block, tuple(w.scales.shape)) for w in weights}
        if len(layouts) != 1:
            raise ValueError(f"the experts' FP8 weights differ in shape or layout: {sorted(map(str, layouts))}")
        return cls(torch.stack([w.qs for w in weights]), torch.stack([w.scales for w in weights]), weights[0].block)

    def per_channel(self) -> Fp8Bank:
        """The bank with one scale per output channel: itself, or a block-scaled one's values quantized again."""
        if self.block is None:
            return self
        return Fp8Bank.stack([quantize_fp8(self.expert(e).dequantize()) for e in range(self.qs.shape[0])])

    def expert(self, index: int) -> Fp8Weight:
        return Fp8Weight(self.qs[index], self.scales[index], self.block)

    def dequantize(self) -> torch.Tensor:
        """`[E, N, K]` float32: each expert's e4m3 values times their scales."""
        return torch.stack([self.expert(e).dequantize() for e in range(self.qs.shape[0])])

    def to(self, device: torch.device) -> Fp8Bank:
        return Fp8Bank(self.qs.to(device), self.scales.to(device), self.block)


@dataclass(frozen=True)
class Fp8ExpertWeights:
    """A bank of experts in FP8: `gate_up` `[E, 2 * I_r, H]` (each expert's gate rows, then its up rows) and `down`
    `[E, H, I_r]`, both per channel or both per block of the same size."""

    gate_up: Fp8Bank
    down: Fp8Bank

    @property
    def format(self) -> str:
        """`fp8` (per channel) or `fp8_block`."""
        return "fp8" if self.gate_up.block is None else "fp8_block"


def quantize_fp8_experts(bank: ParallelExperts) -> Fp8ExpertWeights:
    """A float bank (this rank's slices under tensor parallelism) in e4m3, one scale per output channel of each
    expert's projection (its largest magnitude maps to 448). One expert at a time: the float32 temporaries stay one
    expert's, not a whole bank's (1.6 GB for one of Qwen3-30B-A3B's)."""

    def per_channel(weights: torch.Tensor) -> Fp8Bank:
        return Fp8Bank.stack([Fp8Weight(*fp8_quantize_per_channel(expert.detach())) for expert in weights])

    return Fp8ExpertWeights(per_channel(bank.w13), per_channel(bank.w2))


class Fp8Experts(nn.Module):
    """`ParallelExperts`' forward over FP8 experts (module doc). On CUDA `w13`, `w2` are the banks' e4m3 values
    and `w13_scale`, `w2_scale` their scales; on the CPU `w13`, `w2` are their dequantized values in `dtype` and
    the scales are None."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    b13: torch.Tensor | None
    b2: torch.Tensor | None

    def __init__(
        self,
        weights: Fp8ExpertWeights,
        dtype: torch.dtype,
        biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        b13, b2 = biases if biases is not None else (None, None)
        self.register_buffer("b13", b13, persistent=False)
        self.register_buffer("b2", b2, persistent=False)
        gate_up, down = weights.gate_up, weights.down
        if gate_up.block != down.block:
            raise ValueError(f"gate/up scaled per {gate_up.block} but down per {down.block}")
        if gate_up.qs.is_cuda and not gpu_takes(gate_up.block):
            gate_up, down = gate_up.per_channel(), down.per_channel()  # blocks the GPU kernel cannot take
        self.num_experts = gate_up.qs.shape[0]
        self.format = Fp8ExpertWeights(gate_up, down).format
        self.block = gate_up.block
        if gate_up.qs.is_cuda:
            self.register_buffer("w13", gate_up.qs.contiguous(), persistent=False)
            self.register_buffer("w2", down.qs.contiguous(), persistent=False)
            self.register_buffer("w13_scale", gate_up.scales.contiguous(), persistent=False)
            self.register_buffer("w2_scale", down.scales.contiguous(), persistent=False)
        else:
            self.register_buffer("w13", gate_up.dequantize().to(dtype), persistent=False)
            self.register_buffer("w2", down.dequantize().to(dtype), persistent=False)
            self.register_buffer("w13_scale", None, persistent=False)
            self.register_buffer("w2_scale", None, persistent=False)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, activation: Activation
    ) -> torch.Tensor:
        """x `[T, H]`, each token's routing `weights` and chosen `experts` `[T, k]` -> `[T, H]` (this rank's
        partial sum under tensor parallelism); `activation` maps the gate/up rows (the backend's `silu_and_mul`,
        or gpt-oss's clamped SwiGLU)."""
        b13, b2 = self.b13, self.b2
        if self.w13_scale is not None and self.w2_scale is not None:
            from ladle_kernels.fused_moe import fp8_fused_moe  # Triton: imported only where there is a GPU

            return fp8_fused_moe(
                x, self.w13, self.w13_scale, self.w2, self.w2_scale, weights, experts, self.block, b13, b2, activation
            )
        return grouped_experts(
            x, weights, experts, self.num_experts,
            lambda e, rows: F.linear(fp8_rounded_rows(rows), self.w13[e], None if b13 is None else b13[e]),
            lambda e, rows: F.linear(fp8_rounded_rows(rows), self.w2[e], None if b2 is None else b2[e]),
            activation,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, w13={tuple(self.w13.shape)}, format={self.format}"


def replace_fp8_experts(model: nn.Module, weights_for: Callable[[str, ParallelExperts], Fp8ExpertWeights]) -> int:
    """Swap every `ParallelExperts` of `model` for an `Fp8Experts` of `weights_for(name, bank)`, moved to the bank's
    device; returns how many. Raises ValueError when a bank's FP8 weights do not have its shapes. On CUDA an ungated
    bank (Nemotron-H's) stays as it is: the fused FP8 kernel runs gated experts."""

    def layer_for(name: str, bank: ParallelExperts) -> nn.Module:
        if not bank.gated and bank.w13.is_cuda:
            return bank
        weights = weights_for(name, bank)
        if weights.gate_up.qs.shape != bank.w13.shape or weights.down.qs.shape != bank.w2.shape:
            raise ValueError(
                f"{name}: FP8 experts {tuple(weights.gate_up.qs.shape)} / {tuple(weights.down.qs.shape)} do not "
                f"match the bank's {tuple(bank.w13.shape)} / {tuple(bank.w2.shape)}"
            )
        device = bank.w13.device
        biases = None if bank.b13 is None or bank.b2 is None else (bank.b13.detach(), bank.b2.detach())
        return Fp8Experts(
            Fp8ExpertWeights(weights.gate_up.to(device), weights.down.to(device)), bank.w13.dtype, biases
        )

    return swap_experts(model, layer_for)
