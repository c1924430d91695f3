"""The Triton fused-MoE kernel against `ladle_kernels.reference.fused_moe` and the engine's own grouped experts
(`ParallelExperts`, the CPU path): token and expert counts from one decode row to every expert busy, ragged
hidden and intermediate sizes, unused experts, dtypes, and the pair alignment it runs on."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from engine_server.parallel.group import SINGLE
from engine_server.parallel.layers import ParallelExperts
from ladle_kernels import reference
from ladle_kernels.fused_moe import align_pairs, fused_moe

TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-1, rtol=2e-2),
}


def operands(tokens: int, top_k: int, experts: int, hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return {
        "x": torch.randn(tokens, hidden, generator=generator),
        "w13": torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5,
        "w2": torch.randn(experts, hidden, inter, generator=generator) / inter**0.5,
        "weights": weights,
        "experts": chosen,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "hidden", "inter"),
    [(1, 2, 4, 64, 32), (5, 2, 4, 64, 96), (17, 3, 8, 48, 40), (40, 8, 16, 64, 32), (3, 1, 32, 32, 16)],
)
def test_fused_moe_matches_reference(
    device: torch.device, dtype: torch.dtype, tokens: int, top_k: int, experts: int, hidden: int, inter: int
) -> None:
    args = operands(tokens, top_k, experts, hidden, inter)
    x, w13, w2 = (args[name].to(device, dtype) for name in ("x", "w13", "w2"))
    weights, chosen = args["weights"].to(device), args["experts"].to(device)
    out = fused_moe(x, w13, w2, weights, chosen)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, weights, chosen), **TOLERANCES[dtype])


def test_fused_moe_equals_the_engines_grouped_experts(device: torch.device) -> None:
    args = operands(23, 4, 8, 64, 48, seed=3)
    bank = ParallelExperts(8, 64, 48, SINGLE)
    bank.w13.data.copy_(args["w13"])
    bank.w2.data.copy_(args["w2"])
    grouped = bank(args["x"], args["weights"], args["experts"], reference.silu_and_mul)
    fused = fused_moe(*(args[name].to(device) for name in ("x", "w13", "w2", "weights", "experts")))
    torch.testing.assert_close(fused.cpu(), grouped, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_with_biases_and_the_clamped_swiglu(device: torch.device, dtype: torch.dtype) -> None:
    """gpt-oss's experts: a bias on each projection (added before the routing weight scales the pair) and the
    clamped SwiGLU (a limit of 1 clamps most of these activations): the kernel, the reference and the engine's
    grouped experts agree, and the biases and the activation each change the result."""
    args = operands(19, 3, 8, 64, 48, seed=5)
    generator = torch.Generator().manual_seed(6)
    b13, b2 = torch.randn(8, 96, generator=generator), torch.randn(8, 64, generator=generator)
    activation = functools.partial(reference.clamped_swiglu, alpha=1.702, limit=1.0)
    x, w13, w2, b13_d, b2_d = (t.to(device, dtype) for t in (args["x"], args["w13"], args["w2"], b13, b2))
    weights, chosen = args["weights"].to(device), args["experts"].to(device)
    out = fused_moe(x, w13, w2, weights, chosen, b13_d, b2_d, activation)
    expected = reference.fused_moe(x, w13, w2, weights, chosen, b13_d, b2_d, activation)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    for unlike in (reference.fused_moe(x, w13, w2, weights, chosen, activation=activation),
                   reference.fused_moe(x, w13, w2, weights, chosen, b13_d, b2_d)):  # fmt: skip
        assert (unlike.float() - expected.float()).abs().max() > 0.1
    bank = ParallelExperts(8, 64, 48, SINGLE, biases=True)
    for name, value in (("w13", args["w13"]), ("w2", args["w2"]), ("b13", b13), ("b2", b2)):
        getattr(bank, name).data.copy_(value)
    grouped = bank(args["x"], args["weights"], args["experts"], activation)
    torch.testing.assert_close(grouped, reference.fused_moe(args["x"], args["w13"], args["w2"], args["weights"],
                                                            args["experts"], b13, b2, activation),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="both"):
        fused_moe(x, w13, w2, weights, chosen, b13_d, None)
    with pytest.raises(ValueError, match="b2 has shape"):
        fused_moe(x, w13, w2, weights, chosen, b13_d, b2_d[:, :10])


def test_pairs_are_sorted_by_expert_into_whole_blocks() -> None:
    chosen = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])  # expert 1 unused
    pair_ids, block_experts = align_pairs(chosen, num_experts=4, block_m=2)
    assert pair_ids.shape == (8 + 4 * 1,) and block_experts.shape == (6,)
    assert block_experts.tolist() == [0, 2, 2, 3, -1, -1]
    assert pair_ids.tolist() == [1, 4, 0, 2, 5, 7, 3, 6, 8, 8, 8, 8]  # expert 0: pairs 1, 4; 2: 0, 2, 5, 7; 3: 3, 6


def test_fused_moe_checks_its_arguments(device: torch.device) -> None:
    args = {name: tensor.to(device) for name, tensor in operands(2, 2, 4, 32, 16).items()}
    with pytest.raises(ValueError, match="w2 has shape"):
        fused_moe(args["x"], args["w13"], args["w2"][:, :, :8], args["weights"], args["experts"])
    with pytest.raises(ValueError, match="w13 has dtype"):
        fused_moe(args["x"], args["w13"].half(), args["w2"], args["weights"], args["experts"])
