"""Rotary position embedding of q and k (NeoX half split) from a cos/sin cache: one Triton program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle_kernels._checks import check_dtype, check_same_device, unit_last_stride


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_h, num_heads, half, cos, sin, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the `num_heads` heads of one token (rows `stride_h` apart) into contiguous `out_ptr`."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    src = x_ptr + heads * stride_h + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + heads * (2 * half) + dims
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    cache_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_cache,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_q_heads,
    num_kv_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Token t at position p, with `(cos, sin) = cache[p, :D/2], cache[p, D/2:]` rounded to q's dtype and
    `x = cat(x1, x2)` for every head of q[t] and k[t]:

        out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)      (float32, rounded to q's dtype)
    """
    t = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + t).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cache_ptr + position * stride_cache + dims
    dtype = q_out_ptr.dtype.element_ty
    # Rounded to q's dtype first because the reference casts the cache rows before multiplying.
    cos = tl.load(row, mask=dims < half, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + half, mask=dims < half, other=0.0).to(dtype).to(tl.float32)
    head_size = 2 * half
    _rotate_heads(
        q_ptr + t * stride_qt,
        q_out_ptr + t * num_q_heads * head_size,
        stride_qh,
        num_q_heads,
        half,
        cos,
        sin,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + t * stride_kt,
        k_out_ptr + t * num_kv_heads * head_size,
        stride_kh,
        num_kv_heads,
        half,
        cos,
        sin,
        BLOCK_HK,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ladle_kernels.reference.rotary_embedding` on the GPU: rotate q `[T, H, D]` and k `[T, Hkv, D]` by position.

    `positions` `[T]` (int32/int64) must index rows of `cos_sin_cache` `[P, D]` (`cat(cos, sin)` per row, any
    float dtype); out-of-range positions are not checked (that would need a device sync). q and k share a
    dtype and may be strided views (e.g. slices of a fused qkv projection). Returns new contiguous tensors.
    """
    check_dtype("q", q)
    check_dtype("k", k, (q.dtype,))
    check_dtype("cos_sin_cache", cos_sin_cache)
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    if q.dim() != 3 or k.dim() != 3 or positions.dim() != 1:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}"
        raise ValueError(f"expected q [T, H, D], k [T, Hkv, D], positions [T]; got {shapes}")
    tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or positions.shape[0] != tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} disagree")
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [P, D] for an even D = {head_dim}")
    q, k, cos_sin_cache = unit_last_stride(q), unit_last_stride(k), unit_last_stride(cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            positions,
            cos_sin_cache,
            q,
            k,
            q_out,
            k_out,
            cos_sin_cache.stride(0),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            num_q_heads,
            k.shape[1],
            head_dim // 2,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return q_out, k_out
