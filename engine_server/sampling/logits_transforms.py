"""Pure batched logits transforms and the exponential-race draw: one row per sequence, no host syncs on CUDA.

Every function works on a [B, V] float32 tensor of logits (or probabilities) with per-row parameters as
[B] tensors on the same device. Functions ending in `_` modify their first argument in place; the others
return a new tensor and leave their inputs untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ladle_kernels import reference

_NEG_INF = float("-inf")


def apply_repetition_penalty_(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> None:
    """Hugging Face semantics: for tokens in `seen` [B, V] bool, divide positive logits by the row's penalty
    and multiply negative ones, so a penalty > 1 always makes a seen token less likely."""
    p = penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    torch.where(seen, penalized, logits, out=logits)


def apply_presence_frequency_(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> None:
    """OpenAI semantics: logit -= frequency * count + presence * (count > 0), counts [B, V] over output tokens."""
    logits.sub_(counts * frequency.unsqueeze(1))
    logits.sub_((counts > 0).to(logits.dtype) * presence.unsqueeze(1))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed tokens to -inf. `bitmask` is [B, ceil(V/32)] int32; bit i of word j is token 32*j+i
    (xgrammar's layout), 1 = allowed. CUDA tensors take the Triton kernel (one pass, without the [B, W, 32]
    temporaries of the torch version); the others `ladle_kernels.reference.apply_token_bitmask_`."""
    kernel = _triton_bitmask() if logits.is_cuda else None
    (kernel or reference.apply_token_bitmask_)(logits, bitmask)


@functools.cache
def _triton_bitmask() -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """The Triton bitmask launcher, or None where triton does not import (it ships for Linux only)."""
    try:
        from ladle_kernels.bitmask import apply_token_bitmask_
    except ImportError:
        return None
    return apply_token_bitmask_


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    *,
    drop_mass: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    from_candidates: bool = True,
) -> torch.Tensor:
    """Mask to -inf everything outside each row's top_k tokens, then outside its nucleus of mass top_p.

    One ascending sort serves both. `top_k` holds V for rows without top-k (ties with the k-th logit are
    kept); `top_p` holds 1.0 for rows without top-p. The most likely token always survives. Top-p alone on the
    CPU reads each row's most likely tokens instead of sorting them all (`_top_p_from_candidates`), unless
    `from_candidates` is False (then the CPU takes the GPU's path, e.g. to count the ops a GPU step launches).
    `drop_mass`, when given, is `1.0 - top_p` in float32 (computed on the host, it saves an op); the sort path
    writes its result into `out` when given, which may be `logits` itself. The result is returned either way.
    """
    if (
        from_candidates
        and top_k is None
        and top_p is not None
        and not logits.is_cuda
        and logits.shape[1] > 2 * NUCLEUS_CANDIDATES
    ):
        return _top_p_from_candidates(logits, top_p)
    return _sorted_top_k_top_p(logits, top_k, top_p, drop_mass=drop_mass, out=out)


# Tokens per row that top-p alone reads on the CPU before falling back to a full sort.
NUCLEUS_CANDIDATES = 1024


def _top_p_from_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_sorted_top_k_top_p(logits, None, top_p)` from each row's NUCLEUS_CANDIDATES most likely tokens.

    A token stays when the tokens more likely than it hold less than top_p of the row's mass, the sorted path's
    rule read from the other end; rows whose candidates hold less than their top_p (a flat distribution, or
    top_p 1.0) take the full sort. On two CPU cores a [16, 49152] sort costs ~35 ms a step and this ~5 ms, which
    the model's own top_p default (the embedded model's 0.9) would otherwise add to every sampled step. CPU only:
    choosing the rows that fall back reads a value on the host.
    """
    values, index = logits.topk(NUCLEUS_CANDIDATES, dim=-1)  # descending
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    before = probs.cumsum(dim=-1) - probs  # the mass of the candidates more likely than each
    keep = before < top_p.unsqueeze(1)
    keep[:, 0] = True
    out = torch.full_like(logits, _NEG_INF).scatter_(1, index, values.masked_fill(~keep, _NEG_INF))
    # The nucleus may reach past the candidates; with top_p 1.0 the sorted path keeps every token of nonzero
    # mass, which a float32 running sum of the candidates cannot tell apart.
    short = (probs.sum(dim=-1) < top_p) | (top_p >= 1.0)
    if bool(short.any()):
        rows = short.nonzero().squeeze(1)
        out[rows] = _sorted_top_k_top_p(logits[rows], None, top_p[rows])
    return out


def _sorted_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    *,
    drop_mass: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask to -inf everything outside each row's top_k tokens, then outside its nucleus of mass top_p.

    One ascending sort serves both. `top_k` holds V for rows without top-k (ties with the k-th logit are
    kept); `top_p` holds 1.0 for rows without top-p. The most likely token always survives. `drop_mass` and
    `out` as in `apply_top_k_top_p`: every column of `out` is written, after `logits` was read.
    """
    sorted_logits, order = logits.sort(dim=-1)
    vocab = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        # Ascending cumulative mass: a token goes when it and everything less likely sum to <= 1 - top_p,
        # which leaves the smallest set of most likely tokens whose mass reaches top_p.
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        remove = cumulative <= (1.0 - top_p if drop_mass is None else drop_mass).unsqueeze(1)
        remove[:, -1] = False
        sorted_logits.masked_fill_(remove, _NEG_INF)
    return (torch.empty_like(logits) if out is None else out).scatter_(1, order, sorted_logits)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Top-k alone without a full sort: torch.topk of the batch's largest k (`k_max` < V, known on the host
    so no sync), then each row's own k-th value is its threshold. Rows holding k > k_max keep everything."""
    values = logits.topk(k_max, dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))
    kth.masked_fill_((top_k > k_max).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_min_p_(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero the probability of tokens below min_p times the row's top probability (min_p 0 keeps all)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)


def exponential_race(
    probs: torch.Tensor,
    shared: torch.Generator,
    seeded_log_uniforms: torch.Tensor | None = None,
    seeded_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row from (unnormalized) `probs`; returns [B] int64. Overwrites `probs` and
    `seeded_log_uniforms`.

    argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i / sum(p), without a
    normalization or a multinomial call (whose CUDA kernel syncs). Rows draw E from the `shared` generator (one
    op for the batch), except seeded rows: `seeded_log_uniforms` [S, V] holds log(u) < 0 for the rows
    `seeded_rows` [S] (every row, in order, when None), E = -log(u), which `noise.SeededNoise` computes from
    the row's seed and position alone, so a seeded row's token does not depend on what else is in the batch.
    The op count is the same for any B and any number of seeded rows.
    """
    if seeded_log_uniforms is not None and seeded_rows is None:
        # p / log(u) = -(p / E) exactly, so its argmin is the argmax above, without negating.
        return probs.div_(seeded_log_uniforms).argmin(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=shared)
    # exponential_ may return exactly 0 on some backends; 0/0 would be NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    if seeded_rows is not None and seeded_log_uniforms is not None:
        noise.index_copy_(0, seeded_rows, seeded_log_uniforms.neg_())
    return probs.div_(noise).argmax(dim=-1)
