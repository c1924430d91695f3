"""A mixture of experts' SwiGLU experts on the GPU: token-expert pairs sorted by expert, two grouped GEMMs.

`fused_moe` is `ladle_kernels.reference.fused_moe`. Each token's k choices are k (token, expert) pairs; the pairs are
sorted by expert and each expert's run padded to a whole number of BLOCK_M rows (`align_pairs`, torch ops of
fixed shapes: no host sync, so a CUDA graph can record it), so every M-block of the sorted list belongs to one
expert. One launch of `_grouped_gemm_kernel` then multiplies each block's rows of x by its expert's `w13` (gate
and up together, `[P, 2I]`), SiLU-and-mul follows, and a second launch multiplies by the expert's `w2` and scales
each pair by its routing weight (`[P, H]`); the k pairs of a token are summed last. Padding rows of a block are
masked; blocks past the last expert's run do nothing. Accumulation is float32 (IEEE for float32 inputs), so the
result matches the reference to float rounding; the pairs of a token are summed in choice order, not expert
order as the CPU path sums them.

`fp8_fused_moe` runs the same two launches on FP8 experts (`--quantization fp8`; contract
`ladle_kernels.reference.fp8_fused_moe`): the weights e4m3 with float32 scales per channel or per block (`fp8_linear`'s
layouts, one per expert), x rounded to e4m3 per token and the SiLU-and-mul rows per pair
(`ladle_kernels.fp8_linear.fp8_quantize_per_token`), e4m3 times e4m3 on the tensor cores with float32 sums, both
scales applied to the sums (a block's to each K tile's partial product) as `ladle_kernels.fp8_linear`'s GEMM does. It
needs compute capability 8.9 or newer, as that GEMM does.

The block sizes are a first guess, not yet tuned on hardware.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ladle_kernels._checks import check_dtype, check_same_device, check_shape, unit_last_stride
from ladle_kernels._dot import dot
from ladle_kernels.fp8_linear import check_scale, fp8_quantize_per_token
from ladle_kernels.reference import FP8_DTYPE, silu_and_mul

_BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-expert pairs (`experts` `[T, k]`, pair `p = t * k + j`) sorted by expert into runs padded to
    multiples of `block_m`: (pair ids `[T*k + E*(block_m - 1)]`, `T*k` in padding and unused rows; the expert of
    each block of `block_m` rows `[len / block_m]`, -1 for blocks past the last run). Shapes depend only on T, k,
    E and `block_m`; pairs of one expert keep their order."""
    flat = experts.flatten().long()
    pairs = flat.numel()
    capacity = pairs + num_experts * (block_m - 1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    destination = (padded_ends - padded)[sorted_experts] + rank
    pair_ids = torch.full((capacity,), pairs, dtype=torch.long, device=flat.device)
    pair_ids.scatter_(0, destination, order)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    return pair_ids, torch.where(block_experts < num_experts, block_experts, -1)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, pair_ids_ptr, block_experts_ptr, pair_weights_ptr,
    num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_be,
    A_ROWS_PER_PAIR_DIV: tl.constexpr, SCALE: tl.constexpr, W_SCALES: tl.constexpr, BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WIDEN: tl.constexpr,
):  # fmt: skip
    """Program (m, n): for block m of the sorted pairs, whose expert is e, out[pair, n-block] =
    a[pair // A_ROWS_PER_PAIR_DIV, :] @ w[e, n-block, :].T (plus `bias[e, n-block]` with BIAS, then times the
    pair's weight with SCALE), in float32.

    W_SCALES 0: a and w are floats. Otherwise both are e4m3, a's row r multiplied by a_scale[r] and w[e] by its
    scales after the sums: W_SCALES 1, one per output channel (`w_scale[e, n]`); 2, one per block of SCALE_ROWS x
    SCALE_COLS (`w_scale[e, n // SCALE_ROWS, k // SCALE_COLS]`, applied to each K tile's partial product: BLOCK_K,
    32, divides SCALE_COLS: `check_scale`). WIDEN (the interpreter) multiplies e4m3 tiles widened to float32: the
    same products."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + slots)
    pair_ok = pairs < num_pairs
    a_rows = (pairs // A_ROWS_PER_PAIR_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    scale_base = w_scale_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # fmt: skip
        if W_SCALES == 0:
            acc = dot(a, w, acc, "ieee", UPCAST_DOT)
        else:
            if WIDEN:  # the interpreter multiplies e4m3 bytes as integers: widen them first (exact)
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            partial = tl.dot(a, w, input_precision="ieee")  # added here in float32: see ladle_kernels.fp8_linear
            if W_SCALES == 1:
                acc += partial
            else:
                block_scale = tl.load(scale_base + (cols // SCALE_ROWS) * stride_sn + k0 // SCALE_COLS, mask=col_ok,
                                      other=0.0)  # fmt: skip
                acc += partial * block_scale[None, :]
    if W_SCALES != 0:
        acc = acc * tl.load(a_scale_ptr + a_rows, mask=pair_ok, other=0.0)[:, None]
    if W_SCALES == 1:
        acc = acc * tl.load(scale_base + cols * stride_sn, mask=col_ok, other=0.0)[None, :]
    if BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if SCALE:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    pair_ids: torch.Tensor,
    block_experts: torch.Tensor,
    num_pairs: int,
    a_rows_per_pair: int,
    pair_weights: torch.Tensor | None,
    out_dtype: torch.dtype,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[num_pairs, N]` in `out_dtype`: each pair's row of `a` (row `pair // a_rows_per_pair`) times its expert's
    `w[e].T`, plus `bias[e]` (`[E, N]`) when given. With `scales` (a's `[rows, 1]`, w's `[E, N, 1]` or per block
    of `block` `[E, nb, kb]`), a and w are e4m3 (kernel doc)."""
    out = torch.empty(num_pairs, w.shape[1], dtype=out_dtype, device=a.device)
    a_scale, w_scale = scales if scales is not None else (a, a)
    w_scales = 0 if scales is None else 1 if block is None else 2
    bias = bias.contiguous() if bias is not None else None
    grid = (block_experts.numel(), triton.cdiv(w.shape[1], _BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, a_scale, w, w_scale, bias if bias is not None else a, out, pair_ids, block_experts,
        pair_weights if pair_weights is not None else a,
        num_pairs, w.shape[1], w.shape[2], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        w_scale.stride(0) if scales is not None else 0, w_scale.stride(1) if scales is not None else 0,
        bias.stride(0) if bias is not None else 0,
        A_ROWS_PER_PAIR_DIV=a_rows_per_pair, SCALE=pair_weights is not None, W_SCALES=w_scales, BIAS=bias is not None,
        SCALE_ROWS=block[0] if block else 1, SCALE_COLS=block[1] if block else 0,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        UPCAST_DOT=a.dtype == torch.bfloat16 and isinstance(_grouped_gemm_kernel, InterpretedFunction),
        WIDEN=isinstance(_grouped_gemm_kernel, InterpretedFunction),
    )  # fmt: skip
    return out


def _check_bank(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
    weight_dtype: torch.dtype, **others: torch.Tensor,
) -> None:  # fmt: skip
    """The launchers' common checks: x `[T, H]` in a float dtype, w13 `[E, 2I, H]` and w2 `[E, H, I]` of
    `weight_dtype`, `weights` shaped as `experts` `[T, k]`, all of them and `others` on one device. Raises
    ValueError otherwise."""
    check_dtype("x", x)
    check_dtype("w13", w13, (weight_dtype,))
    check_dtype("w2", w2, (weight_dtype,))
    check_same_device(x=x, w13=w13, w2=w2, weights=weights, experts=experts, **others)
    if x.dim() != 2 or w13.dim() != 3 or experts.dim() != 2:
        raise ValueError(f"x must be 2-d, w13 3-d, experts 2-d; got {x.dim()}, {w13.dim()}, {experts.dim()}")
    hidden = x.shape[1]
    num_experts, double_inter, _ = w13.shape
    check_shape("w13", w13, (num_experts, double_inter, hidden))
    check_shape("w2", w2, (num_experts, hidden, double_inter // 2))
    check_shape("weights", weights, tuple(experts.shape))


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """`ladle_kernels.reference.fused_moe` on the GPU (module doc): x `[T, H]`, w13 `[E, 2I, H]`, w2 `[E, H, I]`,
    routing `weights` and `experts` `[T, k]` -> `[T, H]` in x's dtype; biases `b13` `[E, 2I]` and `b2` `[E, H]`
    added in the GEMMs' epilogues when given, `activation` (SiLU-and-mul, or gpt-oss's clamped SwiGLU) between
    them. Raises ValueError on dtypes, shapes or devices the kernels cannot read."""
    _check_bank(x, w13, w2, weights, experts, x.dtype)
    _check_biases(w13, w2, b13, b2)
    (tokens, hidden), num_experts, top_k = x.shape, w13.shape[0], experts.shape[1]
    if tokens == 0:
        return x.new_zeros(0, hidden)
    x = unit_last_stride(x)
    w13, w2 = w13.contiguous(), w2.contiguous()
    pair_ids, block_experts = align_pairs(experts, num_experts, _BLOCK_M)
    num_pairs = tokens * top_k
    gate_up = _grouped_gemm(x, w13, pair_ids, block_experts, num_pairs, top_k, None, x.dtype, bias=b13)
    down = _grouped_gemm(
        activation(gate_up),
        w2,
        pair_ids,
        block_experts,
        num_pairs,
        1,
        weights.reshape(-1).float().contiguous(),
        x.dtype,
        bias=b2,
    )
    return down.view(tokens, top_k, hidden).sum(dim=1)


def _check_biases(w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None) -> None:
    """Biases come both or neither, `b13` `[E, 2I]` and `b2` `[E, H]` on the weights' device; ValueError otherwise."""
    if (b13 is None) != (b2 is None):
        raise ValueError("the experts' biases come both (b13 and b2) or neither")
    if b13 is not None and b2 is not None:
        check_same_device(w13=w13, b13=b13, b2=b2)
        check_shape("b13", b13, tuple(w13.shape[:2]))
        check_shape("b2", b2, tuple(w2.shape[:2]))


def fp8_fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    weights: torch.Tensor, experts: torch.Tensor, block: tuple[int, int] | None = None,
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:  # fmt: skip
    """`ladle_kernels.reference.fp8_fused_moe` on the GPU (module doc): x `[T, H]` (float32, float16 or bfloat16), w13
    `[E, 2I, H]` and w2 `[E, H, I]` e4m3 with float32 scales `[E, 2I, 1]` / `[E, H, 1]` (per channel) or per block
    of `block` (`[E, ceil(2I/bn), ceil(H/bk)]` / `[E, ceil(H/bn), ceil(I/bk)]`), routing `weights` and `experts`
    `[T, k]` -> `[T, H]` in x's dtype (gate/up and down in float32, a token's pairs summed in float32); biases
    `b13`, `b2` and `activation` as `fused_moe` takes them. Raises ValueError on dtypes, shapes or devices the
    kernels cannot read."""
    _check_bank(x, w13, w2, weights, experts, FP8_DTYPE, w13_scale=w13_scale, w2_scale=w2_scale)
    _check_biases(w13, w2, b13, b2)
    (tokens, hidden), num_experts, top_k = x.shape, w13.shape[0], experts.shape[1]
    for name, scale, weight in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
        if scale.dim() != 3 or scale.shape[0] != num_experts:
            raise ValueError(f"{name} has shape {tuple(scale.shape)}; expected one scale tensor per expert")
        check_scale(scale[0], weight.shape[1], weight.shape[2], block)
    if tokens == 0:
        return x.new_zeros(0, hidden)
    w13, w2 = w13.contiguous(), w2.contiguous()
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    pair_ids, block_experts = align_pairs(experts, num_experts, _BLOCK_M)
    num_pairs = tokens * top_k
    xq, x_scale = fp8_quantize_per_token(x)
    gate_up = _grouped_gemm(
        xq, w13, pair_ids, block_experts, num_pairs, top_k, None, torch.float32, (x_scale, w13_scale), block, b13
    )
    hidden_q, hidden_scale = fp8_quantize_per_token(activation(gate_up))
    down = _grouped_gemm(
        hidden_q, w2, pair_ids, block_experts, num_pairs, 1, weights.reshape(-1).float().contiguous(), torch.float32,
        (hidden_scale, w2_scale), block, b2,
    )  # fmt: skip
    return down.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
