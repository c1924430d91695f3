"""Qwen4-Exp's hyper-connections: the residual stream is N copies of the hidden state, `[T, N * hidden]`, and each
block reads a gated mix of them and adds its output to each with a weight of its own (`config.Qwen4Exp`).

`GatedResidual` (transformers' `Qwen4ExpTextGatedResidual`): the streams RMS-normalised each on its own with the
weight `1 + w` (`hc_norm`, one weight over all of them), `x`; a low-rank map gives a gate per value, `sigmoid(up(
silu(down(x) / N)))`, and the block's input is the mean over the streams of the gated `x`; the injection weights
are `2 * sigmoid(inject(x) / N)`, one per stream, and the block's output times each is added to its stream (the
streams before the norm). The model's last one (`combine` False) gives the mix alone, the LM head's input: the
model has no final norm. The norm runs in float32 and rounds to the streams' dtype, as transformers' does.
"""

from __future__ import annotations

import torch
from torch import nn

from ladle_kernels.kernel_set import KernelOps


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """x `[T, groups * width]` RMS-normalised per group of `width` values, times `1 + weight` (`[groups * width]`),
    in float32, in x's dtype (transformers' `Qwen4ExpTextRMSNorm` with a `group_size`)."""
    flat = x.float().view(x.shape[0], groups, -1)
    normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return (normed.flatten(1) * (1.0 + weight.float())).to(x.dtype)


class GatedResidual(nn.Module):
    """One block's map of the streams (module doc); parameters named as Qwen4-Exp's checkpoints name them
    (`attn_hyper_connection.*`, `mlp_hyper_connection.*`, `model.hyper_connection_mixer.*`)."""

    def __init__(
        self, streams: int, hidden: int, rank: int, eps: float, dtype: torch.dtype, combine: bool = True
    ) -> None:
        super().__init__()
        self.streams, self.eps = streams, eps
        self.hc_norm = HyperNorm(streams * hidden, dtype)
        self.input_mix_weight_down = nn.Linear(streams * hidden, rank, bias=False, dtype=dtype)
        self.input_mix_weight_up = nn.Linear(rank, streams * hidden, bias=False, dtype=dtype)
        self.block_inject_weight = nn.Linear(streams * hidden, streams, bias=False, dtype=dtype) if combine else None

    def mix(self, streams: torch.Tensor, ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """streams `[T, N * hidden]` -> (the block's input `[T, hidden]`, the normed streams `[T, N * hidden]`). The
        sigmoids go through the kernel set's `sigmoid_mul` (row by row on the CPU: a token's bits its own)."""
        normed = grouped_rms_norm(streams, self.hc_norm.weight, self.streams, self.eps)
        down = (self.input_mix_weight_down(normed) / self.streams).contiguous()
        gated = ops.sigmoid_mul(normed, self.input_mix_weight_up(ops.sigmoid_mul(down, down)).contiguous())
        return gated.view(streams.shape[0], self.streams, -1).mean(dim=1), normed

    def forward(self, streams: torch.Tensor, ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """streams `[T, N * hidden]` -> (the block's input `[T, hidden]`, injection weights `[T, N]`)."""
        assert self.block_inject_weight is not None, "the model's last map mixes alone: call mix"
        block_input, normed = self.mix(streams, ops)
        logits = (self.block_inject_weight(normed) / self.streams).contiguous()
        return block_input, 2 * ops.sigmoid_mul(torch.ones_like(logits), logits)


def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`streams[n] + weights[n] * out` for each stream n: streams `[T, N * hidden]`, a block's output `[T, hidden]`,
    weights `[T, N]` -> `[T, N * hidden]` (transformers' order: the product, then the add)."""
    return streams + (out.unsqueeze(1) * weights.unsqueeze(-1)).flatten(1)


class HyperNorm(nn.Module):
    """The weight of a norm over all the streams (`hc_norm`, applied as `1 + w` by `grouped_rms_norm`): a module of
    its own, so that no `RMSNorm` offset is added to it at load."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
