"""The Triton weight-only int8 linear against `ladle_kernels.reference.int8_linear`: decode and prefill row counts,
ragged N and K, split-K, dtypes, and the argument checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_server.layers.quantized_linear import quantize_q8
from ladle_kernels import reference
from ladle_kernels.int8_linear import int8_linear

TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-1, rtol=2e-2),
}


def operands(rows: int, features: int, depth: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=generator).to(device, dtype)
    weight = quantize_q8(torch.randn(features, depth, generator=generator) / depth**0.5)
    return x, weight.qs.to(device), weight.scales.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("rows", "features", "depth"),
    [(1, 96, 64), (5, 70, 96), (16, 32, 128), (17, 130, 160), (40, 64, 256), (67, 100, 32)],
)
def test_int8_linear_matches_reference(
    device: torch.device, dtype: torch.dtype, rows: int, features: int, depth: int
) -> None:
    x, qs, scales = operands(rows, features, depth, dtype, device)
    out = int8_linear(x, qs, scales)
    assert out.shape == (rows, features) and out.dtype == dtype
    torch.testing.assert_close(out, reference.int8_linear(x, qs, scales), **TOLERANCES[dtype])


@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_split_k_sums_to_the_same_product(device: torch.device, split_k: int) -> None:
    """K = 448 is 7 blocks of 64: splits of uneven length, and more splits asked for than blocks."""
    x, qs, scales = operands(3, 48, 448, torch.float32, device, seed=split_k)
    whole = int8_linear(x, qs, scales, split_k=1)
    torch.testing.assert_close(int8_linear(x, qs, scales, split_k=split_k), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole, reference.int8_linear(x, qs, scales), **TOLERANCES[torch.float32])


def test_int8_linear_reads_strided_rows(device: torch.device) -> None:
    x, qs, scales = operands(4, 40, 64, torch.float32, device)
    wide = torch.cat([x, x], dim=1)[:, :64]
    assert not wide.is_contiguous()
    torch.testing.assert_close(int8_linear(wide, qs, scales), reference.int8_linear(x, qs, scales))


def test_int8_linear_checks_its_arguments(device: torch.device) -> None:
    x, qs, scales = operands(2, 32, 64, torch.float32, device)
    with pytest.raises(ValueError, match="qs has dtype"):
        int8_linear(x, qs.float(), scales)
    with pytest.raises(ValueError, match="scales has dtype"):
        int8_linear(x, qs, scales.float())
    with pytest.raises(ValueError, match="does not match"):
        int8_linear(x[:, :32], qs, scales)
    with pytest.raises(ValueError, match="scales has shape"):
        int8_linear(x, qs, scales[:, :1])
    assert int8_linear(x[:0], qs, scales).shape == (0, 32)
