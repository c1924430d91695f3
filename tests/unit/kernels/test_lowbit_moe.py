"""Banks of experts in GGUF's 5-bit types, llama.cpp's K-quants (Q5_0, Q5_1, Q2_K .. Q6_K), IQ4 and MXFP4 through
the quantized mixture-of-experts op (`torch.ops.ladle_cpu.moe_packed`, `ladle_kernels/cpu/moe.cpp` over lowbit_tiles.h):
each expert's product bit for bit the dense layers' (`QuantizedLinear` on the same blocks), a token's result alone
and in any batch (AMX tiles or not), its input checks, and a GGUF bank's slices under tensor parallelism
(`quantization._stored_experts`) on whole K-quant super-blocks. Their match with `ladle_kernels.reference.quantized_moe`
is among test_quant_moe.py's cases."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.distributed as dist

from engine_server.layers.quantized_experts import ExpertWeights, QuantizedExperts, expert_weights
from engine_server.layers.quantized_linear import QuantizedLinear
from engine_server.loader.gguf_quant import StoredMatrix
from engine_server.parallel.group import TensorParallel
from engine_server.parallel.layers import ParallelExperts
from engine_server.quantization import _stored_experts
from ladle_kernels import cpu_ops as cpu
from tests.lowbit_blocks import KINDS, random_blocks
from tests.unit.kernels.test_quant_moe import (
    assert_same_bits_without_amx,
    random_bank,
    random_weight,
    reference_route,
    routing,
    skip_without_amx,
)

pytestmark = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")

@pytest.mark.parametrize(
    ("gate_up", "down"),
    [("q4_k", "q6_k"), ("q5_k", "q5_0"), ("q5_1", "q4_k"), ("q6_k", "q5_1"), ("mxfp4", "mxfp4"), ("iq4_xs", "iq4_nl"),
     ("q3_k", "q3_k"), ("q2_k", "q2_k"), ("iq3_xxs", "iq3_s"), ("iq2_xxs", "q2_k"),
     ("iq2_s", "iq2_xs"), ("iq1_s", "iq2_s"), ("iq1_m", "iq1_m")],
)
def test_each_experts_product_is_the_dense_layers_bit_for_bit(gate_up: str, down: str) -> None:
    """A token sent to one expert with weight 1 gets down(silu_and_mul(gate_up(x))) of `QuantizedLinear`s on that
    expert's very blocks, bit for bit, its expert's run long enough for AMX tiles (where the CPU has them)."""
    gen = torch.Generator().manual_seed(17)
    bank = random_bank(4, 256, 256, gate_up, down, gen)
    layer = QuantizedExperts(bank)
    x = torch.randn(30, 256, generator=gen)
    chosen = torch.tensor([[2]] * 14 + [[0], [3], [1]] * 5 + [[2]], dtype=torch.long)
    got = layer(x, torch.ones(30, 1), chosen)
    for e in range(4):
        rows = (chosen[:, 0] == e).nonzero().squeeze(1)
        hidden = torch.ops.ladle_cpu.silu_and_mul(QuantizedLinear(bank.gate_up[e], None)(x[rows]))
        assert torch.equal(got[rows], QuantizedLinear(bank.down[e], None)(hidden)), e


def crowded_routing(tokens: int, experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing where most tokens take expert 1 first (a run of many row tiles, AMX's where it is on), some
    expert 3, and the rest spread."""
    logits = torch.randn(tokens, experts, generator=gen)
    logits[2 : tokens - 3, 1] += 10.0
    logits[: tokens // 2, 3] += 5.0
    return reference_route(logits, 2)


@pytest.mark.parametrize(
    ("gate_up", "down"),
    [("q4_k", "q6_k"), ("q5_k", "q5_0"), ("q5_1", "q4_k"), ("q6_k", "q5_k"), ("mxfp4", "mxfp4"), ("iq4_nl", "iq4_xs"),
     ("q3_k", "q5_k"), ("q2_k", "q3_k"), ("iq2_xxs", "iq3_xxs"), ("iq3_s", "q4_k"),
     ("iq2_xs", "iq2_s"), ("iq1_m", "iq2_xs")],
)
def test_a_tokens_result_does_not_depend_on_its_batch(gate_up: str, down: str) -> None:
    gen = torch.Generator().manual_seed(23)
    layer = QuantizedExperts(random_bank(5, 256, 256, gate_up, down, gen))
    x = torch.randn(27, 256, generator=gen)
    weights, chosen = crowded_routing(27, 5, gen)
    together = layer(x, weights, chosen)
    for t in range(27):
        alone = layer(x[t : t + 1], weights[t : t + 1], chosen[t : t + 1])
        assert torch.equal(alone[0], together[t]), t
    halves = [layer(x[part], weights[part], chosen[part]) for part in (slice(0, 11), slice(11, 27))]
    assert torch.equal(torch.cat(halves), together)


@pytest.mark.parametrize(("gate_up", "down"), [("q4_k", "q5_1"), ("q5_k", "q6_k"), ("q5_0", "q4_k"), ("mxfp4", "q5_0")])
def test_amx_tiles_give_the_vnni_tiles_bits(gate_up: str, down: str) -> None:
    skip_without_amx()
    gen = torch.Generator().manual_seed(29)
    layer = QuantizedExperts(random_bank(5, 256, 256, gate_up, down, gen))
    x = torch.randn(40, 256, generator=gen)
    weights, chosen = crowded_routing(40, 5, gen)
    assert_same_bits_without_amx(layer, x, weights, chosen)


def test_malformed_lowbit_banks_are_refused() -> None:
    gen = torch.Generator().manual_seed(31)
    layer = QuantizedExperts(random_bank(3, 256, 256, "q4_k", "q6_k", gen))
    x = torch.randn(2, 256)
    weights, chosen = routing(2, 3, 2, gen)
    args = [layer.w13, layer.w13_scales, layer.w13_mins, layer.w2, layer.w2_scales, layer.w2_mins]

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.ladle_cpu.moe_packed(x, chosen, weights, *tensors, 256)
        return out

    with pytest.raises(RuntimeError, match="Q6_K groups take two high-bit planes"):
        run(*args[:3], layer.w2[..., :160].contiguous(), *args[4:])
    with pytest.raises(RuntimeError, match=r"w13's K-quant scales must be"):
        run(args[0], args[1][:, :, :, :8].contiguous(), *args[2:])
    with pytest.raises(RuntimeError, match="stacked over the 3 experts"):
        run(*args[:5], args[5][:2])
    narrow = QuantizedExperts(random_bank(3, 96, 64, "q5_0", "q5_0", gen))
    with pytest.raises(RuntimeError, match="super-blocks are 256 wide"):  # Q5_0's packing, K-quant tables
        torch.ops.ladle_cpu.moe_packed(
            torch.randn(2, 96), chosen, weights, narrow.w13, narrow.w13_scales,
            torch.zeros(3, 16, 3, 16, dtype=torch.uint8), narrow.w2, narrow.w2_scales, narrow.w2_mins, 64,
        )  # fmt: skip
    mxfp4 = QuantizedExperts(random_bank(3, 96, 64, "mxfp4", "mxfp4", gen))
    fp4 = [mxfp4.w13, mxfp4.w13_scales, mxfp4.w13_mins, mxfp4.w2, mxfp4.w2_scales, mxfp4.w2_mins]
    with pytest.raises(RuntimeError, match=r"MXFP4 groups \(uint8 exponents\) take no high-bit plane"):
        torch.ops.ladle_cpu.moe_packed(torch.randn(2, 96), chosen, weights, *fp4[:3], narrow.w2, *fp4[4:], 64)
    with pytest.raises(RuntimeError, match="w2's MXFP4 exponents must be"):
        torch.ops.ladle_cpu.moe_packed(torch.randn(2, 96), chosen, weights, *fp4[:4], fp4[4][..., :4].contiguous(),
                                       fp4[5], 64)  # fmt: skip
    iq2 = QuantizedExperts(random_bank(3, 256, 256, "iq2_xs", "iq2_xs", gen))
    grid = [iq2.w13, iq2.w13_scales, iq2.w13_mins, iq2.w2, iq2.w2_scales, iq2.w2_mins]
    with pytest.raises(RuntimeError, match=r"w13's IQ2_XS / IQ2_S / IQ1_M tables must be"):
        run(grid[0], grid[1], grid[2][..., :8].contiguous(), *grid[3:])
    with pytest.raises(RuntimeError, match=r"w13's K-quant scales must be"):  # d in float16: not read as IQ2's
        run(grid[0], grid[1].half(), *grid[2:])
    iq4 = QuantizedExperts(random_bank(3, 256, 256, "iq4_xs", "iq4_xs", gen))
    four = [iq4.w13, iq4.w13_scales, iq4.w13_mins, iq4.w2, iq4.w2_scales, iq4.w2_mins]
    with pytest.raises(RuntimeError, match="w13's IQ4 tables must be"):
        torch.ops.ladle_cpu.moe_packed(x, chosen, weights, four[0], four[1][:, :, :, :4].contiguous(), *four[2:], 256)


def test_gate_and_up_in_different_formats_are_refused() -> None:
    gen = torch.Generator().manual_seed(37)
    gate, up = random_weight("q4_k", 32, 256, gen), random_weight("q5_0", 32, 256, gen)
    with pytest.raises(ValueError, match="gate and up are served in one format"):
        expert_weights([gate], [up], [random_weight("q6_k", 256, 32, gen)])
    bank = random_bank(2, 256, 256, "q4_k", "q6_k", gen)
    with pytest.raises(ValueError, match="same formats"):
        QuantizedExperts(ExpertWeights(bank.gate_up, (bank.down[0], random_weight("q5_k", 256, 256, gen))))


@pytest.mark.parametrize(("intermediate", "kept"), [(512, True), (256, False)])
def test_a_ranks_slice_of_k_quant_experts_falls_on_super_blocks(intermediate: int, kept: bool) -> None:
    """Under TP=2 each rank reads its rows of every expert's gate and up and the same columns of its down, from the
    file's blocks; with a K-quant down those columns must be whole super-blocks of 256 (I = 512: each rank's 256),
    or the bank stays float (I = 256: 128 each)."""
    gen = torch.Generator().manual_seed(41)
    experts, hidden = 2, 256
    shapes = {"gate": ("q4_k", intermediate, hidden), "up": ("q4_k", intermediate, hidden),
              "down": ("q6_k", hidden, intermediate)}  # fmt: skip
    stored = {
        f"experts.{e}.{part}_proj.weight": StoredMatrix(random_blocks(kind, n, k, gen).numpy(), KINDS[kind])
        for e in range(experts)
        for part, (kind, n, k) in shapes.items()
    }
    no_group = cast(dist.ProcessGroup, object())  # the banks read only their partition: no collective runs
    for rank in range(2):
        bank = ParallelExperts(experts, hidden, intermediate, TensorParallel(rank, 2, no_group, no_group))
        found = _stored_experts(stored, "experts", bank)
        if not kept:
            assert found is None
            continue
        weights = found.read() if found is not None else None
        assert weights is not None and QuantizedExperts(weights).format == "q4_k+q6_k"
        rows = bank.rows.rows
        for e in range(experts):
            gate, up, down = (stored[f"experts.{e}.{part}_proj.weight"].read().dequantize() for part in shapes)
            assert torch.equal(
                weights.gate_up[e].dequantize(), torch.cat([gate[rows.start : rows.stop], up[rows.start : rows.stop]])
            )
            assert torch.equal(weights.down[e].dequantize(), down[:, rows.start : rows.stop])
