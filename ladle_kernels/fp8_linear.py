"""FP8 linear layers on the GPU: `x @ W.T` with W in float8 e4m3 and x rounded to e4m3 per token on the fly.

The weight is `--quantization fp8`'s (`engine_server.layers.fp8_linear.Fp8Weight`): `[N, K]` e4m3 with float32
scales, one per output channel (`[N, 1]`) or one per block of the checkpoint's `weight_block_size` (`[ceil(N/bn),
ceil(K/bk)]`). x's rows are quantized first by a small Triton kernel (`_quantize_rows_kernel`: each row's largest
magnitude maps to 448), so a step streams one byte per weight and multiplies e4m3 by e4m3 with float32 sums.
Contract: `ladle_kernels.reference.fp8_linear`.

Three GEMMs take the quantized rows:
- `_fp8_few_rows_kernel` for at most `FEW_ROWS` rows (a decode step of a few sequences, single-stream serving): it
  rounds x itself as it goes, so no quantization kernel runs first, and sums the e4m3 products on the CUDA cores
  in float32. At one row on an H200, the quantization and `torch._scaled_mm` below took 1.4-1.8x bf16's time on
  three of Llama 3.1 8B's four projections though they read half the bytes (0.87x on the widest, gate_up:
  benchmarks/results/gpu_h200_fp8_gemm.jsonl); this one streams each weight byte once, in one launch. It is not
  yet timed on hardware (scripts/fp8_gemm_timings.py does: `fp8_few_rows`).
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

from ladle_kernels._checks import check_dtype, check_same_device, unit_last_stride
from ladle_kernels._e4m3 import scaled_to_e4m3
from ladle_kernels.reference import FP8_DTYPE, FP8_GPU_BLOCK_COLUMNS, FP8_MAX, FP8_MIN_SCALE

# A row of x up to this long is read in one tile by `_quantize_rows_kernel` (one load per pass, ~32 values a thread).
_QUANT_BLOCK = 16384
_BLOCK_K = 64
FEW_ROWS = 4  # x with at most this many rows takes `_fp8_few_rows_kernel`
_FEW_ROWS_BLOCK_K = 256
_FEW_ROWS_SUMS = 8192  # ROWS * BLOCK_N * BLOCK_K running sums per program: BLOCK_N shrinks as the rows grow
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor cores


@triton.jit
def _store_rows(acc, ws_ptr, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, N, SCALE_COLS: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """The FP8 GEMMs' last step: the float32 sums `acc` `[rows, cols]` times the weight's per-channel scales (with
    SCALE_COLS == 0; per-block scales are in already), plus the bias, rounded once to out's dtype and stored."""
    if SCALE_COLS == 0:
        acc = acc * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    """Program m: scale[m] = max(max_k |x[m, k]| / MAX, MIN_SCALE), q[m, k] = e4m3(clamp(x[m, k] / scale[m],
    ±MAX)), both divisions correctly rounded in float32 (`ladle_kernels.reference.fp8_quantize_per_token`)."""
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
        q = scaled_to_e4m3(x, scale, MAX)
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
    _store_rows(acc, ws_ptr, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, N, SCALE_COLS, HAS_BIAS)


