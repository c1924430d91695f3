"""FP8 linear layers on the GPU: `x @ W.T` with W in float8 e4m3 and x rounded to e4m3 per token on the fly.

The weight is `--quantization fp8`'s (`engine_server.layers.fp8_linear.Fp8Weight`): `[N, K]` e4m3 with float32
scales, one per output channel (`[N, 1]`) or one per block of the checkpoint's `weight_block_size` (`[ceil(N/bn),
ceil(K/bk)]`). x's rows are quantized first by a small Triton kernel (`_quantize_rows_kernel`: each row's largest
magnitude maps to 448), so a step streams one byte per weight and multiplies e4m3 by e4m3 with float32 sums.
Contract: `kernels.reference.fp8_linear`.

Two GEMMs take the quantized rows:
- `torch._scaled_mm` (cuBLASLt/CUTLASS, rowwise scales) for per-channel weights in bfloat16 where this torch and
  GPU run it (sm_89+, probed once per device against the reference: `scaled_mm_available`);
- otherwise `_fp8_gemm_kernel`, which also takes block-wise scales (each K tile's partial product scaled by its
  block's scale before it is added), multiplying e4m3 tiles on the tensor cores (under Triton's interpreter,
  widened to float32 first: the same products and float32 sums).
Both need e4m3 tensor cores, i.e. compute capability 8.9 or newer (Ada, Hopper and later): `--quantization fp8`
is refused on older GPUs (`engine_server.quantization`). Block sizes are a first guess, not yet tuned on hardware;
there is no split-K yet.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels._checks import check_dtype, check_same_device, unit_last_stride
from kernels._e4m3 import round_to_e4m3
from kernels.reference import FP8_DTYPE, FP8_GPU_BLOCK_COLUMNS, FP8_MAX, FP8_MIN_SCALE

_QUANT_BLOCK = 1024
_BLOCK_K = 64
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor cores


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    """Program m: scale[m] = max(max_k |x[m, k]| / MAX, MIN_SCALE), q[m, k] = e4m3(clamp(x[m, k] / scale[m],
    ±MAX)), both divisions correctly rounded in float32 (`kernels.reference.fp8_quantize_per_token`)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), MAX), MIN_SCALE)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -MAX), MAX))
        tl.store(q_ptr + row * K + ks, q.to(tl.float8e4nv), mask=ks < K)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _fp8_gemm_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, K, ws_row_stride,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    """Program (m, n) writes out[m-block, n-block] = xs[m] * sum_t ws[n, t] * (xq[m, K_t] @ w[n, K_t].T) (+ bias[n])
    rounded once to out's dtype, with xq, w e4m3, sums in float32 and t over K tiles of BLOCK_K.

    Per channel (SCALE_COLS == 0) ws[n] is one `[N, 1]` scale, applied once after the K loop; per block, ws is
    `[ceil(N / SCALE_ROWS), ceil(K / SCALE_COLS)]` and each tile's scale is its block's (BLOCK_K divides
    SCALE_COLS, so a tile never straddles two blocks)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(xq_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # fmt: skip
        if WIDEN:  # Triton's interpreter multiplies e4m3 bytes as integers: widen them first (exact)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # Each tile's product is added to the float32 sums here, not accumulated inside the dot: Hopper's e4m3
        # tensor cores keep ~13 bits of a running sum, so summing all of K there would lose precision with K.
        partial = tl.dot(a, b, input_precision="ieee")
        if SCALE_COLS == 0:
            acc += partial
        else:
            scale = tl.load(ws_ptr + (cols // SCALE_ROWS) * ws_row_stride + k0 // SCALE_COLS, mask=col_ok, other=0.0)
            acc += partial * scale[None, :]
    acc = acc * tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if SCALE_COLS == 0:
        acc = acc * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.reference.fp8_quantize_per_token` on the GPU: x `[M, K]` (float32, float16 or bfloat16) ->
    (xq `[M, K]` e4m3, scale `[M, 1]` float32)."""
    check_dtype("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-d; got {tuple(x.shape)}")
    x = unit_last_stride(x)
    rows, depth = x.shape
    xq = torch.empty(rows, depth, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows and depth:
        block = min(_QUANT_BLOCK, triton.next_power_of_2(depth))
        _quantize_rows_kernel[(rows,)](x, xq, scale, depth, x.stride(0), MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
                                       BLOCK=block)  # fmt: skip
    return xq, scale


def _blocks(rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for `rows` rows of x: decode-sized batches get narrow tiles and more programs."""
    if rows <= 16:
        return 16, 64
    if rows <= 64:
        return 64, 64
    return 128, 64


def check_scale(scale: torch.Tensor, features: int, depth: int, block: tuple[int, int] | None) -> None:
    """An FP8 weight `[N, K]`'s float32 scale must be `[N, 1]` (per channel, `block` None) or `[ceil(N/bn),
    ceil(K/bk)]` (per block of `block` = (bn, bk), bk a multiple of `FP8_GPU_BLOCK_COLUMNS`, 32): raises ValueError
    otherwise."""
    check_dtype("scale", scale, (torch.float32,))
    if block is None:
        expected = (features, 1)
    else:
        if block[0] < 1 or block[1] % FP8_GPU_BLOCK_COLUMNS or block[1] < FP8_GPU_BLOCK_COLUMNS:
            raise ValueError(f"block {block}: rows >= 1 and columns a multiple of {FP8_GPU_BLOCK_COLUMNS} expected")
        expected = (-(-features // block[0]), -(-depth // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected {list(expected)} for block {block}")


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None, use_scaled_mm: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """`kernels.reference.fp8_linear` on the GPU: x `[M, K]` (float32, float16 or bfloat16) times the e4m3 weight
    `[N, K]` with its float32 `scale` (`[N, 1]`, or per block of `block`: `check_scale`) plus `bias` `[N]` ->
    `[M, N]` in x's dtype. `use_scaled_mm` (tests) forces the GEMM (None: `torch._scaled_mm` where
    `scaled_mm_available` and the scale is per channel). Raises ValueError on dtypes, shapes or devices it
    cannot read."""
    check_dtype("x", x)
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_same_device(x=x, weight=weight, scale=scale)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    rows, depth = x.shape
    features = weight.shape[0]
    check_scale(scale, features, depth, block)
    if bias is not None and (tuple(bias.shape) != (features,) or bias.device != x.device):
        raise ValueError(f"bias has shape {tuple(bias.shape)} on {bias.device}; expected [{features}] on {x.device}")
    if rows == 0 or features == 0:
        return x.new_zeros(rows, features)
    xq, x_scale = fp8_quantize_per_token(x)
    weight, scale = weight.contiguous(), scale.contiguous()
    if use_scaled_mm is None:
        use_scaled_mm = block is None and x.dtype == torch.bfloat16 and scaled_mm_available(x.device)
    if use_scaled_mm:
        return _scaled_mm(xq, x_scale, weight, scale, bias, x.dtype)
    out = torch.empty(rows, features, dtype=x.dtype, device=x.device)
    block_m, block_n = _blocks(rows)
    block_k = _BLOCK_K if block is None else next(b for b in (64, FP8_GPU_BLOCK_COLUMNS) if block[1] % b == 0)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(features, block_n))
    _fp8_gemm_kernel[grid](
        xq, x_scale, weight, scale, bias if bias is not None else scale, out,
        rows, features, depth, scale.stride(0),
        SCALE_ROWS=block[0] if block else 1, SCALE_COLS=block[1] if block else 0, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        WIDEN=isinstance(_fp8_gemm_kernel, InterpretedFunction),
    )  # fmt: skip
    return out


def _scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """cuBLASLt's FP8 GEMM with rowwise scales: x_scale `[M, 1]`, the weight's `[1, N]` (its rows, read as the
    column-major `[K, N]` operand it wants: `weight.t()` of the row-major `[N, K]`)."""
    out: torch.Tensor = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), bias=bias, out_dtype=dtype
    )
    return out


@functools.cache
def scaled_mm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs rowwise-scaled e4m3 GEMMs with bfloat16 output on `device` and agrees with
    the reference: a CUDA GPU of compute capability 8.9 or newer and a torch that has the kernel, checked once per
    device on a small product (at load, never inside a graph capture)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        return False
    from kernels.reference import fp8_linear as reference_fp8_linear
    from kernels.reference import fp8_quantize_per_channel

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=generator).to(device, torch.bfloat16)
    weight, scale = fp8_quantize_per_channel(torch.randn(48, 64, generator=generator).to(device))
    try:
        xq, x_scale = fp8_quantize_per_token(x)
        got = _scaled_mm(xq, x_scale, weight, scale, None, torch.bfloat16)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    expected = reference_fp8_linear(x, weight, scale)
    return bool(torch.allclose(got.float(), expected.float(), atol=5e-2, rtol=2e-2))
