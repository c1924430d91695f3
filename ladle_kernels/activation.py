"""SwiGLU's `silu(gate) * up` on a fused gate/up projection: one Triton program per row and column block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle_kernels._checks import check_dtype, unit_last_stride

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr):
    """For row r of x `[R, 2d]` and column j < d, with g = x[r, j] and u = x[r, d + j]:

        out[r, j] = silu(g) * u,   silu(g) = g / (1 + exp(-g))

    silu is computed in float32 and rounded to x's dtype before the product, as torch does in two ops.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`ladle_kernels.reference.silu_and_mul` on the GPU: `silu(x[..., :d]) * x[..., d:]` for x `[..., 2d]`.

    Rows may be strided (the last dim is read with unit stride, copied if it is not); returns a new
    contiguous `[..., d]` tensor in x's dtype.
    """
    check_dtype("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2d]; got {tuple(x.shape)}")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows2d = unit_last_stride(x.reshape(-1, x.shape[-1]))
    block = min(_BLOCK, triton.next_power_of_2(d))
    grid = (rows2d.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](rows2d, out, rows2d.stride(0), d, BLOCK=block)
    return out
