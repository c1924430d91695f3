"""The quantized mixture-of-experts op (`torch.ops.ladle_cpu.moe_packed`, `ladle_kernels/cpu/moe.cpp`) against
`ladle_kernels.reference.quantized_moe`, a token's result alone and in any batch, its input checks; the router product
(`rowwise_linear`) against a float matmul, row by row whatever the batch, and the grouped router routed so; and
`QuantizedExperts` / `quantize_experts` against the float `ParallelExperts` they replace. Banks in the 5-bit and
K-quant types: test_lowbit_moe.py."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import pytest
import torch
import torch.distributed as dist

from engine_server.layers.lowbit_weight import LowBitWeight, decode_blocks
from engine_server.layers.moe import GroupedTopkRouter
from engine_server.layers.quantized_experts import (
    ExpertWeights,
    QuantizedExperts,
    expert_weights,
    quantize_experts,
    replace_routers,
)
from engine_server.layers.quantized_linear import QuantizedWeight, pack_for_cpu
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import ParallelExperts
from ladle_kernels import cpu_ops as cpu
from ladle_kernels import reference
from tests.lowbit_blocks import random_blocks
from tests.unit.kernels.test_quant_matmul import random_q4, random_q8

pytestmark = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
_NO_GROUP = cast(dist.ProcessGroup, object())  # the banks read only their partition: no collective runs


def random_weight(kind: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """A random `[n, k]` weight of format `kind`: `q4`, `q8`, or a GGUF kind (`q5_0`, `q4_k`, ...: random blocks)."""
    if kind == "q4":
        return random_q4(n, k, gen)
    if kind == "q8":
        return random_q8(n, k, gen)
    return decode_blocks(random_blocks(kind, n, k, gen), kind)


def random_bank(
    experts: int, hidden: int, intermediate: int, gate_up: str, down: str, gen: torch.Generator
) -> ExpertWeights:
    gate, up = [], []
    for _ in range(experts):
        gate.append(random_weight(gate_up, intermediate, hidden, gen))
        up.append(random_weight(gate_up, intermediate, hidden, gen))
    return expert_weights(gate, up, [random_weight(down, hidden, intermediate, gen) for _ in range(experts)])


def product(weight: QuantizedWeight) -> reference.QuantizedProduct:
    values = weight.dequantize() if isinstance(weight, LowBitWeight) else None

    def run(expert: int, rows: torch.Tensor) -> torch.Tensor:
        del expert
        if values is not None:
            return reference.lowbit_linear(rows, values)
        if hasattr(weight, "mins"):
            return reference.q4_linear(rows, weight.qs, weight.scales, weight.mins)
        return reference.q8_linear(rows, weight.qs, weight.scales)

    return run


def reference_moe(
    bank: ExpertWeights, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gelu: bool = False,
    swiglu: tuple[float, float, float] | None = None, relu2: bool = False,
) -> torch.Tensor:
    gate_up, down = [product(w) for w in bank.gate_up], [product(w) for w in bank.down]
    return reference.quantized_moe(
        x, lambda e, rows: gate_up[e](e, rows), lambda e, rows: down[e](e, rows), weights, chosen, gelu,
        bank.b13, bank.b2, swiglu, relu2,
    )  # fmt: skip


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=gen)
    return reference_route(logits, top_k)


def reference_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights, chosen = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return weights, chosen


# (tokens, experts, top-k, hidden, intermediate, gate/up format, down format): one decode row, ragged row tiles
# per expert, blocks of 8 with a ragged end (I = 44 is not one: its down's K must be on groups of 32, so I is),
# mixed formats, more tokens than one expert's tile.
CASES = [
    (1, 8, 2, 64, 32, "q4", "q4"),
    (5, 4, 2, 96, 64, "q8", "q8"),
    (13, 8, 3, 64, 96, "q4", "q8"),
    (40, 6, 1, 128, 32, "q8", "q4"),
    # The 5-bit, K-quant, IQ4 and MXFP4 kinds (test_lowbit_moe.py): every kind as gate/up and as down,
    # K-quants over one and several super-blocks, a Q4_K_M file's pairs (Q4_K with Q6_K, Q5_0 with Q8_0 fallbacks),
    # one decode row, ragged row tiles, and an expert with more rows than AMX's kAmxMinRows.
    (1, 4, 2, 256, 256, "q4_k", "q6_k"),
    (13, 6, 3, 256, 512, "q5_k", "q4_k"),
    (40, 4, 2, 512, 256, "q6_k", "q5_k"),
    (7, 5, 2, 96, 64, "q5_0", "q5_1"),
    (9, 4, 2, 64, 256, "q5_1", "q6_k"),
    (20, 3, 2, 256, 96, "q4_k", "q5_0"),
    (11, 4, 2, 96, 64, "q5_0", "q8"),
    (6, 4, 1, 256, 64, "q4", "q5_1"),
    (8, 4, 2, 96, 64, "mxfp4", "mxfp4"),  # gpt-oss's files
    (15, 4, 2, 256, 64, "mxfp4", "q8"),
    (9, 4, 2, 256, 256, "iq4_xs", "iq4_nl"),  # IQ4_XS files (IQ4_NL where a row is not whole super-blocks)
    (14, 5, 2, 96, 64, "iq4_nl", "q5_0"),
    (11, 4, 2, 256, 256, "q3_k", "q4_k"),  # Q3_K_M files
    (10, 4, 2, 256, 256, "q2_k", "q3_k"),  # Q2_K files (their down projections Q3_K)
    (12, 4, 2, 256, 256, "iq3_xxs", "iq3_s"),  # IQ3_XXS / IQ3_M files
    (9, 4, 2, 256, 256, "iq2_xxs", "q2_k"),  # IQ2_XXS files
    (13, 4, 2, 256, 256, "iq2_s", "iq2_xs"),  # IQ2_M / IQ2_XS files
    (11, 4, 2, 256, 256, "iq1_s", "iq2_xxs"),  # IQ1_S files
    (10, 4, 2, 256, 256, "iq1_m", "iq2_s"),  # IQ1_M files
]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "intermediate", "gate_up", "down"), CASES)
def test_moe_matches_the_reference(
    tokens: int, experts: int, top_k: int, hidden: int, intermediate: int, gate_up: str, down: str
) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    bank = random_bank(experts, hidden, intermediate, gate_up, down, gen)
    layer = QuantizedExperts(bank)
    assert layer.format == (gate_up if gate_up == down else f"{gate_up}+{down}")
    x = torch.randn(tokens, hidden, generator=gen)
    weights, chosen = routing(tokens, experts, top_k, gen)
    torch.testing.assert_close(layer(x, weights, chosen), reference_moe(bank, x, weights, chosen), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(("gate_up", "down"), [("q8", "q4"), ("q4_k", "q6_k")])
def test_gelu_experts_match_the_reference_and_not_the_silu_ones(gate_up: str, down: str) -> None:
    """Gemma 4's experts (`QuantizedExperts(gelu=True)`): the GELU (tanh) product, to float32 rounding, which SiLU's
    is far from; a token's result alone equals its result in the batch, bit for bit."""
    gen = torch.Generator().manual_seed(41)
    bank = random_bank(5, 256, 256, gate_up, down, gen)
    layer = QuantizedExperts(bank, gelu=True)
    x = torch.randn(19, 256, generator=gen)
    weights, chosen = routing(19, 5, 2, gen)
    together = layer(x, weights, chosen)
    torch.testing.assert_close(together, reference_moe(bank, x, weights, chosen, gelu=True), atol=2e-4, rtol=1e-4)
    assert (together - reference_moe(bank, x, weights, chosen)).abs().max() > 1e-2
    for t in (0, 7, 18):
        assert torch.equal(layer(x[t : t + 1], weights[t : t + 1], chosen[t : t + 1])[0], together[t]), t


