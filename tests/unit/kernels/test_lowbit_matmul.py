"""GGUF's 5-bit blocks, llama.cpp's K-quants and MXFP4 on the CPU (`engine_server/layers/lowbit_weight.py`,
`ladle_kernels/cpu/lowbit_tiles.h`): their decoding bit for bit against the gguf package's reference dequantizer, the
kernels against `ladle_kernels.reference.lowbit_linear`, a row alone against the same row in a batch (bit for bit), the
shards of a fused projection kept in their own formats, and slices on block boundaries."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf.quants import quantize

from engine_server.layers.lowbit_weight import HIGH_BITS, LowBitWeight, decode_blocks, pack_lowbit
from engine_server.layers.quantized_linear import (
    Q4Weight,
    Q8Weight,
    QuantizedEmbedding,
    QuantizedLinear,
    StackedWeight,
    concat_rows,
    pad_rows,
    quantize_q8,
)
from ladle_kernels import cpu_ops as cpu
from ladle_kernels import reference
from tests.lowbit_blocks import KINDS, block_elements, gguf_dequantize, random_blocks

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
# As the 4/8-bit kernels': integer dots exact on both sides, float32 summation order over K/32 groups apart.
TOLERANCE = dict(atol=1e-4, rtol=1e-5)
# Rows: tiles of 8 (6 without VNNI) with ragged ends, and more than one L2-sized chunk of quantized x; features:
# blocks of 8 with ragged ends; K: one and several super-blocks (K-quants), odd group counts (Q5_*).
K_SHAPES = [(1, 1, 256), (3, 7, 512), (9, 20, 256), (17, 33, 1536), (64, 8, 768), (300, 12, 1536)]
Q5_SHAPES = [(1, 1, 32), (3, 7, 96), (9, 20, 576), (17, 33, 1536), (300, 12, 1536)]


def _shapes() -> list[tuple[str, int, int, int]]:
    return [(kind, *shape) for kind in KINDS for shape in (K_SHAPES if block_elements(kind) == 256 else Q5_SHAPES)]


def _weight(kind: str, n: int, k: int, seed: int) -> LowBitWeight:
    return decode_blocks(random_blocks(kind, n, k, torch.Generator().manual_seed(seed)), kind)


@pytest.mark.parametrize("kind", list(KINDS))
def test_decoding_equals_the_gguf_reference_bit_for_bit(kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    blocks = random_blocks(kind, 9, 1024 if block_elements(kind) == 256 else 288, gen)
    weight = decode_blocks(blocks, kind)
    assert weight.values.max() < 2 ** (4 + HIGH_BITS[kind])
    assert torch.equal(weight.dequantize().view(torch.int32), gguf_dequantize(blocks, kind).view(torch.int32))


@pytest.mark.parametrize("kind", ["q5_0", "q5_1"])
def test_blocks_the_gguf_quantizer_writes_decode_exactly(kind: str) -> None:
    """The 5-bit types from gguf's own quantizer (its K-quant quantizer is not implemented in Python; llama.cpp's
    files are checked in tests/unit/test_lowbit_files.py)."""
    array = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32)
    array[0, :32] = 0.0  # a zero group
    raw = torch.from_numpy(quantize(array, KINDS[kind]).copy())
    blocks = raw.reshape(6, -1, raw.shape[1] // 8)
    assert torch.equal(decode_blocks(blocks, kind).dequantize().view(torch.int32),
                       gguf_dequantize(blocks, kind).view(torch.int32))  # fmt: skip


@needs_kernels
@pytest.mark.parametrize(("kind", "m", "n", "k"), _shapes())
def test_the_kernel_matches_the_reference(kind: str, m: int, n: int, k: int) -> None:
    weight = _weight(kind, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    x[0, :32] = 0.0  # a zero group
    got = torch.ops.ladle_cpu.packed_linear(x, *pack_lowbit(weight), n)
    torch.testing.assert_close(got, reference.lowbit_linear(x, weight.dequantize()), **TOLERANCE)


@needs_kernels
@needs_kernels
@pytest.mark.parametrize(("kind", "n", "k"), [(kind, *shape[1:]) for kind, *shape in _shapes()])
def test_the_cpp_packing_equals_the_torch_one(kind: str, n: int, k: int) -> None:
    """`pack_lowbit` through the C++ `lowbit_planes` (what loading uses, `pack_for_cpu`) gives the torch reference's
    packed blocks and tables, byte for byte, ragged blocks of 8 features included."""
    weight = _weight(kind, n, k, seed=n + k)
    ours = pack_lowbit(weight, torch.ops.ladle_cpu.lowbit_planes)
    assert all(torch.equal(a, b) for a, b in zip(ours, pack_lowbit(weight), strict=True))
    with pytest.raises(RuntimeError, match="high_bits must be 0, 1 or 2"):
        torch.ops.ladle_cpu.lowbit_planes(weight.values, 3)


def test_q2_k_is_held_in_the_files_bytes() -> None:
    """Q2_K's values take 2 bits in the kernels' layout as in the file (a 2-bit plane, no nibble plane) and its
    halves' scales stay one byte each: whole blocks of 8 rows pack into exactly their blocks' 84 bytes per 256."""
    blocks = random_blocks("q2_k", 16, 512, torch.Generator().manual_seed(9))
    packed, scales, mins = pack_lowbit(decode_blocks(blocks, "q2_k"))
    assert packed.shape == (2, 16, 1, 64)
    assert packed.numel() + 2 * scales.numel() + mins.numel() == blocks.numel()


@needs_kernels
def test_an_mxfp4_exponent_scales_the_product_exactly() -> None:
    """Each MXFP4 group's exponent byte e is the power of two 2 ** (e - 128) the kernels apply to its doubled codes:
    a product with every exponent e equals the product at e = 127 times 2 ** (e - 127), bit for bit, across the
    range where nothing is subnormal; at e = 0 and 1 (subnormal scales) it is the reference's to float32 rounding."""
    base = _weight("mxfp4", 20, 96, seed=11)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(12))

    def product(e: int) -> tuple[torch.Tensor, LowBitWeight]:
        weight = replace(base, groups=torch.full_like(base.groups, e))
        return torch.ops.ladle_cpu.packed_linear(x, *pack_lowbit(weight), 20), weight

    unit = product(127)[0]
    for e in (20, 60, 126, 128, 200, 230):
        assert torch.equal(product(e)[0], unit * 2.0 ** (e - 127)), e
    for e in (0, 1):
        got, weight = product(e)
        expected = reference.lowbit_linear(x, weight.dequantize())
        assert expected.abs().max() > 0
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_row_alone_equals_the_row_in_a_batch(kind: str) -> None:
    k = 512 if block_elements(kind) == 256 else 576
    weight = _weight(kind, 37, k, seed=3)
    packed = pack_lowbit(weight)
    x = torch.randn(333, k, generator=torch.Generator().manual_seed(4))
    batch = torch.ops.ladle_cpu.packed_linear(x, *packed, 37)
    for row in (0, 5, 7, 8, 200, 332):
        alone = torch.ops.ladle_cpu.packed_linear(x[row : row + 1].contiguous(), *packed, 37)
        assert torch.equal(alone[0], batch[row]), row


