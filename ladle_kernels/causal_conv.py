"""Plain-torch ops of the short depthwise causal convolutions that recurrent layers run over their tokens, carrying
each sequence's last inputs from step to step: Gated DeltaNet's over q, k and v, with a SiLU
(`ladle_kernels.gated_delta`), and LFM2's over `B * x`, without one (`short_convolution`, a kernel sets' op). What every
device runs.

A sequence's convolution state between steps is its last `K - 1` inputs, `[K - 1, C]` (zeros before its first
token), for a convolution of `K` taps over `C` channels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution over tokens, then SiLU where `silu`: x `[..., T, C]` (one sequence's chunk, or
    with a leading batch dim one token per row as `[B, 1, C]`), weight `[C, K]`, state `[..., K - 1, C]` (the inputs
    before x) -> (the output `[..., T, C]` in x's dtype, the new state: the last `K - 1` inputs, state included when x
    is shorter). Each output is the taps' products summed in tap order, elementwise: the same bits whatever T or B."""
    taps = weight.shape[1]
    window = torch.cat((state.to(x.dtype), x), dim=-2)  # [..., K - 1 + T, C]
    length = x.shape[-2]
    out = window[..., :length, :] * weight[:, 0]
    for tap in range(1, taps):
        out = out + window[..., tap : tap + length, :] * weight[:, tap]
    return F.silu(out) if silu else out, window[..., window.shape[-2] - (taps - 1) :, :]


def advance_sequences(
    out: torch.Tensor,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
    chunk: Callable[[slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    rows: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Advance a step's sequences through a recurrent op, writing `out` (`[T, ...]`, returned): sequence i's
    `query_lens[i]` tokens follow each other in that order and its state is `states[slots[i]]`, advanced in place
    (from zeros where `fresh[i]`). Each longer chunk alone, `chunk(its token span, its state) -> (its output, its new
    state)`; the one-token rows together (a decode step's rows in a few ops, not a few per row), `rows(their token
    indices, their states stacked) -> (their outputs, their new states)`."""
    device = states.device
    single: list[int] = []
    starts: list[int] = []
    first = 0
    for i, count in enumerate(query_lens):
        if count == 1:
            single.append(i)
            starts.append(first)
        else:
            span = slice(first, first + count)
            before = torch.zeros_like(states[slots[i]]) if fresh[i] else states[slots[i]]
            out[span], states[slots[i]] = chunk(span, before)
        first += count
    if single:
        tokens = torch.tensor(starts, device=device)
        index = torch.tensor([slots[i] for i in single], device=device)
        before = states.index_select(0, index)
        zeroed = [j for j, i in enumerate(single) if fresh[i]]
        if zeroed:
            before.index_fill_(0, torch.tensor(zeroed, device=device), 0.0)
        step, after = rows(tokens, before)
        states.index_copy_(0, index, after.to(states.dtype))
        out.index_copy_(0, tokens, step)
    return out


def convolve(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
    silu: bool,
) -> torch.Tensor:
    """`causal_conv1d` of a step's sequences `[T, C]`, each after its state `conv_states[slots[i]]` (`[K - 1, C]`;
    zeros where `fresh[i]`), which advances (`advance_sequences`)."""

    def rows(tokens: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        convolved, after = causal_conv1d(mixed.index_select(0, tokens)[:, None, :], weight, before, silu)
        return convolved[:, 0, :], after

    return advance_sequences(
        torch.empty_like(mixed), conv_states, slots, query_lens, fresh,
        lambda span, before: causal_conv1d(mixed[span], weight, before, silu), rows,
    )  # fmt: skip


def short_convolution(
    bx: torch.Tensor,
    conv_weight: torch.Tensor,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """LFM2's convolution over one step (the kernel sets' op of that name): bx `[T, C]` (its input projection's
    `B * x`), the convolution's weight `[C, 1, K]`. Sequence i's `query_lens[i]` tokens follow each other in that
    order; its state is row `slots[i]` of `states` (`[slots, (K - 1) * C]` float32, the last `K - 1` values of
    `B * x`), zeroed first where `fresh[i]`, advanced in place. Returns the convolution `[T, C]` in bx's dtype, with
    no activation."""
    channels = bx.shape[1]
    taps = conv_weight.shape[-1]
    conv_states = states.view(-1, taps - 1, channels)
    return convolve(bx, conv_weight.reshape(channels, taps), conv_states, slots, query_lens, fresh, silu=False)


def biased_convolution(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """The Mamba layers' convolution over one step (Mamba-1's, the kernel sets' `mamba1_conv`; Mamba-2's over x, B and
    C): x `[T, C]`, the weight `[C, 1, K]` and bias `[C]` (or None); sequence i's `query_lens[i]` tokens follow each
    other in that order, its last `K - 1` inputs the first `(K - 1) * C` values of row `slots[i]` of `states`
    (`[slots, >= (K - 1) * C]` float32; zeroed first where `fresh[i]`, advanced in place). Returns
    `silu(conv(x) + bias)`, `[T, C]` in x's dtype (the bias after the taps' sum)."""
    channels, taps = x.shape[1], conv_weight.shape[-1]
    history = states[:, : (taps - 1) * channels].view(-1, taps - 1, channels)
    convolved = convolve(x, conv_weight.reshape(channels, taps), history, slots, query_lens, fresh, silu=False)
    return F.silu(convolved if conv_bias is None else convolved + conv_bias)
