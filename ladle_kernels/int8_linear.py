"""Weight-only 8-bit linear layers on the GPU: `x @ W.T` with W kept as int8 groups of 32 and float16 scales.

The weight is `--quantization int8`'s `Q8Weight` (GGUF Q8_0's scheme, the same form the CPU kernels read):
`qs` `[N, K]` int8 and `scales` `[N, K/32]` float16, element = scale * q. Each program dequantizes a
`[BLOCK_K, BLOCK_N]` tile of W into x's dtype in registers and feeds it to `tl.dot` with a float32
accumulator, so a step streams one byte per weight (plus 1/16 of a byte of scale) instead of bf16's two.

Decode steps have few rows, so an `[M, N]` grid alone can leave most SMs idle; the K loop is then split
over `split_k` programs that write float32 partial sums, added in a fixed order afterwards (deterministic, no
atomics). The block sizes are a first guess, not yet tuned on hardware.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ladle_kernels._checks import check_dtype, check_same_device, check_shape, unit_last_stride
from ladle_kernels._dot import dot
from ladle_kernels.reference import QUANT_GROUP

_BLOCK_K = 64
# Enough programs per SM that a split-K launch fills the GPU; each split keeps at least this many K blocks.
_PROGRAMS_PER_SM = 2
_MIN_K_BLOCKS_PER_SPLIT = 4


@triton.jit
def _int8_linear_kernel(
    x_ptr, qs_ptr, scales_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Program (m, n, s) writes out[s, m-block, n-block] = x[m-block, K_s] @ W[n-block, K_s].T over its split's
    K range K_s = [s * k_per_split, (s + 1) * k_per_split) in float32, W[n, k] = float(qs[n, k]) *
    float(scales[n, k // GROUP]) rounded to x's dtype (products summed in float32, IEEE for float32 x)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    groups = K // GROUP
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        q = tl.load(qs_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=w_mask, other=0)
        scale = tl.load(scales_ptr + cols[None, :].to(tl.int64) * groups + (ks // GROUP)[:, None], mask=w_mask,
                        other=0.0)  # fmt: skip
        w = (q.to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        acc = dot(x, w, acc, "ieee", UPCAST_DOT)  # float32 x: no TF32 (16-bit x: the same either way)
    out = out_ptr + split.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def _blocks(rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for `rows` rows of x: decode-sized batches get narrow tiles and more programs."""
    if rows <= 16:
        return 16, 32
    if rows <= 32:
        return 32, 64
    return 64, 64


@functools.cache
def _split_k(tiles: int, k_blocks: int, device: torch.device) -> int:
    """How many programs share each tile's K loop so that about `_PROGRAMS_PER_SM` land on every SM."""
    if device.type != "cuda":
        return 1
    wanted = _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(wanted // tiles, k_blocks // _MIN_K_BLOCKS_PER_SPLIT))


def int8_linear(
    x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, split_k: int | None = None
) -> torch.Tensor:
    """`ladle_kernels.reference.int8_linear` on the GPU: x `[M, K]` (float32, float16 or bfloat16) times the 8-bit
    weight (`qs` `[N, K]` int8, `scales` `[N, K/32]` float16) -> `[M, N]` in x's dtype.

    `split_k` (tests) fixes how many programs share each output tile's K loop; None picks it from the GPU's SM
    count. Raises ValueError on dtypes, shapes or devices the kernel cannot read.
    """
    check_dtype("x", x)
    check_dtype("qs", qs, (torch.int8,))
    check_dtype("scales", scales, (torch.float16,))
    check_same_device(x=x, qs=qs, scales=scales)
    if x.dim() != 2 or qs.dim() != 2:
        raise ValueError(f"x and qs must be 2-d; got {tuple(x.shape)} and {tuple(qs.shape)}")
    rows, depth = x.shape
    features = qs.shape[0]
    if depth % QUANT_GROUP or qs.shape[1] != depth:
        raise ValueError(f"qs {tuple(qs.shape)} does not match x {tuple(x.shape)} (K a multiple of {QUANT_GROUP})")
    check_shape("scales", scales, (features, depth // QUANT_GROUP))
    if rows == 0 or features == 0:
        return x.new_zeros(rows, features)
    x = unit_last_stride(x)
    qs, scales = qs.contiguous(), scales.contiguous()
    block_m, block_n = _blocks(rows)
    k_blocks = triton.cdiv(depth, _BLOCK_K)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(features, block_n)
    splits = max(1, min(split_k if split_k is not None else _split_k(tiles, k_blocks, x.device), k_blocks))
    k_per_split = triton.cdiv(k_blocks, splits) * _BLOCK_K
    splits = triton.cdiv(depth, k_per_split)
    partial = torch.empty(splits, rows, features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(features, block_n), splits)
    _int8_linear_kernel[grid](
        x, qs, scales, partial, rows, features, depth, k_per_split, x.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, GROUP=QUANT_GROUP,
        UPCAST_DOT=x.dtype == torch.bfloat16 and isinstance(_int8_linear_kernel, InterpretedFunction),
    )  # fmt: skip
    summed = partial[0] if splits == 1 else partial.sum(0)
    return summed.to(x.dtype)
