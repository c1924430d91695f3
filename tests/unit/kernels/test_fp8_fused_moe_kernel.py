"""FP8 experts (`ladle_kernels.fused_moe.fp8_fused_moe`, `engine_server.layers.fp8_experts`) against
`ladle_kernels.reference.fp8_fused_moe`: per channel and per block (DeepSeek's 128 x 128, partial blocks, blocks the K
tiles must not straddle), one decode row to every expert busy, unused experts, dtypes; the CPU layer (dequantized
banks, rows rounded in torch) against the same reference; the argument checks.

The operands are chosen so that the gate/up sums are exact in float32 whatever their order: x's rows are e4m3
values that are multiples of 1/2 with a largest magnitude of 14 (so x's per-token scale is 2^-5 and its rounding to
e4m3 exact), the weights small integers with power-of-two scales. The kernel and the reference then round the same
gate/up values to e4m3 before down (a sum in another order could otherwise flip one rounding, a step of 1/8 of
that element), and differ only by the order of down's float32 sums and by the final rounding to x's dtype."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from engine_server.layers.fp8_experts import Fp8Bank, Fp8Experts, Fp8ExpertWeights, quantize_fp8_experts
from engine_server.parallel.group import SINGLE
from engine_server.parallel.layers import ParallelExperts
from ladle_kernels import reference
from ladle_kernels.fused_moe import fp8_fused_moe

TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}


def exact_bank(
    experts: int, rows: int, cols: int, block: tuple[int, int] | None, generator: torch.Generator
) -> Fp8Bank:
    """Integer e4m3 weights in [-12, 12] with scales 2^-7, 2^-6 or 2^-5, per channel or per block."""
    qs = reference.to_fp8(torch.randint(-12, 13, (experts, rows, cols), generator=generator).float())
    shape = (experts, rows, 1) if block is None else (experts, -(-rows // block[0]), -(-cols // block[1]))
    scales = 2.0 ** -torch.randint(5, 8, shape, generator=generator).float()
    return Fp8Bank(qs, scales, block)


def exact_rows(tokens: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of e4m3 multiples of 1/2 in [-14, 14], each with 14 or -14 at one place (module doc)."""
    x = reference.to_fp8((torch.randn(tokens, hidden, generator=generator) * 8).round().clamp(-28, 28) / 2).float()
    x[torch.arange(tokens), torch.randint(0, hidden, (tokens,), generator=generator)] = 14.0
    return x


def operands(
    tokens: int, top_k: int, experts: int, hidden: int, inter: int, block: tuple[int, int] | None, seed: int = 0
) -> tuple[torch.Tensor, Fp8ExpertWeights, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights, chosen = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=generator), -1), top_k, -1)
    bank = Fp8ExpertWeights(
        exact_bank(experts, 2 * inter, hidden, block, generator), exact_bank(experts, hidden, inter, block, generator)
    )
    return exact_rows(tokens, hidden, generator), bank, weights, chosen


def run_reference(x: torch.Tensor, bank: Fp8ExpertWeights, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    gate_up, down = bank.gate_up, bank.down
    return reference.fp8_fused_moe(x, gate_up.qs, gate_up.scales, down.qs, down.scales, weights, chosen, gate_up.block)


def run_kernel(x: torch.Tensor, bank: Fp8ExpertWeights, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    gate_up, down = bank.gate_up, bank.down
    return fp8_fused_moe(x, gate_up.qs, gate_up.scales, down.qs, down.scales, weights, chosen, gate_up.block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "hidden", "inter", "block"),
    [
        (1, 2, 4, 64, 32, None),  # one decode row
        (17, 3, 8, 48, 40, None),  # ragged sizes, most experts busy
        (3, 1, 16, 32, 16, None),  # most experts unused
        (5, 2, 4, 256, 128, (128, 128)),  # DeepSeek's blocks
        (9, 2, 4, 96, 80, (64, 64)),  # partial blocks in both dims
        (6, 2, 4, 96, 48, (16, 96)),  # blocks of 96 columns: three K tiles each, down's block partial
    ],
)
def test_fp8_fused_moe_matches_the_reference(
    device: torch.device, dtype: torch.dtype, tokens: int, top_k: int, experts: int, hidden: int, inter: int,
    block: tuple[int, int] | None,
) -> None:  # fmt: skip
    x, bank, weights, chosen = operands(tokens, top_k, experts, hidden, inter, block, seed=tokens)
    x = x.to(device, dtype)
    bank = Fp8ExpertWeights(bank.gate_up.to(device), bank.down.to(device))
    weights, chosen = weights.to(device), chosen.to(device)
    out = run_kernel(x, bank, weights, chosen)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, run_reference(x, bank, weights, chosen), **TOLERANCES[dtype])


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["channel", "block"])
def test_the_cpu_layer_is_the_reference(block: tuple[int, int] | None) -> None:
    x, bank, weights, chosen = operands(23, 3, 8, 64, 48, block, seed=5)
    layer = Fp8Experts(bank, torch.float32)
    assert layer.format == ("fp8" if block is None else "fp8_block") and layer.w13_scale is None
    torch.testing.assert_close(layer.w13, bank.gate_up.dequantize(), atol=0, rtol=0)
    out = layer(x, weights, chosen, reference.silu_and_mul)
    torch.testing.assert_close(out, run_reference(x, bank, weights, chosen), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["channel", "block"])
