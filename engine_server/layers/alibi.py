"""ALiBi's slopes (BLOOM's, MPT's, Falcon-RW's): attention without rope whose every score gets a linear bias by
distance, `slope_h * (j - p)` for the query at position p and the key at j (head h's slope; transformers adds
`slope_h * j`, the same softmax). Falcon-RW's bias is its modeling code's: `slope_h * j` in bfloat16 (the slope rounded
to it too), then scaled with the scores.

The attention itself is the kernel set's `alibi_attention` (`ladle_kernels.reference.alibi_attention`: torch over
the paged cache, sequence by sequence; the CPU's C++ decode kernel, every token a row of its own, for BLOOM's and
MPT's bias). The torch path cannot be recorded by a CUDA graph (`model_loading`).
"""

from __future__ import annotations

import math

import torch


def bloom_slopes(heads: int) -> torch.Tensor:
    """Each of `heads` heads' slope, float32, as transformers' `_get_alibi_slopes` (BLOOM's) gives them: the powers
    of `2^(-8 / n)` for the largest power of two n <= heads, then every other power of `2^(-4 / n)` for the rest."""
    closest = 2 ** math.floor(math.log2(heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))])
    return slopes


def mpt_slopes(heads: int, bias_max: float) -> torch.Tensor:
    """Each of `heads` heads' slope, float32, as MPT builds them (transformers' `build_mpt_alibi_tensor`):
    `2^(-i * bias_max / n)` for i = 1..n, n the smallest power of two >= heads; for other head counts the odd
    i's slopes first, then the even i's, the first `heads` of them."""
    closest = 2 ** math.ceil(math.log2(heads))
    exponents = torch.arange(1, closest + 1, dtype=torch.int64).float() * (bias_max / closest)
    slopes = 1.0 / torch.pow(2, exponents)
    if closest != heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:heads]
    return slopes


def alibi_slopes(kind: str, heads: int, bias_max: float) -> torch.Tensor:
    """The slopes of a model's `heads` heads, float32 (`ModelConfig.alibi`: "mpt" from `bias_max`; "bloom" and
    "falcon" BLOOM's, which the attention rounds to bfloat16 for Falcon: `reference.alibi_attention`)."""
    return mpt_slopes(heads, bias_max) if kind == "mpt" else bloom_slopes(heads)
