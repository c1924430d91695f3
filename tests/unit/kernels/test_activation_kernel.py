"""The Triton `silu_and_mul` against `ladle_kernels.reference.silu_and_mul`: odd widths, several blocks, dtypes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ladle_kernels import reference
from ladle_kernels.activation import silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 96), (3, 200), (7, 2200), (2, 3, 192)])  # 2200: d = 1100 spans two blocks
def test_silu_and_mul_matches_reference(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))).to(device, dtype)
    out = silu_and_mul(x)
    expected = reference.silu_and_mul(x)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_silu_and_mul_of_strided_rows(device: torch.device) -> None:
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(6)).to(device)[:, :200]
    assert not x.is_contiguous()
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **TOLERANCES[torch.float32])


def test_silu_and_mul_rejects_an_odd_width(device: torch.device) -> None:
    with pytest.raises(ValueError, match="2d"):
        silu_and_mul(torch.randn(2, 7, device=device))