def test_biases_and_the_clamped_swiglu(device: torch.device, block: tuple[int, int] | None) -> None:
    """gpt-oss's experts in FP8: biases (multiples of 1/32, so the gate/up sums stay exact) added to both products
    and its clamped SwiGLU between them: the kernel, the CPU layer and the reference agree, and the biases count."""
    x, bank, weights, chosen = operands(13, 2, 8, 64, 48, block, seed=9)
    generator = torch.Generator().manual_seed(10)
    b13 = torch.randint(-32, 33, (8, 96), generator=generator).float() / 32
    b2 = torch.randint(-32, 33, (8, 64), generator=generator).float() / 32
    activation = functools.partial(reference.clamped_swiglu, alpha=1.702, limit=0.5)
    gate_up, down = bank.gate_up, bank.down
    expected = reference.fp8_fused_moe(
        x, gate_up.qs, gate_up.scales, down.qs, down.scales, weights, chosen, block, b13, b2, activation
    )
    moved = Fp8ExpertWeights(gate_up.to(device), down.to(device))
    out = fp8_fused_moe(
        x.to(device), moved.gate_up.qs, moved.gate_up.scales, moved.down.qs, moved.down.scales, weights.to(device),
        chosen.to(device), block, b13.to(device), b2.to(device), activation,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    layer = Fp8Experts(bank, torch.float32, (b13, b2))
    torch.testing.assert_close(layer(x, weights, chosen, activation), expected, **TOLERANCES[torch.float32])
    unbiased = reference.fp8_fused_moe(
        x, gate_up.qs, gate_up.scales, down.qs, down.scales, weights, chosen, block, activation=activation
    )
    assert (unbiased - expected).abs().max() > 0.1


def test_a_float_bank_is_quantized_per_channel_and_the_kernel_serves_it(device: torch.device) -> None:
    """`quantize_fp8_experts` of a float bank: each expert's rows as `fp8_quantize_per_channel` makes them; the
    kernel on them equals the reference (random operands now, so a looser bound: a rounding of the SiLU-and-mul rows
    may flip), and both stay near the float bank's own output (e4m3's ~2-3% per element)."""
    generator = torch.Generator().manual_seed(7)
    float_bank = ParallelExperts(8, 64, 48, SINGLE)
    float_bank.w13.data.copy_(torch.randn(8, 96, 64, generator=generator) / 8)
    float_bank.w2.data.copy_(torch.randn(8, 64, 48, generator=generator) / 7)
    bank = quantize_fp8_experts(float_bank)
    qs, scales = reference.fp8_quantize_per_channel(float_bank.w13.data[3])
    assert torch.equal(bank.gate_up.qs[3].view(torch.uint8), qs.view(torch.uint8))
    assert torch.equal(bank.gate_up.scales[3], scales) and bank.format == "fp8"
    x = torch.randn(11, 64, generator=generator)
    weights, chosen = torch.topk(torch.softmax(torch.randn(11, 8, generator=generator), -1), 2, -1)
    expected = run_reference(x, bank, weights, chosen)
    moved = Fp8ExpertWeights(bank.gate_up.to(device), bank.down.to(device))
    out = run_kernel(x.to(device), moved, weights.to(device), chosen.to(device)).cpu()
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=1e-2)
    exact = float_bank(x, weights, chosen, reference.silu_and_mul)
    assert (expected - exact).norm() / exact.norm() < 0.08


def test_no_tokens_and_the_argument_checks(device: torch.device) -> None:
    x, bank, weights, chosen = operands(2, 2, 4, 32, 16, None)
    x, weights, chosen = x.to(device), weights.to(device), chosen.to(device)
    bank = Fp8ExpertWeights(bank.gate_up.to(device), bank.down.to(device))
    gate_up, down = bank.gate_up, bank.down
    assert run_kernel(x[:0], bank, weights[:0], chosen[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="w13 has dtype"):
        fp8_fused_moe(x, gate_up.qs.float(), gate_up.scales, down.qs, down.scales, weights, chosen)
    with pytest.raises(ValueError, match="w2_scale has shape"):
        fp8_fused_moe(x, gate_up.qs, gate_up.scales, down.qs, down.scales[0], weights, chosen)
    with pytest.raises(ValueError, match="scale has shape"):
        fp8_fused_moe(x, gate_up.qs, gate_up.scales, down.qs, down.scales, weights, chosen, block=(16, 32))
    with pytest.raises(ValueError, match="multiple of 32"):  # e4m3 K tiles are 32 wide at least
        fp8_fused_moe(x, gate_up.qs, gate_up.scales, down.qs, down.scales, weights, chosen, block=(16, 48))
