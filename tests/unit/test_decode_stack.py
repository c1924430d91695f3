"""The C++ decode stack runs a quantized model's steps (prompt tokens as decode rows of their own) with the very
kernels, in the very order, of the layers: its hidden states and tokens equal theirs bit for bit, and it steps aside
where it does not apply."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine_server.config import ModelConfig
from engine_server.layers.decode_stack import build_decode_stack
from engine_server.layers.lowbit_weight import LowBitWeight, decode_blocks
from engine_server.layers.quantized_linear import QuantizedLinear, concat_rows, quantize_q8
from engine_server.model_loading import load_model
from engine_server.model_runner import ModelRunner
from kernels import cpu_ops as cpu
from tests.lowbit_blocks import random_blocks
from tests.unit.runner_factories import MAX_MODEL_LEN, TINY_LLAMA, greedy_request, make_lockstep, tiny_engine_config
from tests.unit.runner_factories import tiny_source as source_of

pytestmark = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")

TINY_QWEN2 = dataclasses.replace(TINY_LLAMA, architecture="qwen2", attention_bias=True, name="tiny-qwen2")
TINY_QWEN3 = dataclasses.replace(TINY_LLAMA, architecture="qwen3", qk_norm=True, name="tiny-qwen3")
TINY_QWEN3_MOE = dataclasses.replace(
    TINY_LLAMA, architecture="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, norm_topk_prob=True, name="tiny-qwen3-moe",
)  # fmt: skip
# q/k norms over the whole projection, q/k/v clamped.
TINY_OLMOE = dataclasses.replace(
    TINY_QWEN3_MOE, architecture="olmoe", qk_norm_whole=True, clip_qkv=0.5, norm_topk_prob=False, name="tiny-olmoe"
)
# Every second layer sparse (layer 0 a dense MLP), a shared expert with its gate, weights not renormalised.
TINY_QWEN2_MOE = dataclasses.replace(
    TINY_LLAMA, architecture="qwen2_moe", attention_bias=True, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, dense_layers=(0,), name="tiny-qwen2-moe",
)  # fmt: skip


class CountingStack:
    """Forwards to a DecodeStack, counting the steps it ran."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.steps = stack, 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.steps += 1
        result: torch.Tensor = self.stack.forward(*args)
        return result


def int8_runner(model: ModelConfig) -> ModelRunner:
    config = dataclasses.replace(tiny_engine_config(), quantization="int8")
    return ModelRunner(load_model(source_of(model), config, MAX_MODEL_LEN))


@pytest.mark.parametrize(
    "model", [TINY_LLAMA, TINY_QWEN2, TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN2_MOE, TINY_OLMOE],
    ids=["llama", "qwen2-bias", "qwen3-qk-norms", "qwen3-moe", "qwen2-moe-shared", "olmoe"],
)  # fmt: skip
def test_every_step_equals_the_layers_bit_for_bit(model: ModelConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, candidate = int8_runner(model), int8_runner(model)
    assert candidate.model.model.decode_stack is not None
    reference.model.model.decode_stack = None
    counting = CountingStack(candidate.model.model.decode_stack)
    candidate.model.model.decode_stack = counting
    lockstep = make_lockstep(reference, candidate, tiny_engine_config(), monkeypatch)
    requests = [greedy_request(f"r{i}", prompt_len=3 + 5 * i, max_tokens=12 + i) for i in range(4)]
    steps = lockstep.run(requests, late={4: [greedy_request("late", prompt_len=9, max_tokens=6)]})
    assert counting.steps == len(steps) > 10  # every step: prefill, decode and mixed ones
    assert sum(step.decode_only for step in steps) > 10
    assert any(not step.decode_only for step in steps[1:])  # a mixed step (decode rows beside a prompt's)
    for step in steps:
        assert step.tokens[0] == step.tokens[1]
        assert torch.equal(step.hidden[0], step.hidden[1])


def lowbit_runner() -> ModelRunner:
    """`int8_runner` of a Llama whose projections are swapped for a Q4_K_M file's kinds: q/k in Q5_0 beside v in
    Q8_0 (one fused projection of two formats), o in Q5_1, gate/up in Q5_0, down in Q6_K and Q4_K (alternating),
    drawn from a fixed seed; the decode stack rebuilt over them."""
    runner = int8_runner(dataclasses.replace(TINY_LLAMA, intermediate_size=256, name="tiny-lowbit"))
    decoder = runner.model.model
    gen = torch.Generator().manual_seed(0)

    def weight(kind: str, n: int, k: int) -> LowBitWeight:
        return decode_blocks(random_blocks(kind, n, k, gen), kind)

    for i, layer in enumerate(decoder.layers):
        attention, mlp = layer.self_attn, layer.mlp
        q_rows = attention.num_heads * attention.head_dim
        kv_rows = attention.num_kv_heads * attention.head_dim
        v = quantize_q8(torch.randn(kv_rows, 64, generator=gen) * 0.1)
        qkv = concat_rows([weight("q5_0", q_rows, 64), weight("q5_0", kv_rows, 64), v])
        attention.qkv_proj = QuantizedLinear(qkv, None)
        attention.o_proj = QuantizedLinear(weight("q5_1", 64, q_rows), None)
        mlp.gate_up_proj = QuantizedLinear(weight("q5_0", 512, 64), None)
        mlp.down_proj = QuantizedLinear(weight("q6_k" if i % 2 else "q4_k", 64, 256), None)
    decoder.decode_stack = build_decode_stack(decoder)
    return runner


def test_lowbit_and_mixed_projections_equal_the_layers_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    reference, candidate = lowbit_runner(), lowbit_runner()
    assert candidate.model.model.decode_stack is not None
    assert candidate.model.model.layers[0].self_attn.qkv_proj.format == "q5_0+q8"
    reference.model.model.decode_stack = None
    counting = CountingStack(candidate.model.model.decode_stack)
    candidate.model.model.decode_stack = counting
    lockstep = make_lockstep(reference, candidate, tiny_engine_config(), monkeypatch)
    steps = lockstep.run([greedy_request(f"r{i}", prompt_len=4 + 3 * i, max_tokens=10) for i in range(3)])
    assert counting.steps == len(steps) > 8
    for step in steps:
        assert step.tokens[0] == step.tokens[1]
        assert torch.equal(step.hidden[0], step.hidden[1])


def test_models_it_does_not_cover_keep_the_layers() -> None:
    partial_rotary = dataclasses.replace(TINY_LLAMA, architecture="phi3", partial_rotary_factor=0.5, name="phi")
    assert int8_runner(partial_rotary).model.model.decode_stack is None
    float_runner = ModelRunner(load_model(source_of(TINY_LLAMA), tiny_engine_config(), MAX_MODEL_LEN))
    assert float_runner.model.model.decode_stack is None
    assert build_decode_stack(float_runner.model.model) is None


def test_bad_inputs_are_refused_before_anything_is_written() -> None:
    runner = int8_runner(TINY_LLAMA)
    stack = runner.model.model.decode_stack
    assert stack is not None
    hidden, positions = torch.ones(2, TINY_LLAMA.hidden_size), torch.zeros(2, dtype=torch.long)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        stack.forward(hidden, positions, runner.kv_caches[:1], tables, lens, torch.zeros(2, dtype=torch.long), None)
    before = [cache.clone() for cache in runner.kv_caches]
    with pytest.raises(RuntimeError, match="outside the cache"):
        stack.forward(hidden, positions, runner.kv_caches, tables, lens, torch.tensor([5, 10**9]), None)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
