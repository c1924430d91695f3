"""Mamba-1's selective scan (Jamba's, Mamba's and Falcon Mamba's mixer): the reference against transformers' own slow
scan, and the C++ kernels (`ladle_kernels/cpu/mamba1.cpp`: the scan and the convolution before it) against the
reference, the same bits for a sequence alone, batched and prefilled in chunks of any size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ladle_kernels import cpu_ops as cpu
from ladle_kernels.causal_conv import biased_convolution as reference_conv
from ladle_kernels.mamba1 import mamba1_scan as reference_scan

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
CHANNELS, STATE = 40, 19  # a block and a part of one; 16 lanes and a scalar tail
TOKENS = 80


class ScanInputs:
    """A layer's random A and D and 80 tokens' inputs as the layer hands them over (x, the gate z and the time step
    from strided splits of one projection, B and C of another), its rows in 4 slots (`shared`: kept across calls)."""

    def __init__(self, seed: int = 3, state: int = STATE) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.state = state
        x, z, dt = torch.randn(TOKENS, 3 * CHANNELS, generator=gen).split(CHANNELS, dim=-1)
        self.x, self.z, self.dt = x.contiguous(), z, F.softplus(dt)
        self.b, self.c = torch.randn(TOKENS, 2 * state, generator=gen).split(state, dim=-1)
        self.a = -torch.rand(CHANNELS, state, generator=gen).mul(4).exp()  # decays from ~1 to ~0 per step
        self.d = torch.randn(CHANNELS, generator=gen)
        self.shared = torch.zeros(4, CHANNELS * state + 7)[:, 7:]  # a view with a row stride past its width

    def run(self, op: Any, spans: list[slice], slots: list[int], fresh: list[bool],
            states: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """One step of `op` over the sequences `spans` in `slots`, from zeroed states unless given."""
        x, z, dt, b, c = (torch.cat([t[span] for span in spans]) for t in (self.x, self.z, self.dt, self.b, self.c))
        states = torch.zeros(4, CHANNELS * self.state) if states is None else states
        out: torch.Tensor = op(x, dt, self.a, b, c, self.d, z, states, slots,
                               [span.stop - span.start for span in spans], fresh)  # fmt: skip
        return out


def transformers_scan(inputs: ScanInputs) -> torch.Tensor:
    """transformers' MambaMixer slow path's scan over all 80 tokens of one sequence, gated: `exp(dt A)`, `dt B x`,
    then each token's state read out by C, plus `D x`, times `silu(z)`."""
    decay = torch.exp(inputs.dt[:, :, None] * inputs.a[None])  # [T, E, N]
    pushed = inputs.dt[:, :, None] * inputs.b[:, None, :] * inputs.x[:, :, None]
    state = torch.zeros(CHANNELS, inputs.state)
    outputs = []
    for t in range(TOKENS):
        state = decay[t] * state + pushed[t]
        outputs.append(state @ inputs.c[t])
    return (torch.stack(outputs) + inputs.x * inputs.d) * F.silu(inputs.z)


def test_the_reference_equals_transformers_and_carries_its_state() -> None:
    """The reference over a whole sequence equals transformers' scan; prefilled over a step, then decoded a token a
    step beside another sequence, it is the same, its rows carried in its slot."""
    inputs = ScanInputs()
    whole = inputs.run(reference_scan, [slice(0, TOKENS)], [1], [True])
    torch.testing.assert_close(whole, transformers_scan(inputs), atol=1e-5, rtol=1e-5)
    steps = [inputs.run(reference_scan, [span], [2], [span.start == 0], states=inputs.shared)
             for span in (slice(0, 50), slice(50, 51), slice(51, TOKENS))]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("state", [STATE, 16])
def test_the_cpu_kernel_equals_the_reference_and_is_batch_invariant(state: int) -> None:
    """The C++ scan equals the reference on a step of a prefill, a decode row and another prefill (states of 19
    entries, lanes and a tail, and of 16, lanes alone); a sequence's output is the same bits alone, batched and
    prefilled in chunks of any size, its rows carried in a strided view of its slot."""
    inputs = ScanInputs(state=state)
    spans = [slice(0, 70), slice(70, 71), slice(71, TOKENS)]
    expected = inputs.run(reference_scan, spans, [2, 0, 3], [True, True, True])
    ours = inputs.run(cpu.mamba1_scan, spans, [2, 0, 3], [True, True, True])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    alone = inputs.run(cpu.mamba1_scan, spans[:1], [1], [True])
    shared = torch.zeros(4, CHANNELS * state + 7)[:, 7:]
    steps = [inputs.run(cpu.mamba1_scan, [span], [1], [span.start == 0], states=shared)
             for span in (slice(0, 30), slice(30, 31), slice(31, 70))]  # fmt: skip
    assert torch.equal(ours[:70], alone) and torch.equal(torch.cat(steps), alone)
    # Fresh clears only its own rows: a slot left with another's state gives the same bits.
    assert torch.equal(inputs.run(cpu.mamba1_scan, spans[:1], [1], [True], states=torch.randn(4, CHANNELS * state)),
                       alone)  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("bias", [True, False])
def test_the_cpu_convolution_equals_the_reference_and_is_batch_invariant(bias: bool) -> None:
    """The C++ convolution (4 taps over 40 channels, with and without a bias, then SiLU) equals the reference on a
    step of a prefill, a decode row and another prefill, each history read from and left in the first values of its
    slot's row (the scan's rows after them untouched); a sequence's output is the same bits alone, batched and in
    chunks."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, 2 * CHANNELS, generator=gen)[:, :CHANNELS]  # strided rows, as split from in_proj
    weight = torch.randn(CHANNELS, 1, 4, generator=gen) * 0.5
    conv_bias = torch.randn(CHANNELS, generator=gen) if bias else None
    spans, slots = [slice(0, 70), slice(70, 71), slice(71, TOKENS)], [2, 0, 3]

    def run(op: Any, spans: list[slice], slots: list[int], fresh: list[bool], states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = op(torch.cat([x[span] for span in spans]), weight, conv_bias, states, slots,
                               [span.stop - span.start for span in spans], fresh)  # fmt: skip
        return out

    theirs, ours = torch.rand(4, 3 * CHANNELS + 5), torch.zeros(4, 3 * CHANNELS + 5)
    ours.copy_(theirs)
    expected = run(reference_conv, spans, slots, [False, True, False], theirs)
    got = run(cpu.mamba1_conv, spans, slots, [False, True, False], ours)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours[:, 3 * CHANNELS :], theirs[:, 3 * CHANNELS :])
    batched = run(cpu.mamba1_conv, spans, slots, [True] * 3, torch.rand(4, 3 * CHANNELS))
    alone = run(cpu.mamba1_conv, spans[:1], [1], [True], torch.rand(4, 3 * CHANNELS))
    shared = torch.zeros(4, 3 * CHANNELS)
    steps = [run(cpu.mamba1_conv, [span], [1], [span.start == 0], shared)
             for span in (slice(0, 30), slice(30, 31), slice(31, 70))]  # fmt: skip
    assert torch.equal(batched[:70], alone) and torch.equal(torch.cat(steps), alone)
