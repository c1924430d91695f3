"""The C++ decode stack runs a quantized model's steps (prompt tokens as decode rows of their own) with the very
kernels, in the very order, of the layers: its hidden states and tokens equal theirs bit for bit (projections and
banks of experts in 4-, 5-, 6- and 8-bit and K-quant blocks), LoRA adapters' rows too, and it steps aside where it
does not apply."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine_server.config import LoraConfig, ModelConfig
from engine_server.core.request import Request
from engine_server.core.scheduler import Scheduler
from engine_server.hf_config import model_config_from_hf
from engine_server.layers.decode_stack import build_decode_stack
from engine_server.layers.lowbit_weight import LowBitWeight, decode_blocks
from engine_server.layers.quantized_experts import QuantizedExperts
from engine_server.layers.quantized_linear import QuantizedLinear, concat_rows, quantize_q8
from engine_server.lora.peft_format import LoraAdapter, LoraPiece
from engine_server.lora.targets import MLP_PROJECTIONS, module_targets
from engine_server.model_loading import load_model
from engine_server.model_runner import ModelRunner
from ladle_kernels import cpu_ops as cpu
from tests.lowbit_blocks import random_blocks
from tests.unit.kernels.test_quant_moe import random_bank
from tests.unit.runner_factories import (
    MAX_MODEL_LEN,
    TINY_LLAMA,
    Lockstep,
    greedy_request,
    make_lockstep,
    tiny_engine_config,
)
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




def _from_hf(model_type: str, **quirks: Any) -> ModelConfig:
    """A `model_type` model of TINY_LLAMA's shape (3 layers), read from its Hugging Face config with `quirks` (a
    Gemma's query scale by `query_pre_attn_scalar`)."""
    shape = {"vocab_size": TINY_LLAMA.vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
             "query_pre_attn_scalar": 24}  # fmt: skip
    return dataclasses.replace(model_config_from_hf({"model_type": model_type, **shape, **quirks}), name=model_type)


# Gemma 1's GeGLU and scaled embeddings; Gemma 2's sandwich norms, windows and soft-capped scores; Gemma 3's q/k
# norms and its windowed layers' own rope base beside the full layers' linearly scaled one.
TINY_GEMMA = _from_hf("gemma")
TINY_GEMMA2 = _from_hf("gemma2", sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=30.0)
TINY_GEMMA3 = _from_hf(
    "gemma3_text", sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
)  # fmt: skip

# Phi-3's rope over half of each head under LongRoPE (its long factors past 16 tokens: the later steps' rows);
# SmolLM3's NoPE layer (the second); Granite's embedding, residual and attention multipliers.
TINY_PHI3 = _from_hf(
    "phi3", partial_rotary_factor=0.5, original_max_position_embeddings=16,
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0, 5.0, 7.0, 9.0]},
)  # fmt: skip
TINY_SMOLLM3 = _from_hf("smollm3", no_rope_layers=[1, 0, 1])
TINY_GRANITE = _from_hf(
    "granite", embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25, logits_scaling=8.0
)

# HyperCLOVA X SEED's block: Gemma's sandwich norms with Granite's residual multiplier (each output normalised, then
# scaled before its residual add).
TINY_SANDWICH_SCALED = dataclasses.replace(TINY_GEMMA2, residual_multiplier=0.5, name="sandwich-scaled")

