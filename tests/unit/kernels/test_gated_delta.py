"""Gated DeltaNet's ops (`ladle_kernels.gated_delta`, Qwen3-Next and Qwen3.5; Kimi Delta Attention's decay per key
channel and sigmoid gate, Kimi Linear's): the reference against transformers' own functions, the C++ layer core and
output gate against the reference, and what makes the CPU path batch-invariant: a sequence's output is the same bits
alone, batched and prefilled in chunks of any size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ladle_kernels import cpu_ops as cpu
from ladle_kernels import reference
from ladle_kernels.causal_conv import causal_conv1d
from ladle_kernels.gated_delta import gated_delta_chunk, gated_delta_step, prepare_qk

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
KEY_HEADS, VALUE_HEADS = 2, 4
TAPS = 4


def inputs(tokens: int, dk: int = 16, dv: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g (log decays in [-2, 0)) and beta `[T, Hv]`."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, KEY_HEADS, dk, generator=gen) for _ in range(2))
    v = torch.randn(tokens, VALUE_HEADS, dv, generator=gen)
    g = -2 * torch.rand(tokens, VALUE_HEADS, generator=gen)
    beta = torch.rand(tokens, VALUE_HEADS, generator=gen)
    return q, k, v, g, beta


class Layer:
    """A layer's random weights and a step's inputs (`in_proj`'s output split as the layer splits it)."""

    def __init__(
        self, tokens: int, dk: int, dv: int, seed: int = 0, beta_scale: float = 1.0, kimi: bool = False,
        decay_bound: float = 0.0,
    ) -> None:
        """`kimi`: Kimi Delta Attention's a decay per key channel (a and dt_bias Dk values per head) and its norm
        gated by sigmoid; `decay_bound`: Ling 3's safe gate (its decay bounded below)."""
        gen = torch.Generator().manual_seed(seed)
        self.dk, self.dv, self.beta_scale, self.kimi = dk, dv, beta_scale, kimi
        self.decay_bound = decay_bound
        self.channels = 2 * KEY_HEADS * dk + VALUE_HEADS * dv
        self.state_size = (TAPS - 1) * self.channels + VALUE_HEADS * dk * dv
        decays = VALUE_HEADS * (dk if kimi else 1)
        width = self.channels + VALUE_HEADS * dv + VALUE_HEADS + decays
        projected = torch.randn(tokens, width, generator=gen)  # the rows stay strided, as the layer's split leaves them
        self.mixed, self.z, self.b, self.a = projected.split(
            [self.channels, VALUE_HEADS * dv, VALUE_HEADS, decays], dim=-1
        )
        self.conv_weight = torch.randn(self.channels, 1, TAPS, generator=gen) * 0.5
        self.a_log = torch.rand(VALUE_HEADS, generator=gen).log()
        self.dt_bias = torch.randn(decays, generator=gen)
        self.norm_weight = 1 + 0.1 * torch.randn(dv, generator=gen)

    def states(self, slots: int = 6, seed: int = 1) -> torch.Tensor:
        return torch.randn(slots, self.state_size, generator=torch.Generator().manual_seed(seed)) * 0.1

    def run(self, op: Any, chunks: list[tuple[int, slice, bool]], states: torch.Tensor) -> torch.Tensor:
        """One step of `op` over `chunks` ((slot, that sequence's token span, fresh) each, in order)."""
        spans = [span for _, span, _ in chunks]
        picked = [torch.cat([t[span] for span in spans]) for t in (self.mixed, self.z, self.a, self.b)]
        out: torch.Tensor = op(
            *picked, self.conv_weight, self.a_log, self.dt_bias, self.norm_weight, 1e-6, KEY_HEADS, states,
            [slot for slot, _, _ in chunks], [span.stop - span.start for span in spans],
            [fresh for _, _, fresh in chunks], self.beta_scale, self.kimi, self.decay_bound,
        )  # fmt: skip
        return out


def test_the_reference_forms_equal_transformers_functions() -> None:
    """The chunked form over 150 tokens (two whole chunks and a partial one, split anywhere) and the one-token form
    give transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` outputs and states.
    Their q and k come with each key head repeated for its value heads, as transformers' layer gives them: the
    functions of older versions (5.17) take no fewer key heads. The order of the repeat is held by the models' tests."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = inputs(150)
    q, k = (t.repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=1) for t in (q, k))
    theirs, their_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    qn, kn = prepare_qk(q, k, VALUE_HEADS)
    zero = torch.zeros(VALUE_HEADS, 16, 8)
    out, state = gated_delta_chunk(qn, kn, v, g, beta, zero)
    torch.testing.assert_close(out, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, their_state[0], atol=1e-5, rtol=1e-5)
    first, carried = gated_delta_chunk(qn[:70], kn[:70], v[:70], g[:70], beta[:70], zero)
    rest, state = gated_delta_chunk(qn[70:], kn[70:], v[70:], g[70:], beta[70:], carried)
    torch.testing.assert_close(torch.cat((first, rest)), theirs[0], atol=1e-5, rtol=1e-5)
    recurrent, _ = hf.torch_recurrent_gated_delta_rule(
        q[None, :5], k[None, :5], v[None, :5], g=g[None, :5], beta=beta[None, :5], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    state = zero[None]
    for t in range(5):
        step, state = gated_delta_step(qn[t : t + 1], kn[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
        assert torch.equal(step[0], recurrent[0, t])  # the same products and sums, in the same order


def test_the_reference_forms_with_a_decay_per_key_channel_equal_transformers_kimi_functions() -> None:
    """Kimi Delta Attention's rule: the chunked form over 40 tokens (two whole chunks of 16 and a partial one, split
    anywhere) and the one-token form give transformers' `chunk_kimi_delta_attention` /
    `recurrent_kimi_delta_attention` outputs and states, g a log decay per key channel of each head."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, _, beta = inputs(40, dv=16)
    q, k = (t.repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=1) for t in (q, k))
    g = -2 * torch.rand(40, VALUE_HEADS, 16, generator=torch.Generator().manual_seed(3))
    theirs, their_state = hf.chunk_kimi_delta_attention(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=None, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    qn, kn = prepare_qk(q, k, VALUE_HEADS)
    zero = torch.zeros(VALUE_HEADS, 16, 16)
    out, state = gated_delta_chunk(qn, kn, v, g, beta, zero)
    torch.testing.assert_close(out, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, their_state[0], atol=1e-5, rtol=1e-5)
    first, carried = gated_delta_chunk(qn[:21], kn[:21], v[:21], g[:21], beta[:21], zero)
    rest, _ = gated_delta_chunk(qn[21:], kn[21:], v[21:], g[21:], beta[21:], carried)
    torch.testing.assert_close(torch.cat((first, rest)), theirs[0], atol=1e-5, rtol=1e-5)
    recurrent, _ = hf.recurrent_kimi_delta_attention(
        q[None, :5], k[None, :5], v[None, :5], g=g[None, :5], beta=beta[None, :5], initial_state=None,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    state = zero[None]
    for t in range(5):
        step, state = gated_delta_step(qn[t : t + 1], kn[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
        torch.testing.assert_close(step[0], recurrent[0, t], atol=1e-6, rtol=1e-6)


def test_the_convolution_is_a_causal_conv1d_carrying_its_state() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 24, generator=gen)
    weight = torch.randn(24, TAPS, generator=gen)
    whole, state = causal_conv1d(x, weight, torch.zeros(TAPS - 1, 24))
    expected = F.silu(F.conv1d(x.t()[None], weight[:, None, :], padding=TAPS - 1, groups=24)[0, :, :40]).t()
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, x[-(TAPS - 1) :])
    first, carried = causal_conv1d(x[:2], weight, torch.zeros(TAPS - 1, 24))  # shorter than the state
    rest, _ = causal_conv1d(x[2:], weight, carried)
    torch.testing.assert_close(torch.cat((first, rest)), whole, atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize(("dk", "dv", "kimi", "bound"), [
    (16, 8, False, 0.0), (9, 5, False, 0.0), (32, 64, False, 0.0), (128, 128, False, 0.0), (16, 16, True, 0.0),
    (9, 5, True, 0.0), (16, 16, True, -5.0), (9, 5, True, -5.0), (16, 40, False, 0.0),
])  # fmt: skip
def test_the_kernel_matches_the_reference_on_a_mixed_step(dk: int, dv: int, kimi: bool, bound: float) -> None:
    """A fresh prompt, a continued prompt of two tokens (shorter than the convolution's history), another of 44 and
    one-token rows (one fresh), against the reference's chunked and one-token forms; both advance the states in
    place alike and leave a slot no sequence holds as it was. (9, 5): channels and value dims with scalar tails;
    (16, 40): value heads of a whole stripe of columns (32) and a part of one.
    `kimi`: Kimi Delta Attention's decay per key channel and sigmoid gate; `bound`: Ling 3's bounded decay."""
    layer = Layer(82, dk, dv, seed=2, kimi=kimi, decay_bound=bound)
    before = layer.states()
    chunks = [(4, slice(0, 30), True), (1, slice(30, 31), False), (0, slice(31, 75), False),
              (5, slice(75, 76), True), (2, slice(76, 77), False), (3, slice(77, 79), False)]  # fmt: skip
    ours_states, theirs_states = before.clone(), before.clone()
    ours = layer.run(cpu.gated_delta_net, chunks, ours_states)
    theirs = layer.run(reference.gated_delta_net, chunks, theirs_states)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_states, theirs_states, atol=1e-5, rtol=1e-5)
    chunks = [(3, slice(0, 40), False)]  # a slot left out: its state stays
    cpu_before = ours_states.clone()
    layer.run(cpu.gated_delta_net, chunks, ours_states)
    assert torch.equal(ours_states[:3], cpu_before[:3]) and torch.equal(ours_states[4:], cpu_before[4:])


@needs_kernels
def test_a_doubled_write_strength_matches_the_reference() -> None:
    """OLMo Hybrid's `allow_neg_eigval`: beta = 2 sigmoid(b), in (0, 2). The kernel equals the reference's chunked
    and one-token forms with it, and it changes the outputs and states."""
    layer = Layer(40, 16, 8, seed=6, beta_scale=2.0)
    chunks = [(0, slice(0, 30), True), (1, slice(30, 31), False), (2, slice(31, 40), False)]
    before = layer.states()
    ours_states, theirs_states, plain_states = before.clone(), before.clone(), before.clone()
    ours = layer.run(cpu.gated_delta_net, chunks, ours_states)
    torch.testing.assert_close(ours, layer.run(reference.gated_delta_net, chunks, theirs_states), atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    torch.testing.assert_close(ours_states, theirs_states, atol=1e-5, rtol=1e-5)
    layer.beta_scale = 1.0
    plain = layer.run(cpu.gated_delta_net, chunks, plain_states)
    assert not torch.allclose(plain, ours, atol=1e-3) and not torch.allclose(plain_states, ours_states, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize(("dk", "dv", "kimi", "bound"), [(16, 8, False, 0.0), (9, 5, False, 0.0), (16, 16, True, 0.0),
                                                         (16, 16, True, -5.0), (16, 40, False, 0.0)])  # fmt: skip
def test_the_kernel_gives_a_sequence_the_same_bits_alone_batched_and_chunked(
    dk: int, dv: int, kimi: bool, bound: float
) -> None:
    layer = Layer(64, dk, dv, seed=4, kimi=kimi, decay_bound=bound)
    alone_states = layer.states()
    alone = layer.run(cpu.gated_delta_net, [(2, slice(0, 40), True)], alone_states)
    batched_states = layer.states()
    batched = layer.run(cpu.gated_delta_net, [(0, slice(40, 64), True), (2, slice(0, 40), True)], batched_states)
    assert torch.equal(batched[24:], alone) and torch.equal(batched_states[2], alone_states[2])
    chunked_states = layer.states(seed=5)  # another holder's state in the slot: a fresh start ignores it
    pieces = [layer.run(cpu.gated_delta_net, [(2, slice(0, 17), True)], chunked_states)]
    pieces.append(layer.run(cpu.gated_delta_net, [(2, slice(17, 19), False)], chunked_states))
    for t in range(19, 40):  # then one token a step, beside another sequence's decode row
        step = layer.run(cpu.gated_delta_net, [(1, slice(50, 51), False), (2, slice(t, t + 1), False)],
                         chunked_states)  # fmt: skip
        pieces.append(step[1:])
    assert torch.equal(torch.cat(pieces), alone) and torch.equal(chunked_states[2], alone_states[2])


@needs_kernels
def test_the_kernel_refuses_what_does_not_add_up_and_falls_back_on_other_dtypes() -> None:
    layer = Layer(5, 16, 8)
    states = layer.states()
    with pytest.raises(RuntimeError, match=r"states must be float32 \[slots, 800\]"):
        layer.run(cpu.gated_delta_net, [(0, slice(0, 5), True)], states[:, :-1].contiguous())
    with pytest.raises(RuntimeError, match="query lengths add up to 4 tokens, not 5"):
        cpu.gated_delta_net(
            layer.mixed, layer.z, layer.a, layer.b, layer.conv_weight, layer.a_log, layer.dt_bias, layer.norm_weight,
            1e-6, KEY_HEADS, states, [0], [4], [True],
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="slot 7 is not a state row"):
        layer.run(cpu.gated_delta_net, [(7, slice(0, 5), True)], states)
    layer.mixed, layer.z = layer.mixed.to(torch.bfloat16), layer.z.to(torch.bfloat16)
    ours_states, theirs_states = states.clone(), states.clone()
    out = layer.run(cpu.gated_delta_net, [(0, slice(0, 5), True)], ours_states)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, layer.run(reference.gated_delta_net, [(0, slice(0, 5), True)], theirs_states))


@needs_kernels
@pytest.mark.parametrize("n", [64, 40, 7])
def test_the_output_gate_matches_the_reference_and_each_row_alone(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x, gate = torch.randn(9, n, generator=gen), torch.randn(9, 2 * n, generator=gen)[:, n:]
    out = cpu.sigmoid_mul(x, gate)
    torch.testing.assert_close(out, reference.sigmoid_mul(x, gate), atol=1e-6, rtol=1e-6)
    for row in range(9):
        assert torch.equal(cpu.sigmoid_mul(x[row : row + 1], gate[row : row + 1])[0], out[row])


def test_a_bounded_decay_is_ling_3s_safe_gate() -> None:
    """With a `decay_bound` the reference's decay is transformers' `BailingHybridForgetGate` (Ling 3's safe gate:
    `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`): a layer run with it equals the same layer run through the
    rule on the gate's own g, and differs from Kimi's unbounded decay."""
    from transformers import BailingHybridConfig
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridForgetGate

    dk = 16
    layer = Layer(30, dk, dk, seed=8, kimi=True, decay_bound=-5.0)
    config = BailingHybridConfig(hidden_size=VALUE_HEADS * dk, num_attention_heads=VALUE_HEADS, head_dim=dk,
                                 kda_lower_bound=-5.0)  # fmt: skip
    gate = BailingHybridForgetGate(config)
    with torch.no_grad():  # f_proj the identity, so the gate reads `a` itself
        gate.f_proj.weight.copy_(torch.eye(VALUE_HEADS * dk))
        gate.A_log.copy_(layer.a_log)
        gate.dt_bias.copy_(layer.dt_bias)
        g = gate(layer.a[None].contiguous())[0]  # [T, heads, dk]
    chunks = [(0, slice(0, 30), True)]
    bounded = layer.run(reference.gated_delta_net, chunks, layer.states())
    expected_g = -5.0 * torch.sigmoid(layer.a_log.exp()[:, None] * (layer.a + layer.dt_bias).view(30, VALUE_HEADS, dk))
    torch.testing.assert_close(g, expected_g, atol=1e-6, rtol=1e-6)
    assert bool((g > -5.0).all()) and bool((g < 0).all())
    # the same layer with a = the softplus form's inverse of g gives the same core: the bound is what the op applies
    layer.decay_bound = 0.0
    unbounded = layer.run(reference.gated_delta_net, chunks, layer.states())
    assert not torch.allclose(bounded, unbounded, atol=1e-3)
    rate = layer.a_log.exp()[:, None]
    layer.a = (torch.expm1(-g / rate).log().reshape(30, -1) - layer.dt_bias).contiguous()  # softplus^-1(-g / rate)
    torch.testing.assert_close(layer.run(reference.gated_delta_net, chunks, layer.states()), bounded, atol=1e-4,
                               rtol=1e-4)  # fmt: skip
