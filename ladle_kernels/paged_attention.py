"""Causal attention over the paged KV cache for a mixed batch (prefill chunks and decodes) in one Triton kernel.

Each program takes one tile of a sequence's new tokens for one KV head and streams that sequence's keys
through its block table with an online softmax (flash-attention style). The tile's rows are (token, query
head) pairs: the H / Hkv query heads sharing a KV head are stacked as rows, so K/V are read once per group
and a decode row still fills the matrix unit. The launcher needs no host sync: every size it uses is a
shape or a host-side field of `AttentionInputs`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ladle_kernels import reference
from ladle_kernels._checks import check_dtype, check_same_device, unit_last_stride
from ladle_kernels._dot import dot
from ladle_kernels._e4m3 import e4m3_value
from ladle_kernels.reference import FP8_KV_DTYPE, FP8_KV_SCALE_BYTES, is_fp8_kv_cache, kv_cache_head_dim

if TYPE_CHECKING:
    from ladle_kernels.attention_inputs import AttentionInputs

_LOG2E = 1.0 / math.log(2.0)
# Rows per tile: a prefill tile holds many tokens, a decode tile one token's query heads (>= 16 for tl.dot).
_PREFILL_ROWS, _DECODE_ROWS = 64, 16
# Keys per step of the online softmax; float32 tiles are twice the bytes, so they take half as many keys.
_KEYS, _KEYS_FP32 = 64, 32
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# Heads padded to 1,024 dims (DeepSeek's 576-dim latent rows, `engine_server.layers.mla`) take tiles of 16 rows and
# 16 keys, which fit a block's shared memory, and a wide GQA group is split over programs to fit them (H100: 232 KB).
_WIDE_DIMS, _WIDE_ROWS, _WIDE_KEYS = 1024, 16, 16
# and 8 warps (the float32 accumulator over twice the threads: no spills over a bf16 cache) with one stage (no
# prefetched tiles: a float32 model's fit an A100's 164 KB too).
_WIDE_LAUNCH = {"num_warps": 8, "num_stages": 1}
_FP8_SCALE_BYTES = tl.constexpr(FP8_KV_SCALE_BYTES)


@triton.jit
def _find_sequence(query_start_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global tile `tile`: sequence i's tiles are numbered from
    `query_start[i] // BLOCK_Q + i`, an increasing sequence, so binary-search the last start <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    sinks_ptr,
    slopes_ptr,
    qk_scale,
    window,
    softcap,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_bt,
    v_offset,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    SINKS: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """For new token t of sequence i at position p and query head h (KV head `h // (GROUP * HEAD_SPLITS)`; a
    program takes GROUP of its heads, the share `program_id(1)`):

        out[t, h] = sum_j softmax_j(scale * q[t, h] · K[j]) V[j],   j over the sequence's positions <= p

    (and > p - window, when `window` > 0: a sliding window). K[j], V[j] live in slot
    `block_tables[i, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE` of the cache `[2, slots, NUM_KV_HEADS,
    head_dim]`. The softmax runs online over BLOCK_N keys at a time, in base 2 (`qk_scale` = scale * log2(e)),
    with float32 statistics and accumulator. With SOFTCAP, each score s is first capped to
    `softcap * tanh(s / softcap)` (`qk_scale` is then the plain scale: the cap comes before base 2). With SINKS,
    head h's softmax starts from one more logit, `sinks[h]` (float32), as if it were a key whose value is 0: the
    running max starts at it and the running sum at 1 (its weight), so the sink only adds to the denominator. With
    ALIBI, each score gets head h's `slopes[h] * (j - p)` (float32; BLOOM's and MPT's bias), in base 2 too. With FP8,
    the cache is uint8 rows of `head_dim` e4m3 values and their float32 scale (`reference.fp8_kv_rows`), each
    tile decoded as the reference decodes it (`_decode_fp8_rows`) before its dot.
    """
    tile = tl.program_id(0)
    part = tl.program_id(1)  # GROUP query heads of KV head part // HEAD_SPLITS: its (part % HEAD_SPLITS)-th share
    kv_head = part // HEAD_SPLITS
    seq = _find_sequence(query_start_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:  # the grid is an upper bound on the number of tiles
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = local_tile * BLOCK_Q + rows // GROUP  # index among the sequence's new tokens
    head = part * GROUP + rows % GROUP
    # BLOCK_M need not be a multiple of GROUP: the last partial group belongs to the next tile.
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    position = context + token
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q_offsets = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # The tile's last token sees keys up to its own position: later keys are never loaded; with a window, its
    # first token sees none before its own position - window + 1: earlier keys are never loaded either.
    kv_end = context + tl.minimum(q_len, (local_tile + 1) * BLOCK_Q)
    kv_begin = tl.where(window > 0, tl.maximum(context + local_tile * BLOCK_Q - window + 1, 0), 0)
    # A finite floor instead of -inf keeps fully masked (padding) rows free of inf - inf = NaN.
    if SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=-1.0e30).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slopes = tl.load(slopes_ptr + head, mask=row_ok, other=0.0).to(tl.float32) if ALIBI else m_i
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    row_len = head_dim + _FP8_SCALE_BYTES if FP8 else head_dim  # a cached row: an FP8 one ends with its scale
    for start in range(kv_begin, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + keys % BLOCK_SIZE
        row_start = (slot * NUM_KV_HEADS + kv_head) * row_len
        kv_offsets = row_start[:, None] + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        if FP8:
            k = _decode_fp8_rows(cache_ptr + row_start, dims, kv_mask, key_ok, head_dim, q.dtype)
        else:
            k = tl.load(cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = dot(q, tl.trans(k), None, INPUT_PRECISION, UPCAST_DOT) * qk_scale
        if ALIBI:  # in base 2, as the scores are
            distance = (keys[None, :] - position[:, None]).to(tl.float32)
            scores += slopes[:, None] * distance * 1.4426950408889634
        if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1, then to base 2
            scores = (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0) * (softcap * 1.4426950408889634)
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])
        visible = visible & ((window <= 0) | (keys[None, :] > position[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            v = _decode_fp8_rows(cache_ptr + v_offset + row_start, dims, kv_mask, key_ok, head_dim, q.dtype)
        else:
            v = tl.load(cache_ptr + v_offset + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, None, INPUT_PRECISION, UPCAST_DOT)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offsets = (q_start + token).to(tl.int64)[:, None] * (NUM_KV_HEADS * HEAD_SPLITS * GROUP * head_dim)
    out_offsets += head[:, None] * head_dim + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_fp8_rows(rows, dims, mask, row_ok, head_dim, dtype: tl.constexpr):
    """A tile `[BLOCK_N, BLOCK_D]` of FP8 cache rows starting at `rows` (uint8 pointers `[BLOCK_N]`; `head_dim`
    e4m3 bytes, then the float32 scale, 4-byte aligned) as `reference.fp8_kv_values` decodes them: float32(e4m3) *
    scale, rounded once to `dtype`; 0 where masked."""
    values = e4m3_value(tl.load(rows[:, None] + dims[None, :], mask=mask, other=0))
    scales = tl.load((rows + head_dim).to(tl.pointer_type(tl.float32), bitcast=True), mask=row_ok, other=0.0)
    return (values * scales[:, None]).to(dtype)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ladle_kernels.reference.paged_attention` on the GPU: causal attention of q `[T, H, D]` over the paged cache.

    For new token t of sequence i at position p, `out[t, h] = softmax(scale * q[t, h] · K[j]) @ V[j]` over the
    sequence's cached positions j <= p (and > p - window for a sliding `window` > 0), read through its block
    table from KV head `h // (H / Hkv)`, scores soft-capped with `softcap` > 0 (Gemma 2), each head's softmax
    with a sink logit of `sinks` (`[H]` float32, gpt-oss) when given. The
    contiguous cache `[2, num_blocks, block_size, Hkv, D]` must already hold this step's K/V and share q's
    dtype, or be an FP8 cache (`[..., D + 4]` uint8, `reference.fp8_kv_rows`' rows); D is padded to a power of
    two (>= 16) with masks, so any head dim works. Returns a new contiguous
    `[T, H, D]` tensor. q may be strided over tokens and heads.
    """
    return _paged_attention(q, kv_cache, meta, scale, window, softcap, sinks)