@pytest.mark.parametrize(("gate_up", "down"), [("q8", "q8"), ("q5_0", "q5_0"), ("q4", "q5_1"), ("mxfp4", "mxfp4")])
def test_gpt_oss_experts_match_the_reference_and_not_the_plain_ones(gate_up: str, down: str) -> None:
    """gpt-oss's experts (`QuantizedExperts(swiglu=...)` over a bank with biases): each product plus its expert's
    bias, the clamped SwiGLU between (a limit of 2 clamps many of these products), to float32 rounding; without the
    biases, or with SiLU, the result is far off; a token's result alone equals its result in the batch, bit for
    bit."""
    gen = torch.Generator().manual_seed(43)
    plain = random_bank(5, 96, 64, gate_up, down, gen)
    bank = replace(plain, b13=torch.randn(5, 128, generator=gen), b2=torch.randn(5, 96, generator=gen))
    layer = QuantizedExperts(bank, swiglu=(1.702, 2.0, 1.0))
    x = torch.randn(19, 96, generator=gen) * 0.3
    weights, chosen = routing(19, 5, 2, gen)
    together = layer(x, weights, chosen)
    expected = reference_moe(bank, x, weights, chosen, swiglu=(1.702, 2.0, 1.0))
    torch.testing.assert_close(together, expected, atol=2e-4, rtol=1e-4)
    for other in (reference_moe(plain, x, weights, chosen, swiglu=(1.702, 2.0, 1.0)), reference_moe(bank, x, weights,
                                                                                                 chosen)):
        assert (together - other).abs().max() > 1e-2
    for t in (0, 7, 18):
        assert torch.equal(layer(x[t : t + 1], weights[t : t + 1], chosen[t : t + 1])[0], together[t]), t


