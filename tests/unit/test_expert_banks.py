"""A bank of experts quantized and packed whole (`quantize_experts`, `bank_weights`) equals the same bank quantized
and packed expert by expert, bit for bit: every expert's weights and every packed buffer of `QuantizedExperts`."""

from __future__ import annotations

import pytest
import torch

from engine_server.layers.quantized_experts import ExpertWeights, QuantizedExperts, quantize_experts
from engine_server.parallel.group import SINGLE
from engine_server.parallel.layers import ParallelExperts
from ladle_kernels import cpu_ops as cpu

pytestmark = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")

EXPERTS, INTERMEDIATE, HIDDEN = 3, 128, 256
BUFFERS = ("w13", "w13_scales", "w13_mins", "w2", "w2_scales", "w2_mins")


def assert_same_weights(ours: ExpertWeights, theirs: ExpertWeights) -> None:
    for mine, other in zip((*ours.gate_up, *ours.down), (*theirs.gate_up, *theirs.down), strict=True):
        assert type(mine) is type(other)
        for name, tensor in vars(mine).items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(tensor, getattr(other, name)), name


def assert_same_packing(ours: ExpertWeights, theirs: ExpertWeights) -> None:
    mine, other = QuantizedExperts(ours), QuantizedExperts(theirs)
    for name in BUFFERS:
        assert torch.equal(getattr(mine, name), getattr(other, name)), name


@pytest.mark.parametrize("kind", ["q2_k", "iq3_xxs", "iq4_xs"])
def test_gguf_experts_packed_whole_equal_expert_by_expert(kind: str) -> None:
    """A bank of a file's blocks read whole (`bank_weights`) packs to the experts' stack, a grid kind's codebook
    repeated for each expert."""
    from engine_server.layers.lowbit_weight import decode_blocks
    from engine_server.layers.quantized_experts import bank_weights, row_slice
    from tests.lowbit_blocks import random_blocks

    gen = torch.Generator().manual_seed(2)
    gate_up = decode_blocks(random_blocks(kind, EXPERTS * 2 * INTERMEDIATE, HIDDEN, gen), kind)
    down = decode_blocks(random_blocks(kind, EXPERTS * HIDDEN, INTERMEDIATE * 2, gen), kind)
    whole = bank_weights(gate_up, down, EXPERTS)
    per = 2 * INTERMEDIATE
    theirs = ExpertWeights(tuple(row_slice(gate_up, e * per, (e + 1) * per) for e in range(EXPERTS)),
                           tuple(row_slice(down, e * HIDDEN, (e + 1) * HIDDEN) for e in range(EXPERTS)))  # fmt: skip
    assert_same_packing(whole, theirs)


def test_int8_experts_quantized_whole_equal_expert_by_expert() -> None:
    from engine_server.layers.quantized_linear import quantize_q8

    bank = ParallelExperts(EXPERTS, HIDDEN, INTERMEDIATE, SINGLE)
    gen = torch.Generator().manual_seed(1)
    bank.w13.data.copy_(torch.randn(bank.w13.shape, generator=gen) * 0.02)
    bank.w2.data.copy_(torch.randn(bank.w2.shape, generator=gen) * 0.02)
    whole = quantize_experts(bank)
    assert whole is not None and whole.whole is not None
    theirs = ExpertWeights(tuple(quantize_q8(bank.w13[e]) for e in range(EXPERTS)),
                           tuple(quantize_q8(bank.w2[e]) for e in range(EXPERTS)))  # fmt: skip
    assert_same_weights(whole, theirs)
    assert_same_packing(whole, theirs)
