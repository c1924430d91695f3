"""Plain-torch ops of the gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5) after its
short causal convolution (`ladle_kernels.causal_conv`): what every device runs, one sequence's chunk or a batch of
decode rows at a time.

A sequence's state between steps is two tensors: the convolution's last `K - 1` inputs `[K - 1, C]` (zeros before
its first token) and the recurrent state `[H, Dk, Dv]` in float32, one `Dk x Dv` matrix per value head (zeros
before its first token). The rule, per head and token t, with `q`, `k` L2-normalised and `q` scaled by
`Dk ** -0.5`:

    S = exp(g_t) * S;   S += k_t (beta_t * (v_t - k_t S));   o_t = q_t S

(row vectors; `k_t S` is what the state recalls for `k_t`, so only the difference to `v_t` is written: the delta
rule). Kimi Delta Attention (Kimi Linear's) decays each key channel at its own rate: g_t is a vector of Dk, and
`exp(g_t) * S` scales row i of S by `exp(g_t[i])`.

`gated_delta_net` is a layer's whole core over one step's sequences, convolution, rule and gated norm (the
contract of the kernel sets' op of that name: on the CPU `ladle_kernels/cpu/gated_delta.cpp`, token by token); here
`gated_delta_rule` takes each prefill chunk through `gated_delta_chunk`, a run of tokens in chunks of `CHUNK` at once
(the WY form: within a chunk the updates' interplay is one unit lower-triangular solve, across chunks the state
carries), and the one-token rows together through `gated_delta_step`; both leave the same state to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ladle_kernels.causal_conv import advance_sequences, convolve

CHUNK = 64  # tokens a chunk's triangular solve covers (the chunk size of transformers' and FLA's kernels)
# With a decay per key channel a chunk's decays are a [H, C, C, Dk] tensor: shorter chunks keep it small.
CHANNEL_CHUNK = 16


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x²) + eps)` over the last dim (FLA's and transformers' form, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(query: torch.Tensor, key: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k `[..., Hk, Dk]` as the rule reads them: float32, each key head repeated for the value heads it serves
    (`value_heads / Hk` consecutive ones), L2-normalised, q scaled by `Dk ** -0.5`."""
    repeat = value_heads // query.shape[-2]
    q, k = (t.float().repeat_interleave(repeat, dim=-2) if repeat > 1 else t.float() for t in (query, key))
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k `[B, H, Dk]` (`prepare_qk`'s), v `[B, H, Dv]`, g (log decay, <= 0) `[B, H]` (or
    `[B, H, Dk]`, a decay per key channel), beta `[B, H]`, state `[B, H, Dk, Dv]` float32 -> (output `[B, H, Dv]`
    float32, new state). Each row's values depend on that row alone (elementwise products and sums over Dk,
    whatever B)."""
    decay = g.float().exp()
    state = state * (decay[..., None] if decay.dim() == q.dim() else decay[..., None, None])
    recalled = (state * k[..., None]).sum(dim=-2)
    delta = (v.float() - recalled) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def gated_delta_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's run of T tokens: q, k `[T, H, Dk]` (`prepare_qk`'s), v `[T, H, Dv]`, g and beta `[T, H]`,
    state `[H, Dk, Dv]` float32 -> (output `[T, H, Dv]` float32, new state), in chunks of `CHUNK` tokens; with g
    `[T, H, Dk]` (a decay per key channel) `gated_delta_channel_chunk`'s.

    Within a chunk, with `G_i` the cumulative log decay up to token i and `D_ij = exp(G_i - G_j)` (i >= j), the
    tokens' corrections `u` solve `(I + L) u = beta v - (beta k exp(G)) S` for the strictly lower
    `L_ij = beta_i (k_i . k_j) D_ij`; then `o_i = exp(G_i) q_i S + sum_{j <= i} (q_i . k_j) D_ij u_j` and the state
    leaves the chunk as `exp(G_last) S + sum_j exp(G_last - G_j) k_j u_j`."""
    if g.dim() == q.dim():
        return gated_delta_channel_chunk(q, k, v, g, beta, state)
    total = q.shape[0]
    # Heads first: [H, T, ...], float32.
    qh, kh = q.transpose(0, 1), k.transpose(0, 1)
    vh = v.float().transpose(0, 1)
    gh, bh = g.float().t(), beta.float().t()
    out = torch.empty_like(vh)
    for begin in range(0, total, CHUNK):
        end = min(begin + CHUNK, total)
        qc, kc, vc = qh[:, begin:end], kh[:, begin:end], vh[:, begin:end]
        bc = bh[:, begin:end, None]
        cumulative = gh[:, begin:end].cumsum(dim=-1)  # [H, C]
        lower = torch.ones(end - begin, end - begin, dtype=torch.bool, device=q.device).tril()
        decay = (cumulative[:, :, None] - cumulative[:, None, :]).masked_fill(~lower, -torch.inf).exp()
        k_beta = kc * bc
        system = (k_beta @ kc.transpose(-1, -2)) * decay  # its diagonal is ignored: a unit triangle
        corrections = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        recalls = torch.linalg.solve_triangular(
            system, k_beta * cumulative.exp()[..., None], upper=False, unitriangular=True
        )
        u = corrections - recalls @ state
        scores = (qc @ kc.transpose(-1, -2)) * decay
        out[:, begin:end] = (qc * cumulative.exp()[..., None]) @ state + scores @ u
        last = cumulative[:, -1:]
        kept = kc * (last - cumulative).exp()[..., None]
        state = state * last.exp()[..., None] + kept.transpose(-1, -2) @ u
    return out.transpose(0, 1), state


