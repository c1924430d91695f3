"""The quantized linear kernels (`ladle_kernels/cpu/quant_matmul.cpp`) against `ladle_kernels.reference.q4_linear` /
`q8_linear`, their input checks, and the reference against a float matmul of the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_server.layers.quantized_linear import Q4Weight, Q8Weight, QuantizedLinear, quantize_q8
from ladle_kernels import cpu_ops as cpu
from ladle_kernels import reference

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
# Integer dot products are exact on both sides; what differs is float32 summation order over K/32 groups.
TOLERANCE = dict(atol=1e-4, rtol=1e-5)


def random_q4(n: int, k: int, gen: torch.Generator) -> Q4Weight:
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    mins = (-torch.rand(n, k // 32, generator=gen) * 0.2).half()
    return Q4Weight(qs, scales, mins)


def random_q8(n: int, k: int, gen: torch.Generator) -> Q8Weight:
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return Q8Weight(qs, (torch.rand(n, k // 32, generator=gen) * 0.01).half())


# Row tiles of 6 with ragged ends of 1-5, blocks of 8 output features with ragged ends, and (300 rows of
# K = 1536) more rows than one L2-sized chunk of quantized x (168 rows there).
SHAPES = [
    (1, 1, 32), (1, 7, 64), (3, 5, 96), (4, 33, 576), (5, 64, 576), (17, 129, 1536), (31, 40, 64), (32, 40, 64),
    (64, 96, 224), (40, 1100, 96), (300, 20, 1536),
]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_q4_kernel_matches_reference(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = random_q4(n, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    got = torch.ops.ladle_cpu.q4_linear(x, w.qs, w.scales, w.mins)
    torch.testing.assert_close(got, reference.q4_linear(x, w.qs, w.scales, w.mins), **TOLERANCE)


@needs_kernels
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_q8_kernel_matches_reference(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = random_q8(n, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    got = torch.ops.ladle_cpu.q8_linear(x, w.qs, w.scales)
    torch.testing.assert_close(got, reference.q8_linear(x, w.qs, w.scales), **TOLERANCE)


@needs_kernels
def test_extreme_values_zero_groups_and_strided_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=gen)
    x[0] = 0.0  # a zero row: every group's scale is 0
    x[1, 32:64] = 0.0  # one zero group
    x[2] *= 1e4
    x[3] *= 1e-6
    q8 = Q8Weight(torch.full((9, 128), -127, dtype=torch.int8), torch.rand(9, 4, generator=gen).half())
    q8.qs[::2] = 127  # the largest products the 16-bit pair sums must hold
    q4 = Q4Weight(
        torch.full((9, 64), 0xFF, dtype=torch.uint8), torch.rand(9, 4, generator=gen).half(), torch.zeros(9, 4).half()
    )
    wide = torch.randn(6, 256, generator=gen)
    for rows in (x, wide[:, :128]):  # contiguous and row-strided
        torch.testing.assert_close(
            torch.ops.ladle_cpu.q8_linear(rows, q8.qs, q8.scales), reference.q8_linear(rows, q8.qs, q8.scales),
            atol=1e-3, rtol=1e-5,
        )  # fmt: skip
        torch.testing.assert_close(
            torch.ops.ladle_cpu.q4_linear(rows, q4.qs, q4.scales, q4.mins),
            reference.q4_linear(rows, q4.qs, q4.scales, q4.mins),
            atol=1e-3, rtol=1e-5,
        )  # fmt: skip
    assert torch.ops.ladle_cpu.q8_linear(x, q8.qs, q8.scales)[0].abs().max() == 0
    assert torch.ops.ladle_cpu.q8_linear(torch.empty(0, 128), q8.qs, q8.scales).shape == (0, 9)


@needs_kernels
def test_kernels_refuse_malformed_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    w = random_q4(8, 64, gen)
    q8 = random_q8(8, 64, gen)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.ladle_cpu.q8_linear(torch.randn(2, 48), q8.qs[:, :48].contiguous(), q8.scales[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.ladle_cpu.q4_linear(x.double(), w.qs, w.scales, w.mins)
    with pytest.raises(RuntimeError, match="qs must be"):
        torch.ops.ladle_cpu.q4_linear(x, w.qs[:, :16].contiguous(), w.scales, w.mins)
    with pytest.raises(RuntimeError, match="mins must be"):
        torch.ops.ladle_cpu.q4_linear(x, w.qs, w.scales, w.mins[:4].contiguous())
    with pytest.raises(RuntimeError, match="qs must be"):
        torch.ops.ladle_cpu.q8_linear(x, q8.qs.to(torch.uint8), q8.scales)
    with pytest.raises(RuntimeError, match=r"scales must be .* float16"):
        torch.ops.ladle_cpu.q8_linear(x, q8.qs, q8.scales.float())


def test_reference_is_the_dequantized_matmul_up_to_activation_rounding() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 576, generator=gen)
    w = random_q4(40, 576, gen)
    exact = F.linear(x, w.dequantize())
    got = reference.q4_linear(x, w.qs, w.scales, w.mins)
    # 8-bit activations: each element off by at most half a step (max|x| / 254 per group).
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()
    assert (got - exact).abs().max() > 0  # the activations really are rounded


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_a_rows_result_does_not_depend_on_its_batch(fmt: str) -> None:
    # Bit for bit: a greedy answer must not change with what else is in the batch.
    gen = torch.Generator().manual_seed(6)
    weight = random_q4(203, 576, gen) if fmt == "q4" else random_q8(203, 576, gen)
    layer = QuantizedLinear(weight, None)
    x = torch.randn(333, 576, generator=gen)
    batched = layer(x)
    for start, rows in ((0, 1), (5, 1), (7, 3), (100, 2), (330, 3), (1, 64), (200, 133)):
        assert torch.equal(layer(x[start : start + rows]), batched[start : start + rows]), (start, rows)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_amx_tiles_give_the_vnni_tiles_bits(fmt: str) -> None:
    # Rows in full and ragged 16-row tiles, an odd number of 8-feature blocks (a pair with one block), K of 9 groups
    # (the four groups in flight end on one).
    if not torch.ops.ladle_cpu.set_quant_amx(True):
        pytest.skip("this CPU (or kernel) has no AMX tiles")
    gen = torch.Generator().manual_seed(8)
    weight = random_q4(200, 288, gen) if fmt == "q4" else random_q8(200, 288, gen)
    layer = QuantizedLinear(weight, None)
    for rows in (12, 16, 29, 64):
        x = torch.randn(rows, 288, generator=gen) * 2
        with_amx = layer(x)
        try:
            torch.ops.ladle_cpu.set_quant_amx(False)
            assert torch.equal(layer(x), with_amx), rows
        finally:
            torch.ops.ladle_cpu.set_quant_amx(True)


@needs_kernels
def test_q8_weights_take_their_whole_int8_range() -> None:
    gen = torch.Generator().manual_seed(7)
    qs = torch.randint(-128, 128, (16, 64), dtype=torch.int8, generator=gen)
    qs[0] = -128
    qs[1] = 127
    w = Q8Weight(qs, (torch.rand(16, 2, generator=gen) * 0.01).half())
    x = torch.randn(3, 64, generator=gen) * 5
    torch.testing.assert_close(torch.ops.ladle_cpu.q8_linear(x, w.qs, w.scales), reference.q8_linear(x, w.qs, w.scales))


@needs_kernels
def test_packed_linear_refuses_tables_that_do_not_match() -> None:
    gen = torch.Generator().manual_seed(8)
    packed, scales, mins = torch.ops.ladle_cpu.pack_q4(*(lambda w: (w.qs, w.scales, w.mins))(random_q4(20, 64, gen)))
    assert packed.shape == (3, 2, 1, 128) and scales.shape == mins.shape == (3, 2, 8)
    x = torch.randn(2, 64)
    assert torch.ops.ladle_cpu.packed_linear(x, packed, scales, mins, 20).shape == (2, 20)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.ladle_cpu.packed_linear(x, packed, scales, mins, 25)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.ladle_cpu.packed_linear(torch.randn(2, 96), packed, scales, mins, 20)
    with pytest.raises(RuntimeError, match="scales and mins"):
        torch.ops.ladle_cpu.packed_linear(x, packed, scales.float(), mins, 20)


def test_quantize_q8_round_trip_and_unpack_order() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(10, 96, generator=gen)
    q = quantize_q8(weight)
    step = weight.reshape(10, 3, 32).abs().amax(-1, keepdim=True) / 127
    # Half a step from rounding q, plus 127 times the scale's float16 rounding (a relative 2^-11).
    assert ((q.dequantize() - weight).reshape(10, 3, 32).abs() <= step * (0.5 + 127 * 2**-11) + 1e-7).all()
    assert q.scales.dtype == torch.float16
    assert q.qs.abs().max() == 127
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8(torch.randn(4, 40))
    # Byte j of a group: element j low, j + 16 high.
    qs = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)
    assert reference.unpack_q4(qs)[0, [0, 16]].tolist() == [1, 2]


@needs_kernels
def test_quantized_linear_layer_keeps_leading_dims_and_adds_bias() -> None:
    gen = torch.Generator().manual_seed(5)
    w = random_q8(12, 64, gen)
    bias = torch.randn(12, generator=gen)
    layer = QuantizedLinear(w, bias)
    x = torch.randn(2, 3, 64, generator=gen)
    expected = reference.q8_linear(x.reshape(6, 64), w.qs, w.scales).reshape(2, 3, 12) + bias
    torch.testing.assert_close(layer(x), expected, **TOLERANCE)
    assert "format=q8" in repr(layer)


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(1, 32), (13, 64), (49, 576)])
def test_q8_rows_read_from_the_packed_blocks_are_the_dequantized_rows(n: int, k: int) -> None:
    """`q8_packed_rows` (a tied embedding's lookups from its LM head's blocks): every row, in any order and
    repeated, bit for bit `Q8Weight.dequantize`'s, with the whole int8 range; a row past the packed blocks is
    refused."""
    gen = torch.Generator().manual_seed(n)
    weight = random_q8(n, k, gen)
    weight.qs[0, :4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)
    packed, scales, _ = torch.ops.ladle_cpu.pack_q8(weight.qs, weight.scales)
    index = torch.cat([torch.randperm(n, generator=gen), torch.tensor([0, n - 1, 0])])
    rows = torch.ops.ladle_cpu.q8_packed_rows(packed, scales, index)
    assert torch.equal(rows, weight.dequantize()[index])
    with pytest.raises(RuntimeError, match="outside the weight"):
        torch.ops.ladle_cpu.q8_packed_rows(packed, scales, torch.tensor([-(-n // 8) * 8]))
