"""Plain-torch ops of Mamba-2's selective state space layer (the mixer of Granite 4.0's hybrids), after its short
causal convolution (`ladle_kernels.causal_conv`): what every device runs, one sequence's chunk or a batch of decode rows
at a time.

A sequence's state between steps is two tensors: the convolution's last `K - 1` inputs `[K - 1, C]` (zeros before
its first token) and one `P x N` matrix per head, `[H, P, N]` in float32 (zeros before its first token). Per head and
token t, with `dt_t = softplus(dt_raw_t + dt_bias) > 0`, `A = -exp(A_log) < 0` and the head's group's `B_t`, `C_t`
(`[N]`; `G` groups of `H / G` consecutive heads share them):

    S = exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t

(`x_t` `[P]`, the head's slice of the convolved x). `mamba2_mixer` is a layer's whole core over one step's
sequences, convolution, scan and gated norm (the contract of the kernel sets' op of that name); here each prefill
chunk goes through `ssd_chunk`, a run of tokens in chunks of `CHUNK` at once (within a chunk the scan is one masked
product, across chunks the state carries: Mamba-2's state space duality), and the one-token rows together through
`ssd_step`; both leave the same state to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ladle_kernels.causal_conv import advance_sequences, biased_convolution

CHUNK = 64  # tokens one masked product covers


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x `[R, H, P]`, dt `[R, H]` (after softplus), a `[H]` (`-exp(A_log)`), b and c `[R, H, N]`
    (each head's group's), state `[R, H, P, N]` float32 -> (output `[R, H, P]` float32 without the `D` term, new
    state). Each row's values depend on that row alone."""
    dt32 = dt.float()
    decay = torch.exp(dt32 * a.float())[..., None, None]
    state = state * decay + (dt32[..., None] * x.float())[..., None] * b.float()[..., None, :]
    return (state * c.float()[..., None, :]).sum(dim=-1), state


def ssd_chunk(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's run of T tokens: x `[T, H, P]`, dt `[T, H]` (after softplus), a `[H]`, b and c `[T, H, N]`,
    state `[H, P, N]` float32 -> (output `[T, H, P]` float32 without the `D` term, new state), in chunks of `CHUNK`.

    Within a chunk, with `G_i` the cumulative `dt A` up to token i and `L_ij = exp(G_i - G_j)` (i >= j, else 0):
    `y_i = sum_{j <= i} (c_i . b_j) L_ij dt_j x_j + exp(G_i) S c_i`, and the state leaves the chunk as
    `exp(G_last) S + sum_j exp(G_last - G_j) dt_j x_j b_j^T`."""
    total = x.shape[0]
    # Heads first: [H, T, ...], float32.
    xh, bh, ch = x.float().transpose(0, 1), b.float().transpose(0, 1), c.float().transpose(0, 1)
    dth = dt.float().t()
    log_decay = dth * a.float()[:, None]  # [H, T]
    out = torch.empty_like(xh)
    for begin in range(0, total, CHUNK):
        end = min(begin + CHUNK, total)
        xc, bc, cc = xh[:, begin:end], bh[:, begin:end], ch[:, begin:end]
        weighted = xc * dth[:, begin:end, None]  # dt_j x_j
        cumulative = log_decay[:, begin:end].cumsum(dim=-1)  # [H, L]
        lower = torch.ones(end - begin, end - begin, dtype=torch.bool, device=x.device).tril()
        decay = (cumulative[:, :, None] - cumulative[:, None, :]).masked_fill(~lower, -torch.inf).exp()
        scores = (cc @ bc.transpose(-1, -2)) * decay  # [H, L, L]
        out[:, begin:end] = scores @ weighted + (cc @ state.transpose(-1, -2)) * cumulative.exp()[..., None]
        last = cumulative[:, -1:]
        kept = weighted * (last - cumulative).exp()[..., None]  # [H, L, P]
        state = state * last.exp()[..., None] + kept.transpose(-1, -2) @ bc
    return out.transpose(0, 1), state


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """One step of the scan over its sequences: x `[T, H, P]`, dt `[T, H]`, a `[H]`, b and c `[T, H, N]`; sequence
    i's `query_lens[i]` tokens follow each other in that order and its state is `states[slots[i]]` (`[slots, H, P,
    N]` float32, advanced in place; zeroed first where `fresh[i]`). Returns the output `[T, H, P]` float32 (without
    the `D` term)."""
    def rows(tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ssd_step(
            x.index_select(0, tokens), dt.index_select(0, tokens), a, b.index_select(0, tokens),
            c.index_select(0, tokens), state,
        )  # fmt: skip

    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return advance_sequences(
        out, states, slots, query_lens, fresh,
        lambda span, state: ssd_chunk(x[span], dt[span], a, b[span], c[span], state), rows,
    )  # fmt: skip


def gated_group_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, groups: int
) -> torch.Tensor:
    """`weight * rms_norm(x * silu(gate))`, the statistic over each of `groups` equal groups of the last dim
    (transformers' `MambaRMSNormGated` with the gate before the norm; in float32, the weight applied in x's dtype)."""
    gated = x.float() * F.silu(gate.float())
    grouped = gated.view(*gated.shape[:-1], groups, -1)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.view(gated.shape).to(x.dtype)


def mamba2_mixer(
    xbc: torch.Tensor,
    z: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    d: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    groups: int,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """A Mamba-2 layer's core over one step, from its input projection's parts to what its output projection takes:
    xbc `[T, C]` (x of H heads P wide, then B and C of `groups` groups N wide), z `[T, H * P]` (the gate), dt `[T, H]`
    (before softplus); the convolution's weight `[C, 1, K]` and bias `[C]` (or None), `A_log`, `dt_bias` and `D`
    `[H]`, the gated norm's weight `[H * P]`, eps and its `groups` (the scan's groups: each normalised over its own
    heads). Sequence i's `query_lens[i]` tokens follow each other in that order; its state is row `slots[i]` of
    `states` (`[slots, (K - 1) * C + H * P * N]` float32: the convolution's last inputs `[K - 1, C]`, then the
    matrices `[H, P, N]`), zeroed first where `fresh[i]`, advanced in place. Returns `[T, H * P]` in xbc's dtype:
    `rms_norm((y + D x) * silu(z))` times the norm's weight; with a norm weight of None, `(y + D x) * silu(z)`
    unnormalised (for a caller whose groups span tensor-parallel ranks)."""
    tokens, channels = xbc.shape
    heads = dt.shape[1]
    inner = z.shape[1]
    head_dim = inner // heads
    state_dim = (channels - inner) // (2 * groups)
    matrices = states[:, (conv_weight.shape[-1] - 1) * channels :].view(-1, heads, head_dim, state_dim)
    convolved = biased_convolution(xbc, conv_weight, conv_bias, states, slots, query_lens, fresh)
    x, b, c = convolved.split([inner, groups * state_dim, groups * state_dim], dim=-1)
    per_group = heads // groups
    b = b.reshape(tokens, groups, state_dim).repeat_interleave(per_group, dim=1)
    c = c.reshape(tokens, groups, state_dim).repeat_interleave(per_group, dim=1)
    step = F.softplus(dt.float() + dt_bias.float())
    heads_x = x.reshape(tokens, heads, head_dim)
    y = ssd_scan(heads_x, step, -a_log.float().exp(), b, c, matrices, slots, query_lens, fresh)
    y = (y + d.float()[:, None] * heads_x.float()).reshape(tokens, inner)
    if norm_weight is None:
        return (y * F.silu(z.float())).to(xbc.dtype)
    return gated_group_norm(y.to(xbc.dtype), z, norm_weight, eps, groups)
