"""The FP8 GEMM (`ladle_kernels.fp8_linear`) against `ladle_kernels.reference.fp8_linear`: the per-token quantization
bit for bit, then the product per channel and per block (partial blocks, bias), decode and prefill row counts, ragged N
and K, dtypes, strided x, the argument checks, and on an sm_89+ GPU `torch._scaled_mm` against the same reference.

Tolerances: the kernel and the reference multiply the same e4m3 operands with float32 sums, so they differ only by
the order of those sums (float32: ~1e-6 relative of the row's magnitude) and then by one rounding to x's dtype
(an ulp of float16 / bfloat16 where the sums straddle a rounding boundary). On a GPU the e4m3 tensor cores add their
own rounding: Hopper's keep only about 14 bits of a sum of products inside one instruction (DeepSeek-V3's report,
3.3.2; on an H200 float32 outputs were ~1e-3 off where the products' magnitudes summed to ~8), which
`assert_product_close` allows for."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ladle_kernels import reference
from ladle_kernels.fp8_linear import fp8_linear, fp8_quantize_per_token, scaled_mm_available

TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}


def assert_product_close(
    out: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    block: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """`out` within `TOLERANCES` of `expected`, plus on a GPU 2^-11 of the sum of its products' magnitudes (the
    tensor cores' ~2^-13, with room): |xq * xs| @ |w * ws|.T over the same e4m3 operands."""
    tolerance = TOLERANCES[out.dtype]
    if not out.is_cuda:
        torch.testing.assert_close(out, expected, **tolerance)
        return
    xq, x_scale = reference.fp8_quantize_per_token(x)
    w = weight.float() * reference.expand_fp8_scale(scale, weight.shape[0], weight.shape[1], block)
    magnitudes = (xq.float() * x_scale).abs() @ w.abs().T
    allowed = tolerance["atol"] + tolerance["rtol"] * expected.float().abs() + 2**-11 * magnitudes
    excess = (out.float() - expected.float()).abs() - allowed
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} outputs off by up to {excess.max().item():.3g} beyond"


def operands(
    rows: int, features: int, depth: int, dtype: torch.dtype, device: torch.device, block: tuple[int, int] | None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=generator).to(device, dtype)
    w = torch.randn(features, depth, generator=generator) / depth**0.5
    if block is None:
        weight, scale = reference.fp8_quantize_per_channel(w)
    else:
        weight, scale = reference.fp8_quantize_blocks(w, block)
    return x, weight.to(device), scale.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "depth"), [(1, 64), (7, 100), (33, 1500), (3, 40000)])
def test_per_token_quantization_equals_the_reference(
    device: torch.device, dtype: torch.dtype, rows: int, depth: int
) -> None:
    """Rows of any length (1500: one partial tile; 40000: three tiles of 16384, the last partial), a zero row and one
    with a huge value."""
    x = torch.randn(rows, depth, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
    x[0] = 0
    x[-1, -1] = 3e4
    xq, scale = fp8_quantize_per_token(x)
    expected_q, expected_scale = reference.fp8_quantize_per_token(x)
    assert xq.dtype == reference.FP8_DTYPE and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=0)
    assert torch.equal(xq.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "features", "depth"), [(1, 96, 64), (5, 70, 96), (17, 130, 160), (67, 100, 48)])
