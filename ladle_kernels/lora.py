"""LoRA's shrink and expand products on the GPU for a batch whose rows belong to many adapters (multi-LoRA serving).

`lora_shrink` and `lora_expand` are `ladle_kernels.reference.lora_shrink` / `lora_expand`. The rows are sorted by slot
into runs padded to whole blocks of `_BLOCK_M` rows with `fused_moe.align_pairs` (rows without an adapter, slot -1,
run as an extra slot S whose blocks do nothing), so every block of the sorted list belongs to one slot; one launch
then multiplies each block's rows by its slot's A (shrink) or B (expand), a small GEMM per block that reads the
slot's weight tile once for all its rows. Everything is torch ops of fixed shapes and launches whose grids depend
only on T, S, R, K and N: no host sync, so a CUDA graph can record both, with the slots a device tensor. Slots
outside [-1, S) are not checked (that would sync).

Shrink's K is long and its R short, so a decode batch has few output tiles: its K loop is split over programs
that write float32 partial sums (about `_TARGET_PROGRAMS` programs in all, a number fixed by the shapes), added in
a fixed order afterwards. Expand adds its float32 product to out's rows in place; each (row, column) belongs to
one program, so there are no atomics. Accumulation is float32 (IEEE for float32 inputs). The block sizes are a
first guess, not yet tuned on hardware.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ladle_kernels._checks import check_dtype, check_same_device, check_shape, unit_last_stride
from ladle_kernels._dot import dot
from ladle_kernels.fused_moe import align_pairs

_BLOCK_M = 16
_BLOCK_K = 64
_BLOCK_N = 64
_MAX_BLOCK_R = 64
# About two programs per SM of an H100 / H200 (132 SMs); each split of shrink's K loop keeps this many K blocks.
_TARGET_PROGRAMS = 256
_MIN_K_BLOCKS_PER_SPLIT = 4
SLOT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, partial_ptr, row_ids_ptr, block_slots_ptr,
    T, R, K, num_slots, k_per_split, stride_xm, stride_as, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Program (m, r, s): for block m of the rows sorted by slot, whose slot is `slot` (blocks past the last run
    and those of rows without an adapter do nothing), partial[s, row, r-block] = x[row, K_s] @ a[slot, r-block,
    K_s].T in float32 over split s's K range K_s = [s * k_per_split, (s + 1) * k_per_split)."""
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(block_slots_ptr + pid_m)
    if (slot < 0) | (slot >= num_slots):
        return
    rows = tl.load(row_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < T
    rows = rows.to(tl.int64)
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_base + ranks[None, :] * stride_ar + ks[:, None], mask=k_ok[:, None] & rank_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = dot(x, a, acc, "ieee", UPCAST_DOT)
    out = partial_ptr + split.to(tl.int64) * T * R + rows[:, None] * R + ranks[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, row_ids_ptr, block_slots_ptr,
    T, N, R, num_slots, stride_ym, stride_bs, stride_br, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Program (m, n): for block m of the rows sorted by slot, whose slot is `slot` (as `_shrink_kernel`),
    out[row, n-block] += y[row, :] @ b[slot, :, n-block], the product in float32, the sum rounded to out's
    dtype."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slots_ptr + pid_m)
    if (slot < 0) | (slot >= num_slots):
        return
    rows = tl.load(row_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < T
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        y = tl.load(y_ptr + rows[:, None] * stride_ym + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(b_base + ranks[:, None].to(tl.int64) * stride_br + cols[None, :],
                    mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        acc = dot(y, b, acc, "ieee", UPCAST_DOT)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    mask = row_ok[:, None] & col_ok[None, :]
    total = tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)


def _sorted_blocks(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` over the rows' slots, rows without an adapter as slot `num_slots`: (row ids `[T + (S + 1) *
    (_BLOCK_M - 1)]`, T in padding; each block's slot)."""
    slot_ids = torch.where(slots < 0, num_slots, slots).view(-1, 1)
    return align_pairs(slot_ids, num_slots + 1, _BLOCK_M)


def _block_r(rank: int) -> int:
    """A power of two >= 16 (`tl.dot`'s least) covering `rank`, at most `_MAX_BLOCK_R`."""
    return min(_MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))


def _upcast(kernel: object, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction)


def _check_slots(slots: torch.Tensor, tokens: int) -> None:
    check_dtype("slots", slots, SLOT_DTYPES)
    check_shape("slots", slots, (tokens,))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`ladle_kernels.reference.lora_shrink` on the GPU (module doc): x `[T, K]`, a `[S, R, K]` in x's dtype, slots
    `[T]` int32 or int64 (-1: no adapter) -> `[T, R]` in x's dtype. Raises ValueError on dtypes, shapes or devices the
    kernel cannot read."""
    check_dtype("x", x)
    check_dtype("a", a, (x.dtype,))
    check_same_device(x=x, a=a, slots=slots)
    if x.dim() != 2 or a.dim() != 3:
        raise ValueError(f"x must be 2-d and a 3-d; got {tuple(x.shape)} and {tuple(a.shape)}")
    tokens, depth = x.shape
    num_slots, rank, _ = a.shape
    check_shape("a", a, (num_slots, rank, depth))
    _check_slots(slots, tokens)
    if tokens == 0 or rank == 0 or num_slots == 0 or depth == 0:
        return x.new_zeros(tokens, rank)
    x, a = unit_last_stride(x), unit_last_stride(a)
    row_ids, block_slots = _sorted_blocks(slots, num_slots)
    block_r = _block_r(rank)
    tiles = block_slots.numel() * triton.cdiv(rank, block_r)
    k_blocks = triton.cdiv(depth, _BLOCK_K)
    splits = max(1, min(_TARGET_PROGRAMS // tiles, k_blocks // _MIN_K_BLOCKS_PER_SPLIT))
    k_per_split = triton.cdiv(k_blocks, splits) * _BLOCK_K
    splits = triton.cdiv(depth, k_per_split)
    # Zeros: rows without an adapter are never written.
    partial = torch.zeros(splits, tokens, rank, dtype=torch.float32, device=x.device)
    grid = (block_slots.numel(), triton.cdiv(rank, block_r), splits)
    _shrink_kernel[grid](
        x, a, partial, row_ids, block_slots,
        tokens, rank, depth, num_slots, k_per_split, x.stride(0), a.stride(0), a.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, UPCAST_DOT=_upcast(_shrink_kernel, x.dtype),
    )  # fmt: skip
    summed = partial[0] if partial.shape[0] == 1 else partial.sum(0)
    return summed.to(x.dtype)


def lora_expand(out: torch.Tensor, y: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """`ladle_kernels.reference.lora_expand` on the GPU (module doc): out `[T, N]` (any float dtype, any strides: a
    column slice of a wider tensor too) += y[t] @ b[slots[t]] for y `[T, R]` and b `[S, R, N]` in y's dtype, slots
    as `lora_shrink`'s; rows without an adapter are left untouched. Raises ValueError on dtypes, shapes or devices
    the kernel cannot read."""
    check_dtype("out", out)
    check_dtype("y", y)
    check_dtype("b", b, (y.dtype,))
    check_same_device(out=out, y=y, b=b, slots=slots)
    if out.dim() != 2 or y.dim() != 2 or b.dim() != 3:
        raise ValueError(f"out and y must be 2-d and b 3-d; got {out.dim()}, {y.dim()}, {b.dim()}")
    tokens, features = out.shape
    num_slots, rank, _ = b.shape
    check_shape("y", y, (tokens, rank))
    check_shape("b", b, (num_slots, rank, features))
    _check_slots(slots, tokens)
    if tokens == 0 or features == 0 or rank == 0 or num_slots == 0:
        return
    y, b = unit_last_stride(y), unit_last_stride(b)
    row_ids, block_slots = _sorted_blocks(slots, num_slots)
    grid = (block_slots.numel(), triton.cdiv(features, _BLOCK_N))
    _expand_kernel[grid](
        y, b, out, row_ids, block_slots,
        tokens, features, rank, num_slots, y.stride(0), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=_block_r(rank), UPCAST_DOT=_upcast(_expand_kernel, y.dtype),
    )  # fmt: skip
