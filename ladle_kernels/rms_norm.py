"""RMSNorm over the last dim, with an optional fused residual add: one Triton program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle_kernels._checks import check_dtype, check_same_device, check_shape, unit_last_stride

# One row must fit one block; beyond this a row would need a loop (no supported model comes close).
_MAX_BLOCK = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    inner_rows,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row r of x, seen as `[outer, inner_rows, N]` (strided rows, unit column stride); outputs contiguous:

        s = x[r] + residual[r]                       (rounded to x's dtype; s = x[r] without a residual)
        n = s * rsqrt(sum(s²) / N + eps)             (float32, then rounded to x's dtype)
        out[r] = weight * n,  new_residual[r] = s

    The roundings mirror `ladle_kernels.reference.rms_norm` step by step so low-precision results agree to an ulp.
    """
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_rows
    inner = row % inner_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """x as `[outer, inner, N]` without a copy when it has at most 3 dims (e.g. a strided q `[T, H, D]`)."""
    if x.dim() == 1:
        x = x.view(1, 1, -1)
    elif x.dim() == 2:
        x = x.unsqueeze(0)
    elif x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
    return unit_last_stride(x)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`ladle_kernels.reference.rms_norm` on the GPU: `weight * (x / sqrt(mean(x²) + eps))` over the last dim.

    With `residual` (same shape and dtype as x), returns `(rms_norm(x + residual), x + residual)`. x may be
    strided (its last dim is read with unit stride, copied if it is not); outputs are new contiguous tensors,
    the normalised one in `promote_types(weight.dtype, x.dtype)` like the reference.
    """
    check_dtype("x", x)
    check_dtype("weight", weight)
    check_shape("weight", weight, (x.shape[-1],))
    check_same_device(x=x, weight=weight)
    n_cols = x.shape[-1]
    block = triton.next_power_of_2(n_cols)
    if block > _MAX_BLOCK:
        raise ValueError(f"rows of {n_cols} elements exceed the kernel's single-block limit of {_MAX_BLOCK}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    x3 = _as_3d(x)
    r3, new_residual = x3, out  # placeholders the kernel never touches without HAS_RESIDUAL
    if residual is not None:
        check_dtype("residual", residual, (x.dtype,))
        check_shape("residual", residual, tuple(x.shape))
        check_same_device(x=x, residual=residual)
        r3 = _as_3d(residual)
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        _rms_norm_kernel[(rows,)](
            x3,
            r3,
            unit_last_stride(weight),
            out,
            new_residual,
            x3.shape[1],
            x3.stride(0),
            x3.stride(1),
            r3.stride(0),
            r3.stride(1),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    return out if residual is None else (out, new_residual)


def _num_warps(block: int) -> int:
    """More warps for wider rows, so each thread keeps a handful of elements in registers."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4
