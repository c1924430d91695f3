"""The Triton rotary embedding against `ladle_kernels.reference.rotary_embedding`: head dims, GQA, caches, dtypes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_server.config import RopeScaling
from ladle_kernels import reference
from ladle_kernels.rotary import rotary_embedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The reference rounds after each product; the kernel once at the end: a couple of ulps apart at most.
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}
LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
MAX_POSITIONS = 300


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"), [(1, 4, 4, 64), (3, 6, 2, 96), (7, 3, 1, 80), (5, 8, 8, 128)]
)
def test_rotary_matches_reference(
    device: torch.device, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * heads + head_dim)
    # q and k as the attention layer makes them: strided views into one fused projection.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen).to(device)
    scaling = LLAMA3 if head_dim == 128 else None
    cache = reference.build_cos_sin_cache(head_dim, MAX_POSITIONS, 10000.0, scaling, dtype).to(device)
    q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOLERANCES[dtype])


def test_rotary_casts_a_float32_cache_like_the_reference(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 2, 64, generator=gen).to(device, torch.float16)
    k = torch.randn(4, 1, 64, generator=gen).to(device, torch.float16)
    positions = torch.tensor([0, 7, 299, 3], dtype=torch.int32, device=device)
    cache = torch.randn(MAX_POSITIONS, 64, generator=gen).to(device)  # any cache, not only a rope table
    outputs = rotary_embedding(positions, q, k, cache)
    for out, ref in zip(outputs, reference.rotary_embedding(positions, q, k, cache), strict=True):
        torch.testing.assert_close(out, ref, **TOLERANCES[torch.float16])


def test_rotary_leaves_its_inputs_alone(device: torch.device) -> None:
    q = torch.randn(2, 2, 16, device=device)
    k = torch.randn(2, 2, 16, device=device)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.tensor([1, 2], device=device), q, k, torch.randn(4, 16, device=device))
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rotary_rejects_a_cache_of_another_width(device: torch.device) -> None:
    q = torch.randn(2, 2, 16, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(torch.tensor([0, 1], device=device), q, q, torch.randn(4, 8, device=device))