def test_hy_v4_experts_take_the_clamped_swiglu_without_the_up_offset() -> None:
    """HY-V4's experts (`swiglu` alpha 1, offset 0: `silu(min(gate, limit)) * clamp(up, +-limit)`) equal the
    reference to float32 rounding, and differ from gpt-oss's form (offset 1) and from the unclamped SiLU."""
    gen = torch.Generator().manual_seed(44)
    bank = random_bank(5, 96, 64, "q8", "q8", gen)
    layer = QuantizedExperts(bank, swiglu=(1.0, 0.5, 0.0))
    x = torch.randn(11, 96, generator=gen)
    weights, chosen = routing(11, 5, 2, gen)
    together = layer(x, weights, chosen)
    torch.testing.assert_close(together, reference_moe(bank, x, weights, chosen, swiglu=(1.0, 0.5, 0.0)), atol=2e-4,
                               rtol=1e-4)  # fmt: skip
    for other in (reference_moe(bank, x, weights, chosen, swiglu=(1.0, 0.5, 1.0)), reference_moe(bank, x, weights,
                                                                                                 chosen)):
        assert (together - other).abs().max() > 1e-2


@pytest.mark.parametrize(("up", "down"), [("q8", "q8"), ("q4", "q4"), ("q4_k", "q6_k")])
def test_relu2_experts_match_the_reference(up: str, down: str) -> None:
    """Nemotron-H's ungated experts (`QuantizedExperts(relu2=True)`: each expert's up rows alone, `down(relu(up)²)`),
    to float32 rounding; a token's result alone equals its result in the batch, bit for bit."""
    gen = torch.Generator().manual_seed(47)
    ups = [random_weight(up, 256, 256, gen) for _ in range(5)]
    bank = ExpertWeights(tuple(ups), tuple(random_weight(down, 256, 256, gen) for _ in range(5)))
    layer = QuantizedExperts(bank, relu2=True)
    x = torch.randn(19, 256, generator=gen)
    weights, chosen = routing(19, 5, 2, gen)
    together = layer(x, weights, chosen)
    torch.testing.assert_close(together, reference_moe(bank, x, weights, chosen, relu2=True), atol=2e-4, rtol=1e-4)
    for t in (0, 7, 18):
        assert torch.equal(layer(x[t : t + 1], weights[t : t + 1], chosen[t : t + 1])[0], together[t]), t


def test_a_tokens_result_does_not_depend_on_its_batch() -> None:
    """Each token alone, and in a batch where most tokens crowd one expert (so its run spans several row tiles and
    the threads' shares of the work differ), gives the same bits."""
    gen = torch.Generator().manual_seed(7)
    bank = random_bank(6, 64, 64, "q4", "q8", gen)
    layer = QuantizedExperts(bank)
    x = torch.randn(23, 64, generator=gen)
    logits = torch.randn(23, 6, generator=gen)
    logits[3:20, 2] += 10.0  # expert 2 first for most tokens
    weights, chosen = reference_route(logits, 2)
    together = layer(x, weights, chosen)
    for t in range(23):
        alone = layer(x[t : t + 1], weights[t : t + 1], chosen[t : t + 1])
        assert torch.equal(alone[0], together[t]), t