def test_per_channel_product_matches_the_reference(
    device: torch.device, dtype: torch.dtype, rows: int, features: int, depth: int
) -> None:
    x, weight, scale = operands(rows, features, depth, dtype, device, None)
    out = fp8_linear(x, weight, scale, use_scaled_mm=False)
    assert out.shape == (rows, features) and out.dtype == dtype
    assert_product_close(out, reference.fp8_linear(x, weight, scale), x, weight, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("rows", "features", "depth", "block"),
    [(3, 200, 160, (64, 64)), (20, 130, 256, (128, 128)), (2, 50, 96, (16, 32)), (9, 64, 112, (48, 96))],
)
def test_block_scaled_product_with_bias_matches_the_reference(
    device: torch.device, dtype: torch.dtype, rows: int, features: int, depth: int, block: tuple[int, int]
) -> None:
    """Blocks partial in both dims (200 x 160 of 64 x 64), DeepSeek's 128 x 128, and blocks of 32 and 96 columns that
    the kernel's K tiles (32 wide then) must not straddle."""
    x, weight, scale = operands(rows, features, depth, dtype, device, block, seed=rows)
    bias = torch.randn(features, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out = fp8_linear(x, weight, scale, bias, block=block)
    assert_product_close(out, reference.fp8_linear(x, weight, scale, bias, block), x, weight, scale, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("block", [None, (128, 128), (16, 32), (48, 96)], ids=str)
def test_the_few_rows_kernel_matches_the_reference(
    device: torch.device, dtype: torch.dtype, rows: int, block: tuple[int, int] | None
) -> None:
    """A decode step's few rows in one launch: each row rounded to e4m3 inside the kernel as the reference rounds it
    (a zero row, a huge value), per channel and per block (96-wide blocks: K tiles of 32), ragged N and K, bias."""
    features, depth = 70, 200
    x, weight, scale = operands(rows, features, depth, dtype, device, block, seed=rows)
    x[0] = 0
    x[-1, -1] = 3e4
    bias = torch.randn(features, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    out = fp8_linear(x, weight, scale, bias, block=block, few_rows=True)
    assert out.shape == (rows, features) and out.dtype == dtype
    assert_product_close(out, reference.fp8_linear(x, weight, scale, bias, block), x, weight, scale, block)


def test_few_rows_take_the_few_rows_kernel(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to FEW_ROWS rows (strided ones too) go to the few-rows kernel; more to the quantization and a GEMM."""
    from ladle_kernels import fp8_linear as module

    taken: list[int] = []
    few_rows = module._few_rows

    def recorded(x: torch.Tensor, *rest: Any) -> torch.Tensor:
        taken.append(x.shape[0])
        return few_rows(x, *rest)

    monkeypatch.setattr(module, "_few_rows", recorded)
    x, weight, scale = operands(module.FEW_ROWS + 1, 40, 64, torch.float32, device, None)
    wide = torch.cat([x, x], dim=1)[:, :64]
    for count in (1, module.FEW_ROWS, module.FEW_ROWS + 1):
        expected = reference.fp8_linear(x[:count], weight, scale)
        torch.testing.assert_close(fp8_linear(wide[:count], weight, scale), expected)
    assert taken == [1, module.FEW_ROWS]
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_linear(torch.zeros(17, 64, device=device), weight, scale, few_rows=True)


def test_the_few_rows_kernel_takes_other_tiles(device: torch.device) -> None:
    """The tiles a benchmark sweeps give the same products (a row's sums in another order)."""
    x, weight, scale = operands(3, 70, 200, torch.float32, device, (128, 128))
    expected = reference.fp8_linear(x, weight, scale, block=(128, 128))
    for tiles in ((16, 128, 4), (64, 32, 8), (8, 64, 2)):
        out = fp8_linear(x, weight, scale, block=(128, 128), few_rows=True, few_rows_tiles=tiles)
        assert_product_close(out, expected, x, weight, scale, (128, 128))
    with pytest.raises(ValueError, match="does not divide"):
        fp8_linear(x, weight, scale, block=(128, 128), few_rows=True, few_rows_tiles=(16, 256, 4))


def test_the_gemm_takes_other_tiles(device: torch.device) -> None:
    x, weight, scale = operands(20, 70, 256, torch.float32, device, (128, 128))
    expected = reference.fp8_linear(x, weight, scale, block=(128, 128))
    for tiles in ((16, 32, 32, 4, 2), (64, 128, 128, 4, 3)):
        out = fp8_linear(x, weight, scale, block=(128, 128), use_scaled_mm=False, gemm_tiles=tiles)
        assert_product_close(out, expected, x, weight, scale, (128, 128))
    with pytest.raises(ValueError, match="does not divide"):
        fp8_linear(x, weight, scale, block=(128, 128), use_scaled_mm=False, gemm_tiles=(16, 32, 256, 4, 2))


def test_the_product_is_close_to_the_float_one(device: torch.device) -> None:
    """What FP8 costs on random data: both operands at 3 mantissa bits, within ~2% of the float product's scale."""
    generator = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 512, generator=generator), torch.randn(64, 512, generator=generator) / 512**0.5
    weight, scale = reference.fp8_quantize_per_channel(w)
    out = fp8_linear(x.to(device), weight.to(device), scale.to(device), use_scaled_mm=False).cpu()
    exact = x @ w.T
    assert (out - exact).abs().max() <= 0.05 * exact.abs().max()


def test_strided_rows_are_read(device: torch.device) -> None:
    x, weight, scale = operands(4, 40, 64, torch.float32, device, None)
    wide = torch.cat([x, x], dim=1)[:, :64]
    assert not wide.is_contiguous()
    torch.testing.assert_close(fp8_linear(wide, weight, scale), reference.fp8_linear(x, weight, scale))


def test_arguments_are_checked(device: torch.device) -> None:
    x, weight, scale = operands(2, 32, 64, torch.float32, device, None)
    with pytest.raises(ValueError, match="weight has dtype"):
        fp8_linear(x, weight.float(), scale)
    with pytest.raises(ValueError, match="scale has dtype"):
        fp8_linear(x, weight, scale.half())
    with pytest.raises(ValueError, match="does not match"):
        fp8_linear(x[:, :32], weight, scale)
    with pytest.raises(ValueError, match="scale has shape"):
        fp8_linear(x, weight, scale[:1])
    with pytest.raises(ValueError, match="scale has shape"):
        fp8_linear(x, weight, scale, block=(16, 32))
    with pytest.raises(ValueError, match="multiple of 32"):  # e4m3 K tiles are 32 wide at least
        fp8_linear(x, weight, scale.new_ones(2, 2), block=(16, 48))
    with pytest.raises(ValueError, match="bias has shape"):
        fp8_linear(x, weight, scale, scale[:, 0][:5])
    assert fp8_linear(x[:0], weight, scale).shape == (0, 32)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not scaled_mm_available(torch.device("cuda")),
    reason="torch._scaled_mm's rowwise FP8 GEMM needs an sm_89+ GPU",
)
@pytest.mark.parametrize(("rows", "features", "depth"), [(1, 96, 64), (16, 4096, 1024), (300, 512, 2048)])
def test_scaled_mm_matches_the_reference(rows: int, features: int, depth: int) -> None:
    device = torch.device("cuda")
    x, weight, scale = operands(rows, features, depth, torch.bfloat16, device, None)
    bias = torch.randn(features, device=device, dtype=torch.bfloat16)
    expected = reference.fp8_linear(x, weight, scale, bias)
    torch.testing.assert_close(fp8_linear(x, weight, scale, bias), expected, **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(fp8_linear(x, weight, scale, bias, use_scaled_mm=False), expected,
                               **TOLERANCES[torch.bfloat16])  # fmt: skip
