"""The Triton KV-cache write against `ladle_kernels.reference.write_kv_cache`: scattered slots, casts, dtypes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ladle_kernels import reference
from ladle_kernels._e4m3 import e4m3_bits, e4m3_value
from ladle_kernels.kv_cache import write_kv_cache

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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "kv_heads", "head_dim"), [(1, 1, 64), (7, 3, 128), (33, 2, 96), (5, 2, 20)])
def test_write_kv_cache_packs_fp8_rows_as_the_reference(
    device: torch.device, dtype: torch.dtype, tokens: int, kv_heads: int, head_dim: int
) -> None:
    """Bit for bit `reference.fp8_kv_rows`' bytes and scales, over rows of every size: beyond e4m3's ±448 before
    scaling, far below its smallest normal, all zeros, and values that round up into the next binade (which
    Triton's interpreter would get wrong through a plain cast)."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    cache = torch.randint(0, 256, (2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim + 4), generator=gen,
                          dtype=torch.uint8).to(device)  # fmt: skip
    expected = cache.clone()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    k, v = strided_kv(tokens, kv_heads, head_dim, dtype, device, seed=tokens)
    k[0] *= 1000.0
    v[-1] *= 1e-4
    if tokens > 2:
        k[1, 0] = 0.0
        v[1, 0, :4] = torch.tensor([124.0, -124.0, 60.0, 448.0])
    write_kv_cache(k, v, cache, slots)
    reference.write_kv_cache(k, v, expected, slots)
    assert torch.equal(cache, expected)
    flat = cache.view(2, NUM_BLOCKS * BLOCK_SIZE, kv_heads, head_dim + 4)
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, or of the row's smallest normal step.
    for stored, wrote in ((flat[0], k), (flat[1], v)):
        values, x = reference.fp8_kv_values(stored[slots.cpu()].cpu()), wrote.float().cpu()
        bound = x.abs() / 16 + x.abs().amax(-1, keepdim=True) / 448 * 2**-9
        assert ((values - x).abs() <= bound).all()


def test_write_kv_cache_fp8_skips_slots_outside_the_cache(device: torch.device) -> None:
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 1, 16 + 4, device=device, dtype=torch.uint8)
    k, v = strided_kv(3, 1, 16, torch.float32, device, seed=9)
    write_kv_cache(k, v, cache, torch.tensor([-1, 5, NUM_BLOCKS * BLOCK_SIZE], device=device))
    expected = torch.zeros_like(cache)
    reference.write_kv_cache(k[1:2], v[1:2], expected, torch.tensor([5], device=device))
    assert torch.equal(cache, expected)


@triton.jit
def _bytes_round_trip(bytes_ptr, values_ptr, again_ptr):
    i = tl.arange(0, 256)
    value = e4m3_value(tl.load(bytes_ptr + i))
    tl.store(values_ptr + i, value)
    tl.store(again_ptr + i, e4m3_bits(value))


def test_every_e4m3_byte_reads_as_torchs_value_and_writes_back(device: torch.device) -> None:
    """The bit arithmetic that stands in for Triton's float8 type (sm_89+ only) over all 256 bytes: each reads as
    torch's float8_e4m3fn value (NaN's two bytes aside) and is written back as itself."""
    every = torch.arange(256, dtype=torch.uint8)
    values, again = torch.empty(256, device=device), torch.empty(256, dtype=torch.uint8, device=device)
    _bytes_round_trip[(1,)](every.to(device), values, again)
    finite = every.view(reference.FP8_DTYPE).float().isfinite()
    assert finite.sum() == 254
    assert torch.equal(values.cpu()[finite], every.view(reference.FP8_DTYPE).float()[finite])
    assert torch.equal(again.cpu()[finite], every[finite])