def skip_without_amx() -> None:
    """Skips the test where this CPU (or the kernel build) has no AMX tiles; else leaves them on."""
    if not torch.ops.ladle_cpu.set_quant_amx(True):
        pytest.skip("this CPU (or kernel) has no AMX tiles")


def assert_same_bits_without_amx(layer: QuantizedExperts, x: torch.Tensor, weights: torch.Tensor,
                                 chosen: torch.Tensor) -> None:
    """The layer's output with AMX on equals its output with AMX off, bit for bit (AMX left on after)."""
    with_amx = layer(x, weights, chosen)
    try:
        torch.ops.ladle_cpu.set_quant_amx(False)
        assert torch.equal(layer(x, weights, chosen), with_amx)
    finally:
        torch.ops.ladle_cpu.set_quant_amx(True)


def test_amx_tiles_give_the_vnni_tiles_bits() -> None:
    """Experts with 16+ rows (AMX tiles), 12-15 (AMX, ragged) and fewer (VNNI) in one step, against AMX off."""
    skip_without_amx()
    gen = torch.Generator().manual_seed(9)
    bank = random_bank(6, 96, 64, "q4", "q8", gen)
    layer = QuantizedExperts(bank)
    x = torch.randn(40, 96, generator=gen)
    logits = torch.randn(40, 6, generator=gen)
    logits[:30, 1] += 10.0
    logits[:13, 4] += 5.0
    weights, chosen = reference_route(logits, 2)
    assert_same_bits_without_amx(layer, x, weights, chosen)


def test_no_tokens_and_unused_experts() -> None:
    gen = torch.Generator().manual_seed(3)
    bank = random_bank(4, 32, 32, "q8", "q8", gen)
    layer = QuantizedExperts(bank)
    empty = layer(torch.zeros(0, 32), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert empty.shape == (0, 32)
    x, ones = torch.randn(3, 32, generator=gen), torch.ones(3, 1)
    only_one = torch.full((3, 1), 1, dtype=torch.long)  # experts 0, 2 and 3 get no token
    torch.testing.assert_close(layer(x, ones, only_one), reference_moe(bank, x, ones, only_one), atol=2e-4, rtol=1e-4)


def test_moe_refuses_malformed_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    layer = QuantizedExperts(random_bank(4, 64, 32, "q4", "q4", gen))
    x = torch.randn(2, 64)
    weights, chosen = routing(2, 4, 2, gen)
    with pytest.raises(RuntimeError, match=r"expert id 4 is not in 0\.\.3"):
        layer(x, weights, torch.tensor([[0, 4], [1, 2]]))
    with pytest.raises(RuntimeError, match="weights must be"):
        layer(x, weights[:, :1], chosen)
    with pytest.raises(RuntimeError, match="w13 must be"):
        layer(torch.randn(2, 96), weights, chosen)
    with pytest.raises(ValueError, match="same formats"):
        mixed = random_bank(2, 64, 32, "q4", "q4", gen)
        QuantizedExperts(ExpertWeights(mixed.gate_up, (mixed.down[0], random_q8(64, 32, gen))))


@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_experts_of_a_float_bank_follow_it_to_8_bit_rounding(tp: int) -> None:
    """`quantize_experts` of a float bank (this rank's rows of each expert under TP) computes what the float bank
    does, to the 8-bit rounding of weights and activations; each rank's part sums to the whole."""
    gen = torch.Generator().manual_seed(11)
    hidden, intermediate, experts = 64, 64, 4
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, intermediate, generator=gen) * 0.1
    x = torch.randn(9, hidden, generator=gen)
    weights, chosen = routing(9, experts, 2, gen)
    whole = ParallelExperts(experts, hidden, intermediate, SINGLE)
    whole.w13.data.copy_(w13)
    whole.w2.data.copy_(w2)
    expected = whole(x, weights, chosen, reference.silu_and_mul)
    total = torch.zeros_like(expected)
    for rank in range(tp):
        group = SINGLE if tp == 1 else TensorParallel(rank=rank, size=tp, group=_NO_GROUP, control_group=_NO_GROUP)
        bank = ParallelExperts(experts, hidden, intermediate, group)
        rows = bank.rows.rows
        for e in range(experts):
            for part, full in (("gate", w13[e, :intermediate]), ("up", w13[e, intermediate:]), ("down", w2[e])):
                bank.load_expert(e, part, full)
        quantized = quantize_experts(bank)
        assert quantized is not None and quantized.format == "q8" and len(rows) == intermediate // tp
        total += QuantizedExperts(quantized)(x, weights, chosen)
    torch.testing.assert_close(total, expected, atol=0.03 * expected.abs().max().item(), rtol=0.05)


