"""Plain-torch ops of Mamba-1's selective scan (Jamba's Mamba layers), after its short causal convolution
(`ladle_kernels.causal_conv`): one sequence's chunk, or a batch of decode rows, at a time.

A sequence's state between steps is the convolution's last `K - 1` inputs `[K - 1, E]` and one `N`-wide row per
channel, `[E, N]` in float32 (zeros before its first token). Per channel e and token t, with `dt_t[e] > 0` (after
softplus), `A[e] = -exp(A_log[e])` (`[N]`: unlike Mamba-2's one value per head, a decay per channel and state
entry) and the token's `B_t`, `C_t` (`[N]`, shared by every channel):

    h[e] = exp(dt_t[e] A[e]) * h[e] + dt_t[e] x_t[e] B_t;   y_t[e] = h[e] . C_t + D[e] x_t[e]

`selective_scan` runs a step's sequences through it: each prefill chunk token by token (`scan_chunk`), the one-token
rows together (`scan_rows`); both leave the same state to float rounding. `mamba1_scan`, the kernel sets' op (the C++
one: `ladle_kernels/cpu/mamba1.cpp`), adds the skip `D x` and the gate `silu(z)`; the convolution before it, with
its bias and SiLU, is `causal_conv.biased_convolution` (the kernel sets' `mamba1_conv`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ladle_kernels.causal_conv import advance_sequences


def scan_rows(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x and dt `[R, E]` (dt after softplus), a `[E, N]`, b and c `[R, N]`, state `[R, E, N]`
    float32 -> (output `[R, E]` float32 without the `D` term, new state). Each row's values depend on it alone."""
    dt32 = dt.float()
    state = state * torch.exp(dt32[..., None] * a.float()) + (dt32 * x.float())[..., None] * b.float()[:, None, :]
    return read_out(state, c.float()[:, None, :]), state


def scan_chunk(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's run of T tokens: x and dt `[T, E]`, a `[E, N]`, b and c `[T, N]`, state `[E, N]` float32 ->
    (output `[T, E]` float32 without the `D` term, new state), a token at a time (the decays are per channel and
    entry: no one masked product covers a chunk as Mamba-2's scalar ones do)."""
    decay = torch.exp(dt.float()[..., None] * a.float())  # [T, E, N]
    pushed = (dt.float() * x.float())[..., None] * b.float()[:, None, :]  # [T, E, N]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        state = state * decay[t] + pushed[t]
        out[t] = read_out(state, c[t].float())
    return out, state


def read_out(state: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`state . c` over the state's last dim (`[..., E, N]` by `[..., N]` broadcast), summed entry by entry in one
    order: the same bits for a row alone, among others, or in a chunk (a reduction or a product would sum in an order
    that depends on how many rows there are)."""
    out = state[..., 0] * c[..., 0]
    for n in range(1, state.shape[-1]):
        out = out + state[..., n] * c[..., n]
    return out


def selective_scan(
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
    """One step of the scan over its sequences: x and dt `[T, E]` (dt after softplus), a `[E, N]`, b and c `[T, N]`;
    sequence i's `query_lens[i]` tokens follow each other in that order and its state is `states[slots[i]]`
    (`[slots, E, N]` float32, advanced in place; zeroed first where `fresh[i]`). Returns `[T, E]` float32 (without
    the `D` term)."""

    def rows(tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return scan_rows(x.index_select(0, tokens), dt.index_select(0, tokens), a, b.index_select(0, tokens),
                         c.index_select(0, tokens), state)  # fmt: skip

    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return advance_sequences(
        out, states, slots, query_lens, fresh,
        lambda span, state: scan_chunk(x[span], dt[span], a, b[span], c[span], state), rows,
    )  # fmt: skip


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    z: torch.Tensor,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """A Mamba-1 layer's scan over one step, gated: x, dt (after softplus) and the gate z `[T, E]`, A `[E, N]`, B and
    C `[T, N]`, D `[E]`; sequence i's `query_lens[i]` tokens follow each other in that order and its rows are row
    `slots[i]` of `states` (`[slots, E * N]` float32, the channels' rows one after another; zeroed first where
    `fresh[i]`, advanced in place). Returns `(scan + D x) * silu(z)`, `[T, E]` in x's dtype."""
    rows = states.view(states.shape[0], x.shape[1], a.shape[1])
    y = selective_scan(x, dt, a, b, c, rows, slots, query_lens, fresh) + d.float() * x.float()
    return (y * F.silu(z.float())).to(x.dtype)