# Ministral 3: YaRN and Llama 4's query temperature by position over its 16-token original context (the later steps'
# queries scaled).
TINY_MINISTRAL3 = _from_hf(
    "ministral3",
    rope_parameters={"type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                     "llama_4_scaling_beta": 0.5},
)  # fmt: skip

# Cohere's parallel blocks under one LayerNorm each (Command R), and Command R7B's: windows on three layers in four
# with rope, NoPE on the full ones.
TINY_COHERE = _from_hf("cohere", logit_scale=0.5)
TINY_COHERE2 = _from_hf(
    "cohere2", sliding_window=8, logit_scale=0.5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)  # fmt: skip

# OLMo 2's post-norm blocks (q/k norms over the whole projection), OLMo 3's with windows on two layers in three.
TINY_OLMO2 = _from_hf("olmo2")
TINY_OLMO3 = _from_hf(
    "olmo3", sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"]
)


class CountingStack:
    """Forwards to a DecodeStack, counting the steps it ran and keeping each one's `lora_segments` (None: a step
    without adapters)."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.steps = stack, 0
        self.lora_segments: list[int | None] = []

    def forward(self, *args: Any) -> torch.Tensor:
        self.steps += 1
        self.lora_segments.append(args[8] if len(args) > 8 and args[7] is not None else None)
        result: torch.Tensor = self.stack.forward(*args)
        return result


def int8_runner(model: ModelConfig) -> ModelRunner:
    config = dataclasses.replace(tiny_engine_config(), quantization="int8")
    return ModelRunner(load_model(source_of(model), config, MAX_MODEL_LEN))


@pytest.mark.parametrize(
    "model",
    [TINY_LLAMA, TINY_QWEN2, TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN2_MOE, TINY_OLMOE, TINY_GEMMA, TINY_GEMMA2,
     TINY_GEMMA3, TINY_PHI3, TINY_SMOLLM3, TINY_GRANITE, TINY_SANDWICH_SCALED,
     TINY_MINISTRAL3, TINY_COHERE, TINY_COHERE2, TINY_OLMO2, TINY_OLMO3],
    ids=["llama", "qwen2-bias", "qwen3-qk-norms", "qwen3-moe", "qwen2-moe-shared", "olmoe", "gemma", "gemma2",
         "gemma3", "phi3-partial-longrope", "smollm3-nope", "granite-multipliers", "hyperclovax-sandwich-scaled",
         "ministral3-temperature", "cohere-parallel", "cohere2-windows-nope", "olmo2-post-norm", "olmo3-windows"],
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


def lowbit_moe_runner() -> ModelRunner:
    """`int8_runner` of a Qwen3-MoE 256 wide whose banks of experts are swapped for a Q4_K_M file's kinds (layer 0:
    gate/up Q4_K, down Q6_K; layer 1: gate/up Q5_0, down Q5_K), drawn from a fixed seed; the decode stack rebuilt
    over them."""
    model = dataclasses.replace(TINY_QWEN3_MOE, hidden_size=256, moe_intermediate_size=256, name="tiny-lowbit-moe")
    runner = int8_runner(model)
    decoder = runner.model.model
    gen = torch.Generator().manual_seed(0)
    for layer, (gate_up, down) in zip(decoder.layers, [("q4_k", "q6_k"), ("q5_0", "q5_k")], strict=True):
        layer.mlp.experts = QuantizedExperts(random_bank(4, 256, 256, gate_up, down, gen))
    decoder.decode_stack = build_decode_stack(decoder)
    return runner


def test_lowbit_experts_equal_the_layers_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    reference, candidate = lowbit_moe_runner(), lowbit_moe_runner()
    assert candidate.model.model.decode_stack is not None
    assert [layer.mlp.experts.format for layer in candidate.model.model.layers] == ["q4_k+q6_k", "q5_0+q5_k"]
    reference.model.model.decode_stack = None
    counting = CountingStack(candidate.model.model.decode_stack)
    candidate.model.model.decode_stack = counting
    lockstep = make_lockstep(reference, candidate, tiny_engine_config(), monkeypatch)
    requests = [greedy_request(f"r{i}", prompt_len=4 + 5 * i, max_tokens=10 + i) for i in range(4)]
    steps = lockstep.run(requests, late={3: [greedy_request("late", prompt_len=14, max_tokens=5)]})
    assert counting.steps == len(steps) > 10
    assert any(not step.decode_only for step in steps[1:])  # prompt tokens beside decode rows
    for step in steps:
        assert step.tokens[0] == step.tokens[1]
        assert torch.equal(step.hidden[0], step.hidden[1])


QV = ("self_attn.q_proj", "self_attn.v_proj")
EVERY_MODULE = (*QV, "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
O_AND_UP = ("self_attn.o_proj", "mlp.up_proj")


def random_adapter(model: ModelConfig, name: str, modules: tuple[str, ...], rank: int, seed: int) -> LoraAdapter:
    """An adapter of `rank` on `modules` of every layer (an MLP's modules only where the MLP is dense), its weights
    drawn from `seed` and large enough to change the greedy tokens."""
    gen = torch.Generator().manual_seed(seed)
    pieces = []
    for layer in range(model.num_hidden_layers):
        for module in modules:
            target = module_targets(model, layer)[module]
            if target.projection in MLP_PROJECTIONS and model.is_moe_layer(layer):
                continue
            a = torch.randn(rank, target.in_features, generator=gen) * 0.3
            b = torch.randn(target.out_features, rank, generator=gen) * 0.3
            pieces.append(LoraPiece(layer, target, a, b))
    short = tuple(module.rsplit(".", 1)[-1] for module in modules)
    return LoraAdapter(name, name, f"{name}-key", rank, short, tuple(pieces))


def adapter_request(request_id: str, prompt: list[int], max_tokens: int, adapter: LoraAdapter | None) -> Request:
    params = greedy_request(request_id, 1, max_tokens).sampling_params
    return Request(request_id, prompt, params, max_model_len=MAX_MODEL_LEN, lora=adapter)


@pytest.mark.parametrize("model", [TINY_LLAMA, TINY_QWEN2_MOE], ids=["llama", "qwen2-moe-shared"])
@pytest.mark.parametrize("every_segment", [False, True], ids=["changed-segments", "every-segment"])
def test_steps_with_lora_adapters_equal_the_layers_bit_for_bit(
    model: ModelConfig, every_segment: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapters on q/v only, on every module and on o/up (segments skipped), ranks under the slots', rows of the
    base model beside them, two slots for three adapters (slots reloaded between steps, in place: the stack reads
    the slots' own tensors), prompt tokens beside decode rows; with `every_segment`, every segment runs on every
    step, as in a decode graph (`LoraBatch.changed` None)."""
    config = dataclasses.replace(
        tiny_engine_config(), quantization="int8", lora=LoraConfig(max_loras=2, max_lora_rank=8)
    )
    reference, candidate = (ModelRunner(load_model(source_of(model), config, MAX_MODEL_LEN)) for _ in range(2))
    assert candidate.lora_slots is not None and candidate.model.model.decode_stack_lora is candidate.lora_slots
    reference.model.model.decode_stack = None
    counting = CountingStack(candidate.model.model.decode_stack)
    candidate.model.model.decode_stack = counting
    if every_segment:
        for runner in (reference, candidate):
            monkeypatch.setattr(runner.lora_slots, "changed_by", lambda slots: None)
    qv, every, o_up = (
        random_adapter(model, "qv", QV, 4, seed=1),
        random_adapter(model, "every", EVERY_MODULE, 8, seed=2),
        random_adapter(model, "o-up", O_AND_UP, 3, seed=3),
    )
    prompt = [(7 * i + 3) % 256 for i in range(6)]
    requests = [
        adapter_request("base", prompt, 12, None),
        adapter_request("every", prompt, 5, every),  # done early: later steps run q/v and o/up alone
        adapter_request("qv", prompt[:4], 14, qv),
        adapter_request("o-up", prompt[1:], 8, o_up),  # waits for a slot, then takes every's
        adapter_request("qv-2", prompt[::-1] * 2, 10, qv),
    ]
    scheduler = Scheduler(config.scheduler, config.cache, reference.num_blocks, MAX_MODEL_LEN, lora_slots=2)
    lockstep = Lockstep(reference, candidate, scheduler, monkeypatch)
    steps = lockstep.run(requests, late={3: [adapter_request("late", prompt * 2, 6, o_up)]})
    assert counting.steps == len(steps) > 10
    assert any(not step.decode_only for step in steps[1:])  # prompt tokens beside decode rows
    for step in steps:
        assert step.tokens[0] == step.tokens[1]
        assert torch.equal(step.hidden[0], step.hidden[1])
    masks = [mask for mask in counting.lora_segments if mask is not None]
    assert len(masks) > 10  # steps with adapters' rows ran in the stack
    if every_segment:
        assert set(masks) == {-1}
    else:  # each step ran the segments of its adapters alone
        assert -1 not in masks and len(set(masks)) > 2
    generated = {rid: [step.tokens[0][rid] for step in steps if rid in step.tokens[0]] for rid in ("base", "every")}
    assert generated["base"][:5] != generated["every"]  # the adapters change the tokens: the equality says something


def test_models_it_does_not_cover_keep_the_layers() -> None:
    sinks = dataclasses.replace(TINY_LLAMA, attention_sinks=True, name="sinks")  # (gpt-oss's)
    assert int8_runner(sinks).model.model.decode_stack is None
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
    with pytest.raises(RuntimeError, match="holds no adapters"):
        stack.forward(hidden, positions, runner.kv_caches, tables, lens, torch.zeros(2, dtype=torch.long), None,
                      torch.zeros(2, dtype=torch.long))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    a, b = torch.zeros(2, 8, TINY_LLAMA.hidden_size), torch.zeros(2, 8, TINY_LLAMA.hidden_size)
    with pytest.raises(RuntimeError, match="columns"):  # o_proj has hidden_size output columns, not 2 x hidden_size
        stack.set_lora(0, 1, a, [b], [TINY_LLAMA.hidden_size], [0], 8)