def gated_delta_channel_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_chunk` with a decay per key channel (Kimi Delta Attention): g `[T, H, Dk]`, in chunks of
    `CHANNEL_CHUNK` tokens. The same form with `G_i` a vector of Dk: every product of two tokens' keys (or a query's
    and a key's) weighs channel c by `exp(G_ic - G_jc)`, and `exp(G_i)` scales the state's rows."""
    total = q.shape[0]
    qh, kh = q.transpose(0, 1), k.transpose(0, 1)  # [H, T, Dk]
    vh = v.float().transpose(0, 1)
    gh, bh = g.float().transpose(0, 1), beta.float().t()
    out = torch.empty_like(vh)
    for begin in range(0, total, CHANNEL_CHUNK):
        end = min(begin + CHANNEL_CHUNK, total)
        qc, kc, vc = qh[:, begin:end], kh[:, begin:end], vh[:, begin:end]
        bc = bh[:, begin:end, None]
        cumulative = gh[:, begin:end].cumsum(dim=1)  # [H, C, Dk]
        lower = torch.ones(end - begin, end - begin, dtype=torch.bool, device=q.device).tril()
        spread = cumulative[:, :, None, :] - cumulative[:, None, :, :]  # [H, C, C, Dk]: G_i - G_j
        decay = spread.masked_fill(~lower[..., None], -torch.inf).exp()
        k_beta = kc * bc
        system = torch.einsum("hic,hjc,hijc->hij", k_beta, kc, decay)  # its diagonal is ignored: a unit triangle
        corrections = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        recalls = torch.linalg.solve_triangular(system, k_beta * cumulative.exp(), upper=False, unitriangular=True)
        u = corrections - recalls @ state
        scores = torch.einsum("hic,hjc,hijc->hij", qc, kc, decay)
        out[:, begin:end] = (qc * cumulative.exp()) @ state + scores @ u
        last = cumulative[:, -1:]  # [H, 1, Dk]
        kept = kc * (last - cumulative).exp()
        state = state * last.exp().transpose(-1, -2) + kept.transpose(-1, -2) @ u
    return out.transpose(0, 1), state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """One step of the rule over its sequences: q, k `[T, Hk, Dk]` and v `[T, Hv, Dv]` as the convolution gives them
    (not normalised), g and beta `[T, Hv]` (g `[T, Hv, Dk]`: a decay per key channel); sequence i's `query_lens[i]`
    tokens follow each other in that order and its state is `states[slots[i]]` (`[slots, Hv, Dk, Dv]` float32,
    advanced in place; zeroed first where `fresh[i]`). Returns the output `[T, Hv, Dv]` float32."""
    value_heads = v.shape[1]

    def chunk(span: slice, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qn, kn = prepare_qk(q[span], k[span], value_heads)
        return gated_delta_chunk(qn, kn, v[span], g[span], beta[span], state)

    def rows(tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qn, kn = prepare_qk(q.index_select(0, tokens), k.index_select(0, tokens), value_heads)
        return gated_delta_step(
            qn, kn, v.index_select(0, tokens), g.index_select(0, tokens), beta.index_select(0, tokens), state
        )

    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    return advance_sequences(out, states, slots, query_lens, fresh, chunk, rows)


def gated_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, sigmoid_gate: bool = False
) -> torch.Tensor:
    """`weight * rms_norm(x) * silu(gate)` over the last dim (transformers' `RMSNormGated`: the statistic and the
    gate in float32, the weight applied in x's dtype); `sigmoid(gate)` with `sigmoid_gate` (Kimi Linear's)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    gate32 = gate.float()
    return ((weight * normed) * (gate32.sigmoid() if sigmoid_gate else F.silu(gate32))).to(x.dtype)


def gated_delta_net(
    mixed: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    key_heads: int,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
    beta_scale: float = 1.0,
    sigmoid_gate: bool = False,
    decay_bound: float = 0.0,
) -> torch.Tensor:
    """A Gated DeltaNet layer's core over one step, from its input projection's parts to what its output projection
    takes: mixed `[T, C]` (q, k, v of `key_heads`, `key_heads` and Hv heads side by side), z `[T, Hv * Dv]`, a and b
    `[T, Hv]`; the convolution's weight `[C, 1, K]`, `A_log` and `dt_bias` `[Hv]`, the gated norm's weight `[Dv]`
    and eps. Sequence i's `query_lens[i]` tokens follow each other in that order; its state is row `slots[i]` of
    `states` (`[slots, (K - 1) * C + Hv * Dk * Dv]` float32: the convolution's last inputs `[K - 1, C]`, then the
    matrices `[Hv, Dk, Dv]`), zeroed first where `fresh[i]`, advanced in place. Returns `[T, Hv * Dv]` in mixed's
    dtype: each head's rule output, normalised and gated by `silu(z)`. The write strength is `beta_scale * sigmoid(b)`
    (OLMo Hybrid's `allow_neg_eigval`: 2, so beta in (0, 2) and the state's eigenvalues may turn negative).

    Kimi Delta Attention (Kimi Linear's linear layers): a and dt_bias `[T, Hv * Dk]` and `[Hv * Dk]`, a decay per key
    channel (`g = -exp(A_log[head]) * softplus(a + dt_bias)`, each head's Dk values), and with `sigmoid_gate` the
    norm gated by `sigmoid(z)`. A nonzero `decay_bound` (Ling 3's safe gate, negative) bounds the decay instead:
    `g = decay_bound * sigmoid(exp(A_log[head]) * (a + dt_bias))`, within (decay_bound, 0)."""
    tokens, channels = mixed.shape
    value_heads = b.shape[1]
    dv = z.shape[1] // value_heads
    dk = (channels - value_heads * dv) // (2 * key_heads)
    taps = conv_weight.shape[-1]
    weight = conv_weight.reshape(channels, taps)
    conv_size = (taps - 1) * channels
    conv_states = states[:, :conv_size].view(-1, taps - 1, channels)
    matrices = states[:, conv_size:].view(-1, value_heads, dk, dv)
    convolved = convolve(mixed, weight, conv_states, slots, query_lens, fresh, silu=True)
    q, k, v = convolved.split([key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    per_channel = a.shape[1] != value_heads  # a decay per key channel
    rate = a_log.float().exp()[:, None] if per_channel else a_log.float().exp()
    shifted = a.float() + dt_bias
    shifted = shifted.view(tokens, value_heads, dk) if per_channel else shifted
    g = decay_bound * torch.sigmoid(rate * shifted) if decay_bound else -rate * F.softplus(shifted)
    core = gated_delta_rule(
        q.reshape(tokens, key_heads, dk), k.reshape(tokens, key_heads, dk), v.reshape(tokens, value_heads, dv),
        g, b.sigmoid().float() * beta_scale, matrices, slots, query_lens, fresh,
    )  # fmt: skip
    normed = gated_norm(core.to(mixed.dtype), z.reshape(tokens, value_heads, dv), norm_weight, eps, sigmoid_gate)
    return normed.reshape(tokens, value_heads * dv)