@triton.jit
def _fp8_few_rows_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, ws_row_stride,
    MAX: tl.constexpr, MIN_SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program n writes out[:M, n-block] for all M <= ROWS rows of x at once: each row's scale from its largest
    magnitude (a first pass over x), then per K tile the row rounded to e4m3 as `_quantize_rows_kernel` rounds it,
    times the weight tile's e4m3 values, both widened to float32 (the products exact), summed in float32; then
    xs[m] and the weight's scales as in `_fp8_gemm_kernel`. x is read twice, the weight once.
    A row's arithmetic does not depend on ROWS (BLOCK_K is the weight's alone), nor then on the rows beside it."""
    pid_n = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    x_scale = tl.maximum(tl.math.div_rn(amax, MAX), MIN_SCALE)
    # Each lane keeps its own float32 sums over the K tiles; one reduction across lanes at the end.
    sums = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        xq = scaled_to_e4m3(x, x_scale[:, None], MAX)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        if SCALE_COLS == 0:
            sums += xq[:, None, :] * w[None, :, :]
        else:
            scale = tl.load(ws_ptr + (cols // SCALE_ROWS) * ws_row_stride + k0 // SCALE_COLS, mask=col_ok, other=0.0)
            sums += xq[:, None, :] * (w * scale[:, None])[None, :, :]
    acc = tl.sum(sums, axis=2) * x_scale[:, None]
    _store_rows(acc, ws_ptr, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, N, SCALE_COLS, HAS_BIAS)


def fp8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ladle_kernels.reference.fp8_quantize_per_token` on the GPU: x `[M, K]` (float32, float16 or bfloat16) ->
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
                                       BLOCK=block, num_warps=min(16, max(4, block // 1024)))  # fmt: skip
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
    block: tuple[int, int] | None = None, use_scaled_mm: bool | None = None, few_rows: bool | None = None,
    few_rows_tiles: tuple[int, int, int] | None = None, gemm_tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`ladle_kernels.reference.fp8_linear` on the GPU: x `[M, K]` (float32, float16 or bfloat16) times the e4m3 weight
    `[N, K]` with its float32 `scale` (`[N, 1]`, or per block of `block`: `check_scale`) plus `bias` `[N]` ->
    `[M, N]` in x's dtype. `few_rows` and `use_scaled_mm` (tests, benchmarks) force the GEMM (None:
    `_fp8_few_rows_kernel` for at most `FEW_ROWS` rows, else `torch._scaled_mm` where `scaled_mm_available` and the
    scale is per channel, else `_fp8_gemm_kernel`). `few_rows_tiles` (BLOCK_N, BLOCK_K, num_warps) and
    `gemm_tiles` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) replace the Triton kernels' tiles
    (scripts/fp8_gemm_timings.py sweeps them). Raises ValueError on dtypes, shapes or devices it cannot read."""
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
    weight, scale = weight.contiguous(), scale.contiguous()
    if few_rows if few_rows is not None else rows <= FEW_ROWS:
        return _few_rows(unit_last_stride(x), weight, scale, bias, block, few_rows_tiles)
    xq, x_scale = fp8_quantize_per_token(x)
    if use_scaled_mm is None:
        use_scaled_mm = block is None and x.dtype == torch.bfloat16 and scaled_mm_available(x.device)
    if use_scaled_mm:
        return _scaled_mm(xq, x_scale, weight, scale, bias, x.dtype)
    out = torch.empty(rows, features, dtype=x.dtype, device=x.device)
    block_m, block_n = _blocks(rows)
    block_k = _BLOCK_K if block is None else next(b for b in (64, FP8_GPU_BLOCK_COLUMNS) if block[1] % b == 0)
    launch: dict[str, int] = {}
    if gemm_tiles is not None:
        block_m, block_n, block_k, launch["num_warps"], launch["num_stages"] = gemm_tiles
        _check_tile_depth(block_k, block)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(features, block_n))
    _fp8_gemm_kernel[grid](
        xq, x_scale, weight, scale, bias if bias is not None else scale, out,
        rows, features, depth, scale.stride(0),
        SCALE_ROWS=block[0] if block else 1, SCALE_COLS=block[1] if block else 0, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        WIDEN=isinstance(_fp8_gemm_kernel, InterpretedFunction), **launch,
    )  # fmt: skip
    return out


def _check_tile_depth(block_k: int, block: tuple[int, int] | None) -> None:
    """A K tile of a block-scaled weight must not straddle two blocks: ValueError unless BLOCK_K divides them."""
    if block is not None and block[1] % block_k:
        raise ValueError(f"BLOCK_K {block_k} does not divide the weight's blocks {block}")


def _few_rows(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    block: tuple[int, int] | None, tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`_fp8_few_rows_kernel` over x's rows (at most 16: its tiles hold them all), arguments checked by the caller;
    `tiles` (BLOCK_N, BLOCK_K, num_warps) in place of the default ones."""
    rows, depth = x.shape
    if rows > 16:
        raise ValueError(f"the few-rows kernel takes at most 16 rows of x; got {rows}")
    features = weight.shape[0]
    row_tile = triton.next_power_of_2(rows)
    block_k = min(triton.next_power_of_2(depth), _FEW_ROWS_BLOCK_K)
    if block is not None:  # a K tile never straddles two blocks: a power of two dividing their width
        block_k = min(block_k, block[1] & -block[1])
    block_n = max(_FEW_ROWS_SUMS // (row_tile * block_k), 1)
    num_warps = 4
    if tiles is not None:
        block_n, block_k, num_warps = tiles
        _check_tile_depth(block_k, block)
    out = torch.empty(rows, features, dtype=x.dtype, device=x.device)
    _fp8_few_rows_kernel[(triton.cdiv(features, block_n),)](
        x, weight, scale, bias if bias is not None else scale, out,
        rows, features, depth, x.stride(0), scale.stride(0),
        MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, SCALE_ROWS=block[0] if block else 1, SCALE_COLS=block[1] if block else 0,
        HAS_BIAS=bias is not None, ROWS=row_tile, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
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
    from ladle_kernels.reference import fp8_linear as reference_fp8_linear
    from ladle_kernels.reference import fp8_quantize_per_channel

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
