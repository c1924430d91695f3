"""Mamba-2's ops (`ladle_kernels.mamba2`, Granite 4.0's hybrids): the chunked scan and the one-token step against
transformers' own functions, carrying a state across calls; the layer core's sequences the same alone, batched and
prefilled in chunks of any size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as theirs

from ladle_kernels import cpu_ops as cpu
from ladle_kernels.mamba2 import CHUNK, gated_group_norm, ssd_chunk, ssd_step
from ladle_kernels.mamba2 import mamba2_mixer as reference_mixer

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
HEADS, HEAD_DIM, STATE, GROUPS, TAPS = 4, 8, 16, 2, 4


class MixerInputs:
    """A layer's random weights and 80 tokens' inputs (`in_proj`'s output split as the layer splits it), its states
    in 4 slots (`shared`: one set kept across calls)."""

    def __init__(self, seed: int = 6) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.inner, self.channels = HEADS * HEAD_DIM, HEADS * HEAD_DIM + 2 * GROUPS * STATE
        projected = torch.randn(80, self.inner + self.channels + HEADS, generator=gen)  # strided rows, as split
        self.z, self.xbc, self.dt = projected.split([self.inner, self.channels, HEADS], dim=-1)
        self.conv_weight = torch.randn(self.channels, 1, TAPS, generator=gen) * 0.5
        self.conv_bias = torch.randn(self.channels, generator=gen) * 0.1
        self.a_log, self.dt_bias = torch.rand(HEADS, generator=gen).log(), torch.randn(HEADS, generator=gen)
        self.d, self.norm_weight = torch.randn(HEADS, generator=gen), 1 + 0.1 * torch.randn(self.inner, generator=gen)
        self.size = (TAPS - 1) * self.channels + HEADS * HEAD_DIM * STATE
        self.shared = torch.zeros(4, self.size)

    def run(
        self, op: Any, spans: list[slice], slots: list[int], fresh: list[bool], states: torch.Tensor | None = None,
        bias: bool = True, norm: bool = True,
    ) -> torch.Tensor:
        """One step of `op` over the sequences `spans` (token spans) in `slots`, from zeroed states unless given."""
        picked = [torch.cat([t[span] for span in spans]) for t in (self.xbc, self.z, self.dt)]
        out: torch.Tensor = op(
            *picked, self.conv_weight, self.conv_bias if bias else None, self.a_log, self.dt_bias, self.d,
            self.norm_weight if norm else None, 1e-5, GROUPS, torch.zeros(4, self.size) if states is None else states,
            slots, [span.stop - span.start for span in spans], fresh,
        )  # fmt: skip
        return out


def scan_inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x `[T, H, P]`, dt `[T, H]` (after softplus), a `[H]`, b and c `[T, G, N]`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    dt = F.softplus(torch.randn(tokens, HEADS, generator=gen))
    a = -torch.rand(HEADS, generator=gen) * 2
    b, c = (torch.randn(tokens, GROUPS, STATE, generator=gen) for _ in range(2))
    return x, dt, a, b, c


def per_head(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(HEADS // GROUPS, dim=1)


@pytest.mark.parametrize("tokens", [5, CHUNK + 11])
def test_the_chunked_scan_equals_transformers_carrying_its_state(tokens: int) -> None:
    """`ssd_chunk` over a run (one chunk, or two), from a nonzero state, equals transformers' `mamba2_chunk_scan`
    (output and final state); the run split in two with the state carried gives the same."""
    x, dt, a, b, c = scan_inputs(tokens)
    start = torch.randn(HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(3)) * 0.3
    expected, final = theirs.mamba2_chunk_scan(
        x[None], dt[None], a, b[None], c[None], chunk_size=16, initial_states=start[None], return_final_states=True
    )
    out, state = ssd_chunk(x, dt, a, per_head(b), per_head(c), start)
    torch.testing.assert_close(out, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, final[0], atol=1e-4, rtol=1e-4)
    first, carried = ssd_chunk(x[:3], dt[:3], a, per_head(b[:3]), per_head(c[:3]), start)
    rest, state = ssd_chunk(x[3:], dt[3:], a, per_head(b[3:]), per_head(c[3:]), carried)
    torch.testing.assert_close(torch.cat([first, rest]), expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, final[0], atol=1e-4, rtol=1e-4)


def test_the_one_token_step_equals_transformers_state_update() -> None:
    """`ssd_step` on a batch of rows equals transformers' `mamba2_selective_state_update` (its `D` term aside)."""
    x, dt, a, b, c = scan_inputs(3)
    start = torch.randn(3, HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(4)) * 0.3
    state = start.clone()
    expected = theirs.mamba2_selective_state_update(
        state, x, dt[..., None].expand(-1, -1, HEAD_DIM), a[:, None, None].expand(-1, HEAD_DIM, STATE), b, c
    )
    out, ours = ssd_step(x, dt, a, per_head(b), per_head(c), start)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, state, atol=1e-5, rtol=1e-5)


