"""The Triton RMSNorm against `ladle_kernels.reference.rms_norm`: odd widths, strided rows, residual, dtypes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ladle_kernels import reference
from ladle_kernels.rms_norm import rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernel rounds where the reference does, so results agree to about one ulp of the output dtype (the
# interpreter rounds float32 -> bfloat16 toward zero, the GPU to nearest).
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 96), (3, 100), (7, 128), (2, 3, 40), (2, 2, 2, 24)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], with_residual: bool
) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    if with_residual:
        residual = torch.randn(shape, generator=gen).to(device, dtype)
        out, new_residual = rms_norm(x, weight, 1e-6, residual)
        expected, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
        torch.testing.assert_close(new_residual, expected_residual, **TOLERANCES[dtype])
    else:
        out = rms_norm(x, weight, 1e-6)
        expected = reference.rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_strided_heads(device: torch.device, dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: per-head rows of a `[T, H, D]` view into a fused qkv projection, read in place."""
    tokens, heads, head_dim = 5, 3, 24
    qkv = torch.randn(tokens, heads * head_dim + 40, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert not q.is_contiguous()
    weight = torch.rand(head_dim, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    torch.testing.assert_close(rms_norm(q, weight, 1e-5), reference.rms_norm(q, weight, 1e-5), **TOLERANCES[dtype])


def test_rms_norm_promotes_to_the_weight_dtype(device: torch.device) -> None:
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    weight = torch.randn(100, generator=torch.Generator().manual_seed(4)).to(device)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), **TOLERANCES[torch.bfloat16])


def test_rms_norm_rejects_mismatched_arguments(device: torch.device) -> None:
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=device), 1e-6, torch.randn(2, 8, device=device, dtype=torch.float16))
    assert rms_norm(x[:0], torch.ones(8, device=device), 1e-6).shape == (0, 8)
