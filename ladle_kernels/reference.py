"""Plain-torch reference ops: what the CPU path runs and what every Triton kernel is tested against.

Shapes: T tokens in the flattened batch, H query heads, Hkv KV heads, D head dim. The KV cache layout and the
metadata contract are described in `engine_server.attention_metadata`. `apply_token_bitmask_` (the grammar mask) and
`seeded_log_uniforms` (the noise of seeded rows) are the sampler's; the other ops are the layers'
(`ladle_kernels.kernel_set.KernelOps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar, overload

import numpy as np
import torch
import torch.nn.functional as F

from ladle_kernels.causal_conv import biased_convolution
from ladle_kernels.causal_conv import (
    short_convolution as short_convolution,  # the kernel sets' op of LFM2's convolution
)
from ladle_kernels.gated_delta import gated_delta_net as gated_delta_net  # the kernel sets' op of Gated DeltaNet
from ladle_kernels.mamba1 import mamba1_scan as mamba1_scan
from ladle_kernels.mamba2 import mamba2_mixer as mamba2_mixer  # the kernel sets' op of Mamba-2

if TYPE_CHECKING:
    from ladle_kernels.attention_inputs import AttentionInputs, RopeScalingParams, YarnParams


def mamba1_conv(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """The kernel sets' op of Mamba-1's convolution (beside `mamba1_scan`): `causal_conv.biased_convolution`."""
    return biased_convolution(x, conv_weight, conv_bias, states, slots, query_lens, fresh)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(gate)` (Qwen3-Next's and Qwen3.5's attention output gate), in x's dtype."""
    return x * torch.sigmoid(gate)


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: `weight * (x / sqrt(mean(x²) + eps))`, the statistic in float32.

    With `residual`, first `x = x + residual` (in x's dtype) and return `(rms_norm(x), x)`: the new residual
    stream comes back alongside the normalised value, like vLLM's fused add-norm.
    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return out if residual is None else (out, x)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScalingParams | None = None) -> torch.Tensor:
    """Inverse frequencies `theta ** (-2i / D)` for i < D/2, float32, with Llama-3 scaling when given.

    Llama 3: wavelengths `2π / f` longer than `orig_ctx / low_freq_factor` are divided by `factor`, shorter
    than `orig_ctx / high_freq_factor` kept, and those in between interpolated with
    `s = (orig_ctx / wavelen - low) / (high - low)`: `f' = (1 - s) * f / factor + s * f`.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    orig = scaling.original_max_position_embeddings
    low_wavelen = orig / scaling.low_freq_factor
    high_wavelen = orig / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def build_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: RopeScalingParams | None = None,
    dtype: torch.dtype = torch.float32,
    linear_factor: float = 1.0,
    rotated_angles: int | None = None,
) -> torch.Tensor:
    """`[max_positions, D]`: row p is `cat(cos(p * f), sin(p * f))` over the D/2 inverse frequencies f (divided by
    `linear_factor`: linear rope scaling, as transformers' "linear" rope type divides them). With `rotated_angles`
    (Gemma 4's "proportional" rope) only the first that many frequencies are kept, the others 0 (cos 1, sin 0: those
    dims pass unturned).

    Angles are computed in float32 (as Hugging Face does) and the result is cast to `dtype`.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    if rotated_angles is not None:
        inv_freq = torch.cat((inv_freq[:rotated_angles], torch.zeros(head_dim // 2 - rotated_angles)))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def yarn_inv_freq(rotary_dim: int, theta: float, yarn: YarnParams) -> torch.Tensor:
    """YaRN's inverse frequencies (float32, in transformers' order of operations): with `f` the plain ones, dim i
    gets `f / factor * r_i + f * (1 - r_i)`, `r_i` a ramp from 0 to 1 between the dims where `beta_fast` and `beta_slow`
    rotations fit in the original context (`d(b) = D * ln(orig / (2π b)) / (2 ln theta)`, clamped to [0, D-1],
    rounded outwards when `truncate`)."""

    def correction_dim(rotations: float) -> float:
        orig = yarn.original_max_position_embeddings
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    extrapolated = 1 - ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return 1.0 / (yarn.factor * powers) * (1 - extrapolated) + 1.0 / powers * extrapolated


def build_yarn_cos_sin_cache(
    rotary_dim: int, max_positions: int, theta: float, yarn: YarnParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """YaRN: `build_cos_sin_cache`'s rows over `yarn_inv_freq`, times `attention_factor`."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), yarn_inv_freq(rotary_dim, theta, yarn))
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * yarn.attention_factor).to(dtype)


def build_longrope_cos_sin_cache(
    rotary_dim: int,
    max_positions: int,
    theta: float,
    short_factor: tuple[float, ...],
    long_factor: tuple[float, ...],
    attention_factor: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """LongRoPE (Phi-3): `[2 * max_positions, D]`, the short factors' rows then the long factors' (a token that
    takes the long ones reads row `max_positions + p`). Each is `build_cos_sin_cache`'s row with the inverse
    frequencies divided by the factors, times `attention_factor`, as transformers computes them in float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    positions = torch.arange(max_positions, dtype=torch.float32)
    halves = []
    for factors in (short_factor, long_factor):
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
        freqs = torch.outer(positions, inv_freq)
        halves.append(torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1))
    return torch.cat(halves).to(dtype)


RopeRowsT = TypeVar("RopeRowsT", np.ndarray, torch.Tensor)


def unpermute_rope_rows(weight: RopeRowsT, n_head: int, rotary_dim: int | None = None) -> RopeRowsT:
    """A q/k projection's rows (weight or bias, numpy or torch) with each head's rope pairs moved from interleaved
    (x[2i], x[2i+1]) to halves (x[i], x[i + half]), the pairs `rotary_embedding` turns: the view (n_head, half, 2)
    read as (n_head, 2, half). Interleaved are llama.cpp's `llama` files (its converter permutes HF's halves that
    way; Qwen's, on its neox rope, are not permuted), Llama 4's and GLM-4's own checkpoints (`models.llama4`,
    `models.glm4`) and so the q/k updates of LoRA adapters trained on them (`lora.peft_format`). `rotary_dim`: only
    each head's first that many rows turn (GLM-4's half), and only they move; the rest stay where they are."""
    head_dim = weight.shape[0] // n_head
    if rotary_dim is None or rotary_dim == head_dim:
        half = head_dim // 2
        return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    within = np.arange(head_dim)
    within[:rotary_dim] = np.arange(rotary_dim).reshape(rotary_dim // 2, 2).T.reshape(-1)
    order = (np.arange(n_head)[:, None] * head_dim + within).reshape(-1)
    return weight[order if isinstance(weight, np.ndarray) else torch.from_numpy(order)]


def swapped_rope_halves(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """A q/k projection's rows (weight, bias or a LoRA update's B) with each head's two halves swapped. NanoChat turns
    each pair (x[i], x[i + half]) by minus its angle (its `rotate_half` is `(x2, -x1)`); the same pair swapped, as
    (x[i + half], x[i]), turned by plus its angle is that result swapped. The same order on q and k leaves each
    score unchanged, so `rotary_embedding` serves it on these rows."""
    head_dim = weight.shape[0] // n_head
    return weight.reshape(n_head, 2, head_dim // 2, *weight.shape[1:]).flip(1).reshape(weight.shape)


def grouped_qkv_rows(weight: torch.Tensor, n_head: int, n_kv_head: int | None = None) -> torch.Tensor:
    """Fused q/k/v rows grouped by KV head (weight, bias or a LoRA update's B): each of the `n_kv_head` groups its
    `n_head / n_kv_head` queries, then its key, then its value (Falcon's `query_key_value`; GPT-NeoX's, one query a
    group: each head's query, key and value in turn), as `cat(q, k, v)`. `models.gpt_neox` loads its checkpoints'
    so, `lora.peft_format` an adapter's update of them."""
    kv = n_kv_head or n_head
    queries = n_head // kv
    groups = weight.reshape(kv, queries + 2, -1, *weight.shape[1:])
    parts = (groups[:, :queries], groups[:, queries], groups[:, queries + 1])
    return torch.cat([part.reshape(-1, *weight.shape[1:]) for part in parts])


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, H, D]` and k `[T, Hkv, D]` by their token's position (NeoX / Hugging Face half split).

    With `x = cat(x1, x2)` and `(cos, sin) = cos_sin_cache[positions]` split in halves:
    `out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`. Returns new tensors; inputs are not modified.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).to(q.dtype).unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float, up_offset: float = 1.0) -> torch.Tensor:
    """gpt-oss's experts' activation of x `[..., 2d]` (gate, then up): the gate clamped to at most `limit`, the up
    to [-limit, limit], then `gate * sigmoid(alpha * gate) * (up + up_offset)` (transformers' `GptOssExperts`, offset
    1; HY-V4's experts: alpha 1 and offset 0, a plain SwiGLU clamped)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + up_offset)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` for x `[..., 2d]` (the fused gate/up projection of a SwiGLU MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(x[..., :d]) * x[..., d:]` for x `[..., 2d]` (GeGLU with GELU's tanh approximation: Gemma's
    `gelu_pytorch_tanh`)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v `[T, Hkv, D]` in place: `kv_cache[0|1].flat_slots[slot_mapping[t]] = k|v[t]`, as `fp8_kv_rows`
    packs them in an FP8 cache (uint8, `[..., D + 4]`), else cast to the cache's dtype.

    The cache `[2, num_blocks, block_size, Hkv, D (+ 4)]` must be contiguous (as `allocate_kv_cache` makes it).
    """
    _, num_blocks, block_size, heads, row = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, row)
    store = fp8_kv_rows if is_fp8_kv_cache(kv_cache) else (lambda x: x.to(kv_cache.dtype))
    flat[0].index_copy_(0, slot_mapping, store(k))
    flat[1].index_copy_(0, slot_mapping, store(v))


def is_fp8_kv_cache(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` is an FP8 cache: uint8 rows of `fp8_kv_rows`' layout (`--kv-cache-dtype fp8`)."""
    return kv_cache.dtype == FP8_KV_DTYPE


def kv_cache_head_dim(kv_cache: torch.Tensor) -> int:
    """The head dim D of a cache `[2, blocks, block_size, Hkv, row]`: its rows' length, less an FP8 row's scale."""
    return int(kv_cache.shape[-1]) - (FP8_KV_SCALE_BYTES if is_fp8_kv_cache(kv_cache) else 0)


def _read_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`cache[block_ids]` (one half of a KV cache, `[blocks, block_size, Hkv, row]`) as `dtype`, FP8 rows decoded
    (`fp8_kv_values`): `[len(block_ids), block_size, Hkv, D]`."""
    blocks = cache.index_select(0, block_ids)
    return fp8_kv_values(blocks, dtype) if cache.dtype == FP8_KV_DTYPE else blocks


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q `[T, H, D]` over the paged cache; returns `[T, H, D]`.

    For new token t of sequence i at position p: `out[t, h] = softmax(scale * q[t, h] · K[j]) @ V[j]` over the
    sequence's cached positions j <= p, with K/V read through its block table from KV head `h // (H / Hkv)`
    (grouped-query attention); with a sliding `window` > 0, over p - window < j <= p only (transformers'
    sliding-window mask); with `softcap` > 0, each score s is capped to `softcap * tanh(s / softcap)` before the
    softmax (Gemma 2's attention-logit soft-capping); with `sinks` (`[H]` float32, gpt-oss's attention sinks), head
    h's softmax has one more logit, `sinks[h]`, whose weight is dropped: each output is the plain one times
    `Z / (Z + exp(sinks[h]))`, Z the sum of the exponentiated scores. The cache must already hold this step's K/V
    (see `write_kv_cache`).

    Decode rows (one new token) are computed together: one gather of their blocks and one batched attention,
    with the H / Hkv query heads of each KV head stacked as rows so K/V are never repeated. Rows with several
    new tokens (prefill chunks, possibly after cached context) run one SDPA each.
    """
    _, _, block_size, kv_heads, _ = kv_cache.shape
    dim = kv_cache_head_dim(kv_cache)
    if block_size != meta.block_size:
        raise ValueError(f"cache block size {block_size} != metadata block size {meta.block_size}")
    heads = q.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    plan = meta.reference_plan
    k_cache, v_cache = kv_cache[0], kv_cache[1]

    rows = plan.decode_token_index.numel()
    if rows:
        span = plan.decode_blocks * block_size
        # index_select on whole blocks copies contiguous runs; it is ~2x faster than advanced indexing on CPU.
        keys = _read_blocks(k_cache, plan.decode_block_ids, q.dtype).view(rows, span, kv_heads, dim).transpose(1, 2)
        values = _read_blocks(v_cache, plan.decode_block_ids, q.dtype).view(rows, span, kv_heads, dim).transpose(1, 2)
        queries = q if plan.all_decode else q.index_select(0, plan.decode_token_index)
        mask = plan.decode_mask
        if 0 < window < span:  # positions at or before seq_len - 1 - window are outside the window too
            before = plan.decode_seq_lens.to(torch.int64).unsqueeze(1) - window
            outside = torch.arange(span, device=q.device).unsqueeze(0) < before
            mask = mask.masked_fill(outside.view(rows, 1, 1, span), float("-inf"))
        decode_sinks = None if sinks is None else sinks.view(kv_heads, group, 1)
        decoded = _attend(
            queries.reshape(rows, kv_heads, group, dim), keys, values, mask.to(q.dtype), scale, softcap,
            sinks=decode_sinks,
        ).reshape(rows, heads, dim)
        if plan.all_decode:  # the common pure-decode step: no scatter back
            return decoded
        out.index_copy_(0, plan.decode_token_index, decoded)

    attend_prefills(q, kv_cache, meta, scale, out, window, softcap, sinks)
    return out


def attend_prefills(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """The rows of `paged_attention` with several new tokens (prefill chunks): one causal SDPA each (over the
    sliding `window`, when > 0; scores soft-capped with `softcap` > 0; `sinks` as `paged_attention` says), written
    into `out` `[T, H, D]` at their tokens' places. Decode rows of `out` are left as they are."""
    _, _, _, kv_heads, _ = kv_cache.shape
    dim = kv_cache_head_dim(kv_cache)
    group = q.shape[1] // kv_heads
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    mask: torch.Tensor | None
    for p in meta.reference_plan.prefills:
        ids = meta.block_tables[p.seq_index, : p.num_blocks].to(torch.int64)
        keys = _read_blocks(k_cache, ids, q.dtype).view(-1, kv_heads, dim)[: p.seq_len].transpose(0, 1)
        values = _read_blocks(v_cache, ids, q.dtype).view(-1, kv_heads, dim)[: p.seq_len].transpose(0, 1)
        queries = q[p.query_start : p.query_start + p.query_len].transpose(0, 1)
        context = p.seq_len - p.query_len
        windowed = 0 < window < p.seq_len
        mask = None
        if context or windowed:
            # SDPA's is_causal aligns the diagonal top-left; with cached context it must sit bottom-right. Query
            # row r (position context + r) sees key j for context + r - window < j <= context + r.
            mask = torch.ones(p.query_len, p.seq_len, dtype=torch.bool, device=q.device).tril_(context)
            if windowed:
                mask.triu_(context - window + 1)
        o = _attend(queries[None], keys[None], values[None], mask, scale, softcap, enable_gqa=group > 1,
                    sinks=None if sinks is None else sinks.view(-1, 1, 1))  # fmt: skip
        out[p.query_start : p.query_start + p.query_len] = o[0].transpose(0, 1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of q `[..., L, D]` over k, v `[..., S, D]` (`mask`: boolean, True = attend, or additive; None: causal
    from the top left; `enable_gqa`: k and v have fewer heads, each serving a group of q's, dim -3); with `softcap`
    > 0, the same attention written out, each score capped to `softcap * tanh(s / softcap)` before the mask (SDPA
    has no soft-capping); with `sinks` (a logit per query row, shaped to broadcast as the scores' `[..., L, 1]`),
    written out too, each row's softmax over its scores and its sink, the sink's weight then dropped (as
    transformers' gpt-oss attention computes it)."""
    if softcap <= 0 and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
        )
    if enable_gqa:  # the explicit product wants K/V per query head
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril_()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    with_sinks = torch.cat((scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)
    weights = torch.softmax(with_sinks, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed tokens of logits `[B, V]` to -inf, in place. `bitmask` is `[B, W]` int32 with
    `W >= ceil(V / 32)`; bit i of word j is token 32*j+i (xgrammar's layout), 1 = allowed."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


# SplitMix64 (Steele, Lea and Flood 2014; the output function is Stafford's "Mix13"): the Weyl increment and
# the two multipliers of mix64(z) = x ^ (x >> 31) where y = (z ^ (z >> 30)) * MIX_1, x = (y ^ (y >> 27)) * MIX_2.
SPLITMIX_GOLDEN = 0x9E3779B97F4A7C15
SPLITMIX_MIX_1 = 0xBF58476D1CE4E5B9
SPLITMIX_MIX_2 = 0x94D049BB133111EB


def as_int64(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (how int64 tensors hold it)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def seeded_log_uniforms(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log(u) `[S, V]` float32 for rows keyed `keys` `[S]` int64 and token ids `tokens` `[V]` int64, where

        z = mix64(key + SPLITMIX_GOLDEN * token)      (mod 2**64: SplitMix64's output over a Weyl sequence)
        s = z >> 41, as a signed 64-bit integer        (the top 23 bits, in [-2**22, 2**22))
        u = 0.5 + (2 s + 1) * 2**-24                   (an odd multiple of 2**-24: never 0 nor 1)

    mix64's last step, x ^ (x >> 31), leaves the top 31 bits alone, so it is skipped. int64 tensors wrap on
    multiplication, which is the mod 2**64 arithmetic wanted, but shift right arithmetically, hence the masks.
    u, then log(u), is computed exactly but for the log's own rounding; 13 tensor ops on [S, V] int64.
    """
    z = torch.add(keys.unsqueeze(1), tokens, alpha=as_int64(SPLITMIX_GOLDEN))
    z ^= (z >> 30) & ((1 << 34) - 1)
    z *= as_int64(SPLITMIX_MIX_1)
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= as_int64(SPLITMIX_MIX_2)
    z >>= 41
    return z.mul(2.0**-23).add_(0.5 + 2.0**-24).log_()


# Weight-only quantized linear layers (`ladle_kernels/cpu/quant_matmul.cpp`): weights in groups of QUANT_GROUP along
# K, as llama.cpp's Q4_0 / Q4_1 / Q8_0, times activations quantized to 8 bits per group on the fly (exact integer
# dot products), for any number of rows.
QUANT_GROUP = 32


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` float32 -> (xq `[M, K/32, 32]`, integer-valued float32 in [-127, 127]; dx `[M, K/32]`).

    Per group: dx = max|x| / 127 and xq = round-half-even(x * (1 / dx)), all in float32; a zero group has
    dx = 0 and xq = 0. x ≈ xq * dx.
    """
    groups = x.float().reshape(x.shape[0], -1, QUANT_GROUP)
    dx = groups.abs().amax(-1) / 127.0
    inverse = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(groups * inverse.unsqueeze(-1)), dx


def unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    """qs `[N, K/2]` uint8 -> `[N, K]` int64 values 0..15: byte j of a group's 16 holds element j in its low
    nibble and element j + 16 in its high nibble (GGUF's Q4_0 / Q4_1 order)."""
    blocks = qs.reshape(qs.shape[0], -1, QUANT_GROUP // 2).long()
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(qs.shape[0], -1)


def q4_linear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` float32 times a 4-bit weight `[N, K]` (element = scales * q + mins per group, `unpack_q4(qs)`,
    scales and mins float16) -> `[M, N]` float32, with x quantized by `quantize_activations` and sums in
    float64."""
    xq, dx = quantize_activations(x)
    q = unpack_q4(qs).reshape(qs.shape[0], -1, QUANT_GROUP).double()
    dots = torch.einsum("mgi,ngi->mng", xq.double(), q)
    dx64 = dx.double().unsqueeze(1)
    offsets = mins.double().unsqueeze(0) * (dx64 * xq.double().sum(-1).unsqueeze(1))
    return (dots * scales.double().unsqueeze(0) * dx64 + offsets).sum(-1).float()


def q8_linear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` float32 times an 8-bit weight `[N, K]` (element = scales * qs per group, scales float16) -> `[M, N]`
    float32, as `q4_linear`: 8-bit x and float64 sums."""
    xq, dx = quantize_activations(x)
    q = qs.reshape(qs.shape[0], -1, QUANT_GROUP).double()
    dots = torch.einsum("mgi,ngi->mng", xq.double(), q)
    return (dots * scales.double().unsqueeze(0) * dx.double().unsqueeze(1)).sum(-1).float()


def lowbit_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` float32 times a 5-bit, 6-bit or K-quant weight `[N, K]` given by its exact float32 values (a
    `LowBitWeight`'s `dequantize()`) -> `[M, N]` float32, as `q4_linear`: x quantized by `quantize_activations`,
    sums in float64. The kernels (ladle_kernels/cpu/lowbit_tiles.h) take the weight's values and scales as the file
    stores them, so their dots are exact integer ones per group, scaled in float32."""
    xq, dx = quantize_activations(x)
    w = weight.double().reshape(weight.shape[0], -1, QUANT_GROUP)
    return torch.einsum("mgi,ngi->mn", xq.double() * dx.double().unsqueeze(-1), w).float()


def int8_linear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The GPU's weight-only 8-bit product (`ladle_kernels.int8_linear`): x `[M, K]` in any float dtype times the
    weight `[N, K]` of `q8_linear` (element = float(scales) * qs in float32, then rounded to x's dtype), summed
    in float32 -> `[M, N]` in x's dtype. x itself is not quantized, unlike the CPU kernels' decode rows."""
    weight = qs.reshape(qs.shape[0], -1, QUANT_GROUP).float() * scales.float().unsqueeze(-1)
    weight = weight.reshape(qs.shape[0], -1).to(x.dtype)
    return torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)


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
    """A mixture of experts' SwiGLU experts: x `[T, H]`, w13 `[E, 2I, H]` (each expert's gate rows, then up),
    w2 `[E, H, I]`, each token's routing `weights` and `experts` `[T, k]` -> `[T, H]` in x's dtype:
    `sum_j weights[t, j] * w2[e] @ (silu(gate_e @ x[t]) * (up_e @ x[t]))` for `e = experts[t, j]`, computed in
    float32 one (token, choice) pair at a time (the experts' weights gathered per pair: a reference, not fast).
    With biases `b13` `[E, 2I]` and `b2` `[E, H]` (gpt-oss) each product adds its expert's; `activation` takes the
    place of SiLU-and-mul on the gate/up rows (`clamped_swiglu`)."""
    tokens, top_k = experts.shape
    pairs = experts.flatten()
    rows = x.float().repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [P, H, 1]
    gate_up = torch.bmm(w13.float()[pairs], rows).squeeze(-1)  # [P, 2I]
    if b13 is not None:
        gate_up = gate_up + b13.float()[pairs]
    hidden = activation(gate_up).unsqueeze(-1)  # [P, I, 1]
    down = torch.bmm(w2.float()[pairs], hidden).squeeze(-1)  # [P, H]
    if b2 is not None:
        down = down + b2.float()[pairs]
    out = down * weights.float().reshape(-1, 1)
    return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


QuantizedProduct = Callable[[int, torch.Tensor], torch.Tensor]


def quantized_moe(
    x: torch.Tensor, gate_up: QuantizedProduct, down: QuantizedProduct, weights: torch.Tensor, experts: torch.Tensor,
    gelu: bool = False, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    swiglu: tuple[float, float, float] | None = None, relu2: bool = False,
) -> torch.Tensor:
    """The CPU's quantized mixture of experts (`torch.ops.ladle_cpu.moe_packed`): x `[T, H]` float32, each token's
    routing `weights` and `experts` `[T, k]` -> `[T, H]` float32, `sum_j weights[t, j] * down(e, silu_and_mul(
    gate_up(e, x[t])))` for `e = experts[t, j]` (with `gelu`, `gelu_tanh_and_mul`: Gemma 4's experts), the k terms
    added in ascending expert order. `gate_up(e, rows)` and
    `down(e, rows)` are expert e's quantized products (rows `[M, K]` -> `[M, N]`) in its bank's format: `q4_linear`
    / `q8_linear` of its weights, or `lowbit_linear` of a 5-bit or K-quant weight's values (Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K; gate/up and down each in its own), so x and the hidden activations are quantized per group of 32 as the
    kernel does. gpt-oss's experts: `b13` `[E, 2I]` and `b2` `[E, H]` added to expert e's gate/up and down products,
    and with `swiglu` (alpha, limit, up_offset) the activation is `clamped_swiglu`. With `relu2` (Nemotron-H's ungated
    experts) `gate_up(e, rows)` is the up product alone, `[M, I]`, and the activation `relu(up)²`."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for token in range(x.shape[0]):
        for choice in torch.argsort(experts[token], stable=True).tolist():
            expert = int(experts[token, choice])
            product = gate_up(expert, x[token : token + 1].float())
            product = product if b13 is None else product + b13[expert].float()
            if relu2:
                hidden = torch.relu(product).square()
            elif swiglu is not None:
                hidden = clamped_swiglu(product, *swiglu)
            else:
                hidden = gelu_tanh_and_mul(product) if gelu else silu_and_mul(product)
            result = down(expert, hidden)[0]
            result = result if b2 is None else result + b2[expert].float()
            out[token] += weights[token, choice].float() * result
    return out


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` float32 times weight `[N, K]` -> `[M, N]` (`torch.ops.ladle_cpu.rowwise_linear`, which sums each
    dot product in one fixed order whatever M is, so a row's result does not depend on its batch)."""
    return F.linear(x.float(), weight.float())


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """LoRA's first product for rows of many adapters at once: x `[T, K]`, a `[S, R, K]` (slot s holds one adapter's
    A, its rows past the adapter's rank zero), slots `[T]` integer (row t's slot; -1: no adapter) -> `[T, R]` in x's
    dtype, `y[t] = a[slots[t]] @ x[t]` (0 where slots[t] is -1), each product in x's dtype as `nn.Linear` takes it.
    One matmul per slot present (a reference: it syncs with the device to find them)."""
    y = x.new_zeros(x.shape[0], a.shape[1])
    for slot in slots.unique().tolist():
        if slot >= 0:
            rows = (slots == slot).nonzero().squeeze(1)
            y[rows] = F.linear(x[rows], a[slot])
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """LoRA's second product, added in place: out `[T, N]`, y `[T, R]` (`lora_shrink`'s), b `[S, R, N]` (slot s holds
    one adapter's B transposed, times its scaling, rows past its rank zero), slots as `lora_shrink`'s:
    `out[t] += y[t] @ b[slots[t]]` where slots[t] >= 0 (other rows untouched), the product in y's dtype. out may be a
    column slice of a wider tensor (rows further apart than N), y too: out is written through the view."""
    for slot in slots.unique().tolist():
        if slot >= 0:
            rows = (slots == slot).nonzero().squeeze(1)
            out[rows] += (y[rows] @ b[slot]).to(out.dtype)


# FP8 linear layers (`ladle_kernels.fp8_linear`, `engine_server.layers.fp8_linear`): weights in float8 e4m3 (OCP's
# "e4m3fn": no infinities, largest finite value 448) with float32 scales, one per output channel or one per block
# of FP8_BLOCK x FP8_BLOCK elements; activations rounded to e4m3 per token on the fly, with a float32 scale each.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128  # the block-wise checkpoints' weight_block_size (DeepSeek-V3, Qwen3-FP8): [128, 128]
# The GPU kernels' e4m3 K tiles are 32 columns wide at least (tl.dot's least K for 8-bit floats) and never straddle
# two blocks: they take blocks a multiple of this many columns wide (`engine_server.layers.fp8_linear.gpu_layout`).
FP8_GPU_BLOCK_COLUMNS = 32
# A row of zeros gets this scale instead of 0, so that dividing by it is defined (its values stay 0).
FP8_MIN_SCALE = 1e-12


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 (nearest, ties to even), saturating: values beyond ±448 (infinities too) become ±448,
    NaN stays NaN. torch's own cast leaves out-of-range values to the device's conversion, so clamp first."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_scale_of(amax: torch.Tensor) -> torch.Tensor:
    """max(amax / 448, FP8_MIN_SCALE) in float32, the division correctly rounded on every device (as the kernels'
    `div_rn`). CUDA's division by a Python number multiplies by its rounded reciprocal instead, which is one unit
    in the last place off for some amax, so the divisor is a tensor on amax's device."""
    return (amax / torch.tensor(FP8_MAX, device=amax.device)).clamp(min=FP8_MIN_SCALE)


def fp8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> (xq `[M, K]` e4m3, scale `[M, 1]` float32) with x ≈ float(xq) * scale: scale =
    `fp8_scale_of(max|x[m]|)`, xq = to_fp8(x / scale) computed in float32 (both divisions correctly rounded)."""
    x32 = x.float()
    scale = fp8_scale_of(x32.abs().amax(-1, keepdim=True))
    return to_fp8(x32 / scale), scale


# An FP8 KV cache (`--kv-cache-dtype fp8`) holds each token's key or value of one KV head as a row of uint8: its D
# values in e4m3 (`fp8_quantize_per_token`: the row's largest magnitude maps to 448), then their float32 scale's 4
# bytes. One tensor per layer as with a float cache, so block tables, prefix caching and graphs are unchanged.
FP8_KV_DTYPE = torch.uint8
FP8_KV_SCALE_BYTES = 4


def fp8_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """x `[..., D]` -> `[..., D + 4]` uint8: each row's `fp8_quantize_per_token` (e4m3 bits, then the float32
    scale's bytes in the machine's byte order)."""
    xq, scale = fp8_quantize_per_token(x.reshape(-1, x.shape[-1]))
    rows = torch.cat([xq.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
    return rows.view(*x.shape[:-1], x.shape[-1] + FP8_KV_SCALE_BYTES)


def fp8_kv_values(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`fp8_kv_rows`' rows `[..., D + 4]` -> their values `[..., D]` in `dtype`: float32(e4m3) * scale in float32,
    then rounded once to `dtype`."""
    flat = rows.reshape(-1, rows.shape[-1])
    dim = flat.shape[-1] - FP8_KV_SCALE_BYTES
    values = flat[:, :dim].contiguous().view(FP8_DTYPE).float()
    scale = flat[:, dim:].contiguous().view(torch.float32)
    return (values * scale).to(dtype).view(*rows.shape[:-1], dim)


def fp8_quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[N, K]` -> (`[N, K]` e4m3, scale `[N, 1]` float32): `fp8_quantize_per_token` of its rows (each
    output channel's largest magnitude maps to 448)."""
    return fp8_quantize_per_token(weight)


def fp8_quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[N, K]` -> (`[N, K]` e4m3, scale `[ceil(N/bn), ceil(K/bk)]` float32), one scale per block of
    `block` = (bn, bk) elements (the last row and column of blocks may be partial), each block's largest magnitude
    mapped to 448: the layout block-wise FP8 checkpoints store (`weight` and `weight_scale_inv`, the scale that
    multiplies)."""
    rows, cols = weight.shape
    w = weight.float()
    padded = F.pad(w.abs(), (0, -cols % block[1], 0, -rows % block[0]))
    blocks = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale = fp8_scale_of(blocks.amax((1, 3)))
    return to_fp8(w / expand_fp8_scale(scale, rows, cols, block)), scale


def expand_fp8_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None = None) -> torch.Tensor:
    """An FP8 weight `[N, K]`'s scale as the float32 multiplier of each element (a tensor that broadcasts to
    `[N, K]`): without `block`, `[]` / `[1]` (per tensor) or `[N]` / `[N, 1]` (per channel); with `block` (bn, bk),
    `[ceil(N/bn), ceil(K/bk)]`, one per block of bn x bk elements (the last row and column of blocks partial)."""
    s = scale.float()
    if block is not None:
        return s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return s.reshape(1, 1) if s.numel() == 1 else s.reshape(rows, 1)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """An e4m3 weight `[N, K]` times its scale (`expand_fp8_scale`'s layouts) -> `[N, K]` float32."""
    return weight.float() * expand_fp8_scale(scale, weight.shape[0], weight.shape[1], block)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The FP8 GEMM (`ladle_kernels.fp8_linear`): x `[M, K]` in any float dtype, rounded per token by
    `fp8_quantize_per_token`, times the e4m3 weight `[N, K]` with its scale (`expand_fp8_scale`'s layouts, per
    block of `block`) -> `[M, N]` in x's dtype: out[m, n] = x_scale[m] * sum_k float(xq[m, k]) * w_scale[n, k] *
    float(w[n, k]) in float32, plus bias, then rounded once to x's dtype."""
    xq, x_scale = fp8_quantize_per_token(x)
    out = F.linear(xq.float() * x_scale, fp8_dequantize(weight, scale, block))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    weights: torch.Tensor, experts: torch.Tensor, block: tuple[int, int] | None = None,
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:  # fmt: skip
    """`fused_moe` with FP8 experts (`ladle_kernels.fused_moe.fp8_fused_moe`): w13 `[E, 2I, H]` and w2 `[E, H, I]` in
    e4m3 with their float32 scales (each expert's `[N, 1]` per channel, or per block of `block`: `fp8_linear`'s layouts,
    stacked over the experts), x `[T, H]`, routing `weights` and `experts` `[T, k]` -> `[T, H]` in x's dtype. Each
    (token, choice) pair is two `fp8_linear`s in float32: x's row rounded per token times gate/up (plus `b13[e]`),
    `activation` (`silu_and_mul`, or gpt-oss's `clamped_swiglu`), that row rounded to e4m3 again times down (plus
    `b2[e]`), scaled by the pair's weight; a token's pairs are summed in float32, then rounded once to x's dtype.
    One pair at a time: a reference."""
    tokens, top_k = experts.shape
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for token in range(tokens):
        for choice in range(top_k):
            e = int(experts[token, choice])
            gate_up = fp8_linear(x[token : token + 1].float(), w13[e], w13_scale[e], block=block)
            hidden = activation(gate_up if b13 is None else gate_up + b13[e].float())
            down = fp8_linear(hidden, w2[e], w2_scale[e], block=block)
            down = down if b2 is None else down + b2[e].float()
            out[token] += weights[token, choice].float() * down[0]
    return out.to(x.dtype)


def alibi_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    slopes: torch.Tensor,
    falcon: bool = False,
) -> torch.Tensor:
    """ALiBi (BLOOM's, MPT's; `engine_server.layers.alibi` gives the slopes): causal attention of q `[T, H, D]` over
    the paged cache `[2, blocks, block_size, Hkv, row]` (this step's K/V written already), each score `scale * q . k
    + slopes[h] * (j - p)` for the query at position p and the key at j (`slopes` `[H]` float32): `[T, H, D]`.
    `falcon`: each score `scale * (q . k + bf16(slopes[h] * j))` instead (Falcon-RW's bias: slopes bfloat16).

    Sequence by sequence in torch: each sequence's keys and values gathered from its blocks, the scores in q's dtype,
    the bias and the softmax in float32 (as transformers' BLOOM computes them)."""
    out = torch.empty_like(q)
    block, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // kv_heads
    start = 0
    for row, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        rows = kv_cache[:, meta.block_tables[row, : -(-seq_len // block)].long()]
        if is_fp8_kv_cache(kv_cache):
            rows = fp8_kv_values(rows, q.dtype)
        rows = rows.reshape(2, -1, kv_heads, rows.shape[-1])[:, :seq_len]
        keys = rows[0].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, D]
        values = rows[1].transpose(0, 1).repeat_interleave(group, dim=0)
        queries = q[start : start + query_len].transpose(0, 1)  # [H, Q, D]
        keys_at = torch.arange(seq_len, device=q.device)
        queries_at = keys_at[seq_len - query_len :]
        distance = (keys_at[None, :] - queries_at[:, None]).float()  # [Q, S]
        scores = torch.matmul(queries, keys.transpose(1, 2)) * scale
        if falcon:  # the product in bfloat16, as its modeling code computes it, then scaled with the scores
            bias = (slopes.bfloat16()[:, None] * keys_at[None, :]).float()[:, None, :] * scale
        else:
            bias = slopes[:, None, None] * distance
        scores = scores.float() + bias
        scores = scores.masked_fill(distance > 0, float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        out[start : start + query_len] = torch.matmul(weights, values).transpose(0, 1)
        start += query_len
    return out