def _paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention`, each score plus `alibi_slopes[h] * (j - p)` with `alibi_slopes` (`[H]` float32:
    `reference.alibi_attention`'s BLOOM and MPT bias; not with a cap)."""
    _check_arguments(q, kv_cache, meta)
    if sinks is not None:
        _check_per_head("sinks", sinks, q, "a logit per query head")
    if alibi_slopes is not None:
        _check_per_head("alibi_slopes", alibi_slopes, q, "a slope per query head, and no cap beside them", softcap == 0)
    _, _, block_size, kv_heads, _ = kv_cache.shape
    head_dim = kv_cache_head_dim(kv_cache)
    tokens, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = len(meta.query_lens_cpu)
    if tokens == 0:
        return out
    q = unit_last_stride(q)
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    wide = block_d >= _WIDE_DIMS
    rows = _WIDE_ROWS if wide else _PREFILL_ROWS if meta.max_query_len > 1 else _DECODE_ROWS
    splits = _head_splits(heads // kv_heads, rows) if wide else 1
    group = heads // kv_heads // splits
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = block_m // group
    # Sequence i gets tiles [start_i // block_q + i, start_{i+1} // block_q + i + 1): at least the
    # ceil(query_len / block_q) it needs; the spare ones exit at once.
    grid = (tokens // block_q + num_seqs, kv_heads * splits)
    block_tables = meta.block_tables
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    _paged_attention_kernel[grid](
        q,
        kv_cache,
        out,
        block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        sinks if sinks is not None else q,
        alibi_slopes if alibi_slopes is not None else q,
        scale if softcap > 0 else scale * _LOG2E,
        window,
        float(softcap),
        num_seqs,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=_WIDE_KEYS if wide else _KEYS_FP32 if q.dtype == torch.float32 else _KEYS,
        BLOCK_D=block_d,
        NUM_KV_HEADS=kv_heads,
        HEAD_SPLITS=splits,
        # float32 models get full-precision dots; TF32 would cost ~1e-3 relative error.
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=q.dtype == torch.bfloat16 and isinstance(_paged_attention_kernel, InterpretedFunction),
        SOFTCAP=softcap > 0,
        FP8=is_fp8_kv_cache(kv_cache),
        SINKS=sinks is not None,
        ALIBI=alibi_slopes is not None,
        **_WIDE_LAUNCH if wide else {},
    )
    return out


def alibi_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    slopes: torch.Tensor,
    falcon: bool = False,
) -> torch.Tensor:
    """`reference.alibi_attention` through the kernel: BLOOM's and MPT's bias `slopes[h] * (j - p)` added to each
    scaled score; Falcon-RW's (bfloat16 products, scaled with the scores) through the reference."""
    if falcon:
        return reference.alibi_attention(q, kv_cache, meta, scale, slopes, falcon)
    return _paged_attention(q, kv_cache, meta, scale, alibi_slopes=slopes)


def _check_per_head(name: str, values: torch.Tensor, q: torch.Tensor, what: str, allowed: bool = True) -> None:
    """ValueError unless `values` is a contiguous float32 `[H]` on q's device (one value per query head of q `[T, H,
    D]`, `what` each) and `allowed`."""
    check_dtype(name, values, (torch.float32,))
    check_same_device(q=q, **{name: values})
    if values.shape != (q.shape[1],) or not values.is_contiguous() or not allowed:
        raise ValueError(f"{name} must be a contiguous [{q.shape[1]}] ({what}); got {tuple(values.shape)}")


def _head_splits(group: int, rows: int) -> int:
    """The fewest equal shares of a GQA group of `group` query heads that each fit a tile of `rows` rows."""
    return next(s for s in range(1, group + 1) if group % s == 0 and triton.next_power_of_2(group // s) <= rows)


def _check_arguments(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionInputs) -> None:
    """Raise ValueError unless q, the cache and the metadata fit together as the kernel reads them."""
    check_dtype("q", q)
    check_dtype("kv_cache", kv_cache, (q.dtype, FP8_KV_DTYPE))
    check_same_device(q=q, kv_cache=kv_cache, block_tables=meta.block_tables, seq_lens=meta.seq_lens)
    check_same_device(q=q, query_start_loc=meta.query_start_loc)
    for name, t in (("block_tables", meta.block_tables), ("seq_lens", meta.seq_lens)):
        check_dtype(name, t, (torch.int32,))
    check_dtype("query_start_loc", meta.query_start_loc, (torch.int32,))
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [2, blocks, block_size, Hkv, D]; got {tuple(kv_cache.shape)}")
    _, _, block_size, kv_heads, _ = kv_cache.shape
    head_dim = kv_cache_head_dim(kv_cache)
    if is_fp8_kv_cache(kv_cache) and head_dim % FP8_KV_SCALE_BYTES:
        raise ValueError(f"an FP8 cache needs a head dim that is a multiple of 4 (aligned scales); got {head_dim}")
    if block_size != meta.block_size:
        raise ValueError(f"cache block size {block_size} != metadata block size {meta.block_size}")
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} must be [T, H, {head_dim}] with H a multiple of {kv_heads} KV heads")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens; the metadata {meta.num_tokens}")
