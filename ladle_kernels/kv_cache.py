"""Store a step's K/V in the paged cache through the slot mapping: one Triton program per token; into an FP8
cache as `ladle_kernels.reference.fp8_kv_rows` packs them, bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle_kernels._checks import FLOAT_DTYPES, check_dtype, check_same_device, unit_last_stride
from ladle_kernels._e4m3 import e4m3_bits, scaled_to_e4m3
from ladle_kernels.reference import (
    FP8_KV_DTYPE,
    FP8_KV_SCALE_BYTES,
    FP8_MAX,
    FP8_MIN_SCALE,
    is_fp8_kv_cache,
    kv_cache_head_dim,
)

_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)
_FP8_SCALE_BYTES = tl.constexpr(FP8_KV_SCALE_BYTES)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    v_offset,
    num_slots,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    """With s = slot_mapping[t] and the cache seen as `[2, num_slots, Hkv, row]` (K then V, v_offset apart):

        cache[0, s] = k[t],  cache[1, s] = v[t]      (cast to the cache's dtype)

    or with FP8, each head's row packed as `reference.fp8_kv_rows` does (row = head_dim + 4 bytes: e4m3 values,
    then the float32 scale). Slots outside `[0, num_slots)` are skipped rather than written out of bounds.
    """
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # Compared as a broadcast tensor: Triton's interpreter mis-types a scalar condition and'ed into a mask.
    slots = slot + tl.zeros([BLOCK_H, 1], tl.int64)
    mask = (heads < num_heads) & (dims < head_dim) & (slots >= 0) & (slots < num_slots)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    if FP8:
        row = head_dim + _FP8_SCALE_BYTES
        base = cache_ptr + slots * (num_heads * row) + heads * row
        _store_fp8_rows(base, k.to(tl.float32), mask, head_dim, dims)
        _store_fp8_rows(base + v_offset, v.to(tl.float32), mask, head_dim, dims)
    else:
        dst = cache_ptr + slots * (num_heads * head_dim) + heads * head_dim + dims
        dtype = cache_ptr.dtype.element_ty
        tl.store(dst, k.to(dtype), mask=mask)
        tl.store(dst + v_offset, v.to(dtype), mask=mask)


@triton.jit
def _store_fp8_rows(base, x, mask, head_dim, dims):
    """Rows x `[BLOCK_H, BLOCK_D]` (float32, zero where masked) packed at `base` (a uint8 pointer per row):
    scale = max(max|x| / 448, FP8_MIN_SCALE), the e4m3 bits of x / scale clamped to ±448 (both divisions
    correctly rounded, as torch's), then the scale."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _FP8_MIN_SCALE)[:, None]
    scaled = scaled_to_e4m3(x, scale, _FP8_MAX)
    tl.store(base + dims, e4m3_bits(scaled), mask=mask)
    scale_ptr = (base + head_dim).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_ptr, scale, mask=tl.max(mask.to(tl.int32), axis=1)[:, None] > 0)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`ladle_kernels.reference.write_kv_cache` on the GPU: `kv_cache[0|1].flat_slots[slot_mapping[t]] = k|v[t]`.

    k, v `[T, Hkv, D]` (any float dtype, possibly strided views), the contiguous cache
    `[2, num_blocks, block_size, Hkv, D]` (or an FP8 one, `[..., D + 4]` uint8), slot_mapping `[T]` int64 (or
    int32). The reference raises on a slot outside the cache; this kernel cannot raise without a device sync, so
    it skips such a token instead (never writing out of bounds). Callers must not rely on either: valid slots are
    part of the contract.
    """
    check_dtype("k", k)
    check_dtype("v", v)
    check_dtype("kv_cache", kv_cache, (*FLOAT_DTYPES, FP8_KV_DTYPE))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_same_device(k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [2, blocks, block_size, Hkv, D]; got {tuple(kv_cache.shape)}")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be [T]; got {tuple(slot_mapping.shape)}")
    _, num_blocks, block_size, num_heads, _ = kv_cache.shape
    head_dim = kv_cache_head_dim(kv_cache)
    tokens = slot_mapping.shape[0]
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (tokens, num_heads, head_dim):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {(tokens, num_heads, head_dim)}")
    if tokens == 0:
        return
    k, v = unit_last_stride(k), unit_last_stride(v)
    _write_kv_cache_kernel[(tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        num_blocks * block_size,
        num_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=is_fp8_kv_cache(kv_cache),
    )