def test_a_bank_off_groups_of_32_stays_float() -> None:
    bank = ParallelExperts(2, 64, 48, SINGLE)
    assert quantize_experts(bank) is None


@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 64), (7, 60, 100), (33, 128, 2048)])
def test_rowwise_linear_matches_a_float_matmul_and_each_row_alone(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    together = torch.ops.ladle_cpu.rowwise_linear(x, w)
    torch.testing.assert_close(together, reference.rowwise_linear(x, w), atol=1e-4 * k**0.5, rtol=1e-5)
    for row in range(m):
        assert torch.equal(torch.ops.ladle_cpu.rowwise_linear(x[row : row + 1], w)[0], together[row])
    with pytest.raises(RuntimeError, match="w must be"):
        torch.ops.ladle_cpu.rowwise_linear(x, w[:, :-1])


@pytest.mark.parametrize(
    ("experts", "hidden", "groups", "sigmoid"), [(8, 64, 2, True), (160, 512, 1, True), (64, 256, 8, False)]
)
def test_a_grouped_router_routed_row_by_row_gives_each_token_its_choice_alone(
    experts: int, hidden: int, groups: int, sigmoid: bool
) -> None:
    """DeepSeek-V3's / GLM-4.5's router (sigmoid scores with a bias; DeepSeek-V2's softmax) on the quantized path
    (`replace_routers` sets `rowwise`): every row of 37 tokens gets the experts and weights it gets alone, bit for
    bit, the same experts as the float router's and their weights within float rounding. The float router's
    `F.linear` and `torch.sigmoid` do not hold the first (measured: 72 of 257 rows of a 64-wide, 8-expert router)."""
    gen = torch.Generator().manual_seed(experts + hidden)
    router = GroupedTopkRouter(hidden, experts, 4, groups, max(1, groups // 2), True, 2.5, sigmoid=sigmoid,
                               score_bias=sigmoid)  # fmt: skip
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3, generator=gen)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.uniform_(-0.3, 0.3, generator=gen)
    x = torch.randn(37, hidden, generator=gen)
    float_weights, float_chosen = router.route(x)
    assert replace_routers(router) == 1 and router.rowwise
    weights, chosen = router.route(x)
    for row in range(x.shape[0]):
        alone_weights, alone_chosen = router.route(x[row : row + 1])
        assert torch.equal(alone_chosen[0], chosen[row]) and torch.equal(alone_weights[0], weights[row]), row
    assert torch.equal(chosen.sort(-1).values, float_chosen.sort(-1).values)
    order, float_order = chosen.argsort(-1), float_chosen.argsort(-1)
    torch.testing.assert_close(weights.gather(1, order), float_weights.gather(1, float_order), atol=1e-5, rtol=1e-5)


def test_packed_banks_are_the_packed_weights_of_each_expert() -> None:
    gen = torch.Generator().manual_seed(2)
    bank = random_bank(3, 64, 32, "q4", "q8", gen)
    layer = QuantizedExperts(bank)
    for e in range(3):
        packed, scales, mins = pack_for_cpu(bank.down[e])
        assert torch.equal(layer.w2[e], packed) and torch.equal(layer.w2_scales[e], scales)
        assert torch.equal(layer.w2_mins[e], mins)
        assert torch.equal(layer.w13[e], pack_for_cpu(bank.gate_up[e])[0])