def test_the_gated_norm_is_transformers() -> None:
    """The gate before the norm, the statistic over each group (`GraniteMoeHybridRMSNormGated`)."""
    gen = torch.Generator().manual_seed(5)
    x, gate = torch.randn(3, HEADS * HEAD_DIM, generator=gen), torch.randn(3, HEADS * HEAD_DIM, generator=gen)
    norm = theirs.GraniteMoeHybridRMSNormGated(HEADS * HEAD_DIM, group_size=HEADS * HEAD_DIM // GROUPS, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        expected = norm(x, gate)
    torch.testing.assert_close(gated_group_norm(x, gate, norm.weight, 1e-5, GROUPS), expected)


def test_a_sequence_is_the_same_alone_batched_and_in_chunks() -> None:
    """The layer core: three sequences in one step (a prefill, a decode row, another prefill) equal each alone, and a
    sequence prefilled over a step, then decoded a token a step, equals it whole, the convolution's and the scan's
    states carried in its slot."""
    layer = MixerInputs()
    spans = [slice(0, 6), slice(6, 7), slice(7, 12)]
    alone = [layer.run(reference_mixer, [span], [0], [True]) for span in spans]
    batched = layer.run(reference_mixer, spans, [2, 0, 3], [True, True, True])
    torch.testing.assert_close(batched, torch.cat(alone), atol=1e-5, rtol=1e-5)
    steps = [layer.run(reference_mixer, [span], [1], [span.start == 0], states=layer.shared)
             for span in (slice(0, 4), slice(4, 5), slice(5, 6))]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps), alone[0], atol=1e-5, rtol=1e-5)


@needs_kernels
def test_the_cpu_kernel_equals_the_reference_and_is_batch_invariant() -> None:
    """The C++ core (`ladle_kernels/cpu/mamba2.cpp`) equals the reference on a step of a prefill, a decode row and
    another prefill; a sequence's output is the same bits alone, batched and prefilled in chunks of any size (the
    reference's chunked form is not); a convolution without a bias is served too, and without a norm weight the
    output is the gate's alone (for groups split over ranks)."""
    layer = MixerInputs()
    spans = [slice(0, 70), slice(70, 71), slice(71, 80)]
    expected = layer.run(reference_mixer, spans, [2, 0, 3], [True, True, True])
    ours = layer.run(cpu.mamba2_mixer, spans, [2, 0, 3], [True, True, True])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    alone = layer.run(cpu.mamba2_mixer, spans[:1], [1], [True])
    steps = [layer.run(cpu.mamba2_mixer, [span], [1], [span.start == 0], states=layer.shared)
             for span in (slice(0, 30), slice(30, 31), slice(31, 70))]  # fmt: skip
    assert torch.equal(ours[:70], alone) and torch.equal(torch.cat(steps), alone)
    unbiased = layer.run(cpu.mamba2_mixer, spans, [2, 0, 3], [True, True, True], bias=False)
    torch.testing.assert_close(unbiased, layer.run(reference_mixer, spans, [2, 0, 3], [True] * 3, bias=False),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    gated = layer.run(cpu.mamba2_mixer, spans, [2, 0, 3], [True] * 3, norm=False)
    torch.testing.assert_close(gated, layer.run(reference_mixer, spans, [2, 0, 3], [True] * 3, norm=False),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