@needs_kernels
@pytest.mark.parametrize("kind", [*KINDS, "q4", "q8"])
def test_rows_unpacked_from_the_kernels_blocks_are_the_weights_own(kind: str) -> None:
    """A tied embedding reads its rows from the LM head's packed blocks (`unpack_rows`): the very values of the
    weight before packing, bit for bit, in any order, padding rows past N included."""
    gen = torch.Generator().manual_seed(5)
    n, k = 21, 512
    if kind == "q8":
        weight: LowBitWeight | Q4Weight | Q8Weight = quantize_q8(torch.randn(n, k, generator=gen))
    elif kind == "q4":
        scales = torch.rand(n, k // 32, generator=gen).half()
        weight = Q4Weight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen), scales, -8 * scales)
    else:
        weight = decode_blocks(random_blocks(kind, n, k, gen), kind)
    head = QuantizedLinear(weight, None)
    index = torch.tensor([0, 20, 7, 8, 3, 3, 15, 16])
    assert torch.equal(QuantizedEmbedding(head)(index.view(2, 4)), weight.dequantize()[index].view(2, 4, k))


def test_shards_in_different_formats_keep_their_own() -> None:
    """A Q4_K_M file's fused q/k/v: q and k in Q5_0, v in Q8_0 (a `StackedWeight`), and a fused projection of one
    format merged into one weight."""
    q, k = _weight("q5_0", 24, 512, seed=5), _weight("q5_0", 8, 512, seed=6)
    v = quantize_q8(torch.randn(8, 512, generator=torch.Generator().manual_seed(7)))
    fused = concat_rows([q, k, v])
    assert isinstance(fused, StackedWeight) and [p.shape[0] for p in fused.parts] == [32, 8]
    layer = QuantizedLinear(pad_rows(fused, 3), None)
    assert layer.format == "q5_0+q8" and layer.out_features == 43
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(8))
    separate = [QuantizedLinear(w, None)(x) for w in (concat_rows([q, k]), v)]
    torch.testing.assert_close(layer(x), torch.cat([*separate, torch.zeros(5, 3)], -1), atol=0, rtol=0)
    torch.testing.assert_close(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))
    assert isinstance(concat_rows([q, k]), LowBitWeight)


def test_slices_fall_on_blocks() -> None:
    weight = _weight("q4_k", 16, 768, seed=9)
    part = weight.columns(256, 768)
    assert torch.equal(part.dequantize(), weight.dequantize()[:, 256:768])
    rows = weight.rows(torch.tensor([3, 1]))
    assert torch.equal(rows.dequantize(), weight.dequantize()[[3, 1]])
    with pytest.raises(ValueError, match="blocks of 256"):
        weight.columns(32, 256)


@needs_kernels
def test_malformed_tables_are_refused() -> None:
    packed, scales, mins = pack_lowbit(_weight("q6_k", 8, 256, seed=10))
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="two high-bit planes"):
        torch.ops.ladle_cpu.packed_linear(x, packed[..., :160].contiguous(), scales, mins, 8)
    with pytest.raises(RuntimeError, match="super-blocks are 256 wide"):
        torch.ops.ladle_cpu.packed_linear(torch.randn(2, 96), packed[:, :3].contiguous(), scales, mins, 8)


@needs_kernels
@pytest.mark.parametrize("kind", list(KINDS))
def test_amx_tiles_give_the_vnni_tiles_bits(kind: str) -> None:
    """Where the CPU has AMX, products of 12 rows or more of every kind but Q6_K (two scales a group) run on its
    tiles: the same bits as with AMX switched off (a no-op comparison on CPUs without it)."""
    k = 1536
    weight = _weight(kind, 40, k, seed=11)
    packed = pack_lowbit(weight)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(12))
    try:
        on = torch.ops.ladle_cpu.packed_linear(x, *packed, 40)
        torch.ops.ladle_cpu.set_quant_amx(False)
        off = torch.ops.ladle_cpu.packed_linear(x, *packed, 40)
    finally:
        torch.ops.ladle_cpu.set_quant_amx(True)
    assert torch.equal(on, off)
