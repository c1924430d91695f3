"""The Triton KV-cache write against `kernels.reference.write_kv_cache`: scattered slots, casts, dtypes."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.kv_cache import write_kv_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_BLOCKS, BLOCK_SIZE = 5, 16


def strided_kv(
    tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the attention layer passes them: views into one fused k/v projection."""
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    return k, v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "kv_heads", "head_dim"), [(1, 1, 64), (3, 2, 80), (7, 3, 128), (33, 2, 96)])
def test_write_kv_cache_matches_reference(
    device: torch.device, dtype: torch.dtype, tokens: int, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens + head_dim)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(device, dtype)
    expected = cache.clone()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    k, v = strided_kv(tokens, kv_heads, head_dim, dtype, device, seed=tokens)
    write_kv_cache(k, v, cache, slots)
    reference.write_kv_cache(k, v, expected, slots)
    assert torch.equal(cache, expected)  # a copy: bit-exact


def test_write_kv_cache_casts_to_the_cache_dtype(device: torch.device) -> None:
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 64, device=device, dtype=torch.float16)
    expected = cache.clone()
    k, v = strided_kv(4, 2, 64, torch.float32, device, seed=8)
    slots = torch.tensor([3, 17, 64, 79], device=device)
    write_kv_cache(k, v, cache, slots)
    reference.write_kv_cache(k, v, expected, slots)
    assert torch.equal(cache, expected)


def test_write_kv_cache_skips_slots_outside_the_cache(device: torch.device) -> None:
    """The reference raises on such slots; the kernel cannot, so it must at least never write out of bounds."""
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 1, 16, device=device)
    k, v = strided_kv(3, 1, 16, torch.float32, device, seed=9)
    write_kv_cache(k, v, cache, torch.tensor([-1, 5, NUM_BLOCKS * BLOCK_SIZE], device=device))
    expected = torch.zeros_like(cache)
    reference.write_kv_cache(k[1:2], v[1:2], expected, torch.tensor([5], device=device))
    assert torch.equal(cache, expected)


def test_write_kv_cache_rejects_a_wrong_shape(device: torch.device) -> None:
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16, device=device)
    k = torch.randn(3, 1, 16, device=device)
    with pytest.raises(ValueError, match="shape"):
        write_kv_cache(k, k, cache, torch.arange(3, device=device))
